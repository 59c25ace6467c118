//! A thread that holds another thread of this process still (stopped in a signal handler
//! while it reads that thread's stack and memory, as a dump from another thread does when a
//! scheduler's thread is away in native code): while it does, it must not wait for a lock
//! the held thread may hold, or it waits until the hold runs out and its read is lost. So,
//! on a thread inside [`enter`]'s guard (`capture::holding_another_thread`):
//! - the symbolizer answers from its caches only ([`crate::symbolize`]: a lookup that is not
//!   cached, or whose part of the cache another thread writes just then, gets an address
//!   without a name, which is not cached) — the held thread may have been stopped inside the
//!   symbolizer, holding a file's lock while it loads debug information for seconds;
//! - walks do not refresh the image table when they meet code outside every known image
//!   (the refresh takes the loader's lock, which the held thread may hold): they end there.
//!
//! How a result can be wrong: a frame looked up under the hold that the caches did not have
//! is left unnamed (the caller names it again after the hold), and a walk through code
//! loaded since the table was last read ends early.

use std::cell::Cell;

thread_local! {
    /// Set while this thread holds another still.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// While held, this thread holds another of the process still (see the module doc).
pub struct Holding {
    was: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Marks this thread as holding another still until the guard is dropped (nested guards
/// keep the mark until the outermost ends).
pub fn enter() -> Holding {
    Holding {
        was: HOLDING.try_with(|h| h.replace(true)).unwrap_or(true),
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = HOLDING.try_with(|h| h.set(self.was));
    }
}

/// Whether this thread holds another still now.
#[inline]
pub fn active() -> bool {
    HOLDING.try_with(Cell::get).unwrap_or(false)
}
