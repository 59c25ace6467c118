//! C stack overflow in Lua code: `C stack overflow`, a Lua error `pcall` catches, on every
//! path where C functions nest Lua calls, JIT on or off; the program goes on, and the next
//! overflow (of the same fiber, of others at once) is caught the same way. The depth reached
//! before the error is at least Tarantool's (measured with Tarantool 2.6 on the same machine:
//! nested `string.gsub` 58 levels, `table.sort` 2,147, `load` readers 947, `__tostring` in
//! `string.format` 2,300, `coroutine.wrap` 6,439, each a crash there).
//!
//! Lua 5.4 counts its C levels itself and raises its own error at 200: its fibers' stacks
//! must hold those 200 levels on every path, also when Lua's C code is built without
//! optimization (the last test).

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_fibertrace");

/// Writes `src` to a temporary script and runs it with `args`: (stdout, stderr, exit code).
fn run(name: &str, src: &str, args: &[&str]) -> (String, String, Option<i32>) {
    let dir = Scratch::new("cstack");
    let path = dir.join(name);
    std::fs::write(&path, src).unwrap();
    let o = Command::new(EXE)
        .arg("run")
        .arg(name)
        .args(args)
        .current_dir(&dir)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code(),
    )
}

/// One script per path: recursion through the C function until the error, counted.
#[cfg(feature = "luajit")]
const PATHS: &str = r#"
local kind, jit_on = arg[1], arg[2] == 'on'
if not jit_on then jit.off() end
local n = 0
local f
if kind == 'gsub' then
  f = function() n = n + 1; string.gsub('a', 'a', function() f() end) end
elseif kind == 'sort' then
  f = function() n = n + 1; table.sort({1, 2}, function(a, b) f() return a < b end) end
elseif kind == 'load' then
  f = function()
    n = n + 1
    local done = false
    local g, err = load(function() if done then return nil end done = true; f(); return 'return 1' end)
    if not g then error(err, 0) end
  end
elseif kind == 'format' then
  local mt = {}
  mt.__tostring = function() n = n + 1; return string.format('%s', setmetatable({}, mt)) end
  f = function() return tostring(setmetatable({}, mt)) end
elseif kind == 'coro' then
  f = function() n = n + 1; coroutine.wrap(f)() end
end
local ok, err = pcall(f)
err = tostring(err)
print(ok, err:sub(-16), n)
"#;

#[test]
#[cfg(feature = "luajit")]
fn every_c_path_raises_c_stack_overflow_past_tarantools_depth() {
    // (path, Tarantool's depth at its crash)
    let paths = [
        ("gsub", 58),
        ("sort", 2147),
        ("load", 947),
        ("format", 2300),
        ("coro", 6439),
    ];
    for jit in ["on", "off"] {
        for (kind, tarantool) in paths {
            let (out, err, code) = run("paths.lua", PATHS, &[kind, jit]);
            assert_eq!(code, Some(0), "{kind} jit {jit}: {err}");
            let f: Vec<&str> = out.trim_end().split('\t').collect();
            assert_eq!(
                f[..2],
                ["false", "C stack overflow"],
                "{kind} jit {jit}: {out}"
            );
            let depth: u32 = f[2].parse().unwrap();
            assert!(
                depth > tarantool,
                "{kind} jit {jit}: {depth} levels, Tarantool {tarantool}"
            );
        }
    }
}

