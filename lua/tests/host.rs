//! The Lua host (`fiber` module, `fiber.info()`): exact interleaved traces of Lua fibers,
//! native and Lua frames, under both Lua flavours (the same scripts).
//!
//! Traces are projected for comparison: every Lua entry is kept whole (without its number),
//! native entries only for the functions that matter (the host's C functions, the runtime's
//! switch points, the test's own Rust callbacks `tcb_*`), by the last segment of their name.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use fibertrace_lua::LuaHost;
use mlua::{Function, Table, Value};

const LUAJIT: bool = cfg!(feature = "luajit");

const KEEP: &[&str] = &[
    "sleep",
    "yield_now",
    "yield_to",
    "yield_to_id",
    "f_sleep",
    "f_yield",
    "f_info",
    "f_create",
    "call_in_thread",
    "lua_fiber_main",
    "run_main_fiber",
];

fn c_name(s: &str) -> Option<String> {
    // "#1  0x55.. in path::name+off"
    let (_, rest) = s.split_once(" in ")?;
    let name = rest.rsplit_once('+').map_or(rest, |(n, _)| n);
    if name.ends_with("{{closure}}") {
        return None;
    }
    let last = name.rsplit("::").next().unwrap_or(name);
    (KEEP.contains(&last) || last.starts_with("tcb_")).then(|| format!("C {last}"))
}

fn strip_number(s: &str) -> &str {
    // "#12 text" or "#1  text"
    s.split_once(' ').map_or(s, |(_, r)| r.trim_start())
}

fn project(entries: &Table) -> Vec<String> {
    let mut out = Vec::new();
    for e in entries.sequence_values::<Table>() {
        let e = e.unwrap();
        let (k, v): (String, String) = e.pairs().next().unwrap().unwrap();
        match k.as_str() {
            "L" => out.push(format!("L {}", strip_number(&v))),
            "C" => out.extend(c_name(&v)),
            other => panic!("unexpected key {other}"),
        }
    }
    out
}

fn run(src: &str) -> LuaHost {
    let host = LuaHost::new().unwrap();
    let lua = host.lua();
    lua.globals()
        .set("tcb_call", lua.create_function(tcb_call).unwrap())
        .unwrap();
    if let Err(e) = host.run_main("@t.lua", src.as_bytes(), &[]) {
        panic!("script failed: {e}");
    }
    host
}

/// A Rust callback that calls a Lua function (which may switch fibers).
#[inline(never)]
fn tcb_call(_: &mlua::Lua, f: Function) -> mlua::Result<()> {
    f.call::<()>(())?;
    std::hint::black_box(());
    Ok(())
}

fn result(host: &LuaHost, name: &str) -> Vec<String> {
    let t: Table = host.lua().globals().get(name).unwrap();
    project(&t)
}

/// The sequence in global table `name`.
fn global_seq<T: mlua::FromLua>(host: &LuaHost, name: &str) -> Vec<T> {
    host.lua()
        .globals()
        .get::<Table>(name)
        .unwrap()
        .sequence_values::<T>()
        .map(Result::unwrap)
        .collect()
}

fn v(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The bottom of a fiber made by fiber.create.
const FIBER_BOTTOM: &[&str] = &["C call_in_thread", "C lua_fiber_main"];

fn with_bottom(mut top: Vec<String>) -> Vec<String> {
    top.extend(v(FIBER_BOTTOM));
    top
}

#[test]
fn fiber_sleeping_three_lua_calls_deep() {
    let host = run(r#"local fiber = require('fiber')
local function leaf()
  fiber.sleep(100)
  return 1
end
local function mid()
  leaf()
  return 2
end
local function top()
  mid()
  return 3
end
local f = fiber.create(top)
RESULT = fiber.info()[f:id()].backtrace
SELF = fiber.info()[fiber.id()].backtrace
"#);
    assert_eq!(
        result(&host, "RESULT"),
        with_bottom(v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            "L leaf in @t.lua:3",
            "L mid in @t.lua:7",
            "L function <t.lua:10> in @t.lua:11",
        ]))
    );
    // The running fiber's own trace starts at fiber.info's C function.
    assert_eq!(
        result(&host, "SELF"),
        v(&[
            "C f_info",
            "L info in =[C]:-1",
            "L main chunk in @t.lua:16",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
}

#[test]
fn rust_callback_lua_rust_lua_chain() {
    let host = run(r#"local fiber = require('fiber')
local function inner()
  tcb_call(function()
    fiber.sleep(100)
  end)
  return 1
end
local function outer()
  tcb_call(function()
    inner()
  end)
  return 2
end
local f = fiber.create(outer)
RESULT = fiber.info()[f:id()].backtrace
"#);
    assert_eq!(
        result(&host, "RESULT"),
        with_bottom(v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            "L function <t.lua:3> in @t.lua:4",
            "C tcb_call",
            "L tcb_call in =[C]:-1",
            "L inner in @t.lua:3",
            "L function <t.lua:9> in @t.lua:10",
            "C tcb_call",
            "L tcb_call in =[C]:-1",
            "L function <t.lua:8> in @t.lua:9",
        ]))
    );
}

#[test]
fn table_sort_comparator_that_sleeps() {
    let host = run(r#"local fiber = require('fiber')
local function sorter()
  local t = {3, 1, 2}
  table.sort(t, function(a, b)
    fiber.sleep(100)
    return a < b
  end)
  return t
end
local f = fiber.create(sorter)
RESULT = fiber.info()[f:id()].backtrace
"#);
    assert_eq!(
        result(&host, "RESULT"),
        with_bottom(v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            "L function <t.lua:4> in @t.lua:5",
            "L sort in =[C]:-1",
            "L function <t.lua:2> in @t.lua:4",
        ]))
    );
}

#[test]
fn pcall_and_metamethod_in_the_chain() {
    let host = run(r#"local fiber = require('fiber')
local mt = {__index = function(t, k)
  fiber.sleep(100)
  return k
end}
local function get()
  local obj = setmetatable({}, mt)
  local v = obj.key
  return v
end
local function guarded()
  local ok, v = pcall(get)
  return ok, v
end
local f = fiber.create(guarded)
RESULT = fiber.info()[f:id()].backtrace
"#);
    // Lua 5.4 names a metamethod without its underscores.
    let mm = if LUAJIT {
        "L __index in @t.lua:3"
    } else {
        "L index in @t.lua:3"
    };
    assert_eq!(
        result(&host, "RESULT"),
        with_bottom(v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            mm,
            "L function <t.lua:6> in @t.lua:8",
            "L pcall in =[C]:-1",
            "L function <t.lua:11> in @t.lua:12",
        ]))
    );
}

#[test]
fn coroutine_wrap_inside_a_fiber() {
    let host = run(r#"local fiber = require('fiber')
local function inner()
  fiber.sleep(100)
  return 1
end
local function body()
  local w = coroutine.wrap(function()
    inner()
    return 2
  end)
  w()
  return 3
end
local f = fiber.create(body)
RESULT = fiber.info()[f:id()].backtrace
"#);
    assert_eq!(
        result(&host, "RESULT"),
        with_bottom(v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            "L inner in @t.lua:3",
            "L function <t.lua:7> in @t.lua:8",
            "L w in =[C]:-1",
            "L function <t.lua:6> in @t.lua:11",
        ]))
    );
}

