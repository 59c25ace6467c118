//! A process for `fibertrace dump PID` to read (and the tests of `fibertrace_core::remote`):
//! threads waiting in known functions, and one that counts, so that a reader can check the
//! process runs on after being read.
//!
//! It prints `ready` once every thread is in place, then the counter's value every 10 ms;
//! a line on its standard input (or its end) makes it finish its work and exit 0.
//!
//! ```sh
//! cargo run -p fibertrace-core --example remote_target &      # then: fibertrace dump $!
//! ```

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

static COUNT: AtomicU64 = AtomicU64::new(0);

/// Waits for `rx` in a named frame (the `parked` thread).
#[inline(never)]
fn parked_inner(rx: &mpsc::Receiver<()>) {
    let _ = rx.recv(); // parked_inner waits here
    std::hint::black_box(());
}

#[inline(never)]
fn parked_outer(rx: &mpsc::Receiver<()>) {
    parked_inner(rx); // parked_outer calls here
    std::hint::black_box(());
}

/// Counts, and prints the count every 10 ms until told to stop.
#[inline(never)]
fn count(stop: &mpsc::Receiver<()>) {
    let out = std::io::stdout();
    loop {
        for _ in 0..1000 {
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        let _ = writeln!(out.lock(), "{}", COUNT.load(Ordering::Relaxed));
        let _ = out.lock().flush();
        if stop.recv_timeout(Duration::from_millis(10)).is_ok() {
            return;
        }
    }
}

/// Reads a line of standard input (the `reader` thread): blocked in `read`.
#[inline(never)]
fn read_line() -> String {
    let mut s = String::new();
    let _ = std::io::stdin().lock().read_line(&mut s); // read_line waits here
    std::hint::black_box(s)
}

fn main() {
    let (wake_tx, wake_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel();
    let r1 = ready_tx.clone();
    let parked = std::thread::Builder::new()
        .name("parked".into())
        .spawn(move || {
            r1.send(()).unwrap();
            parked_outer(&wake_rx); // the parked thread's closure calls here
        })
        .unwrap();
    let counter = std::thread::Builder::new()
        .name("counter".into())
        .spawn(move || count(&stop_rx))
        .unwrap();
    let reader = std::thread::Builder::new()
        .name("reader".into())
        .spawn(move || {
            ready_tx.send(()).unwrap();
            read_line()
        })
        .unwrap();
    ready_rx.recv().unwrap();
    ready_rx.recv().unwrap();
    // Give both a moment to reach their waits.
    std::thread::sleep(Duration::from_millis(50));
    println!("ready");
    let _ = std::io::stdout().flush();
    let _ = reader.join();
    let _ = wake_tx.send(());
    let _ = stop_tx.send(());
    parked.join().unwrap();
    counter.join().unwrap();
    println!("done {}", COUNT.load(Ordering::Relaxed));
}
