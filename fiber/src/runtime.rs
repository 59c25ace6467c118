//! The constructors that wire the machinery ([`crate::sched`]) to the layer above it
//! ([`crate::inspect`]): the only place that names both.

use crate::sched::{Scheduler, SchedulerOptions};

impl Scheduler {
    /// A scheduler with default options.
    pub fn new() -> Scheduler {
        Self::with_options(SchedulerOptions::default())
    }

    /// A scheduler with the given options.
    pub fn with_options(opts: SchedulerOptions) -> Scheduler {
        Scheduler::with_hooks(opts, &crate::inspect::HOOKS)
    }
}

impl Default for Scheduler {
    fn default() -> Self {
        Self::new()
    }
}
