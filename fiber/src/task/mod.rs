//! The fiber itself, as every thread may see it: its control block ([`ControlBlock`]), its
//! run state ([`state`]) and its parent trace ([`parent`]).
//!
//! The control block is what other threads read about a fiber (status, wait, counters, stack
//! bounds, saved registers); the scheduler's thread is its only writer. The registers are
//! read only under an inspection ([`state::RunCell::inspect`]), the one primitive every walk
//! of a parked stack goes through ([`ControlBlock::with_parked`]).
//!
//! How a result can be wrong: fields other than the registers are read without a lock, each
//! on its own, so a report may combine a status and a switch count from two moments a few
//! nanoseconds apart; a walk is exact for the suspension it reads (a cached walk is reused
//! only at the same switch count).

pub(crate) mod barrier;
pub(crate) mod parent;
pub(crate) mod state;

pub use parent::{
    parent_trace_copies, ParentTrace, PARENT_DEPTH_KEPT, PARENT_DEPTH_SHOWN, PARENT_FRAMES,
};
pub(crate) use state::{RunCell, RunState};

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use fibertrace_core::{Backtrace, CaptureOptions, Frame, SavedContext, StackBounds};

use crate::frames::FrameInfo;

use serde::{Deserialize, Serialize};

/// Identifier of a fiber, unique in the process (never reused).
pub type FiberId = u64;

/// How a fiber's function ended (its control block's `outcome`): not yet, returned, cancelled,
/// panicked.
pub(crate) const OUTCOME_NONE: u8 = 0;
pub(crate) const OUTCOME_OK: u8 = 1;
pub(crate) const OUTCOME_CANCELLED: u8 = 2;
pub(crate) const OUTCOME_PANICKED: u8 = 3;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_fiber_id() -> FiberId {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// What a fiber is doing, as reported by info and dumps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Executing now.
    Running,
    /// Runnable, waiting for its turn (never ran yet, yielded, or woken up).
    Ready,
    /// Suspended by an explicit [`crate::suspend`] with no wake-up condition.
    Suspended,
    /// Sleeping until a deadline.
    Sleeping,
    /// Blocked on a channel, condition or join.
    Waiting,
    /// Finished.
    Dead,
}

impl Status {
    /// Whether a fiber in this status waits (sleeps, is blocked or suspended): what it waits
    /// on is recorded until it runs again, but a fiber woken meanwhile (ready) waits no more
    /// — it was shown as still waiting, `[sleep, 23ms]`, where it was about to run.
    pub fn waits(self) -> bool {
        matches!(self, Status::Suspended | Status::Sleeping | Status::Waiting)
    }
}

/// What a fiber waits on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitOn {
    /// A sleep.
    Sleep,
    /// A receive on channel `n`.
    ChannelReceive(u64),
    /// A send on channel `n` (full).
    ChannelSend(u64),
    /// A condition variable `n`.
    Condition(u64),
    /// The end of fiber `n`.
    Join(FiberId),
    /// An explicit wake-up ([`crate::suspend`]).
    Wakeup,
}

impl WaitOn {
    /// One word: the kind in the low 3 bits, the object's id above (ids stay below 2^61).
    fn pack(on: Option<WaitOn>) -> u64 {
        let (tag, id) = match on {
            None => (0, 0),
            Some(WaitOn::Sleep) => (1, 0),
            Some(WaitOn::ChannelReceive(n)) => (2, n),
            Some(WaitOn::ChannelSend(n)) => (3, n),
            Some(WaitOn::Condition(n)) => (4, n),
            Some(WaitOn::Join(n)) => (5, n),
            Some(WaitOn::Wakeup) => (6, 0),
        };
        (id << 3) | tag
    }

    pub(crate) fn unpack(v: u64) -> Option<WaitOn> {
        let id = v >> 3;
        Some(match v & 7 {
            1 => WaitOn::Sleep,
            2 => WaitOn::ChannelReceive(id),
            3 => WaitOn::ChannelSend(id),
            4 => WaitOn::Condition(id),
            5 => WaitOn::Join(id),
            6 => WaitOn::Wakeup,
            _ => return None,
        })
    }

    /// In words, without allocating where the words are fixed.
    pub fn words(&self) -> std::borrow::Cow<'static, str> {
        use std::borrow::Cow;
        match self {
            WaitOn::Sleep => Cow::Borrowed("sleep"),
            WaitOn::ChannelReceive(_) => Cow::Borrowed("channel receive"),
            WaitOn::ChannelSend(_) => Cow::Borrowed("channel send"),
            WaitOn::Condition(_) => Cow::Borrowed("condition wait"),
            WaitOn::Join(id) => Cow::Owned(format!("join fiber {id}")),
            WaitOn::Wakeup => Cow::Borrowed("suspended"),
        }
    }
}

