//! Sampling the fiber a scheduler is running right now, from another thread: a signal to the
//! scheduler's thread, a walk of the interrupted context inside the handler, the result read
//! back by the requester. This is how a dump shows a fiber that spins and never yields.
//!
//! In the handler: no lock, no allocation, no symbolization — one bounded walk (DWARF through
//! code without frame pointers, with a cache allocated beforehand) into a preallocated slot,
//! then a sequence number bump. The handler runs on an alternate signal stack, so a fiber
//! with a small stack cannot overflow it. It writes only when a sample was requested, so a
//! stray signal cannot tear a sample being read.
//!
//! The same signal can hold the thread still afterwards (`hold`): the handler then waits,
//! napping, until the holder lets it go or a few seconds passed, while another thread reads
//! what the held thread would change (a report's late path, see [`super::HeldSource`]).
//!
//! The signal is SIGURG by default (ignored by default if our handler were ever missing,
//! and not SIGPROF, which profilers use); [`set_signal`] changes it before first use.
//!
//! A fiber is named only while its own code runs: caught in the switch to or from it, or
//! while the runtime starts it (before its entry stack pointer is set, the last step before
//! its code is called) or finishes it (a stack pointer at or above that entry), the sample
//! names no fiber, as between fibers. Caught at the very entry of its code or just past its
//! return, its trace is the runtime's trampoline alone (which reports leave out).
//!
//! How a sample can be wrong: the scheduler may switch fibers between the request and the
//! signal (the sample then names the fiber it caught); an interrupt inside a prologue can lose
//! one caller with the frame-pointer unwinder (the first step is DWARF to avoid it).

use std::cell::Cell;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use fibertrace_core::unwind::DwarfCache;
use fibertrace_core::{Backtrace, CaptureOptions, StackBounds, Unwinder};

use crate::registry::SchedShared;
use crate::task::{FiberId, RunState};

static SIGNAL: AtomicI32 = AtomicI32::new(libc::SIGURG);
static INSTALL: Once = Once::new();

/// Chooses the sampling signal (before any scheduler runs). Returns false if the handler is
/// already installed on another signal.
pub fn set_signal(sig: i32) -> bool {
    if INSTALL.is_completed() {
        return SIGNAL.load(Ordering::Relaxed) == sig;
    }
    SIGNAL.store(sig, Ordering::Relaxed);
    true
}

/// The sampling signal.
pub fn signal() -> i32 {
    SIGNAL.load(Ordering::Relaxed)
}

thread_local! {
    static ALTSTACK: Cell<bool> = const { Cell::new(false) };
}

/// Called on a scheduler's thread when it starts running (the scheduler's `enter_thread`
/// hook): installs the handler once per process, and gives the thread its walk cache and an
/// alternate signal stack, before the scheduler publishes its state to this thread's handlers.
pub(crate) fn prepare_thread(s: &SchedShared) {
    // The sampler's tables are this library's: not tracked by the heap tracker.
    let _untracked = fibertrace_core::heap::pause();
    install();
    fibertrace_core::prepare();
    // SAFETY: only this (the scheduler's) thread touches the cache, and the handler does not
    // sample this scheduler yet: its state is published to the handler after this returns.
    unsafe {
        let c = &mut *s.on_thread.sample.cache.get();
        if c.is_none() {
            *c = Some(Box::new(DwarfCache::new()));
        }
    }
    ensure_altstack();
}

fn ensure_altstack() {
    if ALTSTACK.with(|a| a.get()) {
        return;
    }
    // The DWARF walk keeps its evaluation state on the stack (no allocation): unoptimised
    // builds need well over 64 KiB. A guard page below catches an overflow.
    const SIZE: usize = 512 * 1024;
    const GUARD: usize = 4096;
    // SAFETY: querying and installing an alternate signal stack for this thread; the mapping
    // is never unmapped (one per thread that runs a scheduler) so it outlives any handler.
    unsafe {
        let mut old: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(std::ptr::null(), &mut old) == 0
            && old.ss_flags & libc::SS_DISABLE == 0
            && old.ss_size >= SIZE
        {
            ALTSTACK.with(|a| a.set(true));
            return;
        }
        let mem = libc::mmap(
            std::ptr::null_mut(),
            SIZE + GUARD,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        );
        if mem == libc::MAP_FAILED {
            return;
        }
        libc::mprotect(mem, GUARD, libc::PROT_NONE);
        let st = libc::stack_t {
            ss_sp: (mem as *mut u8).add(GUARD) as *mut libc::c_void,
            ss_flags: 0,
            ss_size: SIZE,
        };
        if libc::sigaltstack(&st, std::ptr::null_mut()) == 0 {
            ALTSTACK.with(|a| a.set(true));
        }
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: installs an SA_SIGINFO handler that only touches async-signal-safe state.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(SIGNAL.load(Ordering::Relaxed), &sa, std::ptr::null_mut());
        }
    });
}

