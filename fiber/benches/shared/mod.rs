//! Helpers shared by the fiber benches (`fiber.rs`, `speed.rs`). Not a bench of its own
//! (cargo finds benches at `benches/*.rs` and `benches/*/main.rs` only).

use std::time::{Duration, Instant};

use fibertrace_fiber::{yield_now, Scheduler, SchedulerOptions};

/// A scheduler with 64 KiB stacks, tracing and parent traces as asked.
pub fn sched(traced: bool, parent_traces: bool) -> Scheduler {
    Scheduler::with_options(SchedulerOptions {
        traced,
        parent_traces,
        stack_size: 64 * 1024,
        ..SchedulerOptions::default()
    })
}

/// Time of `iters` yields in each of two fibers (`2 * iters` switches between fibers),
/// measured around the scheduler's run.
pub fn ping_pong(traced: bool, iters: u64) -> Duration {
    let s = sched(traced, false);
    for _ in 0..2 {
        s.spawn(move || {
            // Each yield switches to the other fiber.
            for _ in 0..iters {
                yield_now();
            }
        });
    }
    let t0 = Instant::now();
    s.run().unwrap();
    t0.elapsed()
}
