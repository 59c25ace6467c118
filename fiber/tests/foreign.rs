//! Another process's fibers, read from the outside (`inspect::foreign`): a target with 1,000
//! fibers suspended in known functions is read in both modes; every fiber is found with its
//! name, status and wait, and a fiber's frames are exactly the ones the target's own dump
//! gives; the target runs on and its fibers finish their work after being read.

#[path = "common/tied.rs"]
mod tied;
use tied::Tied;

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fibertrace_core::remote::{DumpOptions, Mode};
use fibertrace_fiber::inspect::foreign::{self, ForeignDump, ForeignScheduler};

/// An example built beside the tests (`cargo test` builds the examples).
fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples")
        .join(name);
    assert!(p.exists(), "{} is not built", p.display());
    p
}

struct Target {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    /// The frame lines of `waiter-0` in the target's own dump.
    own_waiter: Vec<String>,
}

impl Target {
    fn start(n: usize) -> Target {
        let mut child = Command::new(example("foreign_target"))
            .arg(n.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .tied()
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut own = String::new();
        let mut in_dump = false;
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the target ended");
            match line.as_str() {
                "own-dump\n" => in_dump = true,
                "end-own-dump\n" => in_dump = false,
                "ready\n" => break,
                l if in_dump => own.push_str(l),
                _ => {}
            }
        }
        let block = own
            .split("\n\n")
            .find(|b| b.contains("\"waiter-0\" ["))
            .unwrap_or_else(|| panic!("{own}"))
            .to_string();
        Target {
            child,
            out,
            own_waiter: frame_lines(&block),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

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
        (self.child.wait().unwrap().code().unwrap_or(-1), last)
    }
}

/// A fiber block's own frame lines (up to its creators).
fn frame_lines(block: &str) -> Vec<String> {
    block
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("created by "))
        .map(str::to_string)
        .collect()
}

/// The scheduler that holds the target's fibers.
fn scheduler(d: &ForeignDump) -> &ForeignScheduler {
    d.schedulers
        .iter()
        .max_by_key(|s| s.fibers.len())
        .unwrap_or_else(|| panic!("no scheduler: {:?}", d.note))
}

fn check(d: &ForeignDump, t: &Target, n: usize) {
    assert_eq!(d.note, None, "{}", d.to_text());
    let s = scheduler(d);
    // The main fiber and the n others.
    assert_eq!(s.fibers.len(), n + 1, "{}", d.to_text());
    assert!(s.thread.is_some());
    let waiters: Vec<_> = s
        .fibers
        .iter()
        .filter(|f| f.name.starts_with("waiter-"))
        .collect();
    let nappers: Vec<_> = s.fibers.iter().filter(|f| f.name == "napper").collect();
    assert_eq!((waiters.len(), nappers.len()), (n / 2, n / 2));
    assert!(waiters
        .iter()
        .all(|f| f.waiting.as_deref() == Some("channel receive")));
    assert!(nappers
        .iter()
        .all(|f| f.waiting.as_deref() == Some("sleep")));
    // How long each waiting fiber has waited: measured in a live process (and only for a
    // fiber that waits, as in-process: a ready or running one has no such time); a core
    // file records no clock, so none there (read against this clock, they grew with every
    // reading).
    if d.process.core.is_none() {
        assert!(
            s.fibers.iter().all(|f| match &f.waiting {
                Some(_) => f.status_seconds.is_some_and(|x| (0.0..60.0).contains(&x)),
                None => f.status_seconds.is_none(),
            }),
            "{}",
            d.to_text()
        );
    } else {
        assert!(
            s.fibers.iter().all(|f| f.status_seconds.is_none()),
            "{}",
            d.to_text()
        );
    }
    // Their creator: the main fiber.
    let main = s.fibers.iter().find(|f| f.name == "main").unwrap();
    assert!(waiters.iter().all(|f| f.parent == Some(main.id)));
    // A fiber's frames: exactly the target's own dump's.
    let text = d.to_text();
    let block = text
        .split("\n\n")
        .find(|b| b.contains("\"waiter-0\" ["))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(frame_lines(block), t.own_waiter, "{block}");
    assert!(
        t.own_waiter
            .iter()
            .any(|l| l.contains(" in foreign_target::wait_inner+")),
        "{:?}",
        t.own_waiter
    );
}

