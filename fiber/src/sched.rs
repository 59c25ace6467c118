//! The scheduler (a "cord"): one per OS thread, running its fibers cooperatively.
//!
//! Every suspension goes through one of two `#[inline(never)]` points: [`suspend_current`]
//! (back to the scheduler) and `Inner::run_nested` (running a ready fiber inside the caller's
//! switch, as `fiber.create` does). Each records the fiber's registers (when tracing is on)
//! and publishes `SUSPENDED` before switching away, so that any thread can walk the fiber's
//! stack from its saved context; the switch count goes up before the fiber runs again, so a
//! walk cached at one count is never reused for a later suspension. The
//! stack pointer of the fiber's entry frame (at its call of the user's code) is recorded when
//! it starts; walks end below it, so the scheduler's and corosensei's frames never appear in
//! a fiber's trace — in any build: a stack pointer means the same with or without frame
//! pointers.
//!
//! Traces of the current fiber taken by a report (`dump_text`, `info`, `Fiber::backtrace`,
//! ...) start at the caller of the report's public entry point, whose registers it records
//! (`report_entry!`): the report's own frames never show, whatever the build inlined.
//!
//! How a trace can be wrong: a fiber whose user closure was not inlined into the runtime's
//! trampoline shows the trampoline (`call_user`) as its last raw frame (renderers drop it); a
//! fiber running on another thread is captured by a signal (see [`crate::sample`]) and may
//! have moved on by the time the trace is read.

use std::cell::{Cell, RefCell};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corosensei::{Coroutine, CoroutineResult, Yielder};
use fibertrace_core::{Backtrace, CaptureOptions, Frame, Unwinder};

use crate::control::{
    next_fiber_id, FiberId, FiberShared, NewFiber, PanicReport, ParentInit, ParentTrace, Status,
    WaitOn, DEAD, NEW, OUTCOME_CANCELLED, OUTCOME_OK, OUTCOME_PANICKED, RUNNING, SUSPENDED,
};
use crate::registry::{self, SchedShared, SlabIndex, SlabOwner};
use crate::stack;

/// Fiber ids are sequential: a multiplicative hash spreads them well and costs a few cycles
/// (SipHash cost a fifth of a switch).
type IdHash = BuildHasherDefault<fibertrace_core::symbolize::AddrHasher>;

/// Why a fiber switched back to the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Yield {
    /// Still runnable: put it at the end of the ready queue.
    Ready,
    /// Blocked: something else will make it ready.
    Blocked,
}

type Co = Coroutine<(), Yield, (), HeldStack>;

/// Per-fiber data owned by the scheduler (not shared with other threads).
pub(crate) struct FiberCtx {
    pub shared: Arc<FiberShared>,
    pub yielder: Cell<*const Yielder<(), Yield>>,
    /// Set while the fiber unwinds because it was cancelled (yield points then stop
    /// re-raising).
    pub unwinding: Cell<bool>,
    /// Set while its scheduler drops it (corosensei force-unwinds the stack).
    pub dropping: Cell<bool>,
    /// In the ready queue, or counted as ready (a fiber waiting in a nested start): a
    /// wake-up changes nothing. (Here, not in the slot map, so that a nested start sets it
    /// on the caller's context without a map lookup.)
    queued: Cell<bool>,
}

/// A fiber's slot. Boxed: its address (and its context's, which `CURRENT` and a running
/// fiber's resume hold) stays put while the slot map grows, and the map moves a pointer, not
/// the slot, when a fiber is added or removed. Finished fibers' boxes are reused.
struct Slot {
    ctx: FiberCtx,
    co: Option<Co>,
    timer_seq: u64,
    joiners: Vec<FiberId>,
    /// Where its control block is in the registry.
    reg: SlabIndex,
    /// Its `fiber.top()` figures (kept up to date only while top is on).
    top: TopStat,
}

/// One row of `fiber.top()` as the scheduler keeps it: CPU ticks at the end of the last loop
/// turn, the ticks of that turn, their moving average over turns, and the ticks when top was
/// turned on (its time counts from there).
#[derive(Clone, Copy, Default)]
struct TopStat {
    last: u64,
    prev: u64,
    acc: f64,
    base: u64,
}

impl TopStat {
    /// Closes a turn in which the row ran `delta` ticks (Tarantool's moving average: a
    /// sixteenth of the new turn, fifteen sixteenths of the old average).
    fn close_turn(&mut self, delta: u64) {
        self.acc = delta as f64 / 16.0 + self.acc * 15.0 / 16.0;
        self.prev = delta;
    }
}

/// A row of [`top`]: shares of the scheduler's time (percent) and the CPU time counted since
/// top was turned on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TopRow {
    /// Moving average over loop turns of the share of each turn it ran, in percent.
    pub average: f64,
    /// Its share of the last loop turn, in percent.
    pub instant: f64,
    /// Time it ran since top was turned on.
    pub time: Duration,
}

/// Options of a scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerOptions {
    /// Record the registers at every suspension, so that suspended fibers can be walked.
    pub traced: bool,
    /// Capture the creator's trace when a fiber is spawned.
    pub parent_traces: bool,
    /// Default stack size of new fibers.
    pub stack_size: usize,
    /// Print a report (message and backtrace) to stderr when a fiber panics.
    pub report_panics: bool,
    /// Scheduler name shown in dumps.
    pub name: String,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            traced: true,
            parent_traces: true,
            stack_size: 256 * 1024,
            report_panics: true,
            name: std::thread::current().name().unwrap_or("cord").to_string(),
        }
    }
}

pub(crate) struct Inner {
    pub shared: Arc<SchedShared>,
    opts: RefCell<SchedulerOptions>,
    slots: RefCell<HashMap<FiberId, Box<Slot>, IdHash>>,
    /// The writing side of this scheduler's registry slab (`shared.fibers`).
    reg: RefCell<SlabOwner>,
    /// Clock ticks at the last accounting point: the end of a fiber's run (or of an idle
    /// wait) or the start of a nested one. One counter read per switch serves both the
    /// finished share's CPU time and the next run's start time.
    last_tick: Cell<u64>,
    ready: RefCell<VecDeque<FiberId>>,
    timers: RefCell<BinaryHeap<std::cmp::Reverse<(Instant, u64, FiberId)>>>,
    next_seq: Cell<u64>,
    current: Cell<FiberId>,
    pool: RefCell<stack::Pool>,
    /// Boxes of finished fibers' slots, reused by the next spawns (one allocation and free
    /// less per fiber). A box keeps its last fiber's control block alive until reused.
    // The boxes themselves are what is reused: they move between the slot map and this pool.
    #[allow(clippy::vec_box)]
    free_slots: RefCell<Vec<Box<Slot>>>,
    /// Loop turns so far: a turn runs the fibers that were ready when it began (those made
    /// ready meanwhile run in the next one), as one iteration of Tarantool's event loop.
    turn: Cell<u64>,
    /// Fibers of the current turn not run yet.
    turn_left: Cell<usize>,
    /// `fiber.top()`: whether on, the clock ticks when the current turn began, and the
    /// scheduler's own row (the time of a turn no fiber ran, waiting included) and the
    /// whole turn's (the sum of every row).
    top_on: Cell<bool>,
    turn_start: Cell<u64>,
    top_sched: Cell<TopStat>,
    top_total: Cell<TopStat>,
}

/// Most slot boxes kept for reuse.
const SLOT_POOL_MAX: usize = 64;

thread_local! {
    /// Schedulers created on this thread, to wake their fibers from outside `run`.
    static ON_THREAD: RefCell<Vec<(u64, std::rc::Weak<Inner>)>> = const { RefCell::new(Vec::new()) };
    static SCHED: Cell<*const Inner> = const { Cell::new(std::ptr::null()) };
    static CURRENT: Cell<*const FiberCtx> = const { Cell::new(std::ptr::null()) };
}

/// A scheduler: create it on a thread, spawn fibers, and run it there.
pub struct Scheduler {
    inner: Rc<Inner>,
}

impl Default for Scheduler {
    fn default() -> Self {
        Self::new()
    }
}

/// Errors of running a scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunError {
    /// Every remaining fiber waits on something only another fiber could give, and no timer
    /// is pending: nothing can ever run again.
    Deadlock {
        /// The fibers left waiting.
        fibers: Vec<FiberId>,
    },
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Deadlock { fibers } => write!(
                f,
                "all fibers are asleep — deadlock ({} fibers waiting)",
                fibers.len()
            ),
        }
    }
}

impl std::error::Error for RunError {}

impl Scheduler {
    /// A scheduler with default options.
    pub fn new() -> Scheduler {
        Self::with_options(SchedulerOptions::default())
    }

