//! fibertrace-fiber: a cooperative fiber runtime on corosensei whose every fiber can be
//! traced — the running one, every suspended one (from its saved context), and who created
//! each — with fiber info, Go-like dumps, and a dump signal that works while a fiber spins.
//!
//! ```
//! use fibertrace_fiber::{channel, spawn, Scheduler};
//! let sched = Scheduler::new();
//! let n = sched
//!     .block_on(|| {
//!         let ch = channel::<u32>(1);
//!         let tx = ch.clone();
//!         let h = spawn(move || tx.send(7).unwrap());
//!         let v = ch.recv().unwrap();
//!         h.join().unwrap();
//!         v
//!     })
//!     .unwrap();
//! assert_eq!(n, 7);
//! ```
//!
//! One scheduler runs per OS thread; several may run on several threads at once. Fibers
//! are not moved between threads. Info and dumps work from any thread.

/// Marks the function it is written in as a report's entry point: while it runs, a trace of
/// the current fiber taken for the report starts at its caller (the user's code), whatever
/// the report's own machinery inlined or not. The function must be `#[inline(never)]`.
macro_rules! report_entry {
    () => {
        let _origin = $crate::inspect::info::ReportOrigin::enter(
            fibertrace_core::__fibertrace_registers_here!(),
        );
    };
}

// The machinery, from the bottom up (see `inspect`'s module doc for the layers).
mod clock;
mod frames;
mod overflow;
mod publish;
pub mod registry;
mod running;
mod sched;
mod stack;
pub mod sync;
mod task;
// Above the machinery: the snapshot and the reports.
pub mod inspect;
// The constructors that wire the two.
mod runtime;
// What a layer that embeds another language's runtime in fibers needs beyond the user API.
pub mod embed;

pub use frames::TRAMPOLINE;
pub use inspect::{dump, export, glue, http, info, sample, watchdog};
pub use inspect::{FiberInfo, FrameInfo, FrameSource, HeldSource, InfoOptions, Snapshot};
pub use sched::{
    cancellation_caught, current, current_id, end_run_after_turn, is_cancelled, release_caches,
    sleep, spawn, suspend, testcancel, try_spawn, yield_now, yield_to, yield_to_id, BlockOnError,
    Builder, Fiber, JoinError, JoinHandle, RunError, SchedBuilder, Scheduler, SchedulerOptions,
    SpawnError, SpawnErrorKind, MIN_STACK_SIZE, NAME_MAX,
};
pub use sync::{channel, Channel, ChannelError, Cond};
pub use task::barrier::barriers_made_here;
pub use task::state::switches_unlocked;
pub use task::{
    parent_trace_copies, ControlBlock, FiberId, PanicReport, ParentTrace, Status, WaitOn,
    PARENT_DEPTH_KEPT, PARENT_DEPTH_SHOWN, PARENT_FRAMES,
};

/// The README's examples, compiled and run as doctests so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
