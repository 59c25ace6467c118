//! Interleaved native + Lua traces, exact frames, under the flavour being built (LuaJIT or
//! Lua 5.4), with the frame-pointer walk and with DWARF.
//!
//! Each trace is projected onto the frames a test names: every Lua frame (as Tarantool's L
//! line body) and the native frames whose function's last path segment starts with `tfn_`,
//! is `call_callback` (mlua's trampoline: the anchor of every Rust callback), or is in the
//! test's list of C library functions. Separately, no VM frame may appear when hidden.

use std::cell::RefCell;

use fibertrace_core::{symbolize, Backtrace, Frame, Unwinder};
use fibertrace_lua::interleave::vm_map;
use fibertrace_lua::{capture_current, render, InterleaveOptions};
use mlua::{Function, Lua, Thread};

const LUAJIT: bool = cfg!(feature = "luajit");

thread_local! {
    static ROOT: RefCell<Option<Thread>> = const { RefCell::new(None) };
    static UNWINDER: RefCell<Unwinder> = const { RefCell::new(Unwinder::Fast) };
    static CAPTURED: RefCell<Vec<Backtrace>> = const { RefCell::new(Vec::new()) };
}

fn setup(unwinder: Unwinder) -> Lua {
    let lua = Lua::new();
    ROOT.with(|r| *r.borrow_mut() = Some(lua.current_thread()));
    UNWINDER.with(|u| *u.borrow_mut() = unwinder);
    CAPTURED.with(|c| c.borrow_mut().clear());
    let g = lua.globals();
    g.set("capture", lua.create_function(tfn_capture).unwrap())
        .unwrap();
    g.set("capture2", lua.create_function(tfn_capture_both).unwrap())
        .unwrap();
    g.set("g", lua.create_function(tfn_g).unwrap()).unwrap();
    lua
}

fn root() -> Thread {
    ROOT.with(|r| r.borrow().clone().expect("setup ran"))
}

#[inline(never)]
fn tfn_capture(_: &Lua, _: ()) -> mlua::Result<()> {
    let root = root();
    let u = UNWINDER.with(|u| *u.borrow());
    let bt = capture_current(&root, &InterleaveOptions::with_unwinder(u));
    CAPTURED.with(|c| c.borrow_mut().push(bt));
    Ok(())
}

/// Captures with both unwinders at (nearly) the same point. The native traces keep their
/// innermost 64 frames (`top: 0`): the unwinders may differ below the thread's entry point
/// (libc without frame pointers), which would shift an `Omitted` window.
#[inline(never)]
fn tfn_capture_both(_: &Lua, _: ()) -> mlua::Result<()> {
    let root = root();
    let opts = |u| {
        let mut o = InterleaveOptions::with_unwinder(u);
        o.capture.top = 0;
        o
    };
    let fast = capture_current(&root, &opts(Unwinder::Fast));
    let precise = capture_current(&root, &opts(Unwinder::Precise));
    CAPTURED.with(|c| c.borrow_mut().extend([fast, precise]));
    Ok(())
}

#[inline(never)]
fn tfn_g(_: &Lua, h: Function) -> mlua::Result<()> {
    h.call::<()>(())
}

fn last_segment(name: &str) -> &str {
    // Strip generic arguments, then take the last `::` segment.
    let base = match name.find('<') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    };
    base.rsplit("::").next().unwrap_or(base)
}

fn native_name(f: &Frame) -> Option<String> {
    let r = symbolize::resolve(f)?;
    r.function().map(|n| last_segment(n).to_string())
}

/// The projection described in the module docs.
fn project(bt: &Backtrace, libs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for f in bt.frames() {
        match f {
            Frame::Lua(id) => out.push(format!("L {}", render::lua_line(*id).unwrap())),
            _ => {
                if let Some(n) = native_name(f) {
                    if n.starts_with("tfn_") || n == "call_callback" || libs.contains(&n.as_str()) {
                        out.push(format!("C {n}"));
                    }
                }
            }
        }
    }
    out
}

fn assert_no_vm_frames(bt: &Backtrace) {
    let map = vm_map();
    for f in bt.frames() {
        if let Some(a) = f.lookup_address() {
            assert!(
                !map.is_vm(a),
                "VM frame {:?} shown:\n{}",
                native_name(f),
                render::text(bt.frames())
            );
        }
    }
}

fn captured() -> Vec<Backtrace> {
    CAPTURED.with(|c| c.borrow().clone())
}

fn run(unwinder: Unwinder, script: &str) -> Backtrace {
    let lua = setup(unwinder);
    lua.load(script).set_name("@script.lua").exec().unwrap();
    let mut all = captured();
    assert_eq!(all.len(), 1);
    let bt = all.remove(0);
    assert_no_vm_frames(&bt);
    bt
}

fn check(script: &str, libs: &[&str], want: &[&str], test_fn: &str) {
    for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
        let bt = run(u, script);
        let mut got = project(&bt, libs);
        // Everything up to the test's own function.
        let end = got.iter().position(|s| s == &format!("C {test_fn}"));
        assert!(
            end.is_some(),
            "{u:?}: no {test_fn}:\n{}",
            render::text(bt.frames())
        );
        got.truncate(end.unwrap());
        assert_eq!(got, want, "{u:?}:\n{}", render::text(bt.frames()));
    }
}

