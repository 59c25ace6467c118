//! Frame sources: what a layer above the runtime (the Lua host) adds to the frames of the
//! fibers it runs, so that the runtime's own reports show them as `fiber.info()` does.
//!
//! The runtime sees native frames only. A Lua fiber's native stack holds the interpreter's
//! frames, and its Lua frames are in its Lua thread, which only the host can read. A host
//! registers a [`FrameSource`] for its scheduler ([`crate::Scheduler::set_frame_source`]);
//! the text reports built *on that scheduler's thread* (the deadlock report, a
//! [`super::dump::dump_text`] called from a fiber) then ask it for each fiber's frames — the
//! native ones with the host's interleaved — and for the names of the frames it added.
//!
//! The source is kept per thread: it reads state (a Lua thread) that only its scheduler's
//! thread may touch, and only while the fiber is suspended. A snapshot taken on another
//! thread (the dump signal's, the watchdog's) asks the scheduler's thread for its part (see
//! [`super::snapshot`]), built between fibers or at a safe point inside the running one
//! ([`super::serve_at_safe_point`]).
//!
//! How a result can be wrong: the source is asked only for fibers that are suspended (or
//! never ran) when the report reads them; it answers from the fiber's state at that moment.
//! A source that fails keeps the native frames (the report says nothing of the failure).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use fibertrace_core::{Frame, LuaFrameId};

use crate::task::FiberId;

/// Frames a layer above the runtime contributes for the fibers of one scheduler.
pub trait FrameSource {
    /// The frames of fiber `fiber` (innermost first) with this layer's frames interleaved
    /// into its native ones `native` (as the runtime walked them, innermost first); `None`
    /// keeps the native frames. Called on the scheduler's thread while the fiber is
    /// suspended (or has not run yet), never while it runs.
    fn frames(&self, fiber: FiberId, native: &[Frame]) -> Option<Vec<Frame>>;

    /// The body of a line for a frame this layer made (`name in source:line`), or `None`.
    fn name(&self, id: LuaFrameId) -> Option<String>;

    /// The ids of the channels and conditions that suspended fiber `fiber` holds in this
    /// layer's frames (a Lua local or upvalue), for the deadlock report's wait-for graph:
    /// the fibers that could end a wait on one of them. Called on the scheduler's thread
    /// while the fiber is suspended. The default knows of none.
    fn holds(&self, fiber: FiberId) -> Vec<u64> {
        let _ = fiber;
        Vec::new()
    }
}

/// A layer's frames read from another thread while the scheduler's thread is held still (see
/// [`super::snapshot`]'s late path): for a report asked while that thread is away in native
/// code for good (a blocking call), where the [`FrameSource`] cannot be asked. It reads the
/// layer's state from memory (the Lua host: its Lua threads, as `fibertrace dump PID` reads
/// another process's), never through the layer's own API.
///
/// How a result can be wrong: the thread is held wherever the signal found it, in code that
/// may be changing the layer's state (a collector step moving a stack): the reader must
/// check what it reads and say when it does not check out, never guess or fault; and a hold
/// that ran out before the read ended makes the whole read void (the caller drops it).
pub trait HeldSource: Send + Sync {
    /// A suspended (or never started) fiber's frames, with the layer's merged into its
    /// native ones `native` (innermost first), from its layer word `word`; `None` keeps the
    /// native frames, with the note of why (or none).
    fn frames(&self, word: u64, native: &[Frame]) -> (Option<Vec<Frame>>, Option<String>);

    /// The same for the fiber that ran when its thread was stopped, from that thread's
    /// frames `native` (walked from where the signal found it, innermost first) and its
    /// registers there (`register(n)`: DWARF number `n`, as the unwinder numbers them).
    fn running_frames(
        &self,
        word: u64,
        native: &[Frame],
        register: &dyn Fn(u16) -> Option<u64>,
    ) -> (Option<Vec<Frame>>, Option<String>);

