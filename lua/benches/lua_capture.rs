//! Costs of the Lua side of a capture, per frame: reading and interning the Lua levels,
//! merging them with native frames, and a whole interleaved capture of the current stack.
//!
//! `cargo bench -p fibertrace-lua --bench lua_capture` (LuaJIT) or add
//! `--no-default-features --features lua54`. The benchmarks run inside a Rust callback
//! called from a Lua recursion of `DEPTH` levels, so the stacks are real. Besides
//! criterion's report, a per-frame summary is printed.

use std::cell::RefCell;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use fibertrace_core::{collect, CaptureOptions, Unwinder};
use fibertrace_lua::{capture_current, capture_lua_stack, interleave, InterleaveOptions, LuaStack};
use mlua::{Lua, Thread};

const DEPTH: usize = 20;

thread_local! {
    static CRIT: RefCell<Option<Criterion>> = const { RefCell::new(None) };
}

fn per_iter(mut f: impl FnMut()) -> Duration {
    for _ in 0..1000 {
        f();
    }
    let n = 20_000u32;
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed() / n
}

fn run(c: &mut Criterion, root: &Thread) {
    fibertrace_lua::prepare();
    let mut lua_stack = LuaStack::new();
    // SAFETY: `root` is this OS thread's main Lua thread and we run inside its callback.
    unsafe { capture_lua_stack(root.state(), &mut lua_stack) };
    let levels = lua_stack.levels.len();
    let fast = InterleaveOptions::with_unwinder(Unwinder::Fast);
    let native = collect(&CaptureOptions::with_unwinder(Unwinder::Fast));
    let merged_len = (native.len() + levels) as u64;

    let mut g = c.benchmark_group("lua");
    g.measurement_time(Duration::from_secs(2)).sample_size(30);
    g.throughput(Throughput::Elements(levels as u64));
    g.bench_function(format!("capture_lua_stack/{levels}_levels"), |b| {
        let mut s = LuaStack::new();
        // SAFETY: as above.
        b.iter(|| unsafe { capture_lua_stack(black_box(root.state()), &mut s) })
    });
    g.throughput(Throughput::Elements(merged_len));
    g.bench_function(format!("merge/{merged_len}_frames"), |b| {
        b.iter(|| interleave(black_box(native.frames()), &lua_stack, &fast))
    });
    g.bench_function("capture_current/fast", |b| {
        b.iter(|| capture_current(root, &fast))
    });
    g.finish();

    // A plain per-frame summary.
    let mut s = LuaStack::new();
    // SAFETY: as above.
    let t_lua = per_iter(|| unsafe { capture_lua_stack(root.state(), &mut s) });
    let t_merge = per_iter(|| {
        black_box(interleave(native.frames(), &lua_stack, &fast));
    });
    let t_native = per_iter(|| {
        black_box(collect(&CaptureOptions::with_unwinder(Unwinder::Fast)));
    });
    let t_all = per_iter(|| {
        black_box(capture_current(root, &fast));
    });
    println!(
        "\nper-frame summary ({} flavour, {levels} Lua levels, {} native frames):",
        if cfg!(feature = "luajit") {
            "LuaJIT"
        } else {
            "Lua 5.4"
        },
        native.len()
    );
    println!(
        "  Lua capture + intern: {:?} total, {:.1} ns per Lua level",
        t_lua,
        t_lua.as_nanos() as f64 / levels as f64
    );
    println!(
        "  merge:                {:?} total, {:.1} ns per merged frame",
        t_merge,
        t_merge.as_nanos() as f64 / merged_len as f64
    );
    println!("  native FP walk:       {t_native:?}");
    println!("  whole capture_current (FP walk + Lua + merge): {t_all:?}");
}

fn main() {
    CRIT.with(|c| *c.borrow_mut() = Some(Criterion::default().configure_from_args()));
    let lua = Lua::new();
    let root = lua.current_thread();
    let bench = lua
        .create_function(move |_, ()| {
            let mut c = CRIT.with(|c| c.borrow_mut().take()).expect("criterion set");
            run(&mut c, &root);
            CRIT.with(|cell| *cell.borrow_mut() = Some(c));
            Ok(())
        })
        .expect("create bench");
    lua.globals().set("bench", bench).expect("set bench");
    let script = format!(
        "local function rec(n)\n  if n == 0 then bench() else rec(n - 1) end\n  return n\nend\nrec({})\n",
        DEPTH - 2
    );
    lua.load(script)
        .set_name("@bench.lua")
        .exec()
        .expect("bench script");
    if let Some(c) = CRIT.with(|c| c.borrow_mut().take()) {
        c.final_summary();
    }
}
