//! `fibertrace decode` as a program: every lws vector line embedded in log text decodes to
//! exactly what lws's tool prints; bad lines are reported with their numbers and do not stop
//! the rest.

#[path = "../../fiber/tests/common/tied.rs"]
mod tied;
use tied::Tied;

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::io::Write;
use std::process::{Command, Stdio};

const LWS: &str = include_str!("../../core/tests/data/lws-vectors.tsv");
const CBF: &str = include_str!("../../core/tests/data/cbf-vectors.tsv");

fn run(args: &[&str], stdin: &str) -> (String, String, i32) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    (
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8(o.stderr).unwrap(),
        o.status.code().unwrap(),
    )
}

#[test]
fn all_lws_vectors_from_stdin() {
    let input: String = LWS
        .lines()
        .enumerate()
        .map(|(i, l)| format!("[{i}] heap dump: {} (end)\n", l.split('\t').next().unwrap()))
        .collect();
    let want: String = LWS
        .lines()
        .map(|l| format!("~b#{} \n", l.split('\t').nth(1).unwrap()))
        .collect();
    let (out, err, code) = run(&["decode"], &input);
    assert_eq!(err, "");
    assert_eq!(code, 0);
    assert_eq!(out, want);
}

#[test]
fn cbf_vector_file() {
    let want: String = CBF
        .lines()
        .map(|l| format!("{}\n", l.split('\t').nth(1).unwrap()))
        .collect();
    let (out, err, code) = run(&["decode", "--cbf"], CBF);
    assert_eq!((err.as_str(), code), ("", 0));
    assert_eq!(out, want);
}

#[test]
fn bad_lines_are_reported_and_skipped() {
    let input = "ok ~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV\nplain text\nbad ~m#IF0B*\n~c#02ff\n~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV\n";
    let (out, err, code) = run(&["decode", "-"], input);
    assert_eq!(code, 1);
    assert_eq!(
        out,
        "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 \n\
         ~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 \n"
    );
    assert_eq!(
        err,
        "fibertrace: <stdin>:3: ~m#IF0B: length field says 23809 bytes but the data has 3\n\
         fibertrace: <stdin>:4: ~c#02ff: reserved CBF opcode 0xff (at byte 1)\n"
    );
}

/// A token with no frame says so (it printed an empty line); a bad token's text is written
/// with its control characters escaped (a log line can hold a terminal's escape sequences:
/// they cleared the screen and set the window's title).
#[test]
fn an_empty_trace_says_so_and_bad_tokens_are_written_escaped() {
    let (out, err, code) = run(&["decode", "-"], "x ~c#00 y\n");
    assert_eq!((out.as_str(), err.as_str(), code), ("(no frames)\n", "", 0));
    let (out, err, code) = run(&["decode", "--cbf", "-"], "\x1b[31mRED\x1b]0;pwned\x07 x\n");
    assert_eq!((out.as_str(), code), ("", 1));
    assert!(!err.contains('\x1b') && !err.contains('\x07'), "{err:?}");
    assert!(
        err.starts_with("fibertrace: <stdin>:1: CBF \\e[31mRED\\e]0;pwned\\x07: "),
        "{err:?}"
    );
}

