//! Tarantool parity of the `fiber`, `clock` and `compat` modules: exact results and error
//! texts (Tarantool 2.6's for what 2.6 has, the newer ones for what came later), including
//! the worst inputs (wrong types, nil, negative, NaN, huge, numeric strings). The scripts of
//! `tests/tarantool/` check the same against Tarantool itself; these pin fibertrace's
//! behaviour under both Lua flavours.
//!
//! Each script appends lines to `OUT` (`out(...)` joins its values' `tostring`s with a
//! space); a line's position in an error text is found by a `--[[name]]` marker on it.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use fibertrace_lua::LuaHost;

const LUAJIT: bool = cfg!(feature = "luajit");

const PRELUDE: &str = r#"local fiber = require('fiber')
local clock = require('clock')
OUT = {}
local function out(...)
  local t = {}
  for i = 1, select('#', ...) do t[i] = tostring((select(i, ...))) end
  OUT[#OUT + 1] = table.concat(t, ' ')
end
local function g(x) return x == nil and 'nil' or string.format('%g', x) end
local function spin(s) local stop = clock.monotonic() + s while clock.monotonic() < stop do end end
"#;

/// Runs `PRELUDE` + `body` as `@t.lua`; returns `OUT`'s lines and the source.
fn run(body: &str) -> (Vec<String>, String) {
    let src = format!("{PRELUDE}{body}");
    let host = LuaHost::new().unwrap();
    if let Err(e) = host.run_main("@t.lua", src.as_bytes(), &[]) {
        panic!("script failed: {e}");
    }
    let t: mlua::Table = host.lua().globals().get("OUT").unwrap();
    let lines = t.sequence_values::<String>().map(|v| v.unwrap()).collect();
    (lines, src)
}

/// `t.lua:N: ` for the line of `src` holding the marker `--[[name]]`.
fn at(src: &str, name: &str) -> String {
    let marker = format!("--[[{name}]]");
    let n = src
        .lines()
        .position(|l| l.contains(&marker))
        .unwrap_or_else(|| panic!("no marker {name}"));
    format!("t.lua:{}: ", n + 1)
}

fn check(got: &[String], want: &[String]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "line {}", i + 1);
    }
    assert_eq!(got.len(), want.len(), "{got:#?}");
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Tarantool 2.6 raises argument errors with `luaL_error`: the calling Lua line's position
/// in front when a Lua function called directly, none from `pcall` or a tail call.
#[test]
fn errors_have_the_callers_position_as_lual_error_gives_it() {
    let (got, src) = run(r#"
out(pcall(fiber.create))
out(pcall(function() local f = fiber.create(nil) return f end)) --[[create]]
out(pcall(function() return fiber.create(nil) end)) --[[tail]]
out(pcall(function() local f = fiber.new(42) return f end)) --[[new]]
out(pcall(function() local x = fiber.sleep('x') return x end)) --[[sleep]]
out(pcall(fiber.sleep, 1, 2))
out(pcall(fiber.sleep))
out(pcall(fiber.sleep, {}))
out(pcall(fiber.testcancel, 1))
out(pcall(fiber.set_joinable, fiber.self()))
out(pcall(fiber.find))
out(pcall(fiber.find, 1, 2))
out(pcall(function() local x = fiber.find() return x end)) --[[find]]
"#);
    let want = vec![
        "false fiber.create(function, ...): bad arguments".to_string(),
        format!(
            "false {}fiber.create(function, ...): bad arguments",
            at(&src, "create")
        ),
        // (Lua 5.4 keeps the caller of a tail-called C function for the position.)
        if LUAJIT {
            "false fiber.create(function, ...): bad arguments".into()
        } else {
            format!(
                "false {}fiber.create(function, ...): bad arguments",
                at(&src, "tail")
            )
        },
        format!(
            "false {}fiber.new(function, ...): bad arguments",
            at(&src, "new")
        ),
        format!(
            "false {}fiber.sleep(delay): bad arguments",
            at(&src, "sleep")
        ),
        "false fiber.sleep(delay): bad arguments".into(),
        "false fiber.sleep(delay): bad arguments".into(),
        "false fiber.sleep(delay): bad arguments".into(),
        "false fiber.testcancel(): bad arguments".into(),
        "false fiber.set_joinable(id, yesno): bad arguments".into(),
        "false fiber.find(id): bad arguments".into(),
        "false fiber.find(id): bad arguments".into(),
        format!("false {}fiber.find(id): bad arguments", at(&src, "find")),
    ];
    check(&got, &want);
}

/// A value of the wrong type is a bad argument, worded as LuaJIT's `luaL_argerror`: the
/// function's name as called (`?` from `pcall`), `calling ... on bad self` for a method's
/// object.
#[test]
fn wrong_types_are_bad_arguments_with_luajits_wording() {
    let (got, src) = run(r#"
out(pcall(fiber.status, 1))
out(pcall(fiber.status, 'fafa-gaga'))
out(pcall(fiber.status, nil))
out(pcall(fiber.status, fiber.channel()))
out(pcall(fiber.id, 5))
out(pcall(fiber.id, nil))
out(fiber.self().id() == fiber.id(), fiber.self():id() == fiber.id())
out(pcall(function() local x = fiber.self().status(5) return x end)) --[[direct]]
local o = {status = fiber.self().status}
out(pcall(function() local x = o:status() return x end)) --[[method]]
out(pcall(fiber.name, {}))
out(pcall(fiber.name, true))
out(pcall(fiber.name, fiber.self(), nil))
out(pcall(fiber.cancel, 'x'))
out(pcall(fiber.cancel, {}))
out(fiber.self():status(1))
"#);
    let want = vec![
        "false bad argument #1 to '?' (fiber expected, got number)".to_string(),
        "false bad argument #1 to '?' (fiber expected, got string)".into(),
        "false bad argument #1 to '?' (fiber expected, got nil)".into(),
        "false bad argument #1 to '?' (fiber expected, got userdata)".into(),
        "false bad argument #1 to '?' (fiber expected, got number)".into(),
        "false bad argument #1 to '?' (fiber expected, got nil)".into(),
        "true true".into(),
        format!(
            "false {}bad argument #1 to 'status' (fiber expected, got number)",
            at(&src, "direct")
        ),
        format!(
            "false {}calling 'status' on bad self (fiber expected, got table)",
            at(&src, "method")
        ),
        "false bad argument #1 to '?' (string expected, got table)".into(),
        "false bad argument #1 to '?' (string expected, got boolean)".into(),
        "false bad argument #2 to '?' (string expected, got nil)".into(),
        "false bad argument #1 to '?' (fiber expected, got string)".into(),
        "false bad argument #1 to '?' (fiber expected, got table)".into(),
        "running".into(),
    ];
    check(&got, &want);
}

/// `fiber.find` takes numbers and numeric strings (truncated); anything else finds nothing.
#[test]
fn find_takes_numbers_and_numeric_strings_only() {
    let (got, _) = run(r#"
local me = fiber.self()
out(fiber.find('test'), fiber.find(me), fiber.find({}), fiber.find(nil))
out(fiber.find(fiber.id()) == me, fiber.find(tostring(fiber.id())) == me,
    fiber.find(fiber.id() + 0.7) == me)
out(fiber.find(-1), fiber.find(0/0), fiber.find(math.huge), fiber.find(1e300), fiber.find(0))
local dead = fiber.create(function() end)
out(fiber.find(dead:id()), dead:status())
"#);
    check(
        &got,
        &s(&[
            "nil nil nil nil",
            "true true true",
            "nil nil nil nil nil",
            "nil dead",
        ]),
    );
}

/// A fiber that wakes itself is in the ready list (Tarantool 2.6's `fiber_wakeup` of the
/// running fiber): its next condition wait ends at once, `true`, and a channel's wait waits on
/// until its timeout. (Its sleep is in `tests/tarantool/fiber.lua`, which runs under both
/// programs; these are pinned here: Tarantool 2.6 leaves the fiber in the waiters' list, and a
/// later wait spins for ever.)
#[test]
fn wakeup_of_self_ends_the_next_condition_wait() {
    let (got, _) = run(r#"
local c, ch = fiber.cond(), fiber.channel(1)
local function took(f)
  fiber.self():wakeup()
  local t0 = clock.monotonic()
  local r = f()
  out(clock.monotonic() - t0 < 0.2 and 'at once' or 'waited', r)
end
took(function() return c:wait(0.5) end)
took(function() return ch:get(0.3) end)
took(function() return c:wait(0.05) end)
"#);
    check(&got, &s(&["at once true", "waited nil", "at once true"]));
}

/// A sleep or a timed wait after the thread was busy takes its whole time. Tarantool 2.6
/// counts its timers from the time its event loop last read (libev's `ev_now`): after 0.25 s
/// of work without a yield, its `fiber.sleep(0.3)` and `cond:wait(0.3)` end after 0.05 s.
/// Here timeouts count from the real clock.
#[test]
fn a_sleep_after_busy_work_takes_its_whole_time() {
    let (got, _) = run(r#"
local c = fiber.cond()
local function took(f)
  fiber.sleep(0.001)
  spin(0.25)
  local t0 = clock.monotonic()
  f()
  out(clock.monotonic() - t0 >= 0.29 and 'whole' or 'short')
end
took(function() fiber.sleep(0.3) end)
took(function() c:wait(0.3) end)
"#);
    check(&got, &s(&["whole", "whole"]));
}

/// `fiber_object.storage`: one table per fiber, set from any fiber, gone when the fiber's
/// function ends; a dead fiber's raises with the caller's position.
#[test]
fn storage_is_per_fiber_and_released_at_the_end() {
    let (got, src) = run(r#"
local me = fiber.self()
me.storage.k = 1
out(type(me.storage), me.storage == me.storage, me.storage.k)
local ch = fiber.channel(1)
local f = fiber.create(function() ch:get() ch:put(fiber.self().storage.k) end)
f.storage.k = 'set from main'
ch:put('go')
fiber.yield()
out(ch:get(0), me.storage.k)
local weak = setmetatable({}, {__mode = 'v'})
local g = fiber.create(function()
  local t = {}
  weak[1] = t
  fiber.self().storage.t = t
end)
collectgarbage('collect')
collectgarbage('collect')
out(weak[1])
local h = fiber.create(function() fiber.self().storage.x = 'kept' collectgarbage() fiber.sleep(0) end)
collectgarbage('collect')
out(h.storage.x)
fiber.sleep(0.001)
out(pcall(function() local x = g.storage return x end)) --[[dead]]
local j = fiber.new(function() fiber.self().storage.x = 1 end)
j:set_joinable(true)
fiber.yield()
out(j:status(), pcall(function() local x = j.storage return x end)) --[[ended]]
j:join()
out(me.nonexistent, me[1], type(me.id))
"#);
    let want = vec![
        "table true 1".to_string(),
        "set from main 1".into(),
        "nil".into(),
        "kept".into(),
        format!("false {}the fiber is dead", at(&src, "dead")),
        format!("suspended false {}the fiber is dead", at(&src, "ended")),
        "nil nil function".into(),
    ];
    check(&got, &want);
}

/// A joinable fiber that ended stays found until joined, as in Tarantool: status
/// `suspended`, cancel and wakeup accepted (nothing happens), listed by `fiber.info()`
/// (its `status` there `dead`, its backtrace empty: Tarantool printed a stale stack's),
/// join gives its outcome; made unjoinable, it is released.
#[test]
fn an_ended_joinable_fiber_is_found_until_joined() {
    let (got, _) = run(r#"
local f = fiber.new(function() error('dies at once', 0) end)
f:set_joinable(true)
fiber.yield()
out(f:status(), fiber.find(f:id()) == f, tostring(f) == 'fiber: ' .. f:id())
out(pcall(fiber.cancel, f))
out(pcall(fiber.wakeup, f))
out(pcall(fiber.name, f))
local function listed(bt)
  local i = fiber.info({backtrace = bt})[f:id()]
  return i and string.format('%s %s %d %s %s', i.name, i.status, i.csw,
    i.backtrace and #i.backtrace, i.memory.total > 0)
end
out(listed(true))
out(listed(false))
local st, e = f:join()
out(st, e, f:status(), tostring(f) == 'fiber: ' .. f:id() .. ' (dead)')
out(listed(true))
out(pcall(f.join, f))
local g = fiber.new(function() return 1 end)
g:set_joinable(true)
fiber.yield()
g:set_joinable(false)
out(g:status(), fiber.find(g:id()), pcall(g.join, g))
"#);
    check(
        &got,
        &s(&[
            "suspended true true",
            "true",
            "true",
            "true lua",
            "lua dead 1 0 true",
            "lua dead 1 nil true",
            "false dies at once dead true",
            "nil",
            "false the fiber is dead",
            "dead nil false the fiber is dead",
        ]),
    );
}

/// `fiber.join` returns error objects (Tarantool's): message, type, tostring, `..`.
#[test]
fn join_returns_error_objects() {
    let (got, _) = run(r#"
local f = fiber.new(function() error('oh my', 0) end)
f:set_joinable(true)
local st, e = f:join()
out(st, type(e), e.message, e.type, e.base_type, tostring(e), 'got: ' .. e, e .. '!')
out(#e.trace, e:unpack().message, e:match('o(h)'))
out(pcall(e.raise, e))
local g = fiber.new(function() error({code = 7}) end)
g:set_joinable(true)
local _, e2 = g:join()
out(e2.type, e2.message:match('^table: ') ~= nil)
local h = fiber.new(function() fiber.sleep(10) end)
h:set_joinable(true)
fiber.yield()
h:cancel()
local _, e3 = h:join()
out(e3.type, e3.message)
local k = fiber.new(function() end)
k:set_joinable(true)
k:cancel()
fiber.yield()
local _, e4 = k:join()
out(e4.type, e4.message)
local m = fiber.new(function(a, b) return a + b, nil, 'z' end, 2, 3)
m:set_joinable(true)
out(select('#', m:join()), pcall(m.join, m))
"#);
    check(
        &got,
        &s(&[
            "false table oh my LuajitError LuajitError oh my got: oh my oh my!",
            "0 oh my h",
            "false oh my",
            "LuajitError true",
            "FiberIsCancelled fiber is cancelled",
            "FiberIsCancelled fiber is cancelled",
            "4 false the fiber is dead",
        ]),
    );
}

/// Join's checks in Tarantool's order (found, joinable, itself, the timeout), the timeout,
/// concurrent joins, and a cancelled joiner that keeps waiting.
#[test]
fn join_checks_timeout_and_concurrent_joins() {
    let (got, src) = run(r#"
out(pcall(fiber.join, fiber.self()))
out(pcall(function() local x = fiber.join(fiber.self()) return x end)) --[[self]]
local me = fiber.self()
me:set_joinable(true)
out(pcall(fiber.join, me))
out(pcall(function() local x = fiber.join(me) return x end))
me:set_joinable(false)
local f = fiber.new(function() fiber.sleep(10) return 'late' end)
f:set_joinable(true)
fiber.yield()
local st, e = f:join(0.01)
out(st, e, e.type)
out(pcall(f.join, f, 'x'))
out(pcall(f.join, f, -1))
out(pcall(f.join, f, {}))
local st0, e0 = f:join(0)
out(st0, e0)
-- a second joiner of the same fiber is told another took it
local results = {}
local j1 = fiber.create(function() results[1] = {f:join()} end)
local j2 = fiber.create(function() results[2] = {pcall(f.join, f)} end)
f:wakeup()
fiber.sleep(0.01)
out(results[1][1], results[1][2], results[2][1], results[2][2])
-- a cancelled joiner keeps waiting (Tarantool's join is not a cancellation point)
local child = fiber.new(function() fiber.sleep(0.02) return 7 end)
child:set_joinable(true)
local got
local joiner = fiber.create(function()
  got = {child:join()}
  got[#got + 1] = select(2, pcall(fiber.yield))
end)
joiner:cancel()
fiber.sleep(0.005)
out(joiner:status(), got)
fiber.sleep(0.05)
out(joiner:status(), got[1], got[2], got[3])
"#);
    let want = vec![
        "false the fiber is not joinable".to_string(),
        format!("false {}the fiber is not joinable", at(&src, "self")),
        "false cannot join itself".into(),
        "false cannot join itself".into(),
        "false timed out TimedOut".into(),
        "false fiber:join(timeout): bad arguments".into(),
        "false fiber:join(timeout): bad arguments".into(),
        "false fiber:join(timeout): bad arguments".into(),
        "false timed out".into(),
        "true late false the fiber is already joined by concurrent fiber:join()".into(),
        "suspended nil".into(),
        "dead true 7 fiber is cancelled".into(),
    ];
    check(&got, &want);
}

/// Status, tostring and `__serialize` of a fiber that has not run, the running one, one
/// that ended and was joined, and one that is gone.
#[test]
fn status_tostring_and_serialize() {
    let (got, _) = run(r#"
local function ser(f)
  local t = f:__serialize()
  local keys = {}
  for k, v in pairs(t) do keys[#keys + 1] = k .. '=' .. tostring(v) end
  table.sort(keys)
  return (table.concat(keys, ','):gsub('id=%d+', 'id=N'))
end
local f = fiber.new(function() end)
f:name('new one')
out(f:status(), ser(f), tostring(f) == 'fiber: ' .. f:id())
out(fiber.status(), ser(fiber.self()):gsub('name=[^,]*', 'name=X'))
fiber.yield()
out(f:status(), ser(f), tostring(f) == 'fiber: ' .. f:id() .. ' (dead)')
out(getmetatable(f), getmetatable(fiber.channel()), getmetatable(fiber.cond()))
out(type(getmetatable(fiber).__serialize), fiber._internal ~= nil,
    getmetatable(fiber).__serialize(fiber)._internal)
"#);
    check(
        &got,
        &s(&[
            "suspended id=N,name=new one,status=suspended true",
            "running id=N,name=X,status=running 1",
            "dead id=N,status=dead true",
            "fiber fiber.channel fiber.cond",
            "function true nil",
        ]),
    );
}

/// `fiber.name`: numbers become names, a NUL byte ends the name, 255 bytes at most
/// (truncated only with `{truncate = true}`), any other argument count reads it.
#[test]
fn names() {
    let (got, src) = run(r#"
local old = fiber.name()
fiber.name(123)
out(fiber.name(), type(fiber.name()))
fiber.name('a\0b')
out(fiber.name(), #fiber.name())
fiber.name(string.rep('x', 255))
out(#fiber.name())
out(pcall(fiber.name, string.rep('y', 256)))
out(pcall(function() fiber.name(string.rep('y', 256)) end)) --[[long]]
out(pcall(fiber.name, string.rep('y', 300), {truncate = 1}))
fiber.name(string.rep('z', 300), {truncate = true})
out(#fiber.name(), fiber.name():sub(1, 1))
out(fiber.name('q', {}, 'extra') == fiber.name(), fiber.name():sub(1, 1))
fiber.name(old)
local f = fiber.create(function() end)
out(pcall(fiber.name, f))
out(pcall(fiber.name, f, 'x'))
"#);
    let want = vec![
        "123 string".to_string(),
        "a 1".into(),
        "255".into(),
        "false Fiber name is too long".into(),
        format!("false {}Fiber name is too long", at(&src, "long")),
        "false Fiber name is too long".into(),
        "255 z".into(),
        "true z".into(),
        "false the fiber is dead".into(),
        "false the fiber is dead".into(),
    ];
    check(&got, &want);
}

/// Channels: usage texts, bad objects, timeouts (numeric strings, NaN waits forever,
/// negative is a usage error), `has_readers`/`has_writers`, tostring.
#[test]
fn channel_texts_and_queries() {
    let (got, src) = run(r#"
local ch = fiber.channel(1)
out(pcall(ch.put, ch))
out(pcall(function() local x = ch:put() return x end)) --[[put]]
out(pcall(ch.put, ch, 1, -1))
out(pcall(ch.put, ch, 1, 'x'))
out(pcall(ch.put, ch, 1, {}))
out(pcall(ch.get, ch, 'x'))
out(pcall(ch.get, ch, -10))
out(pcall(ch.put))
out(pcall(ch.size))
out(pcall(ch.size, 'x'))
out(pcall(ch.is_closed, fiber.cond()))
out(pcall(function() local t = {size = ch.size} local x = t:size() return x end)) --[[self]]
out(ch:put(1, 0/0), ch:put(2, '0.001'), ch:get('0'), ch:put(3), ch:get(0/0))
out(pcall(fiber.channel, -1))
out(pcall(fiber.channel, 'x'))
out(pcall(fiber.channel, 0/0))
out(pcall(fiber.channel, 1e300))
out(pcall(fiber.channel, {}))
out(fiber.channel('3'):size(), fiber.channel(2.9):size(), fiber.channel(-0.5):size(),
    fiber.channel(nil):size(), fiber.channel():size())
out(tostring(ch), ch:has_readers(), ch:has_writers())
local r = fiber.create(function() ch:get() end)
out(ch:has_readers(), ch:has_writers())
r:cancel()
out(ch:has_readers())
ch:put('a')
local w = fiber.create(function() ch:put('b') end)
out(ch:has_readers(), ch:has_writers(), tostring(ch))
ch:close()
out(tostring(ch), ch:has_writers(), w:status(), ch:get(), ch:is_closed())
"#);
    let want = vec![
        "false usage: channel:put(var [, timeout])".to_string(),
        format!(
            "false {}usage: channel:put(var [, timeout])",
            at(&src, "put")
        ),
        "false usage: channel:put(var [, timeout])".into(),
        "false usage: channel:put(var [, timeout])".into(),
        "false usage: channel:put(var [, timeout])".into(),
        "false usage: channel:get([timeout])".into(),
        "false usage: channel:get([timeout])".into(),
        "false usage: channel:put(var [, timeout])".into(),
        "false usage: channel:size()".into(),
        "false bad argument #1 to '?' (fiber.channel expected, got string)".into(),
        "false bad argument #1 to '?' (fiber.channel expected, got userdata)".into(),
        format!(
            "false {}calling 'size' on bad self (fiber.channel expected, got table)",
            at(&src, "self")
        ),
        "true false 1 true 3".into(),
        "false fiber.channel(size): negative size".into(),
        "false fiber.channel(size): bad arguments".into(),
        "false fiber.channel(size): negative size".into(),
        "false fiber.channel(size): negative size".into(),
        "false fiber.channel(size): bad arguments".into(),
        "3 2 0 0 0".into(),
        "channel: 0 false false".into(),
        "true false".into(),
        "false".into(),
        "false true channel: 1".into(),
        "channel: closed false suspended nil true".into(),
    ];
    check(&got, &want);
}

/// compat's `fiber_channel_close_mode`: 'new' keeps queued values readable after close,
/// 'old' (the default here, as Tarantool 2.6) drops them; the module's errors.
#[test]
fn channel_close_modes_and_compat() {
    let (got, src) = run(r#"
local compat = require('compat')
out(compat.fiber_channel_close_mode.current, compat.fiber_channel_close_mode.default,
    compat.fiber_channel_close_mode:is_old())
compat.fiber_channel_close_mode = 'new'
local ch = fiber.channel(3)
ch:put(1) ch:put(2)
ch:close()
out(ch:is_closed(), ch:put(3), ch:get(), ch:get(), ch:get(), ch:count())
out(compat.fiber_channel_close_mode.current, compat.fiber_channel_close_mode:is_new())
compat({fiber_channel_close_mode = 'default'})
local old = fiber.channel(3)
old:put(1)
old:close()
out(old:get(), old:count(), compat.fiber_channel_close_mode.current)
out(pcall(function() compat.nonexistent = 'new' end)) --[[c1]]
out(pcall(function() compat.fiber_channel_close_mode = 'maybe' end)) --[[c2]]
out(pcall(function() return compat.nonexistent end)) --[[c3]]
out(pcall(compat, 5))
"#);
    let want = vec![
        "default old true".to_string(),
        "true false 1 2 nil 0".into(),
        "new true".into(),
        "nil 0 default".into(),
        format!("false {}Invalid option nonexistent", at(&src, "c1")),
        format!(
            "false {}Invalid argument maybe in option fiber_channel_close_mode",
            at(&src, "c2")
        ),
        format!("false {}Invalid option nonexistent", at(&src, "c3")),
        "false usage: compat({<option_name> = 'new'/'old'/'default'})".into(),
    ];
    check(&got, &want);
}

/// Conditions: usage texts, bad objects, timeouts, tostring.
#[test]
fn cond_texts() {
    let (got, src) = run(r#"
local c = fiber.cond()
out(tostring(c), pcall(c.wait))
out(pcall(c.wait, '1'))
out(pcall(c.wait, c, -1))
out(pcall(function() local x = c:wait(-1) return x end)) --[[neg]]
out(pcall(c.wait, c, 'x'))
out(pcall(c.signal))
out(pcall(c.broadcast))
out(pcall(function() local x = c.wait(fiber.channel()) return x end)) --[[other]]
out(c:wait('0.001'), c:wait(0))
fiber.create(function() c:signal() end)
"#);
    let want = vec![
        "cond false usage: cond:wait([timeout])".to_string(),
        "false bad argument #1 to '?' (fiber.cond expected, got string)".into(),
        "false usage: cond:wait([timeout])".into(),
        format!("false {}usage: cond:wait([timeout])", at(&src, "neg")),
        "false usage: cond:wait([timeout])".into(),
        "false usage: cond:signal()".into(),
        "false usage: cond:broadcast()".into(),
        format!(
            "false {}bad argument #1 to 'wait' (fiber.cond expected, got userdata)",
            at(&src, "other")
        ),
        "false false".into(),
    ];
    check(&got, &want);
}

/// `fiber.time`/`fiber.clock` and their 64-bit forms are read once per loop turn; the
/// 64-bit forms count microseconds, the clock module's nanoseconds; under LuaJIT they are
/// int64 cdata (FFI calls, as Tarantool's).
#[test]
fn clocks_are_cached_per_turn_and_in_their_units() {
    let (got, _) = run(r#"
local a, b, c, d = fiber.time(), fiber.time64(), fiber.clock(), fiber.clock64()
spin(0.002)
out(fiber.time() == a, fiber.time64() == b, fiber.clock() == c, fiber.clock64() == d)
fiber.yield()
out(fiber.time() > a, fiber.time64() > b, fiber.clock() > c, fiber.clock64() > d)
local function near(x, y) return math.abs(x - y) < 0.5 end
out(near(fiber.time(), tonumber(fiber.time64()) / 1e6),
    near(fiber.clock(), tonumber(fiber.clock64()) / 1e6),
    near(clock.time(), tonumber(clock.time64()) / 1e9),
    near(clock.realtime(), tonumber(clock.realtime64()) / 1e9),
    near(clock.monotonic(), tonumber(clock.monotonic64()) / 1e9),
    near(clock.proc(), tonumber(clock.proc64()) / 1e9),
    near(clock.thread(), tonumber(clock.thread64()) / 1e9),
    near(fiber.time(), clock.time()), near(fiber.clock(), clock.monotonic()))
local x = clock.monotonic64()
fiber.sleep(0.001)
out(x - clock.monotonic64() < 0, type(fiber.time64()), type(clock.monotonic),
    type(fiber.time))
local r = clock.bench(function(p, q) return p + q end, 2, 3)
out(#r, type(r[1]), r[2])
"#);
    let (num64, fn_type) = if LUAJIT {
        ("cdata", "cdata")
    } else {
        ("number", "function")
    };
    check(
        &got,
        &[
            "true true true true".to_string(),
            "true true true true".into(),
            "true true true true true true true true true".into(),
            format!("true {num64} {fn_type} function"),
            "2 number 5".into(),
        ],
    );
}

/// `csw` counts switches away from a fiber (its yields), as Tarantool's: in the running
/// fiber and in the info of the others.
#[test]
fn csw_counts_yields() {
    let (got, _) = run(r#"
local seen = {}
local f = fiber.new(function()
  for j = 1, 3 do
    fiber.yield()
    seen[#seen + 1] = fiber.self():csw() .. '/' .. fiber.self():info().csw ..
                      '/' .. fiber.info()[fiber.id()].csw
  end
end)
f:set_joinable(true)
out(f:csw(), fiber.info()[f:id()].csw)
fiber.yield()
out(f:csw(), fiber.info()[f:id()].csw)
f:join()
out(table.concat(seen, ' '))
local before = fiber.self():csw()
fiber.create(function() end)
out(fiber.self():csw() - before, pcall(f.csw, f))
"#);
    check(
        &got,
        &s(&[
            "0 0",
            "1 1",
            "1/1/1 2/2/2 3/3/3",
            "1 false the fiber is dead",
        ]),
    );
}

/// `fiber.info()` serializes as a mapping; `max_slice` shows a finite effective slice.
#[test]
fn info_mapping_and_max_slice() {
    let (got, _) = run(r#"
local mt = getmetatable(fiber.info())
out(type(mt), mt.__serialize, getmetatable(fiber.info({bt = false})) == mt)
local f = fiber.new(function() end)
f:set_joinable(true)
out(fiber.info()[f:id()].max_slice, f:info().max_slice)
f:set_max_slice({warn = 1.5, err = 3})
local m = f:info().max_slice
out(g(m.warn), g(m.err), g(fiber.info()[f:id()].max_slice.err))
f:set_max_slice(2)
m = f:info().max_slice
out(g(m.warn), g(m.err))
fiber.set_max_slice({warn = 100 * 365 * 86400, err = 4})
m = fiber.self():info().max_slice
out(g(m.warn), g(m.err), g(f:info().max_slice.err))
fiber.set_max_slice(100 * 365 * 86400)
out(fiber.self():info().max_slice)
f:join()
"#);
    check(
        &got,
        &s(&[
            "table mapping true",
            "nil nil",
            "1.5 3 3",
            "nil 2",
            "nil 4 2",
            "nil",
        ]),
    );
}

/// Slices: argument errors (post-2.6 texts, no position), exceeding, extending, setting,
/// and a new run starting with the max slice again.
#[test]
fn slices() {
    let (got, _) = run(r#"
local bad = 'slice must be a number or a table {warn = <number>, err = <number>}'
for _, v in ipairs({'foo', {err = 1}, {warn = 1}, {warn = 1, err = 'foo'}, {warn = 'x', err = 1},
                    true}) do
  local r = {}
  for _, fn in ipairs({fiber.set_slice, fiber.extend_slice, fiber.set_max_slice}) do
    local ok, err = pcall(fn, v)
    r[#r + 1] = tostring(not ok and err == bad)
  end
  local ok, err = pcall(fiber.set_max_slice, fiber.self(), v)
  r[#r + 1] = tostring(not ok and err == bad)
  out(table.concat(r, ','))
end
for _, v in ipairs({-1, {warn = 1, err = -1}, {warn = -1, err = 1}, 0/0, {warn = 0/0, err = 1}}) do
  out(pcall(fiber.set_slice, v))
end
out(pcall(function() fiber.set_slice(-1) end))
out(pcall(fiber.set_slice))
out(pcall(fiber.set_slice, 1, 2))
out(pcall(fiber.extend_slice))
out(pcall(fiber.check_slice, 1))
out(pcall(fiber.set_max_slice))
out(pcall(fiber.set_max_slice, fiber.self(), 1, 2))
out(pcall(fiber.set_max_slice, 99999999, 1))
out(pcall(fiber.check_slice))
fiber.set_slice(0)
out(pcall(fiber.check_slice))
fiber.yield()
out(pcall(fiber.check_slice))
fiber.set_slice({warn = 100, err = '0.001'})
spin(0.002)
out(pcall(fiber.check_slice))
fiber.extend_slice(1)
out(pcall(fiber.check_slice))
fiber.yield()
fiber.self():set_max_slice(0.001)
spin(0.002)
out(pcall(fiber.check_slice))
fiber.yield()
fiber.self():set_max_slice(100 * 365 * 86400)
out(pcall(fiber.check_slice))
local f = fiber.new(function() spin(0.003) fiber.check_slice() end)
f:set_joinable(true)
f:set_max_slice(0.001)
local st, e = f:join()
out(st, e)
"#);
    check(
        &got,
        &s(&[
            "true,true,true,true",
            "true,true,true,true",
            "true,true,true,true",
            "true,true,true,true",
            "true,true,true,true",
            "true,true,true,true",
            "false slice value must be >= 0",
            "false slice value must be >= 0",
            "false slice value must be >= 0",
            "false slice value must be >= 0",
            "false slice value must be >= 0",
            "false slice value must be >= 0",
            "false fiber.set_slice(slice): bad arguments",
            "false fiber.set_slice(slice): bad arguments",
            "false fiber.extend_slice(slice): bad arguments",
            "false fiber.check_slice(): bad arguments",
            "false fiber.set_max_slice([id,] slice): bad arguments",
            "false fiber.set_max_slice([id,] slice): bad arguments",
            "false the fiber is dead",
            "true",
            "false fiber slice is exceeded",
            "true",
            "false fiber slice is exceeded",
            "true",
            "false fiber slice is exceeded",
            "true",
            "false fiber slice is exceeded",
        ]),
    );
}

/// `fiber.top()`: an error while off; on, the scheduler's row and one per live fiber,
/// shares that sum to at most 100, a busy fiber's time.
#[test]
fn top() {
    let (got, src) = run(r#"
out(pcall(fiber.top))
out(pcall(function() local x = fiber.top() return x end)) --[[off]]
fiber.top_enable()
local row
local busy = fiber.create(function()
  for _ = 1, 50 do spin(0.0002) fiber.yield() end
  row = fiber.top().cpu[fiber.id() .. '/' .. fiber.name()]
end)
while busy:status() ~= 'dead' do fiber.sleep(0.001) end
local top = fiber.top()
local sum, n = 0, 0
for k, r in pairs(top.cpu) do
  sum = sum + r.average
  n = n + 1
  assert(type(r.instant) == 'number' and type(r.time) == 'number', k)
end
out(g(top.cpu_misses), top.cpu['1/sched'] ~= nil, top.cpu[fiber.id() .. '/' .. fiber.name()] ~= nil,
    sum <= 100.0001, n >= 2)
out(row.average > 0, row.instant > 0, row.time > 0.005, row.time < 1)
fiber.top_disable()
out(pcall(fiber.top))
"#);
    let off = "false fiber.top() is disabled. Enable it with fiber.top_enable() first";
    let want = vec![
        off.to_string(),
        format!(
            "false {}fiber.top() is disabled. Enable it with fiber.top_enable() first",
            at(&src, "off")
        ),
        "0 true true true true".into(),
        "true true true true".into(),
        off.into(),
    ];
    check(&got, &want);
}

/// `fiber.top()` lists a joinable fiber that ended until it is joined, as Tarantool does
/// (the same script under Tarantool 2.6 prints the same, but for the decay): its time
/// stays, its share of the last turn is 0, its average decays as any row's that does not run
/// (here by turns that count the loop's waits, so an idle loop's turns take it down fast;
/// Tarantool's stays near where it was); one that ended while accounting was off is listed
/// with zeros (turning it on resets every figure); one not joinable is gone when it ends.
#[test]
fn top_lists_an_ended_joinable_fiber_until_joined() {
    let (got, _) = run(r#"
local early = fiber.new(function() spin(0.003) end)
early:set_joinable(true)
early:name('early')
fiber.yield()
fiber.top_enable()
local f = fiber.new(function() spin(0.01) end)
f:set_joinable(true)
f:name('worker')
local g = fiber.new(function() spin(0.01) end)
g:name('gone')
fiber.yield()
out(f:status(), g:status())
fiber.sleep(0.001)
local cpu = fiber.top().cpu
local r = cpu[f:id() .. '/worker']
local e = cpu[early:id() .. '/early']
out(r ~= nil, cpu[g:id() .. '/gone'], e and string.format('%g %g %g', e.average, e.instant, e.time))
out(r.time > 0.009, r.time < 1, r.instant == 0, r.average > 0)
for _ = 1, 30 do fiber.sleep(0.001) end
local r2 = fiber.top().cpu[f:id() .. '/worker']
out(r2.time == r.time, r2.instant == 0, r2.average < r.average / 2, r2.average > 0)
f:join()
early:join()
cpu = fiber.top().cpu
out(cpu[f:id() .. '/worker'], cpu[early:id() .. '/early'])
"#);
    check(
        &got,
        &s(&[
            "suspended dead",
            "true nil 0 0 0",
            "true true true true",
            "true true true true",
            "nil nil",
        ]),
    );
}

/// `fiber.info()`'s `time` is counted always (the host's scheduler times every run), not
/// only while `fiber.top` is on as in Tarantool; a slice set in the middle of a run counts
/// the run from its start, as Tarantool's.
#[test]
fn info_time_and_slices_count_from_the_runs_start() {
    let (got, _) = run(r#"
local function time() return fiber.info()[fiber.id()].time end
fiber.yield()
local t0 = time()
spin(0.02) fiber.yield()
local d = time() - t0
out(d > 0.015, d < 0.1)
spin(0.02)
fiber.set_slice(0.01)
out(pcall(fiber.check_slice))
"#);
    check(&got, &s(&["true true", "false fiber slice is exceeded"]));
}

/// `fiber._internal.schedule_task`: tasks run later, in order, in a worker fiber; scheduling
/// does not yield; a task that raises or cancels the worker does not stop the next ones.
#[test]
fn schedule_task() {
    let (got, _) = run(r#"
local log = {}
local function task(arg)
  log[#log + 1] = arg
  arg = arg + 1
  if arg <= 3 then
    fiber._internal.schedule_task(task, arg)
  else
    fiber.self():cancel()
    error('the worker breaks down')
  end
end
local csw = fiber.self():csw()
for i = 1, 3 do fiber._internal.schedule_task(task, i) end
out(fiber.self():csw() - csw, #log)
for _ = 1, 20 do fiber.yield() end
out(table.concat(log, ','))
fiber._internal.schedule_task(function(x) error(x) end, 'fails')
fiber._internal.schedule_task(function(x) log = x end, 'after')
for _ = 1, 5 do fiber.yield() end
out(log)
"#);
    check(&got, &s(&["0 0", "1,2,3,2,3,3", "after"]));
}

/// Wrong inputs never panic or hang: every function of the modules called with every kind
/// of value either returns or raises a Lua error.
#[test]
fn every_function_survives_every_input() {
    let (got, _) = run(r#"
local ch, c = fiber.channel(1), fiber.cond()
local dead = fiber.create(function() end)
local values = {nil, true, 0, -1, 1.5, 0/0, math.huge, -math.huge, 1e300, '', 'x', '1e3',
                {}, {warn = 1}, fiber.self(), dead, ch, c, print, coroutine.create(print)}
local skip = {sleep = true, stall = true, yield = true}
local calls, raised = 0, 0
for i = 1, 20 do
  local v = values[i]
  for name, fn in pairs(fiber) do
    if type(fn) == 'function' and not skip[name] and name ~= 'create' and name ~= 'new'
       and name ~= 'cancel' and name ~= 'kill' and name ~= 'top_enable' then
      for _, args in ipairs({{v}, {v, v}, {dead, v}, {ch, v}}) do
        local ok = pcall(fn, args[1], args[2])
        calls = calls + 1
        if not ok then raised = raised + 1 end
      end
    end
  end
  for _, obj in ipairs({ch, c, fiber.self(), dead}) do
    local mt = getmetatable(obj)
    for _, m in ipairs({'get', 'put', 'close', 'size', 'count', 'is_full', 'is_empty',
                        'has_readers', 'has_writers', 'is_closed', 'wait', 'signal',
                        'broadcast', 'id', 'name', 'status', 'info', 'csw', 'join',
                        'set_joinable', 'wakeup', 'set_max_slice', '__serialize'}) do
      local fn = obj[m]
      -- (the waits only with values that do not wait: forever or for long)
      local n = tonumber(v)
      local waits = m == 'wait' or m == 'get' or m == 'put'
      if type(fn) == 'function' and not (waits and (v == nil or (n ~= nil and not (n <= 0))))
         and not (m == 'join' and obj == fiber.self()) then
        pcall(fn, obj, v)
        if not waits then pcall(fn, v) end
      end
    end
    ch = fiber.channel(1)
  end
end
fiber.set_max_slice(100 * 365 * 86400)
out(calls > 1000, raised > 100, fiber.self():status())
"#);
    check(&got, &s(&["true true running"]));
}

fn run_binary(script: &str) -> (i32, String, String) {
    let dir = Scratch::new("parity");
    let path = dir.join(format!("p{}.lua", script.len()));
    std::fs::write(&path, script).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A cancelled fiber's error is not reported (Tarantool's rule); another fiber's is.
#[test]
fn a_cancelled_fiber_is_not_reported_as_failed() {
    let (code, out, err) = run_binary(
        "local fiber = require('fiber')\n\
         fiber.create(function() fiber.self():cancel() end)\n\
         local f = fiber.create(function() fiber.sleep(10) end)\n\
         f:cancel()\n\
         fiber.create(function() fiber.testcancel() error('boom', 0) end)\n\
         fiber.sleep(0.01)\n\
         print('done')\n",
    );
    assert_eq!((code, out.as_str()), (0, "done\n"), "{err}");
    assert!(err.contains("\"lua\" failed: boom\n"), "{err}");
    assert!(!err.contains("cancelled"), "{err}");
    assert_eq!(err.matches(" failed: ").count(), 1, "{err}");
}

/// The warning of `check_slice()` past the warning part, once per run.
#[test]
fn the_slice_warning_is_printed_once_per_run() {
    let (code, out, err) = run_binary(
        "local fiber = require('fiber')\n\
         local clock = require('clock')\n\
         fiber.set_slice({warn = 0.01, err = 10})\n\
         local stop = clock.monotonic() + 0.03\n\
         while clock.monotonic() < stop do fiber.check_slice() end\n\
         print('ok')\n",
    );
    assert_eq!((code, out.as_str()), (0, "ok\n"), "{err}");
    assert!(
        err.ends_with("\"main\": fiber has not yielded for more than 0.010 seconds\n"),
        "{err}"
    );
    assert_eq!(err.matches("has not yielded").count(), 1, "{err}");
}

/// `fiber.create` is no cancellation point (Tarantool's `fiber_start`): a creator that its
/// new fiber cancels gets the new fiber, and the cancellation at its next yield.
#[test]
fn create_is_not_a_cancellation_point() {
    let (got, _) = run(r#"
local me = fiber.self()
local r
local f = fiber.create(function()
  local child = fiber.create(function() fiber.self():cancel() end)
  r = {pcall(fiber.create, function() me:cancel() end)}
end)
out(r[1], type(r[2]), fiber.status())
out(pcall(fiber.yield))
out(pcall(fiber.testcancel))
"#);
    check(
        &got,
        &s(&[
            "true userdata running",
            "false fiber is cancelled",
            "false fiber is cancelled",
        ]),
    );
}
