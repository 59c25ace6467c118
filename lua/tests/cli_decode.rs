//! `fibertrace decode` as a program: every lws vector line embedded in log text decodes to
//! exactly what lws's tool prints; bad lines are reported with their numbers and do not stop
//! the rest.

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

#[test]
fn missing_file_is_an_error_but_others_go_on() {
    let dir = std::env::temp_dir().join(format!("fibertrace-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
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
}
