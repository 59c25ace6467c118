//! Stuck Lua fibers through `fibertrace run`: a busy fiber is reported by the stall
//! detector (`--stall-ms`), a channel deadlock exits non-zero with the report.

use std::process::Command;

/// Where [`run_script`] writes `script` run with `args`.
fn script_path(args: &[&str], script: &str) -> String {
    let dir = std::env::temp_dir().join(format!("fibertrace-stall-{}", std::process::id()));
    let path = dir.join(format!("s{}.lua", args.len() + script.len()));
    path.to_str().unwrap().to_string()
}

fn run_script(args: &[&str], script: &str) -> (i32, String, String) {
    let path = script_path(args, script);
    std::fs::create_dir_all(std::path::Path::new(&path).parent().unwrap()).unwrap();
    std::fs::write(&path, script).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_fibertrace"));
    c.arg("run").args(args).arg(&path);
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const BUSY: &str = r#"
if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
local function c(until_t) local n = 0 while clock.monotonic() < until_t do n = n + 1 end return n end
local function b(t) return c(t) + 0 end
local function a(t) return b(t) + 0 end
local f = fiber.new(function() return a(clock.monotonic() + 1.2) end)
f:name('busy')
f:set_joinable(true)
print(f:join())
"#;

#[test]
fn a_busy_lua_fiber_is_reported_with_its_native_frames() {
    let (code, _out, err) = run_script(&["--stall-ms", "100"], BUSY);
    assert_eq!(code, 0, "{err}");
    // `fiber N "busy" has run 1xxms without yielding:` — the first report of the run's CPU
    // time comes within 1.5x the threshold (a wall-time report may come first on a loaded
    // machine; the smallest figure is the first CPU-time one).
    let heads: Vec<(usize, f64)> = err
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("\"busy\" has run "))
        .filter_map(|(i, l)| {
            let v = l
                .split("has run ")
                .nth(1)?
                .split("ms")
                .next()?
                .parse()
                .ok()?;
            Some((i, v))
        })
        .collect();
    let &(first, ms) = heads
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or_else(|| panic!("no stall report:\n{err}"));
    assert!((100.0..=150.0).contains(&ms), "{err}");
    // This report only: up to a blank line or the next report's heading (reports of a
    // running fiber follow one another without a blank line).
    let report: Vec<&str> = err
        .lines()
        .skip(first)
        .enumerate()
        .take_while(|(i, l)| !l.is_empty() && (*i == 0 || !l.starts_with("fiber ")))
        .map(|(_, l)| l)
        .collect();
    let text = report.join("\n");
    // The VM's frames down to the call into the fiber's function; the host's glue below it
    // (the fiber's start) is left out.
    let frames: Vec<&str> = report
        .iter()
        .filter(|l| l.starts_with('#'))
        .copied()
        .collect();
    assert!(
        frames
            .last()
            .is_some_and(|l| l.contains(" in lua_pcall+") || l.contains(" in lua_pcallk+")),
        "{text}"
    );
    assert!(!text.contains("lua_fiber_main"), "{text}");
    assert!(text.contains("Lua frames not shown"), "{text}");
    // Again at twice the threshold while it lasts.
    assert!(err.matches("\"busy\" has run ").count() >= 2, "{err}");
}

const DEADLOCK: &str = r#"
local fiber = require('fiber')
local a, b = fiber.channel(1), fiber.channel(1)
local ping = fiber.new(function() a:get(); b:put(1) end)
ping:name('ping')
local pong = fiber.new(function() b:get(); a:put(1) end)
pong:name('pong')
ping:set_joinable(true)
ping:join()
"#;