const CHAIN: &str = "\
local function h()
  capture()
  return 1
end
function f()
  g(h)
  return 1
end
f()
";

#[test]
fn tfn_rust_lua_rust_lua_chain() {
    check(
        CHAIN,
        &[],
        &[
            "C tfn_capture",
            "C call_callback",
            "L capture in =[C]:-1",
            "L function <script.lua:1> in @script.lua:2",
            "C tfn_g",
            "C call_callback",
            "L g in =[C]:-1",
            "L f in @script.lua:6",
            "L main chunk in @script.lua:9",
        ],
        "tfn_rust_lua_rust_lua_chain",
    );
}

const SORT: &str = "\
local done = false
local t = {3, 1, 2}
table.sort(t, function(a, b)
  if not done then done = true; capture() end
  return a < b
end)
";

#[test]
fn tfn_table_sort_comparator() {
    let mut want = vec![
        "C tfn_capture",
        "C call_callback",
        "L capture in =[C]:-1",
        "L function <script.lua:3> in @script.lua:4",
    ];
    if LUAJIT {
        want.extend(["C auxsort", "C lj_cf_table_sort"]);
    } else {
        want.extend(["C auxsort", "C sort"]);
    }
    want.extend(["L sort in =[C]:-1", "L main chunk in @script.lua:3"]);
    check(
        SORT,
        &["sort", "auxsort", "lj_cf_table_sort"],
        &want,
        "tfn_table_sort_comparator",
    );
}

const PCALL_META: &str = "\
local mt = {__index = function(t, k)
  capture()
  return k
end}
local function viaindex()
  local obj = setmetatable({}, mt)
  local v = obj.missing
  return v
end
local ok, v = pcall(viaindex)
assert(ok and v == 'missing')
";

#[test]
fn tfn_pcall_and_metamethod() {
    let mut want = vec![
        "C tfn_capture",
        "C call_callback",
        "L capture in =[C]:-1",
        if LUAJIT {
            "L __index in @script.lua:2"
        } else {
            "L index in @script.lua:2"
        },
        "L function <script.lua:5> in @script.lua:7",
    ];
    if !LUAJIT {
        // Lua 5.4's pcall is a real C function; LuaJIT's is an interpreter fast function.
        want.push("C luaB_pcall");
    }
    want.extend(["L pcall in =[C]:-1", "L main chunk in @script.lua:10"]);
    check(
        PCALL_META,
        &["luaB_pcall"],
        &want,
        "tfn_pcall_and_metamethod",
    );
}

const WRAP: &str = "\
local function inner()
  capture()
  return 1
end
local co = coroutine.wrap(function()
  inner()
  coroutine.yield(1)
end)
co()
";

#[test]
fn tfn_coroutine_wrap_inside() {
    let mut want = vec![
        "C tfn_capture",
        "C call_callback",
        "L capture in =[C]:-1",
        "L inner in @script.lua:2",
        "L function <script.lua:5> in @script.lua:6",
    ];
    if !LUAJIT {
        want.extend(["C auxresume", "C luaB_auxwrap"]);
    }
    want.extend(["L co in =[C]:-1", "L main chunk in @script.lua:9"]);
    check(
        WRAP,
        &["auxresume", "luaB_auxwrap"],
        &want,
        "tfn_coroutine_wrap_inside",
    );
}

const RESUME: &str = "\
local function inner()
  capture()
  return 1
end
local co = coroutine.create(function(x)
  inner()
  return x
end)
local ok, x = coroutine.resume(co, 5)
assert(ok and x == 5)
";

#[test]
fn tfn_coroutine_resume_inside() {
    let mut want = vec![
        "C tfn_capture",
        "C call_callback",
        "L capture in =[C]:-1",
        "L inner in @script.lua:2",
        "L function <script.lua:5> in @script.lua:6",
    ];
    if !LUAJIT {
        want.extend(["C luaB_coresume"]);
    }
    want.extend(["L resume in =[C]:-1", "L main chunk in @script.lua:9"]);
    check(
        RESUME,
        &["luaB_coresume"],
        &want,
        "tfn_coroutine_resume_inside",
    );
}

const TAIL: &str = "\
local function leaf()
  capture()
  return 1
end
local function mid()
  return leaf()
end
local function top()
  local r = mid()
  return r
end
top()
";

#[test]
fn tfn_tail_calls() {
    // `mid` tail-calls `leaf`: its frame is gone. Lua 5.4 then knows no name for `leaf`;
    // LuaJIT names it by its caller's call site, which called `mid`.
    check(
        TAIL,
        &[],
        &[
            "C tfn_capture",
            "C call_callback",
            "L capture in =[C]:-1",
            if LUAJIT {
                "L mid in @script.lua:2"
            } else {
                "L function <script.lua:1> in @script.lua:2"
            },
            "L top in @script.lua:9",
            "L main chunk in @script.lua:12",
        ],
        "tfn_tail_calls",
    );
}

