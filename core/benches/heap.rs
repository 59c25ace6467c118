//! The heap tracker's cost on an allocation-heavy workload (building and dropping maps of
//! strings, 16 calls deep), side by side in one run: untracked, sampled (512 KiB mean), every
//! allocation; and `heaptrack` on the same program when it is installed.
//!
//! The tier is fixed when a process starts, so each measurement runs this same program again
//! as a child with `FIBERTRACE_HEAP` set (`off`, `sampled`, `every`); the child times the
//! workload itself (start-up is not counted) and reports nanoseconds per iteration, which
//! criterion's `iter_custom` takes. Before criterion, a figure table: medians of alternating
//! runs, the ratios to the untracked run, the every tier's cost per allocation, and the
//! metadata bytes per live allocation.
//!
//! `cargo bench -p fibertrace-core --bench heap`

use std::alloc::System;
use std::collections::HashMap;
use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::Criterion;
use fibertrace_core::heap::{self, Tier, Tracked};

#[global_allocator]
static HEAP: Tracked<System> = Tracked::from_env(System, Tier::Off);

/// Entries per map.
const ENTRIES: usize = 1000;

/// One iteration: a map of 1,000 formatted strings to strings, kept, then dropped.
fn build() -> usize {
    let mut m: HashMap<String, String> = HashMap::new();
    for i in 0..ENTRIES {
        m.insert(format!("key-{i}"), format!("value number {i} of the map"));
    }
    let n = m.len();
    drop(black_box(m));
    n
}

/// `build` called `depth` frames deep.
#[inline(never)]
fn deep(depth: usize) -> usize {
    if depth == 0 {
        return build();
    }
    // Not a tail call: the frame stays (black_box after the call).
    black_box(deep(black_box(depth - 1)))
}

/// The child: `iters` iterations 16 frames deep; prints `ns_per_iter allocations_per_iter
/// metadata_bytes mean_live_allocation_size`.
fn child(iters: u64) {
    let _ = deep(16);
    let t = Instant::now();
    for _ in 0..iters {
        black_box(deep(16));
    }
    let ns = t.elapsed().as_nanos() as f64 / iters.max(1) as f64;
    // Allocations per iteration and what the tracker keeps per live allocation, measured on
    // a map kept alive (every tier: the header in front of each allocation; sampled: the
    // sample table's entries spread over the allocations they stand for).
    let before = heap::owners().first().map_or(0, |r| r.usage.alloc_objects);
    let mut m: HashMap<String, String> = HashMap::new();
    for i in 0..ENTRIES {
        m.insert(format!("key-{i}"), format!("value number {i} of the map"));
    }
    let live = heap::live();
    let after = heap::owners().first().map_or(0, |r| r.usage.alloc_objects);
    let meta = match heap::tier() {
        Tier::Every => {
            let total: usize = live
                .iter()
                .map(|a| (a.blob.len() + 24).next_multiple_of(8))
                .sum();
            total as f64 / live.len().max(1) as f64
        }
        // The bytes one sample takes (its table entry, key and control byte included); per
        // live allocation that is this times the chance an allocation is sampled.
        Tier::Sampled => {
            (std::mem::size_of::<(usize, [u64; 31], usize, u32, i64, i64)>() + 9) as f64
        }
        Tier::Off => 0.0,
    };
    let mean = live.iter().map(|a| a.size).sum::<usize>() as f64 / live.len().max(1) as f64;
    drop(black_box(m));
    println!(
        "{ns:.1} {} {meta:.1} {mean:.1}",
        after.saturating_sub(before)
    );
}

struct Figures {
    ns: f64,
    allocs: f64,
    meta: f64,
    mean: f64,
}

/// Runs this program as a child in `tier` for `iters` iterations.
fn run(tier: &str, iters: u64) -> Option<Figures> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe)
        .env("FIBERTRACE_HEAP", tier)
        .env("FIBERTRACE_HEAP_BENCH_CHILD", iters.to_string())
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout);
    let mut w = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some(Figures {
        ns: w.next()??,
        allocs: w.next()??,
        meta: w.next()??,
        mean: w.next()??,
    })
}

