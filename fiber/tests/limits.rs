//! Spawning is fallible: a stack that cannot be mapped is an error that says which limit was
//! hit (`try_spawn`), or a panic with that text (`spawn`), and the scheduler goes on.

use fibertrace_fiber::{Scheduler, SpawnErrorKind};

/// More address space than x86_64 Linux gives a process (47 bits): the mapping fails.
const HUGE: usize = 1 << 50;

#[test]
fn try_spawn_of_a_stack_that_cannot_be_mapped_says_why_and_the_scheduler_goes_on() {
    let sched = Scheduler::new();
    let e = match sched.builder().stack_size(HUGE).try_spawn(|| 1) {
        Err(e) => e,
        Ok(_) => panic!("a 1 PiB stack was mapped"),
    };
    assert_eq!(e.stack_size(), HUGE);
    assert_eq!(e.errno(), libc::ENOMEM);
    let limited = {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a plain query into a local.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0;
        ok && rl.rlim_cur != libc::RLIM_INFINITY
    };
    let want = if limited {
        SpawnErrorKind::AddressSpace
    } else {
        SpawnErrorKind::OutOfMemory
    };
    assert_eq!(e.kind(), want);
    if !limited {
        assert_eq!(
            e.to_string(),
            format!(
                "cannot create a fiber: out of memory for its {HUGE}-byte stack (Cannot \
                 allocate memory (os error 12); {} fiber stacks in use)",
                e.fiber_stacks()
            )
        );
    }
    // Nothing was left behind: fibers are made and run as before.
    let h = sched.try_spawn(|| 7).unwrap();
    assert_eq!(sched.block_on(move || h.join().unwrap()).unwrap(), 7);
    assert_eq!(sched.fiber_count(), 0);
}

#[test]
fn spawn_that_cannot_map_its_stack_panics_with_the_reason() {
    let sched = Scheduler::new();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sched.builder().stack_size(HUGE).spawn(|| ());
    }));
    let p = r.unwrap_err();
    let msg = p.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.starts_with("cannot create a fiber: ") && msg.contains(&format!("{HUGE}-byte stack")),
        "{msg}"
    );
    let h = sched.spawn(|| 3);
    assert_eq!(sched.block_on(move || h.join().unwrap()).unwrap(), 3);
}

#[test]
fn try_spawn_inside_a_fiber_fails_without_leaving_anything() {
    let sched = Scheduler::new();
    let n = sched
        .block_on(|| {
            let bad = fibertrace_fiber::Builder::new()
                .stack_size(HUGE)
                .try_spawn(|| ());
            assert!(bad.is_err());
            let good = fibertrace_fiber::try_spawn(|| 5).unwrap();
            good.join().unwrap()
        })
        .unwrap();
    assert_eq!(n, 5);
}

/// Under an address-space limit (`ulimit -v`), spawning until it fails leaves the rest of
/// the process room to map: the last stack that would have fit is refused, so what comes
/// after it (a thread's stack here; a Rust allocation of the main thread's, which aborts the
/// process when it fails) still fits.
#[test]
fn spawning_up_to_the_address_space_limit_leaves_room_for_the_rest() {
    if std::env::var_os("FT_AS_CHILD").is_some() {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split(' ').next().unwrap().parse().unwrap();
        let limit = pages * 4096 + (256 << 20);
        let rl = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: sets this child process's own limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
        let sched = Scheduler::new();
        let mut held = Vec::new();
        let e = loop {
            match sched.builder().stack_size(1 << 20).try_spawn(|| ()) {
                Ok(h) => held.push(h),
                Err(e) => break e,
            }
            assert!(held.len() < 1000, "256 MiB held 1,000 stacks of 1 MiB");
        };
        assert_eq!(e.kind(), SpawnErrorKind::AddressSpace, "{e}");
        // A thread with a 4 MiB stack: more than the room one more fiber stack would have
        // left (its mapping is 1.3 MiB).
        let t = std::thread::Builder::new()
            .stack_size(4 << 20)
            .spawn(|| {
                std::hint::black_box([1u8; 1 << 20])
                    .iter()
                    .map(|&b| u64::from(b))
                    .sum::<u64>()
            })
            .map(|t| t.join().unwrap());
        println!("stacks {} then a thread: {t:?}", held.len());
        println!("error: {e}");
        return;
    }
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "spawning_up_to_the_address_space_limit_leaves_room_for_the_rest",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FT_AS_CHILD", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    let stacks: usize = out
        .split("stacks ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    // 256 MiB more than the process's size, less the room kept (a sixteenth of the limit):
    // most of it went to stacks of 1.3 MiB.
    assert!((150..195).contains(&stacks), "{out}");
    assert!(out.contains(" then a thread: Ok(1048576)\n"), "{out}");
    let line = out.lines().find(|l| l.starts_with("error: ")).unwrap();
    assert!(
        line.starts_with(
            "error: cannot create a fiber: its 1048576-byte stack does not fit in the \
             address-space limit (RLIMIT_AS, ulimit -v) of "
        ) && line.contains(
            " bytes kept for the rest of the process (Cannot allocate memory (os error 12); "
        ),
        "{line}"
    );
}