impl std::fmt::Display for WaitOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitOn::Sleep => f.write_str("sleep"),
            WaitOn::ChannelReceive(_) => f.write_str("channel receive"),
            WaitOn::ChannelSend(_) => f.write_str("channel send"),
            WaitOn::Condition(_) => f.write_str("condition wait"),
            WaitOn::Join(id) => write!(f, "join fiber {id}"),
            WaitOn::Wakeup => f.write_str("suspended"),
        }
    }
}

/// Bytes of a parked stack prefetched ahead of its walk (from the stack pointer up).
const PREFETCH_STACK: usize = 1024;

impl Status {
    pub(crate) fn from_u8(v: u8) -> Status {
        match v {
            0 => Status::Running,
            1 => Status::Ready,
            2 => Status::Suspended,
            3 => Status::Sleeping,
            4 => Status::Waiting,
            _ => Status::Dead,
        }
    }
    fn to_u8(self) -> u8 {
        match self {
            Status::Running => 0,
            Status::Ready => 1,
            Status::Suspended => 2,
            Status::Sleeping => 3,
            Status::Waiting => 4,
            Status::Dead => 5,
        }
    }
}

/// A walk of a parked stack, kept until the fiber runs again.
struct TraceCache {
    csw: u64,
    opts: CaptureOptions,
    frames: Box<[Frame]>,
    /// The same frames as fiber info hands them out (resolved or not), shared by every
    /// info call until the fiber runs again.
    info: Option<(bool, Arc<[FrameInfo]>)>,
}

/// A panic that ended a fiber.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PanicReport {
    /// The panic message.
    pub message: String,
    /// Where it was raised (file:line:col), when known.
    pub location: Option<String>,
    /// The fiber's stack when it panicked.
    pub backtrace: Backtrace,
}

/// A fiber's name and parent as a reader in another process reads them (see
/// `crate::publish`): plain words, where the control block keeps an `Arc<str>` behind a
/// mutex and an `Option`.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct Published {
    /// The name's bytes (the `Arc<str>` in `name` keeps them alive) and length; written
    /// under `name`'s lock, the pointer last.
    pub name_len: AtomicU64,
    pub name_ptr: AtomicU64,
    /// The creator's fiber id (0: none, or a thread).
    pub parent: AtomicU64,
}

impl Published {
    fn new(name: &Arc<str>, parent: Option<FiberId>) -> Published {
        let p = Published::default();
        p.set_name(name);
        p.parent.store(parent.unwrap_or(0), Ordering::Relaxed);
        p
    }

    /// Publishes `name` (kept alive by the caller's `Arc` in the block's `name`).
    pub(crate) fn set_name(&self, name: &Arc<str>) {
        self.name_ptr.store(0, Ordering::Release);
        self.name_len.store(name.len() as u64, Ordering::Release);
        self.name_ptr.store(name.as_ptr() as u64, Ordering::Release);
    }
}

