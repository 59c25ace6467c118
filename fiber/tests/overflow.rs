//! A Rust fiber that recurses past its stack: the process says which fiber overflowed, and
//! with what stack size, before it stops by the fault (no overflow handler is registered on
//! this thread, so the reserve below the stack is no recovery, only more guard).

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
