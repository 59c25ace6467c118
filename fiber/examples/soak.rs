//! A soak, not a test: a scheduler creates and cancels fibers a million times while one of its
//! fibers asks for the info (with backtraces) of every fiber over and over, and another thread
//! samples the running fiber by signal a hundred thousand times. Prints the resident memory
//! at each tenth of the run: it must stay flat (nothing grows with the number of cycles).
//!
//! ```sh
//! cargo run --release -p fibertrace-fiber --example soak            # 10^6 cycles, 10^5 samples
//! cargo run --release -p fibertrace-fiber --example soak -- 100000  # fewer cycles
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fibertrace_fiber::{registry, spawn, yield_now, Scheduler};

/// Resident memory in KiB (from /proc/self/statm).
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page / 1024
}

fn main() {
    let cycles: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let samples_wanted: u64 = (cycles / 10).max(1);
    let done = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(AtomicU64::new(0));
    let infos = Arc::new(AtomicU64::new(0));

    // The sampler thread: signals the scheduler's thread and reads back the running fiber's
    // stack, as the stall detector and the dump do.
    let sampler = {
        let done = done.clone();
        let samples = samples.clone();
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) && samples.load(Ordering::Relaxed) < samples_wanted
            {
                for s in registry::schedulers() {
                    if fibertrace_fiber::sample::sample(&s, Duration::from_millis(100)).is_some() {
                        samples.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::yield_now();
            }
        })
    };

    let t0 = Instant::now();
    let rss0 = rss_kib();
    println!("cycles {cycles}, start: rss {rss0} KiB");
    let (d, inf) = (done.clone(), infos.clone());
    Scheduler::new()
        .block_on(move || {
            // The info reader: every fiber, with resolved backtraces and parent traces.
            let reader = {
                let d = d.clone();
                spawn(move || {
                    while !d.load(Ordering::Relaxed) {
                        let all = fibertrace_fiber::info::info(&Default::default());
                        std::hint::black_box(&all);
                        inf.fetch_add(1, Ordering::Relaxed);
                        yield_now();
                    }
                })
            };
            let mut peak = 0u64;
            for i in 0..cycles {
                // A fiber that blocks, and is cancelled while blocked.
                let h = spawn(|| loop {
                    fibertrace_fiber::sleep(Duration::from_secs(3600));
                });
                yield_now();
                h.fiber().cancel();
                let _ = h.join();
                if (i + 1) % (cycles / 10).max(1) == 0 {
                    let rss = rss_kib();
                    peak = peak.max(rss);
                    println!(
                        "{:>8} cycles  {:>6.1} s  rss {rss} KiB",
                        i + 1,
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
            d.store(true, Ordering::Relaxed);
            reader.join().unwrap();
            peak
        })
        .map(|peak| {
            done.store(true, Ordering::Relaxed);
            sampler.join().unwrap();
            println!(
                "done in {:.1} s: {} signal samples, {} info passes; rss start {rss0} KiB, \
                 peak {peak} KiB, end {} KiB",
                t0.elapsed().as_secs_f64(),
                samples.load(Ordering::Relaxed),
                infos.load(Ordering::Relaxed),
                rss_kib()
            );
        })
        .unwrap();
}