/// The control block of one fiber. Shared with other threads through the registry.
///
/// Laid out in declaration order (`repr(C)`), on cache-line boundaries: the first line holds
/// what changes as the fiber runs and what every listing reads (status, what it waits on,
/// counters, stack in use), the second what a listing reads and rarely changes (id, stack
/// bounds, parent, name); a report over many fibers touches two lines per block, which
/// [`ControlBlock::prefetch`] asks for ahead of use.
#[repr(C, align(64))]
pub struct ControlBlock {
    // Line 0.
    status: AtomicU8,
    pub(crate) run: RunCell,
    /// How its function ended (`OUTCOME_*`), written by the fiber as it finishes.
    pub(crate) outcome: AtomicU8,
    pub(crate) cancelled: AtomicBool,
    /// Whether suspensions record the registers (tracing on).
    pub(crate) traced: bool,
    /// The creation time is taken when it first runs (see [`crate::Builder::created_at_start`]).
    pub(crate) created_at_start: bool,
    /// What a blocked fiber waits on (set only for blocking waits, not for yields).
    /// Packed ([`WaitOn::pack`]): one atomic word, so reading it from another thread takes
    /// no lock.
    wait_on: AtomicU64,
    /// Clock ticks when the current status began.
    pub(crate) since: AtomicU64,
    pub(crate) csw: AtomicU64,
    pub(crate) cpu_ticks: AtomicU64,
    /// Stack pointer at the last suspension.
    pub(crate) last_sp: AtomicU64,
    pub(crate) stack_size: usize,
    /// The switch count of the walk in `trace_cache` (a hint readable without the lock:
    /// whether a new walk is due, so its stack is worth prefetching).
    walked_csw: AtomicU64,
    // Line 1.
    pub(crate) id: FiberId,
    pub(crate) stack: StackBounds,
    pub(crate) parent: Option<FiberId>,
    pub(crate) name: Mutex<Arc<str>>,
    // The rest.
    pub(crate) sched: u64,
    /// Its scheduler thread's [`state::thread_mark`]: an inspector there needs no handshake.
    thread_mark: usize,
    pub(crate) parent_trace: Option<ParentTrace>,
    /// Clock ticks at creation (see [`crate::clock`]; reading the system clocks twice per
    /// spawn cost more than the rest of the bookkeeping). With `created_at_start`, the
    /// scheduler's last accounting point until the fiber first runs, then its start.
    pub(crate) created: AtomicU64,
    /// Written by the fiber before publishing SUSPENDED; read only under an inspection
    /// (`with_parked`).
    ctx: UnsafeCell<SavedContext>,
    /// Stack pointer of the runtime's entry frame on this fiber's stack, at its call of the
    /// user's code (0 before start): walks of this fiber end below it.
    pub(crate) entry_sp: AtomicU64,
    /// Lowest stack pointer seen at a suspension or sample.
    pub(crate) min_sp: AtomicU64,
    /// A word the layer above attaches to the fiber (the Lua host: its Lua thread), for its
    /// signal handler (see `crate::Fiber::set_layer_word`).
    pub(crate) layer_word: AtomicU64,
    /// What a reader in another process needs that the fields above keep in Rust's own
    /// layouts (see `crate::publish`).
    pub(crate) published: Published,
    /// Address of the fiber's entry function (shown for a fiber that never ran).
    pub(crate) entry_fn: u64,
    /// The type name of the fiber's entry closure (a closure has no symbol of its own).
    pub(crate) entry_name: &'static str,
    pub(crate) panic: Mutex<Option<Box<PanicReport>>>,
    /// The last walk of this fiber's suspended stack: valid while the fiber has not been
    /// resumed since (same switch count), for the same capture options.
    trace_cache: Mutex<Option<TraceCache>>,
    /// What its heap allocations are charged to (see `fibertrace_core::heap`): current
    /// while it runs, closed when it ends.
    pub(crate) heap: fibertrace_core::heap::Owner,
}

// The two lines a listing reads (see `ControlBlock`): only speed depends on it.
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::offset_of!(ControlBlock, id) == 64);
    assert!(std::mem::offset_of!(ControlBlock, sched) == 128);
};

// SAFETY: every field is Sync except `ctx`, which is written only by the fiber's own thread
// while the fiber runs (run == RUNNING) and read by other threads only under an inspection
// (`state::RunCell::inspect`), which orders the accesses (release / acquire, and the
// handshake's barrier).
unsafe impl Sync for ControlBlock {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for ControlBlock {}

impl std::fmt::Debug for ControlBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlBlock")
            .field("id", &self.id)
            .field("name", &&*self.name_arc())
            .field("run", &self.run)
            .finish()
    }
}

/// How a new fiber gets its parent trace.
pub(crate) enum ParentInit<'a> {
    None,
    /// Made by hand (a host's interleaved frames).
    Given(Box<ParentTrace>),
    /// Return addresses just captured from the creator's stack: the trace is built from them
    /// in place, in the new control block (no copy of a few hundred bytes per spawn).
    Captured {
        creator: Option<Arc<ControlBlock>>,
        thread_name: Option<Arc<str>>,
        ras: &'a [u64],
    },
}

pub(crate) struct NewFiber<'a> {
    pub id: FiberId,
    /// Clock ticks at its creation.
    pub now: u64,
    /// `now` is provisional: the creation time is taken at the first run.
    pub created_at_start: bool,
    pub sched: u64,
    pub name: Arc<str>,
    /// The creating fiber's id, 0 for none (a plain word: an `Option` of two words, just
    /// written, was read back as one 16-byte load, which stalls on store forwarding).
    pub parent: FiberId,
    pub parent_trace: ParentInit<'a>,
    pub stack: StackBounds,
    pub stack_size: usize,
    pub entry_fn: u64,
    pub entry_name: &'static str,
    pub traced: bool,
}

