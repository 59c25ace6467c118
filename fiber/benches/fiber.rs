//! Fiber runtime costs (issue: fiber). Run: cargo bench -p fibertrace-fiber --bench fiber
//!
//! - yield ping-pong between two fibers, traced vs untraced, and bare corosensei;
//! - spawn + run of an empty fiber, with and without parent traces;
//! - info with resolved backtraces for 10,000 suspended fibers, 20 frames each.

use std::hint::black_box;
use std::time::{Duration, Instant};

use corosensei::{Coroutine, CoroutineResult};
use criterion::{criterion_group, criterion_main, Criterion};
use fibertrace_fiber::{
    channel, spawn, yield_now, Channel, InfoOptions, Scheduler, SchedulerOptions,
};

fn sched(traced: bool, parent_traces: bool) -> Scheduler {
    Scheduler::with_options(SchedulerOptions {
        traced,
        parent_traces,
        stack_size: 64 * 1024,
        ..SchedulerOptions::default()
    })
}

/// Time per switch of `iters` yields in each of two fibers.
fn ping_pong(traced: bool, iters: u64) -> Duration {
    let s = sched(traced, false);
    for _ in 0..2 {
        s.spawn(move || {
            // Measured from inside: each yield switches to the other fiber.
            for _ in 0..iters {
                yield_now();
            }
        });
    }
    let t0 = Instant::now();
    s.run().unwrap();
    t0.elapsed()
}

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
    g.bench_function("with_parent_traces", |b| b.iter_custom(|n| spawn_run(true, n)));
    g.finish();
}

#[inline(never)]
fn park_deep(n: u32, ch: &Channel<u8>) {
    if n == 0 {
        black_box(ch.recv());
        return;
    }
    park_deep(n - 1, ch);
    black_box(());
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
            .spawn(move || park_deep(15, &c));
    }
    // Run until every fiber is parked in its receive (the scheduler reports that nothing can
    // run: a deadlock, by design here).
    assert!(s.run().is_err());
    let opts = InfoOptions::default();
    let first = s.info(&opts);
    println!(
        "info: {} fibers, {} frames each (+{} parent frames)",
        first.len(),
        first[0].backtrace.as_ref().unwrap().len(),
        first[0]
            .parent_backtrace
            .iter()
            .map(|p| p.frames.len())
            .sum::<usize>()
    );
    let mut g = c.benchmark_group("info_10000_suspended_fibers");
    g.sample_size(10);
    g.bench_function("resolved_backtraces", |b| b.iter(|| black_box(s.info(&opts))));
    let no_bt = InfoOptions {
        backtrace: false,
        ..opts
    };
    g.bench_function("no_backtraces", |b| b.iter(|| black_box(s.info(&no_bt))));
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
    println!("{label}: {ma:.1} ns vs {mb:.1} ns per op, ratio {:.3}", ma / mb);
}

fn ratios(_c: &mut Criterion) {
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
