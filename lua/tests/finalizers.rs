//! `__gc` finalizers that touch fibers (LuaJIT runs them on one Lua thread of its own, on the
//! native stack of whichever fiber triggered the collection): a switch inside one is refused
//! with a clear error that Lua reports as the finalizer's, what completes without a switch
//! works, and a finalizer may create fibers — also from inside the host's own allocations.
#![cfg(feature = "luajit")]

use std::time::{Duration, Instant};

use fibertrace_lua::LuaHost;

/// `gcobj(f)`: a userdata whose finalizer is `f` (tables have no `__gc` in Lua 5.1).
const PRELUDE: &str = "local fiber = require('fiber')\n\
    local function gcobj(f) local p = newproxy(true) getmetatable(p).__gc = f return p end\n";

#[path = "common/bounded.rs"]
mod bounded;
use bounded::Out;

/// Runs `src` (after [`PRELUDE`], so its line N is the script's line N + 2) as a script
/// named `name`, bounded in time.
fn run_script(name: &str, src: &str) -> (Out, String) {
    let path = std::env::temp_dir().join(format!("ft-fin-{name}-{}.lua", std::process::id()));
    std::fs::write(&path, format!("{PRELUDE}{src}")).unwrap();
    let o = bounded::run(&["run", path.to_str().unwrap()], b"");
    let p = path.to_str().unwrap().to_string();
    let _ = std::fs::remove_file(&path);
    (o, p)
}

/// Two fibers whose finalizers sleep: each used to go on in the other fiber (LuaJIT's one
/// finalizer thread, resumed by whichever fiber woke first — a finalizer started in fiber 3
/// went on in fiber 2), and finalizers of different shapes corrupted the Lua stack. Now the
/// sleep is an error, reported as the finalizer's, and both fibers go on.
#[test]
fn a_finalizer_that_switches_gets_an_error_and_the_fibers_go_on() {
    let (o, p) = run_script(
        "sleep",
        "local log = {}\n\
         local function fin(name)\n\
           return function()\n\
             log[#log + 1] = name .. ' starts in fiber ' .. fiber.id()\n\
             fiber.sleep(0.05)\n\
             log[#log + 1] = name .. ' goes on in fiber ' .. fiber.id()\n\
           end\n\
         end\n\
         local a = fiber.create(function() gcobj(fin('A')) collectgarbage() log[#log + 1] = 'A collected' end)\n\
         local b = fiber.create(function() gcobj(fin('B')) collectgarbage() log[#log + 1] = 'B collected' end)\n\
         fiber.sleep(0.2)\n\
         print(table.concat(log, '\\n'))\n",
    );
    assert_eq!(
        o.stdout,
        "A starts in fiber 2\nA collected\nB starts in fiber 3\nB collected\n"
    );
    assert_eq!(
        o.stderr,
        format!(
            "ERROR in finalizer: {p}:7: fiber.sleep: cannot switch fibers inside a __gc finalizer\n\
             ERROR in finalizer: {p}:7: fiber.sleep: cannot switch fibers inside a __gc finalizer\n"
        )
    );
    assert_eq!(o.code, Some(0));
}

