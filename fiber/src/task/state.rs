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
//! - [`RunCell::inspect`]: the one inspection primitive: every walk of a parked stack happens
//!   while the [`Inspection`] it returns is held (the fiber is then neither resumed nor
//!   freed).
//! - [`RunCell::begin_resume`] (`New`/`Suspended → Running`) and [`RunCell::mark_dead`]
//!   (`→ Dead`, before the stack is freed): the scheduler's thread, each waiting out an
//!   inspection under way (a walk takes well under a microsecond).
//!
//! Two handshakes keep a walk from overlapping a resume, chosen once per process:
//! - *Asymmetric* (Linux, where `membarrier` is allowed, with `FIBERTRACE_MEMBARRIER=1`): the resumer stores `Running`, then,
//!   past a compiler barrier only, reads the count of inspectors announced on the fiber
//!   (`held`), and waits while it is not zero. An inspector on another thread counts itself
//!   in, makes every thread of the process pass a full barrier ([`super::barrier::heavy`]),
//!   then reads the state and walks only if it is `Suspended`. Each side stores before it
//!   loads and the barrier orders both, so either the resumer sees the inspector counted
//!   (and waits for it), or the inspector sees `Running` (and walks nothing). A switch pays
//!   no locked instruction; an inspection from another thread pays a system call (~0.2-5
//!   us, more with more threads running).
//! - *Compare-and-swap* (the default): the inspector
//!   swaps `Suspended → Inspecting`, the resumer swaps out of any state but `Inspecting`.
//!
//! An inspector on the fiber's own thread needs neither: nothing there resumes the fiber
//! while it walks (a signal handler that interrupted the scheduler resumes nothing), so it
//! reads the state and walks if the fiber is parked.
//!
//! So a walk never overlaps a resume and never reads a freed stack: the invariant the
//! inspection layer relies on. A walk that starts right after the fiber published
//! `Suspended` but before it finished switching away is still sound: the frames it reads (the
//! suspend wrapper's and its callers') no longer change; the switch itself only writes below
//! the recorded stack pointer. (The asymmetric handshake rests on the barrier the kernel
//! makes, which Rust's memory model does not describe; the compiler barrier keeps the
//! resumer's store and load in order, and the hardware's ordering does the rest, as in
//! every user of `membarrier`.)

use std::sync::atomic::{compiler_fence, AtomicU8, Ordering};

use super::barrier;

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

/// The handshake this process uses (see the module docs): 0 not chosen yet, 1 asymmetric,
/// 2 compare-and-swap. Chosen once, before the first resume or inspection, and never changed.
static MODE: AtomicU8 = AtomicU8::new(0);

/// Whether the asymmetric handshake is the process's.
#[inline(always)]
fn asymmetric() -> bool {
    match MODE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => choose_mode(),
    }
}

/// Chooses the handshake (the first caller's choice stands for every thread).
#[cold]
pub(crate) fn choose_mode() -> bool {
    let seen = MODE.load(Ordering::Relaxed);
    if seen != 0 {
        return seen == 1;
    }
    let mine = if barrier::available() { 1 } else { 2 };
    match MODE.compare_exchange(0, mine, Ordering::AcqRel, Ordering::Relaxed) {
        Ok(_) => mine == 1,
        Err(other) => other == 1,
    }
}

/// Whether this process's fiber switches pay no locked instruction: the inspection
/// handshake is the asymmetric one, whose cost falls on inspections from other threads (a
/// `membarrier` system call each) instead of on every switch. False where the kernel does
/// not offer `membarrier`, and unless `FIBERTRACE_MEMBARRIER=1` is in the environment (read
/// once, when the first scheduler is made or this is first called).
pub fn switches_unlocked() -> bool {
    asymmetric()
}

/// The run state of one fiber (one atomic byte in its control block), and the inspectors
/// from other threads announced on it.
pub(crate) struct RunCell {
    pub(crate) state: AtomicU8,
    /// Inspectors from other threads counted in (asymmetric handshake): a resume or a death
    /// waits while any is.
    held: AtomicU8,
}
impl std::fmt::Debug for RunCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get(Ordering::Relaxed).fmt(f)
    }
}

impl RunCell {
    /// A new fiber's state.
    pub(crate) const fn new() -> RunCell {
        RunCell {
            state: AtomicU8::new(RunState::New as u8),
            held: AtomicU8::new(0),
        }
    }

    /// Back to `New`, for a control block renewed in place (nothing else holds it).
    pub(crate) fn reset(&mut self) {
        *self.state.get_mut() = RunState::New as u8;
        debug_assert_eq!(*self.held.get_mut(), 0, "a renewed block still inspected");
        *self.held.get_mut() = 0;
    }

    /// The state now (`order`: Acquire to read what the fiber published with it).
    #[inline]
    pub(crate) fn get(&self, order: Ordering) -> RunState {
        RunState::from_u8(self.state.load(order))
    }

    /// `Running → Suspended`, by the fiber itself after recording its registers.
    #[inline(always)]
    pub(crate) fn publish_suspended(&self) {
        self.state
            .store(RunState::Suspended as u8, Ordering::Release);
    }