#[test]
fn a_thousand_fibers_of_a_stopped_process_are_read_with_their_frames_and_it_runs_on() {
    let n = 1000;
    let mut t = Target::start(n);
    let before = t.count();
    let d = foreign::dump(t.pid(), &DumpOptions::default()).unwrap();
    check(&d, &t, n);
    assert_eq!(d.process.mode, Mode::Consistent);
    let text = d.to_text();
    assert!(
        text.contains(&format!(
            "\nscheduler 1 \"main\": {} fibers (thread {})",
            n + 1,
            t.pid()
        )),
        "{}",
        &text[..text.len().min(4000)]
    );
    // Grouped: the waiters in one group, with the frames the text gives each of them.
    let grouped = d.to_grouped_text();
    let headers: Vec<&str> = grouped
        .lines()
        .filter(|l| l.contains(" fibers [") || l.contains(" fiber ["))
        .collect();
    let group = grouped
        .split("\n\n")
        .find(|b| b.starts_with(&format!("{} fibers [channel receive, ", n / 2)))
        .unwrap_or_else(|| panic!("{headers:#?}"));
    assert!(
        group.lines().next().unwrap().ends_with(&format!(
            "names \"waiter-0\" ×1, \"waiter-10\" ×1, \"waiter-100\" ×1, ... ({} more names):",
            n / 2 - 3
        )),
        "{group}"
    );
    assert!(
        grouped.contains(&format!(
            "\nscheduler 1 \"main\": {} fibers in 3 groups\n",
            n + 1
        )),
        "{headers:#?}"
    );
    assert_eq!(frame_lines(group), t.own_waiter, "{group}");
    // The exports' snapshot: the threads first (as a scheduler of their own), then every
    // fiber, its frames named as read from the target (never by this process's symbols).
    let snap = d.snapshot(true);
    assert_eq!(snap.schedulers[0].name, "threads");
    assert_eq!(snap.schedulers[0].fibers.len(), d.process.threads.len());
    assert_eq!(snap.schedulers[1].fibers.len(), n + 1);
    // Another process's CPU times are not read: said so, not shown as 0 seconds measured.
    assert!(snap.schedulers[1]
        .fibers
        .iter()
        .all(|f| !f.cpu_time_counted && f.cpu_time == 0.0));
    let folded = fibertrace_fiber::inspect::export::folded(&snap);
    assert!(
        folded
            .lines()
            .any(|l| l.starts_with("main;fiber:waiter-100;")
                && l.contains(";foreign_target::wait_outer;foreign_target::wait_inner;")),
        "{}",
        &folded[..folded.len().min(4000)]
    );
    // The threads are threads (`thread:NAME`, or its id), not fibers.
    let threads: Vec<&str> = folded
        .lines()
        .filter(|l| l.starts_with("threads;"))
        .collect();
    let counted: usize = threads
        .iter()
        .map(|l| l.rsplit(' ').next().unwrap().parse::<usize>().unwrap())
        .sum();
    assert_eq!(counted, d.process.threads.len(), "{folded}");
    for t in &d.process.threads {
        let label = if t.name.is_empty() {
            t.tid.to_string()
        } else {
            t.name.clone()
        };
        assert!(
            threads
                .iter()
                .any(|l| l.starts_with(&format!("threads;thread:{label};"))),
            "{label}: {threads:?}"
        );
    }
    // It counts on, then every fiber finishes its work.
    let after = t.count();
    let later = t.count();
    assert!(later > after && after >= before);
    let (code, last) = t.finish();
    assert_eq!((code, last.as_str()), (0, format!("done {n}\n").as_str()));
}

#[test]
fn fibers_are_read_without_stopping_the_process_too() {
    let n = 200;
    let t = Target::start(n);
    let opts = DumpOptions {
        mode: Mode::NonBlocking,
        ..DumpOptions::default()
    };
    let d = foreign::dump(t.pid(), &opts).unwrap();
    check(&d, &t, n);
    assert_eq!(d.process.paused_us, None);
    let (code, _) = t.finish();
    assert_eq!(code, 0);
}

#[test]
fn a_process_without_the_runtime_has_its_threads_and_a_note() {
    let mut c = Command::new("sleep").arg("10").tied().spawn().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let d = foreign::dump(c.id() as i32, &DumpOptions::default()).unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    assert!(d.schedulers.is_empty());
    assert_eq!(
        d.note.as_deref(),
        Some(
            "no fiber registry: the process does not use the fibertrace runtime (or was built \
             without it)"
        )
    );
    assert_eq!(d.process.threads.len(), 1);
    assert!(d.to_text().contains("(fibers: no fiber registry: "));
}