#[test]
fn parent_trace_contains_the_creators_lua_function() {
    let host = run(r#"local fiber = require('fiber')
fiber.parent_backtrace_enable()
local child
local function spawner()
  child = fiber.create(function()
    fiber.sleep(100)
  end)
  fiber.sleep(100)
end
local function start_spawner()
  local p = fiber.create(spawner)
  return p
end
local p = start_spawner()
local i = fiber.info()[child:id()]
RESULT = i.parent_backtrace
PARENT = i.parent
PID = p:id()
GRAND = fiber.info()[p:id()].parent_backtrace
fiber.parent_backtrace_disable()
local q = fiber.create(function() fiber.sleep(100) end)
NONE = fiber.info()[q:id()].parent_backtrace == nil
"#);
    let g = host.lua().globals();
    assert_eq!(
        g.get::<u64>("PARENT").unwrap(),
        g.get::<u64>("PID").unwrap()
    );
    assert!(g.get::<bool>("NONE").unwrap());
    // The child's parent trace: the spawner at its fiber.create, then (chained) the main
    // fiber where it created the spawner.
    assert_eq!(
        result(&host, "RESULT"),
        v(&[
            "C f_create",
            "L create in =[C]:-1",
            "L function <t.lua:4> in @t.lua:5",
            "C call_in_thread",
            "C lua_fiber_main",
            "C f_create",
            "L create in =[C]:-1",
            "L start_spawner in @t.lua:11",
            "L main chunk in @t.lua:14",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
    assert_eq!(
        result(&host, "GRAND"),
        v(&[
            "C f_create",
            "L create in =[C]:-1",
            "L start_spawner in @t.lua:11",
            "L main chunk in @t.lua:14",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
}

/// Two fibers passing the turn to each other with `fiber.yield()` (the first to yield runs
/// the other inside its own switch; the other's yield goes straight back): each one's
/// listing shows the other in its `fiber.yield()` call, Lua and C frames in order, as after
/// a yield through the scheduler.
#[test]
fn fibers_passing_the_turn_list_each_other_in_their_yields() {
    let host = run(r#"local fiber = require('fiber')
local a, b
A_SEES, B_SEES = {}, {}
local function pass_a()
  fiber.yield()
end
local function pass_b()
  fiber.yield()
end
a = fiber.create(function()
  pass_a()
  for i = 1, 3 do
    A_SEES[i] = fiber.info()[b:id()].backtrace
    pass_a()
  end
end)
b = fiber.create(function()
  for i = 1, 3 do
    pass_b()
    B_SEES[i] = fiber.info()[a:id()].backtrace
  end
end)
a:set_joinable(true)
a:join()
"#);
    let seen = |name: &str| -> Vec<Vec<String>> {
        let t: Table = host.lua().globals().get(name).unwrap();
        t.sequence_values::<Table>()
            .map(|e| project(&e.unwrap()))
            .collect()
    };
    let (a, b) = (seen("A_SEES"), seen("B_SEES"));
    assert_eq!(a.len(), 3);
    assert_eq!(b.len(), 3);
    let of = |pass: &str, line: u32, body: u32, call: u32| {
        with_bottom(v(&[
            "C yield_now",
            "C f_yield",
            "L yield in =[C]:-1",
            &format!("L {pass} in @t.lua:{line}"),
            &format!("L function <t.lua:{body}> in @t.lua:{call}"),
        ]))
    };
    for seen in a {
        assert_eq!(seen, of("pass_b", 8, 17, 19));
    }
    // (a's first pass_a call is on line 11, the ones b sees on line 14.)
    for seen in b {
        assert_eq!(seen, of("pass_a", 5, 10, 14));
    }
}

#[test]
fn info_without_backtraces() {
    let host = run(r#"local fiber = require('fiber')
local f = fiber.create(function() fiber.sleep(100) end)
f:name('sleeper')
local a = fiber.info({backtrace = false})[f:id()]
local b = fiber.info({bt = false})[f:id()]
local c = f:info({bt = false})
local d = fiber.info()[f:id()]
A = a.backtrace == nil and b.backtrace == nil and c.backtrace == nil and d.backtrace ~= nil
KEYS = {a.fid == f:id(), a.name, a.status, a.waiting.on, type(a.csw), type(a.time),
        type(a.memory.used), type(a.memory.total), a.parent == fiber.id(), f:status()}
"#);
    let g = host.lua().globals();
    assert!(g.get::<bool>("A").unwrap());
    let keys: Table = g.get("KEYS").unwrap();
    let got: Vec<String> = keys
        .sequence_values::<Value>()
        .map(|v| match v.unwrap() {
            Value::String(s) => s.to_string_lossy(),
            Value::Boolean(b) => b.to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        v(&[
            "true",
            "sleeper",
            "sleeping",
            "sleep",
            "number",
            "number",
            "number",
            "number",
            "true",
            "suspended"
        ])
    );
}

/// Each entry has exactly the keys its fiber has values for, whatever shape it takes (each
/// shape has its own constructor: see `info::entry_ctors_source`), with and without
/// backtraces; `max_slice` lands in a full table.
#[test]
fn info_entries_have_exactly_the_keys_of_their_fiber() {
    let host = run(r#"local fiber = require('fiber')
local function keys(t)
  local k = {}
  for n in pairs(t) do k[#k + 1] = n end
  table.sort(k)
  return table.concat(k, ',')
end
local s = fiber.create(function() fiber.sleep(100) end)
local r = fiber.new(function() end)
fiber.parent_backtrace_enable()
local p = fiber.create(function() fiber.sleep(100) end)
fiber.parent_backtrace_disable()
p:set_max_slice(5)
local all, nobt, me = fiber.info(), fiber.info({bt = false}), fiber.id()
KEYS = {keys(all[me]), keys(all[s:id()]), keys(all[r:id()]), keys(all[p:id()]),
        keys(nobt[me]), keys(nobt[s:id()]), keys(nobt[r:id()]), keys(nobt[p:id()]),
        keys(all[s:id()].waiting), keys(all[p:id()].max_slice), keys(all[p:id()].memory)}
"#);
    let keys: Vec<String> = host.lua().globals().get("KEYS").unwrap();
    let base = "csw,fid,memory,name,status,time";
    let with = |extra: &[&str]| {
        let mut k: Vec<&str> = base.split(',').chain(extra.iter().copied()).collect();
        k.sort_unstable();
        k.join(",")
    };
    assert_eq!(
        keys,
        vec![
            with(&["backtrace"]),
            with(&["backtrace", "parent", "waiting"]),
            with(&["backtrace", "parent"]),
            with(&[
                "backtrace",
                "max_slice",
                "parent",
                "parent_backtrace",
                "waiting"
            ]),
            with(&[]),
            with(&["parent", "waiting"]),
            with(&["parent"]),
            with(&["max_slice", "parent", "waiting"]),
            "on,seconds".to_string(),
            "err".to_string(),
            "total,used".to_string(),
        ]
    );
}

#[test]
fn lua_error_in_the_main_fiber_has_an_interleaved_traceback() {
    let host = LuaHost::new().unwrap();
    let err = host
        .run_main(
            "@t.lua",
            br#"local fiber = require('fiber')
local function fail()
  error('boom')
end
local function caller()
  fail()
  return 1
end
caller()
"#,
            &[],
        )
        .unwrap_err();
    assert_eq!(err.message, "t.lua:3: boom");
    let lines: Vec<String> = err
        .traceback
        .lines()
        .filter_map(|l| {
            if l.contains(" 0x") {
                c_name(l)
            } else {
                Some(format!("L {}", strip_number(l)))
            }
        })
        .collect();
    assert_eq!(
        lines,
        v(&[
            "L error in =[C]:-1",
            "L fail in @t.lua:3",
            "L caller in @t.lua:6",
            "L main chunk in @t.lua:9",
        ])
    );
}

#[test]
fn lua_error_in_a_fiber_joined_and_printed() {
    // Joined: the joiner gets the error.
    let host = run(r#"local fiber = require('fiber')
local f = fiber.new(function(a, b)
  fiber.yield()
  error('bad ' .. a .. b)
end, 'x', 'y')
f:set_joinable(true)
local ok, err = f:join()
R = tostring(ok) .. ' ' .. err
local g = fiber.new(function(a, b) fiber.yield() return a + b, 'z' end, 2, 3)
g:set_joinable(true)
local ok2, sum, z = g:join()
R2 = tostring(ok2) .. ' ' .. sum .. ' ' .. z .. ' ' .. g:status()
"#);
    let g = host.lua().globals();
    assert_eq!(g.get::<String>("R").unwrap(), "false t.lua:4: bad xy");
    assert_eq!(g.get::<String>("R2").unwrap(), "true 5 z dead");
}

#[test]
fn lua_error_in_a_fiber_prints_an_interleaved_traceback() {
    let dir = Scratch::new("host");
    let script = dir.join("err.lua");
    std::fs::write(
        &script,
        "local fiber = require('fiber')\nlocal function deep()\n  error('kaput')\nend\nfiber.create(function()\n  deep()\nend)\nprint('after')\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .arg(&script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "after\n");
    let s = script.display().to_string();
    assert!(
        stderr.contains(&format!("failed: {s}:3: kaput\nstack traceback:\n")),
        "{stderr}"
    );
    let lua_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with('#') && !l.contains(" 0x"))
        .map(strip_number)
        .collect();
    assert_eq!(
        lua_lines,
        vec![
            "error in =[C]:-1".to_string(),
            format!("deep in @{s}:3"),
            format!("function <{s}:5> in @{s}:6"),
        ]
    );
    // The host's glue (the call into the fiber's function) is left out: the traceback is the
    // Lua frames alone.
    let traceback: Vec<&str> = stderr
        .lines()
        .skip_while(|l| *l != "stack traceback:")
        .skip(1)
        .take_while(|l| l.starts_with('#'))
        .collect();
    // (Lua 5.4's `error` is a C function of its own, `luaB_error`, a native frame on top.)
    let native_error = usize::from(cfg!(feature = "lua54"));
    assert_eq!(traceback.len(), 3 + native_error, "{stderr}");
    // --native-detail shows it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .args(["run", "--native-detail"])
        .arg(&script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let natives: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with('#') && l.contains(" 0x"))
        .filter_map(|l| l.split_once(" in ")?.1.rsplit_once('+').map(|(n, _)| n))
        .collect();
    assert_eq!(
        natives[native_error..],
        [
            "fibertrace_lua::host::spawn::call_in_thread",
            "fibertrace_lua::host::spawn::lua_fiber_main",
            "fibertrace_lua::host::spawn::LuaBody::run",
            "fibertrace_lua::host::spawn::spawn_lua::{{closure}}"
        ],
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fiber_api_basics() {
    let host = run(r#"local fiber = require('fiber')
local clock = require('clock')
local log = {}
local f = fiber.create(function(x) table.insert(log, 'child ' .. x) end, 1)
table.insert(log, 'parent')
local ch = fiber.channel(2)
local c = fiber.cond()
local w = fiber.create(function()
  for i = 1, 3 do ch:put(i) end
  c:signal()
end)
local got = {}
for i = 1, 3 do got[#got + 1] = ch:get() end
table.insert(log, table.concat(got, ','))
table.insert(log, tostring(ch:get(0.01)))
local s = fiber.create(function() fiber.sleep(100) end)
s:cancel()
fiber.yield()
table.insert(log, s:status())
local t0 = clock.monotonic()
fiber.sleep(0.01)
table.insert(log, tostring(clock.monotonic() - t0 >= 0.009))
table.insert(log, tostring(fiber.self() == fiber.find(fiber.id())))
table.insert(log, tostring(fiber.find(f:id())))
fiber.name('mainer')
table.insert(log, fiber.name() .. ' ' .. fiber.self():name())
table.insert(log, tostring(pcall(fiber.name, string.rep('x', 300))))
fiber.name(string.rep('y', 300), {truncate = true})
table.insert(log, tostring(#fiber.name()))
table.insert(log, tostring(fiber.self()):match('^fiber: %d+$') and 'tostring ok' or 'bad')
table.insert(log, type(fiber.time()) .. type(fiber.clock()) .. type(clock.time()) .. type(clock.proc()))
LOG = table.concat(log, '|')
"#);
    assert_eq!(
        host.lua().globals().get::<String>("LOG").unwrap(),
        "child 1|parent|1,2,3|nil|dead|true|true|nil|mainer mainer|false|255|tostring ok|numbernumbernumbernumber"
    );
}

/// A fiber cancelled before it ever ran leaves nothing behind: not findable, its record,
/// thread and object released (memory does not grow over many of them); a joinable one is
/// joined as cancelled.
#[test]
fn a_fiber_cancelled_before_it_starts_is_released() {
    let host = run(r#"local fiber = require('fiber')
local f = fiber.new(function() end)
local id = f:id()
f:cancel()
fiber.yield()
local log = {f:status(), tostring(fiber.find(id))}
local g = fiber.new(function() return 1 end)
g:set_joinable(true)
g:cancel()
fiber.yield()
-- Dead, kept for its joiner only: not findable, cannot be made unjoinable.
log[#log + 1] = tostring(fiber.find(g:id())) .. ' ' .. tostring(pcall(g.set_joinable, g, false))
local ok, err = g:join()
log[#log + 1] = tostring(ok) .. ' ' .. tostring(err)
local function churn(n)
  for _ = 1, n do
    local x = fiber.new(function() end)
    x:cancel()
    fiber.yield()
  end
  collectgarbage('collect')
  collectgarbage('collect')
end
churn(500)
local before = collectgarbage('count')
churn(5000)
local grew = collectgarbage('count') - before
log[#log + 1] = grew < 200 and 'no growth' or ('grew ' .. grew .. ' KiB')
LOG = table.concat(log, '|')
"#);
    assert_eq!(
        host.lua().globals().get::<String>("LOG").unwrap(),
        "dead|nil|nil false|false fiber is cancelled|no growth"
    );
}

/// A fiber's object is the same while the fiber lives, and once the fiber is dead and no
/// script holds the object, it is collected (a weak table keyed by fiber objects loses the
/// entry), also when no fiber is created afterwards to reuse its slot.
#[test]
fn fiber_objects_live_with_their_fiber_and_are_collected_after() {
    let host = run(r#"local fiber = require('fiber')
local data = setmetatable({}, {__mode = 'k'})
local n = 0
for i = 1, 50 do
  local f = fiber.create(function() fiber.sleep(0.001) end)
  data[f] = i
end
for _ in pairs(data) do n = n + 1 end
local alive = n
local same = fiber.self() == fiber.self()
fiber.sleep(0.05)
collectgarbage()
collectgarbage()
n = 0
for _ in pairs(data) do n = n + 1 end
RES = alive .. ' ' .. n .. ' ' .. tostring(same)
"#);
    assert_eq!(
        host.lua().globals().get::<String>("RES").unwrap(),
        "50 0 true"
    );
}

/// The exact key sets of `fiber.info()` entries (no key more, none less), and the words of
/// what a fiber waits on.
#[test]
fn info_entries_have_exactly_their_keys() {
    let host = run(r#"local fiber = require('fiber')
local ch = fiber.channel(1)
local r = fiber.create(function() ch:get() end)
local i = fiber.info()
local function keys(t)
  local k = {}
  for n in pairs(t) do k[#k + 1] = n end
  table.sort(k)
  return table.concat(k, ',')
end
K1 = keys(i[r:id()])
K2 = keys(i[r:id()].waiting)
K3 = keys(i[r:id()].memory)
W = i[r:id()].waiting.on
SEC = type(i[r:id()].waiting.seconds)
K4 = keys(fiber.info({bt = false})[fiber.id()])
S = i[fiber.id()].status .. ' ' .. i[r:id()].status
ch:put(1)
"#);
    let g = host.lua().globals();
    let s = |k: &str| g.get::<String>(k).unwrap();
    assert_eq!(
        s("K1"),
        "backtrace,csw,fid,memory,name,parent,status,time,waiting"
    );
    assert_eq!(s("K2"), "on,seconds");
    assert_eq!(s("K3"), "total,used");
    assert_eq!(s("W"), "channel receive");
    assert_eq!(s("SEC"), "number");
    assert_eq!(s("K4"), "csw,fid,memory,name,status,time");
    assert_eq!(s("S"), "running waiting");
}

/// `fiber.info()` lists exactly the live fibers, each under its own id, whether the ids are
/// dense (the result's array part holds them) or spread out by many fibers that ended (its
/// hash part): with and without backtraces, by `pairs` and by `next`.
#[test]
fn info_lists_exactly_the_live_fibers_whether_their_ids_are_dense_or_spread() {
    let host = run(r#"local fiber = require('fiber')
local mine = {}
for i = 1, 40 do mine[i] = fiber.create(function() fiber.sleep(100) end) end
local function expected()
  local e = {[fiber.id()] = true}
  for _, f in ipairs(mine) do
    if f:status() ~= 'dead' then e[f:id()] = true end
  end
  return e
end
local function check(opts)
  local got, exp = fiber.info(opts), expected()
  local n, m = 0, 0
  for id, entry in pairs(got) do
    if not exp[id] or entry.fid ~= id then return 'unexpected ' .. tostring(id) end
    n = n + 1
  end
  for id in pairs(exp) do
    if got[id] == nil then return 'missing ' .. id end
    m = m + 1
  end
  local k, c = next(got), 0
  while k ~= nil do c = c + 1; k = next(got, k) end
  return n == m and c == n and n or 'counts ' .. n .. ' ' .. m .. ' ' .. c
end
R = {}
R[1] = check()
R[2] = check({backtrace = false})
-- Many fibers that end: the ids of the live ones spread out.
for _ = 1, 2000 do fiber.create(function() end) end
for i = 1, 35 do mine[i]:cancel() end
fiber.yield()
R[3] = check()
R[4] = check({backtrace = false})
mine[#mine + 1] = fiber.create(function() fiber.sleep(100) end)
R[5] = check({bt = false})
MAXID = mine[#mine]:id()
"#);
    let g = host.lua().globals();
    let r: Vec<Value> = g
        .get::<Table>("R")
        .unwrap()
        .sequence_values::<Value>()
        .map(Result::unwrap)
        .collect();
    let r: Vec<String> = r
        .iter()
        .map(|v| match v {
            Value::Integer(n) => n.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.to_string_lossy(),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(r, v(&["41", "41", "6", "6", "7"]));
    // The last fiber's id is far past twice the count: the spread case was taken.
    assert!(g.get::<i64>("MAXID").unwrap() > 2000);
}

/// A debug hook that would raise inside `fiber.info()`'s entry constructor does not run
/// there (hooks are off during the call), and it is back afterwards.
#[test]
fn info_runs_without_the_callers_hook_and_restores_it() {
    let host = run(r#"local fiber = require('fiber')
local f = fiber.create(function() fiber.sleep(100) end)
local inside = 0
local function hook()
  local i = debug.getinfo(2, 'S')
  if i and i.source == '=fiber.info' then
    inside = inside + 1
    error('hook raised inside fiber.info')
  end
end
debug.sethook(hook, '', 1)
local t = fiber.info()
local back = debug.gethook() == hook
debug.sethook()
R = tostring(type(t[f:id()]) == 'table') .. ' ' .. inside .. ' ' .. tostring(back)
"#);
    assert_eq!(
        host.lua().globals().get::<String>("R").unwrap(),
        "true 0 true"
    );
}

#[test]
fn a_creator_waits_in_fiber_create_while_its_child_runs_and_goes_on_right_after() {
    let host = run(r#"local fiber = require('fiber')
local main_id = fiber.id()
ORDER = {}
local function child()
  RESULT = fiber.info()[main_id].backtrace
  STATUS = fiber.info()[main_id].status
  API_STATUS = fiber.find(main_id):status()
  table.insert(ORDER, 'child')
  fiber.yield()
  table.insert(ORDER, 'child again')
end
local function starter()
  fiber.create(child)
  table.insert(ORDER, 'creator')
end
starter()
fiber.yield()
table.insert(ORDER, 'creator again')
"#);
    // The creator is suspended inside fiber.create, in its Lua caller, while the child runs.
    assert_eq!(
        result(&host, "RESULT"),
        v(&[
            "C yield_to_id",
            "C f_create",
            "L create in =[C]:-1",
            "L starter in @t.lua:13",
            "L main chunk in @t.lua:16",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
    let g = host.lua().globals();
    // Ready to go on (info's own status), "suspended" in Tarantool's terms.
    assert_eq!(g.get::<String>("STATUS").unwrap(), "ready");
    assert_eq!(g.get::<String>("API_STATUS").unwrap(), "suspended");
    // The child runs first; when it yields, the creator goes on at once.
    let order: Vec<String> = g
        .get::<Table>("ORDER")
        .unwrap()
        .sequence_values::<String>()
        .map(|s| s.unwrap())
        .collect();
    assert_eq!(order, ["child", "creator", "child again", "creator again"]);
}

#[test]
fn a_trace_read_before_a_fiber_moved_on_is_not_reused_for_its_next_suspension() {
    let host = run(r#"local fiber = require('fiber')
local main_id = fiber.id()
local function park()
  fiber.sleep(0.001)
end
local function child()
  SECOND = fiber.info()[main_id].backtrace
end
local function starter()
  fiber.create(child)
end
fiber.create(function()
  fiber.yield()
  FIRST = fiber.info()[main_id].backtrace
end)
park()
starter()
"#);
    // Read while the main fiber slept in park() (and cached), then read again while it
    // waits inside fiber.create: a new suspension, a new trace.
    assert_eq!(
        result(&host, "FIRST"),
        v(&[
            "C sleep",
            "C f_sleep",
            "L sleep in =[C]:-1",
            "L park in @t.lua:4",
            "L main chunk in @t.lua:16",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
    assert_eq!(
        result(&host, "SECOND"),
        v(&[
            "C yield_to_id",
            "C f_create",
            "L create in =[C]:-1",
            "L starter in @t.lua:10",
            "L main chunk in @t.lua:17",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
}

/// Fibers parked in the same function, some at one line and some at another, then moved to
/// the other line: each listing gives each fiber the line it waits at now (fibers parked at
/// the same place share their trace's merge; one Lua level's line apart, they do not).
#[test]
fn fibers_parked_alike_but_a_line_apart_each_get_their_own_line() {
    let host = run(r#"local fiber = require('fiber')
local where = {}
local function sleeper(i)
  while true do
    if where[i] == 'a' then
      fiber.sleep(100)
    else
      fiber.sleep(100)
    end
  end
end
local fs = {}
for i = 1, 6 do
  where[i] = (i % 3 == 1) and 'a' or 'b'
  fs[i] = fiber.create(sleeper, i)
end
local function lines()
  local info, out = fiber.info(), {}
  for i, f in ipairs(fs) do
    for _, e in ipairs(info[f:id()].backtrace) do
      if e.L and e.L:find('t.lua:3>', 1, true) then out[#out + 1] = e.L:match(':(%d+)$') end
    end
  end
  return table.concat(out, ' ')
end
R = {lines(), lines()}
for i = 1, 6 do where[i] = (where[i] == 'a') and 'b' or 'a' end
for i = 1, 6 do fs[i]:wakeup() end
fiber.yield()
R[3] = lines()
for i = 1, 6 do fs[i]:wakeup() end
fiber.yield()
R[4] = lines()
"#);
    assert_eq!(
        global_seq::<String>(&host, "R"),
        v(&["6 8 8 6 8 8", "6 8 8 6 8 8", "8 6 6 8 6 6", "8 6 6 8 6 6"])
    );
}

/// The listing's memo of Lua levels (fibers parked at the same place read once per call)
/// gives each fiber exactly the trace the debug API gives, for stacks of every kind — Lua
/// calls, a tail call, a vararg function, `pcall`, `xpcall`, a comparator called by
/// `table.sort`, `__index` (also a vararg one), `__call` and `__concat` functions
/// (continuation frames), a method, a channel wait, a function loaded from stripped
/// bytecode, one closure per fiber of the same function, coroutines inside the fiber
/// (`coroutine.wrap` and `coroutine.resume`) and a stack deeper than the memo covers (these
/// three read through the debug API) — after the JIT compiled their loops (calls stitched
/// to traces: continuation frames); three fibers per kind, the traces and merges kept
/// forgotten between the listings compared. The memo is used where the stack allows (two
/// of three fibers of each such kind come from it).
#[test]
fn the_level_memo_gives_what_the_debug_api_gives() {
    let host = LuaHost::new().unwrap();
    let lua = host.lua();
    lua.globals()
        .set(
            "memo",
            lua.create_function(|_, on: bool| Ok(fibertrace_lua::host::set_lua_level_memo(on)))
                .unwrap(),
        )
        .unwrap();
    // A C function that waits with all its arguments on the Lua stack (a cancellation, when
    // the host is dropped, becomes a Lua error: an unwinding must not cross Lua's frames).
    unsafe extern "C-unwind" fn tcb_wait(l: *mut mlua::ffi::lua_State) -> std::ffi::c_int {
        let waited = std::panic::catch_unwind(|| {
            fibertrace_fiber::sleep(std::time::Duration::from_secs(100))
        });
        if waited.is_err() {
            fibertrace_fiber::cancellation_caught();
            // SAFETY: `l` is the state calling this C function, which has room for a value.
            unsafe {
                mlua::ffi::lua_pushstring(l, c"cancelled".as_ptr());
                mlua::ffi::lua_error(l);
            }
        }
        0
    }
    lua.globals()
        .set(
            "tcb_wait",
            // SAFETY: `tcb_wait` touches no Lua state and returns no values.
            unsafe { lua.create_c_function(tcb_wait) }.unwrap(),
        )
        .unwrap();
    let src = r#"local fiber = require('fiber')
local unpack = table.unpack or unpack
local ch = fiber.channel(1)
local function leaf() while true do fiber.sleep(100) end end
local function mid() leaf() end
local obj = {}
function obj:wait() while true do fiber.sleep(100) end end
local function deep(n) if n == 0 then leaf() end deep(n - 1) end
local big = {}
for i = 1, 400 do big[i] = (i * 7919) % 401 end
local shapes = {
  plain = function() mid() end,
  tail = function() return mid() end,
  vararg = function(...) local n = select('#', ...) while true do fiber.sleep(100) end end,
  pcall = function() pcall(function() while true do fiber.sleep(100) end end) end,
  sort = function()
    local t = {unpack(big)}
    table.sort(t, function(a, b) fiber.sleep(100) return a < b end)
    leaf()
  end,
  meta = function() local t = setmetatable({}, {__index = function() leaf() end}) return t.x end,
  co = function() local co = coroutine.wrap(function() leaf() end) co() end,
  deep = function() deep(40) end,
  method = function() obj:wait() end,
  chan = function() while true do ch:get() end end,
  xpcall = function() xpcall(function() leaf() end, debug.traceback) end,
  call = function() local t = setmetatable({}, {__call = function() leaf() end}) t() end,
  concat = function() local t = setmetatable({}, {__concat = function() leaf() end}) return t .. 'x' end,
  varmeta = function() local t = setmetatable({}, {__index = function(...) leaf() end}) return t.x end,
  resume = function() local co = coroutine.create(function() leaf() end) coroutine.resume(co) end,
  stripped = load(string.dump(function() while true do require('fiber').sleep(100) end end, true)),
}
-- Each fiber of this kind runs a closure of its own (of the same function), as a server
-- makes one per connection.
local function closure() return function() mid() end end
local names = {'closure'}
for k in pairs(shapes) do names[#names + 1] = k end
table.sort(names)
local fs = {}
for _, name in ipairs(names) do
  for _ = 1, 3 do fs[#fs + 1] = {name, fiber.create(shapes[name] or closure())} end
end
-- One call site, waiting with 1 argument or with 7999 (past what the debug API's reader
-- may add to: it reads no Lua level of that fiber).
local function wide(t) while true do tcb_wait(unpack(t)) end end
-- Interpreted, so that the narrow and the wide waiters' frames are alike (compiled, the
-- narrow one's call would be stitched to a trace and the wide one's not).
if jit then jit.off(wide, true) end
local huge = {}
for i = 1, 7999 do huge[i] = i end
for _, t in ipairs({{1}, huge, {1}, huge}) do fs[#fs + 1] = {'wide' .. #t, fiber.create(wide, t)} end
for _ = 1, 120 do
  for _, f in ipairs(fs) do f[2]:wakeup() end
  fiber.yield()
end
local function snap()
  local info, out = fiber.info(), {}
  for i, f in ipairs(fs) do
    local parts = {}
    for _, e in ipairs(info[f[2]:id()].backtrace) do parts[#parts + 1] = e.C or e.L end
    out[i] = f[1] .. ': ' .. table.concat(parts, ' | ')
  end
  return out
end
local h0 = memo(true)
A = snap()
local h1 = memo(false)
B = snap()
local h2 = memo(true)
C = snap()
local h3 = memo(true)
HITS = {h1 - h0, h2 - h1, h3 - h2}
"#;
    if let Err(e) = host.run_main("@t.lua", src.as_bytes(), &[]) {
        panic!("script failed: {e}");
    }
    let list = |name: &str| global_seq::<String>(&host, name);
    let (a, b, c) = (list("A"), list("B"), list("C"));
    assert_eq!(a.len(), 55);
    for ((x, y), z) in a.iter().zip(&b).zip(&c) {
        assert_eq!(x, y, "with the memo, then without");
        assert_eq!(x, z, "with the memo again");
    }
    let hits = global_seq::<i64>(&host, "HITS");
    // Fourteen kinds of seventeen have a shape (not the two coroutines', not the deep one):
    // the second and third fibers of each come from the memo, and the second narrow waiter;
    // none without it.
    let expect = if LUAJIT { 29 } else { 0 };
    // (LuaJIT's reader gets no room past 8,000 slots; Lua 5.4's does.)
    for i in [52, 54] {
        assert_eq!(a[i].contains(" in @"), !LUAJIT, "a wide waiter: {}", a[i]);
    }
    for i in [51, 53] {
        assert!(a[i].contains(" in @t.lua"), "{}", a[i]);
    }
    assert_eq!(hits, [expect, 0, expect]);
}

/// Entries share equal `memory` tables within a result (as they share backtraces): fibers
/// parked alike (the same stack in use) get one table, fibers whose stacks differ their
/// own, each holding exactly `used` and `total` as the fiber's own `info()` gives them.
#[test]
fn info_entries_share_equal_memory_tables_and_only_those() {
    let host = run(r#"local fiber = require('fiber')
local function park() fiber.sleep(100) end
local a, b = {}, {}
for i = 1, 3 do a[i] = fiber.create(park) end
for i = 1, 2 do
  b[i] = fiber.create(function() table.sort({3, 2, 1}, function(x, y) park() return x < y end) end)
end
local info = fiber.info()
local function mem(f) return info[f:id()].memory end
local function same(f) local m, own = mem(f), f:info().memory
  local n = 0
  for _ in pairs(m) do n = n + 1 end
  return n == 2 and m.used == own.used and m.total == own.total and m.used > 0
end
R = {
  tostring(rawequal(mem(a[1]), mem(a[2])) and rawequal(mem(a[1]), mem(a[3]))),
  tostring(rawequal(mem(b[1]), mem(b[2]))),
  tostring(rawequal(mem(a[1]), mem(b[1]))),
  tostring(mem(a[1]).used < mem(b[1]).used),
  tostring(same(a[1]) and same(a[3]) and same(b[2])),
}
"#);
    assert_eq!(
        global_seq::<String>(&host, "R"),
        v(&["true", "true", "false", "true", "true"])
    );
}

/// A script that reaches the host's table of fiber objects through the debug library and
/// puts other values where the objects made ahead for the next fibers are (another
/// userdata, a table, nil), or replaces the table itself, gets a clear error from
/// `fiber.create` and `fiber.new` — never an id written into another object's block — and
/// the objects of live fibers are theirs as before.
#[test]
fn fiber_objects_made_ahead_survive_a_script_that_changes_them() {
    let host = run(r#"local fiber = require('fiber')
local first = fiber.create(function() fiber.sleep(10) end)
-- Find the host's object table: the registry table that holds `first`.
local reg, key, objs = debug.getregistry(), nil, nil
for k, v in pairs(reg) do
  if type(v) == 'table' then
    for _, o in pairs(v) do
      if rawequal(o, first) then key, objs = k, v end
    end
  end
end
assert(objs, 'the object table was not found')
local log = {}
local function try(what, f)
  local ok, err = pcall(f, function() end)
  log[#log + 1] = what .. ' ' .. (ok and 'made' or tostring(err))
end
-- Every other fiber object in it (those made ahead) becomes something else, in turns: a
-- userdata too small for a fiber's block that carries the fiber metatable, a table, nil.
local small = newproxy and newproxy(false) or io.stdout
if newproxy then debug.setmetatable(small, debug.getmetatable(first)) end
local other = {small, {}, false}
local n = 0
for k, o in pairs(objs) do
  if not rawequal(o, first) then
    n = n + 1
    objs[k] = other[n % 3 + 1] or nil
  end
end
try('create', fiber.create)
try('new', fiber.new)
try('create', fiber.create)
-- The stdout handle still works (no id was written into its block).
log[#log + 1] = 'stdout ' .. io.type(io.stdout)
-- The whole table replaced.
reg[key] = 42
try('create', fiber.create)
try('new', fiber.new)
reg[key] = objs
log[#log + 1] = 'first ' .. tostring(rawequal(fiber.find(first:id()), first)) .. ' ' .. first:status()
first:cancel()
LOG = table.concat(log, '|')
"#);
    let e = "fibertrace: the host's table of fiber objects was changed by the script";
    let log: String = host.lua().globals().get("LOG").unwrap();
    let lines: Vec<&str> = log.split('|').collect();
    // Every object made ahead was changed: each create meets one (and gives its slot back).
    let want: Vec<String> = vec![
        format!("create {e}"),
        format!("new {e}"),
        format!("create {e}"),
        "stdout file".into(),
        format!("create {e}"),
        format!("new {e}"),
        "first true suspended".into(),
    ];
    assert_eq!(lines, want, "{log}");
}

/// A script can move any of the host's metatables onto any other userdata
/// (`debug.setmetatable`): a fiber's onto a channel, a channel's onto a condition or a fiber
/// object, any of them onto a file or a zero-size userdata. Each method then refuses the value
/// as not its type (its block carries its type's tag): before, a fiber's id was read as a
/// channel's pointer (a crash) and a channel's block used as a condition's. Given its own
/// metatable back, each object works as before (nothing was written into it).
#[test]
fn a_host_metatable_moved_onto_another_userdata_is_refused() {
    let host = run(r#"local fiber = require('fiber')
local mt = {
  fiber = debug.getmetatable(fiber.self()),
  channel = debug.getmetatable(fiber.channel()),
  cond = debug.getmetatable(fiber.cond()),
}
local call = {
  fiber = function(u) return u:status() end,
  channel = function(u) return u:put(1, 0) end,
  cond = function(u) return u:signal() end,
}
local make = {
  fiber = function() return fiber.create(function() end) end,
  channel = function() return fiber.channel(1) end,
  cond = function() return fiber.cond() end,
  file = function() return io.tmpfile() end,
}
if newproxy then make.proxy = function() return newproxy(false) end end
local log = {}
for _, t in ipairs({'fiber', 'channel', 'cond'}) do
  for _, v in ipairs({'fiber', 'channel', 'cond', 'file', 'proxy'}) do
    if v ~= t and make[v] then
      local u = make[v]()
      local own = debug.getmetatable(u)
      debug.setmetatable(u, mt[t])
      local ok, err = pcall(call[t], u)
      debug.setmetatable(u, own)
      local back = call[v] and tostring((call[v](u))) or tostring(io.type(u))
      log[#log + 1] = t .. ' on ' .. v .. ': ' .. tostring(ok) .. ' ' .. tostring(err) .. ' / ' .. back
    end
  end
end
LOG = table.concat(log, '|')
"#);
    let log: String = host.lua().globals().get("LOG").unwrap();
    let got: Vec<&str> = log.split('|').collect();
    let mut want = Vec::new();
    for (t, what, line, method) in [
        ("fiber", "fiber", 8, "status"),
        ("channel", "fiber.channel", 9, "put"),
        ("cond", "fiber.cond", 10, "signal"),
    ] {
        // (Lua 5.4's luaL_argerror names a method's bad self and where it was called.)
        let err = if cfg!(feature = "lua54") {
            format!("t.lua:{line}: calling '{method}' on bad self ({what} expected, got userdata)")
        } else {
            format!("bad argument #1 to '?' ({what} expected, got userdata)")
        };
        for (v, back) in [
            ("fiber", "dead"),
            ("channel", "true"),
            ("cond", "nil"),
            ("file", "file"),
            ("proxy", ""),
        ] {
            if v == t || (v == "proxy" && cfg!(feature = "lua54")) {
                continue;
            }
            let back = if v == "proxy" { "nil" } else { back };
            want.push(format!("{t} on {v}: false {err} / {back}"));
        }
    }
    assert_eq!(got, want, "{log}");
}

/// `fiber.info()` builds its entries with Lua functions the host keeps in the registry; a
/// script reaches them (`debug.getregistry()`). Replaced — one of them by the script's own
/// function (which would run in the middle of a listing), by a number, or the whole table by
/// a thread or nil — `fiber.info()` and `fiber_object:info()` raise a clear error (before: a
/// thread or nil there was read as a table, a crash), and work again once they are put back.
#[test]
fn fiber_info_refuses_constructors_changed_by_the_script() {
    let host = run(r#"local fiber = require('fiber')
local reg, key = debug.getregistry(), nil
for k, v in pairs(reg) do
  if type(v) == 'table' and type(v[1]) == 'function'
     and debug.getinfo(v[1], 'S').source == '=fiber.info' then key = k end
end
assert(key, 'the constructors were not found')
local t = reg[key]
local log = {}
local function try(what)
  local ok, err = pcall(fiber.info)
  local ok2, err2 = pcall(fiber.self().info, fiber.self())
  log[#log + 1] = what .. ': ' .. (ok and type(err) or err) .. ' / ' .. (ok2 and type(err2) or err2)
end
local orig = t[1]
t[1] = function() error('the script ran') end
try('own function')
t[1] = 42
try('number')
t[1] = orig
try('put back')
reg[key] = coroutine.create(function() end)
try('thread')
reg[key] = nil
try('nil')
reg[key] = t
try('table back')
LOG = table.concat(log, '|')
"#);
    let e = "fibertrace: the host's fiber.info constructors were changed by the script";
    let log: String = host.lua().globals().get("LOG").unwrap();
    let lines: Vec<&str> = log.split('|').collect();
    assert_eq!(
        lines,
        [
            format!("own function: {e} / {e}"),
            format!("number: {e} / {e}"),
            "put back: table / table".to_string(),
            format!("thread: {e} / {e}"),
            format!("nil: {e} / {e}"),
            "table back: table / table".to_string(),
        ],
        "{log}"
    );
}

/// A join that waited and finds the fiber's record gone is told why: another join took the
/// results (Tarantool's text), the fiber was made non-joinable meanwhile (it was released at
/// its end), or it was the main fiber (whose end is the script's). The second and third were
/// told "already joined by concurrent fiber:join()".
#[test]
fn a_join_that_finds_the_fiber_gone_is_told_why() {
    let host = run(r#"local fiber = require('fiber')
LOG = {}
local function log(s) LOG[#LOG + 1] = s end
local k = fiber.new(function() fiber.sleep(0.02) return 'k' end)
k:set_joinable(true)
for i = 1, 2 do
  fiber.create(function() local ok, a = pcall(k.join, k) log('two ' .. tostring(ok) .. ' ' .. tostring(a)) end)
end
local u = fiber.new(function() fiber.sleep(0.02) return 'u' end)
u:set_joinable(true)
fiber.create(function() fiber.sleep(0.001) u:set_joinable(false) end)
local ok, err = pcall(u.join, u)
log('unjoinable ' .. tostring(ok) .. ' ' .. tostring(err))
fiber.sleep(0.03)
local me = fiber.self()
me:set_joinable(true)
fiber.create(function() local ok, a = pcall(fiber.join, me) log('main ' .. tostring(ok) .. ' ' .. tostring(a)) end)
"#);
    let mut log: Vec<String> = host.lua().globals().get("LOG").unwrap();
    // (The fibers wake in an order the timers decide: sorted.)
    log.sort();
    assert_eq!(
        log,
        [
            "main false the main fiber ended: its results are the script's, not kept for a join",
            "two false the fiber is already joined by concurrent fiber:join()",
            "two true true",
            "unjoinable false the fiber was made non-joinable while it was being joined",
        ],
        "{log:?}"
    );
}

/// A script can replace any value the host keeps in the registry (`debug.getregistry()`):
/// its protected-call trampoline, its tables of objects and constructors, its metatables.
/// Whatever it puts there (nil, a number, its own function, a thread), every fiber, channel
/// and condition function still returns or raises a Lua error — no crash (`fiber.info()`
/// read a replaced table of constructors as a table: SIGSEGV) — and with the values put
/// back, all work as before.
#[test]
fn the_host_survives_any_registry_slot_replaced_by_the_script() {
    let host = run(r#"local fiber = require('fiber')
local reg = debug.getregistry()
local keys = {}
for k in pairs(reg) do if type(k) == 'number' then keys[#keys + 1] = k end end
table.sort(keys)
local function battery()
  local out = {}
  local ops = {
    function() return fiber.create(function() end) end,
    function() local f = fiber.new(function() return 1 end) f:set_joinable(true) return f:join() end,
    function() return fiber.channel(1):put(1, 0) end,
    function() local c = fiber.cond() c:signal() return c:wait(0) end,
    function() return fiber.info() end,
    function() return fiber.self():info() end,
    function() return fiber.self():name() end,
    function() return fiber.find(fiber.id()) end,
    function() return fiber.sleep(0) end,
  }
  for i, op in ipairs(ops) do out[i] = pcall(op) end
  return out
end
local junk = {false, 42, function() error('the script ran') end, coroutine.create(function() end)}
local rounds = 0
for _, k in ipairs(keys) do
  local saved = reg[k]
  for _, j in ipairs(junk) do
    reg[k] = j or nil
    battery()
    reg[k] = saved
    rounds = rounds + 1
  end
end
local after = battery()
local all = true
for _, ok in ipairs(after) do all = all and ok end
RESULT = string.format('%d keys, %d rounds, all work after: %s', #keys, rounds, tostring(all))
NKEYS = #keys
"#);
    let n: usize = host.lua().globals().get("NKEYS").unwrap();
    // (The host keeps about ten values there, by reference number: the test covers them all.)
    assert!(n >= 10, "{n}");
    let result: String = host.lua().globals().get("RESULT").unwrap();
    assert_eq!(
        result,
        format!("{n} keys, {} rounds, all work after: true", n * 4)
    );
}

/// A SIGQUIT handler that does nothing (the process then *handles* SIGQUIT).
extern "C" fn quiet(_: libc::c_int) {}

/// Installs [`quiet`] for signal `sig` in this test process (no test here sends it).
fn handle_quietly(sig: libc::c_int) {
    // SAFETY: a handler that does nothing; the structure is plain data, initialized before
    // the call.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = quiet as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut act.sa_mask);
        assert_eq!(libc::sigaction(sig, &act, std::ptr::null_mut()), 0);
    }
}

/// `os.execute` gives each flavour's own results — with the C library's `system()` when the
/// process does not handle SIGQUIT, and with the host's own spawn (which leaves SIGQUIT to
/// the process's handler while the command runs) when it does: the same results both ways.
#[test]
fn os_execute_gives_each_flavours_results_whether_or_not_sigquit_is_handled() {
    let _one = SIGNALS.lock().unwrap_or_else(|p| p.into_inner());
    let src = r#"
        results = {}
        local function add(...)
          local t = {}
          for i = 1, select('#', ...) do t[i] = tostring((select(i, ...))) end
          results[#results + 1] = table.concat(t, ",")
        end
        add(os.execute("exit 3"))
        add(os.execute("kill -9 $$"))
        add(os.execute("true"))
        add(os.execute() and "shell" or "no shell")
        add(os.execute(nil) and "shell" or "no shell")
        add(os.execute("exit 5\0ignored"))
        add(os.execute(0 + 0x7f000000))
        local ok, e = pcall(os.execute, {})
        add(ok, e:match("^bad argument #1 to '.-' %(string expected, got table%)$") ~= nil)
    "#;
    let want: Vec<String> = if LUAJIT {
        v(&[
            "768",
            "9",
            "0",
            "shell",
            "shell",
            "1280",
            "32512",
            "false,true",
        ])
    } else {
        v(&[
            "nil,exit,3",
            "nil,signal,9",
            "true,exit,0",
            "shell",
            "shell",
            "nil,exit,5",
            "nil,exit,127",
            "false,true",
        ])
    };
    let host = run(src);
    assert_eq!(global_seq::<String>(&host, "results"), want);
    drop(host);
    handle_quietly(libc::SIGQUIT);
    let host = run(src);
    assert_eq!(global_seq::<String>(&host, "results"), want);
    // SAFETY: the default action back.
    unsafe { libc::signal(libc::SIGQUIT, libc::SIG_DFL) };
}

/// The tests that change this process's signal dispositions, one at a time.
static SIGNALS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The SIGINT disposition now (its handler's address, or `SIG_IGN`/`SIG_DFL`).
fn sigint_action() -> libc::sighandler_t {
    // SAFETY: reads the disposition into a zeroed structure (a null new action changes nothing).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(libc::SIGINT, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

/// Two hosts on two threads run a command each at the same moment (each command waits for the
/// other's mark, so neither ends unless both run at once), with SIGQUIT handled (the host's
/// own spawn): each gets its own command's status, SIGINT is ignored while either runs, and
/// the disposition the first one found is back once both have ended, whichever ends first.
#[test]
fn two_hosts_running_os_execute_at_once_each_get_their_status_and_sigint_comes_back() {
    let _one = SIGNALS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = Scratch::new("execute-two");
    handle_quietly(libc::SIGQUIT);
    handle_quietly(libc::SIGINT);
    let handler = quiet as extern "C" fn(libc::c_int) as libc::sighandler_t;
    assert_eq!(sigint_action(), handler);
    // Each command marks its start, waits (5 s at most) for the other's mark, then for a
    // last mark this test makes once it has seen SIGINT ignored, and exits with its code.
    let d = dir.path().display().to_string();
    let cmd = |me: &str, other: &str, code: u8, hold: &str| {
        format!(
            "touch {d}/{me}; i=0; while [ ! -e {d}/{other} ] || [ ! -e {d}/{hold} ]; do \
             i=$((i+1)); [ $i -gt 500 ] && exit 99; sleep 0.01; done; exit {code}"
        )
    };
    let threads: Vec<_> = [("a", "b", 3u8, "go_a"), ("b", "a", 4, "go_b")]
        .into_iter()
        .map(|(me, other, code, hold)| {
            let src = format!(
                "local a, b, c = os.execute({:?})\n\
                 status = table.concat({{tostring(a), tostring(b), tostring(c)}}, ',')",
                cmd(me, other, code, hold)
            );
            std::thread::spawn(move || {
                let host = run(&src);
                host.lua().globals().get::<String>("status").unwrap()
            })
        })
        .collect();
    // Both commands run: SIGINT is ignored in this process now.
    let t0 = std::time::Instant::now();
    while !(dir.path().join("a").exists() && dir.path().join("b").exists()) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "both commands started"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        sigint_action(),
        libc::SIG_IGN,
        "SIGINT ignored while commands run"
    );
    // The first ends; the other still runs, and SIGINT stays ignored.
    std::fs::write(dir.path().join("go_a"), "").unwrap();
    let mut it = threads.into_iter();
    let a = it.next().unwrap().join().unwrap();
    assert_eq!(
        sigint_action(),
        libc::SIG_IGN,
        "still ignored while one runs"
    );
    std::fs::write(dir.path().join("go_b"), "").unwrap();
    let b = it.next().unwrap().join().unwrap();
    let want = |code: i32| {
        if LUAJIT {
            format!("{},nil,nil", code << 8)
        } else {
            format!("nil,exit,{code}")
        }
    };
    assert_eq!((a, b), (want(3), want(4)));
    assert_eq!(
        sigint_action(),
        handler,
        "the disposition found first is back"
    );
    // SAFETY: the default actions back.
    unsafe {
        libc::signal(libc::SIGQUIT, libc::SIG_DFL);
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}
