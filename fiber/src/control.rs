//! The fiber control block: what other threads may read about a fiber, and the handshake
//! that keeps a walk of its stack from racing a resume.
//!
//! Run states (one atomic byte):
//!
//! ```text
//!   NEW --resume--> RUNNING --suspend--> SUSPENDED --resume--> RUNNING ... --return--> DEAD
//!                                        SUSPENDED <--inspect--> INSPECTING
//! ```
//!
//! The fiber itself records its registers and then publishes `SUSPENDED` (release) just
//! before switching away. An inspector — any thread — moves `SUSPENDED → INSPECTING` with a
//! compare-and-swap, walks the stack, and moves it back. The scheduler resumes only with a
//! `SUSPENDED → RUNNING` swap, waiting while an inspection is under way (a walk takes well
//! under a microsecond), and frees a stack only after `SUSPENDED → DEAD` or `RUNNING →
//! DEAD`. So a walk never overlaps a resume, and never reads a freed stack: the invariant.
//!
//! A walk that starts right after the fiber published `SUSPENDED` but before it finished
//! switching away is still sound: the frames it reads (the suspend wrapper's and its callers')
//! no longer change; the switch itself only writes below the recorded stack pointer.
//!
//! Parent traces ([`ParentTrace`]): each fiber's creation segment (its creator's frames at the
//! spawn) is captured once, inline in its control block, and the chain of ancestors is a
//! chain of links through the creators' control blocks, shared by every descendant. So a
//! report over a chain of D fibers costs O(D) (each entry shows at most
//! [`PARENT_DEPTH_SHOWN`] ancestors and counts the rest), and a lineage of any length keeps at
//! most [`PARENT_DEPTH_KEPT`] ancestors alive. What can be wrong: a linked creator is named by
//! its name now, a copied one by its name when copied; ancestors past the kept chain are only
//! counted.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use fibertrace_core::{Backtrace, CaptureOptions, Frame, SavedContext, StackBounds};
use smallvec::SmallVec;

use serde::{Deserialize, Serialize};

/// Identifier of a fiber, unique in the process (never reused).
pub type FiberId = u64;

pub(crate) const NEW: u8 = 0;
pub(crate) const RUNNING: u8 = 1;
pub(crate) const SUSPENDED: u8 = 2;
pub(crate) const INSPECTING: u8 = 3;
pub(crate) const DEAD: u8 = 4;

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