/// `gcore` (Debian's `gdb`) writes a core of a live process without stopping it for long.
fn gcore(pid: i32, dir: &std::path::Path) -> std::path::PathBuf {
    let out = Command::new("gcore")
        .arg("-o")
        .arg(dir.join("core"))
        .arg(pid.to_string())
        .output()
        .unwrap_or_else(|e| panic!("gcore cannot run ({e}): apt-get install gdb"));
    assert!(
        out.status.success(),
        "gcore failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = dir.join(format!("core.{pid}"));
    assert!(p.exists(), "{} was not written", p.display());
    p
}

#[test]
fn a_core_file_has_every_fiber_with_the_same_frames() {
    let n = 400;
    let mut t = Target::start(n);
    let dir = Scratch::new("foreign-core");
    let core = gcore(t.pid(), &dir);
    // The process ran on meanwhile.
    let a = t.count();
    assert!(t.count() > a);
    let d = foreign::dump_core(&core, None, None, &DumpOptions::default()).unwrap();
    assert_eq!(d.process.core.as_deref(), Some(core.to_str().unwrap()));
    assert_eq!(d.process.pid, t.pid());
    check(&d, &t, n);
    assert!(
        d.to_text()
            .lines()
            .next()
            .unwrap()
            .ends_with(&format!("from the core file {}", core.display())),
        "{}",
        d.to_text()
    );
    let (code, _) = t.finish();
    assert_eq!(code, 0);
    // What is not a core file says so.
    let e = foreign::dump_core(
        &example("foreign_target"),
        None,
        None,
        &DumpOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().ends_with(": not a core file"), "{e}");
    let missing = dir.join("no-such-core");
    let e = foreign::dump_core(&missing, None, None, &DumpOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: No such file or directory (os error 2)",
            missing.display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dump_core` of `core`, in a thread: `None` if it has not returned within `secs` (a hang;
/// the thread is left behind and the test fails). The dump's fiber count, or its error.
fn dump_core_within(core: &std::path::Path, secs: u64) -> Option<Result<usize, String>> {
    let core = core.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = foreign::dump_core(&core, None, None, &DumpOptions::default());
        let n = |d: ForeignDump| d.schedulers.iter().map(|s| s.fibers.len()).sum();
        let _ = tx.send(r.map(n).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

/// A damaged core file gives a dump or an error, never an abort or a hang: every loadable
/// segment's size made huge (an allocation of exabytes aborted the process), each loadable
/// segment in turn moved to another place in the file (one made the registry's length
/// garbage, and its slots were scanned one by one for ever), and single bytes of the headers
/// and notes changed (seeded).
#[test]
fn a_damaged_core_file_gives_a_dump_or_an_error_never_an_abort_or_a_hang() {
    let t = Target::start(50);
    let dir = Scratch::new("foreign-badcore");
    let core = gcore(t.pid(), &dir);
    let (code, _) = t.finish();
    assert_eq!(code, 0);
    let good = std::fs::read(&core).unwrap();
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let phoff = u64_at(&good, 0x20) as usize;
    let phnum = u16::from_le_bytes([good[0x38], good[0x39]]) as usize;
    let loads: Vec<usize> = (0..phnum)
        .map(|i| phoff + i * 56)
        .filter(|&p| u32::from_le_bytes(good[p..p + 4].try_into().unwrap()) == 1)
        .collect();
    assert!(loads.len() > 5, "{} loadable segments", loads.len());
    // The core is patched in place and put back after each try (it is large: copies of it
    // were most of the test's time).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&core)
        .unwrap();
    let try_patched = |patches: &[(usize, Vec<u8>)], what: &str| {
        use std::os::unix::fs::FileExt as _;
        for (at, bytes) in patches {
            f.write_all_at(bytes, *at as u64).unwrap();
        }
        let answered = dump_core_within(&core, 60).is_some();
        for (at, bytes) in patches {
            f.write_all_at(&good[*at..*at + bytes.len()], *at as u64)
                .unwrap();
        }
        assert!(answered, "{what}: no answer in 60 s");
    };
    let huge: Vec<(usize, Vec<u8>)> = loads
        .iter()
        .map(|&p| (p + 40, 0x5600_0000_0000_0000u64.to_le_bytes().to_vec()))
        .collect();
    try_patched(&huge, "every p_memsz huge");
    for (k, &p) in loads.iter().enumerate() {
        try_patched(
            &[(p + 8, 1u64.to_le_bytes().to_vec())],
            &format!("segment {k} at offset 1"),
        );
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..16 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % 65536) as usize % good.len();
        try_patched(
            &[(at, vec![(x >> 32) as u8])],
            &format!("byte {at} changed (round {round})"),
        );
    }
    // The last dump, of the core as it was, has the target's fibers.
    assert!(matches!(dump_core_within(&core, 60), Some(Ok(n)) if n >= 50));
    // Cut short inside its notes (its threads' registers): said to be truncated.
    let note = (0..phnum)
        .map(|i| phoff + i * 56)
        .find(|&p| u32::from_le_bytes(good[p..p + 4].try_into().unwrap()) == 4)
        .expect("a PT_NOTE segment");
    f.set_len(u64_at(&good, note + 8) + 16).unwrap();
    match dump_core_within(&core, 60) {
        Some(Err(e)) => assert!(
            e.contains("no NT_PRSTATUS note); the file is truncated: its segments reach byte "),
            "{e}"
        ),
        r => panic!("a truncated core: {r:?}"),
    }
    // A directory, a device: said so (mapping them failed with "No such device").
    let e = foreign::dump_core(&dir, None, None, &DumpOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), format!("{}: is a directory", dir.display()));
    let null = std::path::Path::new("/dev/null");
    let e = foreign::dump_core(null, None, None, &DumpOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "/dev/null: not a regular file (a core file is one)"
    );
    // A FIFO too (it was opened, which waits for a writer: the dump hung), and an empty file.
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    match dump_core_within(&fifo, 60) {
        Some(Err(e)) => assert_eq!(
            e,
            format!(
                "{}: not a regular file (a core file is one)",
                fifo.display()
            )
        ),
        r => panic!("a FIFO: {r:?}"),
    }
    let empty = dir.join("empty");
    std::fs::write(&empty, "").unwrap();
    let e = foreign::dump_core(&empty, None, None, &DumpOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: an empty file, not a core file", empty.display())
    );
    let _ = std::fs::remove_dir_all(&dir);
}