/// The error names where it happened; it is caught again and again in one fiber, in several
/// fibers overflowing at once (each with its own error), in the main fiber; a hook the script
/// had set is back afterwards; an overflow nobody catches ends its fiber with the error, and
/// the program goes on.
#[test]
#[cfg(feature = "luajit")]
fn overflows_are_caught_again_in_every_fiber_and_the_program_goes_on() {
    let src = r#"local fiber = require('fiber')
local function r() fiber.yield(); return (string.gsub('a', 'a', function() return r() end)) end
local done = 0
for i = 1, 3 do
  fiber.create(function()
    print(i, pcall(r))
    done = done + 1
  end)
end
while done < 3 do fiber.sleep(0.001) end
for i = 1, 3 do print('again', i, pcall(r)) end
local hf = function() end
debug.sethook(hf, 'r', 7)
print(pcall(r))
local h, m, c = debug.gethook()
print(h == hf, m, c)
debug.sethook()
local f = fiber.create(function() r() end)
f:set_joinable(true)
print(f:join())
print('after')
"#;
    let (out, err, code) = run("again.lua", src, &[]);
    let e = "again.lua:2: C stack overflow";
    assert_eq!(
        out,
        format!(
            "1\tfalse\t{e}\n2\tfalse\t{e}\n3\tfalse\t{e}\nagain\t1\tfalse\t{e}\n\
             again\t2\tfalse\t{e}\nagain\t3\tfalse\t{e}\nfalse\t{e}\ntrue\tr\t7\n\
             false\t{e}\nafter\n"
        ),
        "{err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

/// A script whose main chunk overflows without catching it fails as with any error: the
/// message, exit code 1, and what it printed before is kept.
#[test]
#[cfg(feature = "luajit")]
fn an_uncaught_overflow_is_the_scripts_error() {
    let src = "print('before')\n\
               local function r() return (string.gsub('a', 'a', function() return r() end)) end\n\
               r()\n";
    let (out, err, code) = run("uncaught.lua", src, &[]);
    assert_eq!(out, "before\n");
    assert_eq!(code, Some(1));
    assert_eq!(
        err.lines().next(),
        Some("uncaught.lua:2: C stack overflow"),
        "{err}"
    );
}

/// After the error, going a quarter of the reserve deeper again gets another one: code that
/// catches the error deep in the stack and recurses again ends in an error, not in the guard.
/// (An `xpcall` message handler that recurses again still reaches the guard: it runs inside
/// the hook that raised the error, where LuaJIT calls no hook.)
/// A recursion through C whose every level catches the error itself and goes deeper
/// anyway (`pcall` of a shallow C call at each level, through `gsub` and through `sort`, in
/// the main fiber and in another): in the deepest quarter of the reserve every instruction
/// raises again, so the error climbs to the outer `pcall` instead of the recursion reaching
/// the guard (the process stopped with the overflow report, SIGSEGV).
#[test]
#[cfg(feature = "luajit")]
fn a_recursion_that_catches_each_overflow_and_goes_deeper_still_gets_the_error() {
    let src = r#"
local fiber = require('fiber')
local function shallow() return pcall(string.gsub, 'x', 'x', function() return 'y' end) end
local function via_gsub() shallow() return (('x'):gsub('x', via_gsub)) end
local function via_sort() table.sort({2, 1}, function(a, b) shallow() via_sort() return a < b end) end
for _, jit_on in ipairs({false, true}) do
  if jit_on then jit.on() else jit.off() end
  for name, f in pairs({gsub = via_gsub, sort = via_sort}) do
    local ok, e = pcall(f)
    print(name, jit_on, ok, tostring(e):sub(-16))
    local fb = fiber.new(function() return pcall(f) end)
    fb:set_joinable(true)
    local _, ok2, e2 = fb:join()
    print(name, jit_on, 'fiber', ok2, tostring(e2):sub(-16))
  end
end
print('end')
"#;
    let (out, err, code) = run("catch_each.lua", src, &[]);
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    let mut want = Vec::new();
    for name in ["gsub", "sort"] {
        for jit in ["false", "true"] {
            want.push(format!("{name}\t{jit}\tfalse\tC stack overflow"));
            want.push(format!("{name}\t{jit}\tfiber\tfalse\tC stack overflow"));
        }
    }
    want.push("end".to_string());
    want.sort();
    assert_eq!(lines, want, "{err}");
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "luajit")]
fn recursing_again_after_the_error_raises_again_instead_of_reaching_the_guard() {
    let src = r#"
jit.off()
local function deep(n)
  string.gsub('a', 'a', function() deep(n + 1) end)
end
-- Caught deep (a pcall at every level), then deeper again from where it was caught.
local again = 0
local function catcher(n)
  string.gsub('a', 'a', function()
    local ok, e = pcall(catcher, n + 1)
    if not ok then
      if again < 3 then
        again = again + 1
        local ok2, e2 = pcall(deep, 0)
        print('again', again, ok2, tostring(e2):sub(-16))
      end
      error(e, 0)
    end
  end)
end
local okc, ec = pcall(catcher, 0)
print('caught', okc, tostring(ec):sub(-16))
print('end')
"#;
    let (out, err, code) = run("again.lua", src, &[]);
    assert_eq!(
        out,
        "again\t1\tfalse\tC stack overflow\n\
         again\t2\tfalse\tC stack overflow\n\
         again\t3\tfalse\tC stack overflow\n\
         caught\tfalse\tC stack overflow\n\
         end\n",
        "{err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "luajit")]
fn an_overflow_inside_a_gc_finalizer_is_the_finalizers_error_and_the_program_goes_on() {
    // LuaJIT runs finalizers with hooks off; the overflow must still become an error there.
    let src = r#"
jit.off()
local depth = 0
local function f() depth = depth + 1; string.gsub('a', 'a', f) end
local p = newproxy(true)
getmetatable(p).__gc = function()
  local ok, e = pcall(f)
  print('in finalizer', ok, tostring(e):sub(-16), depth > 50)
  depth = 0
  f() -- uncaught: the finalizer's error
end
p = nil
collectgarbage()
collectgarbage()
-- The next overflow, outside any finalizer, is caught as before.
depth = 0
local ok, e = pcall(f)
print('after', ok, tostring(e):sub(-16), depth > 50)
print('end')
"#;
    let (out, err, code) = run("gc.lua", src, &[]);
    assert_eq!(
        out,
        "in finalizer\tfalse\tC stack overflow\ttrue\n\
         after\tfalse\tC stack overflow\ttrue\n\
         end\n",
        "{err}"
    );
    assert!(
        err.contains("ERROR in finalizer: ") && err.contains("C stack overflow"),
        "{err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "luajit")]
fn a_message_handler_that_overflows_again_gets_error_in_error_handling() {
    // The handler runs inside the hook that raised the first error, deep in the reserve; one
    // that catches each new overflow gets it again every time, not the guard.
    let src = r#"
jit.off()
local function f() string.gsub('a', 'a', f) end
local calls = 0
local function handler(e)
  calls = calls + 1
  f()
  return e
end
local ok, e = xpcall(f, handler)
print('xpcall', ok, e, calls)
-- A handler that catches each new overflow and nests again, five times.
local caught = 0
local function patient(e)
  for _ = 1, 5 do
    local okf, ef = pcall(f)
    if not okf and tostring(ef):sub(-16) == 'C stack overflow' then caught = caught + 1 end
  end
  return 'handled ' .. caught
end
print('patient', xpcall(f, patient))
local ok2, e2 = pcall(f)
print('after', ok2, tostring(e2):sub(-16))
print('end')
"#;
    let (out, err, code) = run("handler.lua", src, &[]);
    assert_eq!(
        out,
        "xpcall\tfalse\terror in error handling\t1\n\
         patient\tfalse\thandled 5\n\
         after\tfalse\tC stack overflow\n\
         end\n",
        "{err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "lua54")]
fn lua54_raises_its_own_c_stack_overflow_on_every_path_inside_the_fiber_stack() {
    let src = r#"
local function gsub(n) string.gsub('a', 'a', function() gsub(n + 1) end) end
local function sort(n) table.sort({1, 2}, function(a, b) sort(n + 1) return a < b end) end
local mt = {}
mt.__tostring = function() return string.format('%s', setmetatable({}, mt)) end
local function format() return tostring(setmetatable({}, mt)) end
local function coro() coroutine.wrap(coro)() end
local function reader()
  local done = false
  local g, e = load(function() if done then return nil end done = true; reader(); return 'return 1' end)
  if not g then error(e, 0) end
end
local ix = {}
ix.__index = function(t, k) return setmetatable({}, ix)[k] end
local function index() return setmetatable({}, ix).x end
local function parse() assert(load(string.rep('(', 250) .. '1' .. string.rep(')', 250))) end
for _, c in ipairs({gsub, sort, format, coro, reader, index, parse}) do
  for _ = 1, 2 do
    local ok, e = pcall(c, 0)
    io.write(tostring(ok), ' ', tostring(e):sub(-16), ';')
  end
  print()
end
print('end')
"#;
    let (out, err, code) = run("paths54.lua", src, &[]);
    let line = "false C stack overflow;false C stack overflow;\n";
    assert_eq!(out, format!("{}end\n", line.repeat(7)), "{err}");
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "luajit")]
fn a_hook_set_while_the_reserve_is_open_waits_and_the_next_overflow_is_still_caught() {
    // debug.sethook deep down (in a message handler, before the stack unwinds) must not
    // replace the hook that closes the reserve: it is set once the reserve is closed.
    let src = r#"
jit.off()
local function f() string.gsub('a', 'a', f) end
local count = 0
local function h() count = count + 1 end
print(xpcall(f, function(e) debug.sethook(h, '', 100) return 'handled' end))
local ok, e = pcall(f)
print(ok, tostring(e):sub(-16))
print(count > 0, debug.gethook() == h)
debug.sethook()
print(xpcall(f, function(e) debug.sethook() return 'handled' end))
print(pcall(f))
print(debug.gethook())
-- The kept hook is what debug.gethook answers meanwhile: saving and restoring it deep down
-- keeps it.
debug.sethook(h, 'c', 7)
print(xpcall(f, function(e) debug.sethook(debug.gethook()) return 'kept' end))
local gh, gm, gc = debug.gethook()
print(gh == h, gm, gc)
debug.sethook()
-- Errors name the function and the caller's line, as the original's do.
print(pcall(function() debug.sethook(h) end))
print('end')
"#;
    let (out, err, code) = run("sethook.lua", src, &[]);
    assert_eq!(
        out,
        "false\thandled\n\
         false\tC stack overflow\n\
         true\ttrue\n\
         false\thandled\n\
         false\tsethook.lua:3: C stack overflow\n\
         nil\t\t0\n\
         false\tkept\n\
         true\tc\t7\n\
         false\tsethook.lua:22: bad argument #2 to 'sethook' (string expected, got no value)\n\
         end\n",
        "{err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

#[test]
#[cfg(feature = "luajit")]
fn c_declarations_nested_deeper_than_64_braces_are_refused_before_parsing() {
    // LuaJIT's C parser nests a C call per level of braces with no Lua in between: a few
    // hundred levels ran into the guard.
    let src = r#"
local ffi = require('ffi')
local function nested(n) return string.rep('struct { ', n) .. 'int x;' .. string.rep('} a;', n) end
print(pcall(ffi.cdef, 'typedef ' .. string.rep('struct { ', 64) .. 'int x;'
  .. string.rep('} a;', 63) .. '} deep64_t;'))
print(ffi.sizeof('deep64_t'))
for _, f in ipairs({'cdef', 'typeof', 'new', 'cast', 'sizeof', 'alignof', 'istype', 'metatype'}) do
  local ok, e = pcall(ffi[f], nested(5000), 1)
  print(f, ok, e)
end
-- Braces in comments and literals are not levels; one that hides a real level is seen.
print(pcall(ffi.cdef, '/* {{{{ */ typedef struct { int y; /* } */ } t2_t; // }}}\n'))
print(ffi.sizeof('t2_t'))
print(pcall(ffi.cdef, 'struct s {' .. string.rep('struct { /*}*/ ', 3000) .. 'int x;'
  .. string.rep('} a;', 3000) .. '};'))
print(pcall(ffi.new, 'int[?]', 3))
print('end')
"#;
    let (out, err, code) = run("cdecl.lua", src, &[]);
    let mut want = String::from("true\n4\n");
    for f in [
        "cdef", "typeof", "new", "cast", "sizeof", "alignof", "istype", "metatype",
    ] {
        want += &format!(
            "{f}\tfalse\tffi.{f}: C declaration nested too deep (more than 64 levels of braces)\n"
        );
    }
    want += "true\n4\n\
             false\tffi.cdef: C declaration nested too deep (more than 64 levels of braces)\n\
             true\tcdata<int [?]>: ";
    assert!(out.starts_with(&want), "{out}\n{err}");
    assert!(out.ends_with("\nend\n"), "{out}\n{err}");
    assert_eq!(code, Some(0), "{err}");
}
