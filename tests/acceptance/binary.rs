//! The `fibertrace` binary end to end, as a user runs it: from another directory, on a
//! script named by a relative path.

use fibertrace_acceptance::Tied;

use fibertrace_acceptance::{run_in, scratch};

/// The `#N` lines of a report block that are Lua frames (`name in source:line`), without
/// their numbers.
fn lua_frames(block: &str) -> Vec<String> {
    block
        .lines()
        .filter(|l| l.starts_with('#') && l.contains(" in ") && !l.contains(" 0x"))
        .map(|l| l.split_once(' ').map_or(l, |(_, r)| r).trim().to_string())
        .collect()
}

const DEADLOCK: &str = "local fiber = require('fiber')\n\
local a, b = fiber.channel(), fiber.channel()\n\
local function ping()\n\
  a:get()\n\
end\n\
local f = fiber.new(ping)\n\
f:name('ping')\n\
f:set_joinable(true)\n\
f:join()\n";

#[test]
fn a_deadlock_report_from_another_directory_names_the_script_as_given() {
    let dir = scratch("deadlock");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/s.lua"), DEADLOCK).unwrap();
    let out = run_in(&dir, &["run", "app/s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The wait-for graph first: main holds the channel ping waits on, and waits for ping.
    assert!(
        err.starts_with(
            "all fibers are asleep — deadlock!\n\n\
             wait-for graph:\n  \
             fiber 1 \"main\" joins fiber 2 \"ping\"\n  \
             fiber 2 \"ping\" receives on channel 1, which fiber 1 \"main\" also holds\n\
             cycle: fiber 1 \"main\" → fiber 2 \"ping\" → fiber 1 \"main\"\n\n\
             scheduler "
        ),
        "{err}"
    );
    let ping = err
        .split("\n\n")
        .find(|b| b.contains("\"ping\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(ping.contains("[channel receive, "), "{ping}");
    assert_eq!(
        lua_frames(ping),
        // (Lua names a function value it was handed by where it is defined.)
        ["get in =[C]:-1", "function <app/s.lua:3> in @app/s.lua:4"],
        "{ping}"
    );
    let main = err
        .split("\n\n")
        .find(|b| b.contains("\"main\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        lua_frames(main),
        ["join in =[C]:-1", "main chunk in @app/s.lua:9"],
        "{main}"
    );
}

#[test]
fn a_script_that_does_not_exist_is_a_clear_error_from_anywhere() {
    let dir = scratch("missing");
    let out = run_in(&dir, &["run", "nope/missing.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("nope/missing.lua"), "{err}");
    assert!(err.contains("No such file or directory"), "{err}");
    assert!(out.stdout.is_empty());
}

/// A script whose fiber spins in a compiled loop; it prints `spinning` first.
const SPIN: &str = "local fiber = require('fiber')\n\
local function work(n)\n\
  local x = 0\n\
  for i = 1, n do\n\
    x = x + i % 7\n\
  end\n\
  return x\n\
end\n\
local function hog()\n\
  io.stdout:write('spinning\\n') io.stdout:flush()\n\
  while true do\n\
    work(1000)\n\
  end\n\
end\n\
local f = fiber.new(hog)\n\
f:name('hog')\n\
f:set_joinable(true)\n\
f:join()\n";

/// Runs `app/s.lua` (a script that prints a line when ready) from `dir` with `env`, sends
/// SIGQUIT once it is ready, and returns what it wrote on stderr by the time the dump of
/// every fiber is complete (or 20 s passed); the program is killed after.
fn sigquit_dump(dir: &std::path::Path, env: &[(&str, &str)]) -> String {
    use std::io::Read;
    use std::process::Stdio;
    let mut cmd = fibertrace_acceptance::command_in(dir, &["run", "app/s.lua"]);
    cmd.envs(env.iter().copied()).stderr(Stdio::piped());
    let mut child = fibertrace_acceptance::spawn_until(cmd, "spinning\n");
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
    let mut stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut err = Vec::new();
    let t0 = std::time::Instant::now();
    // The dump ends with the last fiber's blank line.
    while t0.elapsed() < std::time::Duration::from_secs(20) {
        if let Ok(b) = rx.recv_timeout(std::time::Duration::from_millis(50)) {
            err.extend(b);
        }
        let s = String::from_utf8_lossy(&err);
        if s.contains("\"hog\" [running]") && s.ends_with("\n\n") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    String::from_utf8_lossy(&err).into_owned()
}

#[test]
fn sigquit_while_a_fiber_spins_in_compiled_code_shows_its_lua_frames() {
    let dir = scratch("spin");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/s.lua"), SPIN).unwrap();
    let err = sigquit_dump(&dir, &[]);
    let hog = err
        .split("\n\n")
        .find(|b| b.contains("\"hog\" [running]"))
        .unwrap_or_else(|| panic!("{err}"));
    // Read inside it, at the next line its compiled loop reached: in `work` (its first
    // line, `local x = 0`, included: a thread held still at a call's entry is read there,
    // as CI saw), or in `hog`'s between two calls.
    let frames = lua_frames(hog);
    let in_work = [3, 4, 5, 6, 7].map(|l| {
        vec![
            format!("work in @app/s.lua:{l}"),
            // (Lua names a function value it was handed by where it is defined.)
            "function <app/s.lua:9> in @app/s.lua:12".to_string(),
        ]
    });
    let in_hog = [11, 12, 13].map(|l| vec![format!("function <app/s.lua:9> in @app/s.lua:{l}")]);
    assert!(
        in_work.contains(&frames) || in_hog.contains(&frames),
        "{hog}"
    );
    // Nothing but Lua frames: no VM, no glue.
    assert_eq!(
        hog.lines().filter(|l| l.starts_with('#')).count(),
        frames.len(),
        "{hog}"
    );
    let main = err
        .split("\n\n")
        .find(|b| b.contains("fiber 1 \"main\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        lua_frames(main),
        ["join in =[C]:-1", "main chunk in @app/s.lua:18"],
        "{main}"
    );
    assert!(!err.contains("not shown"), "{err}");

    // Turned off: the thread is held still instead, and the Lua frames are read from
    // memory — the spinning fiber's from the base its trace was entered with (the note says
    // so), or from the interpreter's base and PC registers where the thread was stopped.
    let err = sigquit_dump(&dir, &[("FIBERTRACE_LUA_SAFE_POINTS", "0")]);
    assert!(
        err.contains(
            "(the scheduler's thread did not come back to its run loop within 200 ms, and its \
             running fiber cannot be stopped at a safe point: turned off \
             (FIBERTRACE_LUA_SAFE_POINTS=0): the layer's (Lua) frames were read from memory, \
             the thread held still"
        ),
        "{err}"
    );
    let blocks = fiber_blocks(&err);
    let frames = lua_frames(&blocks["hog"]);
    assert!(
        in_work.contains(&frames) || in_hog.contains(&frames),
        "{err}"
    );
    // Nothing but Lua frames, as at a safe point: in compiled code the native frames below
    // the trace are walked from where the VM was entered, and the trace's own frame is its
    // innermost level's (a `??` frame of the trace's code came first, and nothing below).
    assert_eq!(
        blocks["hog"].lines().filter(|l| l.starts_with('#')).count(),
        frames.len(),
        "{err}"
    );
    assert!(!err.contains("not walked"), "{err}");
    // In the interpreter (compilation off): from its base and PC registers, every time.
    let dir = scratch("spin-interp");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/s.lua"), format!("jit.off() {SPIN}")).unwrap();
    let err = sigquit_dump(&dir, &[("FIBERTRACE_LUA_SAFE_POINTS", "0")]);
    let blocks = fiber_blocks(&err);
    let frames = lua_frames(&blocks["hog"]);
    assert!(
        in_work.contains(&frames) || in_hog.contains(&frames),
        "{err}"
    );
    assert!(!err.contains("; fiber 2:"), "{err}");
    assert_eq!(
        lua_frames(&blocks["main"]),
        ["join in =[C]:-1", "main chunk in @app/s.lua:18"],
        "{err}"
    );
}

/// Writes process `pid`'s core file into `dir` with gdb's `gcore` (the process runs on), and
/// returns its path.
fn gcore(dir: &std::path::Path, pid: &str) -> std::path::PathBuf {
    let out = std::process::Command::new("gcore")
        .arg("-o")
        .arg(dir.join("core"))
        .arg(pid)
        .output()
        .unwrap_or_else(|e| panic!("gcore cannot run ({e}): apt-get install gdb"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.join(format!("core.{pid}"))
}

/// The standard output of a command that must have succeeded (its errors in the message
/// if it did not).
fn stdout_of(out: &std::process::Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `fibertrace dump --core CORE`'s text, run from another directory.
fn dump_core(core: &std::path::Path) -> String {
    stdout_of(&run_in(
        &std::env::temp_dir(),
        &["dump", "--core", core.to_str().unwrap()],
    ))
}

/// A `fibertrace run` process that sleeps until killed, as a target for `fibertrace dump`.
fn sleeping_lua_process(dir: &std::path::Path) -> std::process::Child {
    std::fs::write(
        dir.join("sleep.lua"),
        "io.stdout:write('ready\\n') io.stdout:flush()\nrequire('fiber').sleep(60)\n",
    )
    .unwrap();
    fibertrace_acceptance::start_until(dir, &["run", "sleep.lua"], "ready\n")
}

/// Dumps of one process taken at once each get their turn (a process has one tracer at a
/// time: all but one failed, "already traced by process N (fibertrace)").
#[test]
fn dumps_of_one_process_taken_at_once_all_succeed() {
    let dir = scratch("dump-at-once");
    let mut target = sleeping_lua_process(&dir);
    let pid = target.id().to_string();
    let dumps: Vec<_> = (0..6)
        .map(|_| {
            let pid = pid.clone();
            std::thread::spawn(move || run_in(&std::env::temp_dir(), &["dump", &pid]))
        })
        .collect();
    for d in dumps {
        let text = stdout_of(&d.join().unwrap());
        assert!(text.contains("\nfiber 1 \"main\" [sleep, "), "{text}");
    }
    target.kill().unwrap();
    target.wait().unwrap();
}

#[test]
fn dump_pid_reads_another_process_from_anywhere_and_says_why_when_it_cannot() {
    let dir = scratch("dump-pid");
    let mut target = sleeping_lua_process(&dir);
    let pid = target.id().to_string();
    // From another directory, as a user runs it.
    let out = run_in(&std::env::temp_dir(), &["dump", &pid]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with(&format!("process {pid} \"fibertrace\" (")),
        "{text}"
    );
    // The main thread, from its innermost frame (in the C library) to the program's main.
    let main = text
        .split("\n\n")
        .find(|b| b.starts_with(&format!("thread {pid} ")))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(main.contains("\n#0  0x"), "{main}");
    assert!(main.contains(" in fibertrace::main"), "{main}");
    assert!(main.contains(" in fibertrace_fiber::"), "{main}");
    // Its fibers, from the registry the runtime publishes: the main fiber sleeps.
    assert!(
        text.contains("\nscheduler 1 \"lua\": 1 fiber (thread "),
        "{text}"
    );
    let fiber = text
        .split("\n\n")
        .find(|b| b.starts_with("fiber 1 \"main\" [sleep, "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        fiber.contains(" in fibertrace_lua::host::fiber_fns::sleep_body+"),
        "{fiber}"
    );
    assert_eq!(
        lua_frames(fiber),
        ["sleep in =[C]:-1", "main chunk in @sleep.lua:2"],
        "{fiber}"
    );
    // JSON: the same threads.
    let out = run_in(&std::env::temp_dir(), &["dump", &pid, "--format", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["pid"].to_string(), pid);
    assert_eq!(j["mode"], "consistent");
    assert!(j["threads"].as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(j["schedulers"][0]["fibers"][0]["name"], "main");
    assert_eq!(j["schedulers"][0]["fibers"][0]["waiting"], "sleep");
    // Without stopping it.
    let out = run_in(&std::env::temp_dir(), &["dump", &pid, "--non-blocking"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("not stopped: frames not exact"));
    // Not allowed: the same dump by another user (nobody).
    if std::process::Command::new("setpriv").arg("--version").output().is_ok()
        // SAFETY: getuid has no preconditions.
        && unsafe { libc::getuid() } == 0
    {
        let out = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(fibertrace_acceptance::binary())
            .args(["dump", &pid])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with(&format!(
                "fibertrace: not allowed to read process {pid}: run fibertrace as the \
                 process's user or as root (CAP_SYS_PTRACE)"
            )),
            "{err}"
        );
    }
    // Its core file (gdb's gcore writes it; the process runs on), read the same way.
    let core = gcore(&dir, &pid);
    let text = dump_core(&core);
    assert!(
        text.lines()
            .next()
            .unwrap_or("")
            .ends_with(&format!("from the core file {}", core.display())),
        "{text}"
    );
    // (A core records no clock: what the fiber waits on, not for how long.)
    assert!(text.contains("\nfiber 1 \"main\" [sleep]:\n"), "{text}");
    assert!(text.contains(" in fibertrace::main"), "{text}");
    // Grouped too (it said `[sleep, 0us]`).
    let tmp = std::env::temp_dir();
    let c = core.to_str().unwrap();
    let grouped = stdout_of(&run_in(&tmp, &["dump", "--core", c, "--format", "grouped"]));
    assert!(
        grouped.contains("\n1 fiber [sleep]: id 1, name \"main\":\n"),
        "{grouped}"
    );
    // Another program given for the executable: its frames unnamed and why, and the fibers
    // not said to be absent (another build's tables named and unwound the frames wrong, and
    // the fibers were said not to exist).
    let out = run_in(&tmp, &["dump", "--core", c, "/bin/sh"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let exe = fibertrace_acceptance::binary();
    assert!(
        text.starts_with(&format!(
            "process {pid} \"fibertrace\" ({}): ",
            exe.display()
        )),
        "{text}"
    );
    let unnamed = format!(
        "(frames unnamed in {}: the file read for it (/bin/sh) is not the one mapped (",
        exe.display()
    );
    assert!(text.contains(&unnamed), "{text}");
    assert!(
        text.contains(
            "(fibers: no fiber registry found, but not every file of the process could be \
             read for it: "
        ),
        "{text}"
    );
    assert!(!text.contains(" in fibertrace::main"), "{text}");
    // A --root that is not a directory, an executable that is not a file: said.
    for (args, said) in [
        (
            vec!["--root", "sleep.lua"],
            "fibertrace: --root sleep.lua: not a directory (a copy of the machine's files is one)\n",
        ),
        (
            vec!["12345"],
            "fibertrace: 12345: not a file (the executable the core names, where it is now)\n",
        ),
    ] {
        let mut all = vec!["dump", "--core", c];
        all.extend(args);
        let out = run_in(&dir, &all);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(String::from_utf8_lossy(&out.stderr), said);
    }
    let _ = std::fs::remove_file(&core);
    // --root needs --core; a core file that is not one says so.
    let out = run_in(&dir, &["dump", &pid, "--root", "/"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run_in(&dir, &["dump", "--core", "sleep.lua"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "fibertrace: sleep.lua: not a 64-bit ELF file\n"
    );
    target.kill().unwrap();
    target.wait().unwrap();
    // Gone.
    let out = run_in(&dir, &["dump", &pid]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("fibertrace: no such process: {pid}\n")
    );
    // Not a process id.
    for bad in ["0", "-3", "x", "", "99999999999"] {
        let out = run_in(&dir, &["dump", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
    }
}

/// A Lua script whose fibers wait in known functions until the file `go` appears: three
/// workers two calls deep, one inside a coroutine, and the poller that lets them go (it
/// says `ready` when every other fiber waits).
const WAITERS: &str = "local fiber = require('fiber')\n\
local ch = fiber.channel(10)\n\
local function leaf(i)\n\
  local v = ch:get() return v\n\
end\n\
local function middle(i)\n\
  local v = leaf(i)\n\
  io.stdout:write('finished ', i, '\\n')\n\
  return v\n\
end\n\
for i = 1, 3 do\n\
  fiber.create(function() middle(i) end):name('worker' .. i)\n\
end\n\
local function in_coroutine()\n\
  local co = coroutine.wrap(function() middle(4) end)\n\
  co()\n\
end\n\
fiber.create(in_coroutine):name('co')\n\
local function poll()\n\
  io.stdout:write('ready\\n') io.stdout:flush()\n\
  while not io.open('go') do fiber.sleep(0.2) end\n\
  for i = 1, 4 do ch:put(i) end\n\
end\n\
local p = fiber.new(poll)\n\
p:name('poller')\n\
p:set_joinable(true)\n\
p:join()\n\
fiber.sleep(0.05)\n";

/// The blocks of a dump's fibers, by name, without their header's time and the creator's
/// line (which the in-process dump words differently).
fn fiber_blocks(text: &str) -> std::collections::BTreeMap<String, String> {
    text.split("\n\n")
        .filter_map(|b| {
            let b = b.trim_start_matches('\n');
            let rest = b.strip_prefix("fiber ")?;
            let name = rest.split('"').nth(1)?.to_string();
            let body: Vec<&str> = b
                .lines()
                .skip(1)
                .filter(|l| !l.starts_with("created by") && !l.starts_with("--- created by"))
                .take_while(|l| l.starts_with('#') || l.starts_with("    inlined"))
                .collect();
            Some((name, body.join("\n")))
        })
        .collect()
}

#[test]
fn dump_pid_of_a_lua_process_shows_each_fibers_lua_frames_as_its_own_dump_does() {
    use std::io::BufRead;
    let dir = scratch("dump-lua");
    std::fs::write(dir.join("waiters.lua"), WAITERS).unwrap();
    let _ = std::fs::remove_file(dir.join("go"));
    let err_file = std::fs::File::create(dir.join("stderr")).unwrap();
    let mut child = std::process::Command::new(fibertrace_acceptance::binary())
        .args(["run", "waiters.lua"])
        .current_dir(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(err_file)
        .tied()
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    // The poller goes to sleep right after its line.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let pid = child.id().to_string();
    let dumped = run_in(&std::env::temp_dir(), &["dump", &pid]);
    assert_eq!(
        dumped.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&dumped.stderr)
    );
    let text = String::from_utf8_lossy(&dumped.stdout).into_owned();
    let blocks = fiber_blocks(&text);
    let worker = [
        "get in =[C]:-1",
        "leaf in @waiters.lua:4",
        "middle in @waiters.lua:7",
        "function <waiters.lua:12> in @waiters.lua:12",
    ];
    for w in ["worker1", "worker2", "worker3"] {
        let b = blocks.get(w).unwrap_or_else(|| panic!("{w}: {text}"));
        assert_eq!(lua_frames(b), worker, "{w}: {b}");
        // The native frames the Lua ones are merged with: the channel's wait first.
        assert!(b.starts_with("#0  0x"), "{b}");
        assert!(
            b.contains(" in fibertrace_lua::host::channel::ch_get_body+"),
            "{b}"
        );
    }
    assert_eq!(
        lua_frames(&blocks["co"]),
        [
            "get in =[C]:-1",
            "leaf in @waiters.lua:4",
            "middle in @waiters.lua:7",
            "function <waiters.lua:15> in @waiters.lua:15",
            "co in =[C]:-1",
            // (A fiber's function is called from C: no caller names it.)
            "function <waiters.lua:14> in @waiters.lua:16",
        ],
        "{text}"
    );
    assert_eq!(
        lua_frames(&blocks["poller"]),
        [
            "sleep in =[C]:-1",
            "function <waiters.lua:19> in @waiters.lua:21"
        ],
        "{text}"
    );
    assert_eq!(
        lua_frames(&blocks["main"]),
        ["join in =[C]:-1", "main chunk in @waiters.lua:27"],
        "{text}"
    );
    assert!(!text.contains("Lua frames"), "no fiber has a note: {text}");
    // The same frames, native and Lua, as the process's own dump (SIGQUIT) at this moment.
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
    let t0 = std::time::Instant::now();
    let own = loop {
        let e = std::fs::read_to_string(dir.join("stderr")).unwrap();
        if e.contains("fiber 6 \"poller\"") && e.ends_with("\n\n") {
            break e;
        }
        assert!(t0.elapsed().as_secs() < 20, "no SIGQUIT dump: {e}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let own_blocks = fiber_blocks(&own);
    for name in ["worker1", "worker2", "worker3", "co", "main"] {
        assert_eq!(blocks[name], own_blocks[name], "{name}");
    }
    // JSON: each Lua frame says what it is.
    let j = run_in(&std::env::temp_dir(), &["dump", &pid, "--format", "json"]);
    assert_eq!(j.status.code(), Some(0));
    let j: serde_json::Value = serde_json::from_slice(&j.stdout).unwrap();
    let fibers = j["schedulers"][0]["fibers"].as_array().unwrap();
    let w1 = fibers.iter().find(|f| f["name"] == "worker1").unwrap();
    let lua: Vec<String> = w1["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["frame"].get("lua").is_some())
        .map(|f| {
            let s = &f["resolved"]["symbols"][0];
            format!("{} {} {}", s["name"], s["file"], s["line"])
        })
        .collect();
    assert_eq!(
        lua,
        [
            "\"get\" \"=[C]\" null",
            "\"leaf\" \"@waiters.lua\" 4",
            "\"middle\" \"@waiters.lua\" 7",
            "\"function <waiters.lua:12>\" \"@waiters.lua\" 12",
        ]
    );
    // Grouped: the three workers in one group, with their frames.
    let g = run_in(
        &std::env::temp_dir(),
        &["dump", &pid, "--format", "grouped"],
    );
    assert_eq!(g.status.code(), Some(0));
    let g = String::from_utf8_lossy(&g.stdout).into_owned();
    let group = g
        .split("\n\n")
        .find(|b| b.starts_with("3 fibers [channel receive, "))
        .unwrap_or_else(|| panic!("{g}"));
    assert!(
        group
            .lines()
            .next()
            .unwrap()
            .ends_with("]: ids 2-4, names \"worker1\" ×1, \"worker2\" ×1, \"worker3\" ×1:"),
        "{group}"
    );
    assert_eq!(lua_frames(group), worker, "{group}");
    assert!(
        g.contains("\nscheduler 1 \"lua\": 6 fibers in 4 groups\n"),
        "{g}"
    );
    // Folded stacks (and so pprof, svg, speedscope): threads and fibers, root first.
    let f = run_in(&std::env::temp_dir(), &["dump", &pid, "--format", "folded"]);
    assert_eq!(f.status.code(), Some(0));
    let f = String::from_utf8_lossy(&f.stdout).into_owned();
    assert!(
        f.lines().any(|l| l.starts_with(
            "lua;fiber:worker1;function <waiters.lua:12> (waiters.lua);middle (waiters.lua);\
             leaf (waiters.lua);get ([C]);fibertrace_lua::host::channel::ch_get_body;"
        ) && l.ends_with(" 1")),
        "{f}"
    );
    assert!(
        f.lines().any(
            |l| l.starts_with("threads;thread:fibertrace;") && l.contains(";fibertrace::main;")
        ),
        "{f}"
    );
    let p = run_in(&std::env::temp_dir(), &["dump", &pid, "--format", "pprof"]);
    assert_eq!(p.status.code(), Some(0));
    assert_eq!(p.stdout[..2], [0x1f, 0x8b], "gzip");
    // Without stopping it: suspended fibers are exact all the same.
    let nb = run_in(&std::env::temp_dir(), &["dump", &pid, "--non-blocking"]);
    assert_eq!(nb.status.code(), Some(0));
    let nb_blocks = fiber_blocks(&String::from_utf8_lossy(&nb.stdout));
    assert_eq!(lua_frames(&nb_blocks["worker2"]), worker);
    // Its core file: the same Lua frames.
    let core = gcore(&dir, &pid);
    let c_text = dump_core(&core);
    let _ = std::fs::remove_file(&core);
    let c_blocks = fiber_blocks(&c_text);
    assert_eq!(lua_frames(&c_blocks["worker3"]), worker);
    assert_eq!(lua_frames(&c_blocks["co"]), lua_frames(&blocks["co"]));
    // The process runs on unharmed: let the fibers go; each finishes its work.
    std::fs::write(dir.join("go"), "").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{rest}");
    let mut finished: Vec<&str> = rest.lines().collect();
    finished.sort();
    assert_eq!(
        finished,
        ["finished 1", "finished 2", "finished 3", "finished 4"]
    );
}

/// The state letter of thread `tid` of process `pid` (`t`: stopped by a tracer).
fn thread_state(pid: u32, tid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

#[test]
fn a_dumper_killed_while_it_holds_the_process_lets_it_go_and_it_runs_on() {
    use std::io::BufRead;
    let dir = scratch("dump-killed");
    // Many fibers (a long read while the process is held) and a ticker that shows it runs.
    std::fs::write(
        dir.join("ticker.lua"),
        "local fiber = require('fiber')\n\
         local ch = fiber.channel()\n\
         for i = 1, 3000 do fiber.create(function() ch:get() end) end\n\
         local n = 0\n\
         while true do\n\
           n = n + 1\n\
           io.stdout:write('tick ', n, '\\n') io.stdout:flush()\n\
           fiber.sleep(0.01)\n\
         end\n",
    )
    .unwrap();
    let mut target = std::process::Command::new(fibertrace_acceptance::binary())
        .args(["run", "ticker.lua"])
        .current_dir(&dir)
        .stdout(std::process::Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let pid = target.id();
    let (tx, ticks) = std::sync::mpsc::channel::<String>();
    let stdout = target.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next_tick = |ticks: &std::sync::mpsc::Receiver<String>| {
        ticks
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the target ticks")
    };
    next_tick(&ticks);
    for sig in [libc::SIGINT, libc::SIGKILL] {
        let mut caught = false;
        for _ in 0..10 {
            let mut cmd = std::process::Command::new(fibertrace_acceptance::binary());
            cmd.args(["dump", &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            // SIGINT as a terminal gives it, whatever this test inherited (a run started in
            // the background by a shell has it ignored, and the dumper then ran on).
            // SAFETY: signal(2) in the child before exec, async-signal-safe.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    libc::signal(libc::SIGINT, libc::SIG_DFL);
                    Ok(())
                });
            }
            let mut dumper = cmd.tied().spawn().unwrap();
            // Wait for the target to be held, then kill the dumper.
            while dumper.try_wait().unwrap().is_none() {
                if thread_state(pid, pid) == Some('t') {
                    // SAFETY: signals the child this test started.
                    unsafe { libc::kill(dumper.id() as i32, sig) };
                    caught = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            let status = dumper.wait().unwrap();
            if caught && status.success() {
                // The dump had just ended when the signal came (seen held a moment before
                // it let the target go): not a dumper killed while it held the target.
                caught = false;
                continue;
            }
            if caught {
                break;
            }
        }
        assert!(
            caught,
            "the target was never seen held by a dump (signal {sig})"
        );
        // Let go: no thread stays stopped, and it goes on ticking.
        std::thread::sleep(std::time::Duration::from_millis(100));
        for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let tid: u32 = entry
                .unwrap()
                .file_name()
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert_ne!(
                thread_state(pid, tid),
                Some('t'),
                "thread {tid} (signal {sig})"
            );
        }
        while ticks.try_recv().is_ok() {}
        let a = next_tick(&ticks);
        let b = next_tick(&ticks);
        assert_ne!(a, b);
    }
    target.kill().unwrap();
    target.wait().unwrap();
}

/// A process killed while `dump PID` holds it: what was read is written, with a line under
/// the heading that says the process ended and the dump is incomplete, the same on stderr,
/// and the status is 1. It was 0, without a word, the fiber count in the heading whatever had
/// been read when the memory went away (11,000 of 30,001). (Killed before its threads were
/// walked, the dump is an error: `exited during the dump`, status 1. The kill comes later
/// and later in the reading, try by try.)
#[test]
fn a_process_killed_while_it_is_dumped_gives_an_incomplete_dump_said_so_and_status_1() {
    let dir = scratch("dump-target-killed");
    std::fs::write(
        dir.join("many.lua"),
        "local fiber = require('fiber')\n\
         local ch = fiber.channel()\n\
         for i = 1, 3000 do fiber.create(function() ch:get() end) end\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         fiber.sleep(60)\n",
    )
    .unwrap();
    let mut ended = 0;
    for attempt in 0..12u64 {
        let mut target = fibertrace_acceptance::start_until(&dir, &["run", "many.lua"], "ready\n");
        let pid = target.id();
        let dumper = std::process::Command::new(fibertrace_acceptance::binary())
            .args(["dump", &pid.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .tied()
            .spawn()
            .unwrap();
        // Killed once it is held by the dump.
        let t0 = std::time::Instant::now();
        while thread_state(pid, pid) != Some('t')
            && t0.elapsed() < std::time::Duration::from_secs(10)
        {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        std::thread::sleep(std::time::Duration::from_millis(5 * attempt));
        target.kill().unwrap();
        // (A dump that hangs fails the test, not the suite.)
        let dumper_pid = dumper.id() as i32;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(dumper.wait_with_output());
        });
        let out = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(out) => out.unwrap(),
            Err(_) => {
                // SAFETY: signals the child this test started.
                unsafe { libc::kill(dumper_pid, libc::SIGKILL) };
                panic!("the dump of a killed process did not end within 60 s");
            }
        };
        target.wait().unwrap();
        let (text, err) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        if out.status.success() {
            // The reading was over before the kill: complete, and nothing said.
            assert!(text.contains(": 3001 fibers"), "{text}");
            assert!(!text.contains("ended while it was read"), "{text}");
            continue;
        }
        assert_eq!(out.status.code(), Some(1), "{err}");
        if err == format!("fibertrace: process {pid} exited during the dump\n") {
            assert_eq!(text, "");
            continue;
        }
        assert_eq!(
            err,
            format!(
                "fibertrace: process {pid} ended while it was read (killed, or it exited): the \
                 dump is incomplete\n"
            )
        );
        let second = text.lines().nth(1).unwrap_or_default();
        assert_eq!(
            second,
            "(the process ended while it was read (killed, or it exited): what was read after \
             that is missing or wrong, the dump is incomplete)",
            "{text}"
        );
        ended += 1;
        if ended == 2 {
            break;
        }
    }
    assert!(ended > 0, "no kill came while the dump read the process");
}

/// Flags that take a number say what they take, whatever was given: clap's own messages were
/// "invalid digit found in string" (`-1`, `1e3`), "number too large to fit in target type" and
/// "0 is not in 1..18446744073709551615"; and a flag that only shapes another's work, given
/// without it, is refused rather than silently unused.
#[test]
fn numeric_flags_say_what_they_take_and_a_flag_without_its_feature_is_refused() {
    let dir = scratch("flag-values");
    std::fs::write(dir.join("s.lua"), "print('ran')\n").unwrap();
    let ms = "a whole number of milliseconds is expected, 1 or more";
    let cases: &[(&str, &str, &str, &str)] = &[
        ("--stall-ms", "-1", "N", ms),
        ("--stall-ms", "0", "N", ms),
        ("--stall-ms", "1e3", "N", ms),
        (
            "--stall-ms",
            "99999999999999999999",
            "N",
            "a whole number of milliseconds is expected, 1 or more: this one is past \
             18446744073709551615",
        ),
        ("--blocked-ms", "", "N", ms),
        ("--blocked-ms", "1.5", "N", ms),
        (
            "--dump-on-exit-wait",
            "0.5",
            "SECONDS",
            "a whole number of seconds is expected, from 1 to 3600",
        ),
        (
            "--heap-interval",
            "1099511627777",
            "BYTES",
            "a whole number of bytes is expected, from 1 to 1099511627776",
        ),
        (
            "--leaks-top",
            "-1",
            "N",
            "a whole number of stacks is expected, from 1 to 100000",
        ),
    ];
    for (flag, value, name, why) in cases {
        let out = run_in(&dir, &["run", flag, value, "s.lua"]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        assert!(
            out.stdout.is_empty(),
            "{flag} {value}: the script did not run"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            err.lines().next(),
            Some(format!("error: invalid value '{value}' for '{flag} <{name}>': {why}").as_str()),
            "{err}"
        );
    }
    // In range: taken.
    let out = run_in(
        &dir,
        &["run", "--stall-ms", "250", "--blocked-ms", "1", "s.lua"],
    );
    assert_eq!(
        (out.status.code(), stdout_of(&out).as_str()),
        (Some(0), "ran\n")
    );
    // --leaks-top without --leaks.
    let out = run_in(&dir, &["run", "--leaks-top", "5", "s.lua"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: --leaks-top sets how many stacks the --leaks report lists, and --leaks is not \
         given\n\nFor more information, try '--help'.\n"
    );
    let out = run_in(&dir, &["run", "--leaks", "--leaks-top", "5", "s.lua"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `examples/speed.sh` (the speed goals' command) run from another directory.
fn speed_script(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let script = fibertrace_acceptance::repo().join("examples/speed.sh");
    let mut c = std::process::Command::new("sh");
    c.arg(&script).args(args).current_dir(dir);
    c.env("FIBERTRACE_BIN", fibertrace_acceptance::binary());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("sh runs")
}

#[test]
fn the_speed_command_rejects_bad_run_counts_sizes_and_programs() {
    let dir = scratch("speed-args");
    let bad_env = [
        (
            "SPEED_SIZES",
            "1x",
            "SPEED_SIZES and SPEED_COUNTS take positive numbers, not '1x'",
        ),
        (
            "SPEED_SIZES",
            "0",
            "SPEED_SIZES and SPEED_COUNTS take positive numbers, not '0'",
        ),
        (
            "SPEED_COUNTS",
            "5",
            "SPEED_COUNTS takes two numbers (fibers created, switches), not '5'",
        ),
    ];
    for (k, v, msg) in bad_env {
        let out = speed_script(&dir, &["1"], &[(k, v), ("SPEED_LUA_ONLY", "1")]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{k}={v}: {err}");
        assert!(err.contains(msg), "{k}={v}: {err}");
    }
    // A program that fails, or prints no figures: an error naming it, not a table.
    for (bin, msg) in [
        (
            "/bin/false",
            "fibertrace failed on examples/bench.lua at 100 fibers",
        ),
        (
            "/bin/true",
            "fibertrace: examples/bench.lua at 100 fibers did not print its nine figures",
        ),
    ] {
        let script = fibertrace_acceptance::repo().join("examples/speed.sh");
        let out = std::process::Command::new("sh")
            .arg(&script)
            .arg("1")
            .current_dir(&dir)
            .env("FIBERTRACE_BIN", bin)
            .env("SPEED_LUA_ONLY", "1")
            .env("SPEED_SIZES", "100")
            .output()
            .expect("sh runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bin}: {err}");
        assert!(err.contains(msg), "{bin}: {err}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("speed goals"),
            "{bin}"
        );
    }
    for (arg, msg) in [
        ("abc", "N must be a number of runs, not 'abc'"),
        ("1x", "N must be a number of runs, not '1x'"),
        ("-3", "N must be a number of runs, not '-3'"),
        ("0", "N must be at least 1"),
    ] {
        let out = speed_script(&dir, &[arg], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{arg:?}: {err}");
        assert!(err.contains(msg), "{arg:?}: {err}");
        assert!(out.stdout.is_empty(), "{arg:?}");
    }
}

#[test]
fn the_speed_command_reads_every_lua_figure_and_says_when_tarantool_is_missing() {
    let dir = scratch("speed-lua");
    let out = speed_script(
        &dir,
        &["1"],
        &[
            ("SPEED_LUA_ONLY", "1"),
            ("TARANTOOL", "/nonexistent/tarantool"),
            ("SPEED_SIZES", "100 200 300"),
            ("SPEED_COUNTS", "2000 2000"),
        ],
    );
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("tarantool is not installed (apt-get install tarantool)"),
        "{err}"
    );
    // Every figure parsed from the program's lines: a positive number on each line.
    let figures: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("fiber.info") || l.starts_with("Lua yield"))
        .flat_map(|l| {
            l.split([' ', ';', '(', ')'])
                .filter_map(|w| w.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .collect();
    // 3 sizes x (size, no backtrace and its mean, backtrace and its mean, every fiber
    // moved) + (yield, create).
    assert_eq!(figures.len(), 20, "{text}");
    assert!(
        text.contains("fiber.info({backtrace=false})   200 fibers: "),
        "{text}"
    );
    assert!(figures.iter().all(|x| x.is_finite() && *x > 0.0), "{text}");
    // The first listing of a process: its time (positive) and the memory it added.
    let first = text
        .lines()
        .find_map(|l| l.strip_prefix("first fiber.info() of a process: "))
        .unwrap_or_else(|| panic!("{text}"));
    let (ms, kb) = first
        .strip_suffix(" kB resident")
        .and_then(|r| r.split_once(" ms, +"))
        .unwrap_or_else(|| panic!("{first}"));
    assert!(ms.parse::<f64>().is_ok_and(|x| x > 0.0), "{first}");
    assert!(kb.parse::<f64>().is_ok_and(|x| x >= 0.0), "{first}");
}

/// Each goal's line carries the spread of the runs behind its medians (`[runs MIN-MAX,
/// tarantool MIN-MAX]`), so that a verdict resting on one lucky run shows as such. The peer
/// here is a stand-in (`fibertrace run` under the name the script takes for tarantool): the
/// test checks the table, not Tarantool.
#[test]
fn the_speed_command_prints_the_spread_of_the_runs_behind_each_median() {
    let dir = scratch("speed-spread");
    let peer = dir.join("peer.sh");
    std::fs::write(
        &peer,
        format!(
            "#!/bin/sh\nexec '{}' run \"$@\"\n",
            fibertrace_acceptance::binary().display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&peer, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = speed_script(
        &dir,
        &["3"],
        &[
            ("SPEED_LUA_ONLY", "1"),
            ("TARANTOOL", peer.to_str().unwrap()),
            ("SPEED_SIZES", "100 200"),
            ("SPEED_COUNTS", "2000 2000"),
        ],
    );
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{err}");
    let goals: Vec<&str> = text.lines().filter(|l| l.contains("(goal ")).collect();
    // 2 sizes x (no backtraces, backtraces, every fiber moved), flatness, yield, create.
    assert_eq!(goals.len(), 9, "{text}");
    let number = |w: &str| -> f64 { w.parse().unwrap_or_else(|_| panic!("{w:?} in {text}")) };
    let range = |r: &str| -> (f64, f64) {
        let (lo, hi) = r
            .split_once('-')
            .unwrap_or_else(|| panic!("{r:?} in {text}"));
        (number(lo), number(hi))
    };
    let mut with_spread = 0;
    for line in goals {
        assert!(line.contains("holds") || line.contains("MISSED"), "{line}");
        let Some((head, runs)) = line.split_once("  [runs ") else {
            // Flatness is a ratio of medians over sizes: no runs of its own.
            assert!(line.contains("flatness"), "{line}");
            continue;
        };
        with_spread += 1;
        // "fibertrace's median vs tarantool's median" and each program's runs around it.
        let (ours, peers) = runs
            .strip_suffix(']')
            .and_then(|r| r.split_once(", tarantool "))
            .unwrap_or_else(|| panic!("{line}"));
        let (a, b) = (range(ours), range(peers));
        let (_, medians) = head.split_once(" fibers ").unwrap_or(("", head));
        let figures: Vec<f64> = medians
            .split([' ', ':', 'x'])
            .filter_map(|w| w.parse::<f64>().ok())
            .collect();
        let (m, n) = (figures[0], figures[1]);
        // The medians are printed rounded: allow their last digit.
        let near = |v: f64, (lo, hi): (f64, f64)| lo * 0.99 - 0.05 <= v && v <= hi * 1.01 + 0.05;
        assert!(a.0 <= a.1 && b.0 <= b.1, "{line}");
        assert!(
            near(m, a) && near(n, b),
            "{line}: {m} in {a:?}, {n} in {b:?}"
        );
    }
    assert_eq!(with_spread, 8, "{text}");
}

/// `dump PID` gives a waiting time only to the fibers that wait, as the process's own dump
/// does: it showed `[ready, 3.0s]` for fibers that only yield (the time since they last
/// blocked, after millions of switches), and a fiber caught between the two stores of a
/// resume as `ready` with the note that it runs.
#[test]
fn dump_pid_gives_a_time_only_to_the_fibers_that_wait() {
    let dir = scratch("dump-times");
    std::fs::write(
        dir.join("y.lua"),
        "local fiber = require('fiber')\n\
         for i = 1, 2 do fiber.create(function() while true do fiber.yield() end end):name('yielder' .. i) end\n\
         fiber.create(function() fiber.sleep(100) end):name('sleeper')\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         while true do fiber.yield() end\n",
    )
    .unwrap();
    let mut child = fibertrace_acceptance::start_until(&dir, &["run", "y.lua"], "ready\n");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let pid = child.id().to_string();
    let j = run_in(&std::env::temp_dir(), &["dump", &pid, "--format", "json"]);
    let t = run_in(&std::env::temp_dir(), &["dump", &pid]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        j.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&j.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&j.stdout).unwrap();
    let fibers = j["schedulers"][0]["fibers"].as_array().unwrap();
    assert_eq!(fibers.len(), 4, "{j}");
    for f in fibers {
        let status = f["status"].as_str().unwrap();
        if f["name"] == "sleeper" {
            assert_eq!(status, "sleeping", "{f}");
            let s = f["status_seconds"].as_f64().unwrap();
            assert!((1.0..60.0).contains(&s), "{f}");
        } else {
            assert!(status == "ready" || status == "running", "{f}");
            assert!(f["status_seconds"].is_null(), "{f}");
            // The note that it runs goes only with the status that says so; a running fiber
            // caught with its thread's stack pointer in its own stack has its frames walked
            // from the thread's registers instead, down to its Lua function.
            let says_running = f["note"].as_str().is_some_and(|n| n.starts_with("running"));
            if status == "ready" {
                assert!(!says_running, "{f}");
            } else if !says_running {
                let frames = f["frames"].as_array().unwrap();
                let lua: Vec<&str> = frames
                    .iter()
                    .filter(|x| x["frame"]["lua"].is_u64())
                    .filter_map(|x| x["resolved"]["symbols"][0]["name"].as_str())
                    .collect();
                let own = if f["name"] == "main" {
                    "main chunk"
                } else {
                    "function <y.lua:2>"
                };
                // In the interpreter's own code its Lua frames cannot be read, and a note
                // says why.
                assert!(
                    lua.last().copied() == Some(own) || (lua.is_empty() && f["note"].is_string()),
                    "{f}"
                );
            }
        }
    }
    let t = String::from_utf8_lossy(&t.stdout).into_owned();
    for name in ["yielder1", "yielder2", "main"] {
        let head = t
            .lines()
            .find(|l| l.starts_with("fiber ") && l.contains(&format!("\"{name}\"")))
            .unwrap_or_else(|| panic!("{name}: {t}"));
        assert!(
            head.ends_with(" [ready]:") || head.ends_with(" [running]:"),
            "{head}"
        );
    }
}

/// `dump PID` shows the running fiber's own stack: its thread's frames down to its entry,
/// with its Lua frames when it runs C code that Lua called (here `os.execute`, blocked in
/// `wait4`: the stuck fiber a user looks for), and says why there are none while LuaJIT's
/// interpreter runs. Before, the running fiber had no frames at all, only a note pointing at
/// its thread's stack, which had no Lua frames.
#[test]
fn dump_pid_shows_the_running_fibers_stack_with_its_lua_frames() {
    let dir = scratch("dump-running");
    std::fs::write(
        dir.join("blocked.lua"),
        "local fiber = require('fiber')\n\
         local function blocker() io.stdout:write('ready\\n') io.stdout:flush() os.execute('sleep 30') end\n\
         local function outer() blocker() end\n\
         fiber.create(function() fiber.sleep(100) end)\n\
         outer()\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("spins.lua"),
        "jit.off()\n\
         local function spin() io.stdout:write('ready\\n') io.stdout:flush() local x = 0 while true do x = x + 1 end end\n\
         spin()\n",
    )
    .unwrap();
    // A coroutine that spins inside the fiber, started by a function that called nothing
    // since: the coroutine's recorded base is the one it started with.
    std::fs::write(
        dir.join("in_co.lua"),
        "jit.off()\n\
         local function inner() local x = 0 while true do x = x + 1 end end\n\
         local co = coroutine.wrap(function() inner() end)\n\
         local function outer() io.stdout:write('ready\\n') io.stdout:flush() co() end\n\
         outer()\n",
    )
    .unwrap();
    for script in ["blocked.lua", "spins.lua", "in_co.lua"] {
        let mut child = fibertrace_acceptance::start_until(&dir, &["run", script], "ready\n");
        // Into the system call, or the loop.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let pid = child.id().to_string();
        let out = run_in(&std::env::temp_dir(), &["dump", &pid]);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let main = &fiber_blocks(&text)["main"];
        if script == "blocked.lua" {
            assert!(main.starts_with("#0  0x"), "{main}");
            assert_eq!(
                lua_frames(main),
                [
                    "execute in =[C]:-1",
                    "blocker in @blocked.lua:2",
                    "outer in @blocked.lua:3",
                    "main chunk in @blocked.lua:5",
                ],
                "{main}"
            );
            // The C function Lua called (the host's `os.execute`, which lets a SIGQUIT dump
            // through), right above its level.
            let lines: Vec<&str> = main.lines().collect();
            let at = lines
                .iter()
                .position(|l| l.ends_with(" execute in =[C]:-1"))
                .unwrap_or_else(|| panic!("{main}"));
            assert!(
                lines[at - 1].contains(" fibertrace_lua::host::execute::"),
                "{main}"
            );
            assert!(!text.contains("(it runs Lua code"), "{text}");
            // The thread's own stack crosses from the fiber's stack to the scheduler's at
            // corosensei's trampoline, straight into `switch_and_link`: its CFA (an expression
            // framehop does not evaluate) is stepped by the walk; the frame-pointer fallback
            // read the entry function's address as a frame, `?? (fibertrace+0x…)`.
            let thread = text
                .split("\n\n")
                .find(|b| b.starts_with("thread ") && b.contains("stack_init_trampoline"))
                .unwrap_or_else(|| panic!("{text}"));
            let lines: Vec<&str> = thread.lines().filter(|l| l.starts_with('#')).collect();
            let at = lines
                .iter()
                .position(|l| l.contains(" in stack_init_trampoline+"))
                .unwrap_or_else(|| panic!("{thread}"));
            assert!(
                lines[at + 1].contains(" in corosensei::arch::x86_64::switch_and_link")
                    || lines[at + 1].contains(" in corosensei::arch::aarch64::switch_and_link"),
                "{thread}"
            );
            assert!(!thread.contains("??"), "{thread}");
        } else if script == "spins.lua" {
            // In the interpreter: its levels from the interpreter's frame base and PC
            // registers (the loop is on line 2), nothing but Lua frames (no VM, no glue:
            // as the process's own dump).
            assert_eq!(
                lua_frames(main),
                ["spin in @spins.lua:2", "main chunk in @spins.lua:3"],
                "{main}"
            );
            assert!(!text.contains("(it runs Lua code"), "{text}");
        } else {
            assert_eq!(
                lua_frames(main),
                [
                    "inner in @in_co.lua:2",
                    "function <in_co.lua:3> in @in_co.lua:3",
                    "co in =[C]:-1",
                    "outer in @in_co.lua:4",
                    "main chunk in @in_co.lua:5",
                ],
                "{main}"
            );
            assert!(!text.contains("(it runs Lua code"), "{text}");
        }
    }
}

/// `dump PID` of a fiber that spins in compiled Lua code (a trace): its Lua levels are the
/// trace's snapshot's nearest before the thread's PC (the line it runs, a function it
/// inlined as a level), as the process's own SIGQUIT dump finds them at its next safe point
/// — from the held process and from its core file (the thread's registers); without
/// stopping it (`--non-blocking`, no registers), from the frame base the trace was entered
/// with, the innermost at the trace's start (the loop's line), which a note says.
#[test]
fn dump_pid_of_a_fiber_in_compiled_lua_code_shows_the_lines_the_trace_runs() {
    let dir = scratch("dump-trace");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/s.lua"), SPIN).unwrap();
    let mut child = fibertrace_acceptance::start_until(&dir, &["run", "app/s.lua"], "spinning\n");
    // Compiled by now (a loop is compiled after 56 rounds).
    std::thread::sleep(std::time::Duration::from_millis(300));
    let pid = child.id().to_string();
    // (No note: the levels are the ones the trace's exit would restore.)
    let held = "";
    let mut outs: Vec<(String, &str)> = (0..3)
        .map(|_| {
            let out = run_in(&std::env::temp_dir(), &["dump", &pid]);
            (stdout_of(&out), held)
        })
        .collect();
    // Not stopped (--non-blocking): read from memory alone, the trace's base and the frames
    // below it held still while they were read.
    for _ in 0..2 {
        let out = run_in(&std::env::temp_dir(), &["dump", &pid, "--non-blocking"]);
        outs.push((
            stdout_of(&out),
            "it runs compiled Lua code (a trace), read while it runs: its innermost Lua level",
        ));
    }
    // Its core file too: the thread's registers are the core's.
    let core = gcore(&dir, &pid);
    let _ = child.kill();
    let _ = child.wait();
    outs.push((dump_core(&core), held));
    for (text, note) in outs {
        let blocks = fiber_blocks(&text);
        let hog = &blocks["hog"];
        let frames = lua_frames(hog);
        let in_work = [3, 4, 5, 6, 7].map(|l| {
            vec![
                format!("work in @app/s.lua:{l}"),
                "function <app/s.lua:9> in @app/s.lua:12".to_string(),
            ]
        });
        let in_hog =
            [11, 12, 13].map(|l| vec![format!("function <app/s.lua:9> in @app/s.lua:{l}")]);
        assert!(
            in_work.contains(&frames) || in_hog.contains(&frames),
            "{hog}"
        );
        assert!(text.contains(note), "{text}");
        if note == held {
            assert!(
                !text.contains("innermost Lua level is the function the trace runs in"),
                "{text}"
            );
        }
        // The walk of its thread stops in the trace's code, which the trace's note says:
        // not said twice (the walk's own "walk stopped: ..." before it).
        assert!(!hog.contains("walk stopped"), "{hog}");
        // Nothing but its Lua levels: the trace's own frame is its innermost level's (a
        // `?? ` frame of the trace's code came first).
        assert_eq!(
            hog.lines().filter(|l| l.starts_with('#')).count(),
            frames.len(),
            "{hog}"
        );
        if note == held {
            // Its thread's walk goes on below the trace, from where LuaJIT's VM was entered,
            // down to the program's start: it stopped in the trace's code ("moved
            // backwards"), or went on from the frame pointer the trace used for something
            // else, into a made-up caller.
            let thread = text
                .split("\n\n")
                .find(|b| b.starts_with("thread ") && b.contains(" in ??"))
                .unwrap_or_else(|| panic!("{text}"));
            let lines: Vec<&str> = thread.lines().filter(|l| l.starts_with('#')).collect();
            let trace = lines
                .iter()
                .position(|l| l.ends_with(" in ??"))
                .unwrap_or_else(|| panic!("{thread}"));
            assert!(lines[trace + 1].contains(" in lua_pcall+"), "{thread}");
            assert_eq!(
                lines.iter().filter(|l| l.ends_with(" in ??")).count(),
                1,
                "{thread}"
            );
            assert!(lines.iter().any(|l| l.contains(" in main+")), "{thread}");
            assert!(lines[lines.len() - 1].contains(" in _start+"), "{thread}");
            assert!(
                thread.contains(
                    "compiled Lua code (a trace) has no unwind record: the frames below it \
                     are walked from where LuaJIT's VM was entered"
                ),
                "{thread}"
            );
            assert!(!thread.contains("walk stopped"), "{thread}");
        }
        assert_eq!(
            lua_frames(&blocks["main"]),
            ["join in =[C]:-1", "main chunk in @app/s.lua:18"],
            "{text}"
        );
    }
}

/// SIGQUIT while a fiber waits in `os.execute` dumps the fibers, the waiting one with its
/// thread's frames, and the command and the script go on: the C library's `system()`
/// ignores SIGQUIT in the caller until the command ends, and the dump was lost. The
/// scheduler's thread is in the command: the Lua frames of every fiber (the waiting one's
/// and a sleeping one's) are read from memory, that thread held still.
#[test]
fn sigquit_while_a_fiber_waits_in_os_execute_dumps_it_and_the_command_goes_on() {
    let dir = scratch("execute-quit");
    std::fs::write(
        dir.join("x.lua"),
        "local fiber = require('fiber')\n\
         local function park() fiber.sleep(100) end\n\
         local w = fiber.create(function() park() end)\n\
         w:name('worker')\n\
         local function wait()\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         local r = os.execute('sleep 2')\n\
         return r\n\
         end\n\
         local r = wait()\n\
         w:cancel()\n\
         io.stderr:write('returned ', tostring(r), '\\n')\n",
    )
    .unwrap();
    let mut cmd = fibertrace_acceptance::command_in(&dir, &["run", "x.lua"]);
    cmd.stderr(std::process::Stdio::piped());
    let child = fibertrace_acceptance::spawn_until(cmd, "ready\n");
    // Into the command.
    std::thread::sleep(std::time::Duration::from_millis(500));
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{err}");
    let block = |head: &str| {
        err.split("\n\n")
            .find(|b| b.contains(head))
            .unwrap_or_else(|| panic!("no {head}: {err}"))
            .to_string()
    };
    let main = block("fiber 1 \"main\" [running]:");
    // Its thread's frames, down from the wait for the command, through the host's
    // `os.execute`, then the Lua levels that called it (where the interpreter's frame was).
    let names: Vec<&str> = main
        .lines()
        .filter(|l| l.contains(" 0x"))
        .filter_map(|l| l.split(" in ").nth(1))
        .filter_map(|l| l.split('+').next())
        .collect();
    let body = names
        .iter()
        .position(|n| *n == "fibertrace_lua::host::execute::execute_body")
        .unwrap_or_else(|| panic!("{main}"));
    assert!(
        names[..body].contains(&"fibertrace_lua::host::execute::spawn_and_wait"),
        "{main}"
    );
    assert_eq!(body + 1, names.len(), "no native frame below: {main}");
    assert_eq!(
        lua_frames(&main),
        [
            "execute in =[C]:-1",
            "wait in @x.lua:7",
            "main chunk in @x.lua:10"
        ],
        "{main}"
    );
    assert_eq!(
        lua_frames(&block("fiber 2 \"worker\" [sleep")),
        [
            "sleep in =[C]:-1",
            "park in @x.lua:2",
            "function <x.lua:3> in @x.lua:3"
        ],
        "{err}"
    );
    assert!(
        err.contains(
            "(the scheduler's thread did not come back to its run loop within 200 ms, nor its \
             running fiber to a safe point: the layer's (Lua) frames were read from memory, the \
             thread held still)"
        ),
        "{err}"
    );
    // The command ran to its end: the script had its status.
    assert!(err.ends_with("returned 0\n"), "{err}");
}

/// SIGQUIT, then SIGTERM right after (a common way to stop a process once its stacks are
/// captured): the dump asked first is written whole before the program ends with 143.
/// Before, the exit signal ended the program at once and the dump was lost, without a word
/// (within ~50 ms of the SIGQUIT with two fibers, ~1 s with 30,000).
#[test]
fn sigquit_then_sigterm_at_once_writes_the_dump_before_the_exit() {
    use std::process::Stdio;
    let dir = scratch("quit-term");
    std::fs::write(
        dir.join("s.lua"),
        "local fiber = require('fiber')\n\
         local function park() fiber.sleep(100) end\n\
         for i = 1, 2000 do fiber.create(park) end\n\
         io.stdout:write('spinning\\n') io.stdout:flush()\n\
         fiber.sleep(100)\n",
    )
    .unwrap();
    let mut cmd = fibertrace_acceptance::command_in(&dir, &["run", "s.lua"]);
    cmd.stderr(Stdio::piped());
    let child = fibertrace_acceptance::spawn_until(cmd, "spinning\n");
    // SAFETY: signals the child this test started.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGQUIT);
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    // Every fiber, each with its Lua frames: main and the 2,000 parked ones.
    let blocks: Vec<&str> = err
        .split("\n\n")
        .filter(|b| b.trim_start_matches('\n').starts_with("fiber "))
        .collect();
    assert_eq!(
        blocks.len(),
        2001,
        "{}",
        &err[err.len().saturating_sub(2000)..]
    );
    for b in &blocks[1..] {
        assert_eq!(
            lua_frames(b),
            ["sleep in =[C]:-1", "function <s.lua:2> in @s.lua:2"],
            "{b}"
        );
    }
    // Main in its sleep, or, when the exit signal's halt stopped it at its next Lua line
    // first (the signals come right after its `spinning`), running on line 5 just before.
    let main = lua_frames(blocks[0]);
    if blocks[0]
        .trim_start_matches('\n')
        .starts_with("fiber 1 \"main\" [running]")
    {
        assert_eq!(main, ["main chunk in @s.lua:5"], "{}", blocks[0]);
    } else {
        assert_eq!(
            main,
            ["sleep in =[C]:-1", "main chunk in @s.lua:5"],
            "{}",
            blocks[0]
        );
    }
}

/// A script whose output cannot be written (standard output on a full disk: `/dev/full`)
/// ends with 1 and says so on stderr, whether it ends at its end, through `os.exit(0)`, or
/// printed more than a buffer; Lua's `print` drops write errors, and the program used to end
/// with 0, its output lost without a word. A closed pipe still ends it quietly (SIGPIPE).
#[test]
fn output_that_cannot_be_written_is_said_and_the_exit_status_is_1() {
    let dir = scratch("dev-full");
    for (name, script) in [
        ("a.lua", "print(1)\n"),
        ("b.lua", "print(1) os.exit(0)\n"),
        ("c.lua", "for i = 1, 100000 do print(i) end\n"),
    ] {
        std::fs::write(dir.join(name), script).unwrap();
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = fibertrace_acceptance::command_in(&dir, &["run", name])
            .stdout(full)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert_eq!(
            err,
            "fibertrace: standard output: No space left on device (os error 28): what the \
             script printed is lost\n",
            "{name}"
        );
        // The same script, its output read: all of it, and 0.
        let out = fibertrace_acceptance::command_in(&dir, &["run", name])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{name}");
        assert!(out.stderr.is_empty(), "{name}");
    }
}