impl NewFiber<'_> {
    fn parent(&self) -> Option<FiberId> {
        (self.parent != 0).then_some(self.parent)
    }
}

impl ControlBlock {
    /// A new control block, built in place in its shared allocation (a control block is
    /// several hundred bytes; building it on the stack and moving it in cost a copy per spawn).
    /// (`n` by reference: a by-value move is a copy of its ~160 bytes just written, which
    /// stalls on store forwarding.)
    pub(crate) fn new_shared(n: &mut NewFiber<'_>) -> Arc<Self> {
        let mut a = Arc::<ControlBlock>::new_uninit();
        let slot = Arc::get_mut(&mut a).expect("a new Arc is unique");
        let (given, captured) = Self::split_parent(n);
        let f = slot.write(ControlBlock::new(n, given));
        f.fill_parent_frames(captured);
        // SAFETY: fully written just above.
        unsafe { a.assume_init() }
    }

    /// Makes `this` the control block of a new fiber: in place when nothing else holds the
    /// old one (a finished fiber's block, kept by its recycled slot box: one allocation
    /// and free less per spawn), else in a new allocation.
    pub(crate) fn renew(this: &mut Arc<Self>, n: &mut NewFiber<'_>) {
        let Some(m) = Arc::get_mut(this) else {
            *this = Self::new_shared(n);
            return;
        };
        // Field by field, only what a new fiber changes: building a whole new block and
        // moving it in copied its ~700 bytes (the inline parent-trace buffer included). The
        // pattern names every field, so a field added later must be handled here too.
        let ControlBlock {
            id,
            sched,
            thread_mark,
            name,
            parent,
            parent_trace,
            created,
            created_at_start,
            run,
            ctx,
            entry_sp,
            stack,
            stack_size,
            min_sp,
            last_sp,
            layer_word,
            published,
            status,
            wait_on,
            since,
            csw,
            cpu_ticks,
            cancelled,
            entry_fn,
            entry_name,
            panic,
            outcome,
            trace_cache,
            walked_csw,
            traced,
            heap,
        } = m;
        *id = n.id;
        *sched = n.sched;
        *thread_mark = state::thread_mark();
        *name.get_mut().unwrap_or_else(|e| e.into_inner()) = n.name.clone();
        name.clear_poison();
        *parent = n.parent();
        // Only a given or captured trace is moved in; "none" is a store of the tag, decided
        // before any trace value exists (moving a whole empty Option of this size, even
        // only out of `split_parent`, was a 392-byte copy per spawn: ~8% of a Lua create).
        let captured = if matches!(n.parent_trace, ParentInit::None) {
            *parent_trace = None;
            None
        } else {
            let (given, captured) = Self::split_parent(n);
            *parent_trace = given;
            captured
        };
        *created.get_mut() = n.now;
        *created_at_start = n.created_at_start;
        run.reset();
        *ctx.get_mut() = SavedContext::new(n.stack);
        *entry_sp.get_mut() = 0;
        *stack = n.stack;
        *stack_size = n.stack_size;
        *min_sp.get_mut() = n.stack.hi;
        *last_sp.get_mut() = n.stack.hi;
        *layer_word.get_mut() = 0;
        published.set_name(&n.name);
        *published.parent.get_mut() = n.parent().unwrap_or(0);
        *status.get_mut() = Status::Ready.to_u8();
        *wait_on.get_mut() = 0;
        *since.get_mut() = n.now;
        *csw.get_mut() = 0;
        *cpu_ticks.get_mut() = 0;
        *cancelled.get_mut() = false;
        *entry_fn = n.entry_fn;
        *entry_name = n.entry_name;
        *panic.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        panic.clear_poison();
        *outcome.get_mut() = OUTCOME_NONE;
        *trace_cache.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        trace_cache.clear_poison();
        *walked_csw.get_mut() = u64::MAX;
        *traced = n.traced;
        // (The old owner was closed when its fiber ended; dropping it again is a no-op.)
        *heap = fibertrace_core::heap::Owner::new(n.id);
        m.fill_parent_frames(captured);
    }