extern "C" fn on_signal(_sig: libc::c_int, _info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    // SAFETY: `uc` is the kernel's ucontext for this handler.
    unsafe { serve(uc) };
}

/// Answers a sample (or hold) request of this thread's scheduler, if one is pending, with
/// the context `uc` as the interrupted one: the sampling handler's body, also called by a
/// handler that stops the thread for good (a crash: [`crate::dump`]'s report), which has
/// the sampling signal blocked and answers the requests of the report's dump itself, with
/// the context of the fault. Async-signal-safe.
///
/// # Safety
/// In a signal handler on this thread: `uc` is the kernel's `ucontext_t` of a signal that
/// interrupted this thread's code.
pub(crate) unsafe fn serve(uc: *mut libc::c_void) {
    let p = crate::running::on_this_thread();
    if p.is_null() {
        return;
    }
    // SAFETY: the pointer names the state of a scheduler that runs on this thread; the
    // registry keeps every SchedShared alive while its Scheduler exists, and the pointer is
    // only used while `requested` is set by a requester that holds an Arc to it.
    let sm = unsafe { &*p };
    let slot = &sm.sample;
    if !slot.requested.swap(false, Ordering::Acquire) {
        return;
    }
    let t0 = crate::clock::ticks();
    let mut fid = sm.running.load(Ordering::Acquire);
    // SAFETY: `out` and `cache` are ours while `requested` was set (see the Sync impl).
    let out = unsafe { &mut *slot.out.get() };
    out.clear();
    // SAFETY: `uc` is the kernel's ucontext for this handler.
    let sp = unsafe { fibertrace_core::capture::registers_from_ucontext(uc) }.sp;
    if fid != 0 && !(sm.lo.load(Ordering::Relaxed)..sm.hi.load(Ordering::Relaxed)).contains(&sp) {
        // The scheduler is switching to or from the fiber: no fiber code is running.
        fid = 0;
    }
    let f = sm.fiber.load(Ordering::Relaxed);
    // Its entry stack pointer (where its own code is called) is set once it started; 0
    // before.
    let stop = if fid == 0 || f.is_null() {
        0
    } else {
        // SAFETY: the fiber runs on this thread (we interrupted it): its block is alive.
        unsafe { (*f).entry_sp.load(Ordering::Relaxed) }
    };
    if !f.is_null() && (stop == 0 || sp >= stop) {
        // The runtime is starting the fiber (its code not called yet) or finishing it (its
        // code returned): nothing of the fiber's own is on its stack, as in a switch.
        fid = 0;
    }
    if fid != 0 {
        // The running fiber's stack, from its low end to just below corosensei's link.
        let stacks = [StackBounds::new(
            sm.lo.load(Ordering::Relaxed),
            sm.hi.load(Ordering::Relaxed),
        )];
        let opts = CaptureOptions::with_unwinder(Unwinder::Auto);
        // SAFETY: as above, the cache is the handler's.
        let cache = unsafe { (*slot.cache.get()).as_deref_mut() };
        // Caught in the middle of switching away (it already published its suspension):
        // its recorded context is the truth, not the switch code's registers.
        let switching = !f.is_null() && {
            // SAFETY: `f` is alive (see above); reading an atomic.
            let run = unsafe { (*f).run.get(Ordering::Relaxed) };
            run == RunState::Suspended
        };
        if switching {
            // SAFETY: we interrupted this fiber on its own thread after it published
            // SUSPENDED; nobody resumes it while we run (the scheduler is this thread).
            let ctx = unsafe { (*f).saved_context_in_handler() };
            let opts = CaptureOptions {
                unwinder: Unwinder::Fast,
                offset: 1,
                ..CaptureOptions::default()
            };
            fibertrace_core::capture::collect_from_in_handler(&ctx, &opts, cache, out);
        } else {
            // SAFETY: `uc` is the kernel's ucontext for this handler; the stack range is the
            // running fiber's stack, mapped while it runs (it cannot be freed while running).
            unsafe { fibertrace_core::collect_from_ucontext(uc, &stacks, stop, &opts, cache, out) };
            if out.len() <= 1 && !f.is_null() {
                // Caught inside the switch code right after a resume (its frame pointer is
                // not restored yet): nothing of the fiber has changed since its suspension,
                // so the recorded context tells where it is.
                // SAFETY: the fiber runs on this thread and we interrupted it: nothing writes
                // its context now.
                let ctx = unsafe { (*f).saved_context_in_handler() };
                // Only right at the suspension point: the stack pointer within a few words
                // of the recorded one (the switch code's own pushes).
                if ctx.is_recorded() && sp.abs_diff(ctx.regs.sp) <= 256 {
                    let opts = CaptureOptions {
                        unwinder: Unwinder::Fast,
                        offset: 1,
                        ..CaptureOptions::default()
                    };
                    // SAFETY: as above, the cache is the handler's.
                    let cache = unsafe { (*slot.cache.get()).as_deref_mut() };
                    fibertrace_core::capture::collect_from_in_handler(&ctx, &opts, cache, out);
                }
            }
        }
    }
    slot.fid.store(fid, Ordering::Relaxed);
    slot.resumes
        .store(sm.resumes.load(Ordering::Relaxed), Ordering::Relaxed);
    slot.handler_ns
        .store(crate::clock::ticks().wrapping_sub(t0), Ordering::Relaxed);
    // (Asked only with this request: the requester clears it when it withdraws one.)
    let hold = slot.hold_wanted.swap(false, Ordering::AcqRel);
    if hold {
        for (n, r) in slot.regs.iter().enumerate() {
            // SAFETY: `uc` is the kernel's ucontext for this handler.
            let v = unsafe { fibertrace_core::capture::register_from_ucontext(uc, n as u16) };
            r.store(v.unwrap_or(0), Ordering::Relaxed);
        }
        slot.release.store(false, Ordering::Relaxed);
        slot.holding.store(true, Ordering::Relaxed);
    }
    slot.seq.fetch_add(1, Ordering::Release);
    if hold {
        hold_here(slot);
    }
}

