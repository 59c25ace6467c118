//! A fiber whose thread the OS keeps off the CPU (runnable, waiting for a CPU that other
//! threads hold) is not reported as blocked: off-CPU time spent waiting on a run queue is
//! told apart from time blocked in the kernel. A fiber that really blocks in the kernel for
//! as long is reported. Its own test binary: it pins threads to one CPU and lowers the
//! priority of one of them.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fibertrace_fiber::watchdog::{self, Config, Report};
use fibertrace_fiber::{Builder, Scheduler};

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: an out-pointer to a local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(
        rc,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}

/// The first CPU this process may run on.
fn some_cpu() -> usize {
    // SAFETY: as in `pin_to`; sched_getaffinity fills the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        assert_eq!(rc, 0);
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("a CPU")
    }
}

/// Whether the kernel's scheduler statistics can be read here (what the watchdog reads).
fn schedstat_readable() -> bool {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .is_ok_and(|s| s.split_ascii_whitespace().count() >= 2)
}

fn collect() -> Arc<Mutex<Vec<Report>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let g2 = got.clone();
    watchdog::set_handler(move |r| g2.lock().unwrap().push(r.clone()));
    got
}

#[test]
fn a_preempted_fiber_is_not_reported_as_blocked_and_a_blocked_one_is() {
    let threshold = Duration::from_millis(30);
    // (Its wall mark: max(4 thresholds, threshold + 200 ms) = 230 ms.)
    let got = collect();
    watchdog::start(Config {
        threshold,
        ..Config::default()
    });
    // A thread spinning on one CPU, and on the same CPU, at the lowest priority, a
    // scheduler whose fiber spins for 600 ms in one run: at nice 19 against nice 0 it gets
    // the CPU about 1.5% of the time, so the run uses ~10 ms of CPU (under the threshold)
    // and waits for the CPU the rest of the time.
    let cpu = some_cpu();
    let stop = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..1)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_to(cpu);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n = black_box(n.wrapping_add(1));
                }
                n
            })
        })
        .collect();
    let (cpu_used, wall) = std::thread::spawn(move || {
        pin_to(cpu);
        // SAFETY: setpriority on this thread (its kernel id); lowering one's own priority
        // needs no privilege.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as u32, 19) };
        assert_eq!(rc, 0, "setpriority: {}", std::io::Error::last_os_error());
        Scheduler::new()
            .block_on(|| {
                Builder::new()
                    .name("preempted")
                    .spawn(|| {
                        let (c0, t0) = (thread_cpu(), Instant::now());
                        while t0.elapsed() < Duration::from_millis(600) {
                            black_box(());
                        }
                        (thread_cpu() - c0, t0.elapsed())
                    })
                    .join()
                    .unwrap()
            })
            .unwrap()
    })
    .join()
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
    // The run really was what this test is about: far past the wall mark, little CPU.
    assert!(
        wall >= Duration::from_millis(600) && cpu_used < threshold,
        "the run took {wall:?} for {cpu_used:?} of CPU: the machine did not keep the \
         thread off the CPU as the test needs"
    );
    // A fiber blocked in the kernel as long is reported (by wall time).
    Scheduler::new()
        .block_on(|| {
            Builder::new()
                .name("blocked")
                .spawn(|| std::thread::sleep(Duration::from_millis(500)))
                .join()
                .unwrap()
        })
        .unwrap();
    watchdog::stop();
    let reports: Vec<(String, Duration)> = got
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| match r {
            Report::Stall(s) => Some((s.name.to_string(), s.running_for)),
            _ => None,
        })
        .collect();
    let named = |n: &str| reports.iter().filter(|r| r.0 == n).count();
    assert!(named("blocked") >= 1, "{reports:?}");
    if schedstat_readable() {
        assert_eq!(named("preempted"), 0, "{reports:?}");
    } else {
        // Where the wait on a run queue cannot be read, such a run is taken for a blocked
        // one (the watchdog's module doc says so).
        assert!(named("preempted") >= 1, "{reports:?}");
    }
}
