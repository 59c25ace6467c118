//! The scheduler (a "cord"): one per OS thread, running its fibers cooperatively.
//!
//! Every suspension goes through one of three `#[inline(never)]` points: `suspend_current`
//! (back to the scheduler), `Inner::run_nested` (running a ready fiber inside the caller's
//! switch, as `fiber.create` does) and `Inner::yield_in_place` (a yield that runs the fibers
//! ahead of the caller inside its switch, or goes back to the one it runs inside). Each
//! records the fiber's registers (when tracing is on)
//! and publishes `Suspended` before switching away, so that any thread can walk the fiber's
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
//! fiber running on another thread is captured by a signal (see [`crate::inspect::sample`]) and may
//! have moved on by the time the trace is read.

use std::cell::{Cell, RefCell};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corosensei::{Coroutine, Yielder};

use crate::registry::{self, SchedShared, SlabIndex, SlabOwner};
use crate::stack;
use crate::task::{ControlBlock, FiberId, PanicReport, Status, WaitOn};

mod handle;
pub(crate) mod names;
pub(crate) mod panic;
pub(crate) use panic::forbid_stack_switch;
mod run;
mod spawn;

pub use handle::{CancelQuiet, Fiber, JoinError, JoinHandle};
pub use names::{name_from_bytes, name_to_bytes, quoted_name, QuotedName, NAME_MAX};
pub use run::{
    current_run_time, loop_turn, top_at_end, top_disable, top_enable, top_enabled, top_ended_row,
    top_fiber_row, top_sched_row, EndedTop,
};
pub(crate) use run::{wake, wake_live};
use spawn::{no_tail_call, spawn_failed, HeldStack};
pub use spawn::{
    spawn, try_spawn, Builder, SchedBuilder, SpawnError, SpawnErrorKind, MIN_STACK_SIZE,
};

/// What the machinery asks of the layers above it, handed over by the constructor that wires
/// them ([`crate::runtime`]): the scheduler calls these and never names those layers.
pub(crate) struct Hooks {
    /// On the scheduler's thread as it starts running, before the thread is published
    /// (inspection prepares its sampling of the running fiber here).
    pub enter_thread: fn(&SchedShared),
    /// A fiber panicked and its scheduler reports panics: write the report.
    pub panicked: fn(&ControlBlock, &PanicReport),
    /// The scheduler is being dropped, on its thread: forget what was kept for it.
    pub dropped: fn(u64),
    /// Another thread asked for something done on this scheduler's thread
    /// (`on_thread.asked`): called from the run loop, between fibers.
    pub asked: fn(&SchedShared),
}

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
pub(crate) struct FiberCore {
    pub shared: Arc<ControlBlock>,
    pub yielder: Cell<*const Yielder<(), Yield>>,
    /// Set while the fiber unwinds because it was cancelled (yield points then stop
    /// re-raising).
    pub unwinding: Cell<bool>,
    /// Set while its scheduler drops it (corosensei force-unwinds the stack).
    pub dropping: Cell<bool>,
    /// In the ready queue, or counted as ready (a fiber waiting in a nested start, or in
    /// `yield_in_place` behind the fibers ahead of it, its place a count): a wake-up changes
    /// nothing. (Here, not in the slot map, so that a nested start sets it
    /// on the caller's context without a map lookup.)
    queued: Cell<bool>,
    /// Woken while it ran (by itself, or by code it called): its next suspension does not
    /// wait — a sleep or a wait ends at once, as in Tarantool, whose wake-up puts a running
    /// fiber in the ready list.
    woken: Cell<bool>,
}

/// A fiber's slot. Boxed: its address (and its context's, which `CURRENT` and a running
/// fiber's resume hold) stays put while the slot map grows, and the map moves a pointer, not
/// the slot, when a fiber is added or removed. Finished fibers' boxes are reused.
struct Slot {
    ctx: FiberCore,
    /// Boxed: a resume takes it out of the slot and a suspension puts it back (no reference
    /// into the slot lives across the switch), which moved the whole coroutine twice a
    /// switch, ~40 instructions of ~290 (callgrind, the yield bench); a box moves a pointer.
    co: Option<Box<Co>>,
    /// The box of the last coroutine that ran in this slot, for the next fiber's (the slot
    /// is recycled: no allocation per spawn).
    spare: Option<Box<std::mem::MaybeUninit<Co>>>,
    timer_seq: u64,
    joiners: Vec<FiberId>,
    /// Where its control block is in the registry.
    reg: SlabIndex,
    /// Its `fiber.top()` figures (kept up to date only while top is on).
    top: TopStat,
}

