//! The heap tracker's per-thread pause (see `crate::heap`): set while the tracker works, and
//! while this library's own tables are built (the image table, the symbolizer's caches), so
//! that those allocations are neither tracked nor — since the tracker's stack walks read
//! those tables — able to wait on a lock their own thread holds.
//!
//! A module of its own, below everything that uses it, so that the image table and the
//! symbolizer need not depend on the tracker.

use std::cell::Cell;

thread_local! {
    /// Set while the tracker works on this thread: allocations meanwhile are not tracked.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Tracking paused on this thread while held (see [`pause`]): the tracker's own work, and
/// a library's, is never tracked.
pub struct Busy {
    was: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Pauses tracking on this thread until the guard is dropped: allocations meanwhile are
/// served untracked (not charged, not listed). For a library's own tables and reports.
pub fn pause() -> Busy {
    Busy::enter()
}

impl Busy {
    /// Enters (a nested enter keeps the flag set).
    #[inline]
    pub(crate) fn enter() -> Busy {
        let was = BUSY.try_with(|b| b.replace(true)).unwrap_or(true);
        Busy {
            was,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Whether the thread was already busy (then the work must not be tracked).
    #[inline]
    pub(crate) fn nested(&self) -> bool {
        self.was
    }
}

impl Drop for Busy {
    #[inline]
    fn drop(&mut self) {
        if !self.was {
            let _ = BUSY.try_with(|b| b.set(false));
        }
    }
}