/// heaptrack on the same program, untracked by us: its wall time per iteration (start-up
/// and its own recording included, as heaptrack users see it), or why not.
fn heaptrack(iters: u64) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("fibertrace-heaptrack-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let out = Command::new("heaptrack")
        .arg("-o")
        .arg(dir.join("h"))
        .arg(&exe)
        .env("FIBERTRACE_HEAP", "off")
        .env("FIBERTRACE_HEAP_BENCH_CHILD", iters.to_string())
        .output()
        .map_err(|e| format!("heaptrack not runnable: {e}"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let s = String::from_utf8_lossy(&out.stdout);
    // The child's own line (heaptrack prints its own lines around it).
    s.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let ns = w.next()?.parse::<f64>().ok()?;
            w.next()?.parse::<f64>().ok()?;
            w.next()?.parse::<f64>().ok()?;
            w.next()?.parse::<f64>().ok()?;
            w.next().is_none().then_some(ns)
        })
        .next()
        .ok_or_else(|| format!("heaptrack ran, but the program's figures are missing: {s}"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn figures() {
    const ITERS: u64 = 300;
    const ROUNDS: usize = 7;
    let tiers = ["off", "sampled", "every"];
    let mut ns: [Vec<f64>; 3] = Default::default();
    let mut last: [Option<Figures>; 3] = Default::default();
    for _ in 0..ROUNDS {
        for (i, t) in tiers.iter().enumerate() {
            if let Some(f) = run(t, ITERS) {
                ns[i].push(f.ns);
                last[i] = Some(f);
            }
        }
    }
    if ns.iter().any(Vec::is_empty) {
        println!("heap figures: a child run failed");
        return;
    }
    let m: Vec<f64> = ns.iter_mut().map(|v| median(v)).collect();
    let allocs = last[2].as_ref().map_or(0.0, |f| f.allocs);
    println!("heap workload: a map of {ENTRIES} strings built and dropped, 16 frames deep");
    println!("  allocations per iteration: {allocs:.0}");
    println!("  untracked: {:>10.0} ns/iter", m[0]);
    println!(
        "  sampled:   {:>10.0} ns/iter  {:.3}x untracked (goal <= 1.03)",
        m[1],
        m[1] / m[0]
    );
    println!(
        "  every:     {:>10.0} ns/iter  {:.2}x untracked, {:.0} ns more per allocation",
        m[2],
        m[2] / m[0],
        (m[2] - m[0]) / allocs.max(1.0)
    );
    if let (Some(s), Some(e)) = (&last[1], &last[2]) {
        // A sample per 512 KiB on average: an allocation of the workload's mean size is
        // sampled with chance size / 512 Ki (small sizes).
        let mean = e.mean;
        println!(
            "  metadata per live allocation: every {:.1} bytes (header in front of it); \
             sampled {:.0} bytes per sample, {:.4} bytes per live allocation of ~{mean:.0} bytes",
            e.meta,
            s.meta,
            s.meta * mean / (512.0 * 1024.0)
        );
    }
    match heaptrack(ITERS) {
        Ok(h) => println!(
            "  heaptrack:  {:>10.0} ns/iter  {:.2}x untracked, {:.0} ns more per allocation",
            h,
            h / m[0],
            (h - m[0]) / allocs.max(1.0)
        ),
        Err(e) => println!("  heaptrack: {e}"),
    }
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("heap_workload");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    for tier in ["off", "sampled", "every"] {
        g.bench_function(tier, |b| {
            b.iter_custom(|iters| {
                let f = run(tier, iters.max(1)).expect("the child runs");
                Duration::from_nanos((f.ns * iters as f64) as u64)
            })
        });
    }
    g.finish();
}

fn main() {
    if let Some(n) = std::env::var_os("FIBERTRACE_HEAP_BENCH_CHILD") {
        child(n.to_string_lossy().parse().unwrap_or(1));
        return;
    }
    figures();
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
}
