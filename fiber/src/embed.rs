//! What a layer that runs another language's code in fibers (the Lua host of
//! `fibertrace-lua`) needs from the runtime beyond the user API: the turns of the run loop and
//! `fiber.top()`'s accounting, the run time of the current fiber (for slices), a cancellation
//! that does not end a join, fiber names as the bytes the layer stores, the cycle clock the
//! runtime's times are counted in, and the handler that turns a C stack overflow into that
//! language's error ([`overflow`]), and reads of the process's own memory that fail where a
//! plain read would fault (`overflow::ProbeReads`: what the same handler gives).
//!
//! A program that only runs Rust fibers needs none of it.

pub use crate::clock::{ticks, Rate};

/// A C stack overflow turned into an error of the layer's language: the fiber's reserve, the
/// handler the fault calls, and the polls at the layer's safe points (see the crate's stack
/// layout: each fiber stack has an inaccessible reserve between its usable part and its
/// guard).
pub mod overflow {
    pub use crate::overflow::{
        poll, running_fiber_open, set_thread_handler, Overflow, OverflowHandler, ProbeReads,
        MAX_OPEN, RAISE_AGAIN_BELOW,
    };
}
pub use crate::sched::{
    current_run_time, loop_turn, name_from_bytes, name_to_bytes, quoted_name, top_at_end,
    top_disable, top_enable, top_enabled, top_ended_row, top_fiber_row, top_sched_row, CancelQuiet,
    EndedTop, QuotedName, TopRow,
};
