//! Stuck Lua fibers through `fibertrace run`: a busy fiber is reported by the stall
//! detector (`--stall-ms`), a channel deadlock exits non-zero with the report.

#[path = "../../fiber/tests/common/tied.rs"]
mod tied;
use tied::Tied;

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
    let _ = std::fs::remove_file(&path);
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
local f = fiber.new(function() local n = a(clock.monotonic() + 1.2) return n end)
f:name('busy')
f:set_joinable(true)
print(f:join())
"#;

/// The same under LuaJIT's compiler: the loop is compiled (a trace calls no hook; LuaJIT's
/// profiler still stops it), and spans lines.
const BUSY_JIT: &str = r#"
local fiber = require('fiber')
local clock = require('clock')
local function c(until_t)
  local n = 0
  while true do
    n = n + 1
    if n % 100000 == 0 and clock.monotonic() > until_t then
      break
    end
  end
  return n
end
local function b(t) return c(t) + 0 end
local function a(t) return b(t) + 0 end
local f = fiber.new(function() local n = a(clock.monotonic() + 1.2) return n end)
f:name('busy')
f:set_joinable(true)
print(f:join() and 'done')
"#;

/// The stall reports of fiber "busy" in `err`, in order, each with its figure in ms, up to
/// a blank line or the next report's heading (reports of a running fiber follow one another
/// without a blank line).
fn busy_reports(err: &str) -> Vec<(f64, Vec<&str>)> {
    let lines: Vec<&str> = err.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let ms = l
                .split("\"busy\" has run ")
                .nth(1)?
                .split("ms")
                .next()?
                .parse()
                .ok()?;
            let report = lines[i..]
                .iter()
                .enumerate()
                .take_while(|(k, l)| !l.is_empty() && (*k == 0 || !l.starts_with("fiber ")))
                .map(|(_, l)| *l)
                .collect();
            Some((ms, report))
        })
        .collect()
}

/// The first stall report of fiber "busy" in `err` (the one with the smallest figure: the
/// first by CPU time; a wall-time report may come first on a loaded machine), with its
/// figure in ms (see [`busy_reports`]).
fn first_busy_report(err: &str) -> (f64, Vec<&str>) {
    busy_reports(err)
        .into_iter()
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap_or_else(|| panic!("no stall report:\n{err}"))
}

/// A report's frame lines without their numbers.
fn frame_bodies(report: &[&str]) -> Vec<String> {
    report
        .iter()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| {
            l.trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start()
                .to_string()
        })
        .collect()
}

#[test]
fn a_busy_lua_fiber_is_reported_with_its_lua_frames() {
    // (script, (lines the innermost frame may be at, lines of the three outer frames),
    // what the script prints first)
    type Case<'a> = (&'a str, (&'a [u32], [u32; 3]), &'a str);
    let cases: [Case; 2] = [
        (BUSY, (&[5], [6, 7, 8]), "true\t"),
        (BUSY_JIT, (&[6, 7, 8], [14, 15, 16]), "done"),
    ];
    for (script, lines, done) in cases {
        let (code, out, err) = run_script(&["--stall-ms", "100"], script);
        let path = script_path(&["--stall-ms", "100"], script);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with(done), "{out}");
        // `fiber N "busy" has run 1xxms without yielding:` — the first report of the run's
        // CPU time comes within 1.5x the threshold.
        let (ms, report) = first_busy_report(&err);
        assert!((100.0..=150.0).contains(&ms), "{err}");
        let text = report.join("\n");
        // Its Lua frames, read inside it at the line it had reached (the interpreter's next
        // instruction, or the compiled loop's next line): nothing of the VM or of the host's
        // glue between them, and no note.
        let (c_lines, [b, a, f]) = lines;
        let frames = frame_bodies(&report);
        // The innermost line is one of the loop's (the next one the fiber reached).
        assert!(
            c_lines
                .iter()
                .any(|c| frames[0] == format!("c in @{path}:{c}")),
            "{text}"
        );
        assert_eq!(
            frames[1..],
            [
                format!("b in @{path}:{b}"),
                format!("a in @{path}:{a}"),
                format!("function <{path}:{f}> in @{path}:{f}"),
            ],
            "{text}"
        );
        assert_eq!(report.len(), 5, "{text}");
        // Again at twice the threshold while it lasts.
        assert!(err.matches("\"busy\" has run ").count() >= 2, "{err}");
    }
}