    /// Holds the fiber parked if it is now: while the returned guard lives, the fiber cannot
    /// be resumed or freed, and what it recorded before suspending is visible (acquire).
    /// `None` if it is in any other state (or, from another thread, when 255 inspections of
    /// it are under way, or the process barrier failed). `same_thread`: the caller runs on
    /// the fiber's scheduler thread (see the module docs).
    #[inline]
    pub(crate) fn inspect(&self, same_thread: bool) -> Option<Inspection<'_>> {
        if same_thread {
            return matches!(
                self.get(Ordering::Acquire),
                RunState::Suspended | RunState::Inspecting
            )
            .then_some(Inspection::Local);
        }
        if asymmetric() {
            // Not parked now: no barrier (an inspector that retries on a fiber that keeps
            // running would otherwise interrupt every CPU of the process at each try).
            if self.get(Ordering::Relaxed) != RunState::Suspended {
                return None;
            }
            self.held
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| h.checked_add(1))
                .ok()?;
            let counted = Inspection::Counted(&self.held);
            if !barrier::heavy() {
                return None;
            }
            return (self.get(Ordering::Acquire) == RunState::Suspended).then_some(counted);
        }
        self.state
            .compare_exchange(
                RunState::Suspended as u8,
                RunState::Inspecting as u8,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .ok()
            .map(|_| Inspection::Swapped(&self.state))
    }

    /// `New`/`Suspended → Running` for a resume, waiting out an inspection. `unlocked`: the
    /// process's handshake is the asymmetric one ([`switches_unlocked`], which the scheduler
    /// keeps at hand).
    #[inline(always)]
    pub(crate) fn begin_resume(&self, unlocked: bool) {
        debug_assert_eq!(unlocked, asymmetric());
        if unlocked {
            let was = self.state.load(Ordering::Relaxed);
            self.state.store(RunState::Running as u8, Ordering::Relaxed);
            // The store above stays before the load below (an inspector's barrier does the
            // rest).
            compiler_fence(Ordering::SeqCst);
            if self.held.load(Ordering::Acquire) != 0 {
                self.resume_after_inspection(was);
            }
        } else {
            self.swap(RunState::Running, Ordering::Acquire);
        }
    }

    /// `→ Dead`, waiting out an inspection: after it, nobody walks the stack again.
    pub(crate) fn mark_dead(&self) {
        if asymmetric() {
            self.state.store(RunState::Dead as u8, Ordering::Release);
            self.wait_uncounted();
        } else {
            self.swap(RunState::Dead, Ordering::AcqRel);
        }
    }

    /// An inspector was counted in when the resumer stored `Running`. The fiber has not run
    /// since: it is parked as it was, and says so again (`was`: `Suspended`, its registers
    /// as recorded, or `New`), so that the inspector, which reads the state after its
    /// barrier, walks it instead of finding it running — a fiber parked for less than the
    /// barrier takes would otherwise never be walked from another thread. Then the resume
    /// waits for the inspectors and tries again.
    #[cold]
    #[inline(never)]
    fn resume_after_inspection(&self, was: u8) {
        loop {
            self.state.store(was, Ordering::Release);
            let mut spins = 0u32;
            while self.held.load(Ordering::Acquire) != 0 {
                back_off(&mut spins);
            }
            self.state.store(RunState::Running as u8, Ordering::Relaxed);
            compiler_fence(Ordering::SeqCst);
            if self.held.load(Ordering::Acquire) == 0 {
                return;
            }
        }
    }

    /// After the resumer's store: waits while an inspector is counted in (the asymmetric
    /// handshake; acquire: its reads of the stack come before what the fiber writes next).
    #[inline(always)]
    fn wait_uncounted(&self) {
        // The store above stays before the load below (an inspector's barrier does the rest).
        compiler_fence(Ordering::SeqCst);
        if self.held.load(Ordering::Acquire) != 0 {
            self.wait_uncounted_slow();
        }
    }

    /// An inspector is counted in: waits until it is done (a walk takes well under a
    /// microsecond). (A child process made by `fork` while an inspector of the parent was
    /// counted in on this fiber would wait for ever, as a fiber being walked at the fork
    /// waited for ever under the compare-and-swap handshake: the window is the walk and one
    /// system call.)
    #[cold]
    #[inline(never)]
    fn wait_uncounted_slow(&self) {
        let mut spins = 0u32;
        while self.held.load(Ordering::Acquire) != 0 {
            back_off(&mut spins);
        }
    }

    fn swap(&self, to: RunState, success: Ordering) {
        let mut spins = 0u32;
        loop {
            let cur = self.state.load(Ordering::Relaxed);
            if cur == RunState::Inspecting as u8 {
                back_off(&mut spins);
                continue;
            }
            if self
                .state
                .compare_exchange_weak(cur, to as u8, success, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// One wait of a resumer for an inspection to end. The inspector may be off its CPU (in
/// its system call, or preempted, on a machine with more threads than CPUs): after a short
/// spin, the CPU is given up.
#[inline]
fn back_off(spins: &mut u32) {
    if *spins < 64 {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// An inspection under way (see [`RunCell::inspect`]): dropping it ends the inspection.
pub(crate) enum Inspection<'a> {
    /// On the fiber's own thread: nothing to undo.
    Local,
    /// Counted in (asymmetric handshake).
    Counted(&'a AtomicU8),
    /// `Inspecting` swapped in (compare-and-swap handshake).
    Swapped(&'a AtomicU8),
}

impl Drop for Inspection<'_> {
    #[inline]
    fn drop(&mut self) {
        match self {
            Inspection::Local => {}
            Inspection::Counted(held) => {
                held.fetch_sub(1, Ordering::Release);
            }
            Inspection::Swapped(state) => state.store(RunState::Suspended as u8, Ordering::Release),
        }
    }
}

thread_local! {
    /// A byte per thread, whose address tells the thread (see [`thread_mark`]).
    static MARK: u8 = const { 0 };
}

/// A number unique to this thread among the threads alive (the address of a thread-local):
/// a control block keeps its scheduler thread's, so that an inspector can tell whether it
/// runs there. (An address is reused only by a thread started after this one exited, whose
/// scheduler's fibers were marked dead or are never resumed again.)
#[inline]
pub(crate) fn thread_mark() -> usize {
    MARK.with(|m| m as *const u8 as usize)
}
