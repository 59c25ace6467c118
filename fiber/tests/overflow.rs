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
