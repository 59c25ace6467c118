//! The exports of a snapshot (pprof, folded, SVG, speedscope, JSON), each read back and
//! checked against the text dump of the same snapshot, frame by frame. (The real tools read
//! them in `tests/acceptance/peers.rs`.)

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::io::Read as _;
use std::time::Duration;

use fibertrace_fiber::export::{self, Format};
use fibertrace_fiber::inspect::{self, InfoOptions, Snapshot};
use fibertrace_fiber::{channel, dump, yield_now, Builder, Channel, Scheduler, SchedulerOptions};

#[inline(never)]
fn wait_three(ch: &Channel<u8>) -> u8 {
    let v = wait_two(ch);
    std::hint::black_box(v)
}

#[inline(never)]
fn wait_two(ch: &Channel<u8>) -> u8 {
    let v = ch.recv().unwrap_or(0);
    std::hint::black_box(v)
}

/// The function names of a fiber's frames in the text dump, innermost first, every inline
/// level a name of its own (`#3  0x... in NAME+0x.. at ...` and `    inlined NAME at ...`).
fn text_names(text: &str, id: u64) -> Vec<String> {
    let block = text
        .split("\n\n")
        .find(|b| b.starts_with(&format!("fiber {id} ")))
        .unwrap_or_else(|| panic!("fiber {id} in {text}"));
    let mut out = Vec::new();
    for l in block.lines().skip(1) {
        if l.starts_with("created by") {
            break;
        }
        let l = l.trim_start();
        let name = if let Some(rest) = l.strip_prefix('#') {
            let rest = rest.split_once(" in ").map(|x| x.1).unwrap_or(rest);
            rest.split(" at ").next().unwrap_or(rest)
        } else if let Some(rest) = l.strip_prefix("inlined ") {
            rest.split(" at ").next().unwrap_or(rest)
        } else {
            continue;
        };
        let name = match name.rfind("+0x") {
            Some(i) => &name[..i],
            None => name,
        };
        out.push(name.to_string());
    }
    out
}

// pprof's messages, declared here again from profile.proto (only the fields read), so the
// export is checked against the format, not against itself.
#[derive(Clone, PartialEq, prost::Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
}
#[derive(Clone, PartialEq, prost::Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    ty: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
    #[prost(int64, tag = "3")]
    num: i64,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    memory_start: u64,
    #[prost(uint64, tag = "3")]
    memory_limit: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    #[prost(int64, tag = "6")]
    build_id: i64,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
}
#[derive(Clone, PartialEq, prost::Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
}

fn decode_pprof(gz: &[u8]) -> Profile {
    assert_eq!(&gz[..2], &[0x1f, 0x8b], "gzip magic");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .expect("gzip");
    <Profile as prost::Message>::decode(raw.as_slice()).expect("profile.proto")
}

/// The fibers of this test's scheduler in a snapshot.
fn mine(snap: &Snapshot, id: u64) -> &inspect::SchedulerSnapshot {
    snap.schedulers
        .iter()
        .find(|s| s.fibers.iter().any(|f| f.id == id))
        .expect("this scheduler")
}