/// The Lua frames of a report's fiber block (`#N  name in source:line` lines whose body is
/// not a native frame's `0x...`), without their numbers.
fn lua_frames(block: &str) -> Vec<String> {
    block
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| {
            l.trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start()
        })
        .filter(|body| !body.starts_with("0x"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_channel_deadlock_between_two_lua_fibers_exits_with_the_report() {
    let (code, _out, err) = run_script(&[], DEADLOCK);
    let script = &script_path(&[], DEADLOCK);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.starts_with("all fibers are asleep — deadlock!"),
        "{err}"
    );
    for name in ["ping", "pong"] {
        let block = err
            .split("\n\n")
            .find(|b| b.contains(&format!("\"{name}\" [")))
            .unwrap_or_else(|| panic!("{err}"));
        assert!(block.contains("[channel receive, "), "{block}");
        assert!(
            block.contains(" in fibertrace_lua::host::channel::ch_get"),
            "{block}"
        );
        // The Lua frames, interleaved where they ran (as fiber.info() shows them): the
        // channel's get, called from the fiber's function.
        let line = if name == "ping" { 4 } else { 6 };
        assert_eq!(
            lua_frames(block),
            [
                "get in =[C]:-1".to_string(),
                format!("function <{script}:{line}> in @{script}:{line}")
            ],
            "{block}"
        );
    }
    let main = err
        .split("\n\n")
        .find(|b| b.contains("\"main\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(main.contains("[join fiber "), "{main}");
    // The wait-for graph, between the heading and the dump: each fiber's wait and who else
    // holds its channel (the main chunk's locals, the other fiber's upvalues), then the
    // cycles, the one of ping and pong among them.
    let id = |name: &str| -> String {
        let at = err.find(&format!(" \"{name}\" [")).unwrap();
        err[..at].rsplit("fiber ").next().unwrap().to_string()
    };
    let (m, pi, po) = (id("main"), id("ping"), id("pong"));
    let graph: Vec<&str> = err.split("\n\n").nth(1).unwrap().lines().collect();
    let channel = |line: &str| -> String {
        line.split("on channel ")
            .nth(1)
            .unwrap()
            .split(',')
            .next()
            .unwrap()
            .to_string()
    };
    let (ca, cb) = (channel(graph[2]), channel(graph[3]));
    assert_ne!(ca, cb, "{err}");
    assert_eq!(
        graph,
        [
            "wait-for graph:".to_string(),
            format!("  fiber {m} \"main\" joins fiber {pi} \"ping\""),
            format!(
                "  fiber {pi} \"ping\" receives on channel {ca}, which fibers {m} \"main\", \
                 {po} \"pong\" also hold"
            ),
            format!(
                "  fiber {po} \"pong\" receives on channel {cb}, which fibers {m} \"main\", \
                 {pi} \"ping\" also hold"
            ),
            format!("cycle: fiber {m} \"main\" → fiber {pi} \"ping\" → fiber {m} \"main\""),
            format!("cycle: fiber {pi} \"ping\" → fiber {po} \"pong\" → fiber {pi} \"ping\""),
        ],
        "{err}"
    );
    assert_eq!(
        lua_frames(main),
        [
            "join in =[C]:-1".to_string(),
            format!("main chunk in @{script}:9")
        ],
        "{main}"
    );
}

const MANY_WAITERS: &str = r#"
local fiber = require('fiber')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for _ = 1, 40 do fiber.create(function() wait_here() end) end
ch:get()
"#;

/// `--dump-view grouped`: a deadlock of 40 fibers stuck on the same line and the main fiber
/// reads as two groups, the 40 first, each with its Lua frames once.
#[test]
fn a_deadlock_of_many_identical_lua_waiters_reads_as_groups() {
    let (code, _out, err) = run_script(&["--dump-view", "grouped"], MANY_WAITERS);
    let script = &script_path(&["--dump-view", "grouped"], MANY_WAITERS);
    assert_ne!(code, 0, "{err}");
    let blocks: Vec<&str> = err.split("\n\n").collect();
    assert_eq!(blocks[0], "all fibers are asleep — deadlock!", "{err}");
    // 41 fibers on one channel that all of them hold (the main chunk's local, the waiters'
    // upvalue), and nobody else: one line for them all, and the knot they make.
    let graph: Vec<&str> = blocks[1].lines().collect();
    let ch = graph[1]
        .split("on channel ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{err}"));
    let these = "1 \"main\", 2 \"lua\", 3 \"lua\", 4 \"lua\", 5 \"lua\", 6 \"lua\", 7 \"lua\", \
                 8 \"lua\" and 33 more";
    assert_eq!(
        graph,
        [
            "wait-for graph:",
            &format!(
                "  41 fibers ({these}) receive on channel {ch}, which no other fiber is known \
                 to hold (more fibers used it than the runtime remembers)"
            ),
            "  all 41 fibers of this knot wait on one another: 1 \"main\", 2 \"lua\", 3 \"lua\", \
             4 \"lua\", 5 \"lua\", 6 \"lua\", 7 \"lua\", 8 \"lua\" and 33 more",
        ],
        "{err}"
    );
    let blocks = &blocks[1..];
    assert!(
        blocks[1].starts_with("scheduler ") && blocks[1].ends_with(": 41 fibers in 2 groups"),
        "{err}"
    );
    let (head, rest) = blocks[2].split_once('\n').unwrap();
    assert!(head.starts_with("40 fibers [channel receive, "), "{err}");
    assert!(head.ends_with("]: ids 2-41, names \"lua\":"), "{err}");
    assert!(
        rest.contains(" in fibertrace_lua::host::channel::ch_get"),
        "{err}"
    );
    assert_eq!(
        lua_frames(blocks[2]),
        [
            "get in =[C]:-1".to_string(),
            format!("wait_here in @{script}:4"),
            format!("function <{script}:5> in @{script}:5"),
        ],
        "{err}"
    );
    let head = blocks[3].lines().next().unwrap();
    assert!(head.starts_with("1 fiber [channel receive, "), "{err}");
    assert!(head.ends_with("]: id 1, name \"main\":"), "{err}");
    assert_eq!(
        lua_frames(blocks[3]),
        [
            "get in =[C]:-1".to_string(),
            format!("main chunk in @{script}:6")
        ],
        "{err}"
    );
    // A view that does not exist is refused before the script runs.
    let (code, out, err) = run_script(&["--dump-view", "tree"], "print('ran')");
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert!(
        err.contains("invalid value 'tree' for '--dump-view <VIEW>'"),
        "{err}"
    );
}

const SLICE: &str = r#"
if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
fiber.set_max_slice(0.05)
local ok, err = pcall(fiber.set_max_slice, -1)
assert(not ok and tostring(err) == 'slice value must be >= 0', tostring(err))
local f = fiber.new(function()
  local t = clock.monotonic() + 1.5
  while clock.monotonic() < t do end
end)
f:name('slicer')
f:set_joinable(true)
f:join()
"#;

#[test]
fn fiber_set_max_slice_starts_the_stall_detector() {
    let (code, _out, err) = run_script(&[], SLICE);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("\"slicer\" has run "), "{err}");
}

const PATIENT: &str = r#"
local fiber = require('fiber')
local ch = fiber.channel(1)
local function wait_here() local v = ch:get() return v end
local function worker() local v = wait_here() return v end
local f = fiber.new(worker)
f:name('patient')
f:set_joinable(true)
fiber.sleep(0.4)
ch:put(7)
print(f:join())
"#;

#[test]
fn a_fiber_blocked_longer_than_blocked_ms_is_reported_once_with_its_lua_frames() {
    let args = ["--blocked-ms", "100"];
    let (code, out, err) = run_script(&args, PATIENT);
    let script = &script_path(&args, PATIENT);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "true\t7\n");
    // No stall report without --stall-ms; one report per wait.
    assert!(!err.contains("without yielding"), "{err}");
    let blocks: Vec<&str> = err
        .split("\n\n")
        .filter(|b| b.contains("blocked: fiber ") && b.contains("\"patient\" ["))
        .collect();
    assert_eq!(blocks.len(), 1, "{err}");
    let block = blocks[0];
    assert!(block.contains("[channel receive, "), "{block}");
    assert!(!block.contains("not shown"), "{block}");
    // Every frame, innermost first: the runtime's wait, the host's `get`, then the Lua
    // frames; the glue between (the wrapper Lua calls, catch_unwind, the fiber's start) is
    // left out.
    let frames: Vec<String> = block
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| {
            let body = l
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start();
            match body.strip_prefix("0x") {
                Some(native) => {
                    let name = native.split_once(" in ").unwrap().1;
                    name.split(['+', ' ']).next().unwrap().to_string()
                }
                None => body.to_string(),
            }
        })
        .collect();
    assert_eq!(
        frames,
        [
            "fibertrace_fiber::sched::block".to_string(),
            "fibertrace_fiber::sync::Channel<T>::recv_until".to_string(),
            "fibertrace_fiber::sync::Channel<T>::recv".to_string(),
            "fibertrace_lua::host::channel::ch_get_body".to_string(),
            "get in =[C]:-1".to_string(),
            format!("wait_here in @{script}:4"),
            format!("function <{script}:5> in @{script}:5"),
        ],
        "{block}"
    );
    // The Lua frames, innermost first, as fiber.info() shows them.
    assert_eq!(
        lua_frames(block),
        [
            "get in =[C]:-1".to_string(),
            format!("wait_here in @{script}:4"),
            format!("function <{script}:5> in @{script}:5"),
        ],
        "{block}"
    );
}