/// A fiber in the ready queue, with its slot: resuming it and putting it back after it yields
/// take no lookup in the slot map.
///
/// Invariant (what makes `slot` valid when the entry is taken): a fiber is in the queue at
/// most once (its `queued` flag), only while it is suspended (a fiber that waits in its own
/// `yield_in_place` is not in the queue: its place is counted, `Inner::ahead`, and it is put
/// there only when it suspends to the loop) — and a slot leaves the map only
/// when its fiber returns — after it was taken out of the queue to run — or when the
/// scheduler is dropped (which empties the queue first). So the box `slot` points to is in
/// the map, and holds this fiber, for as long as the entry is queued. This needs the run
/// loop not to be re-entered (a loop run inside one of its own fibers would see that fiber
/// as not running and could queue it): `run` and `block_on` refuse that
/// ([`RunError::Reentered`]).
#[derive(Clone, Copy)]
pub(crate) struct Ready {
    fid: FiberId,
    slot: std::ptr::NonNull<Slot>,
}

/// One row of `fiber.top()` as the scheduler keeps it: CPU ticks at the end of the last loop
/// turn, the ticks of that turn, their moving average over turns, and the ticks when top was
/// turned on (its time counts from there).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TopStat {
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

/// A row of `fiber.top()`: shares of the scheduler's time (percent) and the CPU time counted since
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
    /// Default stack size of new fibers (at least [`MIN_STACK_SIZE`]).
    pub stack_size: usize,
    /// Print a report (message and backtrace) to stderr when a fiber panics.
    pub report_panics: bool,
    /// Scheduler name shown in dumps.
    pub name: String,
    /// Time every run: count each fiber's CPU time at every switch
    /// ([`ControlBlock::cpu_time`]), and know how long the running fiber has run
    /// ([`crate::embed::current_run_time`], for slices). One read of the CPU's time-stamp
    /// counter per switch (~10 ns on some machines, a fifth of a yield). Off by default: runs
    /// are then timed only while `fiber.top` accounting is on ([`crate::embed::top_enable`]),
    /// as Tarantool counts a fiber's `time`.
    ///
    /// [`ControlBlock::cpu_time`]: crate::ControlBlock::cpu_time
    pub cpu_time: bool,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            traced: true,
            parent_traces: true,
            stack_size: 256 * 1024,
            report_panics: true,
            name: std::thread::current().name().unwrap_or("cord").to_string(),
            cpu_time: false,
        }
    }
}

pub(crate) struct Inner {
    pub shared: Arc<SchedShared>,
    hooks: &'static Hooks,
    opts: RefCell<SchedulerOptions>,
    slots: RefCell<HashMap<FiberId, Box<Slot>, IdHash>>,
    /// The writing side of this scheduler's registry slab (`shared.fibers`).
    reg: RefCell<SlabOwner>,
    /// Clock ticks at the last accounting point. While runs are timed (`clocked`): the end of
    /// a fiber's run (or of an idle wait) or the start of a nested one — one counter read
    /// per switch serves both the finished share's CPU time and the next run's start time.
    /// Otherwise: the start of the loop turn (read only while a timer waits), or of the
    /// last idle wait's end.
    last_tick: Cell<u64>,
    /// Whether runs are timed (the counter read at every switch; see `last_tick`): while
    /// someone needs it, as the bits of [`Clocked`] say.
    clocked: Cell<u8>,
    /// Fibers ready to run, in order, each with its slot (see [`Ready`]).
    ready: RefCell<VecDeque<Ready>>,
    timers: RefCell<BinaryHeap<std::cmp::Reverse<(Instant, u64, FiberId)>>>,
    /// The clock ticks (`last_tick`) from which the timers must be looked at: a little before
    /// the first one is due (`u64::MAX`: no timer; 0: at the next loop iteration). The loop
    /// compares the counter it read last (at the last switch while runs are timed, else at
    /// the turn's start) with it instead of reading the monotonic clock at every switch
    /// while some fiber sleeps.
    timer_gate: Cell<u64>,
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
    /// Asked to return from the run loop at the end of this turn ([`end_run_after_turn`]).
    end_after_turn: Cell<bool>,
    /// Set while `run` or `block_on` runs this scheduler (see `Running`).
    running: Cell<bool>,
    /// How many fibers run inside another's switch now (`run_nested`, `yield_in_place`): a
    /// fiber's yield is served in place only when it runs straight from the loop (0); one
    /// run inside another's switch goes back to it at its yield, so yields never nest runs.
    nested: Cell<u32>,
    /// While a yield is served in place (`yield_in_place`): how many fibers in the ready
    /// queue are ahead of the yielding fiber. It is not in the queue meanwhile (its place
    /// there is this count: a fiber made ready goes behind it at the back, as it would);
    /// `run_nested` counts one down when it takes a fiber ahead of it out of the queue.
    /// 0 otherwise.
    ahead: Cell<usize>,
    /// The process's inspection handshake is the asymmetric one: a resume stores its state
    /// with no locked instruction (see `crate::task::state`).
    unlocked: bool,
    /// `fiber.top()`: whether on, the clock ticks when the current turn began, and the
    /// scheduler's own row (the time of a turn no fiber ran, waiting included) and the
    /// whole turn's (the sum of every row).
    top_on: Cell<bool>,
    turn_start: Cell<u64>,
    top_sched: Cell<TopStat>,
    top_total: Cell<TopStat>,
    /// Turns closed since `fiber.top` accounting was last turned on, and how many times it
    /// was (each time resets every figure): what the row of a fiber that ended is computed
    /// from (see `EndedTop`).
    top_turns: Cell<u64>,
    top_epoch: Cell<u64>,
}