    /// The parent trace to build, and the creator's return addresses to copy into it.
    fn split_parent<'a>(n: &mut NewFiber<'a>) -> (Option<ParentTrace>, Option<&'a [u64]>) {
        // The usual case looks at the tag only: moving the whole value out, just written
        // field by field, stalled on store forwarding.
        if matches!(n.parent_trace, ParentInit::None) {
            return (None, None);
        }
        match std::mem::replace(&mut n.parent_trace, ParentInit::None) {
            ParentInit::None => (None, None),
            ParentInit::Given(t) => (Some(*t), None),
            ParentInit::Captured {
                creator,
                thread_name,
                ras,
            } => (Some(ParentTrace::linked(creator, thread_name)), Some(ras)),
        }
    }

    /// Copies captured return addresses into the (inline) parent trace.
    fn fill_parent_frames(&mut self, captured: Option<&[u64]>) {
        if let (Some(t), Some(ras)) = (self.parent_trace.as_mut(), captured) {
            t.fill_return_addresses(ras);
        }
    }

    #[inline(always)]
    fn new(n: &NewFiber<'_>, parent_trace: Option<ParentTrace>) -> Self {
        let now = n.now;
        ControlBlock {
            id: n.id,
            sched: n.sched,
            thread_mark: state::thread_mark(),
            name: Mutex::new(n.name.clone()),
            parent: n.parent(),
            parent_trace,
            created: AtomicU64::new(now),
            created_at_start: n.created_at_start,
            run: RunCell::new(),
            ctx: UnsafeCell::new(SavedContext::new(n.stack)),
            entry_sp: AtomicU64::new(0),
            stack: n.stack,
            stack_size: n.stack_size,
            min_sp: AtomicU64::new(n.stack.hi),
            last_sp: AtomicU64::new(n.stack.hi),
            layer_word: AtomicU64::new(0),
            published: Published::new(&n.name, n.parent()),
            status: AtomicU8::new(Status::Ready.to_u8()),
            wait_on: AtomicU64::new(0),
            since: AtomicU64::new(now),
            csw: AtomicU64::new(0),
            cpu_ticks: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            entry_fn: n.entry_fn,
            entry_name: n.entry_name,
            panic: Mutex::new(None),
            outcome: AtomicU8::new(OUTCOME_NONE),
            trace_cache: Mutex::new(None),
            walked_csw: AtomicU64::new(u64::MAX),
            traced: n.traced,
            heap: fibertrace_core::heap::Owner::new(n.id),
        }
    }

    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        self.id
    }

    /// The trace of its creator at the spawn, with the creator's ancestors chained.
    pub fn parent_trace(&self) -> Option<&ParentTrace> {
        self.parent_trace.as_ref()
    }

    /// The fiber's name.
    pub fn name(&self) -> String {
        self.name_arc().to_string()
    }

    /// Where the fields a reader in another process needs are (see `crate::publish`).
    pub(crate) const CTX_OFFSET: usize = std::mem::offset_of!(ControlBlock, ctx);
    pub(crate) const STATUS_OFFSET: usize = std::mem::offset_of!(ControlBlock, status);
    pub(crate) const WAIT_ON_OFFSET: usize = std::mem::offset_of!(ControlBlock, wait_on);

    /// Renames the fiber.
    pub(crate) fn set_name_arc(&self, name: Arc<str>) {
        let mut g = self.name.lock().unwrap_or_else(|e| e.into_inner());
        self.published.set_name(&name);
        // (The old name's bytes are freed after the new ones are published.)
        *g = name;
    }

    /// The heap charged to the fiber and still live (zero when the process's allocator does
    /// not track it; see `fibertrace_core::heap`).
    pub fn heap_usage(&self) -> fibertrace_core::heap::Usage {
        self.heap.usage()
    }

    /// The fiber's name, shared (no copy).
    pub fn name_arc(&self) -> Arc<str> {
        self.name.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs `f` on the name under its lock (no clone: for a listing that compares it with
    /// the name it saw last). `f` must not reach this fiber's name again (it would wait on
    /// itself): run no callbacks or scripts in it.
    #[inline]
    pub fn with_name<R>(&self, f: impl FnOnce(&Arc<str>) -> R) -> R {
        f(&self.name.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records the suspension point. Called by the fiber itself, on its own stack, in the
    /// suspend wrapper, just before publishing SUSPENDED.
    #[inline(always)]
    pub(crate) fn record_suspension(&self) {
        if self.traced {
            // SAFETY: the fiber is RUNNING on this thread: nobody else reads `ctx` until
            // SUSPENDED is published (release) after this write.
            let ctx = unsafe { &mut *self.ctx.get() };
            ctx.record();
            let sp = ctx.regs.sp;
            self.last_sp.store(sp, Ordering::Relaxed);
            if sp < self.min_sp.load(Ordering::Relaxed) {
                self.min_sp.store(sp, Ordering::Relaxed);
            }
        }
    }

    /// Sets where the walks of the fiber's recorded contexts end (once, when the fiber
    /// starts, before its entry stack pointer is published: see `entry_sp_here!`).
    pub(crate) fn set_stop_sp(&self, sp: u64) {
        // SAFETY: called by the fiber itself while RUNNING (see record_suspension).
        unsafe { (*self.ctx.get()).stop_sp = sp };
    }

    /// The one inspection primitive: if the fiber is suspended (and traced), holds it there
    /// (no resume, no free) while `f` runs with its saved context and its switch count.
    /// `None` if it is in any other state.
    #[inline]
    pub(crate) fn with_parked<R>(&self, f: impl FnOnce(&SavedContext, u64) -> R) -> Option<R> {
        if !self.traced {
            return None;
        }
        let _inspection = self.run.inspect(state::thread_mark() == self.thread_mark)?;
        // While inspected the fiber cannot be resumed: its switch count is stable.
        let csw = self.csw.load(Ordering::Relaxed);
        // SAFETY: the inspection holds the fiber suspended: nothing writes `ctx` until it
        // ends, and the fiber wrote it before publishing `Suspended` (acquired above).
        let ctx = unsafe { &*self.ctx.get() };
        Some(f(ctx, csw))
    }

    /// Whether a walk is kept in the fiber (for tests of [`ControlBlock::inspect_suspended`]).
    #[cfg(test)]
    pub(crate) fn has_kept_walk(&self) -> bool {
        self.trace_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Whether the fiber is parked now in the suspension counted `csw` (its switch count
    /// read before and after its state): a walk kept at that count is its trace now.
    fn parked_at(&self, csw: u64) -> bool {
        self.traced
            && self.csw.load(Ordering::Acquire) == csw
            && matches!(
                self.run.get(Ordering::Acquire),
                RunState::Suspended | RunState::Inspecting
            )
            && self.csw.load(Ordering::Acquire) == csw
    }

    /// Walks the fiber's stack if it is suspended, never racing a resume (with `keep`, a
    /// walk kept since it last ran is reused, and a new one kept; without, the walk is new
    /// and not kept: for a caller that keeps traces of its own). False if it is not
    /// suspended (running, new, dead) or tracing is off.
    pub(crate) fn inspect_suspended(
        &self,
        opts: &CaptureOptions,
        out: &mut Backtrace,
        keep: bool,
    ) -> bool {
        if keep {
            // A walk kept for the suspension now: no handshake (see `suspended_info`).
            let c = self.trace_cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = c
                .as_ref()
                .filter(|t| t.opts == *opts && self.parked_at(t.csw))
            {
                out.set_frames(&t.frames);
                return true;
            }
        }
        self.with_parked(|ctx, csw| {
            if !keep {
                fibertrace_core::collect_from_into(ctx, opts, out);
                return;
            }
            let cached = {
                let c = self.trace_cache.lock().unwrap_or_else(|e| e.into_inner());
                match &*c {
                    Some(t) if t.csw == csw && t.opts == *opts => {
                        out.set_frames(&t.frames);
                        true
                    }
                    _ => false,
                }
            };
            if !cached {
                fibertrace_core::collect_from_into(ctx, opts, out);
                *self.trace_cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(TraceCache {
                    csw,
                    opts: *opts,
                    frames: out.frames().into(),
                    info: None,
                });
                self.walked_csw.store(csw, Ordering::Relaxed);
            }
        })
        .is_some()
    }

    /// The suspended fiber's frames as fiber info hands them out: `build` turns a walk into
    /// the list, and the list is kept and shared until the fiber runs again. `None` when the
    /// fiber is not suspended (or not traced).
    ///
    /// The walk is done under the inspection; `build` (which may resolve symbols, slow the
    /// first time) runs after it, so a resume never waits for symbolization.
    pub(crate) fn suspended_info(
        &self,
        opts: &CaptureOptions,
        resolve: bool,
        build: impl FnOnce(&[Frame]) -> Arc<[FrameInfo]>,
    ) -> Option<Arc<[FrameInfo]>> {
        let mut bt = Backtrace::new();
        let mut c = self.trace_cache.lock().unwrap_or_else(|e| e.into_inner());
        // The list kept for the fiber's suspension now, handed out with no handshake (none
        // reads the stack; from another thread, the handshake is a system call).
        if let Some(t) = c
            .as_ref()
            .filter(|t| t.opts == *opts && self.parked_at(t.csw))
        {
            if let Some((r, i)) = &t.info {
                if *r == resolve {
                    return Some(i.clone());
                }
            }
        }
        let (csw, kept) = self.with_parked(|ctx, csw| {
            let kept = c.as_ref().is_some_and(|t| t.csw == csw && t.opts == *opts);
            if !kept {
                fibertrace_core::collect_from_into(ctx, opts, &mut bt);
            }
            (csw, kept)
        })?;
        // The kept walk, or a new one that found the very same frames (the fiber ran and
        // parked at the same place again, as workers on a queue do): the list still holds.
        if let Some(t) = c
            .as_mut()
            .filter(|t| t.opts == *opts && (kept || *t.frames == *bt.frames()))
        {
            t.csw = csw;
            self.walked_csw.store(csw, Ordering::Relaxed);
            match &t.info {
                Some((r, i)) if *r == resolve => return Some(i.clone()),
                _ if kept => bt.set_frames(&t.frames),
                _ => {}
            }
        }
        drop(c);
        let info = build(bt.frames());
        let mut c = self.trace_cache.lock().unwrap_or_else(|e| e.into_inner());
        // Keep it unless the fiber ran (and was walked again) in the meantime.
        if c.as_ref().is_none_or(|t| t.csw <= csw) {
            *c = Some(TraceCache {
                csw,
                opts: *opts,
                frames: bt.frames().into(),
                info: Some((resolve, info.clone())),
            });
            self.walked_csw.store(csw, Ordering::Relaxed);
        }
        Some(info)
    }

    /// Starts loading this fiber's control block into cache (for a loop over many fibers).
    pub(crate) fn prefetch_block(self: &Arc<Self>) {
        fibertrace_core::capture::prefetch(Arc::as_ptr(self) as u64, std::mem::size_of::<Self>());
    }

    /// Starts loading the used part of a parked stack (up to 1 KiB from the stack pointer)
    /// when a walk of it is due: its frames are then read from cache, not one memory round
    /// trip per frame. A hint; racy reads of the atomics are fine.
    pub fn prefetch_stack(&self) {
        if self.walked_csw.load(Ordering::Relaxed) == self.csw.load(Ordering::Relaxed) {
            return;
        }
        self.prefetch_walk();
    }

    /// [`ControlBlock::prefetch_stack`] for a caller that knows a walk is due (it keeps
    /// traces of its own): the stack, and the block's line with the saved registers.
    pub fn prefetch_walk(&self) {
        if self.run.get(Ordering::Relaxed) != RunState::Suspended {
            return;
        }
        fibertrace_core::capture::prefetch(self.ctx.get() as u64, 64);
        let sp = self.last_sp.load(Ordering::Relaxed);
        if self.stack.contains(sp) {
            // The first line into the first level, then the rest into the second. Asked
            // into the second level only, the lines were often not there when the walk came
            // (a parked Lua fiber's stack is one page since fiber bodies keep no panic
            // report in their frame; most of the walk's time went to loads of frames that
            // had been asked for): `fiber.info()` over 10,000 Lua fibers that all ran since
            // the last listing, 8.6-9.1 -> 5.4-6.5 ms (the first line alone into the first
            // level); the CPU seems to drop a second-level request whose page's
            // translation it does not have, and to fetch the translation for a first-level
            // one.
            fibertrace_core::capture::prefetch(sp, 8);
            fibertrace_core::capture::prefetch_far(
                sp,
                ((self.stack.hi - sp) as usize).min(PREFETCH_STACK),
            );
        }
    }

    /// The saved context, for the sampling signal handler when it interrupts the fiber
    /// between publishing SUSPENDED and finishing the switch.
    ///
    /// # Safety
    /// Only on the fiber's own thread, from a signal handler that interrupted the fiber
    /// (while it switches away after publishing SUSPENDED, or while it switches back in):
    /// nothing writes the context then.
    pub(crate) unsafe fn saved_context_in_handler(&self) -> SavedContext {
        // SAFETY: per the contract the context was fully written (program order on this
        // thread) and nothing writes it until the fiber runs again.
        unsafe { *self.ctx.get() }
    }

    /// Counts a switch into the fiber (the scheduler's thread is the only writer: a load and
    /// a store, no locked read-modify-write).
    #[inline]
    pub(crate) fn add_switch(&self) {
        single_writer_add(&self.csw, 1);
    }

    /// Adds the CPU ticks of a run (single writer, as [`ControlBlock::add_switch`]).
    #[inline]
    pub(crate) fn add_ticks(&self, ticks: u64) {
        single_writer_add(&self.cpu_ticks, ticks);
    }

    /// Sets the status (cheap: no lock, no clock read beyond the tick counter).
    #[inline]
    pub(crate) fn set_status(&self, status: Status) {
        self.status.store(status.to_u8(), Ordering::Relaxed);
    }

    /// Enters a blocking wait on `on`.
    pub(crate) fn begin_wait(&self, status: Status, on: WaitOn) {
        self.wait_on
            .store(WaitOn::pack(Some(on)), Ordering::Relaxed);
        self.since.store(crate::clock::ticks(), Ordering::Relaxed);
        self.set_status(status);
    }

    /// Leaves a blocking wait.
    pub(crate) fn end_wait(&self) {
        self.wait_on.store(0, Ordering::Relaxed);
    }

    /// Status, what it waits on, and the clock ticks when the status began.
    pub(crate) fn status_raw(&self) -> (Status, Option<WaitOn>, u64) {
        let st = Status::from_u8(self.status.load(Ordering::Relaxed));
        let on = WaitOn::unpack(self.wait_on.load(Ordering::Relaxed)).filter(|_| st.waits());
        (st, on, self.since.load(Ordering::Relaxed))
    }

    /// The status alone: one load (`status` also reads the clock, ~10 ns on some CPUs, for
    /// how long; a listing that only asks whether a fiber ran or ended calls this).
    #[inline]
    pub fn state(&self) -> Status {
        Status::from_u8(self.status.load(Ordering::Relaxed))
    }

    /// The status, what it waits on, and for how long.
    pub fn status(&self) -> (Status, Option<WaitOn>, std::time::Duration) {
        self.status_at(crate::clock::ticks())
    }

    /// As [`ControlBlock::status`], "how long" counted up to `now` (from
    /// [`crate::clock::ticks`]): a caller reporting on many fibers reads the clock once.
    pub fn status_at(&self, now: u64) -> (Status, Option<WaitOn>, std::time::Duration) {
        self.status_with(now, crate::clock::Rate::now())
    }

    /// As [`ControlBlock::status_at`], converted with a rate read once for many fibers.
    #[inline]
    pub fn status_with(
        &self,
        now: u64,
        rate: crate::clock::Rate,
    ) -> (Status, Option<WaitOn>, std::time::Duration) {
        let (st, on, since) = self.status_raw();
        (st, on, rate.duration(now.saturating_sub(since)))
    }

    /// Asks the CPU for the block's two first cache lines (what a listing reads: see the
    /// layout), so that a report over many blocks overlaps their misses; a hint only.
    #[inline]
    pub fn prefetch(&self) {
        fibertrace_core::arch::prefetch(self as *const ControlBlock as u64, 128);
    }

    /// Whether the fiber has finished.
    pub fn is_dead(&self) -> bool {
        self.run.get(Ordering::Acquire) == RunState::Dead
    }

    /// Context switches (resumes) so far.
    pub fn csw(&self) -> u64 {
        self.csw.load(Ordering::Relaxed)
    }

    /// CPU time it ran so far, counted while its scheduler times runs: always with
    /// `SchedulerOptions::cpu_time`, otherwise while `fiber.top` accounting is on (or slices
    /// are in use); zero for a fiber that never ran then.
    pub fn cpu_time(&self) -> std::time::Duration {
        self.cpu_time_with(crate::clock::Rate::now())
    }

    /// As [`ControlBlock::cpu_time`], converted with a rate read once for many fibers.
    #[inline]
    pub fn cpu_time_with(&self, rate: crate::clock::Rate) -> std::time::Duration {
        rate.duration(self.cpu_ticks.load(Ordering::Relaxed))
    }

    /// Stack size in bytes.
    pub fn stack_size(&self) -> usize {
        self.stack_size
    }

    /// Stack in use at the last suspension, in bytes.
    pub fn stack_used(&self) -> usize {
        self.stack
            .hi
            .saturating_sub(self.last_sp.load(Ordering::Relaxed)) as usize
    }

    /// Whether it was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// Adds to a counter that only one thread writes (others only read it): a relaxed load and
/// store instead of a locked add, which costs as much as several ordinary instructions.
#[inline]
pub(crate) fn single_writer_add(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}
