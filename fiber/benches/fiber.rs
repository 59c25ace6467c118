//! Fiber runtime costs (issue: fiber). Run: cargo bench -p fibertrace-fiber --bench fiber
//!
//! - yield ping-pong between two fibers, traced vs untraced, and bare corosensei;
//! - spawn + run of an empty fiber, with and without parent traces;
//! - info with resolved backtraces for 10,000 suspended fibers, 20 frames each.

use std::hint::black_box;
use std::time::{Duration, Instant};

use corosensei::{Coroutine, CoroutineResult};
use criterion::{criterion_group, criterion_main, Criterion};
mod shared;
use shared::{ping_pong, sched};

use fibertrace_fiber::{channel, spawn, Channel, InfoOptions, Scheduler};

fn switches(c: &mut Criterion) {
    let mut g = c.benchmark_group("yield_ping_pong");
    // One iteration = one yield of each fiber = two switches (fiber -> scheduler -> fiber
    // counts as one switch between fibers).
    g.bench_function("traced", |b| b.iter_custom(|n| ping_pong(true, n) / 2));
    g.bench_function("untraced", |b| b.iter_custom(|n| ping_pong(false, n) / 2));
    g.bench_function("bare_corosensei_resume_suspend", |b| {
        b.iter_custom(|n| {
            let mut co = Coroutine::new(move |y, ()| {
                for _ in 0..n {
                    y.suspend(());
                }
            });
            let t0 = Instant::now();
            while let CoroutineResult::Yield(()) = co.resume(()) {}
            t0.elapsed()
        })
    });
    g.finish();
}

fn spawn_run(parent_traces: bool, iters: u64) -> Duration {
    let s = sched(true, parent_traces);
    s.block_on(move || {
        // Warm the stack pool.
        spawn(|| {}).join().unwrap();
        let t0 = Instant::now();
        for _ in 0..iters {
            spawn(|| {}).join().unwrap();
        }
        t0.elapsed()
    })
    .unwrap()
}

fn spawning(c: &mut Criterion) {
    let mut g = c.benchmark_group("spawn_and_run_empty_fiber");
    g.bench_function("without_parent_traces", |b| {
        b.iter_custom(|n| spawn_run(false, n))
    });
    g.bench_function("with_parent_traces", |b| {
        b.iter_custom(|n| spawn_run(true, n))
    });
    g.finish();
}

/// Receives one message 15 calls deep; false once the channel is closed.
#[inline(never)]
fn park_deep(n: u32, ch: &Channel<u8>) -> bool {
    if n == 0 {
        return black_box(ch.recv()).is_some();
    }
    let r = park_deep(n - 1, ch);
    black_box(());
    r
}

fn info(c: &mut Criterion) {
    const FIBERS: usize = 10_000;
    let s = sched(true, true);
    let ch = channel::<u8>(1);
    for i in 0..FIBERS {
        let c = ch.clone();
        s.builder()
            .name(&format!("w{i}"))
            .stack_size(16 * 1024)
            .spawn(move || while park_deep(15, &c) {});
    }
    // Run until every fiber is parked in its receive (the scheduler reports that nothing can
    // run: a deadlock, by design here).
    assert!(s.run().is_err());
    let opts = InfoOptions::default();
    let first = s.info(&opts);
    println!(
        "info: {} fibers, {} frames each (+{} parent frames), {} stack bytes in use",
        first.len(),
        first[0].backtrace.as_ref().unwrap().len(),
        first[0]
            .parent_backtrace
            .iter()
            .map(|p| p.frames.len())
            .sum::<usize>(),
        first[0].stack_used
    );
    let mut g = c.benchmark_group("info_10000_suspended_fibers");
    g.sample_size(10);
    g.bench_function("resolved_backtraces", |b| {
        b.iter(|| black_box(s.info(&opts)))
    });
    let raw = InfoOptions {
        resolve: false,
        ..opts
    };
    g.bench_function("raw_backtraces", |b| b.iter(|| black_box(s.info(&raw))));
    let no_bt = InfoOptions {
        backtrace: false,
        ..opts
    };
    g.bench_function("no_backtraces", |b| b.iter(|| black_box(s.info(&no_bt))));
    // Every fiber has run since the last call (one message each, then parked again at the
    // same depth): no kept walk is valid, so each call walks and resolves all 10,000 stacks
    // afresh (the symbol cache is warm, as in a process that has run for a while).
    let move_all = || {
        let feed = ch.clone();
        s.spawn(move || {
            for _ in 0..FIBERS {
                feed.send(0).unwrap();
            }
        });
        assert!(s.run().is_err());
    };
    g.bench_function("resolved_backtraces_all_moved", |b| {
        b.iter_custom(|n| {
            let mut t = Duration::ZERO;
            for _ in 0..n {
                move_all();
                let t0 = Instant::now();
                black_box(s.info(&opts));
                t += t0.elapsed();
            }
            t
        })
    });
    // The same, listed from another thread (each walk then holds its fiber with the
    // handshake a walk from another thread needs: a compare-and-swap, or `membarrier` with
    // `FIBERTRACE_MEMBARRIER=1`, where switches pay no locked instruction).
    let info_opts = fibertrace_fiber::info::InfoOptions {
        sample_running: false,
        ..fibertrace_fiber::info::InfoOptions::default()
    };
    g.bench_function("resolved_backtraces_all_moved_from_another_thread", |b| {
        b.iter_custom(|n| {
            let mut t = Duration::ZERO;
            for _ in 0..n {
                move_all();
                t += std::thread::scope(|sc| {
                    sc.spawn(|| {
                        let t0 = Instant::now();
                        let all = black_box(fibertrace_fiber::info::info(&info_opts));
                        let t = t0.elapsed();
                        assert!(all.iter().filter(|f| f.backtrace.is_some()).count() >= FIBERS);
                        t
                    })
                    .join()
                    .unwrap()
                });
            }
            t
        })
    });
    g.finish();
    ch.close();
    s.run().unwrap();
}