#[test]
fn missing_file_is_an_error_but_others_go_on() {
    let dir = Scratch::new("cli");
    let f = dir.join("log.txt");
    std::fs::write(&f, "~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV\n").unwrap();
    let (out, err, code) = run(&["decode", "/nonexistent/x.log", f.to_str().unwrap()], "");
    assert_eq!(code, 1);
    assert!(err.starts_with("fibertrace: /nonexistent/x.log: "), "{err}");
    assert_eq!(out, "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 \n");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn symbolizes_with_e() {
    use object::{Object, ObjectSymbol};
    let exe = env!("CARGO_BIN_EXE_fibertrace");
    let data = std::fs::read(exe).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let main = file
        .symbols()
        .find(|s| {
            s.name()
                .is_ok_and(|n| n.starts_with("_ZN10fibertrace4main17h"))
        })
        .expect("fibertrace::main in the symbol table")
        .address();
    let src = include_str!("../src/bin/fibertrace.rs");
    let line = src
        .lines()
        .position(|l| l.starts_with("fn main()"))
        .unwrap()
        + 1;
    // CBF (64-bit, absolute pc) of that address, in hex.
    let cbf = format!("~c#021f{main:016x}00");
    let (out, err, code) = run(&["decode", "-e", exe], &format!("trace {cbf}\n"));
    assert_eq!((err.as_str(), code), ("", 0));
    assert_eq!(
        out,
        format!(
            "pc:{main:#x}\n0x{main:016x}: fibertrace::main at {}/src/bin/fibertrace.rs:{line}\n",
            env!("CARGO_MANIFEST_DIR")
        )
    );
    // An address nowhere in the file.
    let (out, _, code) = run(&["decode", "-e", exe], "~c#021d7fff0000000000\n");
    assert_eq!(code, 0);
    assert_eq!(out, "pc:0x7fff00000000\n0x00007fff00000000: ?? ??:0\n");
    // A file that cannot be read.
    let (_, err, code) = run(&["decode", "-e", "/nonexistent/elf"], "");
    assert_eq!(code, 2);
    assert!(
        err.starts_with("fibertrace: cannot read symbols of /nonexistent/elf"),
        "{err}"
    );
    // What is not an ELF file says what it is (a device said `No such device`; a FIFO was
    // opened, which waits for a writer: the decode hung).
    let dir = Scratch::new("decode-exe");
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::write(dir.join("empty"), "").unwrap();
    std::fs::write(dir.join("text"), "hello\n").unwrap();
    let not_regular = "not a regular file (an ELF executable, library or debug file is needed)";
    for (file, why) in [
        ("/dev/null".to_string(), not_regular),
        (fifo.to_str().unwrap().to_string(), not_regular),
        (
            dir.join("empty").to_str().unwrap().to_string(),
            "an empty file, not an ELF file",
        ),
        (
            dir.join("text").to_str().unwrap().to_string(),
            "not an object file: ",
        ),
    ] {
        let (out, err, code) = run(&["decode", "-e", &file], "");
        assert_eq!((out.as_str(), code), ("", 2), "{file}: {err}");
        let want = format!("fibertrace: cannot read symbols of {file}: {why}");
        assert!(err.starts_with(&want), "{file}: {err}");
    }
}

const GOOD: &str = "~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV";
const GOOD_OUT: &str = "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 ";

/// A line with no end (`yes a | tr -d '\n' | fibertrace decode`) is reported once, as soon
/// as it passes the 1 MiB bound — while it still streams in — and skipped to its end without
/// being stored; the next line decodes.
#[test]
fn an_endless_line_is_reported_once_as_it_streams_and_the_next_line_decodes() {
    use std::io::Read;
    use std::time::{Duration, Instant};
    let mut c = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("decode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut sin = c.stdin.take().unwrap();
    let mut serr = c.stderr.take().unwrap();
    let mut sout = c.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let err_reader = std::thread::spawn(move || {
        let mut b = [0u8; 4096];
        loop {
            match serr.read(&mut b) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let _ = tx.send(b[..n].to_vec());
                }
            }
        }
    });
    let out_reader = std::thread::spawn(move || {
        let mut o = String::new();
        let _ = sout.read_to_string(&mut o);
        o
    });
    let chunk = vec![b'a'; 1 << 16];
    // 2 MiB without a newline, and the input stays open.
    for _ in 0..32 {
        sin.write_all(&chunk).unwrap();
    }
    let want = "fibertrace: <stdin>:1: line longer than 1048576 bytes: skipped to its end\n";
    let mut err = Vec::new();
    let t0 = Instant::now();
    while err.len() < want.len() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no report while the line streams: {:?}",
            String::from_utf8_lossy(&err)
        );
        if let Ok(b) = rx.recv_timeout(Duration::from_millis(100)) {
            err.extend_from_slice(&b);
        }
    }
    assert_eq!(String::from_utf8_lossy(&err), want);
    // 64 MiB more of the same line, then its end and a good line.
    for _ in 0..1024 {
        sin.write_all(&chunk).unwrap();
    }
    sin.write_all(format!("\nlog {GOOD}\n").as_bytes()).unwrap();
    drop(sin);
    let status = c.wait().unwrap();
    err_reader.join().unwrap();
    while let Ok(b) = rx.try_recv() {
        err.extend_from_slice(&b);
    }
    assert_eq!(String::from_utf8_lossy(&err), want, "said once");
    assert_eq!(out_reader.join().unwrap(), format!("{GOOD_OUT}\n"));
    assert_eq!(status.code(), Some(1));
}