    /// A scheduler with the given options.
    pub fn with_options(opts: SchedulerOptions) -> Scheduler {
        crate::panic::install_hook();
        crate::clock::init();
        let shared = registry::register(opts.name.clone());
        let sched = Scheduler {
            inner: Rc::new(Inner {
                shared,
                opts: RefCell::new(opts),
                slots: RefCell::new(HashMap::default()),
                reg: RefCell::new(SlabOwner::default()),
                last_tick: Cell::new(crate::clock::ticks()),
                ready: RefCell::new(VecDeque::new()),
                timers: RefCell::new(BinaryHeap::new()),
                next_seq: Cell::new(1),
                current: Cell::new(0),
                pool: RefCell::new(stack::Pool::new()),
                free_slots: RefCell::new(Vec::new()),
                turn: Cell::new(1),
                turn_left: Cell::new(0),
                top_on: Cell::new(false),
                turn_start: Cell::new(0),
                top_sched: Cell::new(TopStat::default()),
                top_total: Cell::new(TopStat::default()),
            }),
        };
        ON_THREAD.with(|t| {
            let mut t = t.borrow_mut();
            t.retain(|(_, w)| w.strong_count() > 0);
            t.push((sched.inner.shared.id, Rc::downgrade(&sched.inner)));
        });
        sched
    }

    /// This scheduler's id (as shown in dumps).
    pub fn id(&self) -> u64 {
        self.inner.shared.id
    }

    /// Turns parent-trace capture on or off for fibers spawned from now on.
    pub fn set_parent_traces(&self, on: bool) {
        self.inner.opts.borrow_mut().parent_traces = on;
    }

    /// Whether parent traces are captured.
    pub fn parent_traces(&self) -> bool {
        self.inner.opts.borrow().parent_traces
    }

    /// Timer entries held (live and stale): bounded by twice the number of fibers, whatever
    /// happened to the fibers that set them. For tests.
    #[doc(hidden)]
    pub fn timer_entries(&self) -> usize {
        self.inner.timers.borrow().len()
    }

    /// Spawns a fiber (it runs when the scheduler runs).
    #[inline(never)]
    pub fn spawn<F, T>(&self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(Builder::new().spawn_on(&self.inner, f, 3)).unwrap_or_else(|e| spawn_failed(e))
    }

    /// Spawns a fiber, or says why it cannot: its stack cannot be mapped (out of memory, the
    /// address-space limit) or the process has as many fiber stacks as `vm.max_map_count`
    /// allows (see [`SpawnError`]). Nothing is left behind by a failure; `f` is dropped.
    #[inline(never)]
    pub fn try_spawn<F, T>(&self, f: F) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(Builder::new().spawn_on(&self.inner, f, 3))
    }

    /// A builder for a fiber with a name or stack size.
    pub fn builder(&self) -> SchedBuilder<'_> {
        SchedBuilder {
            sched: self,
            b: Builder::new(),
        }
    }

    /// Runs fibers until none is left. Returns an error (and leaves the waiting fibers in
    /// place) on a deadlock.
    pub fn run(&self) -> Result<(), RunError> {
        let _enter = Enter::new(&self.inner);
        self.inner.run_loop(|| false)
    }

    /// Spawns `f` as the main fiber and runs until it finishes; returns its result.
    #[inline(never)]
    pub fn block_on<F, T>(&self, f: F) -> Result<T, BlockOnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        let h = Builder::new()
            .name("main")
            .spawn_on(&self.inner, f, 3)
            .map_err(BlockOnError::Spawn)?;
        let _enter = Enter::new(&self.inner);
        let done = h.fiber.shared.clone();
        if let Err(e) = self.inner.run_loop(|| done.is_dead()) {
            return Err(BlockOnError::Run(e));
        }
        match h.take_result() {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(BlockOnError::Join(e)),
            None => Err(BlockOnError::Join(JoinError::Cancelled)),
        }
    }

    /// Info about this scheduler's fibers.
    #[inline(never)]
    pub fn info(&self, opts: &crate::info::InfoOptions) -> Vec<crate::info::FiberInfo> {
        report_entry!();
        crate::info::scheduler_info(&self.inner.shared, opts)
    }

    /// Sets (or with `None` removes) the source of frames that a layer above the runtime
    /// adds to this scheduler's fibers (a Lua host: their Lua frames), used by the text
    /// reports built on this scheduler's thread, the deadlock report among them. See
    /// [`crate::inspect`].
    pub fn set_frame_source(&self, source: Option<std::rc::Rc<dyn crate::inspect::FrameSource>>) {
        crate::inspect::set(self.inner.shared.id, source);
    }

    /// The report for a deadlock returned by [`Scheduler::run`]: `all fibers are asleep —
    /// deadlock!` and the dump of this scheduler's fibers (what each waits on, and where).
    pub fn deadlock_report(&self) -> String {
        let mut out = String::from("all fibers are asleep — deadlock!\n\n");
        crate::dump::scheduler_text(&self.inner.shared, &mut out);
        out
    }

    /// Number of live fibers.
    pub fn fiber_count(&self) -> usize {
        self.inner.slots.borrow().len()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Fibers still suspended are dropped: corosensei unwinds their stacks (running their
        // destructors). Mark each dead first, so no inspector walks a stack being freed.
        crate::inspect::set(self.inner.shared.id, None);
        let _enter = Enter::new(&self.inner);
        let slots: Vec<(FiberId, Box<Slot>)> = self.inner.slots.borrow_mut().drain().collect();
        for (_, mut slot) in slots {
            slot.ctx.shared.cancelled.store(true, Ordering::Relaxed);
            if let Some(mut co) = slot.co.take() {
                CURRENT.with(|c| c.set(&slot.ctx));
                slot.ctx.unwinding.set(true);
                slot.ctx.dropping.set(true);
                if co.started() && !co.done() {
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| co.force_unwind()));
                }
                CURRENT.with(|c| c.set(std::ptr::null()));
                slot.ctx.shared.mark_dead();
                drop(co);
            } else {
                slot.ctx.shared.mark_dead();
            }
            slot.ctx.shared.set_status(Status::Dead);
            self.inner.shared.fibers.remove(
                &mut self.inner.reg.borrow_mut(),
                slot.reg,
                slot.ctx.shared.id,
            );
        }
        registry::unregister(&self.inner.shared);
    }
}

/// Errors of [`Scheduler::block_on`].
#[derive(Debug, Clone)]
pub enum BlockOnError {
    /// The scheduler could not go on (deadlock).
    Run(RunError),
    /// The main fiber did not return a value.
    Join(JoinError),
    /// The main fiber could not be made.
    Spawn(SpawnError),
}