/// Every fiber function inside a finalizer: those that would switch raise (also from a
/// coroutine the finalizer resumes, and from an `ffi.gc` finalizer); those that complete
/// without a switch work as anywhere else.
#[test]
fn inside_a_finalizer_what_would_switch_raises_and_the_rest_works() {
    let (o, p) = run_script(
        "ops",
        "local out = {}\n\
         local function try(name, f, ...)\n\
           local r = {pcall(f, ...)}\n\
           for i = 1, #r do r[i] = tostring(r[i]) end\n\
           out[#out + 1] = name .. ': ' .. table.concat(r, ' ')\n\
         end\n\
         local room, full, has, empty, rdv = fiber.channel(1), fiber.channel(1), fiber.channel(1), fiber.channel(1), fiber.channel()\n\
         full:put('x') has:put('v')\n\
         fiber.create(function() local v = rdv:get() out[#out + 1] = 'reader got ' .. tostring(v) end)\n\
         local ended = fiber.new(function() return 42 end) ended:set_joinable(true)\n\
         fiber.yield()\n\
         local live = fiber.new(function() fiber.sleep(10) end) live:set_joinable(true)\n\
         local cond = fiber.cond()\n\
         local ffi = require('ffi')\n\
         local function body()\n\
           try('yield', fiber.yield)\n\
           try('sleep 0', fiber.sleep, 0)\n\
           try('put with room', room.put, room, 1)\n\
           try('put when full', full.put, full, 1)\n\
           try('put when full, timeout 0', full.put, full, 1, 0)\n\
           try('put to a waiting reader', rdv.put, rdv, 'handed')\n\
           try('put with no reader', rdv.put, rdv, 'lost', 1)\n\
           try('get a queued value', has.get, has)\n\
           try('get from empty', empty.get, empty, 5)\n\
           try('get from empty, timeout 0', empty.get, empty, 0)\n\
           try('join an ended fiber', function() local ok, v = ended:join() return v end)\n\
           try('join a live fiber', live.join, live)\n\
           try('join a live fiber, timeout 0', function() local ok, e = live:join(0) return ok, tostring(e) end)\n\
           try('cond:wait', cond.wait, cond, 0)\n\
           try('yield in a coroutine', coroutine.wrap(function() fiber.yield() end))\n\
           try('info', function() return type(fiber.info()) end)\n\
           try('create', function() return fiber.create(function() out[#out + 1] = 'child runs in ' .. fiber.self():name() fiber.sleep(0) out[#out + 1] = 'child switched' end):status() end)\n\
           out[#out + 1] = 'finalizer ends'\n\
         end\n\
         gcobj(body)\n\
         local p = ffi.gc(ffi.new('char[1]'), function() try('ffi.gc yield', fiber.yield) end)\n\
         p = nil\n\
         collectgarbage() collectgarbage()\n\
         out[#out + 1] = 'main goes on'\n\
         fiber.sleep(0.01)\n\
         live:cancel()\n\
         print(table.concat(out, '\\n'))\n",
    );
    let e = |line: u32, what: &str| {
        format!("{p}:{line}: {what}: cannot switch fibers inside a __gc finalizer")
    };
    let want = [
        "yield: false fiber.yield: cannot switch fibers inside a __gc finalizer".to_string(),
        "sleep 0: false fiber.sleep: cannot switch fibers inside a __gc finalizer".to_string(),
        "put with room: true true".to_string(),
        "put when full: false channel:put: cannot switch fibers inside a __gc finalizer"
            .to_string(),
        "put when full, timeout 0: true false".to_string(),
        "put to a waiting reader: true true".to_string(),
        "put with no reader: false channel:put: cannot switch fibers inside a __gc finalizer"
            .to_string(),
        "get a queued value: true v".to_string(),
        "get from empty: false channel:get: cannot switch fibers inside a __gc finalizer"
            .to_string(),
        "get from empty, timeout 0: true".to_string(),
        "join an ended fiber: true 42".to_string(),
        "join a live fiber: false fiber:join: cannot switch fibers inside a __gc finalizer"
            .to_string(),
        "join a live fiber, timeout 0: true false timed out".to_string(),
        "cond:wait: false cond:wait: cannot switch fibers inside a __gc finalizer".to_string(),
        format!("yield in a coroutine: false {}", e(32, "fiber.yield")),
        "info: true table".to_string(),
        "create: true suspended".to_string(),
        "finalizer ends".to_string(),
        "ffi.gc yield: false fiber.yield: cannot switch fibers inside a __gc finalizer".to_string(),
        "main goes on".to_string(),
        "reader got handed".to_string(),
        "child runs in lua".to_string(),
        "child switched".to_string(),
    ];
    assert_eq!(o.stdout, format!("{}\n", want.join("\n")));
    assert_eq!(o.stderr, "");
    assert_eq!(o.code, Some(0));
}

/// A finalizer that creates a fiber, run by the collector inside the host's own allocation
/// of a fiber's Lua thread (thousands of live fibers: no pooled thread is left), used to get
/// `no Lua host on this thread`. Every finalizer's fiber now runs.
#[test]
fn finalizers_create_fibers_even_inside_the_hosts_allocations() {
    let (o, _) = run_script(
        "create",
        "local finalized, ran = 0, 0\n\
         local keep = {}\n\
         for i = 1, 3000 do\n\
           gcobj(function() finalized = finalized + 1 fiber.create(function() ran = ran + 1 end) end)\n\
           keep[i] = fiber.new(function() fiber.sleep(0.01) end)\n\
           local junk = {} for j = 1, 20 do junk[j] = {} end\n\
         end\n\
         keep = nil\n\
         fiber.sleep(0.1)\n\
         collectgarbage() collectgarbage()\n\
         fiber.sleep(0.05)\n\
         print(finalized, ran)\n",
    );
    assert_eq!(o.stderr, "");
    assert_eq!(o.stdout, "3000\t3000\n");
    assert_eq!(o.code, Some(0));
}

