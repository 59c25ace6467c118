//! The `fibertrace` binary end to end, as a user runs it: from another directory, on a
//! script named by a relative path.

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
    use std::io::{BufRead, Read};
    use std::process::{Command, Stdio};
    let mut child = Command::new(fibertrace_acceptance::binary())
        .args(["run", "app/s.lua"])
        .current_dir(dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "spinning\n");
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
    // Read inside it, at the next line its compiled loop reached: in `work`'s loop, or in
    // `hog`'s between two calls.
    let frames = lua_frames(hog);
    let in_work = [4, 5, 6, 7].map(|l| {
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

    // Turned off: native frames and a note that says so.
    let err = sigquit_dump(&dir, &[("FIBERTRACE_LUA_SAFE_POINTS", "0")]);
    assert!(
        err.contains(
            "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread \
             did not come back to its run loop within 200 ms, and its running fiber cannot be \
             stopped at a safe point: turned off (FIBERTRACE_LUA_SAFE_POINTS=0))"
        ),
        "{err}"
    );
}

/// A `fibertrace run` process that sleeps until killed, as a target for `fibertrace dump`.
fn sleeping_lua_process(dir: &std::path::Path) -> std::process::Child {
    use std::io::BufRead;
    std::fs::write(
        dir.join("sleep.lua"),
        "io.stdout:write('ready\\n') io.stdout:flush()\nrequire('fiber').sleep(60)\n",
    )
    .unwrap();
    let mut child = std::process::Command::new(fibertrace_acceptance::binary())
        .args(["run", "sleep.lua"])
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    child
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
        text.contains("\nscheduler 1 \"lua\": 1 fibers (thread "),
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
    assert!(
        fiber.ends_with(
            "    (its Lua frames are not read from another process yet: native frames only)"
        ),
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
    let gcore = std::process::Command::new("gcore")
        .arg("-o")
        .arg(dir.join("core"))
        .arg(&pid)
        .output()
        .unwrap_or_else(|e| panic!("gcore cannot run ({e}): apt-get install gdb"));
    assert!(
        gcore.status.success(),
        "{}",
        String::from_utf8_lossy(&gcore.stderr)
    );
    let core = dir.join(format!("core.{pid}"));
    let out = run_in(
        &std::env::temp_dir(),
        &["dump", "--core", core.to_str().unwrap()],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines()
            .next()
            .unwrap_or("")
            .ends_with(&format!("from the core file {}", core.display())),
        "{text}"
    );
    assert!(text.contains("\nfiber 1 \"main\" [sleep, "), "{text}");
    assert!(text.contains(" in fibertrace::main"), "{text}");
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