impl std::fmt::Display for BlockOnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockOnError::Run(e) => e.fmt(f),
            BlockOnError::Join(e) => e.fmt(f),
            BlockOnError::Spawn(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for BlockOnError {}

/// Makes a scheduler current on this thread while it runs.
struct Enter {
    prev: *const Inner,
}

impl Enter {
    fn new(inner: &Rc<Inner>) -> Enter {
        let prev = SCHED.with(|s| s.replace(Rc::as_ptr(inner)));
        crate::sample::enter_thread(&inner.shared);
        Enter { prev }
    }
}

impl Drop for Enter {
    fn drop(&mut self) {
        SCHED.with(|s| s.set(self.prev));
        if self.prev.is_null() {
            crate::sample::leave_thread();
        } else {
            // SAFETY: `prev` is the scheduler whose fiber entered this one: it runs on this
            // thread, outside us, and outlives this guard.
            crate::sample::restore_thread(unsafe { &(*self.prev).shared });
        }
    }
}

impl Inner {
    fn run_loop(&self, mut done: impl FnMut() -> bool) -> Result<(), RunError> {
        // Time between runs is nobody's: the first fiber's share starts now.
        self.last_tick.set(crate::clock::ticks());
        loop {
            self.fire_timers();
            let next = {
                let mut ready = self.ready.borrow_mut();
                let mut left = self.turn_left.get();
                if left == 0 {
                    // A new turn, of the fibers ready now.
                    left = ready.len();
                    self.turn.set(self.turn.get().wrapping_add(1));
                    if self.top_on.get() {
                        self.close_top_turn();
                    }
                }
                let next = ready.pop_front();
                self.turn_left
                    .set(if next.is_some() { left - 1 } else { 0 });
                next
            };
            if let Some(fid) = next {
                self.resume(fid);
                continue;
            }
            if done() {
                return Ok(());
            }
            let next_deadline = self.next_deadline();
            match next_deadline {
                Some(when) => {
                    let now = Instant::now();
                    if when > now {
                        self.shared.idle.store(true, Ordering::Relaxed);
                        std::thread::park_timeout(when - now);
                        self.shared.idle.store(false, Ordering::Relaxed);
                        self.last_tick.set(crate::clock::ticks());
                    }
                }
                None => {
                    if self.slots.borrow().is_empty() {
                        return Ok(());
                    }
                    let mut fibers: Vec<FiberId> = self.slots.borrow().keys().copied().collect();
                    fibers.sort_unstable();
                    return Err(RunError::Deadlock { fibers });
                }
            }
        }
    }

    /// With top on, closes every row's figures for the turn that ends (as Tarantool does at
    /// each loop iteration).
    #[cold]
    fn close_top_turn(&self) {
        let now = crate::clock::ticks();
        let total = now.wrapping_sub(self.turn_start.get());
        self.turn_start.set(now);
        let mut ran = 0u64;
        for slot in self.slots.borrow_mut().values_mut() {
            let ticks = slot.ctx.shared.cpu_ticks.load(Ordering::Relaxed);
            let delta = ticks.wrapping_sub(slot.top.last);
            slot.top.last = ticks;
            slot.top.close_turn(delta);
            ran = ran.wrapping_add(delta);
        }
        let mut sched = self.top_sched.get();
        let own = total.saturating_sub(ran);
        sched.last = sched.last.wrapping_add(own);
        sched.close_turn(own);
        self.top_sched.set(sched);
        let mut all = self.top_total.get();
        all.close_turn(ran.wrapping_add(own));
        self.top_total.set(all);
    }

    fn top_row(&self, t: &TopStat) -> TopRow {
        let all = self.top_total.get();
        let share = |x: f64, of: f64| if of > 0.0 { x / of * 100.0 } else { 0.0 };
        TopRow {
            average: share(t.acc, all.acc),
            instant: share(t.prev as f64, all.prev as f64),
            time: crate::clock::to_duration(t.last.wrapping_sub(t.base)),
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut timers = self.timers.borrow_mut();
        let slots = self.slots.borrow();
        // Drop stale entries (fiber gone or woken early) from the top.
        while let Some(std::cmp::Reverse((_, seq, fid))) = timers.peek() {
            match slots.get(fid) {
                Some(s) if s.timer_seq == *seq => break,
                _ => {
                    timers.pop();
                }
            }
        }
        timers.peek().map(|std::cmp::Reverse((when, _, _))| *when)
    }

    fn fire_timers(&self) {
        if self.timers.borrow().is_empty() {
            return;
        }
        let now = Instant::now();
        loop {
            let top = {
                let timers = self.timers.borrow();
                match timers.peek() {
                    Some(std::cmp::Reverse((when, seq, fid))) if *when <= now => Some((*seq, *fid)),
                    _ => None,
                }
            };
            let Some((seq, fid)) = top else { break };
            self.timers.borrow_mut().pop();
            let due = self
                .slots
                .borrow()
                .get(&fid)
                .is_some_and(|s| s.timer_seq == seq);
            if due {
                self.make_ready(fid);
            }
        }
    }

    pub(crate) fn make_ready(&self, fid: FiberId) {
        self.make_ready_if(fid, false);
    }

    /// Makes `fid` ready, unless `live_only` and it was cancelled (its cancellation woke it
    /// already). Returns whether it is a fiber here that was made (or was) ready.
    fn make_ready_if(&self, fid: FiberId, live_only: bool) -> bool {
        let mut slots = self.slots.borrow_mut();
        let Some(slot) = slots.get_mut(&fid) else {
            return false;
        };
        if live_only && slot.ctx.shared.cancelled.load(Ordering::Relaxed) {
            return false;
        }
        slot.timer_seq = 0;
        if !slot.ctx.queued.get() && fid != self.current.get() {
            slot.ctx.queued.set(true);
            slot.ctx.shared.set_status(Status::Ready);
            self.ready.borrow_mut().push_back(fid);
        }
        true
    }

    fn add_timer(&self, fid: FiberId, when: Instant) {
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        if let Some(s) = self.slots.borrow_mut().get_mut(&fid) {
            s.timer_seq = seq;
        }
        let mut timers = self.timers.borrow_mut();
        timers.push(std::cmp::Reverse((when, seq, fid)));
        // A fiber woken early (or cancelled, or gone) leaves its timer in the heap until the
        // timer's time comes: a fiber that sleeps an hour and is cancelled at once, a million
        // times, would leave a million. Each fiber has at most one live timer, so past twice
        // the number of fibers the stale ones are dropped (amortized O(1) a timer).
        let slots = self.slots.borrow();
        if timers.len() > 2 * slots.len() + 64 {
            timers.retain(|std::cmp::Reverse((_, seq, fid))| {
                slots.get(fid).is_some_and(|s| s.timer_seq == *seq)
            });
        }
    }

    /// Takes fiber `fid`'s coroutine out of its slot to resume it (`None`: gone, or running).
    fn take_co(&self, fid: FiberId) -> Option<(Co, *const FiberCtx)> {
        let mut slots = self.slots.borrow_mut();
        let slot = slots.get_mut(&fid)?;
        let co = slot.co.take()?;
        slot.ctx.queued.set(false);
        Some((co, &slot.ctx as *const FiberCtx))
    }

    /// Resumes fiber `fid` from the scheduler loop.
    fn resume(&self, fid: FiberId) {
        let Some((co, ctx_ptr)) = self.take_co(fid) else {
            return;
        };
        self.run_co(fid, co, ctx_ptr);
        self.current.set(0);
    }

    /// Runs a fiber's coroutine until it suspends or returns, with the bookkeeping of a
    /// resume (run state, status, switch count, CPU time, sampler), then puts it back in its
    /// slot or, when it returned, frees it. Leaves the sampler showing no fiber running and
    /// `CURRENT` as it found it; `self.current` is the caller's to restore.
    fn run_co(&self, fid: FiberId, mut co: Co, ctx_ptr: *const FiberCtx) {
        // SAFETY: the FiberCtx is boxed in its slot, which lives until the fiber finishes
        // (removed below, after the coroutine returned).
        let ctx = unsafe { &*ctx_ptr };
        let shared = &ctx.shared;
        shared.begin_resume();
        shared.set_status(Status::Running);
        if shared.created_at_start && shared.csw.load(Ordering::Relaxed) == 0 {
            // Its first run starts at the last accounting point (a nested start reads the
            // clock just before): that is its creation time.
            let t = self.last_tick.get();
            shared.created.store(t, Ordering::Relaxed);
            shared.since.store(t, Ordering::Relaxed);
        }
        // Counted before it runs: the count differs from the one of its last suspension
        // (trace caches are keyed by it) as soon as it can suspend again.
        shared.add_run(1, 0);
        self.current.set(fid);
        let prev = CURRENT.with(|c| c.replace(ctx_ptr));
        let _stack = fibertrace_core::enter_stack(shared.stack);
        crate::sample::set_running(&self.shared, shared, self.last_tick.get());
        let r = co.resume(());
        crate::sample::set_idle(&self.shared);
        // Fibers this one started at once ran inside the resume and moved `last_tick`: the
        // time since is this fiber's.
        let t1 = crate::clock::ticks();
        shared.add_run(0, t1.wrapping_sub(self.last_tick.get()));
        self.last_tick.set(t1);
        CURRENT.with(|c| c.set(prev));
        match r {
            CoroutineResult::Yield(y) => {
                let mut slots = self.slots.borrow_mut();
                if let Some(slot) = slots.get_mut(&fid) {
                    slot.co = Some(co);
                    if y == Yield::Ready && !slot.ctx.queued.get() {
                        slot.ctx.queued.set(true);
                        self.ready.borrow_mut().push_back(fid);
                    }
                }
            }
            CoroutineResult::Return(()) => {
                shared.mark_dead();
                shared.set_status(Status::Dead);
                let slot = self.slots.borrow_mut().remove(&fid);
                if let Some(slot) = &slot {
                    self.shared
                        .fibers
                        .remove(&mut self.reg.borrow_mut(), slot.reg, fid);
                }
                let stack = co.into_stack().into_inner();
                self.pool.borrow_mut().give(shared.stack_size, stack);
                if let Some(mut slot) = slot {
                    for &j in &slot.joiners {
                        self.make_ready(j);
                    }
                    // `ctx` and `shared` are not used past this point.
                    let mut free = self.free_slots.borrow_mut();
                    if free.len() < SLOT_POOL_MAX {
                        slot.joiners.clear();
                        free.push(slot);
                    }
                }
            }
        }
    }

    /// Runs ready fiber `target` now, inside the running fiber `me` (as Tarantool's
    /// `fiber_call` does), until it suspends or finishes; then `me` goes on. Two switches
    /// instead of four through the scheduler, in the same order: `target` first, `me` right
    /// after it. `me` counts as suspended meanwhile (its registers are recorded here, so
    /// inspectors walk it like any suspended fiber) and as ready: a wake-up of it is a no-op,
    /// as when it waited in the ready queue. Returns false (and does nothing) when `target`
    /// is not waiting in the ready queue.
    #[inline(never)]
    fn run_nested(&self, me: &FiberCtx, target: FiberId) -> bool {
        let me_id = me.shared.id;
        // Searched from the back, where a fiber just spawned is.
        let pos = self.ready.borrow().iter().rposition(|&x| x == target);
        let Some(pos) = pos else {
            return false;
        };
        // A fiber in the ready queue is suspended: its coroutine is in its slot (if not, it
        // is left where it is).
        let Some((co, ctx_ptr)) = self.take_co(target) else {
            return false;
        };
        self.ready.borrow_mut().remove(pos);
        me.queued.set(true);
        let shared = &me.shared;
        shared.record_suspension();
        shared.run.store(SUSPENDED, Ordering::Release);
        // `me`'s share of the CPU ends here.
        let t = crate::clock::ticks();
        shared.add_run(0, t.wrapping_sub(self.last_tick.get()));
        self.last_tick.set(t);
        crate::sample::set_idle(&self.shared);
        self.run_co(target, co, ctx_ptr);
        // Back in `me`: its run goes on.
        me.queued.set(false);
        self.current.set(me_id);
        shared.begin_resume();
        shared.set_status(Status::Running);
        shared.add_run(1, 0);
        // A new run for the sampler and the stall watchdog, from the end of the nested one.
        crate::sample::set_running(&self.shared, shared, self.last_tick.get());
        true
    }
}

/// Makes fiber `fid` of scheduler `sched` (created on this thread) ready, whether or not
/// that scheduler is running right now.
pub(crate) fn wake(sched: u64, fid: FiberId) {
    let running = with_sched(|s| {
        if s.shared.id == sched {
            s.make_ready(fid);
            true
        } else {
            false
        }
    });
    if running == Some(true) {
        return;
    }
    let inner = ON_THREAD.with(|t| {
        t.borrow()
            .iter()
            .find(|(id, _)| *id == sched)
            .and_then(|(_, w)| w.upgrade())
    });
    if let Some(inner) = inner {
        inner.make_ready(fid);
    }
}

/// As [`wake`], but a fiber that was cancelled (or is gone) is left alone: returns whether
/// the fiber was woken (one lookup, as `wake`'s).
pub(crate) fn wake_live(sched: u64, fid: FiberId) -> bool {
    let running = with_sched(|s| (s.shared.id == sched).then(|| s.make_ready_if(fid, true)));
    if let Some(Some(woke)) = running {
        return woke;
    }
    let inner = ON_THREAD.with(|t| {
        t.borrow()
            .iter()
            .find(|(id, _)| *id == sched)
            .and_then(|(_, w)| w.upgrade())
    });
    inner.is_some_and(|inner| inner.make_ready_if(fid, true))
}

/// The scheduler running on this thread and its loop turn (`(0, 0)`: none). It changes
/// between two runs of a fiber that yielded (a fiber suspended in a turn runs again in a
/// later one), never within one run: a clock read once per turn, as Tarantool's
/// `fiber.time()` and `fiber.clock()` read the event loop's cached time, is one value per
/// turn.
#[inline]
pub fn loop_turn() -> (u64, u64) {
    with_sched(|s| (s.shared.id, s.turn.get())).unwrap_or((0, 0))
}

/// How long the current fiber has run since it was last switched to (`None` outside a
/// fiber): what Tarantool's fiber slices measure.
pub fn current_run_time() -> Option<Duration> {
    current_ctx()?;
    with_sched(|s| crate::clock::since(s.last_tick.get()))
}

/// Turns `fiber.top()`-style accounting on for the scheduler running on this thread: from
/// now on, at the end of every loop turn, each fiber's share of the turn and a moving average
/// of it are updated (a pass over the fibers per turn; nothing per switch: CPU time is
/// counted at every switch anyway). Turning it on resets every figure. Returns false outside
/// a running scheduler.
pub fn top_enable() -> bool {
    with_sched(|s| {
        if s.top_on.get() {
            return;
        }
        s.top_on.set(true);
        s.turn_start.set(crate::clock::ticks());
        s.top_sched.set(TopStat::default());
        s.top_total.set(TopStat::default());
        for slot in s.slots.borrow_mut().values_mut() {
            let ticks = slot.ctx.shared.cpu_ticks.load(Ordering::Relaxed);
            slot.top = TopStat {
                last: ticks,
                base: ticks,
                ..TopStat::default()
            };
        }
    })
    .is_some()
}

/// Turns `fiber.top()` accounting off (the figures stay as they were).
pub fn top_disable() {
    with_sched(|s| s.top_on.set(false));
}

/// Whether `fiber.top()` accounting is on for the scheduler running on this thread.
pub fn top_enabled() -> bool {
    with_sched(|s| s.top_on.get()).unwrap_or(false)
}

/// The scheduler's own row of `fiber.top()`: the time of its turns no fiber ran (switching,
/// timers, and waiting for them).
pub fn top_sched_row() -> Option<TopRow> {
    with_sched(|s| s.top_row(&s.top_sched.get()))
}

/// Fiber `fid`'s row of `fiber.top()` (`None`: not a fiber of the scheduler running here).
pub fn top_fiber_row(fid: FiberId) -> Option<TopRow> {
    with_sched(|s| {
        let top = s.slots.try_borrow().ok()?.get(&fid).map(|slot| slot.top)?;
        Some(s.top_row(&top))
    })
    .flatten()
}

/// The id of the scheduler running on this thread (0: none).
pub(crate) fn current_sched_id() -> u64 {
    with_sched(|s| s.shared.id).unwrap_or(0)
}

/// The scheduler running on this thread, if any.
pub(crate) fn with_sched<R>(f: impl FnOnce(&Inner) -> R) -> Option<R> {
    let p = SCHED.with(|s| s.get());
    if p.is_null() {
        return None;
    }
    // SAFETY: SCHED is set only while a `Scheduler` runs on this thread (Enter guard) and
    // points at its `Inner`, kept alive by the Scheduler's Rc for that whole time.
    Some(f(unsafe { &*p }))
}

fn current_ctx() -> Option<&'static FiberCtx> {
    let p = CURRENT.with(|c| c.get());
    // SAFETY: CURRENT points at the running fiber's boxed FiberCtx, alive while it runs; the
    // 'static is never held across a switch by callers in this crate.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The running fiber's control block, if the current code runs in a fiber.
pub(crate) fn current_shared() -> Option<Arc<FiberShared>> {
    current_ctx().map(|c| c.shared.clone())
}

/// Marker payload of the unwinding that cancels a fiber.
pub(crate) struct Cancelled;

/// Switches away from the running fiber back to the scheduler (the other suspension point is
/// `Inner::run_nested`): records the registers (when tracing), publishes SUSPENDED, and
/// switches. After the resume, raises the cancellation if the fiber was cancelled meanwhile.
#[inline(never)]
pub(crate) fn suspend_current(why: Yield) {
    let ctx = current_ctx().expect("suspend outside a fiber");
    let shared = &ctx.shared;
    shared.record_suspension();
    shared.run.store(SUSPENDED, Ordering::Release);
    let y = ctx.yielder.get();
    // SAFETY: the yielder pointer was stored by this fiber when it started; it points into
    // its own stack (corosensei's parent link), valid for the coroutine's whole life.
    unsafe { (*y).suspend(why) };
    std::hint::black_box(());
    check_cancel(ctx);
}

fn check_cancel(ctx: &FiberCtx) {
    if ctx.shared.cancelled.load(Ordering::Relaxed) && !ctx.unwinding.get() {
        ctx.unwinding.set(true);
        std::panic::resume_unwind(Box::new(Cancelled));
    }
}

/// Tells the runtime that the cancellation's unwinding of the current fiber was caught and
/// turned into an error of the host's own (a Lua error the script may catch): the fiber's
/// next suspension raises it again, as Tarantool does at every yield of a cancelled fiber.
/// (Until then, a cancelled fiber's suspensions do not raise: its destructors may block
/// while it unwinds.)
pub fn cancellation_caught() {
    if let Some(ctx) = current_ctx() {
        ctx.unwinding.set(false);
    }
}

/// Raises the cancellation now if this fiber was cancelled (Tarantool's `fiber.testcancel`).
pub fn testcancel() {
    if let Some(ctx) = current_ctx() {
        check_cancel(ctx);
    }
}

/// Whether fiber `fid` of scheduler `sched` (the one running on this thread) was cancelled;
/// false for an unknown fiber or another thread's scheduler.
pub(crate) fn is_cancelled_fiber(sched: u64, fid: FiberId) -> bool {
    with_sched(|s| {
        s.shared.id == sched
            && s.slots
                .try_borrow()
                .ok()
                .and_then(|m| {
                    m.get(&fid)
                        .map(|slot| slot.ctx.shared.cancelled.load(Ordering::Relaxed))
                })
                .unwrap_or(false)
    })
    .unwrap_or(false)
}

/// Whether the current fiber was cancelled.
pub fn is_cancelled() -> bool {
    current_ctx().is_some_and(|c| c.shared.cancelled.load(Ordering::Relaxed))
}

/// Yields to the other ready fibers.
#[inline(never)]
pub fn yield_now() {
    if let Some(ctx) = current_ctx() {
        ctx.shared.set_status(Status::Ready);
        suspend_current(Yield::Ready);
        // Not a tail call: `yield_now` stays in the suspended fiber's trace.
        std::hint::black_box(());
    }
}

/// The body of [`yield_to`] and [`yield_to_id`], expanded into each (a macro, not an inlined
/// function: debug info would show that as a frame of its own), so that whichever was called
/// is the first frame of the waiting fiber's trace.
macro_rules! yield_to_body {
    ($fid:expr) => {{
        let fid: FiberId = $fid;
        let Some(ctx) = current_ctx() else {
            return;
        };
        ctx.shared.set_status(Status::Ready);
        // No closure around the nested run: it would be one more frame of this fiber's
        // trace while it waits (in unoptimised builds).
        let p = SCHED.with(|s| s.get());
        if !p.is_null() {
            // SAFETY: see with_sched.
            let s = unsafe { &*p };
            if fid != 0 && s.run_nested(ctx, fid) {
                std::hint::black_box(());
                check_cancel(ctx);
                return;
            }
        }
        suspend_current(Yield::Ready);
    }};
}

/// Runs `f` (if it is ready) now and the current fiber right after it: Tarantool's order for
/// a fiber it starts at once (`fiber.create`). `f` runs inside the current fiber's switch
/// (two switches, not four through the scheduler) until it suspends or finishes. When `f` is
/// not ready, this is [`yield_now`].
#[inline(never)]
pub fn yield_to(f: &Fiber) {
    let p = SCHED.with(|s| s.get());
    // SAFETY: see with_sched.
    let ours = !p.is_null() && unsafe { &*p }.shared.id == f.shared.sched;
    // A fiber of another scheduler: just yield.
    yield_to_body!(if ours { f.shared.id } else { 0 });
    // Not a tail call: `yield_to` stays in the waiting fiber's trace.
    std::hint::black_box(());
}

/// [`yield_to`] by id, for a fiber of the current thread's scheduler (no handle needed: a host
/// that keeps fibers by id saves a reference-count round trip per start). An id that is not
/// a ready fiber there (0, say) makes this [`yield_now`].
#[inline(never)]
pub fn yield_to_id(fid: FiberId) {
    yield_to_body!(fid);
    // Not a tail call: `yield_to_id` stays in the waiting fiber's trace.
    std::hint::black_box(());
}

/// Sleeps for `d` (other fibers run meanwhile). A [`Fiber::wakeup`] ends it early.
#[inline(never)]
pub fn sleep(d: Duration) {
    let Some(ctx) = current_ctx() else {
        std::thread::sleep(d);
        return;
    };
    let fid = ctx.shared.id;
    with_sched(|s| s.add_timer(fid, Instant::now() + d));
    ctx.shared.begin_wait(Status::Sleeping, WaitOn::Sleep);
    suspend_current(Yield::Blocked);
    ctx.shared.end_wait();
}

/// Blocks the current fiber on `on` until something makes it ready (a wake-up, or the
/// optional deadline). Used by channels, conditions and joins.
#[inline(never)]
pub(crate) fn block(on: WaitOn, deadline: Option<Instant>) {
    let Some(ctx) = current_ctx() else {
        return;
    };
    // A cancelled fiber does not start a wait (Tarantool: a channel or condition wait of a
    // cancelled fiber fails at once); what completes without waiting still completes.
    check_cancel(ctx);
    let fid = ctx.shared.id;
    if let Some(d) = deadline {
        with_sched(|s| s.add_timer(fid, d));
    }
    ctx.shared.begin_wait(Status::Waiting, on);
    suspend_current(Yield::Blocked);
    ctx.shared.end_wait();
}

/// Suspends the current fiber until [`Fiber::wakeup`] (Tarantool's `fiber.yield` without
/// requeue is `yield_now`; this is a plain park).
#[inline(never)]
pub fn suspend() {
    let Some(ctx) = current_ctx() else {
        return;
    };
    ctx.shared.begin_wait(Status::Suspended, WaitOn::Wakeup);
    suspend_current(Yield::Blocked);
    ctx.shared.end_wait();
}

/// The current fiber's id (0 outside fibers).
pub fn current_id() -> FiberId {
    current_ctx().map_or(0, |c| c.shared.id)
}

/// A handle to the current fiber.
pub fn current() -> Option<Fiber> {
    current_ctx().map(|c| Fiber {
        shared: c.shared.clone(),
    })
}

/// Spawns a fiber on the current thread's scheduler.
///
/// # Panics
/// Outside a running scheduler, and when the fiber cannot be made (see [`try_spawn`]).
#[inline(never)]
pub fn spawn<F, T>(f: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + 'static,
    T: 'static,
{
    no_tail_call(Builder::new().spawn_inner(f, 3)).unwrap_or_else(|e| spawn_failed(e))
}

/// Spawns a fiber on the current thread's scheduler, or says why it cannot (see
/// [`SpawnError`]).
///
/// # Panics
/// Outside a running scheduler.
#[inline(never)]
pub fn try_spawn<F, T>(f: F) -> Result<JoinHandle<T>, SpawnError>
where
    F: FnOnce() -> T + 'static,
    T: 'static,
{
    no_tail_call(Builder::new().spawn_inner(f, 3))
}

/// The panic of the spawn functions that cannot fail: the reason, said plainly.
#[cold]
#[inline(never)]
fn spawn_failed(e: SpawnError) -> ! {
    panic!("{e}")
}

/// A fiber handle without its result type: id, name, wakeup, cancel, backtrace.
#[derive(Clone, Debug)]
pub struct Fiber {
    pub(crate) shared: Arc<FiberShared>,
}

impl Fiber {
    /// A handle from a control block (as found in the registry).
    pub fn from_shared(shared: Arc<FiberShared>) -> Fiber {
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

    /// Renames the fiber.
    pub fn set_name(&self, name: &str) {
        *self.shared.name.lock().unwrap_or_else(|e| e.into_inner()) = Arc::from(name);
    }

    /// Renames the fiber with any bytes, kept exactly (see [`name_from_bytes`]).
    pub fn set_name_bytes(&self, name: &[u8]) {
        self.set_name(&name_from_bytes(name));
    }

    /// The fiber's name as the bytes it was given (see [`name_from_bytes`]).
    pub fn name_bytes(&self) -> Vec<u8> {
        name_to_bytes(&self.shared.name_arc()).into_owned()
    }

    /// Its status.
    pub fn status(&self) -> Status {
        self.shared.status().0
    }

    /// Makes a blocked fiber ready (interrupts a sleep or a wait; the waiter re-checks its
    /// condition). Must be called on the fiber's own scheduler thread; elsewhere it is a
    /// no-op that returns false.
    pub fn wakeup(&self) -> bool {
        let known = ON_THREAD.with(|t| t.borrow().iter().any(|(id, _)| *id == self.shared.sched));
        if !known {
            return false;
        }
        wake(self.shared.sched, self.shared.id);
        true
    }

    /// Cancels the fiber: at its next suspension point (or right away if it is blocked) it
    /// unwinds, running its destructors; its join returns [`JoinError::Cancelled`].
    pub fn cancel(&self) {
        self.shared.cancelled.store(true, Ordering::Relaxed);
        if self.shared.id != current_id() {
            self.wakeup();
        }
    }

    /// Its backtrace now: the current fiber's own stack, a suspended fiber's saved context,
    /// the entry function of one that never ran, a sample of one running on another thread;
    /// `None` for a dead fiber.
    #[inline(never)]
    pub fn backtrace(&self, unwinder: Unwinder) -> Option<Backtrace> {
        report_entry!();
        crate::info::fiber_backtrace(&self.shared, unwinder)
    }

    /// The trace of the fiber that created it, with the creator's ancestors chained.
    pub fn parent_trace(&self) -> Option<&ParentTrace> {
        self.shared.parent_trace.as_ref()
    }

    /// Id of the fiber that created it.
    pub fn parent(&self) -> Option<FiberId> {
        self.shared.parent
    }

    /// The control block (for info).
    pub fn shared(&self) -> &Arc<FiberShared> {
        &self.shared
    }

    /// Waits (from inside a fiber of the same scheduler) until the fiber has finished.
    ///
    /// # Panics
    /// When called outside a fiber, or by the fiber on itself.
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
            block(WaitOn::Join(shared.id), deadline);
        }
        true
    }
}

/// While it lives, the current fiber's suspensions do not raise its cancellation (for code
/// that is no cancellation point in Tarantool: `fiber_join`, `fiber.create`'s start of the
/// new fiber); dropped, they raise it again, at the next one. Outside a fiber it does
/// nothing.
pub struct CancelQuiet(Option<(&'static FiberCtx, bool)>);

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

type ResultSlot<T> = Rc<RefCell<Option<Result<T, JoinError>>>>;

/// Whether a fiber's result needs a slot: a zero-sized value without a destructor (`()`, as
/// most fibers return) carries nothing but its outcome, which the control block records —
/// one allocation less per spawn.
const fn needs_slot<T>() -> bool {
    std::mem::size_of::<T>() != 0 || std::mem::needs_drop::<T>()
}

/// The handle returned by spawn: join the fiber for its result.
pub struct JoinHandle<T> {
    fiber: Fiber,
    /// `None` when the result needs no slot (see `needs_slot`).
    result: Option<ResultSlot<T>>,
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
    /// When called outside a fiber on the same scheduler, or by the fiber on itself.
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
    fn take_result(&self) -> Option<Result<T, JoinError>> {
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

/// Builds a fiber: name, stack size, parent-trace override.
#[derive(Default)]
pub struct Builder {
    name: Option<Arc<str>>,
    stack_size: Option<usize>,
    /// A trace given by hand (boxed: a builder is moved through several calls, and a
    /// trace is a few hundred bytes).
    parent_trace: Option<Option<Box<ParentTrace>>>,
    created_at_start: bool,
}

/// A [`Builder`] bound to a scheduler (from [`Scheduler::builder`]).
pub struct SchedBuilder<'a> {
    sched: &'a Scheduler,
    b: Builder,
}

impl SchedBuilder<'_> {
    /// Names the fiber.
    pub fn name(mut self, name: &str) -> Self {
        self.b = self.b.name(name);
        self
    }

    /// Sets its stack size.
    pub fn stack_size(mut self, size: usize) -> Self {
        self.b = self.b.stack_size(size);
        self
    }

    /// Spawns it.
    ///
    /// # Panics
    /// When the fiber cannot be made (see [`SchedBuilder::try_spawn`]).
    #[inline(never)]
    pub fn spawn<F, T>(self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.b.spawn_on(&self.sched.inner, f, 3)).unwrap_or_else(|e| spawn_failed(e))
    }

    /// Spawns it, or says why it cannot (see [`SpawnError`]).
    #[inline(never)]
    pub fn try_spawn<F, T>(self, f: F) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.b.spawn_on(&self.sched.inner, f, 3))
    }
}

impl Builder {
    /// A builder with default settings.
    #[inline]
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Names the fiber.
    #[inline]
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(Arc::from(name));
        self
    }

    /// Names the fiber with any bytes, kept exactly (see [`name_from_bytes`]).
    #[inline]
    pub fn name_bytes(mut self, name: &[u8]) -> Self {
        self.name = Some(Arc::from(name_from_bytes(name)));
        self
    }

    /// Names the fiber with a shared name (no copy: a host that spawns many fibers under
    /// one name hands out the same string).
    #[inline]
    pub fn shared_name(mut self, name: Arc<str>) -> Self {
        self.name = Some(name);
        self
    }

    /// Sets its stack size.
    #[inline]
    pub fn stack_size(mut self, size: usize) -> Self {
        self.stack_size = Some(size);
        self
    }

    /// Uses this parent trace instead of capturing the creator's native stack (a Lua host
    /// passes a trace with the creator's Lua frames interleaved); `None` keeps none.
    #[inline]
    pub fn parent_trace(mut self, t: Option<ParentTrace>) -> Self {
        self.parent_trace = Some(t.map(Box::new));
        self
    }

    /// Takes the fiber's creation time when it first runs, not when it is spawned: for a
    /// fiber started at once ([`yield_to`] or [`yield_to_id`] right after the spawn, as
    /// `fiber.create` does), where the clock reading that starts it also dates it — one
    /// reading of the clock less per fiber (a `rdtsc` costs about 10 ns here, as much as a
    /// tenth of a whole create and run). Until it runs, its creation time shows as the
    /// scheduler's last accounting point (when the current run began, or the last one
    /// ended), a moment before the spawn. Use it only for a fiber that is started right away:
    /// otherwise its creation time is when it first ran. Outside a running fiber of the
    /// scheduler it is spawned on, it has no effect.
    #[inline]
    pub fn created_at_start(mut self) -> Self {
        self.created_at_start = true;
        self
    }

    /// Spawns on the current thread's scheduler.
    ///
    /// # Panics
    /// Outside a running scheduler, and when the fiber cannot be made (see
    /// [`Builder::try_spawn`]).
    #[inline(never)]
    pub fn spawn<F, T>(self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_inner(f, 3)).unwrap_or_else(|e| spawn_failed(e))
    }

    /// Spawns on the current thread's scheduler, or says why it cannot (see
    /// [`SpawnError`]); a failure leaves nothing behind, and `f` is dropped.
    ///
    /// # Panics
    /// Outside a running scheduler.
    #[inline(never)]
    pub fn try_spawn<F, T>(self, f: F) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_inner(f, 3))
    }

    #[inline(never)]
    fn spawn_inner<F, T>(self, f: F, skip: usize) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        let p = SCHED.with(|s| s.get());
        assert!(!p.is_null(), "spawn outside a running scheduler");
        // SAFETY: see with_sched.
        let inner = unsafe { &*p };
        no_tail_call(self.spawn_with(inner, f, skip + 1))
    }

    #[inline(never)]
    fn spawn_on<F, T>(
        self,
        inner: &Rc<Inner>,
        f: F,
        skip: usize,
    ) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_with(inner, f, skip + 1))
    }

    #[inline(never)]
    fn spawn_with<F, T>(self, inner: &Inner, f: F, skip: usize) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        let (traced, parent_traces, default_size) = {
            let o = inner.opts.borrow();
            (o.traced, o.parent_traces, o.stack_size)
        };
        let size = self.stack_size.unwrap_or(default_size);
        let stack = take_stack(inner, size)?;
        let bounds = stack::bounds(&stack);
        let stack = HeldStack::new(stack);
        // Borrowed: the creator's control block is cloned only into a parent trace (each
        // clone and drop is an atomic operation on a shared count).
        let creator = current_ctx().map(|c| &c.shared);
        let mut ras = [0u64; crate::control::PARENT_FRAMES];
        let parent_trace = match self.parent_trace {
            Some(Some(t)) => ParentInit::Given(t),
            Some(None) => ParentInit::None,
            None if parent_traces => {
                let n = capture_parent_trace(creator, skip, &mut ras);
                ParentInit::Captured {
                    creator: creator.cloned(),
                    thread_name: creator
                        .is_none()
                        .then(|| Arc::from(std::thread::current().name().unwrap_or("thread"))),
                    ras: &ras[..n],
                }
            }
            None => ParentInit::None,
        };
        let id = next_fiber_id();
        let name = self.name.unwrap_or_else(|| Arc::from(format!("fiber{id}")));
        // Deferred only when spawned by a running fiber of this scheduler, whose run began
        // at the last accounting point.
        let deferred = self.created_at_start
            && creator.is_some()
            && std::ptr::eq(SCHED.with(|s| s.get()), inner);
        let now = if deferred {
            inner.last_tick.get()
        } else {
            crate::clock::ticks()
        };
        let mut n = NewFiber {
            id,
            now,
            created_at_start: deferred,
            sched: inner.shared.id,
            name,
            parent: creator.map_or(0, |c| c.id),
            parent_trace,
            stack: bounds,
            stack_size: size,
            entry_fn: call_user::<F, T> as *const () as u64,
            entry_name: std::any::type_name::<F>(),
            traced,
        };
        // A finished fiber's slot box, with its control block when nothing else holds it.
        let recycled = inner.free_slots.borrow_mut().pop();
        let mut slot = match recycled {
            Some(mut b) => {
                FiberShared::renew(&mut b.ctx.shared, &mut n);
                b.ctx.yielder.set(std::ptr::null());
                b.ctx.unwinding.set(false);
                b.ctx.dropping.set(false);
                b.ctx.queued.set(true);
                b.timer_seq = 0;
                b.top = TopStat::default();
                b
            }
            None => Box::new(Slot {
                ctx: FiberCtx {
                    shared: FiberShared::new_shared(&mut n),
                    yielder: Cell::new(std::ptr::null()),
                    unwinding: Cell::new(false),
                    dropping: Cell::new(false),
                    queued: Cell::new(true),
                },
                co: None,
                timer_seq: 0,
                joiners: Vec::new(),
                reg: SlabIndex::Overflow,
                top: TopStat::default(),
            }),
        };
        let shared = slot.ctx.shared.clone();
        let result: Option<ResultSlot<T>> = needs_slot::<T>().then(|| Rc::new(RefCell::new(None)));
        let slot_result = result.clone();
        let body = move |y: &Yielder<(), Yield>, ()| {
            fiber_body(y, f, slot_result.as_ref());
        };
        slot.co = Some(Co::with_stack(stack, body));
        slot.reg = inner
            .shared
            .fibers
            .add(&mut inner.reg.borrow_mut(), shared.clone());
        inner.slots.borrow_mut().insert(id, slot);
        inner.ready.borrow_mut().push_back(id);
        Ok(JoinHandle {
            fiber: Fiber { shared },
            result,
        })
    }
}

