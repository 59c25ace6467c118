//! A Rust fiber that recurses past its stack: the process says which fiber overflowed, and
//! with what stack size, before it stops by the fault (no overflow handler is registered on
//! that thread, so the reserve below the stack is no recovery, only more guard). With a
//! handler, the reserve opens; a fiber that is back above it at its first safe point (deep
//! code that returned) is not told to raise, and one still deep is.

use std::process::Command;

/// Recursion the optimizer cannot flatten: each level keeps a buffer alive across the call.
#[inline(never)]
fn deep(n: u64) -> u64 {
    let buf = std::hint::black_box([n as u8; 512]);
    if n == u64::MAX {
        return 0;
    }
    deep(n + 1) + u64::from(buf[7])
}

#[test]
fn a_fiber_overflow_is_reported_before_the_process_stops() {
    if std::env::var_os("FT_OVERFLOW_CHILD").is_some() {
        let s = fibertrace_fiber::Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
            stack_size: 256 * 1024,
            ..Default::default()
        });
        s.spawn(|| {
            std::hint::black_box(deep(0));
        });
        let _ = s.run();
        unreachable!("the fiber cannot return");
    }
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_fiber_overflow_is_reported_before_the_process_stops",
            "--nocapture",
        ])
        .env("FT_OVERFLOW_CHILD", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc::SIGSEGV), "{err}");
    assert!(
        err.contains(
            "fibertrace: fiber 1 overflowed its stack of 262144 bytes (calls nested too deep); \
             the process stops\n"
        ),
        "{err}"
    );
}

/// Recurses until a local lies below `limit`; at the bottom, `at_bottom` is called with the
/// stack pointer there.
#[inline(never)]
fn down_to(limit: usize, at_bottom: &mut dyn FnMut(usize)) -> u64 {
    let buf = std::hint::black_box([1u8; 512]);
    let here = std::hint::black_box(&buf) as *const _ as usize;
    if here < limit {
        at_bottom(here);
        return u64::from(buf[3]);
    }
    down_to(limit, at_bottom) + u64::from(buf[7])
}

static OPENED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The handler: records which fiber's reserve was opened.
unsafe fn on_overflow(_ctx: usize, fid: u64) {
    OPENED.store(fid, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn a_reserve_used_and_left_before_any_safe_point_raises_nothing_and_closes() {
    use fibertrace_fiber::embed::overflow::{poll, Overflow};
    use std::sync::atomic::Ordering;
    // SAFETY: the handler only stores to an atomic; it stays valid (a plain function).
    unsafe { fibertrace_fiber::embed::overflow::set_thread_handler(Some((on_overflow, 0))) };
    let s = fibertrace_fiber::Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
        stack_size: 256 * 1024,
        ..Default::default()
    });
    let r = s.block_on(|| {
        let marker = 0u8;
        // (A local: `&0u8` would be a promoted static, not on the stack.)
        let top = std::hint::black_box(&marker) as *const u8 as usize;
        // 64 KiB into the 256 KiB reserve below the 256 KiB stack.
        let limit = top - 320 * 1024;
        let mut polls = Vec::new();
        // Deep C code that returns before any safe point: nothing to raise; the reserve
        // closes at the first poll.
        std::hint::black_box(down_to(limit, &mut |_| {}));
        let opened = OPENED.swap(0, Ordering::SeqCst);
        let sp = top;
        polls.push(poll(sp));
        polls.push(poll(sp));
        // The same depth again faults again (the reserve was closed); a safe point down
        // there is told to raise, and once back up the reserve closes.
        std::hint::black_box(down_to(limit, &mut |deep| polls.push(poll(deep))));
        let again = OPENED.swap(0, Ordering::SeqCst);
        polls.push(poll(sp));
        (opened, again, polls)
    });
    // SAFETY: removing the handler asks nothing.
    unsafe { fibertrace_fiber::embed::overflow::set_thread_handler(None) };
    let (opened, again, polls) = r.unwrap();
    assert_eq!((opened, again), (1, 1));
    assert_eq!(
        polls,
        [
            Overflow::None,
            Overflow::None,
            Overflow::Raise,
            Overflow::None
        ]
    );
}

/// A panic of the fiber that calls this.
#[inline(never)]
fn panics_here() -> u32 {
    let n = std::hint::black_box(7);
    panic!("small {n}")
}

/// A dump of every fiber, taken by the fiber that calls this.
#[inline(never)]
fn dumped_here() -> (String, u32) {
    let (t, line) = (fibertrace_fiber::dump::dump_text(), line!());
    std::hint::black_box((t, line))
}

