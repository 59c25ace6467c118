//! A process for `fibertrace dump PID` to read: N fibers (1,000 by default, or the first
//! argument) suspended in known functions — half wait on a channel, half sleep — and a thread
//! that counts, so that a reader can check the process runs on after being read.
//!
//! It prints its own dump of the first waiter (the frames an in-process dump gives, between
//! `own-dump` and `end-own-dump`), then `ready`, then the counter every 10 ms; a line on its
//! standard input (or its end) makes every fiber finish its work, and it prints `done N`.
//!
//! ```sh
//! cargo run -p fibertrace-fiber --example foreign_target &    # then: fibertrace dump $!
//! ```

use std::hint::black_box;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fibertrace_fiber::{channel, sleep, yield_now, Builder, Channel, Scheduler};

static COUNT: AtomicU64 = AtomicU64::new(0);

#[inline(never)]
fn wait_inner(jobs: &Channel<u32>) -> Option<u32> {
    let j = jobs.recv(); // wait_inner waits here
    black_box(j)
}

#[inline(never)]
fn wait_outer(jobs: &Channel<u32>) -> Option<u32> {
    let j = wait_inner(jobs); // wait_outer calls here
    black_box(j)
}

#[inline(never)]
fn nap() {
    sleep(Duration::from_secs(3600)); // nap sleeps here
    black_box(());
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let quit = Arc::new(AtomicBool::new(false));
    let q = quit.clone();
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut s = String::new();
            let _ = std::io::stdin().lock().read_line(&mut s);
            q.store(true, Ordering::Release);
        })
        .unwrap();
    let stop_counting = Arc::new(AtomicBool::new(false));
    let sc = stop_counting.clone();
    let counter = std::thread::Builder::new()
        .name("counter".into())
        .spawn(move || {
            while !sc.load(Ordering::Acquire) {
                COUNT.fetch_add(1, Ordering::Relaxed);
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", COUNT.load(Ordering::Relaxed));
                let _ = out.flush();
                drop(out);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .unwrap();
    let finished = Scheduler::new()
        .block_on(move || {
            let jobs = channel::<u32>(0);
            let mut waiters = Vec::new();
            let mut nappers = Vec::new();
            for i in 0..n {
                if i % 2 == 0 {
                    let j = jobs.clone();
                    waiters.push(
                        Builder::new()
                            .name(&format!("waiter-{i}"))
                            .spawn(move || wait_outer(&j)),
                    );
                } else {
                    nappers.push(Builder::new().name("napper").spawn(nap));
                }
            }
            yield_now();
            let own = fibertrace_fiber::dump::dump_text();
            {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "own-dump\n{own}end-own-dump\nready");
                let _ = out.flush();
            }
            while !quit.load(Ordering::Acquire) {
                sleep(Duration::from_millis(10));
            }
            jobs.close();
            for f in &nappers {
                f.fiber().cancel();
            }
            let mut done = 0;
            for w in waiters {
                done += usize::from(w.join().is_ok());
            }
            for f in nappers {
                // (Cancelled: their join says so; each has ended.)
                let _ = f.join();
                done += 1;
            }
            done
        })
        .unwrap();
    stop_counting.store(true, Ordering::Release);
    counter.join().unwrap();
    println!("done {finished}");
}