/// What a fiber waits on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

    fn unpack(v: u64) -> Option<WaitOn> {
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

/// Frames kept of a creator's stack.
pub const PARENT_FRAMES: usize = 16;

/// Ancestors shown per fiber (fiber info, dumps, Lua's `parent_backtrace`): the nearest ones.
/// The ones past them are counted, never silently dropped: a dump ends the list with
/// `... N more parent fibers`, fiber info says `parent_backtrace_omitted: N`.
pub const PARENT_DEPTH_SHOWN: usize = 8;

/// Most ancestors a parent trace keeps reachable (and so in memory). A spawn whose creator's
/// chain already holds this many links the child to a copy of the creator's nearest
/// [`PARENT_DEPTH_SHOWN`]` - 1` ancestors instead (made once per such creator and shared by
/// all its children), so a lineage of any length keeps at most this many ancestors alive, and
/// the copying costs `PARENT_DEPTH_SHOWN - 1` small allocations once every
/// `PARENT_DEPTH_KEPT - PARENT_DEPTH_SHOWN + 1` generations: constant per spawn on average.
pub const PARENT_DEPTH_KEPT: usize = 2 * PARENT_DEPTH_SHOWN;

/// Copies of ancestors' traces alive now (see [`PARENT_DEPTH_KEPT`]).
static COPIES: AtomicUsize = AtomicUsize::new(0);

/// How many copied ancestor traces are alive in the process: the memory parent traces hold
/// beyond the control blocks they link, which must stay bounded by the number of live fibers
/// (not by the number of generations that ever ran). For tests and soaks.
pub fn parent_trace_copies() -> usize {
    COPIES.load(Ordering::Relaxed)
}

/// A parent trace: the creator's own frames at the moment it spawned the child (cut at the
/// creator's entry), and a link to the creator, whose own parent trace continues the chain
/// (grandparents are shared by reference, never copied per child). Kept inline in the child's
/// control block: spawning with parent traces costs one short frame-pointer walk and no
/// allocation.
///
/// The link keeps the creator's control block (a few hundred bytes, not its stack) alive as
/// long as a descendant lives, so an ancestor that has exited is still named. A block so held
/// is never reused for another fiber (a block is renewed in place only when nothing else
/// holds it), so a link never names the wrong fiber.
///
/// # Caps, and how the result can be wrong
///
/// - Each trace keeps [`PARENT_FRAMES`] of the creator's frames (the middle of a deeper stack
///   is replaced by one `Omitted(n)` frame).
/// - At most [`PARENT_DEPTH_KEPT`] ancestors are reachable from a trace ([`ParentTrace::chain`]);
///   [`ParentTrace::depth`] still counts them all. Past that the chain continues through
///   copies of the nearest ancestors' traces (see [`PARENT_DEPTH_KEPT`]), whose names are the
///   ones the ancestors had when the copy was made (a linked creator's name is read when
///   asked). So a fiber deep in a lineage reaches between [`PARENT_DEPTH_SHOWN`] and
///   [`PARENT_DEPTH_KEPT`] ancestors, never fewer than `min(depth, PARENT_DEPTH_SHOWN)`.
/// - Reports show the nearest [`PARENT_DEPTH_SHOWN`] ([`ParentTrace::shown`]) and count the
///   rest ([`ParentTrace::omitted`]).
pub struct ParentTrace {
    /// The creating fiber (`None`: a thread outside any fiber).
    pub fiber: Option<FiberId>,
    up: Up,
    frames: SmallVec<[Frame; PARENT_FRAMES]>,
    /// The frames as fiber info hands them out (raw, resolved), each made on first request
    /// (the trace never changes).
    info: [OnceLock<Arc<[crate::info::FrameInfo]>>; 2],
    /// Ancestors reachable from this trace, its own creator included (1..=PARENT_DEPTH_KEPT).
    kept: u32,
    /// Ancestors in all, its own creator included (the ones no longer reachable too).
    depth: u64,
    /// A copy of this trace and its nearest ancestors, for children spawned once this chain is
    /// [`PARENT_DEPTH_KEPT`] long (made by the first such spawn, shared by the next ones).
    cut: OnceLock<Arc<ParentTrace>>,
    /// This is such a copy (counted in [`COPIES`]).
    copy: bool,
}

/// How a chain continues past a trace.
enum Up {
    /// The creating fiber's control block: its name now, and its own parent trace.
    Creator(Arc<FiberShared>),
    /// A name fixed when the trace was made (a thread's) or copied (a fiber's), and the copied
    /// chain beyond it (`None`: the chain ends here; [`ParentTrace::depth`] counts the rest).
    Fixed {
        name: Arc<str>,
        parent: Option<Arc<ParentTrace>>,
    },
}

impl std::fmt::Debug for ParentTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParentTrace")
            .field("fiber", &self.fiber)
            .field("name", &self.name())
            .field("frames", &self.frames)
            .field("kept", &self.kept)
            .field("depth", &self.depth)
            .finish()
    }
}