/// The monotonic clock, read in a signal handler (`clock_gettime`: async-signal-safe).
pub(crate) fn monotonic() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the monotonic time into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Longest a handler holds its thread ([`hold`]): past it the thread goes on, whatever the
/// holder does (a holder that never lets go cannot stop the thread for good).
const HOLD_MAX: Duration = Duration::from_secs(5);

/// In the handler: waits until the holder lets the thread go, or [`HOLD_MAX`] passed.
/// Async-signal-safe (atomics, `clock_gettime`, `nanosleep`); the interrupted code's `errno`
/// is kept.
fn hold_here(slot: &crate::running::SampleSlot) {
    // SAFETY: this thread's errno location, read and written back by this thread only.
    let errno = unsafe { *libc::__errno_location() };
    let now = monotonic;
    let t0 = now();
    while !slot.release.load(Ordering::Acquire) && now().saturating_sub(t0) < HOLD_MAX {
        let nap = libc::timespec {
            tv_sec: 0,
            tv_nsec: 50_000,
        };
        // SAFETY: sleeps 50 us (async-signal-safe); an interruption just ends the nap.
        unsafe { libc::nanosleep(&nap, std::ptr::null_mut()) };
    }
    slot.holding.store(false, Ordering::Release);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// In a signal handler on a scheduler's thread: the word the layer above attached to the
/// fiber whose code the signal interrupted ([`crate::Fiber::set_layer_word`]); 0 when no
/// fiber's code was running (the scheduler itself, or switching), or the fiber has none.
/// Async-signal-safe: no lock, no allocation.
///
/// # Safety
/// `uc` is the kernel's `ucontext_t` of the running signal handler.
pub unsafe fn interrupted_layer_word(uc: *mut libc::c_void) -> u64 {
    let p = crate::running::on_this_thread();
    if p.is_null() || uc.is_null() {
        return 0;
    }
    // SAFETY: the pointer names the state of a scheduler that runs on this thread (set while
    // it runs, see `running`); it is alive while the scheduler is, which it is, since we
    // interrupted this thread inside it.
    let sm = unsafe { &*p };
    // SAFETY: `uc` is the kernel's ucontext for this handler (the contract).
    let sp = unsafe { fibertrace_core::capture::registers_from_ucontext(uc) }.sp;
    let f = sm.fiber.load(Ordering::Relaxed);
    if sm.running.load(Ordering::Acquire) == 0
        || f.is_null()
        || !(sm.lo.load(Ordering::Relaxed)..sm.hi.load(Ordering::Relaxed)).contains(&sp)
    {
        return 0;
    }
    // SAFETY: the interrupted code runs on the running fiber's stack (checked above): that
    // fiber runs on this thread, so its block is alive until the handler returns.
    unsafe { (*f).layer_word.load(Ordering::Acquire) }
}

/// A sample of a running fiber.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The fiber that was running (0: the scheduler was between fibers).
    pub fiber: FiberId,
    /// The scheduler's resume count at the interrupt: which run of that fiber was caught (a
    /// fiber that yielded and was resumed again has the same id but a later count).
    pub resumes: u64,
    /// Its stack at the interrupt, cut at its entry.
    pub backtrace: Backtrace,
    /// Time from the request to the sample being readable.
    pub latency: Duration,
    /// Time the walk took inside the handler.
    pub handler_time: Duration,
}

