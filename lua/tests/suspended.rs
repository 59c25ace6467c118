//! A suspended fiber with Lua on its stack, captured from outside: a corosensei coroutine
//! runs a Lua thread, which (inside a Lua `coroutine.wrap`) calls a Rust function that
//! suspends the coroutine natively. From the main stack, the fiber's native stack is walked
//! from its saved context (`collect_from`) and interleaved with the Lua thread's levels.
//!
//! Pitfalls respected (notes/lua.md): while the fiber is suspended, mlua's notion of the
//! current state is the fiber's thread, so the main side makes no mlua call until the fiber
//! is resumed (the capture uses the raw debug API only); and the coroutine is resumed to its
//! end before it is dropped — dropping it suspended would unwind through the Lua VM's frames.

use std::cell::{Cell, RefCell};
use std::hint::black_box;
use std::rc::Rc;

use corosensei::stack::{DefaultStack, Stack};
use corosensei::{Coroutine, CoroutineResult, Yielder};
use fibertrace_core::{collect_from, symbolize, Backtrace, CaptureOptions, Frame};
use fibertrace_core::{SavedContext, StackBounds, Unwinder};
use fibertrace_lua::{capture_interleaved, prepare, render};
use mlua::{Function, Lua, Thread};

const LUAJIT: bool = cfg!(feature = "luajit");

type Y = Yielder<(), ()>;

thread_local! {
    /// The running fiber's yielder and saved-context cell (set by the fiber body).
    static CURRENT: Cell<(*const Y, *const Cell<SavedContext>)> =
        const { Cell::new((std::ptr::null(), std::ptr::null())) };
    static SUSPENDS: Cell<u32> = const { Cell::new(0) };
}

/// The runtime's suspend wrapper: records the registers, then switches away.
#[inline(never)]
fn tfn_suspend_point(y: &Y, ctx: &Cell<SavedContext>) {
    let mut c = ctx.get();
    c.record();
    ctx.set(c);
    y.suspend(());
    black_box(());
}

/// `suspend()` in Lua.
#[inline(never)]
fn tfn_suspend(_: &Lua, _: ()) -> mlua::Result<()> {
    let (y, ctx) = CURRENT.with(|c| c.get());
    assert!(!y.is_null() && !ctx.is_null(), "suspend() outside a fiber");
    SUSPENDS.with(|s| s.set(s.get() + 1));
    // SAFETY: both pointers were set by `tfn_fiber_body`, which is still running (we are
    // called from inside it) and owns the yielder and keeps the context cell alive.
    unsafe { tfn_suspend_point(&*y, &*ctx) };
    Ok(())
}

#[inline(never)]
fn tfn_fiber_body(y: &Y, ctx: &Cell<SavedContext>, thread: &Thread) {
    CURRENT.with(|c| c.set((y as *const Y, ctx as *const _)));
    let r: i64 = thread.resume(()).expect("fiber's Lua code runs");
    assert_eq!(r, 2);
    CURRENT.with(|c| c.set((std::ptr::null(), std::ptr::null())));
    black_box(());
}

const FIBER: &str = "\
local function inner()
  suspend()
  return 1
end
local function outer()
  local w = coroutine.wrap(function()
    inner()
  end)
  w()
  return 2
end
return outer
";

fn last_segment(name: &str) -> &str {
    let base = match name.find('<') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    };
    base.rsplit("::").next().unwrap_or(base)
}

fn project(bt: &Backtrace, libs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for f in bt.frames() {
        match f {
            Frame::Lua(id) => out.push(format!("L {}", render::lua_line(*id).unwrap())),
            _ => {
                let Some(r) = symbolize::resolve(f) else {
                    continue;
                };
                let Some(n) = r.function().map(last_segment) else {
                    continue;
                };
                if n.starts_with("tfn_") || n == "call_callback" || libs.contains(&n) {
                    out.push(format!("C {n}"));
                }
            }
        }
    }
    out
}

#[test]
fn suspended_fiber_with_lua_frames_captured_from_outside() {
    prepare();
    let lua = Lua::new();
    lua.globals()
        .set("suspend", lua.create_function(tfn_suspend).unwrap())
        .unwrap();
    let outer: Function = lua.load(FIBER).set_name("@fiber.lua").eval().unwrap();
    let thread = lua.create_thread(outer).unwrap();

    let stack = DefaultStack::new(256 * 1024).unwrap();
    // The top 16 bytes hold corosensei's parent link, stale while suspended: not ours.
    let bounds = StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16);
    let ctx = Rc::new(Cell::new(SavedContext::new(bounds)));
    let (ctx2, thread2) = (ctx.clone(), thread.clone());
    let mut co = Coroutine::with_stack(stack, move |y: &Y, ()| {
        tfn_fiber_body(y, &ctx2, &thread2);
    });
    assert!(matches!(co.resume(()), CoroutineResult::Yield(())));
    assert_eq!(SUSPENDS.with(|s| s.get()), 1);

    // The fiber is suspended: capture it from here, with each unwinder.
    let saved = ctx.get();
    assert!(saved.is_recorded());
    let mut results = RefCell::new(Vec::new());
    for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
        let native = collect_from(&saved, &CaptureOptions::with_unwinder(u));
        // SAFETY: the fiber's Lua thread is suspended inside `suspend()` and nothing runs Lua
        // until we resume it below; the capture only reads it through the debug API.
        let bt = unsafe { capture_interleaved(&native, thread.state()) };
        results.get_mut().push((u, bt));
    }

    // Resume the fiber to its end before anything is dropped.
    assert!(matches!(co.resume(()), CoroutineResult::Return(())));
    drop(co);

    let mut want = vec![
        "C tfn_suspend_point",
        "C tfn_suspend",
        "C call_callback",
        "L suspend in =[C]:-1",
        "L inner in @fiber.lua:2",
        "L function <fiber.lua:6> in @fiber.lua:7",
    ];
    if !LUAJIT {
        want.extend(["C auxresume", "C luaB_auxwrap"]);
    }
    want.extend([
        "L w in =[C]:-1",
        "L function <fiber.lua:5> in @fiber.lua:9",
        "C tfn_fiber_body",
    ]);
    let libs = ["auxresume", "luaB_auxwrap"];
    let results = results.into_inner();
    for (u, bt) in &results {
        assert!(matches!(bt.frames()[0], Frame::Pc(_)), "{u:?}");
        let got = project(bt, &libs);
        assert_eq!(got, want, "{u:?}:\n{}", render::text(bt.frames()));
        // Nothing of the main stack (the test harness) appears: the walk stayed on the
        // fiber's stack.
        assert!(
            !render::text(bt.frames()).contains("run_test"),
            "{u:?}:\n{}",
            render::text(bt.frames())
        );
    }
    // The frame-pointer walk (through LuaJIT's interpreter with the CFRAME hop) and DWARF
    // agree frame for frame up to the fiber's entry.
    let upto = |bt: &Backtrace| -> Vec<Frame> {
        let mut v = Vec::new();
        for f in bt.frames() {
            v.push(*f);
            let is_body = symbolize::resolve(f)
                .and_then(|r| r.function().map(|n| last_segment(n) == "tfn_fiber_body"))
                .unwrap_or(false);
            if is_body {
                break;
            }
        }
        v
    };
    assert_eq!(upto(&results[0].1), upto(&results[1].1));
    drop(thread);
}