#[test]
fn blocked_ms_rejects_zero_and_non_numbers() {
    for bad in ["0", "-1", "x", "", "18446744073709551616", "1.5"] {
        let (code, _out, err) = run_script(&["--blocked-ms", bad], "print(1)");
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("--blocked-ms"), "{bad}: {err}");
    }
    // The largest value is a limit never reached: the script runs, nothing is reported.
    let (code, out, err) = run_script(
        &["--blocked-ms", "18446744073709551615"],
        "require('fiber').sleep(0.05) print(1)",
    );
    assert_eq!((code, out.as_str(), err.as_str()), (0, "1\n", ""));
}

const PATIENT_BEHIND_A_HOG: &str = r#"
if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
local ch = fiber.channel(1)
local f = fiber.new(function() return ch:get() end)
f:name('patient')
f:set_joinable(true)
fiber.yield()
local t = clock.monotonic() + 0.8
while clock.monotonic() < t do end
ch:put(7)
print(f:join())
"#;

#[test]
fn a_blocked_report_behind_a_hog_says_why_its_lua_frames_are_missing() {
    let (code, out, err) = run_script(&["--blocked-ms", "100"], PATIENT_BEHIND_A_HOG);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "true\t7\n");
    let block = err
        .split("\n\n")
        .find(|b| b.contains("blocked: fiber ") && b.contains("\"patient\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(block.contains("[channel receive, "), "{block}");
    assert!(
        block.contains(" in fibertrace_lua::host::channel::ch_get"),
        "{block}"
    );
    assert_eq!(lua_frames(block), Vec::<String>::new(), "{block}");
    assert!(
        block.contains(
            "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread \
             did not come back to its run loop within 200 ms"
        ),
        "{block}"
    );
}

/// The channel is held only as a key of the main chunk's table (its maker has ended): the
/// graph finds it there. A zero-size userdata given the channel metatable by the script
/// (`debug.setmetatable`, LuaJIT's `newproxy`) is not taken for a channel.
const KEY_HELD: &str = r#"
local fiber = require('fiber')
local box = {}
local maker = fiber.new(function() box[fiber.channel()] = true end)
maker:set_joinable(true)
maker:join()
local fake = newproxy and newproxy(false)
if fake then debug.setmetatable(fake, debug.getmetatable(next(box))) end
local w = fiber.new(function() local ch = next(box) ch:get() end)
w:name('w')
w:set_joinable(true)
w:join()
"#;

#[test]
fn a_channel_held_as_a_table_key_is_seen_by_the_wait_for_graph() {
    let (code, _out, err) = run_script(&[], KEY_HELD);
    assert_eq!(code, 1, "{err}");
    let graph: Vec<&str> = err.split("\n\n").nth(1).unwrap().lines().collect();
    let ch = graph[2]
        .split("on channel ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        graph,
        [
            "wait-for graph:".to_string(),
            "  fiber 1 \"main\" joins fiber 3 \"w\"".to_string(),
            format!("  fiber 3 \"w\" receives on channel {ch}, which fiber 1 \"main\" also holds"),
            "cycle: fiber 1 \"main\" → fiber 3 \"w\" → fiber 1 \"main\"".to_string(),
        ],
        "{err}"
    );
}