/// Samples what `s` runs now. `None` if the scheduler has no thread, or the signal was not
/// handled within `timeout` (the thread may be blocked with the signal masked).
pub fn sample(s: &SchedShared, timeout: Duration) -> Option<Sample> {
    sample_with(s, timeout, false).map(|(sample, _)| sample)
}

/// Scheduler `s`'s thread held still inside the sampling handler, from another thread, with
/// the sample taken there: while the `Hold` lives (at most [`HOLD_MAX`]) that thread runs
/// nothing, so what it would change (a Lua state, the suspended fibers' stacks) can be read
/// from here. Dropped, it lets the thread go. `None` as for [`sample`]. What is read under
/// a hold counts only if [`Hold::still_held`] says so after the read.
///
/// The held thread may hold a lock (the allocator's, another library's): whatever the
/// holder does under the hold must not wait for one the held thread could hold, past the
/// hold's own bound.
pub(crate) fn hold(s: &SchedShared, timeout: Duration) -> Option<Hold<'_>> {
    let (sample, guard) = sample_with(s, timeout, true)?;
    let slot = &s.on_thread.sample;
    if !slot.holding.load(Ordering::Acquire) {
        return None;
    }
    Some(Hold {
        slot,
        _one: guard,
        sample,
    })
}

/// A scheduler's thread held by [`hold`].
pub(crate) struct Hold<'a> {
    slot: &'a crate::running::SampleSlot,
    /// No other sample is asked of the thread meanwhile.
    _one: std::sync::MutexGuard<'a, ()>,
    /// Its sample, taken as it was stopped.
    pub sample: Sample,
}

impl Hold<'_> {
    /// Whether the thread is still held (its handler's time was not up).
    pub fn still_held(&self) -> bool {
        self.slot.holding.load(Ordering::Acquire)
    }

    /// DWARF register `n` (0 to 16) where the held thread was stopped.
    pub fn register(&self, n: u16) -> Option<u64> {
        let r = self.slot.regs.get(n as usize)?;
        Some(r.load(Ordering::Relaxed))
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.slot.release.store(true, Ordering::Release);
        // The handler sees it within its nap (50 us): the next sample asked of the thread
        // finds it out of the handler.
        let t0 = Instant::now();
        while self.slot.holding.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(1) {
            std::thread::yield_now();
        }
    }
}

/// [`sample`], holding the thread in the handler afterwards when `hold` (then the lock on
/// the thread's samples is given back with the sample, to keep while it is held).
fn sample_with(
    s: &SchedShared,
    timeout: Duration,
    hold: bool,
) -> Option<(Sample, std::sync::MutexGuard<'_, ()>)> {
    let sm = &s.on_thread;
    let slot = &sm.sample;
    let tid = sm.tid.load(Ordering::Relaxed);
    if tid == 0 {
        return None;
    }
    let guard = slot.lock.lock().unwrap_or_else(|e| e.into_inner());
    let before = slot.seq.load(Ordering::Acquire);
    slot.hold_wanted.store(hold, Ordering::Relaxed);
    slot.requested.store(true, Ordering::Release);
    let t0 = Instant::now();
    // (By kernel id: the thread may have exited since, and a scheduler's shared state we
    // hold outlives it. The id is cleared when the scheduler stops running there; one that
    // exited meanwhile is an error here, and the handler of a thread that reused its id
    // finds no request of its own scheduler and returns.)
    if !crate::running::signal_thread(tid, SIGNAL.load(Ordering::Relaxed)) {
        slot.requested.store(false, Ordering::Relaxed);
        slot.hold_wanted.store(false, Ordering::Relaxed);
        return None;
    }
    let mut spins = 0u32;
    while slot.seq.load(Ordering::Acquire) == before {
        if t0.elapsed() > timeout {
            // Withdraw the request; if the handler took it meanwhile, wait for it to finish.
            if slot.requested.swap(false, Ordering::AcqRel) {
                slot.hold_wanted.store(false, Ordering::Relaxed);
                return None;
            }
            // Its walk is short: only a thread stopped inside the handler (a debugger, a
            // stopped process) keeps it — waited for asleep, not spinning (the slot may still
            // be written until it publishes).
            let mut waited = 0u32;
            while slot.seq.load(Ordering::Acquire) == before {
                waited += 1;
                if waited < 2000 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            break;
        }
        spins += 1;
        if spins < 2000 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let latency = t0.elapsed();
    // SAFETY: the handler published the sample (acquire above) and will not write again
    // until another request, which needs the lock we hold.
    let backtrace = unsafe { (*slot.out.get()).clone() };
    let sample = Sample {
        fiber: slot.fid.load(Ordering::Relaxed),
        resumes: slot.resumes.load(Ordering::Relaxed),
        backtrace,
        latency,
        handler_time: crate::clock::to_duration(slot.handler_ns.load(Ordering::Relaxed)),
    };
    Some((sample, guard))
}