/// A stall found just before the program ends is reported before it ends: the exit waits
/// (a few seconds at most) for a report still being made — the first one of a debug build
/// symbolizes its frames cold, which takes longer than the 100 ms this script has left —
/// whether the script returns or calls `os.exit`.
#[test]
fn a_stall_found_just_before_the_end_is_reported_before_the_exit() {
    for end in ["", "os.exit(0)"] {
        let script = format!(
            r#"
if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
local function spin(until_t) local n = 0 while clock.monotonic() < until_t do n = n + 1 end return n end
local f = fiber.new(function() local n = spin(clock.monotonic() + 0.6) return n end)
f:name('busy')
f:set_joinable(true)
print(f:join())
{end}
"#
        );
        let (code, out, err) = run_script(&["--stall-ms", "100"], &script);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with("true\t"), "{out}");
        let (ms, report) = first_busy_report(&err);
        assert!((100.0..=250.0).contains(&ms), "{err}");
        let path = script_path(&["--stall-ms", "100"], &script);
        assert_eq!(
            frame_bodies(&report),
            [
                format!("spin in @{path}:5"),
                format!("function <{path}:6> in @{path}:6")
            ],
            "{err}"
        );
    }
}

/// A fiber inside a C function that does not return to Lua (here: waiting for a child
/// process) cannot be stopped at a Lua line: its thread is held still and its Lua frames
/// read from memory (LuaJIT), so the report has its native frames down to the C function Lua
/// called, then the Lua functions that called it; without that reader (Lua 5.4) it has its
/// native frames and names the C function it sits in. (It waits 3 s: the report comes at 4x
/// the threshold, 200 ms more for the Lua frames, then the symbolizer's first use, slow for
/// a debug build on a fresh machine; 1.2 s was once not enough in CI, and the report died
/// with the process.)
const IN_C: &str = r#"
local fiber = require('fiber')
local f = fiber.new(function() local ok = os.execute('sleep 3') return ok end)
f:name('busy')
f:set_joinable(true)
print(f:join() and 'done')
"#;

#[test]
fn a_fiber_stuck_in_c_code_is_reported_with_its_native_and_lua_frames() {
    let (code, out, err) = run_script(&["--stall-ms", "100"], IN_C);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("done"), "{out}");
    // Blocked in the kernel, it uses no CPU: reported by wall time (4x the threshold).
    let (_, report) = first_busy_report(&err);
    let text = report.join("\n");
    let frames = frame_bodies(&report);
    // `0x... in NAME+0x...`: the innermost native frame, in the C library.
    let top = frames[0]
        .split(" in ")
        .nth(1)
        .and_then(|r| r.split('+').next())
        .unwrap_or_else(|| panic!("{text}"));
    // `os.execute`'s C function: the host's own (which lets a SIGQUIT dump through while
    // the command runs), in `fibertrace run`, a process that handles SIGQUIT.
    assert!(
        report
            .iter()
            .any(|f| f.contains(" fibertrace_lua::host::execute::")),
        "{text}"
    );
    if cfg!(feature = "luajit") {
        let path = script_path(&["--stall-ms", "100"], IN_C);
        let lua: Vec<&String> = frames.iter().filter(|f| !f.starts_with("0x")).collect();
        assert_eq!(
            lua,
            [
                "execute in =[C]:-1",
                &format!("function <{path}:3> in @{path}:3")
            ],
            "{text}"
        );
        // Below the host's `os.execute`: the Lua frames, nothing native.
        let last_native = frames.iter().rposition(|f| f.starts_with("0x")).unwrap();
        assert!(
            frames[last_native].contains(" fibertrace_lua::host::execute::execute_body"),
            "{text}"
        );
        assert!(!text.contains("not shown"), "{text}");
    } else {
        assert_eq!(
            report.last().copied(),
            Some(
                format!(
                    "    (Lua frames not shown: the fiber runs C code ({top}) that did not return \
                     to Lua within 200 ms; its native frames are above)"
                )
                .as_str()
            ),
            "{text}"
        );
    }
}

/// A fiber blocked in the kernel for less than the 200 ms a safe point is waited for after
/// its report: three calls of 0.5 s in one run, reported by wall time at 400, 800 and 1,600
/// ms. Its frames are those of the moment it was blocked — the call, at its line — read with
/// its thread held (LuaJIT). They were those of its next safe point, reached once the call
/// returned: the line after the call (the loop's), the call gone. Without a held reader
/// (Lua 5.4) the frames of the safe point are said to be of that later moment.
const BLOCKED_BRIEFLY: &str = r#"
local fiber = require('fiber')
local function blocker()
  for _ = 1, 3 do
    os.execute('sleep 0.5')
  end
  return 1
