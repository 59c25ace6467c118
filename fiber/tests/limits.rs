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