const BOTH: &str = "\
local function h()
  capture2()
  return 1
end
local function viaindex()
  local obj = setmetatable({}, {__index = function() g(h) return 1 end})
  return obj.x + 1
end
local co = coroutine.wrap(function() pcall(viaindex) end)
co()
";

#[test]
fn tfn_frame_pointer_and_dwarf_give_the_same_interleaved_trace() {
    let lua = setup(Unwinder::Fast);
    lua.load(BOTH).set_name("@script.lua").exec().unwrap();
    let all = captured();
    assert_eq!(all.len(), 2);
    let (fast, precise) = (&all[0], &all[1]);
    // Frame 0 is each capture's own call site; everything after it must agree exactly, down
    // to this test's function (below it, DWARF goes on into libc where frame pointers end).
    // A stack deeper than the 64 native frames kept is cut at the same frame by both.
    let end = |bt: &Backtrace| {
        bt.frames()
            .iter()
            .position(|f| {
                native_name(f).as_deref()
                    == Some("tfn_frame_pointer_and_dwarf_give_the_same_interleaved_trace")
            })
            .map_or(bt.len(), |p| p + 1)
    };
    assert!(fast.len() > 30);
    assert_eq!(
        fast.frames()[1..end(fast)],
        precise.frames()[1..end(precise)],
        "fast:\n{}\nprecise:\n{}",
        render::text(fast.frames()),
        render::text(precise.frames())
    );
    assert_eq!(
        native_name(&fast.frames()[0]).as_deref(),
        Some("tfn_capture_both")
    );
    assert_eq!(
        native_name(&precise.frames()[0]).as_deref(),
        Some("tfn_capture_both")
    );
    let lua_lines: Vec<String> = fast
        .frames()
        .iter()
        .filter_map(|f| match f {
            Frame::Lua(id) => render::lua_line(*id),
            _ => None,
        })
        .collect();
    assert_eq!(
        lua_lines,
        [
            "capture2 in =[C]:-1",
            "function <script.lua:1> in @script.lua:2",
            "g in =[C]:-1",
            if LUAJIT {
                "__index in @script.lua:6"
            } else {
                "index in @script.lua:6"
            },
            "function <script.lua:5> in @script.lua:7",
            "pcall in =[C]:-1",
            "function <script.lua:9> in @script.lua:9",
            "co in =[C]:-1",
            "main chunk in @script.lua:10",
        ]
    );
}

#[test]
fn tfn_tarantool_lines_are_numbered_together() {
    let bt = run(Unwinder::Fast, CHAIN);
    let entries = render::tarantool_entries(bt.frames());
    let text = render::tarantool(bt.frames());
    assert_eq!(entries.len(), bt.len());
    // First line: the capture callback, a C line numbered 1.
    match &entries[0] {
        render::TarantoolEntry::C(s) => {
            assert!(s.starts_with("#1  0x"), "{s}");
            assert!(s.contains("tfn_capture+"), "{s}");
        }
        e => panic!("{e:?}"),
    }
    let l: Vec<&String> = entries
        .iter()
        .filter_map(|e| match e {
            render::TarantoolEntry::L(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(l.len(), 5);
    let n0 = entries
        .iter()
        .position(|e| matches!(e, render::TarantoolEntry::L(_)))
        .unwrap()
        + 1;
    assert_eq!(*l[0], format!("#{n0:<2} capture in =[C]:-1"));
    assert_eq!(
        *l[1],
        format!("#{:<2} function <script.lua:1> in @script.lua:2", n0 + 1)
    );
    for (i, e) in entries.iter().enumerate() {
        let s = match e {
            render::TarantoolEntry::C(s) | render::TarantoolEntry::L(s) => s,
        };
        assert!(s.starts_with(&format!("#{:<2} ", i + 1)), "{s}");
        assert!(text.contains(s.as_str()));
    }
}

const LOAD_READER: &str = "\
local function reader()
  capture()
  return nil
end
local function loader()
  load(reader)
end
loader()
";

/// `load` with a reader function: the reader runs inside `load`'s C code (`lj_cf_load`,
/// `reader_func` calling back into Lua), so those native frames sit between the reader and
/// the `load` level — they were appended below the main chunk.
#[test]
fn tfn_load_with_a_reader_function() {
    let mut want = vec![
        "C tfn_capture",
        "C call_callback",
        "L capture in =[C]:-1",
        "L function <script.lua:1> in @script.lua:2",
    ];
    if LUAJIT {
        want.extend(["C reader_func", "C lj_cf_load"]);
    } else {
        want.extend(["C generic_reader", "C luaB_load"]);
    }
    want.extend([
        "L load in =[C]:-1",
        "L loader in @script.lua:6",
        "L main chunk in @script.lua:8",
    ]);
    check(
        LOAD_READER,
        &["reader_func", "lj_cf_load", "generic_reader", "luaB_load"],
        &want,
        "tfn_load_with_a_reader_function",
    );
}