/// Finalizer errors are reported (also those that are not strings), and the program goes
/// on.
#[test]
fn finalizer_errors_are_reported_and_the_program_goes_on() {
    let (o, p) = run_script(
        "errors",
        "gcobj(function() error('boom') end)\n\
         collectgarbage()\n\
         gcobj(function() error({}) end)\n\
         collectgarbage()\n\
         gcobj(function() fiber.cond():wait() end)\n\
         collectgarbage()\n\
         print('goes on')\n",
    );
    assert_eq!(o.stdout, "goes on\n");
    assert_eq!(
        o.stderr,
        format!(
            "ERROR in finalizer: {p}:3: boom\n\
             ERROR in finalizer: (error object is a table value)\n\
             ERROR in finalizer: {p}:7: cond:wait: cannot switch fibers inside a __gc finalizer\n"
        )
    );
    assert_eq!(o.code, Some(0));
}

/// Many fibers whose finalizers call `fiber.info()`, create fibers and use channels, while
/// the main fiber takes `fiber.info()` with backtraces (whose own allocations run them):
/// nothing fails, nothing is reported.
#[test]
fn finalizers_run_inside_fiber_info_and_channel_operations() {
    let (o, _) = run_script(
        "reentry",
        "fiber.parent_backtrace_enable()\n\
         local ch = fiber.channel(10)\n\
         local infos, made, stop = 0, 0, false\n\
         local function junk(n) local t = {} for i = 1, n do t[i] = {i, tostring(i)} end return t end\n\
         for w = 1, 20 do\n\
           fiber.create(function()\n\
             while not stop do\n\
               gcobj(function()\n\
                 infos = infos + 1\n\
                 assert(type(fiber.info()) == 'table')\n\
                 fiber.create(function() made = made + 1 junk(20) end)\n\
                 ch:put(infos, 0)\n\
                 local c = fiber.channel(2) c:put(junk(5)) c:put(junk(5))\n\
               end)\n\
               junk(20)\n\
               ch:get(0)\n\
               fiber.sleep(0)\n\
             end\n\
           end)\n\
         end\n\
         local t0 = fiber.clock()\n\
         while fiber.clock() - t0 < 1 do fiber.info({backtrace = true}) fiber.yield() end\n\
         stop = true\n\
         fiber.sleep(0.01)\n\
         print(infos > 100, made > 100)\n",
    );
    assert_eq!(o.stderr, "");
    assert_eq!(o.stdout, "true\ttrue\n");
    assert_eq!(o.code, Some(0));
}

/// Finalizers that the closing of a host runs (`LuaHost` dropped): a sleep is refused at
/// once (it used to sleep the thread: there is no scheduler left), a fiber cannot be made.
#[test]
fn finalizers_run_when_a_host_closes_cannot_switch_or_hang() {
    let path = std::env::temp_dir().join(format!("ft-fin-close-{}.txt", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let host = LuaHost::new().unwrap();
    let src = format!(
        "{PRELUDE}\
         local function note(...) local f = io.open('{}', 'a') f:write(table.concat({{...}}, ' '), '\\n') f:close() end\n\
         KEEP = {{\n\
           gcobj(function() note('sleep', select(2, pcall(fiber.sleep, 100))) end),\n\
           gcobj(function() note('create', select(2, pcall(fiber.create, function() end))) end),\n\
         }}\n",
        path.display()
    );
    host.run_main("=close", src.as_bytes(), &[]).unwrap();
    let t0 = Instant::now();
    drop(host);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let mut lines: Vec<String> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "create fiber.create: not in a fiber",
            "sleep fiber.sleep: cannot switch fibers inside a __gc finalizer",
        ]
    );
    let _ = std::fs::remove_file(&path);
}

