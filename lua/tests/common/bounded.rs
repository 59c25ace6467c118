//! Runs the `fibertrace` program to its end, bounded in time (a hang fails the test, not the
//! suite), with what it printed on each stream. Shared by the test suites that run it on
//! hostile scripts and inputs (included with `#[path]`).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a run printed, and its exit code (`None`: killed by a signal).
pub struct Out {
    pub stdout: String,
    pub stderr: String,
    pub code: Option<i32>,
}

/// Runs `fibertrace ARGS` with `stdin` as its standard input (then closed); fails the test
/// if it has not ended within 60 s.
pub fn run(args: &[&str], stdin: &[u8]) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sin = c.stdin.take().unwrap();
    let input = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = sin.write_all(&input);
    });
    let mut sout = c.stdout.take().unwrap();
    let mut serr = c.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut o = Vec::new();
        let _ = sout.read_to_end(&mut o);
        o
    });
    let err = std::thread::spawn(move || {
        let mut e = Vec::new();
        let _ = serr.read_to_end(&mut e);
        e
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = c.kill();
            panic!("fibertrace {args:?} did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = feeder.join();
    Out {
        stdout: String::from_utf8_lossy(&out.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&err.join().unwrap()).into_owned(),
        code: status.code(),
    }
}