/// An image table (`~i#`) on a line whose tokens pass the line's frame budget is still
/// read (it yields no frames): the module-relative trace on the next line decodes with it.
/// (It used to be counted among the tokens not shown, and dropped: the next line then had
/// no table.)
#[test]
fn an_image_table_past_the_lines_frame_budget_is_still_read() {
    use fibertrace_core::codec::native::{self, ImageRef, ImageTable};
    use fibertrace_core::codec::{base64, cbf};
    use fibertrace_core::Frame;
    let table = ImageTable::new(vec![ImageRef {
        base: 0x5555_0000_0000,
        end: 0x5555_0010_0000,
        build_id: vec![0xab; 20],
        path: "/usr/bin/app".into(),
    }]);
    let rel = format!(
        "~n#{}",
        base64::encode(&native::encode(
            &[Frame::Pc(0x5555_0000_1234), Frame::Ra(0x5555_0000_5678)],
            Some(&table)
        ))
    );
    // 16 tokens of 65,536 frames fill the line's 2^20; the 17th passes it.
    let big = cbf::encode(&vec![Frame::Pc(0x1000); 1 << 16], cbf::WordSize::W64).unwrap();
    let big = format!("~c#{}", base64::encode(&big));
    let mut line: Vec<String> = (0..17).map(|_| big.clone()).collect();
    line.push(table.to_line());
    line.push(rel.clone());
    let input = format!("{}\n{rel}\n{GOOD}\n", line.join(" "));
    let (out, err, code) = run(&["decode"], &input);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 16 + 2, "{} lines", lines.len());
    assert_eq!(lines[16], "pc:0x555500001234 ra:0x555500005678");
    assert_eq!(lines[17], GOOD_OUT);
    assert_eq!(
        err,
        "fibertrace: <stdin>:1: the line's tokens decode to more than 1048576 frames: its \
         last 2 tokens are not shown\n"
    );
    assert_eq!(code, 1);
}

/// Decoding a log as it grows (`tail -f log | fibertrace decode`): each line's result goes
/// out before decode waits for more input, not once 8 KiB have piled up (or never, for a
/// program interrupted meanwhile).
#[test]
fn each_line_is_written_out_before_waiting_for_more_input() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    let mut c = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("decode")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut sin = c.stdin.take().unwrap();
    let sout = c.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(sout).lines() {
            let Ok(l) = l else { return };
            let _ = tx.send(l);
        }
    });
    for i in 0..3 {
        sin.write_all(format!("line {i} {GOOD}\n").as_bytes())
            .unwrap();
        sin.flush().unwrap();
        let t0 = Instant::now();
        let got = rx.recv_timeout(Duration::from_secs(20));
        assert_eq!(
            got.as_deref(),
            Ok(GOOD_OUT),
            "line {i} after {:?}",
            t0.elapsed()
        );
    }
    drop(sin);
    let o = c.wait_with_output().unwrap();
    reader.join().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stderr), "");
    assert_eq!(o.status.code(), Some(0));
}

#[test]
fn file_names_that_are_not_utf8_are_opened() {
    use std::os::unix::ffi::OsStrExt;
    let dir = Scratch::new("decode-names");
    let name = std::ffi::OsStr::from_bytes(b"log\xfe.txt");
    std::fs::write(dir.join(name), "alloc ~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("decode")
        .arg(name)
        .arg(std::ffi::OsStr::from_bytes(b"missing\xfe.txt"))
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(o.stdout).unwrap(),
        "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 \n"
    );
    // The missing one is named (not UTF-8: shown with a replacement character).
    assert_eq!(
        String::from_utf8(o.stderr).unwrap(),
        "fibertrace: missing\u{fffd}.txt: No such file or directory (os error 2)\n"
    );
    assert_eq!(o.status.code(), Some(1));
}
