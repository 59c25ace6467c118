//! `fibertrace run --heap` / `--leaks` end to end: the heap charged per fiber in
//! `fiber.info()`, `require('fibertrace').heap()` in its formats and its refusals, the leak
//! report at exit, and `~m#` lines read back by `fibertrace decode`.

use fibertrace_acceptance::Tied;

use fibertrace_acceptance::{binary, run_in, scratch};
use std::io::Write as _;
use std::process::{Command, Stdio};

/// A builder fiber that leaves a 3,000-string table behind when it ends, a holder that keeps
/// 500 other strings while it sleeps (other: Lua interns strings), then the main fiber's
/// report lines.
const SCRIPT: &str = "local fiber = require('fiber')\n\
local ft = require('fibertrace')\n\
keep = {}\n\
local function build(n, c)\n\
  local t = {}\n\
  for i = 1, n do t[i] = string.rep(c, 100) .. i end\n\
  return t\n\
end\n\
local function middle(n, c) return build(n, c) end\n\
local b = fiber.create(function() keep[1] = middle(3000, 'x') end)\n\
local builder = b:id()\n\
local h = fiber.create(function() fiber.self():name('holder'); local x = middle(500, 'y'); fiber.sleep(100) end)\n\
fiber.sleep(0)\n\
for _, e in pairs(fiber.info()) do\n\
  if e.name == 'holder' then print('holder heap', e.memory.heap, e.memory.used ~= nil) end\n\
end\n\
local t = ft.heap()\n\
print('tier', t.tier, t.estimated)\n\
for _, e in ipairs(t.exited) do\n\
  if e.fiber == builder then print('builder held', e.bytes, e.objects) end\n\
end\n\
print('stacks', #t.stacks <= 20, t.live_bytes > 0)\n\
print('top', t.stacks[1].fibers[1].fiber == builder, t.stacks[1].fibers[1].exited)\n\
local text = ft.heap{format = 'text', top = 2}\n\
print('text', text:match('^heap: [^\\n]* live in %d+ allocations') ~= nil)\n\
print('lws', ft.heap{format = 'lws'}:match('^~m#') ~= nil)\n\
io.stdout:flush()\n\
if arg[1] == 'lws' then io.stderr:write(ft.heap{format = 'lws'}) end\n\
if arg[1] == 'pprof' then print('pprof', ft.heap{format = 'pprof', file = arg[2]}) end\n";