/// A fiber with the smallest stack (`MIN_STACK_SIZE`) that panics, or takes a dump of every
/// fiber, gets its report: resolving symbols (parsing the program's debug information the
/// first time) runs on the scheduler's stack, not the fiber's, where it needed about
/// 192 KiB in a debug build and the process stopped with an overflow.
#[test]
fn a_small_fiber_stack_can_panic_and_dump() {
    if std::env::var_os("FT_SMALL_STACK_CHILD").is_some() {
        let s = fibertrace_fiber::Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
            stack_size: std::env::var("FT_STACK")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(fibertrace_fiber::MIN_STACK_SIZE),
            ..Default::default()
        });
        let out = s
            .block_on(|| {
                let dumper = fibertrace_fiber::spawn(dumped_here);
                let text = dumper.join().unwrap();
                let h = fibertrace_fiber::spawn(panics_here);
                let report = match h.join() {
                    Err(fibertrace_fiber::JoinError::Panicked(r)) => r,
                    other => panic!("{other:?}"),
                };
                (text, report)
            })
            .unwrap();
        println!("DUMPED AT {}", out.0 .1);
        println!("DUMP\n{}END", out.0 .0);
        println!("MESSAGE {}", out.1.message);
        println!("LOCATION {}", out.1.location.clone().unwrap_or_default());
        for f in out.1.backtrace.frames() {
            let name = fibertrace_core::symbolize::resolve(f)
                .and_then(|r| r.function().map(str::to_string))
                .unwrap_or_default();
            println!("FRAME {name}");
        }
        return;
    }
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_small_fiber_stack_can_panic_and_dump",
            "--nocapture",
        ])
        .env("FT_SMALL_STACK_CHILD", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    assert!(out.contains("MESSAGE small 7\n"), "{out}");
    assert!(out.contains("LOCATION fiber/tests/overflow.rs:"), "{out}");
    let frames: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("FRAME "))
        .collect();
    assert_eq!(
        frames.first().copied(),
        Some("overflow::panics_here"),
        "{out}"
    );
    // The dump shows the fiber that took it, in the function that called `dump_text`, and
    // the main fiber waiting for it.
    let line: u32 = out
        .split("DUMPED AT ")
        .nth(1)
        .and_then(|r| r.lines().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    let dump = out
        .split("DUMP\n")
        .nth(1)
        .unwrap()
        .split("END")
        .next()
        .unwrap();
    let block = |head: &str| -> Vec<String> {
        let rest = dump
            .split(head)
            .nth(1)
            .unwrap_or_else(|| panic!("{head}: {dump}"));
        rest.lines()
            .skip(1)
            .take_while(|l| l.starts_with('#'))
            .map(|l| {
                let (name, at) = l.split_once(" in ").unwrap().1.split_once(" at ").unwrap();
                let name = name.rsplit_once("+0x").map_or(name, |(n, _)| n);
                let file = at.rsplit('/').next().unwrap();
                format!("{name} {file}")
            })
            .collect()
    };
    assert_eq!(
        block("fiber 2 \"fiber2\" [running]:"),
        [format!("overflow::dumped_here overflow.rs:{line}")],
        "{dump}"
    );
    let main: Vec<String> = block("fiber 1 \"main\" [join fiber 2, ")
        .iter()
        .map(|f| f.split(' ').next().unwrap().to_string())
        .collect();
    // The runtime's frames of a join, in order; those between the first and the join may be
    // inlined away in a release build (`Fiber::wait` is).
    let all = [
        "fibertrace_fiber::sched::block",
        "fibertrace_fiber::sched::handle::Fiber::wait_inner",
        "fibertrace_fiber::sched::handle::Fiber::wait_until",
        "fibertrace_fiber::sched::handle::Fiber::wait",
        "fibertrace_fiber::sched::handle::JoinHandle<T>::join",
        "overflow::a_small_fiber_stack_can_panic_and_dump::{{closure}}",
    ];
    assert_eq!(main.first().map(String::as_str), Some(all[0]), "{dump}");
    assert_eq!(main[main.len().saturating_sub(2)..], all[4..], "{dump}");
    let mut at = 0;
    for f in &main {
        let i = all[at..].iter().position(|a| a == f);
        assert!(i.is_some(), "{f} out of order or unknown: {dump}");
        at += i.unwrap() + 1;
    }
}
