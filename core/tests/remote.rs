//! Another process's threads, read from the outside (`fibertrace_core::remote`): exact frames
//! of a target whose threads wait in known functions, in both modes; the target runs on and
//! finishes its work after being read; every way a dump cannot be made is a clear error.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fibertrace_core::remote::{self, DumpError, DumpOptions, Mode, ProcessDump, ThreadDump};

/// The example `remote_target`, built by `cargo test` beside the tests.
fn target_exe() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> -> target/<profile>/examples/remote_target
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples/remote_target");
    assert!(p.exists(), "{} is not built", p.display());
    p
}

struct Target {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Target {
    fn start() -> Target {
        Target::start_exe(&target_exe())
    }

    /// A copy of the example at `exe`.
    fn start_exe(exe: &std::path::Path) -> Target {
        let mut child = Command::new(exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let t0 = Instant::now();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the target ended");
            if line == "ready\n" {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20));
        }
        Target { child, out }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The counter's latest value (reads the lines printed so far, waits for one more).
    fn count(&mut self) -> u64 {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "the target ended"
            );
            if let Ok(n) = line.trim().parse() {
                return n;
            }
        }
    }

    /// Tells it to finish; its exit status and last line.
    fn finish(mut self) -> (i32, String) {
        self.child
            .stdin
            .take()
            .unwrap()
            .write_all(b"quit\n")
            .unwrap();
        let mut last = String::new();
        let mut line = String::new();
        while self.out.read_line(&mut line).unwrap() > 0 {
            last = std::mem::take(&mut line);
        }
        let status = self.child.wait().unwrap();
        (status.code().unwrap_or(-1), last)
    }
}

/// The thread named `name`.
fn thread<'a>(d: &'a ProcessDump, name: &str) -> &'a ThreadDump {
    d.threads
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no thread {name}:\n{}", d.to_text()))
}

/// A thread's frames as `function at file:line` for the target's own functions (every
/// level, inlined ones too), innermost first.
fn own_frames(t: &ThreadDump) -> Vec<String> {
    t.frames
        .iter()
        .filter_map(|f| f.resolved.as_ref())
        .flat_map(|r| r.symbols.iter())
        .filter_map(|s| {
            let name = s.name.as_deref()?;
            name.starts_with("remote_target::").then(|| {
                let file = s.file.as_deref().unwrap_or("?");
                let file = file.rsplit('/').next().unwrap_or(file);
                format!("{name} at {file}:{}", s.line.unwrap_or(0))
            })
        })
        .collect()
}

/// The line of the example's source that ends with `// <mark>`.
fn line_of(mark: &str) -> u32 {
    let src = include_str!("../examples/remote_target.rs");
    let n = src
        .lines()
        .position(|l| l.trim_end().ends_with(&format!("// {mark}")))
        .unwrap_or_else(|| panic!("no line marked {mark}"));
    n as u32 + 1
}

/// The parked thread's own frames, as the example's source places them.
fn parked_frames() -> [String; 3] {
    [
        format!(
            "remote_target::parked_inner at remote_target.rs:{}",
            line_of("parked_inner waits here")
        ),
        format!(
            "remote_target::parked_outer at remote_target.rs:{}",
            line_of("parked_outer calls here")
        ),
        format!(
            "remote_target::main::{{{{closure}}}} at remote_target.rs:{}",
            line_of("the parked thread's closure calls here")
        ),
    ]
}