fn lines(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn heap_every_charges_each_fiber_and_keeps_an_exited_fibers_bytes() {
    let dir = scratch("heap-every");
    std::fs::write(dir.join("s.lua"), SCRIPT).unwrap();
    let out = run_in(&dir, &["run", "--heap=every", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let l = lines(&out);
    let held: Vec<&str> = l[2].split('\t').collect();
    let (bytes, objects): (i64, i64) = (held[1].parse().unwrap(), held[2].parse().unwrap());
    // 3,000 strings (a 24-byte header, 101..104 bytes and a NUL, in 8-byte steps of
    // LuaJIT's string allocator: 128..136 each) and the table's parts (its array grown to
    // 4,096 slots).
    assert!((3000..3100).contains(&objects), "{l:?}");
    assert!((420_000..500_000).contains(&bytes), "{l:?}");
    // 500 strings of ~104 bytes and the table: the holder's own heap.
    let holder: Vec<&str> = l[0].split('\t').collect();
    assert_eq!(holder[0], "holder heap", "{l:?}");
    let bytes: i64 = holder[1].parse().unwrap();
    assert!((50_000..200_000).contains(&bytes), "{l:?}");
    assert_eq!(holder[2], "true");
    assert_eq!(
        l[1..],
        [
            "tier\tevery\tfalse",
            &l[2],
            "stacks\ttrue\ttrue",
            "top\ttrue\ttrue",
            "text\ttrue",
            "lws\ttrue"
        ],
        "{err}"
    );
}

#[test]
fn heap_sampled_estimates_and_the_env_variable_does_the_same() {
    let dir = scratch("heap-sampled");
    std::fs::write(dir.join("s.lua"), SCRIPT).unwrap();
    for (args, env) in [
        (
            &["run", "--heap", "--heap-interval", "1024", "s.lua"][..],
            None,
        ),
        (
            &["run", "--heap-interval", "1024", "s.lua"][..],
            Some("sampled"),
        ),
    ] {
        let mut c = Command::new(binary());
        c.args(args).current_dir(&dir);
        if let Some(v) = env {
            c.env("FIBERTRACE_HEAP", v);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        let l = lines(&out);
        assert_eq!(l[1], "tier\tsampled\ttrue", "{l:?}");
        // The builder's ~460 KB in ~3,014 allocations, estimated from samples every 1 KiB on
        // average (~380 samples: within 25% is four standard errors).
        let held: Vec<&str> = l[2].split('\t').collect();
        assert_eq!(held[0], "builder held", "{l:?}");
        let (bytes, objects): (f64, f64) = (held[1].parse().unwrap(), held[2].parse().unwrap());
        assert!((bytes / 460_000.0 - 1.0).abs() < 0.25, "{l:?}");
        assert!((objects / 3014.0 - 1.0).abs() < 0.25, "{l:?}");
    }
}

#[test]
fn leaks_at_exit_lists_what_is_still_live_with_the_fiber_that_made_it() {
    let dir = scratch("heap-leaks");
    std::fs::write(dir.join("s.lua"), SCRIPT).unwrap();
    let out = run_in(&dir, &["run", "--leaks", "--leaks-top", "3", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = err
        .split_once("fibertrace: --leaks: live at exit:\n")
        .unwrap_or_else(|| panic!("{err}"))
        .1;
    // What was live before the script started (the runtime's set-up, the Lua state's own),
    // and what the runtime made outside the script's fibers, is left out, and said to be:
    // ~1,200 allocations, ~140 KiB, that every script "leaked".
    let (left_out, report) = report.split_once('\n').unwrap();
    let n: usize = left_out
        .strip_prefix("(left out: ")
        .and_then(|r| r.split_once(' '))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("{left_out}"));
    assert!(n > 500, "{left_out}");
    assert!(
        left_out.ends_with(
            " bytes, live since before the script started or made outside its fibers — the \
             runtime's and the Lua state's own)"
        ),
        "{left_out}"
    );
    assert!(report.starts_with("heap: "), "{report}");
    assert!(report.contains("top 3 by bytes:"), "{report}");
    // The biggest stack: the builder's strings, held by the builder, which has ended; its
    // Lua frames read from the VM's memory where LuaJIT allocated them (`build`, tail-called
    // by `middle`, is named as its caller calls it; a running function's line is not read).
    let first = report.split("\n\n").nth(1).unwrap();
    assert!(first.starts_with("[1] "), "{report}");
    assert!(first.contains("held by exited fiber 2: "), "{report}");
    // (Frame #0 is the host's Lua allocator, with `alloc::alloc::alloc` inlined into it in release
    // builds: an `inlined into` line follows.)
    assert!(
        first.contains("fibertrace_lua::host::global_alloc+0x"),
        "{first}"
    );
    let frames: Vec<&str> = first.lines().filter(|l| l.starts_with('#')).collect();
    assert!(frames[0].starts_with("#0  0x"), "{first}");
    assert!(frames[1].starts_with("#1  middle in @s.lua:"), "{first}");
    assert_eq!(frames[2], "#2  function <s.lua:10> in @s.lua:10", "{first}");
    assert!(
        report.contains("\nheld by exited fiber 2: heap: "),
        "{report}"
    );
    // What each fiber holds adds up to the report's total (each fiber's total counted what
    // was left out too, and exceeded the whole report's).
    let count = |l: &str, after: &str| -> u64 {
        l.split_once(after)
            .and_then(|(_, r)| r.split_once(" allocation"))
            .and_then(|(n, _)| n.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{l}"))
    };
    let total = count(report.lines().next().unwrap(), " live in");
    let held: u64 = report
        .lines()
        .filter(|l| l.starts_with("held by ") && l.contains(": heap: "))
        .map(|l| count(l, ": heap: "))
        .sum();
    assert_eq!(held, total, "{report}");
    assert!(!report.contains("\noutside fibers: "), "{report}");
}

/// The `--leaks` report of a run: what follows its first line.
fn leak_report(err: &str) -> &str {
    err.split_once("fibertrace: --leaks: live at exit:\n")
        .unwrap_or_else(|| panic!("{err}"))
        .1
}

/// Scripts that keep nothing: the report says so, whatever the fibers did and however the
/// run ended (the main chunk's end, `os.exit` from the main fiber or another): the Lua heap
/// is collected first, the runtime lets go of what it keeps for its next fibers (Lua
/// threads, fiber objects, stacks, slots), and what it made for itself outside the script's
/// fibers (its registry, its tables' growth) is left out. Before, a script that printed one
/// line "leaked" ~60 allocations of the runtime's.
#[test]
fn leaks_at_exit_of_a_script_that_keeps_nothing_are_none() {
    let dir = scratch("heap-no-leaks");
    let busy = "local fiber = require('fiber')\n\
local ch = fiber.channel(4)\n\
local c = fiber.cond()\n\
local done = 0\n\
for i = 1, 50 do\n\
  local f = fiber.new(function(n) ch:put(string.rep('x', n)) fiber.sleep(0.001) done = done + 1 c:signal() end, i)\n\
  f:name('worker ' .. i)\n\
  f:set_joinable(i % 2 == 0)\n\
end\n\
for _ = 1, 50 do assert(#ch:get() > 0) end\n\
while done < 50 do c:wait(1) end\n\
local n = 0\n\
for _ in pairs(fiber.info()) do n = n + 1 end\n\
print('listed', n)\n";
    let cases: [(&str, String, i32); 6] = [
        ("s1.lua", "print(1)\n".to_string(), 0),
        ("s2.lua", busy.to_string(), 0),
        // `os.exit` from the main chunk: what its frame still holds would be listed (it
        // is live), so the work is done in a function that has returned.
        (
            "s3.lua",
            format!("local fiber = require('fiber');\n(function()\n{busy}end)()\nos.exit(3)\n"),
            3,
        ),
        // From a fiber other than the main one, while the main one sleeps.
        (
            "s4.lua",
            format!(
                "local fiber = require('fiber');\n(function()\n{busy}end)()\n\
                 fiber.create(os.exit, 4)\n\
                 fiber.sleep(10)\n"
            ),
            4,
        ),
        // A fiber run at once by `fiber.create`: the runtime's bookkeeping when it ends
        // (the registry's free list grew) was charged to the main fiber, a 16-byte leak.
        (
            "s6.lua",
            "local fiber = require('fiber')\nfiber.create(function() end)\n".to_string(),
            0,
        ),
        // A finalizer runs in the collection (its output comes before the report).
        (
            "s5.lua",
            "local p = newproxy(true)\n\
             getmetatable(p).__gc = function() io.stderr:write('finalized\\n') end\n\
             p = nil\n"
                .to_string(),
            0,
        ),
    ];
    for (name, script, code) in cases {
        std::fs::write(dir.join(name), script).unwrap();
        let out = run_in(&dir, &["run", "--leaks", name]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{name}: {err}");
        let report = leak_report(&err);
        let mut lines = report.lines();
        assert!(
            lines.next().unwrap().starts_with("(left out: "),
            "{name}: {report}"
        );
        assert_eq!(
            lines.next(),
            Some("heap: nothing the script made is still live"),
            "{name}: {report}"
        );
        // (The main fiber, and the 25 joinable workers that ended, not joined: listed as
        // Tarantool lists them.)
        if !matches!(name, "s1.lua" | "s5.lua" | "s6.lua") {
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "listed\t26\n",
                "{name}"
            );
        }
        if name == "s5.lua" {
            assert!(err.starts_with("finalized\n"), "{err}");
        }
    }
}

/// A run ended by a signal (SIGTERM) still prints its `--leaks` report (the signal's exit
/// ran no `atexit` handler: the report was lost): what the script holds, its garbage too
/// (the Lua heap is not collected from the signal's thread), which the report says.
#[test]
fn leaks_at_exit_after_sigterm_lists_what_the_script_holds() {
    let dir = scratch("heap-leaks-term");
    std::fs::write(
        dir.join("s.lua"),
        "local fiber = require('fiber')\n\
         cache = {}\n\
         local function remember(i) cache[i] = {i} end\n\
         local function fill() for i = 1, 200 do remember(i) end end\n\
         local f = fiber.new(function() fill() fiber.sleep(100) end)\n\
         f:name('filler')\n\
         fiber.sleep(0)\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         fiber.sleep(100)\n",
    )
    .unwrap();
    let mut cmd = fibertrace_acceptance::command_in(&dir, &["run", "--leaks", "s.lua"]);
    cmd.stderr(Stdio::piped());
    let child = fibertrace_acceptance::spawn_until(cmd, "ready\n");
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    let report = leak_report(&err);
    assert!(
        report.starts_with(
            "(the Lua heap was not collected first: the run ended neither at the script's \
             end nor through os.exit (a signal, or an exit from native code), so garbage not \
             yet collected is listed too)\n(left out: "
        ),
        "{report}"
    );
    // The biggest: the 200 tables `remember` made, held by the filler (which sleeps), in
    // one group or a few (the interpreter's and the trace's native frames differ).
    let groups: Vec<&str> = report.split("\n\n").skip(1).collect();
    assert!(
        groups[0].starts_with("[1] ") && groups[0].contains(" — fiber 2 \"filler\": "),
        "{report}"
    );
    let mut tables = 0;
    for g in &groups {
        let frames: Vec<&str> = g.lines().filter(|l| l.starts_with('#')).collect();
        if !frames.iter().any(|f| f.contains(" fill in @s.lua:")) {
            continue;
        }
        // `remember` called by `fill`, in the interpreter and in the loop's compiled code
        // (which inlined `remember`) alike; and the JIT compiler's trace of the loop, made
        // at its line.
        let lua: Vec<&str> = frames[1..].iter().map(|f| f[4..].trim_start()).collect();
        if lua == ["fill in @s.lua:4", "function <s.lua:5> in @s.lua:5"] {
            assert!(g.contains(" B in 1 allocations — "), "{g}");
            continue;
        }
        assert_eq!(
            lua,
            [
                "remember in @s.lua:3",
                "fill in @s.lua:4",
                "function <s.lua:5> in @s.lua:5"
            ],
            "{g}"
        );
        assert!(g.contains(" — fiber 2 \"filler\": "), "{g}");
        let n: usize = g
            .split_once(" in ")
            .and_then(|(_, r)| r.split_once(' '))
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or_else(|| panic!("{g}"));
        tables += n;
    }
    // (The 200 tables, and the cache's array part as it grew.)
    assert!((200..=210).contains(&tables), "{tables}: {report}");
}

#[test]
fn lws_lines_of_the_live_heap_decode_with_fibertrace_decode() {
    let dir = scratch("heap-lws");
    std::fs::write(dir.join("s.lua"), SCRIPT).unwrap();
    let out = run_in(&dir, &["run", "--heap=every", "s.lua", "lws"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let m: Vec<&str> = err.lines().filter(|l| l.starts_with("~m#")).collect();
    assert!(m.len() > 3000, "{}", m.len());
    let mut dec = Command::new(binary())
        .args(["decode"])
        .current_dir(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let input = m[..50].join("\n") + "\n";
    dec.stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let d = dec.wait_with_output().unwrap();
    assert_eq!(d.status.code(), Some(0));
    let text = String::from_utf8_lossy(&d.stdout);
    // Each line decodes to lws's decoded form: a size and addresses.
    assert_eq!(
        text.lines().filter(|l| l.starts_with("~b#size: ")).count(),
        50,
        "{text}"
    );
}

#[test]
fn heap_refuses_bad_options_clearly_and_says_when_the_heap_is_not_tracked() {
    let dir = scratch("heap-errors");
    let script = "local ft = require('fibertrace')\n\
local function try(...) local ok, a, b = pcall(ft.heap, ...) print(ok, a, b) end\n\
try()\n\
try(5)\n\
try({format = 'nope'})\n\
try({top = 0})\n\
try({top = 1.5})\n\
try({top = 'x'})\n\
try({format = 'table', file = 'x'})\n\
try({format = 'text', file = ''})\n\
try({format = 1})\n\
try({format = 'pprof', file = {}})\n\
try({}, {})\n\
try({top = 3, formt = 'text'})\n";
    std::fs::write(dir.join("e.lua"), script).unwrap();
    let out = run_in(&dir, &["run", "e.lua"]);
    assert_eq!(out.status.code(), Some(0));
    let l = lines(&out);
    let usage = "fibertrace.heap([{format = 'table'|'text'|'pprof'|'lws', top = N, file = PATH}])";
    assert_eq!(
        l,
        [
            "true\tnil\tthe heap is not tracked in this process: install \
             fibertrace_core::heap::Tracked as the global allocator (fibertrace run: --heap or \
             --leaks, or FIBERTRACE_HEAP=sampled|every)"
                .to_string(),
            format!(
                "false\t{usage}: the argument is a table of options or a format name, not a \
                 number\tnil"
            ),
            format!("false\t{usage}: unknown format \"nope\"\tnil"),
            format!("false\t{usage}: top must be an integer from 1 to 100000\tnil"),
            format!("false\t{usage}: top must be an integer from 1 to 100000\tnil"),
            format!("false\t{usage}: top must be a number\tnil"),
            format!(
                "false\t{usage}: a table is not written to a file (format text, pprof or lws is)\tnil"
            ),
            format!("false\t{usage}: file is empty\tnil"),
            // (These named `fibertrace.dump` once.)
            format!("false\t{usage}: format must be a string\tnil"),
            format!("false\t{usage}: file must be a string\tnil"),
            format!("false\t{usage}: one argument at most\tnil"),
            format!("false\t{usage}: option \"formt\" is not one it takes (format, file, top)\tnil"),
        ]
    );
    // Tracked: a file that cannot be written is `nil, message`, nothing left behind.
    std::fs::write(
        dir.join("w.lua"),
        "local ft = require('fibertrace')\n\
         print(ft.heap{format = 'pprof', file = 'no/such/dir/h.pb.gz'})\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--heap", "w.lua"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("nil\t"), "{text}");
    assert!(text.contains("no/such/dir/h.pb.gz"), "{text}");
    // Bad flags: clap's errors, exit 2.
    for args in [
        &["run", "--heap=bogus", "w.lua"][..],
        &["run", "--heap-interval", "0", "w.lua"][..],
        &["run", "--leaks-top", "0", "w.lua"][..],
    ] {
        let out = run_in(&dir, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
    // An interval where nothing is sampled is refused before the script runs (it was taken
    // and unused, without a word).
    let none = "the heap is not tracked: add --heap (sampled)";
    let every = "--heap=every (and --leaks without --heap=sampled) records every allocation: \
                 there is no interval to set";
    for (args, why) in [
        (&["run", "--heap-interval", "4096", "w.lua"][..], none),
        (
            &["run", "--heap=every", "--heap-interval", "4096", "w.lua"][..],
            every,
        ),
        (
            &["run", "--leaks", "--heap-interval", "4096", "w.lua"][..],
            every,
        ),
    ] {
        let out = run_in(&dir, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: the script did not run");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!(
                "error: --heap-interval sets the sampling of --heap=sampled, and {why}\n\n\
                 For more information, try '--help'.\n"
            ),
            "{args:?}"
        );
    }
    // Given with sampling, through the flag or the environment, it is taken (the interval's
    // effect: `heap_sampled_estimates_and_the_env_variable_does_the_same`).
    let out = run_in(
        &dir,
        &[
            "run",
            "--leaks",
            "--heap=sampled",
            "--heap-interval",
            "4096",
            "w.lua",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `os.exit` inside a `__gc` finalizer under `--leaks`: no collection can run there, and the
/// report says that is why garbage is listed (it said the run ended neither at the script's
/// end nor through `os.exit`), and the runtime's own pool of Lua threads is not charged to
/// the script (it was: `release_thread`'s push, "held by exited fiber 1").
#[test]
fn leaks_after_os_exit_in_a_finalizer_say_why_the_heap_was_not_collected() {
    let dir = scratch("heap-exit-in-gc");
    std::fs::write(
        dir.join("gx.lua"),
        "local q = newproxy(true)\n\
         getmetatable(q).__gc = function() print('gc exit 7') os.exit(7) end\n\
         q = nil\n\
         print('end of main')\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "gx.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "end of main\ngc exit 7\n"
    );
    assert!(
        err.contains(
            "(the Lua heap was not collected first: os.exit was called inside a __gc \
             finalizer, where no collection can run, so garbage not yet collected is listed \
             too)"
        ),
        "{err}"
    );
    assert!(!err.contains("release_thread"), "{err}");
}

/// The line of an allocation made by the interpreter from inside an instruction (a table
/// made, a string joined): read from the PC LuaJIT saved for that call, checked against the
/// function's code. It showed `-1` ("a running function's line is not read"); code the JIT
/// compiled still shows no line (its trace keeps no PC there).
#[test]
fn leaks_name_the_line_of_each_interpreted_allocation() {
    let dir = scratch("heap-lines");
    std::fs::write(
        dir.join("s.lua"),
        "jit.off()\n\
         cache = {}\n\
         local function remember(i)\n\
           cache[i] = {i}\n\
         end\n\
         local function fill() for i = 1, 200 do remember(i) end end\n\
         fill()\n\
         names = {}\n\
         for i = 1, 100 do names[i] = 'n' .. i end\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let groups: Vec<&str> = report.split("\n\n").skip(1).collect();
    let lua = |g: &str| -> Vec<String> {
        g.lines()
            .filter(|l| l.starts_with('#') && !l.contains(" 0x"))
            .map(|l| l.split_once("  ").map_or(l, |(_, r)| r).to_string())
            .collect()
    };
    // The 200 tables, each made at line 4 in `remember`, called from `fill` (line 6), from
    // the main chunk (line 7).
    let tables = groups
        .iter()
        .find(|g| g.contains(" in 200 allocations"))
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(
        lua(tables),
        [
            "remember in @s.lua:4",
            "fill in @s.lua:6",
            "main chunk in @s.lua:7"
        ],
        "{tables}"
    );
    // The 100 strings joined at line 9 of the main chunk.
    let strings = groups
        .iter()
        .find(|g| g.contains(" in 100 allocations"))
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(lua(strings), ["main chunk in @s.lua:9"], "{strings}");
}

/// An allocation 300 Lua levels deep: its record keeps the innermost frames, exact (the hook
/// reads only as many levels as a record keeps: reading every level cost each allocation of a
/// deep recursion several times more).
#[test]
fn leaks_of_a_deep_recursion_keep_its_innermost_frames() {
    let dir = scratch("heap-deep");
    std::fs::write(
        dir.join("s.lua"),
        "jit.off()\n\
         keep = {}\n\
         local function work() for i = 1, 7 do keep[i] = {i} end end\n\
         local function rec(d) if d == 0 then work() return end return (rec(d - 1)) end\n\
         rec(300)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let group = report
        .split("\n\n")
        .find(|g| g.contains(" in 7 allocations"))
        .unwrap_or_else(|| panic!("{report}"));
    let frames: Vec<&str> = group.lines().filter(|l| l.starts_with('#')).collect();
    // The host's allocator, then the Lua levels, innermost first, as many as a record keeps
    // (31 frames, `fibertrace_core::codec::lws::MAX_DEPTH`, the allocator's own among them:
    // more of those in an unoptimised build), then the mark that the stack went on.
    assert!(frames[0].starts_with("#0  0x"), "{group}");
    assert!((25..=30).contains(&frames.len()), "{group}");
    assert_eq!(frames[1], "#1  work in @s.lua:3", "{group}");
    let last = frames.len() - 1;
    for (i, f) in frames.iter().enumerate().take(last).skip(2) {
        assert_eq!(*f, format!("#{i:<2} rec in @s.lua:4"), "{group}");
    }
    assert_eq!(
        frames[last],
        format!("#{last:<2} ... truncated ..."),
        "{group}"
    );
}

/// A report group's allocation count (`[N] SIZE in COUNT allocations — ...`), if it is one.
fn group_count(g: &str) -> Option<u64> {
    g.split_once(" in ")
        .and_then(|(_, r)| r.split(' ').next())
        .and_then(|n| n.parse().ok())
}

/// A report group's Lua frames, innermost first, without their numbers (a record's
/// `... truncated ...` end left out).
fn group_lua(g: &str) -> Vec<&str> {
    g.lines()
        .filter(|l| l.starts_with('#') && !l.contains(" 0x") && !l.contains("truncated"))
        .map(|l| l[4..].trim_start())
        .collect()
}

/// Allocations made by compiled code (the loop below becomes a trace, which inlines `va`,
/// `mid` and `leaf`, and the `__index` metamethod) have the frames and lines the
/// interpreter's allocations have: read from the trace's snapshot nearest before its call
/// out to allocate. They were charged to the function the trace started in at line `-1`
/// (a trace keeps no PC), the inlined functions missing; before that, to the state's recorded
/// frames, those of its last call out of Lua (a `fiber.yield` long returned showed as the
/// innermost level of most of them). The trace's machine code is left out as the VM's.
#[test]
fn leaks_of_compiled_code_have_its_lines_and_the_functions_it_inlined() {
    let dir = scratch("heap-jit");
    std::fs::write(
        dir.join("s.lua"),
        "local fiber = require('fiber')\n\
         keep = {}\n\
         local M = {}\n\
         function M.leaf(i) return {i} end\n\
         local function mid(i) local t = M.leaf(i) return t end\n\
         local function va(...) local t = mid(...) return t end\n\
         local mt = {__index = function(t, k) return {k} end}\n\
         local function loop()\n\
           local p = setmetatable({}, mt)\n\
           for i = 1, 5000 do\n\
             keep[i] = va(i)\n\
             keep[i + 5000] = p[i]\n\
             if i % 1000 == 0 then fiber.yield() end\n\
           end\n\
         end\n\
         fiber.create(loop)\n\
         fiber.sleep(0.1)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let groups: Vec<&str> = report
        .split("\n\n")
        .filter(|g| g.contains(" — held by exited fiber 2: "))
        .collect();
    let inlined = [
        "leaf in @s.lua:4",
        "mid in @s.lua:5",
        "va in @s.lua:6",
        "function <s.lua:8> in @s.lua:11",
    ];
    let metamethod = ["__index in @s.lua:7", "function <s.lua:8> in @s.lua:12"];
    let (mut tables, mut values) = (0u64, 0u64);
    for g in &groups {
        let count = group_count(g).unwrap_or_else(|| panic!("{g}"));
        // (The trace's machine code is the VM's: not shown, as `0x… in ??` after the Lua
        // frames it was.)
        assert!(!g.contains(" in ??"), "{g}");
        let lua = group_lua(g);
        if lua == inlined {
            tables += count;
        } else if lua == metamethod {
            values += count;
        } else {
            // Nothing else of the functions the loop calls (a level missing, a line -1).
            assert!(
                !lua.iter().any(|l| ["leaf", "mid", "va", "__index"]
                    .iter()
                    .any(|f| l.starts_with(&format!("{f} in")))),
                "{g}"
            );
        }
    }
    // The 5,000 tables of each kind, most of them made by the trace.
    assert_eq!((tables, values), (5000, 5000), "{report}");
}

/// Compiled code whose callee the trace holds by its prototype only (one of several
/// closures of a function, called through a table) and compiled `pcall`s: their levels are
/// there too, with lines. Both were charged to the loop's function at line `-1` (the trace's
/// snapshot did not name the callee; a protected call's frame link was not followed).
#[test]
fn compiled_calls_of_closures_and_through_pcall_have_their_levels() {
    let dir = scratch("heap-jit-calls");
    std::fs::write(
        dir.join("s.lua"),
        "keep = {}\n\
         local M = {}\n\
         for _, name in ipairs({'a', 'b', 'c'}) do\n\
           M[name] = function(i)\n\
             local t = {i, name}\n\
             return t\n\
           end\n\
         end\n\
         local function thrower(i)\n\
           local t = {i, i}\n\
           return t\n\
         end\n\
         local function loop(n)\n\
           for i = 1, n do\n\
             keep[i] = M.a(i)\n\
             local ok, v = pcall(thrower, i)\n\
             keep[n + i] = v\n\
           end\n\
         end\n\
         loop(2000)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let closure = [
        "a in @s.lua:5",
        "loop in @s.lua:15",
        "main chunk in @s.lua:20",
    ];
    let pcalled = [
        "function <s.lua:9> in @s.lua:10",
        "pcall in =[C]:-1",
        "loop in @s.lua:16",
        "main chunk in @s.lua:20",
    ];
    let (mut a, mut t) = (0u64, 0u64);
    for g in report.split("\n\n") {
        let Some(count) = group_count(g) else {
            continue;
        };
        let lua = group_lua(g);
        if lua == closure {
            a += count;
        } else if lua == pcalled {
            t += count;
        } else {
            assert!(
                !lua.iter().any(|l| l.contains(":-1") && !l.contains("=[C]")),
                "{g}"
            );
        }
    }
    // The 2,000 tables of each, most of them made by the trace.
    assert_eq!((a, t), (2000, 2000), "{report}");
}

/// A C function the interpreter calls right after a trace exited inside an inlined
/// function allocates with that function's frames: the JIT state still names the exit and
/// the saved PC is still its snapshot's, and the exit's frames were laid over the C
/// function's base (the review of the snapshot reader found it).
#[test]
fn a_c_function_called_right_after_a_trace_exit_has_its_own_frames() {
    let dir = scratch("heap-jit-exit");
    std::fs::write(
        dir.join("s.lua"),
        "keep, strs = {}, {}\n\
         local function mk(i)\n\
           local t = {i}\n\
           if i % 500 == 0 then\n\
             strs[#strs + 1] = string.format('%d-%s', i, 'x')\n\
           end\n\
           return t\n\
         end\n\
         local function loop(n)\n\
           for i = 1, n do\n\
             keep[i] = mk(i)\n\
           end\n\
         end\n\
         loop(3000)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let mut strings = 0;
    for g in report
        .split("\n\n")
        .filter(|g| g.contains("format in =[C]"))
    {
        let lua = group_lua(g);
        assert_eq!(
            lua,
            [
                "format in =[C]:-1",
                "mk in @s.lua:5",
                "loop in @s.lua:11",
                "main chunk in @s.lua:14"
            ],
            "{g}"
        );
        strings += 1;
    }
    assert!(strings > 0, "{report}");
}

/// Allocations a `__gc` finalizer makes have the finalizer's frames, then the frames of the
/// code whose collection ran it: LuaJIT runs finalizers on the VM's main thread, and the
/// fiber's own state still held the frames of its call out (`collectgarbage`), so they were
/// charged to `lj_buf_str` ← `collectgarbage` ← the main chunk, the finalizer missing.
#[test]
fn allocations_in_a_finalizer_have_its_frames_then_the_code_that_ran_it() {
    let dir = scratch("heap-gc");
    std::fs::write(
        dir.join("s.lua"),
        "keep = {}\n\
         local function in_finalizer(i)\n\
           keep[#keep + 1] = string.rep('x', 100000 + i)\n\
           keep[#keep + 1] = require('fiber').channel(1)\n\
         end\n\
         local function make(i)\n\
           local p = newproxy(true)\n\
           getmetatable(p).__gc = function() in_finalizer(i) end\n\
         end\n\
         for i = 1, 3 do make(i) end\n\
         collectgarbage()\n\
         assert(#keep == 6)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let report = leak_report(&err);
    let group = report
        .split("\n\n")
        .find(|g| g.starts_with("[1] ") && g.contains(" in 3 allocations — "))
        .unwrap_or_else(|| panic!("{report}"));
    let lua = group_lua(group);
    assert_eq!(
        lua,
        [
            "rep in =[C]:-1",
            "in_finalizer in @s.lua:3",
            "function <s.lua:8> in @s.lua:8",
            "collectgarbage in =[C]:-1",
            "main chunk in @s.lua:11",
        ],
        "{group}"
    );
    // A channel made in the finalizer: the runtime's C function makes it in a protected
    // call of its own (a second call from C on the main thread; only the first was read,
    // the finalizer missing).
    let mut channels = 0;
    for g in report
        .split("\n\n")
        .filter(|g| g.contains("channel in =[C]") || g.contains("? in =[C]"))
    {
        // (A record keeps the innermost frames: the host's below the main chunk are cut.)
        let lua = group_lua(g);
        // (Under the channel's C function, its own protected call, `?`, when it made
        // them there.)
        assert!(
            lua.ends_with(&[
                "channel in =[C]:-1",
                "in_finalizer in @s.lua:4",
                "function <s.lua:8> in @s.lua:8",
                "collectgarbage in =[C]:-1",
                "main chunk in @s.lua:11",
            ]),
            "{g}"
        );
        channels += 1;
    }
    assert!(channels > 0, "{report}");
}

/// Finalizers the collector runs inside a fiber's allocations (its steps, from the
/// interpreter and from C functions) have their frames on top of the fiber's, which have
/// their lines: the line the fiber's code was at when it called out (the step it took).
#[test]
fn finalizers_run_by_a_fibers_allocations_show_on_top_of_its_frames() {
    let dir = scratch("heap-gc-steps");
    std::fs::write(
        dir.join("s.lua"),
        "local fiber = require('fiber')\n\
         keep = {}\n\
         local function in_finalizer(i)\n\
           keep[#keep + 1] = {i, i}\n\
         end\n\
         local function make(i)\n\
           local p = newproxy(true)\n\
           getmetatable(p).__gc = function() in_finalizer(i) end\n\
         end\n\
         local function churn()\n\
           for i = 1, 6000 do\n\
             make(i)\n\
             local junk = {i, i, i}\n\
           end\n\
           io.stdout:write(#keep, '\\n')\n\
         end\n\
         fiber.create(churn)\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--leaks", "s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let kept: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(kept > 200, "{kept}");
    let report = leak_report(&err);
    let mut counted = 0;
    for g in report.split("\n\n").filter(|g| g.contains("in_finalizer")) {
        let count = group_count(g).unwrap_or_else(|| panic!("{g}"));
        let lua = group_lua(g);
        assert_eq!(
            lua[..2],
            ["in_finalizer in @s.lua:4", "function <s.lua:8> in @s.lua:8"],
            "{g}"
        );
        // Below: where the fiber's code was, each level with its line.
        let below: &[&str] = &lua[2..];
        let known: [&[&str]; 3] = [
            &[
                "newproxy in =[C]:-1",
                "make in @s.lua:7",
                "function <s.lua:10> in @s.lua:12",
            ],
            &["make in @s.lua:8", "function <s.lua:10> in @s.lua:12"],
            &["function <s.lua:10> in @s.lua:13"],
        ];
        assert!(known.contains(&below), "{g}");
        counted += count;
    }
    // Each finalizer's table (and the growth of `keep`), all of them.
    assert!(counted >= kept, "{counted} < {kept}: {report}");
}

/// The table form and the pprof export of the heap leave out the runtime's and the host's
/// glue, as the text form does: the three show a fiber's allocation with the same frames
/// (the table kept the host's `call_in_thread`, `run_main_fiber`, ... under the main chunk;
/// the pprof export `lua_fiber_main`, `LuaBody::run`, ...).
#[test]
fn the_heap_views_show_the_same_frames() {
    let dir = scratch("heap-views");
    std::fs::write(
        dir.join("s.lua"),
        "local fiber = require('fiber')\n\
         local ft = require('fibertrace')\n\
         jit.off()\n\
         keep = {}\n\
         local function make() for i = 1, 777 do keep[i] = {i} end end\n\
         fiber.create(function() make() end)\n\
         local t = ft.heap()\n\
         for _, s in ipairs(t.stacks) do\n\
           if s.objects == 777 then\n\
             for _, l in ipairs(s.frames) do print(l) end\n\
           end\n\
         end\n\
         io.stdout:write('--\\n')\n\
         io.stdout:write(ft.heap{format = 'text', top = 50})\n",
    )
    .unwrap();
    let out = run_in(&dir, &["run", "--heap=every", "s.lua"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let (table, text) = stdout.split_once("--\n").unwrap();
    // (Each frame's first line: in an optimised build `inlined into` lines follow some.)
    let table: Vec<&str> = table.lines().filter(|l| !l.starts_with(' ')).collect();
    // The host's allocator, then the Lua frames, ending at the fiber's entry.
    assert!(table[0].starts_with("0x"), "{stdout}");
    assert_eq!(
        table[table.len() - 2..],
        ["make in @s.lua:5", "function <s.lua:6> in @s.lua:6"],
        "{stdout}"
    );
    let group = text
        .split("\n\n")
        .find(|g| g.contains(" in 777 allocations"))
        .unwrap_or_else(|| panic!("{text}"));
    let lines: Vec<&str> = group
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| l.split_once(' ').map_or(l, |x| x.1).trim_start())
        .collect();
    assert_eq!(lines, table, "{group}");
}