end
local function outer()
  local r = blocker()
  return r
end
local f = fiber.new(outer)
f:name('busy')
f:set_joinable(true)
print(f:join() and 'done')
"#;

#[test]
fn a_fiber_blocked_briefly_in_the_kernel_is_reported_at_its_call_not_the_line_after() {
    let args = ["--stall-ms", "100"];
    let (code, out, err) = run_script(&args, BLOCKED_BRIEFLY);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "done\n", "{err}");
    let path = script_path(&args, BLOCKED_BRIEFLY);
    let reports = busy_reports(&err);
    assert!(!reports.is_empty(), "{err}");
    for (_, report) in &reports {
        let text = report.join("\n");
        let frames = frame_bodies(report);
        let lua: Vec<&String> = frames.iter().filter(|f| !f.starts_with("0x")).collect();
        if cfg!(feature = "luajit") {
            assert_eq!(
                lua,
                [
                    "execute in =[C]:-1",
                    &format!("blocker in @{path}:5"),
                    &format!("function <{path}:9> in @{path}:10"),
                ],
                "{text}"
            );
            assert!(!text.contains("not shown"), "{text}");
        } else if !lua.is_empty() {
            assert!(
                text.ends_with(
                    "(its frames are of its next safe point (for Lua, its next line), after \
                     the call it was blocked in returned)"
                ),
                "{text}"
            );
        } else {
            assert!(text.contains("(Lua frames not shown: "), "{text}");
        }
    }
}

/// A script that takes LuaJIT's profiler (`jit.profile`) has its running fibers reported
/// with a note saying why they cannot be stopped at a safe point, while it holds it: their
/// Lua frames read with the thread held (from its trace's base; none in the interpreter,
/// and the note says why); after its `stop` the host takes the profiler back and the Lua
/// frames are read at safe points again. (The second spin lasts 2 s: long
/// enough for a report by wall time, 4x the threshold, when a loaded machine gives the fiber
/// little CPU. The first lasts 2.5 s: its first report, read with the thread held, names
/// its frames cold — over a second on a slow machine, by when a 0.7 s spin had ended.)
#[cfg(feature = "luajit")]
const SCRIPT_PROFILES: &str = r#"
local fiber = require('fiber')
local clock = require('clock')
local profile = require('jit.profile')
local samples = 0
local function spin(t)
  local n = 0
  while clock.monotonic() < t do
    n = n + 1
  end
  return n
end
local f = fiber.new(function()
  profile.start('li5', function() samples = samples + 1 end)
  spin(clock.monotonic() + 2.5)
  profile.stop()
  fiber.yield()
  spin(clock.monotonic() + 2.0)
  return samples
end)
f:name('busy')
f:set_joinable(true)
local ok, n = f:join()
print(ok, n > 0)
"#;