/// Who needs runs timed (bits of `Inner::clocked`).
pub(crate) struct Clocked;

impl Clocked {
    /// `SchedulerOptions::cpu_time`.
    pub(crate) const CPU: u8 = 1;
    /// `fiber.top` accounting is on.
    pub(crate) const TOP: u8 = 2;
}

impl Inner {
    /// Whether runs are timed now.
    #[inline(always)]
    pub(crate) fn is_clocked(&self) -> bool {
        self.clocked.get() != 0
    }

    /// Sets or clears one need of timed runs. When runs start being timed, the running
    /// fiber's run (or the scheduler's time) counts from now: the last accounting point may
    /// be long ago, and its CPU time is no fiber's.
    pub(crate) fn set_clocked(&self, bit: u8, on: bool) {
        let was = self.clocked.get();
        let now = if on { was | bit } else { was & !bit };
        if was == 0 && now != 0 {
            self.last_tick.set(crate::clock::ticks());
            crate::running::restamp_run(&self.shared.on_thread, self.last_tick.get());
            self.shared
                .cpu_counted
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.clocked.set(now);
    }

    /// Lets go of what is kept for the next fibers (finished fibers' slot boxes, stacks) and
    /// of the spare room of the scheduler's own collections. A collection borrowed now (a
    /// caller inside the scheduler's own work) is left as it is.
    pub(crate) fn release_caches(&self) {
        if let Ok(mut f) = self.free_slots.try_borrow_mut() {
            *f = Vec::new();
        }
        if let Ok(mut p) = self.pool.try_borrow_mut() {
            p.clear();
        }
        if let Ok(mut r) = self.ready.try_borrow_mut() {
            r.shrink_to_fit();
        }
        if let Ok(mut t) = self.timers.try_borrow_mut() {
            t.shrink_to_fit();
        }
        if let Ok(mut s) = self.slots.try_borrow_mut() {
            s.shrink_to_fit();
        }
    }
}

/// Lets go of what the running scheduler keeps for its next fibers: finished fibers' slot
/// boxes and stacks, and the spare room of its own collections (what is left is what its
/// fibers hold). For a heap report at exit (`fibertrace run --leaks`); the next fibers are
/// made anew. Outside a running scheduler, nothing.
pub fn release_caches() {
    with_sched(|s| s.release_caches());
}

impl Scheduler {
    /// [`release_caches`] of this scheduler, when it does not run.
    pub fn release_caches(&self) {
        self.inner.release_caches();
    }
}

/// Most slot boxes kept for reuse.
const SLOT_POOL_MAX: usize = 64;

thread_local! {
    /// Schedulers created on this thread, to wake their fibers from outside `run`.
    static ON_THREAD: RefCell<Vec<(u64, std::rc::Weak<Inner>)>> = const { RefCell::new(Vec::new()) };
    static SCHED: Cell<*const Inner> = const { Cell::new(std::ptr::null()) };
    static CURRENT: Cell<*const FiberCore> = const { Cell::new(std::ptr::null()) };
}

/// A scheduler: create it on a thread, spawn fibers, and run it there.
pub struct Scheduler {
    inner: Rc<Inner>,
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
    /// `run` or `block_on` was called from one of the scheduler's own fibers while it runs
    /// (a scheduler runs once at a time; its fibers yield to it instead).
    Reentered,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Deadlock { fibers } => write!(
                f,
                "all fibers are asleep — deadlock ({} fibers waiting)",
                fibers.len()
            ),
            RunError::Reentered => {
                f.write_str("the scheduler is already running: run or block_on from its own fiber")
            }
        }
    }
}