/// Finalizers that join ended fibers and make new ones while `fiber.info()` walks fibers
/// that all moved (the host's records move as records are removed: the last one fills the
/// hole, and a new one may take the place it left): each fiber's new trace is kept in its
/// own record, so the next listing, which takes the kept traces, shows every sleeper in its
/// own function and none in another's (the functions are named by their lines: `function
/// <path:3>` for the first). End to end only: a trace kept in the wrong record is also
/// refused there by its switch count, so the check of a remembered place against the id is
/// tested in `recs.rs`.
#[test]
fn records_removed_by_finalizers_during_a_listing_keep_each_fiber_its_own_trace() {
    let (o, _) = run_script(
        "moved-records",
        "local function a_sleep() while true do fiber.sleep(1e6) end end\n\
         local function b_sleep() while true do fiber.sleep(1e6) end end\n\
         local function c_sleep() while true do fiber.sleep(1e6) end end\n\
         local kinds, names = {a_sleep, b_sleep, c_sleep}, {'.lua:3>', '.lua:4>', '.lua:5>'}\n\
         local kind, sleepers, inside, joined = {}, {}, 0, 0\n\
         local listing = false\n\
         collectgarbage('setpause', 50)\n\
         collectgarbage('setstepmul', 1000)\n\
         for round = 1, 6 do\n\
           local ended = {}\n\
           for i = 1, 200 do\n\
             local f = fiber.new(function() end)\n\
             f:set_joinable(true)\n\
             ended[i] = f\n\
           end\n\
           fiber.yield()\n\
           for i = 1, 100 do\n\
             local k = (round + i) % 3 + 1\n\
             local f = fiber.create(kinds[k])\n\
             kind[f:id()] = k\n\
             sleepers[#sleepers + 1] = f\n\
           end\n\
           for _, f in ipairs(sleepers) do f:wakeup() end\n\
           fiber.yield()\n\
           for i = 1, #ended do\n\
             local f = ended[i]\n\
             gcobj(function()\n\
               if pcall(f.join, f) then\n\
                 joined = joined + 1\n\
                 if listing then inside = inside + 1 end\n\
               end\n\
               fiber.create(function() end)\n\
             end)\n\
           end\n\
           ended = nil\n\
           listing = true\n\
           fiber.info()\n\
           listing = false\n\
         end\n\
         collectgarbage('setpause', 200)\n\
         local info, wrong, right = fiber.info(), 0, 0\n\
         for _, f in ipairs(sleepers) do\n\
           local text = {}\n\
           for _, e in ipairs(info[f:id()].backtrace) do text[#text + 1] = e.L or '' end\n\
           text = table.concat(text, '\\n')\n\
           for k = 1, 3 do\n\
             local has = text:find(names[k], 1, true) ~= nil\n\
             if has ~= (k == kind[f:id()]) then wrong = wrong + 1 end\n\
           end\n\
           if text:find(names[kind[f:id()]], 1, true) then right = right + 1 end\n\
         end\n\
         print(inside > 0, joined > 0, right, wrong)\n",
    );
    assert_eq!(o.stderr, "");
    assert_eq!(o.stdout, "true\ttrue\t600\t0\n");
    assert_eq!(o.code, Some(0));
}

/// A trace taken inside a finalizer (`fiber.info()`, `fibertrace.dump()`) has the
/// finalizer's Lua frames, in call order, above the frames of the code that set off the
/// collection: LuaJIT runs finalizers on a thread of its own, which the fiber's Lua thread
/// does not resume, and its levels were missing (`info`, the functions it called, the
/// finalizer itself).
#[test]
fn a_trace_inside_a_finalizer_has_the_finalizers_frames_in_call_order() {
    let (o, _) = run_script(
        "trace",
        "local function in_finalizer()\n\
           for _, fr in ipairs(fiber.info()[fiber.id()].backtrace) do print(fr.L or fr.C) end\n\
           print(require('fibertrace').dump())\n\
         end\n\
         local e = gcobj(function() in_finalizer() end)\n\
         local function trigger() e = nil collectgarbage() end\n\
         trigger()\n",
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let lua: Vec<&str> = o
        .stdout
        .lines()
        .filter(|l| l.starts_with('#') && !l.contains(" 0x"))
        .map(|l| l.split_once(' ').map_or(l, |x| x.1.trim_start()))
        .collect();
    // (Script lines are the file's: two of prelude first.)
    let levels = |head: &str| {
        vec![
            head.to_string(),
            "in_finalizer in @".to_string(),
            "function <".to_string(),
            "collectgarbage in =[C]:-1".to_string(),
            "trigger in @".to_string(),
            "main chunk in @".to_string(),
        ]
    };
    let want: Vec<String> = [levels("info in =[C]:-1"), levels("dump in =[C]:-1")].concat();
    assert_eq!(lua.len(), want.len(), "{}", o.stdout);
    for (got, want) in lua.iter().zip(&want) {
        assert!(
            got.starts_with(want.as_str()),
            "{got} / {want}:\n{}",
            o.stdout
        );
    }
    for (got, line) in lua.iter().zip([0, 4, 7, 0, 8, 9, 0, 5, 7, 0, 8, 9]) {
        if line > 0 {
            assert!(
                got.ends_with(&format!(".lua:{line}")),
                "{got}:\n{}",
                o.stdout
            );
        }
    }
}