/// (LuaJIT only: Lua 5.4 has no `jit.profile`.)
#[cfg(feature = "luajit")]
#[test]
fn a_script_that_takes_jit_profile_gets_a_note_until_it_gives_it_back() {
    let (code, out, err) = run_script(&["--stall-ms", "300"], SCRIPT_PROFILES);
    let path = script_path(&["--stall-ms", "300"], SCRIPT_PROFILES);
    assert_eq!(code, 0, "{err}");
    // The script's own profiler worked meanwhile.
    assert_eq!(out, "true\ttrue\n");
    let reports: Vec<&str> = err.split("fiber 2 \"busy\" has run ").skip(1).collect();
    assert!(reports.len() >= 2, "{err}");
    // The first run: the script holds the profiler. Read with the thread held: in the
    // loop's trace (its levels from the trace's base, and the note says so), or in the
    // interpreter (from its registers; the profiler's callback, line 14, may be on top).
    // On a slow machine the read may not come: then the note says why, and names the
    // script's profiler where it was the reason (the hold failed, or held in a state of the
    // interpreter that says no Lua code), or the fiber yielded (or its thread took no
    // signal) first.
    let refused = "its running fiber cannot be stopped at a safe point: the script's jit.profile \
                   holds LuaJIT's profiler, through which it is read";
    let first: Vec<&str> = reports[0].lines().collect();
    let lua: Vec<String> = frame_bodies(&first)
        .into_iter()
        .filter(|f| !f.starts_with("0x"))
        .collect();
    // (Stopped in the interpreter's call of `clock.monotonic`, or in the profiler's
    // callback: its level on top.)
    let lua = match lua.split_first() {
        Some((top, rest))
            if top == "monotonic in =[C]:-1"
                || *top == format!("function <{path}:14> in @{path}:14") =>
        {
            rest.to_vec()
        }
        _ => lua,
    };
    // (In the loop's trace the line is its snapshot's nearest the held position: a line of
    // the loop, or the loop's exit, `return n` at line 11 — seen in a CI run.)
    let held = (8..=11).any(|l| {
        lua == [
            format!("spin in @{path}:{l}"),
            format!("function <{path}:13> in @{path}:15"),
        ]
    }) && reports[0].contains(&format!(
        "({refused}: its Lua frames were read from memory, its thread held still"
    ));
    let unread = lua.is_empty()
        && (reports[0].contains("(frames of the layer above the runtime (Lua) not shown: ")
            && (reports[0].contains(refused)
                || reports[0].contains("not shown: the fiber yielded before they could be read)"))
            || reports[0].contains("(its stack was not sampled: "));
    assert!(
        held || unread,
        "{err}\n---- the first report:\n{}",
        reports[0]
    );
    // The second run: Lua frames again (the innermost at one of the loop's lines).
    let last = reports.last().unwrap();
    assert!(
        [8, 9].iter().any(|l| last.contains(&format!(
            "#0  spin in @{path}:{l}\n#1  function <{path}:13> in @{path}:18\n"
        ))),
        "{err}"
    );
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
/// A wait shorter than Tarantool's `TIMEOUT_INFINITY` (100 years) has a timer: a fiber that
/// sleeps two billion seconds is asleep, not suspended for good, so a script whose other
/// fibers wait on it is not a deadlock (from a billion seconds on it was: `all fibers are
/// asleep`, though the sleeper would wake and go on). From 100 years on, forever.
#[test]
fn waits_shorter_than_a_hundred_years_have_a_timer() {
    let (code, out, err) = run_script(
        &[],
        "local fiber = require('fiber')\n\
         local a = fiber.create(function() fiber.sleep(2e9) end)\n\
         local b = fiber.create(function() fiber.sleep(4e9) end)\n\
         local ch = fiber.channel(0)\n\
         local c = fiber.create(function() ch:get(2e9) end)\n\
         fiber.yield()\n\
         local info = fiber.info({backtrace = false})\n\
         print(info[a:id()].status, info[b:id()].status, info[c:id()].status)\n\
         os.exit(0)\n",
    );
    assert_eq!(code, 0, "{err}");
    let shorter = out.trim_end().split('\t').collect::<Vec<_>>();
    assert_eq!(shorter.len(), 3, "{out}");
    // The two-billion-second ones wait with a timer, as a short sleep does; the 4e9 one
    // forever.
    assert_eq!(shorter[0], "sleeping", "{out}");
    assert_eq!(shorter[1], "suspended", "{out}");
    assert_eq!(shorter[2], "waiting", "{out}");
}

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

/// The main chunk sets its slice, then spins: reported from its slice under way, whatever
/// the watchdog ran with before (`--blocked-ms` started it with no stall threshold, and the
/// run under way kept it: no report at all; `--stall-ms 5000` kept its own marks).
const SLICE_MAIN: &str = r#"
if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
local function spin(t)
  while clock.monotonic() < t do end
end
fiber.set_max_slice(0.05)
spin(clock.monotonic() + 0.5)
print('done')
"#;

#[test]
fn a_slice_set_by_the_running_fiber_applies_to_its_run_under_way() {
    for args in [&["--blocked-ms", "10"][..], &["--stall-ms", "5000"], &[]] {
        let (code, out, err) = run_script(args, SLICE_MAIN);
        let path = script_path(args, SLICE_MAIN);
        assert_eq!((code, out.as_str()), (0, "done\n"), "{args:?}: {err}");
        let first = err
            .split("fiber 1 \"main\" has run ")
            .nth(1)
            .unwrap_or_else(|| panic!("{args:?}: no report: {err}"));
        let lines: Vec<&str> = first.lines().collect();
        let lua: Vec<String> = frame_bodies(&lines)
            .into_iter()
            .filter(|f| !f.starts_with("0x"))
            .collect();
        let lua = match lua.split_first() {
            Some((top, rest)) if top == "monotonic in =[C]:-1" => rest.to_vec(),
            _ => lua,
        };
        assert!(
            [5, 6].iter().any(|l| lua
                == [
                    format!("spin in @{path}:{l}"),
                    format!("main chunk in @{path}:9"),
                ]),
            "{args:?}: {err}"
        );
    }
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

/// Many fibers blocked at once past `--blocked-ms` get the stall reports' rate limit (ten
/// reports a second): the rest are counted in a line, not reported one by one (20,000 fibers
/// waiting on one channel printed 20,000 reports, 10 MB, in a second).
#[test]
fn many_fibers_blocked_at_once_are_reported_at_the_rate_limit_and_counted() {
    let (code, _out, err) = run_script(
        &["--blocked-ms", "100"],
        "local fiber = require('fiber')\n\
         local ch = fiber.channel(0)\n\
         for i = 1, 200 do fiber.create(function() ch:get(0.5) end) end\n\
         fiber.sleep(0.4)\n",
    );
    assert_eq!(code, 0, "{err}");
    let reports = err.matches("blocked: fiber ").count();
    let counted: u64 = err
        .lines()
        .filter_map(|l| l.strip_prefix("fibertrace: "))
        .filter_map(|l| l.strip_suffix(" blocked past the limit, not reported (the rate limit)"))
        .map(|l| {
            l.split(' ')
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{l}"))
        })
        .sum();
    // The 200 waiting fibers and the main fiber's sleep: within the first second, ten
    // reports, the others counted.
    assert_eq!(reports, 10, "{err}");
    assert_eq!(reports as u64 + counted, 201, "{err}");
}

/// A dump the dump signal asked for just before the script ends on its own is written
/// before the exit, whole (none was: the exit came first; a dump under way during a
/// deadlock's exit was cut mid-line).
#[test]
fn a_dump_asked_just_before_the_end_is_written_before_the_exit() {
    let (code, _out, err) = run_script(
        &[],
        "local fiber = require('fiber')\n\
         local ch = fiber.channel(0)\n\
         for i = 1, 300 do fiber.create(function() ch:get() end) end\n\
         fiber.yield()\n\
         os.execute('kill -QUIT $PPID')\n\
         fiber.sleep(0)\n",
    );
    assert_eq!(code, 0, "{err}");
    let fibers = err
        .lines()
        .filter(|l| l.starts_with("fiber ") && l.contains(" [channel receive, "))
        .count();
    assert_eq!(fibers, 300, "{err}");
    // Whole: the last fiber's block as long as every other (they wait in the same place).
    // (Taken as the program ends, after its Lua host is gone: native frames only.)
    let blocks: Vec<usize> = err
        .split("\n\n")
        .filter(|b| b.starts_with("fiber ") && b.contains(" [channel receive, "))
        .map(|b| b.trim_end().lines().count())
        .collect();
    assert!(
        blocks.iter().all(|&n| n == blocks[0] && n > 2),
        "{blocks:?}: {err}"
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
local f = fiber.new(function() local v = ch:get() return v end)
f:name('patient')
f:set_joinable(true)
fiber.yield()
local t = clock.monotonic() + 0.8
while clock.monotonic() < t do end
ch:put(7)
print(f:join())
"#;

/// The report is built inside the hog, at its next Lua line: the patient's Lua frames are
/// there.
#[test]
fn a_blocked_report_behind_a_hog_has_its_lua_frames() {
    let (code, out, err) = run_script(&["--blocked-ms", "100"], PATIENT_BEHIND_A_HOG);
    let path = script_path(&["--blocked-ms", "100"], PATIENT_BEHIND_A_HOG);
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
    assert_eq!(
        lua_frames(block),
        [
            "get in =[C]:-1".to_string(),
            format!("function <{path}:6> in @{path}:6")
        ],
        "{block}"
    );
    assert!(!block.contains("not shown"), "{block}");
}

/// Behind a hog that sits in C code (waiting for a child process), the report cannot be
/// built on the scheduler's thread: native frames, and a note that says why.
const PATIENT_BEHIND_C: &str = r#"
local fiber = require('fiber')
local ch = fiber.channel(1)
local f = fiber.new(function() local v = ch:get() return v end)
f:name('patient')
f:set_joinable(true)
fiber.yield()
os.execute('sleep 0.8')
ch:put(7)
print(f:join())
"#;

/// A fiber blocked (on a channel) while its scheduler's thread is away in C code (the
/// command of `os.execute`): its report cannot be built on that thread, so the thread is held
/// still and the fiber's Lua frames read from memory; the report says so.
#[test]
fn a_blocked_report_behind_a_hog_in_c_code_reads_its_lua_frames_with_the_thread_held() {
    let (code, out, err) = run_script(&["--blocked-ms", "100"], PATIENT_BEHIND_C);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "true\t7\n");
    let block = err
        .split("\n\n")
        .find(|b| b.contains("blocked: fiber ") && b.contains("\"patient\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        block.contains(" in fibertrace_lua::host::channel::ch_get"),
        "{block}"
    );
    if cfg!(feature = "luajit") {
        // (The script's path is a scratch file's: `function <PATH:4> in @PATH:4`.)
        let frames = lua_frames(block);
        let path = frames
            .get(1)
            .and_then(|f| f.strip_prefix("function <"))
            .and_then(|f| f.split_once(":4> in @"))
            .filter(|(a, b)| *b == format!("{a}:4") && a.ends_with(".lua"))
            .map(|(a, _)| a.to_string());
        assert!(path.is_some(), "{block}");
        assert_eq!(frames.len(), 2, "{block}");
        assert_eq!(frames[0], "get in =[C]:-1", "{block}");
        assert!(
            block.ends_with(
                "(the scheduler's thread did not come back to its run loop within 200 ms, nor \
                 its running fiber to a safe point: the layer's (Lua) frames were read from \
                 memory, the thread held still)"
            ),
            "{block}"
        );
    } else {
        // (Lua 5.4: no layout to read its stacks from memory with.)
        assert_eq!(lua_frames(block), Vec::<String>::new(), "{block}");
        assert!(
            block.ends_with(
                "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread \
                 did not come back to its run loop within 200 ms, nor its running fiber to a safe \
                 point (it runs native code that does not return to the layer, or the thread waits \
                 outside the runtime))"
            ),
            "{block}"
        );
    }
}

/// Runs `script`, which deadlocks with fiber 1 "main" joining fiber 3 "w", which receives
/// on a channel main also holds: the wait-for graph says exactly that, and nothing more.
fn main_joins_w_who_waits_on_one_channel_main_holds(script: &str) {
    let (code, _out, err) = run_script(&[], script);
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
    main_joins_w_who_waits_on_one_channel_main_holds(KEY_HELD);
}

/// The main chunk holds, beside the channel its waiter receives on, a condition and a fiber
/// object that the script gave the channel metatable (`debug.setmetatable`): the graph's
/// reader takes neither for a channel (their blocks carry their own type's tag). Before, the
/// fiber object's id was read as a channel pointer (a crash in the deadlock report).
const DISGUISED: &str = r#"
local fiber = require('fiber')
local ch = fiber.channel()
local c = fiber.cond()
local dead = fiber.create(function() end)
debug.setmetatable(c, debug.getmetatable(ch))
debug.setmetatable(dead, debug.getmetatable(ch))
local w = fiber.new(function() ch:get() end)
w:name('w')
w:set_joinable(true)
w:join()
"#;

#[test]
fn objects_given_the_channel_metatable_are_not_taken_for_channels_by_the_wait_for_graph() {
    main_joins_w_who_waits_on_one_channel_main_holds(DISGUISED);
}

/// `SIGPROF` from outside (as `kill -PROF` or a profiler's timer sends it) finds the host's
/// handler: it only stops the running fiber at a safe point with nothing asked, and the
/// program runs on, its output and its C calls (a child process waited for) unharmed.
const UNDER_SIGPROF: &str = r#"
local fiber = require('fiber')
local clock = require('clock')
io.stdout:write('ready\n') io.stdout:flush()
local function work(t)
  local n = 0
  while clock.monotonic() < t do n = n + 1 end
  return n
end
local f = fiber.new(function() return work(clock.monotonic() + 0.5) > 0 end)
f:set_joinable(true)
local ok = os.execute('sleep 0.3')
print(f:join(), ok == true or ok == 0)
"#;

#[test]
fn stray_sigprof_signals_do_no_harm() {
    use std::io::{BufRead, Read};
    let path = script_path(&["sigprof"], UNDER_SIGPROF);
    std::fs::create_dir_all(std::path::Path::new(&path).parent().unwrap()).unwrap();
    std::fs::write(&path, UNDER_SIGPROF).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    for _ in 0..200 {
        // SAFETY: signals the child this test started.
        unsafe { libc::kill(child.id() as i32, libc::SIGPROF) };
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(rest, "true\ttrue\n", "{err}");
    assert_eq!(err, "");
}