impl std::error::Error for RunError {}

impl Scheduler {
    /// A scheduler with the given options, wired to the layers above by `hooks`.
    pub(crate) fn with_hooks(opts: SchedulerOptions, hooks: &'static Hooks) -> Scheduler {
        panic::install_hook();
        spawn::register_heap_entry();
        crate::clock::init();
        // The inspection handshake, chosen now rather than at the first switch (it asks the
        // kernel once).
        let unlocked = crate::task::state::choose_mode();
        // The thread's own stack bounds, found now and cached (a scheduler runs on the thread
        // that made it), before its fibers' stacks are mapped: on the main thread the C
        // library finds them by reading /proc/self/maps, a line per mapping and two per
        // fiber stack (the first trace that needed them, a running fiber's at 30,000 fibers,
        // spent ~30 ms there).
        fibertrace_core::capture::thread_stack();
        let shared = registry::register(opts.name.clone());
        crate::publish::add(&shared);
        let cpu_time = opts.cpu_time;
        if cpu_time {
            shared
                .cpu_counted
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let sched = Scheduler {
            inner: Rc::new(Inner {
                shared,
                hooks,
                opts: RefCell::new(opts),
                slots: RefCell::new(HashMap::default()),
                reg: RefCell::new(SlabOwner::default()),
                last_tick: Cell::new(crate::clock::ticks()),
                clocked: Cell::new(if cpu_time { Clocked::CPU } else { 0 }),
                ready: RefCell::new(VecDeque::new()),
                timers: RefCell::new(BinaryHeap::new()),
                timer_gate: Cell::new(u64::MAX),
                next_seq: Cell::new(1),
                current: Cell::new(0),
                pool: RefCell::new(stack::Pool::new()),
                free_slots: RefCell::new(Vec::new()),
                turn: Cell::new(1),
                turn_left: Cell::new(0),
                end_after_turn: Cell::new(false),
                nested: Cell::new(0),
                ahead: Cell::new(0),
                unlocked,
                running: Cell::new(false),
                top_on: Cell::new(false),
                turn_start: Cell::new(0),
                top_sched: Cell::new(TopStat::default()),
                top_total: Cell::new(TopStat::default()),
                top_turns: Cell::new(0),
                top_epoch: Cell::new(0),
            }),
        };
        ON_THREAD.with(|t| {
            let mut t = t.borrow_mut();
            t.retain(|(_, w)| w.strong_count() > 0);
            t.push((sched.inner.shared.id, Rc::downgrade(&sched.inner)));
        });
        sched
    }

    /// What other threads see of this scheduler (its registry entry).
    pub(crate) fn shared(&self) -> &Arc<SchedShared> {
        &self.inner.shared
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
        let _running = Running::new(&self.inner)?;
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
        let _running = Running::new(&self.inner).map_err(BlockOnError::Run)?;
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

    /// Number of live fibers.
    pub fn fiber_count(&self) -> usize {
        self.inner.slots.borrow().len()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Fibers still suspended are dropped: corosensei unwinds their stacks (running their
        // destructors), each marked running meanwhile and dead before its stack is freed, so
        // no inspector walks a stack that changes or is gone.
        (self.inner.hooks.dropped)(self.inner.shared.id);
        // No fiber is resumed from the queue again: a destructor run below that starts a
        // queued fiber (`yield_to`) finds none (the entries point into slots freed here).
        self.inner.ready.borrow_mut().clear();
        self.inner.turn_left.set(0);
        let _enter = Enter::new(&self.inner);
        let slots: Vec<(FiberId, Box<Slot>)> = self.inner.slots.borrow_mut().drain().collect();
        for (_, mut slot) in slots {
            slot.ctx.shared.cancelled.store(true, Ordering::Relaxed);
            if let Some(mut co) = slot.co.take() {
                CURRENT.with(|c| c.set(&slot.ctx));
                slot.ctx.unwinding.set(true);
                slot.ctx.dropping.set(true);
                if co.started() && !co.done() {
                    // Its stack runs again (its destructors): running, for inspectors, as
                    // at any resume (a walk under way is waited out first).
                    slot.ctx.shared.run.begin_resume(self.inner.unlocked);
                    // (Counted: a suspension inside the unwind is a new one, whose walk
                    // is not the one kept.)
                    slot.ctx.shared.add_switch();
                    let prev = fibertrace_core::heap::switch_to(Some(&slot.ctx.shared.heap));
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| co.force_unwind()));
                    fibertrace_core::heap::restore(prev);
                }
                CURRENT.with(|c| c.set(std::ptr::null()));
                slot.ctx.shared.heap.close();
                slot.ctx.shared.run.mark_dead();
                drop(co);
            } else {
                slot.ctx.shared.run.mark_dead();
            }
            slot.ctx.shared.set_status(Status::Dead);
            self.inner.shared.fibers.remove(
                &mut self.inner.reg.borrow_mut(),
                slot.reg,
                slot.ctx.shared.id,
            );
        }
        crate::publish::remove(&self.inner.shared);
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

/// Marks a scheduler as running while `run` or `block_on` runs it: the run loop is not
/// re-entered (the ready queue's slot pointers rely on it, see [`Ready`]).
struct Running<'a>(&'a Inner);

impl<'a> Running<'a> {
    fn new(inner: &'a Inner) -> Result<Running<'a>, RunError> {
        if inner.running.replace(true) {
            return Err(RunError::Reentered);
        }
        Ok(Running(inner))
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.set(false);
    }
}

/// Makes a scheduler current on this thread while it runs.
struct Enter {
    prev: *const Inner,
    /// The scheduler entered (its shared state, which outlives it).
    shared: Arc<SchedShared>,
}

impl Enter {
    fn new(inner: &Rc<Inner>) -> Enter {
        let prev = SCHED.with(|s| s.replace(Rc::as_ptr(inner)));
        (inner.hooks.enter_thread)(&inner.shared);
        crate::overflow::install();
        crate::running::enter_thread(&inner.shared.on_thread);
        Enter {
            prev,
            shared: inner.shared.clone(),
        }
    }
}

impl Drop for Enter {
    fn drop(&mut self) {
        SCHED.with(|s| s.set(self.prev));
        if self.prev.is_null() {
            crate::running::leave_thread(&self.shared.on_thread);
        } else {
            // SAFETY: `prev` is the scheduler whose fiber entered this one: it runs on this
            // thread, outside us, and outlives this guard.
            let outer: &Inner = unsafe { &*self.prev };
            crate::running::restore_thread(&outer.shared.on_thread, &self.shared.on_thread);
        }
    }
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

fn current_ctx() -> Option<&'static FiberCore> {
    let p = CURRENT.with(|c| c.get());
    // SAFETY: CURRENT points at the running fiber's boxed FiberCore, alive while it runs; the
    // 'static is never held across a switch by callers in this crate.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The running fiber's control block, if the current code runs in a fiber.
pub(crate) fn current_shared() -> Option<Arc<ControlBlock>> {
    current_ctx().map(|c| c.shared.clone())
}

// ---- the running fiber's side: yielding, sleeping, blocking, cancellation points ----
//
// These stay in this module on purpose: they are the innermost frames of every parked
// fiber's trace, and their path (`fibertrace_fiber::sched::block`, `::sleep`, ...) is what
// users read at the top of a dump.

/// Marker payload of the unwinding that cancels a fiber.
pub(crate) struct Cancelled;

/// Switches the running fiber (`ctx`: its context, which the caller has already read) back
/// to the scheduler (the other suspension point is `Inner::run_nested`): records the
/// registers (when tracing), publishes `Suspended`, and switches. After the resume, raises the
/// cancellation if the fiber was cancelled meanwhile and `raise` (false: the caller looks at
/// its wait's outcome first, see [`block`]).
#[inline(never)]
pub(crate) fn suspend_current(ctx: &FiberCore, why: Yield, raise: bool) {
    if ctx.dropping.get() {
        // Its scheduler is being dropped and unwinds this fiber's stack: nothing will resume
        // it, and a switch now would make corosensei unwind again from inside the
        // destructor that waits (a panic while panicking: the process aborts). The wait
        // ends at once; the waits that loop see `dropping()` and give up.
        return;
    }
    let shared = &ctx.shared;
    shared.record_suspension();
    shared.run.publish_suspended();
    let y = ctx.yielder.get();
    // SAFETY: the yielder pointer was stored by this fiber when it started; it points into
    // its own stack (corosensei's parent link), valid for the coroutine's whole life.
    unsafe { (*y).suspend(why) };
    std::hint::black_box(());
    if raise {
        check_cancel(ctx);
    }
}

fn check_cancel(ctx: &FiberCore) {
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

/// Asks the running scheduler's loop (`run`, `block_on`) to return at the end of the current
/// turn, whatever fibers are still ready then (they stay in place, as after a deadlock): for a
/// program whose main fiber failed and should end now, not after the others are done —
/// `block_on` ends when the main fiber has ended and no fiber is ready, which a fiber that
/// only yields never lets happen. Outside a fiber, does nothing.
pub fn end_run_after_turn() {
    with_sched(|s| s.end_after_turn.set(true));
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

/// Whether the current fiber is being unwound by its scheduler's drop: its waits end at
/// once (see `suspend_current`), and the waits that loop give up.
pub(crate) fn dropping() -> bool {
    current_ctx().is_some_and(|c| c.dropping.get())
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
        let p = SCHED.with(|s| s.get());
        // SAFETY: see with_sched.
        if !p.is_null() && unsafe { &*p }.yield_in_place(ctx) {
            std::hint::black_box(());
            check_cancel(ctx);
            return;
        }
        suspend_current(ctx, Yield::Ready, true);
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
        suspend_current(ctx, Yield::Ready, true);
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

/// Sleeps for `d` (other fibers run meanwhile). A [`Fiber::wakeup`] ends it early. A `d` too
/// long for the clock (`Duration::MAX`) sleeps until woken, as `std::thread::sleep` does.
#[inline(never)]
pub fn sleep(d: Duration) {
    let Some(ctx) = current_ctx() else {
        std::thread::sleep(d);
        return;
    };
    let fid = ctx.shared.id;
    if let Some(when) = Instant::now().checked_add(d) {
        with_sched(|s| s.add_timer(fid, when));
    }
    ctx.shared.begin_wait(Status::Sleeping, WaitOn::Sleep);
    suspend_current(ctx, Yield::Blocked, true);
    ctx.shared.end_wait();
}

/// Blocks the current fiber on `on` until something makes it ready (a wake-up, or the
/// optional deadline). Used by channels, conditions and joins. A cancelled fiber does not
/// start the wait (Tarantool: a channel or condition wait of a cancelled fiber fails at once;
/// it unwinds). A cancellation that comes during the wait does not unwind out of it: returns
/// whether the fiber is cancelled then (and not unwinding already), for the caller to look
/// at the wait's outcome first (a channel's value handed to the fiber is still returned to
/// it, as Tarantool does), then raise it with [`raise_cancel`].
#[inline(never)]
#[must_use]
pub(crate) fn block(on: WaitOn, deadline: Option<Instant>) -> bool {
    let Some(ctx) = current_ctx() else {
        return false;
    };
    check_cancel(ctx);
    let fid = ctx.shared.id;
    if let Some(d) = deadline {
        with_sched(|s| s.add_timer(fid, d));
    }
    ctx.shared.begin_wait(Status::Waiting, on);
    suspend_current(ctx, Yield::Blocked, false);
    ctx.shared.end_wait();
    ctx.shared.cancelled.load(Ordering::Relaxed) && !ctx.unwinding.get()
}

/// Raises the current fiber's cancellation (unwinds) if it was cancelled and is not unwinding
/// already; otherwise nothing.
pub(crate) fn raise_cancel() {
    if let Some(ctx) = current_ctx() {
        check_cancel(ctx);
    }
}

/// Suspends the current fiber until [`Fiber::wakeup`] (Tarantool's `fiber.yield` without
/// requeue is `yield_now`; this is a plain park).
#[inline(never)]
pub fn suspend() {
    let Some(ctx) = current_ctx() else {
        return;
    };
    ctx.shared.begin_wait(Status::Suspended, WaitOn::Wakeup);
    suspend_current(ctx, Yield::Blocked, true);
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