#[test]
fn every_export_holds_each_fibers_frames_as_the_text_dump_shows_them() {
    Scheduler::with_options(SchedulerOptions {
        name: "exp".into(),
        ..Default::default()
    })
    .block_on(|| {
        let ch = channel::<u8>(1);
        let mut workers = Vec::new();
        for _ in 0..5 {
            let rx = ch.clone();
            workers.push(Builder::new().name("worker").spawn(move || wait_three(&rx)));
        }
        let sleeper = Builder::new()
            .name("idle")
            .spawn(|| fibertrace_fiber::sleep(Duration::from_secs(60)));
        yield_now();
        let full = inspect::snapshot(&InfoOptions::default());
        // Only this scheduler (other tests of the binary may have their own).
        let snap = Snapshot {
            schedulers: vec![mine(&full, workers[0].id()).clone()],
            ..full.clone()
        };
        let text = dump::snapshot_text(&snap);
        let w0 = workers[0].id();
        let leaf_first = text_names(&text, w0);
        let i2 = leaf_first.iter().position(|n| n == "export::wait_two");
        let i3 = leaf_first.iter().position(|n| n == "export::wait_three");
        assert_eq!(i2.map(|i| i + 1), i3, "{text}");
        assert_eq!(leaf_first[0], "fibertrace_fiber::sched::block", "{text}");
        let root_first: Vec<String> = leaf_first.iter().rev().cloned().collect();

        // Folded: one line for the five workers, one for the sleeper, one for main;
        // sorted; the workers' frames are the text dump's, root first.
        let folded = String::from_utf8(export::to_bytes(&snap, Format::Folded)).unwrap();
        let lines: Vec<&str> = folded.lines().collect();
        assert_eq!(lines.len(), 3, "{folded}");
        let mut sorted = lines.clone();
        sorted.sort();
        assert_eq!(lines, sorted, "{folded}");
        let worker_line = format!("exp;fiber:worker;{} 5", root_first.join(";"));
        assert!(
            lines.contains(&worker_line.as_str()),
            "{worker_line}\n{folded}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("exp;fiber:idle;") && l.ends_with(" 1")),
            "{folded}"
        );

        // pprof: one sample per fiber, value 1, labelled; each worker's lines, leaf
        // first, are the text dump's names; locations shared; mappings with build ids.
        let p = decode_pprof(&export::to_bytes(&snap, Format::Pprof));
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(p.string_table[0], "");
        assert_eq!(
            p.sample_type
                .iter()
                .map(|v| (s(v.ty), s(v.unit)))
                .collect::<Vec<_>>(),
            [("fibers", "count")]
        );
        assert_eq!(p.sample.len(), 7);
        let label = |smp: &Sample, key: &str| {
            smp.label.iter().find(|l| s(l.key) == key).map(|l| {
                if l.str != 0 {
                    s(l.str).to_string()
                } else {
                    l.num.to_string()
                }
            })
        };
        let by_id = |id: u64| {
            p.sample
                .iter()
                .find(|smp| label(smp, "fiber_id") == Some(id.to_string()))
                .unwrap_or_else(|| panic!("fiber {id} in the profile"))
        };
        let names = |smp: &Sample| -> Vec<String> {
            smp.location_id
                .iter()
                .flat_map(|id| {
                    let loc = &p.location[*id as usize - 1];
                    assert_eq!(loc.id, *id);
                    loc.line.iter().map(|l| {
                        let f = &p.function[l.function_id as usize - 1];
                        assert_eq!(f.id, l.function_id);
                        s(f.name).to_string()
                    })
                })
                .collect()
        };
        for h in &workers {
            let smp = by_id(h.id());
            assert_eq!(smp.value, [1]);
            assert_eq!(names(smp), leaf_first, "fiber {}", h.id());
            assert_eq!(label(smp, "name").as_deref(), Some("worker"));
            assert_eq!(label(smp, "state").as_deref(), Some("channel receive"));
            assert_eq!(label(smp, "scheduler").as_deref(), Some("exp"));
            assert_eq!(
                label(smp, "parent"),
                Some(fibertrace_fiber::current_id().to_string())
            );
            assert!(label(smp, "waiting_ms").is_some());
            // The five workers share every location.
            assert_eq!(smp.location_id, by_id(w0).location_id);
        }
        let idle = by_id(sleeper.id());
        assert_eq!(label(idle, "state").as_deref(), Some("sleep"));
        let me = by_id(fibertrace_fiber::current_id());
        assert_eq!(label(me, "state").as_deref(), Some("running"));
        assert_eq!(label(me, "waiting_ms"), None);
        let exe = std::fs::canonicalize(std::env::current_exe().unwrap()).unwrap();
        let image = fibertrace_core::symbolize::images()
            .into_iter()
            .find(|i| std::path::Path::new(&i.path) == exe)
            .expect("this test's image");
        let m = p
            .mapping
            .iter()
            .find(|m| s(m.filename) == image.path)
            .unwrap_or_else(|| panic!("a mapping of {}", image.path));
        let hex: String = image
            .build_id
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(!hex.is_empty());
        assert_eq!(s(m.build_id), hex);
        assert_eq!((m.memory_start, m.memory_limit), (image.start, image.end));
        for smp in &p.sample {
            for id in &smp.location_id {
                let loc = &p.location[*id as usize - 1];
                assert!(loc.mapping_id >= 1 && loc.mapping_id as usize <= p.mapping.len());
                let m = &p.mapping[loc.mapping_id as usize - 1];
                assert!((m.memory_start..m.memory_limit).contains(&loc.address));
            }
        }

        // speedscope: the scheduler's profile, one sample per fiber, root first.
        let ss: serde_json::Value =
            serde_json::from_slice(&export::to_bytes(&snap, Format::Speedscope)).unwrap();
        assert_eq!(
            ss["$schema"],
            "https://www.speedscope.app/file-format-schema.json"
        );
        let prof = &ss["profiles"][0];
        assert_eq!(prof["type"], "sampled");
        assert_eq!(
            prof["name"],
            format!("scheduler {} \"exp\"", mine(&full, w0).id)
        );
        let fibers = &mine(&full, w0).fibers;
        let at = fibers.iter().position(|f| f.id == w0).unwrap();
        let frames = ss["shared"]["frames"].as_array().unwrap();
        let stack: Vec<&str> = prof["samples"][at]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                frames[i.as_u64().unwrap() as usize]["name"]
                    .as_str()
                    .unwrap()
            })
            .collect();
        assert_eq!(stack, root_first);
        assert_eq!(prof["weights"].as_array().unwrap().len(), 7);
        assert_eq!(prof["endValue"], 7);

        // SVG: a flame graph whose boxes name the frames with their fiber counts.
        let svg = String::from_utf8(export::to_bytes(&snap, Format::Svg)).unwrap();
        assert!(svg.starts_with("<?xml"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(
            svg.contains("<title>fiber:worker (5 fibers, 71.43%)</title>"),
            "{svg}"
        );
        assert!(svg.contains("<title>export::wait_two (5 fibers, 71.43%)</title>"));

        // JSON: the snapshot itself, read back.
        let back: Snapshot =
            serde_json::from_slice(&export::to_bytes(&snap, Format::Json)).unwrap();
        assert_eq!(back.version, inspect::SNAPSHOT_VERSION);
        assert_eq!(back.schedulers[0].fibers.len(), 7);

        // Text and grouped: the dumps.
        assert_eq!(export::to_bytes(&snap, Format::Text), text.as_bytes());
        assert_eq!(
            export::to_bytes(&snap, Format::Grouped),
            dump::snapshot_grouped(&snap).as_bytes()
        );

        ch.close();
        for h in workers {
            h.join().unwrap();
        }
        sleeper.fiber().cancel();
    })
    .unwrap();
}

