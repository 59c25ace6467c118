//! Handles to fibers: [`Fiber`] (id, name, wake-up, cancel, wait) and [`JoinHandle`] (its
//! result).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::names::{cut_name, name_from_bytes, name_to_bytes};
use super::run::wake;
use super::{block, current_ctx, current_id, with_sched, FiberCore, ON_THREAD};
use crate::task::{
    ControlBlock, FiberId, PanicReport, ParentTrace, Status, WaitOn, OUTCOME_CANCELLED, OUTCOME_OK,
    OUTCOME_PANICKED,
};

/// A fiber handle without its result type: id, name, wakeup, cancel, backtrace.
#[derive(Clone, Debug)]
pub struct Fiber {
    pub(crate) shared: Arc<ControlBlock>,
}

impl Fiber {
    /// A handle from a control block (as found in the registry).
    pub fn from_shared(shared: Arc<ControlBlock>) -> Fiber {
        Fiber { shared }
    }

    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        self.shared.id
    }

    /// The fiber's name.
    pub fn name(&self) -> String {
        self.shared.name()
    }

    /// Renames the fiber (cut to [`NAME_MAX`](crate::NAME_MAX) bytes).
    pub fn set_name(&self, name: &str) {
        self.shared.set_name_arc(Arc::from(cut_name(name)));
    }

    /// Renames the fiber with any bytes, kept exactly up to [`NAME_MAX`](crate::NAME_MAX) (see
    /// [`name_from_bytes`]).
    pub fn set_name_bytes(&self, name: &[u8]) {
        self.set_name(&name_from_bytes(name));
    }

    /// The fiber's name as the bytes it was given (see [`name_from_bytes`]).
    pub fn name_bytes(&self) -> Vec<u8> {
        name_to_bytes(&self.shared.name_arc()).into_owned()
    }

    /// Attaches a word of the layer above the runtime to the fiber (a Lua host: the fiber's
    /// Lua thread), which that layer's signal handler reads for the fiber it interrupted
    /// ([`crate::sample::interrupted_layer_word`]). 0 (the default) means none.
    pub fn set_layer_word(&self, word: u64) {
        self.shared
            .layer_word
            .store(word, std::sync::atomic::Ordering::Release);
    }

    /// The word set by [`Fiber::set_layer_word`] (0: none).
    pub fn layer_word(&self) -> u64 {
        self.shared
            .layer_word
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Its status.
    pub fn status(&self) -> Status {
        self.shared.state()
    }

    /// Makes a blocked fiber ready (interrupts a sleep or a wait; the waiter re-checks its
    /// condition). The running fiber's own wake-up makes its next sleep or wait end at once
    /// (Tarantool's: the fiber goes to the ready list). Must be called on the fiber's own
    /// scheduler thread; elsewhere it is a no-op. Returns whether the fiber was there to
    /// wake: false from another thread, and for a fiber that ended (or whose scheduler was
    /// dropped).
    pub fn wakeup(&self) -> bool {
        self.wake_here() == Some(true)
    }

    /// [`Fiber::wakeup`]: `None` off the fiber's scheduler thread, else whether it was there.
    fn wake_here(&self) -> Option<bool> {
        let known = ON_THREAD.with(|t| t.borrow().iter().any(|(id, _)| *id == self.shared.sched));
        if !known {
            return None;
        }
        if self.shared.id == current_id()
            && with_sched(|s| s.shared.id == self.shared.sched && s.wake_running(self.shared.id))
                == Some(true)
        {
            return Some(true);
        }
        Some(wake(self.shared.sched, self.shared.id))
    }

    /// Cancels the fiber: at its next suspension point (or right away if it is blocked) it
    /// unwinds, running its destructors; its join returns [`JoinError::Cancelled`]. From any
    /// thread: from another than its scheduler's, a blocked fiber is woken at that
    /// scheduler's next turn (an idle scheduler is woken for it). A scheduler whose fibers
    /// all wait with no timer pending ends its run at once with
    /// [`RunError::Deadlock`](crate::RunError::Deadlock): a
    /// cancel from another thread that comes later finds it ended (keep a timer, a sleeping
    /// fiber, while another thread may cancel).
    pub fn cancel(&self) {
        self.shared.cancelled.store(true, Ordering::Relaxed);
        if self.shared.id == current_id() || self.wake_here().is_some() {
            return;
        }
        // Not this thread's scheduler (or none): asked of its own thread. (Only the flag was
        // set before: a fiber sleeping for 5 s unwound after 5 s, one blocked for ever never.)
        if let Some(s) = crate::registry::scheduler(self.shared.sched) {
            s.on_thread
                .cancels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.shared.id);
            s.on_thread.asked.store(true, Ordering::Release);
            if let Some(t) = s.on_thread.handle.get() {
                t.unpark();
            }
        }
    }

    /// The trace of the fiber that created it, with the creator's ancestors chained.
    pub fn parent_trace(&self) -> Option<&ParentTrace> {
        self.shared.parent_trace.as_ref()
    }

    /// Id of the fiber that created it.
    pub fn parent(&self) -> Option<FiberId> {
        self.shared.parent
    }

    /// Its control block: what any thread may read about it (status, counters, stack use).
    pub fn control_block(&self) -> &Arc<ControlBlock> {
        &self.shared
    }

    /// Waits (from inside a fiber of the same scheduler) until the fiber has finished.
    ///
    /// # Panics
    /// When called outside a fiber, from a fiber of another scheduler, or by the fiber on
    /// itself.
    #[inline(never)]
    pub fn wait(&self) {
        self.wait_until(None);
    }

    /// Waits as [`Fiber::wait`], at most until `deadline`; returns whether the fiber has
    /// finished. Several fibers may wait for one; they are woken in the order they began to
    /// wait. A waiter that gives up (deadline, cancellation) is no longer counted as one.
    ///
    /// # Panics
    /// As [`Fiber::wait`].
    #[inline(never)]
    pub fn wait_until(&self, deadline: Option<Instant>) -> bool {
        let r = self.wait_inner(deadline);
        std::hint::black_box(());
        r
    }

    /// As [`Fiber::wait_until`], but a cancellation of the waiting fiber does not end the
    /// wait (Tarantool's `fiber_join`): it is raised at the waiter's next suspension after
    /// the wait.
    ///
    /// # Panics
    /// As [`Fiber::wait`].
    #[inline(never)]
    pub fn wait_until_ignoring_cancel(&self, deadline: Option<Instant>) -> bool {
        let _quiet = CancelQuiet::new();
        let r = self.wait_inner(deadline);
        std::hint::black_box(());
        r
    }

    fn wait_inner(&self, deadline: Option<Instant>) -> bool {
        let me = current_id();
        let shared = &self.shared;
        assert!(me != 0, "join outside a fiber");
        assert!(me != shared.id, "a fiber cannot join itself");
        // (A fiber of another scheduler is not in this one's slots: the wait below would end
        // at once, and a join would report a cancellation that never was.)
        let here = with_sched(|s| s.shared.id).unwrap_or(0);
        assert!(
            here == shared.sched,
            "join of fiber {} of scheduler {} from a fiber of scheduler {here}: a fiber is \
             joined from its own scheduler",
            shared.id,
            shared.sched
        );
        /// Leaves the fiber's joiners however the wait ends.
        struct Leave(FiberId, FiberId);
        impl Drop for Leave {
            fn drop(&mut self) {
                with_sched(|s| {
                    if let Ok(mut slots) = s.slots.try_borrow_mut() {
                        if let Some(slot) = slots.get_mut(&self.0) {
                            slot.joiners.retain(|&j| j != self.1);
                        }
                    }
                });
            }
        }
        let _leave = Leave(shared.id, me);
        while !shared.is_dead() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            let registered = with_sched(|s| {
                if let Some(slot) = s.slots.borrow_mut().get_mut(&shared.id) {
                    if !slot.joiners.contains(&me) {
                        slot.joiners.push(me);
                    }
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
            if !registered {
                break;
            }
            if block(WaitOn::Join(shared.id), deadline) {
                super::raise_cancel();
            }
        }
        true
    }
}

/// While it lives, the current fiber's suspensions do not raise its cancellation (for code
/// that is no cancellation point in Tarantool: `fiber_join`, `fiber.create`'s start of the
/// new fiber); dropped, they raise it again, at the next one. Outside a fiber it does
/// nothing.
pub struct CancelQuiet(Option<(&'static FiberCore, bool)>);

impl CancelQuiet {
    /// Quiets the current fiber's cancellation until dropped.
    pub fn new() -> CancelQuiet {
        // `unwinding` set: suspensions do not raise the cancellation (as while it unwinds).
        CancelQuiet(current_ctx().map(|c| (c, c.unwinding.replace(true))))
    }
}

impl Default for CancelQuiet {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CancelQuiet {
    fn drop(&mut self) {
        // Not while its scheduler drops the fiber: that unwinding must not raise again.
        if let Some((c, prev)) = self.0 {
            if !c.dropping.get() {
                c.unwinding.set(prev);
            }
        }
    }
}

/// Why a join got no value.
#[derive(Debug, Clone)]
pub enum JoinError {
    /// The fiber panicked.
    Panicked(Box<PanicReport>),
    /// The fiber was cancelled.
    Cancelled,
}

impl std::fmt::Display for JoinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JoinError::Panicked(p) => write!(f, "fiber panicked: {}", p.message),
            JoinError::Cancelled => f.write_str("fiber was cancelled"),
        }
    }
}

impl std::error::Error for JoinError {}

pub(super) type ResultSlot<T> = Rc<RefCell<Option<Result<T, JoinError>>>>;

/// Whether a fiber's result needs a slot: a zero-sized value without a destructor (`()`, as
/// most fibers return) carries nothing but its outcome, which the control block records —
/// one allocation less per spawn.
pub(super) const fn needs_slot<T>() -> bool {
    std::mem::size_of::<T>() != 0 || std::mem::needs_drop::<T>()
}

/// The handle returned by spawn: join the fiber for its result.
pub struct JoinHandle<T> {
    pub(super) fiber: Fiber,
    /// `None` when the result needs no slot (see `needs_slot`).
    pub(super) result: Option<ResultSlot<T>>,
}

impl<T> JoinHandle<T> {
    /// The fiber.
    pub fn fiber(&self) -> &Fiber {
        &self.fiber
    }

    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        self.fiber.shared.id
    }

    /// Waits (from inside a fiber) for the fiber to finish and returns its result.
    ///
    /// # Panics
    /// When called outside a fiber, from a fiber of another scheduler, or by the fiber on
    /// itself.
    #[inline(never)]
    pub fn join(self) -> Result<T, JoinError> {
        self.fiber.wait();
        self.take_result().unwrap_or(Err(JoinError::Cancelled))
    }

    /// Gives up the result and keeps the fiber (for a host that tracks fibers by handle and
    /// learns their outcome its own way; wait for the end with [`Fiber::wait`]).
    pub fn into_fiber(self) -> Fiber {
        self.fiber
    }

    /// The result, once (`join` and `block_on` consume the handle).
    pub(super) fn take_result(&self) -> Option<Result<T, JoinError>> {
        if let Some(slot) = &self.result {
            return slot.borrow_mut().take();
        }
        let shared = &self.fiber.shared;
        match shared.outcome.load(Ordering::Acquire) {
            // SAFETY: T is zero-sized with no destructor (`needs_slot`): the fiber's body
            // forgot the value it returned, and this read makes the one value handed back
            // (a zero-sized read from an aligned non-null pointer is valid).
            OUTCOME_OK => Some(Ok(unsafe {
                std::ptr::NonNull::<T>::dangling().as_ptr().read()
            })),
            OUTCOME_CANCELLED => Some(Err(JoinError::Cancelled)),
            OUTCOME_PANICKED => {
                let report = shared
                    .panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                Some(Err(report.map_or(JoinError::Cancelled, JoinError::Panicked)))
            }
            _ => None,
        }
    }

    /// Whether the fiber has finished.
    pub fn is_finished(&self) -> bool {
        self.fiber.shared.is_dead()
    }
}

impl ParentTrace {
    /// A parent trace made by hand (a Lua host passes the creator's interleaved frames).
    /// At most [`crate::task::PARENT_FRAMES`] frames are kept (the middle is omitted when
    /// longer).
    pub fn new(creator: Option<&Fiber>, frames: &[fibertrace_core::Frame]) -> ParentTrace {
        let creator = creator.map(|c| c.control_block().clone());
        let thread_name = creator
            .is_none()
            .then(|| Arc::from(std::thread::current().name().unwrap_or("thread")));
        Self::from_parts(creator, thread_name, frames)
    }
}
