//! A fiber that yields every millisecond is never reported under a 10 ms threshold, over ten
//! seconds. Its own test binary: nothing else runs in the process meanwhile. (It failed
//! twice in many full test runs, the report not kept. One way to a false report, a run
//! preempted past the watchdog's wall mark on a loaded machine and taken for a blocked one,
//! is excluded since: `stall_preempted.rs`.)

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fibertrace_fiber::watchdog::{self, Config};
use fibertrace_fiber::{yield_now, Builder, Scheduler};

#[inline(never)]
fn work_a_millisecond() -> u64 {
    let until = Instant::now() + Duration::from_millis(1);
    let mut n = 0u64;
    while Instant::now() < until {
        n = black_box(n.wrapping_add(1));
    }
    n
}

#[test]
fn a_fiber_yielding_every_millisecond_is_never_reported() {
    let got = Arc::new(Mutex::new(Vec::new()));
    let g2 = got.clone();
    watchdog::set_handler(move |r| g2.lock().unwrap().push(format!("{r:?}")));
    watchdog::start(Config {
        threshold: Duration::from_millis(10),
        ..Config::default()
    });
    let runs = Scheduler::new()
        .block_on(|| {
            Builder::new()
                .name("polite")
                .spawn(|| {
                    let t0 = Instant::now();
                    let mut runs = 0u64;
                    while t0.elapsed() < Duration::from_secs(10) {
                        work_a_millisecond();
                        yield_now();
                        runs += 1;
                    }
                    runs
                })
                .join()
                .unwrap()
        })
        .unwrap();
    watchdog::stop();
    // (About 10,000 on an idle machine; fewer when other processes take the CPU.)
    assert!(runs > 1_000, "{runs}");
    let got = got.lock().unwrap();
    assert!(got.is_empty(), "{} reports, first: {}", got.len(), got[0]);
    // The watchdog was really watching: a run past the threshold is reported.
    let got2 = Arc::new(Mutex::new(0u32));
    let g3 = got2.clone();
    watchdog::set_handler(move |_| *g3.lock().unwrap() += 1);
    watchdog::start(Config {
        threshold: Duration::from_millis(10),
        ..Config::default()
    });
    Scheduler::new()
        .block_on(|| {
            let until = Instant::now() + Duration::from_millis(60);
            while Instant::now() < until {
                black_box(());
            }
        })
        .unwrap();
    watchdog::stop();
    assert!(*got2.lock().unwrap() >= 1);
}