// ---- names of any bytes ----

/// The first of the 128 code points that stand for the bytes 0x80..=0xFF in a name that is
/// not UTF-8 (U+10FF80..=U+10FFFF, private use).
const NAME_ESC: u32 = 0x10FF00;

fn is_name_esc(c: char) -> bool {
    (NAME_ESC + 0x80..=NAME_ESC + 0xFF).contains(&(c as u32))
}

fn push_name_byte(out: &mut String, b: u8) {
    // (0x80..=0xFF: every code point made is a valid one.)
    out.extend(char::from_u32(NAME_ESC + b as u32));
}

/// A fiber name of any bytes as the text the runtime keeps (names are `str`): UTF-8 as it
/// is; each byte of an invalid sequence as the private-use code point U+10FF00 + byte, and a
/// name's own characters of that range as their four bytes so, so that [`name_to_bytes`]
/// gives the exact bytes back. Reports made by the runtime show such a byte as that code
/// point; a host gives the bytes back with [`name_to_bytes`].
pub fn name_from_bytes(b: &[u8]) -> std::borrow::Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(b) {
        if !b.contains(&0xF4) || !s.chars().any(is_name_esc) {
            return std::borrow::Cow::Borrowed(s);
        }
    }
    let mut out = String::with_capacity(b.len() * 2);
    let valid = |out: &mut String, s: &str| {
        for c in s.chars() {
            if is_name_esc(c) {
                c.encode_utf8(&mut [0; 4])
                    .bytes()
                    .for_each(|x| push_name_byte(out, x));
            } else {
                out.push(c);
            }
        }
    };
    let mut rest = b;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                valid(&mut out, s);
                break;
            }
            Err(e) => {
                let (ok, bad) = rest.split_at(e.valid_up_to());
                // (`valid_up_to` bytes are UTF-8.)
                valid(&mut out, std::str::from_utf8(ok).unwrap_or_default());
                let n = e.error_len().unwrap_or(bad.len());
                bad[..n].iter().for_each(|&x| push_name_byte(&mut out, x));
                rest = &bad[n..];
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A fiber name in double quotes as the runtime's text reports write it, so that the exact
/// bytes can be read back and a name cannot break a report's lines: a byte that is not UTF-8
/// (see [`name_from_bytes`]) is `\xNN`, a control character `\n`, `\t`, `\r` or `\xNN`,
/// and `"` and `\` are escaped with a backslash; everything else as it is.
pub fn quoted_name(s: &str) -> QuotedName<'_> {
    QuotedName(s)
}