#[test]
fn every_thread_of_a_stopped_process_has_exact_frames_and_it_runs_on() {
    let mut t = Target::start();
    let before = t.count();
    let t0 = Instant::now();
    let d = remote::dump(t.pid(), &DumpOptions::default()).unwrap();
    let took = t0.elapsed();
    assert_eq!(d.mode, Mode::Consistent);
    assert!(d
        .paused_us
        .is_some_and(|us| us < took.as_micros() as u64 + 1));
    assert_eq!(d.threads.len(), 4, "{}", d.to_text());
    assert!(d.threads.iter().all(|t| t.exact));
    let parked = thread(&d, "parked");
    assert_eq!(own_frames(parked), parked_frames(), "{}", d.to_text());
    let reader = thread(&d, "reader");
    assert_eq!(
        own_frames(reader).first().map(String::as_str),
        Some(
            format!(
                "remote_target::read_line at remote_target.rs:{}",
                line_of("read_line waits here")
            )
            .as_str()
        ),
        "{}",
        d.to_text()
    );
    // Its innermost frame is the system call's, in the C library.
    let top = reader.frames[0].resolved.as_ref().unwrap();
    assert!(
        top.image.as_ref().is_some_and(|i| i.path.contains("libc")),
        "{}",
        d.to_text()
    );
    // The text names the process and every thread.
    let text = d.to_text();
    assert!(
        text.starts_with(&format!("process {} \"remote_target\" (", t.pid())),
        "{text}"
    );
    assert!(text.contains("): 4 threads, stopped "), "{text}");
    assert!(
        text.contains("thread ") && text.contains(" \"parked\":\n#0  0x"),
        "{text}"
    );
    // The target goes on counting, then finishes its work.
    let after = t.count();
    let later = t.count();
    assert!(later > after && after >= before, "{before} {after} {later}");
    let (code, last) = t.finish();
    assert_eq!(code, 0);
    assert!(last.starts_with("done "), "{last}");
}

/// A target whose DWARF cannot be read (its `.debug_info` compressed in a way no reader
/// knows): its frames are named from the symbol table, without file:line, and the dump says
/// why they have none.
#[test]
fn frames_whose_debug_information_cannot_be_read_are_named_and_the_dump_says_why() {
    use object::{Object, ObjectSection};
    let dir = Scratch::new("remote-no-lines");
    let exe = dir.join("remote_target");
    std::fs::copy(target_exe(), &exe).unwrap();
    let st = Command::new("objcopy")
        .arg("--compress-debug-sections=zlib")
        .arg(&exe)
        .status()
        .expect("objcopy (binutils) runs");
    assert!(st.success());
    let mut bytes = std::fs::read(&exe).unwrap();
    let at = {
        let obj = object::File::parse(&*bytes).unwrap();
        let sec = obj.section_by_name(".debug_info").expect("a .debug_info");
        let format = sec.compressed_file_range().unwrap().format;
        assert_eq!(format, object::CompressionFormat::Zlib);
        sec.file_range().unwrap().0 as usize
    };
    // The section's compression header: its type first (1 is zlib).
    assert_eq!(bytes[at..at + 4], 1u32.to_le_bytes());
    bytes[at..at + 4].copy_from_slice(&0x7fu32.to_le_bytes());
    std::fs::write(&exe, &bytes).unwrap();
    let t = Target::start_exe(&exe);
    let d = remote::dump(t.pid(), &DumpOptions::default()).unwrap();
    let text = d.to_text();
    let parked = thread(&d, "parked");
    assert_eq!(
        own_frames(parked),
        [
            "remote_target::parked_inner at ?:0",
            "remote_target::parked_outer at ?:0",
            "remote_target::main::{{closure}} at ?:0",
        ],
        "{text}"
    );
    let path = exe.to_str().unwrap();
    assert_eq!(d.without_lines.len(), 1, "{text}");
    let why = d.without_lines[0]
        .strip_prefix(&format!("{path}: "))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(why, "Unsupported ELF compression type", "{text}");
    assert!(
        text.ends_with(&format!("(frames without file:line in {path}: {why})\n")),
        "{text}"
    );
    assert!(d.unnamed.is_empty(), "{text}");
    // It reads back from JSON.
    let back: ProcessDump = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
    assert_eq!(back.without_lines, d.without_lines);
    assert_eq!(t.finish().0, 0);
}

