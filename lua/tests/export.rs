//! Exports from Lua (`require('fibertrace').dump{...}`) and from `fibertrace run
//! --dump-on-exit FORMAT:FILE`: every exit path writes the dump, Lua frames in place, and
//! every bad argument is a clear error.

#[path = "../../fiber/tests/common/tied.rs"]
mod tied;
use tied::Tied;

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::{Command, Output};

/// A scratch directory for one test, removed when it passes (see `tests/scratch.rs`).
fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("lexp-{name}"))
}

fn run(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Three workers wait in `wait_here` (line 3) on a channel nobody writes; then the script
/// ends as its first argument says.
const WORKERS: &str = r#"local fiber = require('fiber')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for i = 1, 3 do fiber.create(function() wait_here() end):name('worker') end
fiber.yield()
if arg[1] == 'exit' then os.exit(3) end
if arg[1] == 'error' then error('boom') end
if arg[1] == 'deadlock' then ch:get() end
if arg[1] == 'sleep' then io.stdout:write('sleeping\n') io.stdout:flush() fiber.sleep(30) end
"#;

/// The folded line of the workers: `lua;fiber:worker;...;fibertrace_fiber::sched::block 3`
/// with the Lua frames in order between the native ones.
fn check_workers_line(folded: &str) {
    let line = folded
        .lines()
        .find(|l| l.starts_with("lua;fiber:worker;"))
        .unwrap_or_else(|| panic!("no workers' line in\n{folded}"));
    let (stack, count) = line.rsplit_once(' ').unwrap();
    assert_eq!(count, "3", "{folded}");
    let frames: Vec<&str> = stack.split(';').collect();
    assert_eq!(
        frames.last(),
        Some(&"fibertrace_fiber::sched::block"),
        "{line}"
    );
    let lua: Vec<&str> = frames
        .iter()
        .copied()
        .filter(|f| f.ends_with("(s.lua)") || f.ends_with("([C])"))
        .collect();
    assert_eq!(
        lua,
        [
            "function <s.lua:4> (s.lua)",
            "wait_here (s.lua)",
            "get ([C])"
        ],
        "{line}"
    );
}

#[test]
fn every_way_a_program_ends_writes_its_dump_on_exit() {
    let d = dir("exit");
    std::fs::write(d.join("s.lua"), WORKERS).unwrap();
    for (how, code) in [("end", 0), ("exit", 3), ("error", 1), ("deadlock", 1)] {
        let out = run(
            &d,
            &[
                "--dump-on-exit",
                &format!("folded:{how}.folded"),
                "--dump-on-exit",
                &format!("pprof:{how}.pb.gz"),
                "s.lua",
                how,
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(code),
            "{how}: {}",
            text(&out.stderr)
        );
        let folded = std::fs::read_to_string(d.join(format!("{how}.folded")))
            .unwrap_or_else(|e| panic!("{how}: {e}: {}", text(&out.stderr)));
        check_workers_line(&folded);
        let gz = std::fs::read(d.join(format!("{how}.pb.gz"))).unwrap();
        assert_eq!(&gz[..2], &[0x1f, 0x8b], "{how}");
        match how {
            // The fiber that called os.exit, with its Lua frames: the chunk (the program's
            // wrapper around os.exit and its dump call left out).
            "exit" => assert!(
                folded.contains("lua;fiber:main;main chunk (s.lua) 1\n"),
                "{folded}"
            ),
            // The main fiber, in the deadlock too.
            "deadlock" => assert!(
                folded.contains("lua;fiber:main;main chunk (s.lua);get ([C]);"),
                "{folded}"
            ),
            // The main fiber where its uncaught error was raised (it ended before the
            // dumps): `error` called from the chunk.
            // (Lua 5.4 shows `error`'s own C function below its level.)
            "error" => assert!(
                folded.contains("lua;fiber:main;main chunk (s.lua);error ([C]) 1\n")
                    || folded
                        .contains("lua;fiber:main;main chunk (s.lua);error ([C]);luaB_error 1\n"),
                "{folded}"
            ),
            _ => assert!(!folded.contains("fiber:main"), "{how}: {folded}"),
        }
    }
    // SIGTERM: the dump is written before the exit with 143.
    let mut child = start_and_wait(
        &d,
        &["--dump-on-exit", "folded:term.folded", "s.lua", "sleep"],
        "sleeping\n",
    );
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(143));
    let folded = std::fs::read_to_string(d.join("term.folded")).unwrap();
    check_workers_line(&folded);
    // Main in its sleep, or, when the signal's halt stopped it at its next Lua line first
    // (the signal comes right after its `sleeping`), running just before it.
    assert!(
        folded.contains("lua;fiber:main;main chunk (s.lua);sleep ([C]);")
            || folded.contains("lua;fiber:main;main chunk (s.lua) 1\n"),
        "{folded}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_bad_dump_on_exit_is_refused_before_the_script_runs() {
    let d = dir("bad");
    std::fs::write(d.join("s.lua"), "print('ran')").unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    for (arg, msg) in [
        ("pprof", "expected FORMAT:FILE, e.g. pprof:fibers.pb.gz"),
        ("xml:a", "unknown dump format \"xml\": one of text, grouped, json, pprof, folded, svg, speedscope"),
        ("pprof:", "the file name is empty"),
        ("pprof:no/such/x", "no/such: no such directory"),
        ("pprof:sub", "sub: is a directory"),
        ("pprof:..", "..: not a file name"),
    ] {
        let out = run(&d, &["--dump-on-exit", arg, "s.lua"]);
        assert_eq!(out.status.code(), Some(2), "{arg}");
        assert!(out.stdout.is_empty(), "{arg}: the script ran");
        let err = text(&out.stderr);
        assert!(
            err.starts_with(&format!(
                "error: invalid value '{arg}' for '--dump-on-exit <FORMAT:FILE>': {msg}\n"
            )),
            "{arg}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// What the write at exit would meet is found before the script runs (it was found after
/// it: a long run's dump lost at its end): a name too long, a link to nothing, a loop of
/// links, a directory that cannot be written, an immutable file. A name just short of the
/// limit is written (its temporary file's name, longer, could not be made), and so is a
/// read-only file (replaced, as before).
#[test]
fn a_dump_on_exit_that_could_not_be_written_is_refused_before_the_script_runs() {
    let d = dir("unwritable");
    std::fs::write(d.join("s.lua"), "print('ran')").unwrap();
    std::os::unix::fs::symlink("nowhere/x", d.join("dangling")).unwrap();
    std::os::unix::fs::symlink("loop", d.join("loop")).unwrap();
    let long = "n".repeat(300);
    let mut cases = vec![
        (
            format!("pprof:{long}"),
            // (A name that long is cut in messages.)
            format!(
                "{}... (300 bytes): cannot write: File name too long (os error 36)",
                &long[..256]
            ),
        ),
        (
            "json:dangling".to_string(),
            "dangling: cannot write: a symbolic link to nothing".to_string(),
        ),
        (
            "json:loop".to_string(),
            "loop: cannot write: Too many levels of symbolic links (os error 40)".to_string(),
        ),
        // (Not writable even by root; read-only where /sys is mounted so.)
        (
            "json:/sys/x.json".to_string(),
            "/sys/x.json: cannot write: ".to_string(),
        ),
    ];
    // An immutable file (where `chattr` may set it: root on a file system that has it).
    std::fs::write(d.join("frozen"), "kept").unwrap();
    let frozen = Command::new("chattr")
        .args(["+i"])
        .arg(d.join("frozen"))
        .output()
        .is_ok_and(|o| o.status.success());
    if frozen {
        cases.push((
            "text:frozen".to_string(),
            "frozen: cannot write: the file cannot be replaced (it is immutable)".to_string(),
        ));
    } else {
        eprintln!("chattr +i is refused here: the immutable file is not tried");
    }
    for (arg, msg) in &cases {
        let out = run(
            &d,
            &[
                "--dump-on-exit",
                "text:fine",
                "--dump-on-exit",
                arg,
                "s.lua",
            ],
        );
        assert_eq!(out.status.code(), Some(2), "{arg}");
        assert!(out.stdout.is_empty(), "{arg}: the script ran");
        let err = text(&out.stderr);
        assert!(
            err.starts_with(&format!("error: --dump-on-exit: {msg}"))
                && err.ends_with("\n\nFor more information, try '--help'.\n"),
            "{arg}: {err}"
        );
    }
    if frozen {
        let _ = Command::new("chattr")
            .args(["-i"])
            .arg(d.join("frozen"))
            .status();
        assert_eq!(std::fs::read_to_string(d.join("frozen")).unwrap(), "kept");
    }
    // Nothing was left behind by the checks: only the files made here.
    let mut names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["dangling", "frozen", "loop", "s.lua"]);
    // 250 bytes (with `.NAME.PID.tmp`, past 255) and a read-only file: written.
    let name = "m".repeat(250);
    std::fs::write(
        d.join("s.lua"),
        "local fiber = require('fiber')\n\
         fiber.create(function() fiber.sleep(100) end):name('sleeper')\n\
         print('ran')\n\
         os.exit(0)\n",
    )
    .unwrap();
    std::fs::write(d.join("ro"), "old").unwrap();
    let mut perm = std::fs::metadata(d.join("ro")).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o444);
    std::fs::set_permissions(d.join("ro"), perm).unwrap();
    let out = run(
        &d,
        &[
            "--dump-on-exit",
            &format!("folded:{name}"),
            "--dump-on-exit",
            "json:ro",
            "s.lua",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "ran\n");
    let folded = std::fs::read_to_string(d.join(&name)).unwrap();
    assert!(
        folded.lines().any(|l| l
            .starts_with("lua;fiber:sleeper;function <s.lua:2> (s.lua);sleep ([C]);")
            && l.ends_with(";fibertrace_fiber::sched::sleep 1")),
        "{folded}"
    );
    let json = std::fs::read_to_string(d.join("ro")).unwrap();
    assert!(json.starts_with('{'), "{json}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Starts `fibertrace run ARGS` in `cwd` and waits for the script's first line on its
/// standard output, `first` (it prints it when set up, just before its main fiber sleeps).
fn start_and_wait(cwd: &Path, args: &[&str], first: &str) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .args(args)
        .current_dir(cwd)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line, first);
    // Give the main fiber the time to go to sleep (a loaded machine may not have run it
    // further yet).
    std::thread::sleep(std::time::Duration::from_millis(300));
    child
}

/// 3,000 fibers waiting on a channel; "ready" once made.
const MANY: &str = r#"local fiber = require('fiber')
local ch = fiber.channel()
for i = 1, 3000 do fiber.create(function() ch:get() end) end
io.stdout:write('ready\n') io.stdout:flush()
fiber.sleep(60)
"#;

/// SIGTERM gives the `--dump-on-exit` dumps the time they take, up to
/// `--dump-on-exit-wait` (the process used to end a second after the signal whatever the
/// dumps were doing: a dump of 3,000 fibers, ~2 s in a debug build, was lost without a
/// word, its half-written temporary file left behind); past the wait it ends with 143,
/// says so, and removes the temporary files.
#[test]
fn dumps_on_exit_after_sigterm_are_written_or_said_to_be_given_up() {
    let d = dir("sigterm");
    std::fs::write(d.join("many.lua"), MANY).unwrap();
    let mut child = start_and_wait(
        &d,
        &[
            "--dump-on-exit",
            "json:all.json",
            "--dump-on-exit",
            "text:all.txt",
            "many.lua",
        ],
        "ready\n",
    );
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(143));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("all.json")).unwrap()).unwrap();
    let fibers: usize = json["schedulers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["fibers"].as_array().unwrap().len())
        .sum();
    assert_eq!(fibers, 3001, "every fiber and the main one");
    let txt = std::fs::read_to_string(d.join("all.txt")).unwrap();
    assert_eq!(
        txt.matches("\nfiber ").count() + usize::from(txt.starts_with("fiber ")),
        3001
    );
    let leftovers: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A dump that cannot end (a FIFO whose reader never reads: the write blocks once the
    // pipe is full) is given up after --dump-on-exit-wait, and what another dump had
    // half-written (its temporary file, made here in its place) is removed.
    let fifo = d.join("stuck");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // The reader: opened here (without waiting for a writer), never read.
    let _reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let child = start_and_wait(
        &d,
        &[
            "--dump-on-exit-wait",
            "2",
            "--dump-on-exit",
            "text:stuck",
            "--dump-on-exit",
            "json:later.json",
            "many.lua",
        ],
        "ready\n",
    );
    let tmp = d.join(format!(".later.json.{}.tmp", child.id()));
    std::fs::write(&tmp, "half a dump").unwrap();
    let t0 = std::time::Instant::now();
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let took = t0.elapsed();
    assert_eq!(out.status.code(), Some(143));
    assert!(
        took >= std::time::Duration::from_secs(2) && took < std::time::Duration::from_secs(10),
        "{took:?}"
    );
    assert_eq!(
        text(&out.stderr),
        "fibertrace: --dump-on-exit: not written within 2 s of the signal \
         (--dump-on-exit-wait): text:stuck, json:later.json; the program ends without them\n"
    );
    assert!(!tmp.exists(), "the temporary file is removed");
    assert!(!d.join("later.json").exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// An exit signal that comes while another exit path writes the `--dump-on-exit` dumps —
/// the script's end, or `os.exit` on a fiber — waits for them, and the program then ends
/// with 128 + the signal. Before, the signal's thread found the dumps taken and ended the
/// process a second later, in the middle of them (the script's end: no file at all), or
/// wrote them a second time beside `os.exit`'s, into the same temporary files. Here the
/// first dump goes to a FIFO that the test drains only after the signal and 1.5 s.
#[test]
fn an_exit_signal_waits_for_the_dumps_another_exit_path_writes() {
    use std::io::Read as _;
    use std::os::fd::AsRawFd as _;
    let d = dir("signal-meets-exit");
    for (how, fibers) in [("end", 3000), ("exit", 3001)] {
        let script = format!(
            "local fiber = require('fiber')\n\
             for i = 1, 3000 do fiber.create(function() fiber.sleep(60) end) end\n\
             io.stdout:write('ready\\n') io.stdout:flush()\n{}",
            if how == "exit" { "os.exit(0)\n" } else { "" }
        );
        std::fs::write(d.join("s.lua"), script).unwrap();
        let fifo = d.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let _ = std::fs::remove_file(d.join("after.json"));
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let mut reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
            .args(["run", "--dump-on-exit", "text:fifo"])
            .args(["--dump-on-exit", "json:after.json", "s.lua"])
            .current_dir(&d)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .tied()
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "ready\n");
        // The dumps have begun once the FIFO has something to read.
        let mut p = libc::pollfd {
            fd: reader.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd of ours.
        let ready = unsafe { libc::poll(&mut p, 1, 60_000) };
        assert_eq!(ready, 1, "{how}: no dump began");
        // SAFETY: signals our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        std::thread::sleep(std::time::Duration::from_millis(1500));
        assert!(
            child.try_wait().unwrap().is_none(),
            "{how}: the process ended in the middle of its dumps"
        );
        // Drained to its end (blocking reads: the end is when the dump closes the FIFO).
        // SAFETY: fcntl on our own descriptor.
        unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_SETFL, 0) };
        let mut dumped = String::new();
        reader.read_to_string(&mut dumped).unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(143), "{how}: {}", text(&out.stderr));
        assert_eq!(text(&out.stderr), "", "{how}");
        assert_eq!(
            dumped.matches("\nfiber ").count() + usize::from(dumped.starts_with("fiber ")),
            fibers,
            "{how}: the FIFO's dump, written once"
        );
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("after.json")).unwrap()).unwrap();
        let n: usize = json["schedulers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["fibers"].as_array().unwrap().len())
            .sum();
        assert_eq!(n, fibers, "{how}: the second dump");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `os.exit` writes the `--dump-on-exit` dumps whatever the script did to the globals its
/// wrapper uses (it used to look them up at the exit: `ipairs = nil` made `os.exit` raise
/// instead of exiting), and a dump that raises in it (out of memory; here its upvalue is
/// replaced) neither leaves the dumps claimed forever (the exit used to wait for them
/// without end) nor keeps `os.exit` from exiting: the dumps are written from Rust, without
/// the exiting fiber's Lua frames, and stderr says why.
#[test]
fn os_exit_dumps_survive_changed_globals_and_a_dump_that_raises() {
    let d = dir("exit-wrapper");
    let cases = [
        (
            "globals",
            "ipairs, pcall, select, tonumber, tostring = nil, nil, nil, nil, nil\nos.exit(5)\n",
            5,
            "",
        ),
        (
            "raises",
            "local function replace(f, depth)\n\
             \x20 for i = 1, 20 do\n\
             \x20   local name, v = debug.getupvalue(f, i)\n\
             \x20   if name == 'dump' then debug.setupvalue(f, i, function() error('no dump') end) end\n\
             \x20   if type(v) == 'function' and depth < 2 then replace(v, depth + 1) end\n\
             \x20 end\n\
             end\n\
             replace(os.exit, 0)\n\
             os.exit(0)\n",
            0,
            "fibertrace: --dump-on-exit: written without the Lua frames of the fiber that \
             exits: s.lua:13: no dump\n",
        ),
    ];
    for (case, tail, code, err_head) in cases {
        std::fs::write(d.join("s.lua"), format!("{WORKERS}{tail}")).unwrap();
        let _ = std::fs::remove_file(d.join("d.folded"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
            .args(["run", "--dump-on-exit", "folded:d.folded", "s.lua"])
            .current_dir(&d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .tied()
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t0.elapsed() > std::time::Duration::from_secs(30) {
                let _ = child.kill();
                panic!("{case}: the program did not end");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{case}: {err}");
        assert!(err.starts_with(err_head), "{case}: {err}");
        let folded = std::fs::read_to_string(d.join("d.folded"))
            .unwrap_or_else(|e| panic!("{case}: {e}: {err}"));
        check_workers_line(&folded);
    }
}

/// Two `--dump-on-exit` options naming one file (the second dump would replace the first
/// without a word) are refused before the script runs; different files in one directory
/// are not.
#[test]
fn two_dumps_on_exit_into_one_file_are_refused() {
    let d = dir("twice");
    std::fs::write(d.join("s.lua"), "print('ran')").unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/existing"), "").unwrap();
    std::os::unix::fs::symlink("sub/existing", d.join("link")).unwrap();
    // Links to files not made yet (the first dump would make it), one to another.
    std::os::unix::fs::symlink("later", d.join("sub/dangling")).unwrap();
    std::os::unix::fs::symlink("sub/dangling", d.join("chain")).unwrap();
    for (a, b) in [
        ("json:a", "text:a"),
        ("json:a", "text:./a"),
        ("json:sub/x", "folded:sub/../sub/x"),
        ("json:link", "text:sub/existing"),
        ("text:sub/later", "json:sub/dangling"),
        ("json:chain", "svg:sub/later"),
    ] {
        let out = run(&d, &["--dump-on-exit", a, "--dump-on-exit", b, "s.lua"]);
        assert_eq!(out.status.code(), Some(2), "{a} {b}");
        assert!(out.stdout.is_empty(), "{a} {b}: the script ran");
        let (fa, fb) = (
            &a[a.find(':').unwrap() + 1..],
            &b[b.find(':').unwrap() + 1..],
        );
        assert_eq!(
            text(&out.stderr),
            format!(
                "error: --dump-on-exit: {fa} and {fb} are the same file (the second dump \
                 would replace the first)\n\nFor more information, try '--help'.\n"
            ),
            "{a} {b}"
        );
    }
    let out = run(
        &d,
        &[
            "--dump-on-exit",
            "json:a",
            "--dump-on-exit",
            "text:b",
            "s.lua",
        ],
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(d.join("a").exists() && d.join("b").exists());
    for bad in ["0", "3601", "-1", "x", ""] {
        let out = run(&d, &["--dump-on-exit-wait", bad, "s.lua"]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        assert!(
            text(&out.stderr).starts_with(&format!(
                "error: invalid value '{bad}' for '--dump-on-exit-wait <SECONDS>'"
            )),
            "{bad}: {}",
            text(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A dump that cannot be written at exit (`/dev/full`: no space) is an error on stderr, and
/// a program that would have exited with 0 exits with 1 — at its end and through
/// `os.exit()`, `os.exit(0)` or `os.exit(true)` — while a failing one keeps its code; the
/// other dumps are still written.
#[test]
fn a_dump_on_exit_that_cannot_be_written_is_a_failure() {
    let d = dir("full");
    for (end, code) in [
        ("", 0),
        ("os.exit()", 1),
        ("os.exit(0)", 1),
        ("os.exit(true)", 1),
        ("os.exit('0')", 1),
        ("os.exit(3)", 3),
        ("os.exit(false)", 1),
        ("error('boom')", 1),
    ] {
        let _ = std::fs::remove_file(d.join("ok.folded"));
        std::fs::write(d.join("s.lua"), format!("print('ran')\n{end}\n")).unwrap();
        let out = run(
            &d,
            &[
                "--dump-on-exit",
                "text:/dev/full",
                "--dump-on-exit",
                "folded:ok.folded",
                "s.lua",
            ],
        );
        let err = text(&out.stderr);
        // The script's own success, not the dump's failure, would have been 0.
        let want = if code == 0 { 1 } else { code };
        assert_eq!(out.status.code(), Some(want), "{end:?}: {err}");
        assert_eq!(text(&out.stdout), "ran\n", "{end:?}");
        assert!(
            err.contains("fibertrace: --dump-on-exit text: /dev/full: cannot write: No space left on device (os error 28)\n"),
            "{end:?}: {err}"
        );
        // Written (at the script's end no fiber is left: empty; `os.exit` writes it on the
        // main fiber, which is in it).
        let folded = std::fs::read_to_string(d.join("ok.folded")).unwrap();
        if end.starts_with("os.exit") {
            assert!(folded.contains("lua;fiber:main;"), "{end:?}: {folded}");
        }
    }
    // Every dump written: the script's code, 0 included.
    std::fs::write(d.join("s.lua"), "print('ran')\n").unwrap();
    let out = run(&d, &["--dump-on-exit", "folded:ok.folded", "s.lua"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&d);
}

/// A dump on exit into the program's own standard output or error, when that is a file
/// (`> out.log`), lands where the program is in that file, and what comes after it (the
/// `--leaks` report, the shell's next line) after it: opened again by name, it got a file
/// offset of its own and what came after wrote over it (the leaks report replaced the dump
/// whole).
#[test]
fn a_dump_on_exit_into_the_programs_own_output_file_is_not_written_over() {
    let d = dir("own-output");
    std::fs::write(d.join("s.lua"), "print('script output')\n").unwrap();
    let exe = env!("CARGO_BIN_EXE_fibertrace");
    let out = Command::new("sh")
        .current_dir(&d)
        .arg("-c")
        .arg(format!(
            "{{ echo before; '{exe}' run --dump-on-exit text:/dev/stdout s.lua; echo after; }} \
             > out.log; '{exe}' run --leaks --dump-on-exit text:/dev/stderr s.lua 2> err.log"
        ))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(d.join("out.log")).unwrap(),
        "before\nscript output\nscheduler 1 \"lua\": 0 fibers\n\nafter\n"
    );
    let err = std::fs::read_to_string(d.join("err.log")).unwrap();
    assert!(
        err.starts_with("scheduler 1 \"lua\": 0 fibers\n\n") && err.contains("heap: "),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `fibertrace.dump` from Lua: the text of every fiber, the caller's own Lua frames too.
const FROM_LUA: &str = r#"local fiber = require('fiber')
local ft = require('fibertrace')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for i = 1, 2 do fiber.create(function() wait_here() end):name('worker') end
fiber.yield()
local function report()
    local t = ft.dump()
    return t
end
io.write(report())
io.write('--\n')
for _, a in ipairs({
    {1}, {{format = 1}}, {{format = 'xml'}}, {{file = true}}, {{file = ''}}, {{}, 2},
    {{format = 'folded', file = 'no/such/dir/x'}}, {'grouped'}, {{fromat = 'json'}},
    {{[1] = 'json'}}, {string.rep('N', 1000000)},
}) do
    local ok, r, e = pcall(ft.dump, (unpack or table.unpack)(a))
    print(ok, ok and type(r) == 'string' and #r > 200 and 'a dump' or r, e)
end
print(ft.dump{format = 'json', file = 'd.json'} == #io.open('d.json'):read('*a'))
"#;

#[test]
fn a_dump_from_lua_shows_every_fiber_with_its_lua_frames_and_refuses_bad_arguments() {
    let d = dir("lua");
    std::fs::write(d.join("s.lua"), FROM_LUA).unwrap();
    let out = run(&d, &["s.lua"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let all = text(&out.stdout);
    let (dump, rest) = all.split_once("--\n").unwrap();
    let lua_lines = |block: &str| -> Vec<String> {
        block
            .lines()
            .filter(|l| l.contains(" in @") || l.contains(" in =["))
            .map(|l| l.split_once("  ").map_or(l, |x| x.1).to_string())
            .collect()
    };
    let main = dump
        .split("\n\n")
        .find(|b| b.starts_with("fiber 1 \"main\" [running]:"))
        .unwrap_or_else(|| panic!("{dump}"));
    assert_eq!(
        lua_lines(main),
        [
            "dump in =[C]:-1",
            "report in @s.lua:8",
            "main chunk in @s.lua:11"
        ],
        "{main}"
    );
    let workers: Vec<&str> = dump
        .split("\n\n")
        .filter(|b| b.starts_with("fiber ") && b.contains(" \"worker\" [channel receive, "))
        .collect();
    assert_eq!(workers.len(), 2, "{dump}");
    for w in workers {
        assert_eq!(
            lua_lines(w),
            [
                "get in =[C]:-1",
                "wait_here in @s.lua:4",
                "function <s.lua:5> in @s.lua:5"
            ],
            "{w}"
        );
    }
    let usage = "fibertrace.dump([{format = 'text'|'grouped'|'json'|'pprof'|'folded'|'svg'|'speedscope', file = PATH}])";
    // (A misspelt option, or a format given in a list, was ignored: the default used.)
    let expected = [
        format!(
            "false\t{usage}: the argument is a table of options or a format name, not a \
             number\tnil"
        ),
        format!("false\t{usage}: format must be a string\tnil"),
        format!("false\t{usage}: unknown dump format \"xml\": one of text, grouped, json, pprof, folded, svg, speedscope\tnil"),
        format!("false\t{usage}: file must be a string\tnil"),
        format!("false\t{usage}: file is empty\tnil"),
        format!("false\t{usage}: one argument at most\tnil"),
        "true\tnil\tno/such/dir/x: cannot write: No such file or directory (os error 2)".to_string(),
        "true\ta dump\tnil".to_string(),
        format!("false\t{usage}: option \"fromat\" is not one it takes (format, file)\tnil"),
        format!("false\t{usage}: a number key is not one it takes (format, file)\tnil"),
        // (A huge argument is cut in its message.)
        format!(
            "false\t{usage}: unknown dump format \"{}\"... (1000000 bytes): one of text, \
             grouped, json, pprof, folded, svg, speedscope\tnil",
            "N".repeat(64)
        ),
        "true".to_string(),
    ];
    assert_eq!(rest.lines().collect::<Vec<_>>(), expected, "{rest}");
    let _ = std::fs::remove_dir_all(&d);
}