/// See [`quoted_name`].
pub struct QuotedName<'a>(&'a str);

impl std::fmt::Display for QuotedName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write as _;
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                '\n' => f.write_str("\\n")?,
                '\t' => f.write_str("\\t")?,
                '\r' => f.write_str("\\r")?,
                c if is_name_esc(c) => write!(f, "\\x{:02x}", c as u32 - NAME_ESC)?,
                c if (c as u32) < 0x20 || c as u32 == 0x7f => write!(f, "\\x{:02x}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

/// The bytes of a name made by [`name_from_bytes`] (any other text: its UTF-8).
pub fn name_to_bytes(s: &str) -> std::borrow::Cow<'_, [u8]> {
    if !s.as_bytes().contains(&0xF4) || !s.chars().any(is_name_esc) {
        return std::borrow::Cow::Borrowed(s.as_bytes());
    }
    let mut out = Vec::with_capacity(s.len());
    for c in s.chars() {
        if is_name_esc(c) {
            out.push((c as u32 - NAME_ESC) as u8);
        } else {
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
        }
    }
    std::borrow::Cow::Owned(out)
}

// ---- fiber stacks and the limits on them ----

/// Fiber stacks held by fibers, process-wide: each is two memory mappings (its inaccessible
/// guard and reserve, and its usable part). Stacks kept in the schedulers' pools are not
/// counted (at most a few dozen per scheduler).
static STACKS_HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Memory mappings a fiber stack takes.
const MAPS_PER_STACK: usize = 2;

