//! The reports' figures, side by side in one run: the text, grouped and pprof dumps of
//! 10,000 / 30,000 / 100,000 suspended fibers (time and bytes), Go's goroutine dumps of as many
//! parked goroutines (`debug=2`, `debug=1`, pprof) when `go` is installed, and the HTTP
//! endpoint's latency while a fiber spins.
//!
//! ```sh
//! cargo run --release -p fibertrace-fiber --example reports_bench
//! ```
//!
//! Each figure is the best of 3 (the dumps) or the median and worst of 20 requests (the
//! endpoint). A size that cannot be made on this machine (`vm.max_map_count` bounds the
//! fibers' stack mappings) is reported with the error, not skipped silently.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fibertrace_fiber::export::{self, Format};
use fibertrace_fiber::{channel, dump, Builder, Channel, Scheduler};

#[inline(never)]
fn wait_here(ch: &Channel<u8>) {
    let v = ch.recv();
    std::hint::black_box(v);
}

#[inline(never)]
fn worker(ch: &Channel<u8>) {
    wait_here(ch);
    std::hint::black_box(());
}

#[inline(never)]
fn spin_here(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        std::hint::spin_loop();
    }
}

/// A scheduler thread with `n` fibers parked in `worker → wait_here → recv` (and, with
/// `spin`, one more spinning until it is set). Returns when they are parked, or the error
/// that stopped making them.
fn park(
    n: usize,
    spin: Option<Arc<AtomicBool>>,
) -> Result<(Arc<AtomicBool>, std::thread::JoinHandle<()>), String> {
    let (tx, rx) = mpsc::channel::<Result<(), String>>();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let t = std::thread::spawn(move || {
        let s = Scheduler::new();
        let ch = channel::<u8>(0);
        let tx2 = tx.clone();
        let r = s.block_on(move || {
            for i in 0..n {
                let c = ch.clone();
                if let Err(e) = Builder::new().name("worker").try_spawn(move || worker(&c)) {
                    return Err(format!("fiber {i} of {n}: {e}"));
                }
            }
            fibertrace_fiber::yield_now();
            if let Some(stop) = spin {
                let _ = tx2.send(Ok(()));
                spin_here(&stop);
            } else {
                let _ = tx2.send(Ok(()));
                while !done2.load(Ordering::Relaxed) {
                    fibertrace_fiber::sleep(Duration::from_millis(20));
                }
            }
            ch.close();
            Ok(())
        });
        if let Ok(Err(e)) = r {
            let _ = tx.send(Err(e));
        }
    });
    match rx.recv() {
        Ok(Ok(())) => Ok((done, t)),
        Ok(Err(e)) => {
            let _ = t.join();
            Err(e)
        }
        Err(_) => Err("the scheduler thread ended".into()),
    }
}

fn best_of_3(f: impl Fn() -> usize) -> (f64, usize) {
    let mut best = f64::MAX;
    let mut size = 0;
    for _ in 0..3 {
        let t0 = Instant::now();
        size = f();
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    (best, size)
}

fn dumps() {
    println!("dumps of suspended fibers (best of 3)");
    for n in [10_000, 30_000, 100_000] {
        match park(n, None) {
            Ok((done, t)) => {
                for (what, f) in [
                    (
                        "text",
                        Box::new(|| dump::dump_text().len()) as Box<dyn Fn() -> usize>,
                    ),
                    ("grouped", Box::new(|| dump::dump_grouped().len())),
                    ("pprof", Box::new(|| export::export(Format::Pprof).len())),
                ] {
                    let (ms, bytes) = best_of_3(f);
                    println!("{n:>7} fibers     {what:<8} {ms:>8.1} ms {bytes:>11} bytes");
                }
                done.store(true, Ordering::Relaxed);
                let _ = t.join();
            }
            Err(e) => println!("{n:>7} fibers     cannot be made here: {e}"),
        }
    }
}

const GO: &str = r#"package main

import (
	"bytes"
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"time"
)

//go:noinline
func waitHere(ch chan int) int { return <-ch }

func main() {
	n, _ := strconv.Atoi(os.Args[1])
	ch := make(chan int)
	for i := 0; i < n; i++ {
		go func() { waitHere(ch) }()
	}
	time.Sleep(200 * time.Millisecond)
	for _, d := range []struct{ name string; debug int }{{"debug=2", 2}, {"debug=1", 1}, {"pprof", 0}} {
		best := time.Hour
		size := 0
		for k := 0; k < 3; k++ {
			var b bytes.Buffer
			t0 := time.Now()
			pprof.Lookup("goroutine").WriteTo(&b, d.debug)
			if e := time.Since(t0); e < best {
				best = e
			}
			size = b.Len()
		}
		fmt.Printf("%7d goroutines %-8s %8.1f ms %11d bytes\n", n, d.name, float64(best.Microseconds())/1e3, size)
	}
}
"#;

fn go() {
    println!("Go's goroutine dumps, the same sizes (best of 3)");
    let dir = std::env::temp_dir().join(format!("fibertrace-reports-bench-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let src = dir.join("main.go");
    let exe = dir.join("gobench");
    if std::fs::write(&src, GO).is_err() {
        println!("  (cannot write {})", src.display());
        return;
    }
    let built = Command::new("go")
        .args(["build", "-o"])
        .arg(&exe)
        .arg(&src)
        .env("GOCACHE", dir.join("cache"))
        .env("HOME", &dir)
        .output();
    match built {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            println!("  go build failed: {}", String::from_utf8_lossy(&o.stderr));
            return;
        }
        Err(e) => {
            println!("  go is not installed ({e}): apt-get install golang-go");
            return;
        }
    }
    for n in [10_000, 30_000, 100_000] {
        match Command::new(&exe).arg(n.to_string()).output() {
            Ok(o) => print!("{}", String::from_utf8_lossy(&o.stdout)),
            Err(e) => println!("  {n}: {e}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn request(addr: std::net::SocketAddr, target: &str) -> (f64, usize) {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n").expect("send");
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("read");
    assert!(
        all.starts_with(b"HTTP/1.1 200 "),
        "{}",
        String::from_utf8_lossy(&all[..all.len().min(200)])
    );
    (t0.elapsed().as_secs_f64() * 1e3, all.len())
}

fn endpoint() {
    println!("the HTTP endpoint while a fiber spins (1,000 parked fibers; median and worst of 20)");
    let stop = Arc::new(AtomicBool::new(false));
    let (_, t) = match park(1000, Some(stop.clone())) {
        Ok(x) => x,
        Err(e) => {
            println!("  cannot be made here: {e}");
            return;
        }
    };
    let server = fibertrace_fiber::http::serve("127.0.0.1:0").expect("serve");
    let addr = server.local_addr();
    for target in [
        "/debug/fibers?format=grouped",
        "/debug/fibers?format=text",
        "/debug/pprof/goroutine",
    ] {
        let mut times: Vec<f64> = Vec::new();
        let mut bytes = 0;
        for _ in 0..20 {
            let (ms, b) = request(addr, target);
            times.push(ms);
            bytes = b;
        }
        times.sort_by(f64::total_cmp);
        println!(
            "  {target:<30} median {:>7.2} ms  worst {:>7.2} ms  {bytes:>9} bytes",
            times[10], times[19]
        );
    }
    stop.store(true, Ordering::Relaxed);
    let _ = t.join();
    server.stop();
}

fn main() {
    dumps();
    go();
    endpoint();
}