/// Runs `a` and `b` alternately (so machine noise hits both alike) and prints the medians
/// per operation and their ratio: the figure the bounds are about.
fn paired(label: &str, n: u64, a: impl Fn(u64) -> Duration, b: impl Fn(u64) -> Duration) {
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..25 {
        ta.push(a(n).as_nanos() as f64 / n as f64);
        tb.push(b(n).as_nanos() as f64 / n as f64);
    }
    ta.sort_by(f64::total_cmp);
    tb.sort_by(f64::total_cmp);
    let (ma, mb) = (ta[ta.len() / 2], tb[tb.len() / 2]);
    println!(
        "{label}: {ma:.1} ns vs {mb:.1} ns per op, ratio {:.3}",
        ma / mb
    );
}

fn watchdog_on(on: bool) {
    use fibertrace_fiber::watchdog;
    if on {
        watchdog::start(watchdog::Config {
            threshold: Duration::from_millis(10),
            ..watchdog::Config::default()
        });
    } else {
        watchdog::stop();
        while watchdog::is_running() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[inline(never)]
fn spin_until(stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::hint::spin_loop();
    }
}

/// Signal-to-sample latency and in-handler walk time over 5000 samples of a spinning fiber.
fn sampling_figures() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let stop = Arc::new(AtomicBool::new(false));
    let fid = Arc::new(AtomicU64::new(0));
    let (s2, f2) = (stop.clone(), fid.clone());
    let t = std::thread::spawn(move || {
        Scheduler::new()
            .block_on(move || {
                let h = spawn(move || spin_until(&s2));
                f2.store(h.id(), Ordering::Release);
                h.join().unwrap();
            })
            .unwrap()
    });
    while fid.load(Ordering::Acquire) == 0 {
        std::thread::yield_now();
    }
    let (sched, _) = fibertrace_fiber::registry::find(fid.load(Ordering::Acquire)).unwrap();
    let (mut lat, mut walk) = (Vec::new(), Vec::new());
    for _ in 0..5000 {
        if let Some(s) = fibertrace_fiber::sample::sample(&sched, Duration::from_millis(500)) {
            lat.push(s.latency);
            walk.push(s.handler_time);
        }
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
    lat.sort();
    walk.sort();
    let p = |v: &Vec<Duration>, q: usize| v[v.len() * q / 100];
    println!(
        "sampling a spinning fiber ({} samples): signal-to-sample latency median {:?}, p99 {:?}; in-handler walk median {:?}, p99 {:?}",
        lat.len(),
        p(&lat, 50),
        p(&lat, 99),
        p(&walk, 50),
        p(&walk, 99)
    );
}

fn ratios(_c: &mut Criterion) {
    sampling_figures();
    paired(
        "yield ping-pong with vs without the watchdog (10 ms threshold)",
        20_000,
        |n| {
            watchdog_on(true);
            let d = ping_pong(true, n) / 2;
            watchdog_on(false);
            d
        },
        |n| ping_pong(true, n) / 2,
    );
    paired(
        "yield ping-pong traced vs untraced (per switch)",
        20_000,
        |n| ping_pong(true, n) / 2,
        |n| ping_pong(false, n) / 2,
    );
    paired(
        "spawn+run with vs without parent traces",
        5_000,
        |n| spawn_run(true, n),
        |n| spawn_run(false, n),
    );
}

criterion_group!(benches, ratios, switches, spawning, info);
criterion_main!(benches);