/// A fiber's stack while a fiber holds it (counted in [`STACKS_HELD`]).
pub(crate) struct HeldStack(std::mem::ManuallyDrop<stack::FiberStack>);

impl HeldStack {
    fn new(s: stack::FiberStack) -> HeldStack {
        STACKS_HELD.fetch_add(1, Ordering::Relaxed);
        HeldStack(std::mem::ManuallyDrop::new(s))
    }

    /// The stack, no longer held by a fiber (for the pool).
    fn into_inner(self) -> stack::FiberStack {
        let mut me = std::mem::ManuallyDrop::new(self);
        STACKS_HELD.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: `me` is never dropped, so the stack is taken out exactly once.
        unsafe { std::mem::ManuallyDrop::take(&mut me.0) }
    }
}

impl Drop for HeldStack {
    fn drop(&mut self) {
        STACKS_HELD.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: dropped once, here (`into_inner` forgets `self` instead).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.0) };
    }
}

// SAFETY: the bounds are the wrapped stack's, which this value owns for its whole life.
unsafe impl corosensei::stack::Stack for HeldStack {
    #[inline]
    fn base(&self) -> corosensei::stack::StackPointer {
        self.0.base()
    }

    #[inline]
    fn limit(&self) -> corosensei::stack::StackPointer {
        self.0.limit()
    }
}

