//! Capture and resolve costs (issue: core). Throughput is in frames, so criterion's
//! "thrpt" line gives frames per second (ns/frame = 1e9 / thrpt).
//!
//! cargo bench -p fibertrace-core --bench capture

use std::hint::black_box;

use corosensei::stack::{DefaultStack, Stack};
use corosensei::{Coroutine, Yielder};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fibertrace_core::symbolize::{clear_cache, resolve_address};
use fibertrace_core::{
    collect_from_into, collect_into, Backtrace, CaptureOptions, Frame, SavedContext, StackBounds,
    Unwinder,
};

mod shared;
use shared::{deep, park, private_symbol};

const DEPTH: u32 = 32;

fn frames_at_depth() -> u64 {
    let mut n = 0;
    deep(DEPTH, &mut || {
        let mut bt = Backtrace::new();
        collect_into(&CaptureOptions::with_unwinder(Unwinder::Precise), &mut bt);
        n = bt.len() as u64;
    });
    n
}

fn capture(c: &mut Criterion) {
    let frames = frames_at_depth();
    println!("capture of a {DEPTH}-deep recursion: {frames} frames in the whole stack");
    let mut g = c.benchmark_group("capture_32_deep");
    g.throughput(Throughput::Elements(frames));
    for (name, u) in [
        ("fast", Unwinder::Fast),
        ("precise", Unwinder::Precise),
        ("auto", Unwinder::Auto),
    ] {
        let opts = CaptureOptions::with_unwinder(u);
        g.bench_function(name, |b| {
            deep(DEPTH, &mut || {
                let mut bt = Backtrace::new();
                b.iter(|| {
                    collect_into(&opts, &mut bt);
                    black_box(&bt);
                })
            })
        });
    }
    g.bench_function("backtrace_crate_trace", |b| {
        deep(DEPTH, &mut || {
            b.iter(|| {
                let mut n = 0usize;
                let mut ips = [0usize; 64];
                backtrace::trace(|f| {
                    ips[n] = f.ip() as usize;
                    n += 1;
                    n < 64
                });
                black_box(&ips);
            })
        })
    });
    let mut buf = [std::ptr::null_mut::<libc::c_void>(); 64];
    match private_symbol(c"libc.so.6", c"backtrace") {
        Some(glibc_backtrace) => {
            g.bench_function("glibc_backtrace", |b| {
                deep(DEPTH, &mut || {
                    // SAFETY: a valid buffer of 64 pointers.
                    b.iter(|| black_box(unsafe { glibc_backtrace(buf.as_mut_ptr(), 64) }))
                })
            });
        }
        None => println!("glibc backtrace(): not found"),
    }
    match private_symbol(c"libunwind.so.8", c"unw_backtrace") {
        Some(unw_backtrace) => {
            g.bench_function("libunwind_unw_backtrace", |b| {
                deep(DEPTH, &mut || {
                    // SAFETY: a valid buffer of 64 pointers.
                    b.iter(|| black_box(unsafe { unw_backtrace(buf.as_mut_ptr(), 64) }))
                })
            });
        }
        None => println!("libunwind unw_backtrace: libunwind.so.8 not installed, skipped"),
    }
    g.finish();

    // Per-frame slope, free of the fixed cost of a capture: the same capture at two depths.
    let mut g = c.benchmark_group("capture_slope");
    for depth in [8u32, 40] {
        for (name, u) in [("fast", Unwinder::Fast), ("precise", Unwinder::Precise)] {
            let opts = CaptureOptions::with_unwinder(u);
            g.bench_function(format!("{name}/depth_{depth}"), |b| {
                deep(depth, &mut || {
                    let mut bt = Backtrace::new();
                    b.iter(|| {
                        collect_into(&opts, &mut bt);
                        black_box(&bt);
                    })
                })
            });
        }
    }
    g.finish();
}

fn suspended(c: &mut Criterion) {
    let stack = DefaultStack::new(256 * 1024).unwrap();
    let bounds = StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16);
    let ctx = std::rc::Rc::new(std::cell::Cell::new(SavedContext::new(bounds)));
    let c2 = ctx.clone();
    // 27 levels of `park` and the recording point, ending where a runtime's walk ends: at the
    // entry closure's stack pointer (`stop_sp`, as fibertrace-fiber records it), so that
    // neither the closure nor corosensei's trampoline (code without frame pointers, which a
    // `Fast` walk would go on through with DWARF) is walked.
    let mut co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| {
        let here = fibertrace_core::__fibertrace_registers_here!();
        let mut c = c2.get();
        c.stop_sp = here.sp;
        c2.set(c);
        park(y, &c2, 26);
        black_box(());
    });
    co.resume(());
    let saved = ctx.get();
    let mut bt = Backtrace::new();
    collect_from_into(
        &saved,
        &CaptureOptions::with_unwinder(Unwinder::Fast),
        &mut bt,
    );
    println!("suspended coroutine: {} frames", bt.len());
    // What a runtime pays at each suspension point to make the coroutine walkable.
    let mut rec = SavedContext::new(bounds);
    c.bench_function("record_saved_context", |b| {
        b.iter(|| {
            rec.record();
            black_box(&rec);
        })
    });
    let mut g = c.benchmark_group("suspended_coroutine");
    g.throughput(Throughput::Elements(bt.len() as u64));
    for (name, u) in [
        ("fast", Unwinder::Fast),
        ("precise", Unwinder::Precise),
        ("auto", Unwinder::Auto),
    ] {
        let opts = CaptureOptions::with_unwinder(u);
        g.bench_function(name, |b| {
            b.iter(|| {
                collect_from_into(&saved, &opts, &mut bt);
                black_box(&bt);
            })
        });
    }
    g.finish();
    co.resume(());
}

fn resolve(c: &mut Criterion) {
    let mut bt = Backtrace::new();
    deep(4, &mut || collect_into(&CaptureOptions::default(), &mut bt));
    let addr = bt.frames()[0].lookup_address().unwrap();
    let _ = resolve_address(addr);
    let mut g = c.benchmark_group("resolve");
    g.bench_function("cache_hit", |b| {
        b.iter(|| black_box(resolve_address(black_box(addr))))
    });
    // First resolve: addresses spread over this binary's code, each new to the cache.
    let table = fibertrace_core::image::table();
    let exe = &table.images()[0];
    let (s, e) = exe.exec[0];
    let addrs: Vec<u64> = (0..4096u64).map(|i| s + (e - s) * i / 4096).collect();
    for &a in &addrs {
        let _ = resolve_address(a); // open and index the file once
    }
    let mut k = 0usize;
    g.bench_function("first_resolve", |b| {
        b.iter_batched(
            || {
                k = (k + 1) % addrs.len();
                if k == 0 {
                    clear_cache();
                }
                addrs[k]
            },
            |a| black_box(resolve_address(a)),
            BatchSize::SmallInput,
        )
    });
    g.finish();
    let _ = Frame::Truncated;
}

#[inline(never)]
fn panic_deep(n: u32) {
    if n == 0 {
        std::panic::panic_any(7u32);
    }
    panic_deep(n - 1);
    black_box(());
}

fn panic_cost(c: &mut Criterion) {
    std::panic::set_hook(Box::new(|_| {}));
    c.bench_function("panic_through_20_frames", |b| {
        b.iter(|| std::panic::catch_unwind(|| panic_deep(20)).is_err())
    });
    let _ = std::panic::take_hook();
}

criterion_group!(benches, capture, suspended, resolve, panic_cost);
criterion_main!(benches);
