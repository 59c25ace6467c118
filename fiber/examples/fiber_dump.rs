//! A process with stuck fibers that prints a Go-like dump of every fiber on SIGQUIT and goes
//! on running — also while one fiber spins and never yields.
//!
//! cargo run -p fibertrace-fiber --example fiber_dump -- --demo
//!   (sends itself SIGQUIT after 300 ms, prints the dump, and exits after a second)
//! cargo run -p fibertrace-fiber --example fiber_dump -- 60
//!   (waits for `kill -QUIT <pid>` from another terminal; ends by itself after 60 s)

use std::hint::black_box;
use std::time::{Duration, Instant};

use fibertrace_fiber::{channel, sleep, spawn, yield_now, Builder, Channel, Scheduler};

#[inline(never)]
fn wait_for_job(jobs: &Channel<u32>) -> Option<u32> {
    let j = jobs.recv();
    black_box(j)
}

#[inline(never)]
fn worker_loop(jobs: &Channel<u32>) {
    while let Some(j) = wait_for_job(jobs) {
        black_box(j);
    }
}

#[inline(never)]
fn spin_forever(until: Instant) -> u64 {
    let mut n = 0u64;
    while Instant::now() < until {
        n = black_box(n.wrapping_add(1));
    }
    n
}

fn main() {
    fibertrace_fiber::dump::install_signal(libc::SIGQUIT).expect("install the dump signal");
    let arg = std::env::args().nth(1).unwrap_or_default();
    let demo = arg == "--demo";
    let deadline = Instant::now()
        + if demo {
            Duration::from_millis(1000)
        } else {
            Duration::from_secs(arg.parse().unwrap_or(60))
        };
    if demo {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: sending a signal to our own process.
            unsafe { libc::kill(libc::getpid(), libc::SIGQUIT) };
        });
    }
    Scheduler::new()
        .block_on(move || {
            let jobs = channel::<u32>(0);
            for i in 0..2 {
                let j = jobs.clone();
                Builder::new()
                    .name(&format!("worker-{i}"))
                    .spawn(move || worker_loop(&j));
            }
            spawn(|| sleep(Duration::from_secs(3600)));
            yield_now();
            let spinner = Builder::new().name("spinner").spawn(move || {
                println!("ready pid={}", std::process::id());
                spin_forever(deadline)
            });
            let n = spinner.join().unwrap();
            jobs.close();
            black_box(n);
            // Let the dump thread finish printing.
            std::thread::sleep(Duration::from_millis(200));
            std::process::exit(0);
        })
        .unwrap();
}