#[test]
fn a_process_read_without_stopping_it_has_its_waiting_threads_marked_not_exact() {
    let t = Target::start();
    let opts = DumpOptions {
        mode: Mode::NonBlocking,
        ..DumpOptions::default()
    };
    let d = remote::dump(t.pid(), &opts).unwrap();
    assert_eq!(d.mode, Mode::NonBlocking);
    assert_eq!(d.paused_us, None);
    assert!(d.threads.iter().all(|t| !t.exact));
    // The parked thread waits in the kernel: read from where it waits.
    let parked = thread(&d, "parked");
    let own = own_frames(parked);
    assert_eq!(
        own.first().map(String::as_str),
        Some(
            format!(
                "remote_target::parked_inner at remote_target.rs:{}",
                line_of("parked_inner waits here")
            )
            .as_str()
        ),
        "{}",
        d.to_text()
    );
    assert!(
        parked
            .note
            .as_deref()
            .is_some_and(|n| n.contains("read without stopping it")),
        "{}",
        d.to_text()
    );
    assert!(d.to_text().contains("not stopped: frames not exact"));
    let (code, _) = t.finish();
    assert_eq!(code, 0);
}

#[test]
fn the_ways_a_dump_cannot_be_made_are_clear_errors() {
    // No such process: one that has exited and been waited for.
    let mut c = Command::new("true").spawn().unwrap();
    let gone = c.id() as i32;
    c.wait().unwrap();
    let e = remote::dump(gone, &DumpOptions::default()).unwrap_err();
    assert!(matches!(e, DumpError::NoSuchProcess(p) if p == gone), "{e}");
    assert_eq!(e.to_string(), format!("no such process: {gone}"));
    for bad in [0, -1, i32::MIN] {
        assert!(matches!(
            remote::dump(bad, &DumpOptions::default()),
            Err(DumpError::NoSuchProcess(_))
        ));
    }
    // This process itself.
    let e = remote::dump(std::process::id() as i32, &DumpOptions::default()).unwrap_err();
    assert!(matches!(e, DumpError::Myself), "{e}");
    // A thread id that is not a process's.
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() }).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let tid = rx.recv().unwrap();
    assert!(matches!(
        remote::dump(tid, &DumpOptions::default()),
        Err(DumpError::NoSuchProcess(_))
    ));
    h.join().unwrap();
    // A process that has exited but not been waited for (a zombie): it has no threads left
    // to read, and says so (it read "exited during the dump").
    let mut z = Command::new("true").spawn().unwrap();
    let zpid = z.id() as i32;
    std::thread::sleep(Duration::from_millis(200));
    let e = remote::dump(zpid, &DumpOptions::default()).unwrap_err();
    assert!(matches!(e, DumpError::Zombie(p) if p == zpid), "{e:?}: {e}");
    assert_eq!(
        e.to_string(),
        format!(
            "process {zpid} has exited (a zombie its parent has not waited for): nothing left to \
             read"
        )
    );
    z.wait().unwrap();
    // A kernel thread (kthreadd is process 2 wherever the kernel's threads are visible; in a
    // PID namespace that hides them, no process here is one).
    let kthread = (2..200).find(|p| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            let rest = &s[s.rfind(')').unwrap() + 1..];
            let flags: u64 = rest
                .split_ascii_whitespace()
                .nth(6)
                .unwrap()
                .parse()
                .unwrap();
            flags & 0x0020_0000 != 0
        })
    });
    match kthread {
        Some(k) => {
            let e = remote::dump(k, &DumpOptions::default()).unwrap_err();
            assert!(
                matches!(e, DumpError::KernelThread(p) if p == k),
                "{e:?}: {e}"
            );
            assert_eq!(
                e.to_string(),
                format!("process {k} is a kernel thread: it has no user-space stacks to read")
            );
        }
        None => eprintln!("no kernel thread visible in this PID namespace: not checked"),
    }
}