    /// Where the walk of the running fiber's thread goes on below the layer's own code that
    /// has no unwind record (a Lua host's compiled traces), as
    /// [`super::foreign::ForeignLayer::below_unwound`] says for another process, read here
    /// while the thread is held; the runtime walks on from there before it calls
    /// [`HeldSource::running_frames`]. `None` (the default): the walk ends where it stopped.
    fn below_unwound(&self, _word: u64) -> Option<fibertrace_core::arch::Registers> {
        None
    }

    /// As [`FrameSource::name`]; called from any thread.
    fn name(&self, id: LuaFrameId) -> Option<String>;

    /// A read of the fibers under one hold begins: what the source keeps of memory (a cache
    /// of the pages it read) holds from here until [`HeldSource::end`], while nothing it
    /// reads can change. By default, nothing.
    fn begin(&self) {}

    /// The read under the hold ended: nothing read before may be kept. What the source left
    /// for after the hold: the fibers whose frames it merged under the hold with less than
    /// it wanted (what it asks of code the held thread may have been stopped inside, holding
    /// its locks — the symbolizer's, the loader's — it asks there only from what is at hand,
    /// without waiting), each to be merged again once the thread is let go, from what was
    /// read under the hold; dropped unrun when the read is void. By default none.
    fn end(&self) -> Vec<AfterHold> {
        Vec::new()
    }
}

/// Work a [`HeldSource`] left for after the hold: run once the thread is let go, it gives a
/// fiber's layer word and its frames, which replace those given under the hold.
pub type AfterHold = Box<dyn FnOnce() -> (u64, Vec<Frame>) + Send>;

/// The held sources, by scheduler id.
static HELD: Mutex<Vec<(u64, Arc<dyn HeldSource>)>> = Mutex::new(Vec::new());

/// Sets (or with `None` removes) the held source of scheduler `sched`.
pub(crate) fn set_held(sched: u64, source: Option<Arc<dyn HeldSource>>) {
    let mut h = HELD.lock().unwrap_or_else(|e| e.into_inner());
    h.retain(|(id, _)| *id != sched);
    if let Some(src) = source {
        h.push((sched, src));
    }
}

/// The held source of scheduler `sched`, if it has one.
pub(crate) fn held(sched: u64) -> Option<Arc<dyn HeldSource>> {
    HELD.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(id, _)| *id == sched)
        .map(|(_, s)| s.clone())
}

std::thread_local! {
    /// The sources of the schedulers of this thread, by scheduler id.
    static SOURCES: RefCell<Vec<(u64, Rc<dyn FrameSource>)>> = const { RefCell::new(Vec::new()) };
}

/// Schedulers that have a source (on whichever thread): readable from any thread.
static REGISTERED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Whether scheduler `sched` has a source (registered on its own thread).
pub(crate) fn registered(sched: u64) -> bool {
    REGISTERED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&sched)
}

/// Sets (or with `None` removes) the source of scheduler `sched` on this thread.
pub(crate) fn set(sched: u64, source: Option<Rc<dyn FrameSource>>) {
    {
        let mut r = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|&id| id != sched);
        if source.is_some() {
            r.push(sched);
        }
    }
    // (A scheduler dropped while the thread's locals are torn down has nothing left here.)
    let _ = SOURCES.try_with(|s| {
        let mut s = s.borrow_mut();
        s.retain(|(id, _)| *id != sched);
        if let Some(src) = source {
            s.push((sched, src));
        }
    });
}

/// Forgets the sources of scheduler `sched` (it is being dropped, on its thread).
pub(crate) fn forget(sched: u64) {
    set(sched, None);
    set_held(sched, None);
}

/// The source of scheduler `sched`, when it runs on this thread and has one.
pub(crate) fn source(sched: u64) -> Option<Rc<dyn FrameSource>> {
    // (After the thread's locals are gone — a report from an `atexit` handler — there is
    // none.)
    SOURCES
        .try_with(|s| {
            s.try_borrow()
                .ok()?
                .iter()
                .find(|(id, _)| *id == sched)
                .map(|(_, src)| src.clone())
        })
        .ok()
        .flatten()
}
