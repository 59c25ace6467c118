//! A fiber's run state, and the only code that changes it.
//!
//! ```text
//!   New --resume--> Running --suspend--> Suspended --resume--> Running ... --return--> Dead
//!                                        Suspended <--inspect--> Inspecting
//! ```
//!
//! One atomic byte ([`RunCell`]) holds the state; each transition is a method here:
//! - [`RunCell::publish_suspended`]: the fiber itself, on its own thread, after it recorded
//!   its registers and just before it switches away (release: the registers are visible to
//!   whoever sees `Suspended`).
//! - [`RunCell::inspect`]: any thread, `Suspended → Inspecting` by compare-and-swap; the
//!   returned [`Inspection`] moves it back to `Suspended` (release) when dropped. This is the
//!   one inspection primitive: every walk of a parked stack happens while one is held.
//! - [`RunCell::begin_resume`] (`New`/`Suspended → Running`) and [`RunCell::mark_dead`]
//!   (`→ Dead`, before the stack is freed): the scheduler's thread, each waiting out an
//!   inspection under way (a walk takes well under a microsecond).
//!
//! So a walk never overlaps a resume and never reads a freed stack: the invariant the
//! inspection layer relies on. A walk that starts right after the fiber published
//! `Suspended` but before it finished switching away is still sound: the frames it reads (the
//! suspend wrapper's and its callers') no longer change; the switch itself only writes below
//! the recorded stack pointer.

use std::sync::atomic::{AtomicU8, Ordering};

/// Where a fiber is in its life, as far as walking its stack is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum RunState {
    /// Made, never resumed: its stack holds nothing of the user's yet.
    New = 0,
    /// Executing on its scheduler's thread.
    Running = 1,
    /// Parked, its registers recorded: any thread may inspect it.
    Suspended = 2,
    /// Parked, and some thread is walking its stack now.
    Inspecting = 3,
    /// Finished (or dropped): its stack may be gone.
    Dead = 4,
}

impl RunState {
    #[inline]
    pub(crate) fn from_u8(v: u8) -> RunState {
        match v {
            0 => RunState::New,
            1 => RunState::Running,
            2 => RunState::Suspended,
            3 => RunState::Inspecting,
            _ => RunState::Dead,
        }
    }
}

/// The run state of one fiber (one atomic byte in its control block).
pub(crate) struct RunCell(pub(crate) AtomicU8);

impl std::fmt::Debug for RunCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get(Ordering::Relaxed).fmt(f)
    }
}

impl RunCell {
    /// A new fiber's state.
    pub(crate) const fn new() -> RunCell {
        RunCell(AtomicU8::new(RunState::New as u8))
    }

    /// Back to `New`, for a control block renewed in place (nothing else holds it).
    pub(crate) fn reset(&mut self) {
        *self.0.get_mut() = RunState::New as u8;
    }

    /// The state now (`order`: Acquire to read what the fiber published with it).
    #[inline]
    pub(crate) fn get(&self, order: Ordering) -> RunState {
        RunState::from_u8(self.0.load(order))
    }

    /// `Running → Suspended`, by the fiber itself after recording its registers.
    #[inline(always)]
    pub(crate) fn publish_suspended(&self) {
        self.0.store(RunState::Suspended as u8, Ordering::Release);
    }

    /// `Suspended → Inspecting` if the fiber is suspended now: while the returned guard lives,
    /// the fiber cannot be resumed or freed, and what it recorded before suspending is
    /// visible (acquire). `None` if it is in any other state.
    #[inline]
    pub(crate) fn inspect(&self) -> Option<Inspection<'_>> {
        self.0
            .compare_exchange(
                RunState::Suspended as u8,
                RunState::Inspecting as u8,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .ok()
            .map(|_| Inspection(&self.0))
    }

    /// `New`/`Suspended → Running` for a resume, waiting out an inspection.
    #[inline]
    pub(crate) fn begin_resume(&self) {
        self.swap(RunState::Running, Ordering::Acquire);
    }

    /// `→ Dead`, waiting out an inspection: after it, nobody walks the stack again.
    pub(crate) fn mark_dead(&self) {
        self.swap(RunState::Dead, Ordering::AcqRel);
    }

    fn swap(&self, to: RunState, success: Ordering) {
        loop {
            let cur = self.0.load(Ordering::Relaxed);
            if cur == RunState::Inspecting as u8 {
                std::hint::spin_loop();
                continue;
            }
            if self
                .0
                .compare_exchange_weak(cur, to as u8, success, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// An inspection under way (see [`RunCell::inspect`]): dropping it ends the inspection.
pub(crate) struct Inspection<'a>(&'a AtomicU8);

impl Drop for Inspection<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.store(RunState::Suspended as u8, Ordering::Release);
    }
}