#[test]
fn an_export_to_a_file_is_whole_or_leaves_what_was_there() {
    let dir = Scratch::new("export");
    let path = dir.join("fibers.txt");
    std::fs::write(&path, "before").unwrap();
    // A directory where the file should be: the rename fails, the old content stays, and no
    // temporary file is left behind.
    let blocked = dir.join("adir");
    std::fs::create_dir_all(blocked.join("inside")).unwrap();
    let e = export::export_to_file(Format::Text, &blocked).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}: cannot write: ", blocked.display())),
        "{e}"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // No such directory.
    let e = export::export_to_file(Format::Json, &dir.join("no/such/dir/x.json")).unwrap_err();
    assert!(e.to_string().contains("No such file or directory"), "{e}");
    // Not a file name.
    let e = export::write_file(std::path::Path::new("/"), b"x").unwrap_err();
    assert_eq!(e.to_string(), "/: not a file name");
    // A good write replaces the old content whole.
    let n = export::export_to_file(Format::Folded, &path).unwrap();
    let got = std::fs::read(&path).unwrap();
    assert_eq!(got.len(), n);
    assert_ne!(got, b"before");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What is not a regular file is written into, never replaced by a file (a device, a FIFO,
/// reached directly or through a link), and a link to a regular file stays a link, its target
/// written. Before, each was replaced by a regular file (as root, `/dev/full` itself) and a
/// full device's error was never seen. The devices are reached through links in a temporary
/// directory: a regression replaces the link, not the machine's device.
#[test]
fn an_export_writes_into_devices_fifos_and_links_instead_of_replacing_them() {
    use std::os::unix::fs::FileTypeExt;
    let dir = Scratch::new("export-special");
    let is_link = |p: &std::path::Path| {
        std::fs::symlink_metadata(p)
            .unwrap()
            .file_type()
            .is_symlink()
    };
    // A link to a regular file: the file gets the bytes, the link stays.
    std::fs::write(dir.join("target.txt"), "before").unwrap();
    std::os::unix::fs::symlink("target.txt", dir.join("link")).unwrap();
    export::write_file(&dir.join("link"), b"new").unwrap();
    assert!(is_link(&dir.join("link")));
    assert_eq!(std::fs::read(dir.join("target.txt")).unwrap(), b"new");
    // A full device: its error.
    std::os::unix::fs::symlink("/dev/full", dir.join("full")).unwrap();
    let e = export::write_file(&dir.join("full"), b"x").unwrap_err();
    assert!(e.to_string().contains("No space left on device"), "{e}");
    assert!(is_link(&dir.join("full")));
    // A device that takes anything.
    std::os::unix::fs::symlink("/dev/null", dir.join("null")).unwrap();
    export::write_file(&dir.join("null"), b"x").unwrap();
    assert!(is_link(&dir.join("null")));
    // A link to nothing, a directory.
    std::os::unix::fs::symlink("nowhere", dir.join("dangling")).unwrap();
    let e = export::write_file(&dir.join("dangling"), b"x").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: cannot write: a symbolic link to nothing",
            dir.join("dangling").display()
        )
    );
    let e = export::write_file(&dir, b"x").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: cannot write: is a directory", dir.display())
    );
    // A FIFO: without a reader an error at once (not a wait), with one the bytes reach it.
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = export::write_file(&fifo, b"x").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: cannot write: a FIFO with no reader", fifo.display())
    );
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    // (The reader opens the FIFO first: until then a write finds none.)
    let big = vec![b'z'; 1 << 20];
    let mut tries = 0;
    while let Err(e) = export::write_file(&fifo, &big) {
        assert!(e.to_string().ends_with("a FIFO with no reader"), "{e}");
        tries += 1;
        assert!(tries < 2000, "the reader never opened the FIFO");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(reader.join().unwrap(), big);
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    // A reader there that takes nothing: given up after 10 s, with an error (a program's
    // normal exit waited on it forever).
    let idle = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap()
    };
    let e = export::write_file(&fifo, &big).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: cannot write: the FIFO's reader took nothing for 10 s",
            fifo.display()
        )
    );
    drop(idle);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `check_writable` says beforehand what `write_file` would meet, and leaves nothing behind:
/// for every kind of target, the check refuses exactly what the write refuses, with the same
/// text. Names up to the file system's limit are written (their temporary file's name, which
/// is longer, is cut and told apart by a hash).
#[test]
fn a_check_beforehand_agrees_with_the_write() {
    let dir = std::env::temp_dir().join(format!("ft-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink("nowhere", dir.join("dangling")).unwrap();
    std::os::unix::fs::symlink("loop", dir.join("loop")).unwrap();
    std::os::unix::fs::symlink("/dev/null", dir.join("null")).unwrap();
    std::fs::write(dir.join("file"), "old").unwrap();
    std::fs::create_dir(dir.join("sub")).unwrap();
    let long = |c: &str, n: usize| dir.join(c.repeat(n));
    let targets = [
        dir.join("new"),
        dir.join("file"),
        dir.join("dangling"),
        dir.join("loop"),
        dir.join("null"),
        dir.join("sub"),
        dir.join("no/such/dir/x"),
        long("a", 243),
        long("b", 255),
        long("c", 256),
        std::path::PathBuf::from("/sys/x.json"),
        dir.join("new/"),
        dir.join("file/"),
        // (Kernel settings are refused before anything is written: run as root, this one
        // changed the machine's name.)
        std::path::PathBuf::from("/proc/sys/kernel/hostname"),
        std::path::PathBuf::from("/proc/self/root/proc/sys/kernel/hostname"),
    ];
    let listing = || {
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let first = listing();
    assert_eq!(first.len(), 5);
    for t in &targets {
        let check = export::check_writable(t).map_err(|e| e.to_string());
        assert_eq!(
            listing(),
            first,
            "{}: the check left something",
            t.display()
        );
        let write = export::write_file(t, b"new").map_err(|e| e.to_string());
        assert_eq!(check, write, "{}", t.display());
        if !first.contains(t) {
            let _ = std::fs::remove_file(t);
        }
    }
    // What is refused, and what is not.
    let refused = |p: &std::path::Path| export::check_writable(p).is_err();
    assert!(!refused(&dir.join("new")) && !refused(&long("b", 255)));
    assert!(refused(&dir.join("dangling")) && refused(&dir.join("loop")));
    assert!(refused(&long("c", 256)) && refused(&dir.join("sub")));
    assert!(
        refused(&dir.join("new/")) && refused(std::path::Path::new("/proc/sys/kernel/hostname"))
    );
    assert_eq!(
        export::write_file(std::path::Path::new("/proc/sys/kernel/hostname"), b"x")
            .unwrap_err()
            .to_string(),
        "/proc/sys/kernel/hostname: cannot write: a kernel setting (/proc/sys), not a file for a \
         dump"
    );
    // Two long names with one prefix: two temporary files, each a name the system takes.
    let (a, b) = (long("d", 250), dir.join(format!("{}e", "d".repeat(249))));
    let (ta, tb) = (
        export::temporary_file(&a).unwrap(),
        export::temporary_file(&b).unwrap(),
    );
    assert_ne!(ta, tb);
    for t in [&ta, &tb] {
        let n = t.file_name().unwrap().len();
        assert!(n <= 255, "{n}");
    }
    let short = export::temporary_file(&dir.join("x.json")).unwrap();
    assert_eq!(
        short.file_name().unwrap().to_str().unwrap(),
        format!(".x.json.{}.tmp", std::process::id())
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every key path of a JSON value (`a.b[].c`).
fn key_paths(v: &serde_json::Value, path: &str, out: &mut std::collections::BTreeSet<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                out.insert(p.clone());
                key_paths(x, &p, out);
            }
        }
        serde_json::Value::Array(a) => {
            for x in a {
                key_paths(x, &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_key_of_the_json_export_is_in_its_documented_schema() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/snapshot-schema.md"),
    )
    .unwrap();
    let snap = Scheduler::new()
        .block_on(|| {
            // A fiber of every wait kind, each with a parent trace.
            let ch = channel::<u8>(1);
            let cond = std::rc::Rc::new(fibertrace_fiber::Cond::new());
            let rx = ch.clone();
            let a = Builder::new().name("recv").spawn(move || wait_three(&rx));
            let c2 = cond.clone();
            let b = Builder::new().name("cond").spawn(move || {
                c2.wait();
            });
            let c = Builder::new()
                .name("sleep")
                .spawn(|| fibertrace_fiber::sleep(Duration::from_secs(60)));
            let cf = c.fiber().clone();
            let d = Builder::new().name("join").spawn(move || {
                let _ = c.join();
            });
            yield_now();
            let snap = inspect::snapshot(&InfoOptions::default());
            ch.close();
            cond.broadcast();
            a.join().unwrap();
            b.join().unwrap();
            cf.cancel();
            let _ = d.join();
            snap
        })
        .unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&export::to_bytes(&snap, Format::Json)).unwrap();
    let mut paths = std::collections::BTreeSet::new();
    key_paths(&v, "", &mut paths);
    let mut missing = Vec::new();
    for p in &paths {
        let rel = p
            .strip_prefix("schedulers[].fibers[].backtrace[].")
            .or_else(|| p.strip_prefix("schedulers[].fibers[].parent_backtrace[].frames[]."))
            .unwrap_or(p);
        if !doc.contains(&format!("`{rel}`")) {
            missing.push(p.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/snapshot-schema.md: {missing:?}"
    );
    // The snapshot had what the test meant it to have.
    for want in [
        "schedulers[].fibers[].waiting.on.channel_receive",
        "schedulers[].fibers[].waiting.on.condition",
        "schedulers[].fibers[].waiting.on.join",
        "schedulers[].fibers[].parent_backtrace[].frames[].resolved.symbols[].name",
        "schedulers[].fibers[].backtrace[].frame.ra",
    ] {
        assert!(paths.contains(want), "{want} not in {paths:?}");
    }
}

/// A fiber named with control characters (an escape sequence, `\x01`): the folded stacks
/// write them as the text view does (`\x1b`), and the flame graph is well-formed XML (no
/// control character but tab and line ends; the raw ESC made the SVG unreadable).
#[test]
fn control_characters_in_names_leave_the_folded_stacks_and_the_svg_well_formed() {
    Scheduler::with_options(SchedulerOptions {
        name: "ctl".into(),
        ..Default::default()
    })
    .block_on(|| {
        let ch = channel::<u8>(1);
        let rx = ch.clone();
        let w = Builder::new()
            .name("w\u{1b}[31m\u{1}")
            .spawn(move || wait_three(&rx));
        // Characters XML does not allow, and a byte that is not UTF-8.
        let rx2 = ch.clone();
        let v = Builder::new()
            .name(&fibertrace_fiber::embed::name_from_bytes(
                b"v\xef\xbf\xbe\xef\xbf\xbf\xff",
            ))
            .spawn(move || wait_three(&rx2));
        yield_now();
        let full = inspect::snapshot(&InfoOptions::default());
        let snap = Snapshot {
            schedulers: vec![mine(&full, w.id()).clone()],
            ..full.clone()
        };
        let folded = String::from_utf8(export::to_bytes(&snap, Format::Folded)).unwrap();
        assert!(
            folded
                .lines()
                .any(|l| l.starts_with("ctl;fiber:w\\x1b[31m\\x01;")),
            "{folded}"
        );
        assert!(
            folded
                .lines()
                .any(|l| l.starts_with("ctl;fiber:v\\u{fffe}\\u{ffff}\\xff;")),
            "{folded}"
        );
        let svg = export::to_bytes(&snap, Format::Svg);
        let bad = svg
            .iter()
            .position(|&b| b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r'));
        assert_eq!(bad, None, "{}", String::from_utf8_lossy(&svg));
        let text = String::from_utf8(svg).unwrap();
        assert!(!text.contains(['\u{fffe}', '\u{ffff}']), "{text}");
        assert!(
            text.contains("fiber:w\\x1b[31m\\x01"),
            "the name is in the flame graph"
        );
        assert!(text.contains("fiber:v\\u{fffe}\\u{ffff}\\xff"), "{text}");
        ch.close();
        let _ = w.join();
        let _ = v.join();
    })
    .unwrap();
}

/// More fiber names than the flame graph has pixels across (1,500 fibers, each named on its
/// own): the names are left out and equal stacks merged, and the subtitle says so (each
/// fiber narrower than the graph draws, 20,000 such fibers left it empty below the thread);
/// with a few names, each is drawn.
#[test]
fn a_flame_graph_of_more_fiber_names_than_pixels_merges_their_stacks() {
    for (n, named) in [(1500usize, false), (40, true)] {
        Scheduler::with_options(SchedulerOptions {
            name: "many".into(),
            ..Default::default()
        })
        .block_on(move || {
            let ch = channel::<u8>(1);
            let ws: Vec<_> = (0..n)
                .map(|i| {
                    let rx = ch.clone();
                    Builder::new()
                        .name(&format!("u{i}"))
                        .spawn(move || wait_three(&rx))
                })
                .collect();
            yield_now();
            let full = inspect::snapshot(&InfoOptions::default());
            let snap = Snapshot {
                schedulers: vec![mine(&full, ws[0].id()).clone()],
                ..full.clone()
            };
            let svg = String::from_utf8(export::to_bytes(&snap, Format::Svg)).unwrap();
            let note = format!(
                "{} fiber names, more than the image has pixels across: names left out, equal \
                 stacks merged",
                n + 1
            );
            assert_eq!(svg.contains(&note), !named, "{n}");
            assert_eq!(svg.contains("fiber:u7 "), named, "{n}");
            // The stack every worker waits in is drawn, whole, with every fiber's count
            // (written with a thousands separator), or once per name.
            let count = if named {
                "1".to_string()
            } else if n >= 1000 {
                format!("{},{:03}", n / 1000, n % 1000)
            } else {
                n.to_string()
            };
            assert!(
                svg.contains(&format!("<title>export::wait_three ({count} fibers, ")),
                "{n}: {:?}",
                svg.split("<title>")
                    .skip(1)
                    .filter_map(|t| t.split("</title>").next())
                    .take(40)
                    .collect::<Vec<_>>()
            );
            // The folded stacks name every fiber still.
            let folded = String::from_utf8(export::to_bytes(&snap, Format::Folded)).unwrap();
            assert!(
                folded.lines().any(|l| l.starts_with("many;fiber:u7;")),
                "{n}"
            );
            ch.close();
            for w in ws {
                let _ = w.join();
            }
        })
        .unwrap();
    }
}