impl Drop for ParentTrace {
    fn drop(&mut self) {
        if self.copy {
            COPIES.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl ParentTrace {
    /// A parent trace made by hand (a Lua host passes the creator's interleaved frames).
    /// At most [`PARENT_FRAMES`] frames are kept (the middle is omitted when longer).
    pub fn new(creator: Option<&crate::Fiber>, frames: &[Frame]) -> ParentTrace {
        let creator = creator.map(|c| c.shared().clone());
        let thread_name = creator
            .is_none()
            .then(|| Arc::from(std::thread::current().name().unwrap_or("thread")));
        Self::from_parts(creator, thread_name, frames)
    }

    pub(crate) fn from_parts(
        creator: Option<Arc<FiberShared>>,
        thread_name: Option<Arc<str>>,
        frames: &[Frame],
    ) -> ParentTrace {
        let mut t = Self::linked(creator, thread_name);
        t.frames = fit_frames(frames);
        t
    }

    /// A trace without frames yet, linked to its creator (or naming the thread): the link, or
    /// when the creator's chain is [`PARENT_DEPTH_KEPT`] long, its copy cut shorter.
    #[inline]
    fn linked(creator: Option<Arc<FiberShared>>, thread_name: Option<Arc<str>>) -> ParentTrace {
        let fiber = creator.as_ref().map(|c| c.id);
        let (up, kept, depth) = match creator {
            None => (
                Up::Fixed {
                    name: thread_name.unwrap_or_else(|| Arc::from("thread")),
                    parent: None,
                },
                1,
                1,
            ),
            Some(c) => {
                let above = c.parent_trace.as_ref().map(|t| (t.kept, t.depth));
                match above {
                    None => (Up::Creator(c), 1, 1),
                    Some((kept, depth)) if (kept as usize) < PARENT_DEPTH_KEPT => {
                        (Up::Creator(c), kept + 1, depth + 1)
                    }
                    Some((_, depth)) => {
                        let cut = c.parent_trace.as_ref().map(ParentTrace::cut_copy);
                        let kept = cut.as_ref().map_or(0, |p| p.kept) + 1;
                        let name = c.name_arc();
                        (Up::Fixed { name, parent: cut }, kept, depth + 1)
                    }
                }
            }
        };
        ParentTrace {
            fiber,
            up,
            frames: SmallVec::new(),
            info: [OnceLock::new(), OnceLock::new()],
            kept,
            depth,
            cut: OnceLock::new(),
            copy: false,
        }
    }

    /// This trace and its nearest ancestors, `PARENT_DEPTH_SHOWN - 1` in all, copied once
    /// (cold: once every several generations of a lineage).
    #[cold]
    fn cut_copy(&self) -> Arc<ParentTrace> {
        self.cut
            .get_or_init(|| self.copy_chain(PARENT_DEPTH_SHOWN - 1))
            .clone()
    }

    /// A copy of this trace and the next `levels - 1` ancestors (`levels` ≥ 1), with the
    /// names they have now; the copy's chain ends there.
    fn copy_chain(&self, levels: usize) -> Arc<ParentTrace> {
        let nodes: SmallVec<[&ParentTrace; PARENT_DEPTH_KEPT]> =
            self.chain().take(levels.max(1)).collect();
        let mut parent: Option<Arc<ParentTrace>> = None;
        // From the farthest: each copy links the one made before it.
        for t in nodes.iter().rev() {
            let kept = parent.as_ref().map_or(0, |p| p.kept) + 1;
            COPIES.fetch_add(1, Ordering::Relaxed);
            parent = Some(Arc::new(ParentTrace {
                fiber: t.fiber,
                up: Up::Fixed {
                    name: t.name(),
                    parent: parent.take(),
                },
                frames: t.frames.clone(),
                info: t.info.clone(),
                kept,
                depth: t.depth,
                cut: OnceLock::new(),
                copy: true,
            }));
        }
        parent.expect("at least one level is copied")
    }

    /// The creator's frames, innermost first.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// The frames with their resolutions (`resolve`): each list is made once and shared by
    /// every later call.
    pub fn frames_info(&self, resolve: bool) -> Arc<[crate::info::FrameInfo]> {
        self.info[usize::from(resolve)]
            .get_or_init(|| crate::info::frames_info_shared(&self.frames, resolve))
            .clone()
    }

    /// The creator's name (its current name; as it was when copied for a copied ancestor; the
    /// thread's name for a thread).
    pub fn name(&self) -> Arc<str> {
        match &self.up {
            Up::Creator(c) => c.name_arc(),
            Up::Fixed { name, .. } => name.clone(),
        }
    }

    /// The creator's own parent trace (`None` at the first fiber, a thread, or where the kept
    /// chain ends: see [`ParentTrace::depth`]).
    pub fn parent(&self) -> Option<&ParentTrace> {
        match &self.up {
            Up::Creator(c) => c.parent_trace.as_ref(),
            Up::Fixed { parent, .. } => parent.as_deref(),
        }
    }

    /// How many ancestors there are from this trace's creator up, all of them, including
    /// those the chain no longer reaches.
    pub fn depth(&self) -> u64 {
        self.depth
    }

    /// How many ancestors [`ParentTrace::chain`] reaches (at most [`PARENT_DEPTH_KEPT`]).
    pub fn kept(&self) -> usize {
        self.kept as usize
    }

    /// How many ancestors reports leave out: [`ParentTrace::depth`] minus the
    /// [`ParentTrace::shown`] ones.
    pub fn omitted(&self) -> u64 {
        self.depth - self.kept.min(PARENT_DEPTH_SHOWN as u32) as u64
    }

    /// The nearest ancestors, direct parent first: the [`PARENT_DEPTH_SHOWN`] reports show.
    pub fn shown(&self) -> impl Iterator<Item = &ParentTrace> {
        self.chain().take(PARENT_DEPTH_SHOWN)
    }

    /// The shown chain as one list: each ancestor's frames after a [`Frame::Parent`] marker
    /// naming it (the first marker names the direct parent; 0 names a thread). At most
    /// [`PARENT_DEPTH_SHOWN`] ancestors; [`ParentTrace::omitted`] counts the others.
    pub fn flatten(&self) -> Vec<Frame> {
        let mut out = Vec::new();
        for t in self.shown() {
            out.push(Frame::Parent(t.fiber.unwrap_or(0)));
            out.extend_from_slice(t.frames());
        }
        out
    }

    /// Every ancestor the chain reaches, from the direct parent up (at most
    /// [`PARENT_DEPTH_KEPT`]).
    pub fn chain(&self) -> impl Iterator<Item = &ParentTrace> {
        let mut cur = Some(self);
        std::iter::from_fn(move || {
            let t = cur?;
            cur = t.parent();
            Some(t)
        })
    }
}

fn fit_frames(f: &[Frame]) -> SmallVec<[Frame; PARENT_FRAMES]> {
    if f.len() <= PARENT_FRAMES {
        return SmallVec::from_slice(f);
    }
    // Keep the innermost and outermost frames; count what the middle held.
    let head = PARENT_FRAMES / 2;
    let tail = PARENT_FRAMES - head - 1;
    let omitted: u64 = f[head..f.len() - tail]
        .iter()
        .map(|x| match x {
            Frame::Omitted(n) => *n,
            _ => 1,
        })
        .sum();
    let mut v: SmallVec<[Frame; PARENT_FRAMES]> = SmallVec::from_slice(&f[..head]);
    v.push(Frame::Omitted(omitted));
    v.extend_from_slice(&f[f.len() - tail..]);
    v
}

impl Status {
    fn from_u8(v: u8) -> Status {
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
    info: Option<(bool, Arc<[crate::info::FrameInfo]>)>,
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

/// The control block of one fiber. Shared with other threads through the registry.
pub struct FiberShared {
    pub(crate) id: FiberId,
    pub(crate) sched: u64,
    pub(crate) name: Mutex<Arc<str>>,
    pub(crate) parent: Option<FiberId>,
    pub(crate) parent_trace: Option<ParentTrace>,
    /// Clock ticks at creation (see [`crate::clock`]; reading the system clocks twice per
    /// spawn cost more than the rest of the bookkeeping). With `created_at_start`, the
    /// scheduler's last accounting point until the fiber first runs, then its start.
    pub(crate) created: AtomicU64,
    /// The creation time is taken when it first runs (see [`crate::Builder::created_at_start`]).
    pub(crate) created_at_start: bool,
    pub(crate) run: AtomicU8,
    /// Written by the fiber before publishing SUSPENDED; read only under INSPECTING.
    ctx: UnsafeCell<SavedContext>,
    /// Stack pointer of the runtime's entry frame on this fiber's stack, at its call of the
    /// user's code (0 before start): walks of this fiber end below it.
    pub(crate) entry_sp: AtomicU64,
    pub(crate) stack: StackBounds,
    pub(crate) stack_size: usize,
    /// Lowest stack pointer seen at a suspension or sample.
    pub(crate) min_sp: AtomicU64,
    /// Stack pointer at the last suspension.
    pub(crate) last_sp: AtomicU64,
    status: AtomicU8,
    /// What a blocked fiber waits on (set only for blocking waits, not for yields).
    /// Packed ([`WaitOn::pack`]): one atomic word, so reading it from another thread takes
    /// no lock.
    wait_on: AtomicU64,
    /// Clock ticks when the current status began.
    pub(crate) since: AtomicU64,
    pub(crate) csw: AtomicU64,
    pub(crate) cpu_ticks: AtomicU64,
    pub(crate) cancelled: AtomicBool,
    /// Address of the fiber's entry function (shown for a fiber that never ran).
    pub(crate) entry_fn: u64,
    /// The type name of the fiber's entry closure (a closure has no symbol of its own).
    pub(crate) entry_name: &'static str,
    pub(crate) panic: Mutex<Option<Box<PanicReport>>>,
    /// How its function ended (`OUTCOME_*`), written by the fiber as it finishes.
    pub(crate) outcome: AtomicU8,
    /// The last walk of this fiber's suspended stack: valid while the fiber has not been
    /// resumed since (same switch count), for the same capture options.
    trace_cache: Mutex<Option<TraceCache>>,
    /// The switch count of the walk in `trace_cache` (a hint readable without the lock:
    /// whether a new walk is due, so its stack is worth prefetching).
    walked_csw: AtomicU64,
    /// Whether suspensions record the registers (tracing on).
    pub(crate) traced: bool,
}

// SAFETY: every field is Sync except `ctx`, which is written only by the fiber's own thread
// while the fiber runs (run == RUNNING) and read by other threads only after they won the
// SUSPENDED -> INSPECTING swap, which orders the accesses (release / acquire).
unsafe impl Sync for FiberShared {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for FiberShared {}

impl std::fmt::Debug for FiberShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FiberShared")
            .field("id", &self.id)
            .field("name", &&*self.name_arc())
            .field("run", &self.run.load(Ordering::Relaxed))
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
        creator: Option<Arc<FiberShared>>,
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

impl FiberShared {
    /// A new control block, built in place in its shared allocation (a control block is
    /// several hundred bytes; building it on the stack and moving it in cost a copy per spawn).
    /// (`n` by reference: a by-value move is a copy of its ~160 bytes just written, which
    /// stalls on store forwarding.)
    pub(crate) fn new_shared(n: &mut NewFiber<'_>) -> Arc<Self> {
        let mut a = Arc::<FiberShared>::new_uninit();
        let slot = Arc::get_mut(&mut a).expect("a new Arc is unique");
        let (given, captured) = Self::split_parent(n);
        let f = slot.write(FiberShared::new(n, given));
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
        let (given, captured) = Self::split_parent(n);
        // Field by field, only what a new fiber changes: building a whole new block and
        // moving it in copied its ~700 bytes (the inline parent-trace buffer included). The
        // pattern names every field, so a field added later must be handled here too.
        let FiberShared {
            id,
            sched,
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
        } = m;
        *id = n.id;
        *sched = n.sched;
        *name.get_mut().unwrap_or_else(|e| e.into_inner()) = n.name.clone();
        name.clear_poison();
        *parent = n.parent();
        // Only a given or captured trace is moved in; "none" is a store of the tag (moving
        // a whole empty Option of this size was a 330-byte copy).
        match given {
            None => *parent_trace = None,
            t => *parent_trace = t,
        }
        *created.get_mut() = n.now;
        *created_at_start = n.created_at_start;
        *run.get_mut() = NEW;
        *ctx.get_mut() = SavedContext::new(n.stack);
        *entry_sp.get_mut() = 0;
        *stack = n.stack;
        *stack_size = n.stack_size;
        *min_sp.get_mut() = n.stack.hi;
        *last_sp.get_mut() = n.stack.hi;
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
            let ras = &ras[..ras.len().min(PARENT_FRAMES)];
            let buf = t.frames.as_mut_ptr();
            for (i, &a) in ras.iter().enumerate() {
                // SAFETY: the inline buffer holds PARENT_FRAMES frames and i < that.
                unsafe { buf.add(i).write(Frame::Ra(a)) };
            }
            // SAFETY: the first `ras.len()` entries were written just above.
            unsafe { t.frames.set_len(ras.len()) };
        }
    }

    #[inline(always)]
    fn new(n: &NewFiber<'_>, parent_trace: Option<ParentTrace>) -> Self {
        let now = n.now;
        FiberShared {
            id: n.id,
            sched: n.sched,
            name: Mutex::new(n.name.clone()),
            parent: n.parent(),
            parent_trace,
            created: AtomicU64::new(now),
            created_at_start: n.created_at_start,
            run: AtomicU8::new(NEW),
            ctx: UnsafeCell::new(SavedContext::new(n.stack)),
            entry_sp: AtomicU64::new(0),
            stack: n.stack,
            stack_size: n.stack_size,
            min_sp: AtomicU64::new(n.stack.hi),
            last_sp: AtomicU64::new(n.stack.hi),
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

    /// The fiber's name, shared (no copy).
    pub fn name_arc(&self) -> Arc<str> {
        self.name.lock().unwrap_or_else(|e| e.into_inner()).clone()
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

    /// Sets the entry stack pointer (once, when the fiber starts).
    pub(crate) fn set_entry_sp(&self, sp: u64) {
        self.entry_sp.store(sp, Ordering::Relaxed);
        // SAFETY: called by the fiber itself while RUNNING (see record_suspension).
        unsafe { (*self.ctx.get()).stop_sp = sp };
    }

    /// Walks the fiber's stack if it is suspended, never racing a resume. Returns `None` if
    /// it is not suspended (running, new, dead) or tracing is off.
    pub(crate) fn inspect_suspended(&self, opts: &CaptureOptions, out: &mut Backtrace) -> bool {
        if !self.traced {
            return false;
        }
        if self
            .run
            .compare_exchange(SUSPENDED, INSPECTING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // While INSPECTING the fiber cannot be resumed: its switch count is stable, and a
        // walk cached at this count is still the truth (a parked stack does not change).
        let csw = self.csw.load(Ordering::Relaxed);
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
            // SAFETY: we won SUSPENDED -> INSPECTING: the fiber cannot be resumed or freed
            // until we store SUSPENDED back, and its `ctx` was published before SUSPENDED
            // (acquire).
            let ctx = unsafe { *self.ctx.get() };
            fibertrace_core::collect_from_into(&ctx, opts, out);
            *self.trace_cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(TraceCache {
                csw,
                opts: *opts,
                frames: out.frames().into(),
                info: None,
            });
            self.walked_csw.store(csw, Ordering::Relaxed);
        }
        self.run.store(SUSPENDED, Ordering::Release);
        true
    }

    /// The suspended fiber's frames as fiber info hands them out: `build` turns a walk into
    /// the list, and the list is kept and shared until the fiber runs again. `None` when the
    /// fiber is not suspended (or not traced).
    ///
    /// The walk is done under the inspection handshake; `build` (which may resolve symbols,
    /// slow the first time) runs after it, so a resume never waits for symbolization.
    pub(crate) fn suspended_info(
        &self,
        opts: &CaptureOptions,
        resolve: bool,
        build: impl FnOnce(&[Frame]) -> Arc<[crate::info::FrameInfo]>,
    ) -> Option<Arc<[crate::info::FrameInfo]>> {
        if !self.traced {
            return None;
        }
        if self
            .run
            .compare_exchange(SUSPENDED, INSPECTING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return None;
        }
        let csw = self.csw.load(Ordering::Relaxed);
        let mut bt = Backtrace::new();
        let mut c = self.trace_cache.lock().unwrap_or_else(|e| e.into_inner());
        let kept = c.as_ref().is_some_and(|t| t.csw == csw && t.opts == *opts);
        if !kept {
            // SAFETY: we won SUSPENDED -> INSPECTING: the fiber cannot be resumed or freed
            // until we store SUSPENDED back, and its `ctx` was published before SUSPENDED
            // (acquire).
            let ctx = unsafe { *self.ctx.get() };
            fibertrace_core::collect_from_into(&ctx, opts, &mut bt);
        }
        self.run.store(SUSPENDED, Ordering::Release);
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

    /// Starts loading the used part of a parked stack (up to 4 KiB from the stack pointer)
    /// when a walk of it is due: its frames are then read from cache, not one memory round
    /// trip per frame. A hint; racy reads of the atomics are fine.
    pub(crate) fn prefetch_stack(&self) {
        if self.run.load(Ordering::Relaxed) != SUSPENDED
            || self.walked_csw.load(Ordering::Relaxed) == self.csw.load(Ordering::Relaxed)
        {
            return;
        }
        let sp = self.last_sp.load(Ordering::Relaxed);
        if self.stack.contains(sp) {
            fibertrace_core::capture::prefetch(
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

    /// Swaps SUSPENDED (or NEW) to RUNNING for a resume, waiting out an inspection.
    pub(crate) fn begin_resume(&self) {
        self.swap_run_state(RUNNING, Ordering::Acquire);
    }

    /// Marks the fiber dead, waiting out an inspection (before its stack is freed).
    pub(crate) fn mark_dead(&self) {
        self.swap_run_state(DEAD, Ordering::AcqRel);
    }

    /// Moves the run state to `to` from whatever it is, except that an inspection under way
    /// (a walk takes well under a microsecond) is waited out first.
    fn swap_run_state(&self, to: u8, success: Ordering) {
        loop {
            let cur = self.run.load(Ordering::Relaxed);
            if cur == INSPECTING {
                std::hint::spin_loop();
                continue;
            }
            if self
                .run
                .compare_exchange_weak(cur, to, success, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Counts switches into the fiber and adds CPU ticks (the scheduler's thread is the only
    /// writer of both: a load and a store each, no locked read-modify-write).
    #[inline]
    pub(crate) fn add_run(&self, switches: u64, ticks: u64) {
        single_writer_add(&self.csw, switches);
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
        let on = WaitOn::unpack(self.wait_on.load(Ordering::Relaxed));
        (st, on, self.since.load(Ordering::Relaxed))
    }

    /// The status, what it waits on, and for how long.
    pub fn status(&self) -> (Status, Option<WaitOn>, std::time::Duration) {
        self.status_at(crate::clock::ticks())
    }

    /// As [`FiberShared::status`], "how long" counted up to `now` (from
    /// [`crate::clock::ticks`]): a caller reporting on many fibers reads the clock once.
    pub fn status_at(&self, now: u64) -> (Status, Option<WaitOn>, std::time::Duration) {
        let (st, on, since) = self.status_raw();
        (st, on, crate::clock::to_duration(now.saturating_sub(since)))
    }

    /// Whether the fiber has finished.
    pub fn is_dead(&self) -> bool {
        self.run.load(Ordering::Acquire) == DEAD
    }

    /// Context switches (resumes) so far.
    pub fn csw(&self) -> u64 {
        self.csw.load(Ordering::Relaxed)
    }

    /// CPU time it ran so far.
    pub fn cpu_time(&self) -> std::time::Duration {
        crate::clock::to_duration(self.cpu_ticks.load(Ordering::Relaxed))
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