/// The most fiber stacks the process may hold: `vm.max_map_count` (read once) less a reserve
/// of mappings for everything else the process maps (the allocators' arenas, the Lua heap,
/// libraries, threads' stacks): past it, an allocation anywhere in the process would fail
/// (and a Rust one aborts the process), not only the next spawn. The reserve is a sixteenth
/// of the limit, at least 1,024 and at most 8,192 mappings.
fn stacks_allowed() -> (usize, usize, usize) {
    static LIMIT: std::sync::OnceLock<(usize, usize, usize)> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let max = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65530);
        let reserve = (max / 16).clamp(1024, 8192);
        (max.saturating_sub(reserve) / MAPS_PER_STACK, max, reserve)
    })
}

/// A stack for a new fiber: from the pool, or mapped; within the mapping limit.
fn take_stack(inner: &Inner, size: usize) -> Result<stack::FiberStack, SpawnError> {
    let held = STACKS_HELD.load(Ordering::Relaxed);
    let (allowed, max_maps, reserve) = stacks_allowed();
    let err = |kind, errno, limit| SpawnError {
        kind,
        stack_size: size,
        stacks: held,
        errno,
        limit,
        reserve,
    };
    if held >= allowed {
        return Err(err(SpawnErrorKind::MapCount, 0, max_maps as u64));
    }
    inner.pool.borrow_mut().take(size).map_err(|e| {
        let errno = e.raw_os_error().unwrap_or(0);
        if e.kind() == std::io::ErrorKind::InvalidInput || errno == libc::EINVAL {
            return err(SpawnErrorKind::StackSize, errno, 0);
        }
        if errno != libc::ENOMEM {
            return err(SpawnErrorKind::Other, errno, 0);
        }
        if (held + 1) * MAPS_PER_STACK + reserve / 2 >= max_maps {
            return err(SpawnErrorKind::MapCount, errno, max_maps as u64);
        }
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a plain query into a local.
        let limited = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0
            && rl.rlim_cur != libc::RLIM_INFINITY;
        if limited {
            err(SpawnErrorKind::AddressSpace, errno, rl.rlim_cur)
        } else {
            err(SpawnErrorKind::OutOfMemory, errno, 0)
        }
    })
}