#[test]
fn a_core_file_of_the_process_has_the_same_exact_frames() {
    let t = Target::start();
    let dir = Scratch::new("remote-core");
    let out = Command::new("gcore")
        .arg("-o")
        .arg(dir.join("core"))
        .arg(t.pid().to_string())
        .output()
        .unwrap_or_else(|e| panic!("gcore cannot run ({e}): apt-get install gdb"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let core = dir.join(format!("core.{}", t.pid()));
    let d = remote::dump_core(&core, None, None, &DumpOptions::default()).unwrap();
    let (code, _) = t.finish();
    assert_eq!(code, 0);
    assert_eq!(d.threads.len(), 4, "{}", d.to_text());
    // A core keeps the process's name only: the parked thread is the one in parked_inner.
    let parked = d
        .threads
        .iter()
        .find(|t| {
            own_frames(t)
                .first()
                .is_some_and(|f| f.contains("parked_inner"))
        })
        .unwrap_or_else(|| panic!("{}", d.to_text()));
    assert_eq!(own_frames(parked), parked_frames(), "{}", d.to_text());
    assert!(d.threads.iter().all(|t| t.exact));
    assert_eq!(thread(&d, "remote_target").tid, d.pid);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process another tracer holds (a debugger, strace) cannot be stopped by a second one:
/// the error says who traces it, not that permission is missing (the same EPERM).
#[test]
fn a_process_already_traced_is_said_to_be() {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    // SAFETY: between fork and exec, only ptrace(2), an async-signal-safe system call.
    unsafe {
        cmd.pre_exec(|| {
            libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as i32;
    // (Traced, it stops at its exec; this process is its tracer.)
    std::thread::sleep(Duration::from_millis(100));
    let e = remote::dump(pid, &DumpOptions::default()).unwrap_err();
    // (The tracer is the thread that spawned it: /proc names it by its thread id.)
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    assert!(
        e.to_string().starts_with(&format!(
            "not allowed to read process {pid}: it is already traced by process {me} ("
        )),
        "{e}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A process that execs while it is being stopped is read (before or after its exec), or
/// said to be changing (never said to have exited, nor refused), and is never left hung: an exec waits for the threads it kills to be
/// reaped by their tracer, holding the lock that the next `PTRACE_SEIZE` waits for; both
/// processes used to hang there (the target in state D) until the reader was killed. Here
/// a process execs itself every ~25 ms with 200 threads, and is stopped 200 times (without
/// the reaper, the stop hung within a few dozen).
#[test]
fn a_process_that_execs_while_it_is_stopped_is_never_left_hung() {
    let exe = target_exe().with_file_name("exec_loop");
    assert!(exe.exists(), "{} is not built", exe.display());
    /// Killed when dropped (a failed round included).
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Killed(
        Command::new(&exe)
            .arg("1000000")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id() as i32;
    std::thread::sleep(Duration::from_millis(100));
    for round in 0..200 {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r =
                remote::Session::open(pid, &DumpOptions::default()).map(|mut s| s.threads().len());
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok(n)) => assert!(n >= 1, "round {round}"),
            // (A process that keeps exec'ing may be caught changing at every try: said so.)
            Ok(Err(e)) if e.ends_with("while it was read: try again") => {}
            Ok(Err(e)) => panic!("round {round}: {e}"),
            Err(_) => {
                let state =
                    std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                panic!("round {round}: the stop did not end in 20 s; the target: {state}");
            }
        }
    }
    drop(child);
}

/// A process killed while it is being stopped is said to have exited, never that reading it
/// is not allowed (its exiting threads refuse a seize with EPERM, which was taken for a
/// missing permission in a third of such runs).
#[test]
fn a_process_killed_while_it_is_stopped_is_said_to_have_exited() {
    let exe = target_exe().with_file_name("exec_loop");
    for round in 0..30u64 {
        let mut child = Command::new(&exe)
            .arg("0")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Its 200 threads started (they park; it then reads its input).
        let t0 = Instant::now();
        while std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count()) < 201 {
            assert!(t0.elapsed() < Duration::from_secs(20), "round {round}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let opener = std::thread::spawn(move || {
            remote::Session::open(pid, &DumpOptions::default()).map(|mut s| s.threads().len())
        });
        std::thread::sleep(Duration::from_micros(300 * (round % 10)));
        child.kill().unwrap();
        let r = opener.join().unwrap();
        child.wait().unwrap();
        match r {
            Ok(_) | Err(DumpError::Exited(_)) | Err(DumpError::NoSuchProcess(_)) => {}
            Err(DumpError::Zombie(_)) => {}
            Err(e) => panic!("round {round}: {e}"),
        }
    }
}