/// Which limit a spawn hit (see [`SpawnError`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpawnErrorKind {
    /// The stack could not be mapped: out of memory.
    OutOfMemory,
    /// The stack does not fit in the address-space limit (`RLIMIT_AS`, `ulimit -v`).
    AddressSpace,
    /// The process holds as many fiber stacks as `vm.max_map_count` allows, less a reserve of
    /// mappings for the rest of the process.
    MapCount,
    /// The stack size asked for is too large to map.
    StackSize,
    /// The mapping failed otherwise (see [`SpawnError::errno`]).
    Other,
}

/// Why a fiber could not be made: which limit, the stack size, and the system's error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpawnError {
    kind: SpawnErrorKind,
    stack_size: usize,
    stacks: usize,
    errno: i32,
    limit: u64,
    reserve: usize,
}

impl SpawnError {
    /// Which limit was hit.
    pub fn kind(&self) -> SpawnErrorKind {
        self.kind
    }

    /// The size of the stack the fiber was to get.
    pub fn stack_size(&self) -> usize {
        self.stack_size
    }

    /// Fiber stacks held by fibers in the process when the spawn failed.
    pub fn fiber_stacks(&self) -> usize {
        self.stacks
    }

    /// The `errno` of the failed mapping (0 when the spawn was refused before mapping).
    pub fn errno(&self) -> i32 {
        self.errno
    }
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = self.stack_size;
        let n = self.stacks;
        let os = std::io::Error::from_raw_os_error(self.errno);
        match self.kind {
            SpawnErrorKind::OutOfMemory => write!(
                f,
                "cannot create a fiber: out of memory for its {size}-byte stack ({os}; {n} \
                 fiber stacks in use)"
            ),
            SpawnErrorKind::AddressSpace => write!(
                f,
                "cannot create a fiber: its {size}-byte stack does not fit in the \
                 address-space limit (RLIMIT_AS, ulimit -v) of {} bytes ({os}; {n} fiber \
                 stacks in use)",
                self.limit
            ),
            SpawnErrorKind::MapCount => write!(
                f,
                "cannot create a fiber: {n} fiber stacks in use, as many as vm.max_map_count \
                 ({}) allows at {MAPS_PER_STACK} memory mappings each, with {} kept for the \
                 rest of the process",
                self.limit, self.reserve
            ),
            SpawnErrorKind::StackSize => {
                write!(f, "cannot create a fiber: a {size}-byte stack is too large")
            }
            SpawnErrorKind::Other => write!(
                f,
                "cannot create a fiber: cannot map its {size}-byte stack ({os})"
            ),
        }
    }
}

impl std::error::Error for SpawnError {}

/// Keeps the spawn functions' frames on the stack (no tail call), so that the number of
/// frames to skip when capturing the creator's trace is the same at every optimisation level.
#[inline(always)]
fn no_tail_call<T>(v: T) -> T {
    std::hint::black_box(());
    v
}

/// Captures the creator's return addresses for a child's parent trace: its own frames (cut
/// at its entry when it is a fiber; the spawn machinery skipped). Returns how many.
#[inline(never)]
fn capture_parent_trace(
    creator: Option<&Arc<FiberShared>>,
    skip: usize,
    ras: &mut [u64; crate::control::PARENT_FRAMES],
) -> usize {
    let (stop, stack) = match creator {
        // A fiber: its own stack, up to its entry.
        Some(c) => (c.entry_sp.load(Ordering::Relaxed), c.stack),
        None => (0, fibertrace_core::capture::thread_stack()),
    };
    // The lean frame-pointer walk (no thread-local access, no allocation) keeps spawning
    // with parent traces within a few percent of without; code built without frame
    // pointers (a user's crate) gets the DWARF walk instead.
    let n = match fibertrace_core::collect_raw(skip, stop, stack, ras) {
        Some(n) => n,
        None => parent_trace_dwarf(skip, stop, ras),
    };
    // Not a tail call: this frame is one of the `skip` ones at every optimisation level.
    no_tail_call(n)
}

/// [`capture_parent_trace`]'s walk where frame pointers cannot be trusted. Called from the
/// same frame as `collect_raw` would be, so `skip` means the same frames.
#[inline(never)]
fn parent_trace_dwarf(
    skip: usize,
    stop_sp: u64,
    ras: &mut [u64; crate::control::PARENT_FRAMES],
) -> usize {
    let opts = CaptureOptions {
        unwinder: Unwinder::Auto,
        // This function's own frame stands where `collect_raw`'s would not: one more.
        offset: skip + 1,
        limit: ras.len(),
        top: 0,
    };
    let mut bt = Backtrace::new();
    fibertrace_core::collect_until(&opts, stop_sp, &mut bt);
    let mut n = 0;
    for f in bt.frames() {
        if let Frame::Ra(a) = f {
            ras[n] = *a;
            n += 1;
        }
    }
    no_tail_call(n)
}

/// The body of every fiber, on its own stack.
fn fiber_body<F, T>(y: &Yielder<(), Yield>, f: F, result: Option<&ResultSlot<T>>)
where
    F: FnOnce() -> T,
{
    // This fiber's own context (the scheduler made it current for the resume); its box
    // stays in the fiber's slot until the coroutine has returned.
    let ctx = current_ctx().expect("a fiber body runs in its fiber");
    let shared = &ctx.shared;
    ctx.yielder.set(y as *const _);
    let finish = |out: Result<T, JoinError>| {
        let code = match &out {
            Ok(_) => OUTCOME_OK,
            Err(JoinError::Cancelled) => OUTCOME_CANCELLED,
            Err(JoinError::Panicked(_)) => OUTCOME_PANICKED,
        };
        match result {
            Some(slot) => *slot.borrow_mut() = Some(out),
            // No slot: a zero-sized value without a destructor, handed back by the join
            // (an error is dropped: the join reads the outcome and the stored report).
            None => {
                if let Ok(v) = out {
                    std::mem::forget(v);
                }
            }
        }
        shared.outcome.store(code, Ordering::Release);
    };
    if shared.cancelled.load(Ordering::Relaxed) {
        finish(Err(JoinError::Cancelled));
        return;
    }
    // The indirect call keeps `call_user` a real frame; the stack pointer of the function
    // that calls it (whatever was inlined into it), at the call, is where the fiber's trace
    // ends: that function's stack pointer does not move between the read and the call.
    let call: fn(F) -> T = std::hint::black_box(call_user::<F, T>);
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let here = fibertrace_core::__fibertrace_registers_here!();
        shared.set_entry_sp(here.sp);
        call(f)
    }));
    if r.is_err() && ctx.dropping.get() {
        // The scheduler is dropping this fiber: let corosensei's unwinding go on.
        if let Err(payload) = r {
            std::panic::resume_unwind(payload);
        }
        unreachable!();
    }
    let out = match r {
        Ok(v) => Ok(v),
        Err(payload) if payload.is::<Cancelled>() => Err(JoinError::Cancelled),
        Err(payload) => {
            let report = crate::panic::take_report(shared, &*payload);
            if with_sched(|s| s.opts.borrow().report_panics).unwrap_or(true) {
                crate::panic::print_report(shared, &report);
            }
            *shared.panic.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(Box::new(report.clone()));
            Err(JoinError::Panicked(Box::new(report)))
        }
    };
    finish(out);
}

/// Calls the user's function: the outermost frame of every fiber's trace.
#[inline(never)]
pub(crate) fn call_user<F: FnOnce() -> T, T>(f: F) -> T {
    let r = f();
    std::hint::black_box(());
    r
}

/// Whether the given run state means the fiber never ran.
pub(crate) fn never_ran(run: u8) -> bool {
    run == NEW
}

/// Whether the given run state means the fiber is running now.
pub(crate) fn is_running(run: u8) -> bool {
    run == RUNNING
}

/// Whether the fiber is dead.
pub(crate) fn is_dead(run: u8) -> bool {
    run == DEAD
}

/// The frame shown for a fiber that never ran: its entry function.
pub(crate) fn entry_frame(shared: &FiberShared) -> Frame {
    Frame::Pc(shared.entry_fn)
}

/// The current fiber's trace (from inside it), cut at its entry. Inside a report (see
/// `report_entry!`) it starts at the caller of the report's entry point.
#[inline(never)]
pub(crate) fn current_backtrace(shared: &FiberShared, unwinder: Unwinder) -> Backtrace {
    let mut bt = Backtrace::new();
    let stop = shared.entry_sp.load(Ordering::Relaxed);
    match crate::info::ReportOrigin::current() {
        Some(origin) => {
            let opts = CaptureOptions::with_unwinder(unwinder);
            fibertrace_core::collect_from_origin(origin, &opts, stop, &mut bt);
        }
        None => {
            let opts = CaptureOptions {
                unwinder,
                offset: 2, // this function and info's caller
                ..CaptureOptions::default()
            };
            fibertrace_core::collect_until(&opts, stop, &mut bt);
        }
    }
    bt
}
