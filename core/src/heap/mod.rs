//! Heap metadata: which code — and which fiber — allocated every live byte.
//!
//! [`Tracked`] wraps any [`GlobalAlloc`] (the system allocator, usually) as the process's
//! `#[global_allocator]`, in one of two tiers:
//!
//! * **every allocation** ([`Tracked::every`]): lws's `alloc_metadata` scheme. Each
//!   allocation carries, hidden in front of the pointer handed out, the lws-compressed
//!   backtrace of the code that made it and its size (the blob), the blob's 16-bit big-endian
//!   length, and three words of links (previous, next, owner slot) that chain it into the live
//!   list. Free works backwards from the pointer. Live allocations can be listed
//!   ([`live`]), printed as lws `~m#` lines ([`write_m_lines`], which lws's own decoder
//!   reads), grouped by stack ([`group`]); every alloc and free can be reported to a
//!   callback ([`set_events`]). For tests and small systems: every allocation pays a stack walk.
//! * **sampled** ([`Tracked::sampled`]): Poisson sampling by bytes, as jemalloc and Go do: a
//!   per-thread countdown of bytes drawn from an exponential distribution (mean
//!   [`Config::sample_interval`], 512 KiB by default); the allocation that crosses it is
//!   sampled: its stack is recorded in a table and it stands for `1/p` allocations of its size,
//!   `p = 1 − e^(−size/interval)` (the estimate is unbiased). Free finds a sampled pointer by
//!   a probe in a counting filter (one load for the others). Cheap enough to leave on.
//!
//! [`Tracked::from_env`] picks the tier when the process starts from `FIBERTRACE_HEAP`
//! (`every`, `sampled` or `off`), so one binary can do both.
//!
//! Each allocation is charged to the current [`Owner`] (a runtime switches it with each
//! fiber, see [`switch_to`]) and credited back to it on free, whichever thread frees it:
//! [`Owner::usage`] and [`owners`] give live bytes per fiber, exited fibers included.
//!
//! Invariants: the tracker never re-enters itself — all of its own work (capture, tables,
//! callbacks) runs under a per-thread busy flag, and allocations made meanwhile go to the
//! inner allocator untracked (in the every tier still with a header, marked unlinked).
//! Thread-locals are plain `const` cells without destructors, so allocations during a
//! thread's teardown are served (untracked once the capture's own thread-locals are gone).
//! Capture is the frame-pointer walk when the code keeps frame pointers (no allocation, no
//! lock once the image table is built), else the DWARF walk.
//!
//! How a result can be wrong: the recorded stack starts inside the allocation machinery
//! (`__rust_alloc`, `alloc::raw_vec`…) — views drop those frames by name; a stack deeper than
//! [`Config::depth`] keeps its innermost frames; `realloc` in the every tier is a new
//! allocation (its stack is the `realloc`'s); sampled figures are estimates.

mod every;
mod owner;
mod reserve;
mod sample;
mod totals;
mod view;

pub use crate::symbolize::RoomAside;
pub use crate::untracked::{pause, Busy};
pub use owner::{
    outside_fibers, owners, restore, switch_to, OutsideFibers, Owner, OwnerRow, Usage, MAX_OWNERS,
};
pub use reserve::{
    keep_reserve_out, one_arena_under_limit, reserve_use, room_for, room_for_thread, set_aside,
    Reserve, ReserveKeptOut, ReserveUse, RESERVE_BYTES, SET_ASIDE_MAX,
};
pub use totals::{totals, Total, MAX_ENTRIES};
pub use view::{
    add_fiber_trampoline, for_each_live, group, group_live, human_bytes, live, m_lines,
    machinery_frames, own_frames, render_groups, share_name, write_m_lines, Group, Grouped,
    LiveAlloc, LiveRef, Share,
};

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// Which tier a [`Tracked`] allocator runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Not tracking: allocations go straight to the inner allocator.
    Off,
    /// Every allocation carries its stack (lws `alloc_metadata`).
    Every,
    /// Poisson-sampled by bytes.
    Sampled,
}

const UNDECIDED: u8 = 0;
const OFF: u8 = 1;
const EVERY: u8 = 2;
const SAMPLED: u8 = 3;

/// The tier of the process's tracker, decided at its first allocation.
static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// The active tier (`Off` when no [`Tracked`] allocator is installed or it has not
/// allocated yet).
pub fn tier() -> Tier {
    match MODE.load(Ordering::Relaxed) {
        EVERY => Tier::Every,
        SAMPLED => Tier::Sampled,
        _ => Tier::Off,
    }
}

/// Whether the tracker runs a tier (a load, for paths that switch owners only for it).
#[inline]
pub(crate) fn tracking() -> bool {
    matches!(MODE.load(Ordering::Relaxed), EVERY | SAMPLED)
}

/// Settings of the tracker (change them at any time with [`configure`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Frames dropped at the top of each recorded stack (besides the tracker's own).
    pub snip_pre: usize,
    /// Frames dropped at the bottom (the thread's start code, say).
    pub snip_post: usize,
    /// Most frames recorded per stack (at most [`crate::codec::lws::MAX_DEPTH`] = 31, lws's
    /// limit).
    pub depth: usize,
    /// Mean bytes between samples in the sampled tier.
    pub sample_interval: u64,
    /// Whether the every tier records stacks (when off, allocations keep their headers but
    /// are not listed).
    pub record: bool,
    /// Walk stacks with DWARF (`Unwinder::Precise`) instead of the frame-pointer walk: for
    /// programs that link code built without frame pointers into an image that has them
    /// (LuaJIT's C, say), whose frames the lean walk would lose or misread. Slower per
    /// recorded stack.
    pub precise: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            snip_pre: 0,
            snip_post: 0,
            depth: crate::codec::lws::MAX_DEPTH,
            sample_interval: 512 * 1024,
            record: true,
            precise: false,
        }
    }
}

static SNIP_PRE: AtomicUsize = AtomicUsize::new(0);
static SNIP_POST: AtomicUsize = AtomicUsize::new(0);
static DEPTH: AtomicUsize = AtomicUsize::new(crate::codec::lws::MAX_DEPTH);
static INTERVAL: AtomicU64 = AtomicU64::new(512 * 1024);
static RECORD: AtomicBool = AtomicBool::new(true);
static PRECISE: AtomicBool = AtomicBool::new(false);

/// Applies `c` (to allocations made from now on).
pub fn configure(c: Config) {
    SNIP_PRE.store(c.snip_pre.min(64), Ordering::Relaxed);
    SNIP_POST.store(c.snip_post.min(64), Ordering::Relaxed);
    DEPTH.store(
        c.depth.clamp(1, crate::codec::lws::MAX_DEPTH),
        Ordering::Relaxed,
    );
    INTERVAL.store(c.sample_interval.max(1), Ordering::Relaxed);
    RECORD.store(c.record, Ordering::Relaxed);
    PRECISE.store(c.precise, Ordering::Relaxed);
}

/// The settings in force.
pub fn config() -> Config {
    Config {
        snip_pre: SNIP_PRE.load(Ordering::Relaxed),
        snip_post: SNIP_POST.load(Ordering::Relaxed),
        depth: DEPTH.load(Ordering::Relaxed),
        sample_interval: INTERVAL.load(Ordering::Relaxed),
        record: RECORD.load(Ordering::Relaxed),
        precise: PRECISE.load(Ordering::Relaxed),
    }
}

/// An allocation or a free, as reported to the [`set_events`] callback.
#[derive(Debug)]
pub struct Event<'a> {
    /// Whether it is an allocation (else a free).
    pub alloc: bool,
    /// The pointer handed out.
    pub ptr: usize,
    /// Its size.
    pub size: usize,
    /// The fiber it is charged to (`None`: outside fibers).
    pub fiber: Option<u64>,
    /// The lws blob (with its 2-byte length) of its allocation stack: what a `~m#` line
    /// carries. Empty for allocations whose stack was not recorded.
    pub blob: &'a [u8],
}

type EventFn = fn(&Event<'_>);
static EVENTS: std::sync::atomic::AtomicPtr<()> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Calls `f` for every recorded allocation and its free in the every tier (`None`: stop).
/// The callback runs inside the allocator: its own allocations are not tracked and it must
/// not block on a lock an allocating thread could hold.
pub fn set_events(f: Option<EventFn>) {
    EVENTS.store(
        f.map_or(std::ptr::null_mut(), |f| f as *mut ()),
        Ordering::Release,
    );
}

/// Calls the event callback, if any, catching a panic (one unwinding out of the allocator
/// aborts the process).
pub(crate) fn report(e: &Event<'_>) {
    if let Some(f) = events() {
        let _ = std::panic::catch_unwind(|| f(e));
    }
}

fn events() -> Option<EventFn> {
    let p = EVENTS.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: only `set_events` stores here, always a `fn(&Event)` cast to a pointer.
    Some(unsafe { std::mem::transmute::<*mut (), EventFn>(p) })
}

/// Runs `f` with tracking paused on this thread (its allocations are served untracked).
pub fn untracked<R>(f: impl FnOnce() -> R) -> R {
    let _b = Busy::enter();
    f()
}

/// A global allocator that records who allocated every live byte. See the module docs.
///
/// ```no_run
/// use fibertrace_core::heap::Tracked;
/// #[global_allocator]
/// static HEAP: Tracked<std::alloc::System> = Tracked::sampled(std::alloc::System);
/// ```
pub struct Tracked<A> {
    inner: A,
    tier: u8,
}

impl<A> Tracked<A> {
    /// Every allocation carries its stack.
    pub const fn every(inner: A) -> Self {
        Tracked { inner, tier: EVERY }
    }

    /// Poisson-sampled by bytes.
    pub const fn sampled(inner: A) -> Self {
        Tracked {
            inner,
            tier: SAMPLED,
        }
    }

    /// The tier named by `FIBERTRACE_HEAP` (`every`, `sampled`, `off`) when the process
    /// starts, `default` when it is unset or names none of them.
    pub const fn from_env(inner: A, default: Tier) -> Self {
        let tier = match default {
            Tier::Off => OFF,
            Tier::Every => EVERY,
            Tier::Sampled => SAMPLED,
        };
        Tracked {
            inner,
            tier: tier | 0x80,
        }
    }

    #[inline]
    fn mode(&self) -> u8 {
        match MODE.load(Ordering::Relaxed) {
            UNDECIDED => self.decide(),
            m => m,
        }
    }

    #[cold]
    fn decide(&self) -> u8 {
        let mut m = self.tier & 0x7f;
        if self.tier & 0x80 != 0 {
            m = env_tier().unwrap_or(m);
        }
        match MODE.compare_exchange(UNDECIDED, m, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => m,
            Err(won) => won,
        }
    }
}

/// `FIBERTRACE_HEAP`, read without allocating.
fn env_tier() -> Option<u8> {
    // SAFETY: getenv with a NUL-terminated name; the result, when not null, is a
    // NUL-terminated string owned by the environment, read at once.
    let v = unsafe { libc::getenv(c"FIBERTRACE_HEAP".as_ptr()) };
    if v.is_null() {
        return None;
    }
    // SAFETY: as above.
    let v = unsafe { std::ffi::CStr::from_ptr(v) }.to_bytes();
    match v {
        b"every" => Some(EVERY),
        b"sampled" => Some(SAMPLED),
        b"off" | b"" | b"0" => Some(OFF),
        _ => None,
    }
}

thread_local! {
    /// How many tracked allocations are in progress on this thread: more than one while the
    /// tracker allocates for its own tables during one (see [`keep_reserve_out`]).
    static TRACKED_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// See [`TRACKED_DEPTH`].
pub(crate) fn tracked_depth() -> u32 {
    TRACKED_DEPTH.try_with(|d| d.get()).unwrap_or(0)
}

/// Counts a tracked allocation in progress while held.
struct InTracked;

impl InTracked {
    #[inline]
    fn enter() -> InTracked {
        let _ = TRACKED_DEPTH.try_with(|d| d.set(d.get().saturating_add(1)));
        InTracked
    }
}

impl Drop for InTracked {
    #[inline]
    fn drop(&mut self) {
        let _ = TRACKED_DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
    }
}

// SAFETY: every method hands out memory from the inner allocator, with a layout that holds
// the caller's (size and alignment) at the pointer returned, and frees it with the layout it
// was allocated with (recomputed from the caller's layout and the header's length).
unsafe impl<A: GlobalAlloc> GlobalAlloc for Tracked<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.mode() {
            // SAFETY: the caller's contract (a non-zero-sized layout).
            EVERY => unsafe {
                let _in = InTracked::enter();
                every::alloc(&self.inner, layout, false)
            },
            // SAFETY: as above.
            SAMPLED => unsafe {
                let _in = InTracked::enter();
                sample::alloc(&self.inner, layout, false)
            },
            // SAFETY: as above.
            _ => unsafe { self.inner.alloc(layout) },
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match self.mode() {
            // SAFETY: the caller's contract.
            EVERY => unsafe {
                let _in = InTracked::enter();
                every::alloc(&self.inner, layout, true)
            },
            // SAFETY: as above.
            SAMPLED => unsafe {
                let _in = InTracked::enter();
                sample::alloc(&self.inner, layout, true)
            },
            // SAFETY: as above.
            _ => unsafe { self.inner.alloc_zeroed(layout) },
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match self.mode() {
            // SAFETY: `ptr` was handed out by this allocator in this mode, with `layout`.
            EVERY => unsafe { every::dealloc(&self.inner, ptr, layout) },
            // SAFETY: as above.
            SAMPLED => unsafe { sample::dealloc(&self.inner, ptr, layout) },
            // SAFETY: as above.
            _ => unsafe { self.inner.dealloc(ptr, layout) },
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match self.mode() {
            // SAFETY: the caller's contract for realloc.
            EVERY => unsafe {
                let _in = InTracked::enter();
                every::realloc(&self.inner, ptr, layout, new_size)
            },
            // SAFETY: as above.
            SAMPLED => unsafe {
                let _in = InTracked::enter();
                sample::realloc(&self.inner, ptr, layout, new_size)
            },
            // SAFETY: as above.
            _ => unsafe { self.inner.realloc(ptr, layout, new_size) },
        }
    }
}

/// The high bits that mark a Lua frame in a recorded stack (a host's stack hook writes
/// `LUA_TAG | id` for a Lua frame it interleaves, see [`set_stack_hook`]): no native address
/// has them (user space ends below 2^47), and the value stays below 2^63, as an lws blob
/// needs.
pub const LUA_TAG: u64 = 0x7f1b_0000_0000_0000;

/// The last entry of a recorded stack cut short (the stack went on past the frames a record
/// keeps, [`Config::depth`] at most): [`frames_of`] gives [`crate::Frame::Truncated`] for it.
/// Like [`LUA_TAG`], no native address and below 2^63.
pub const TRUNC_TAG: u64 = 0x7f1c_0000_0000_0000;

/// A recorded stack's entries as frames: Lua frames for tagged entries, the truncation mark
/// for [`TRUNC_TAG`], return addresses for the others.
pub fn frames_of(addrs: &[u64]) -> Vec<crate::Frame> {
    addrs
        .iter()
        .map(|&a| {
            if a == TRUNC_TAG {
                crate::Frame::Truncated
            } else if a & 0xffff_0000_0000_0000 == LUA_TAG {
                crate::Frame::Lua(crate::LuaFrameId((a & 0xffff_ffff) as u32))
            } else {
                crate::Frame::Ra(a)
            }
        })
        .collect()
}

/// Adds a layer's frames to a stack being recorded: gets the native return addresses
/// (innermost first, the allocator's own frames cut) and their count, rewrites them in
/// place and returns the new count (at most the array's length). The last entry given is
/// [`TRUNC_TAG`] when the native stack went on past them; the hook ends its result with it
/// when that stack, or its own result, was cut. It runs inside the allocator, on the
/// allocating thread, with tracking paused; it must not block.
pub type StackHook = fn(&mut [u64; crate::codec::lws::MAX_DEPTH], usize) -> usize;

static HOOK: std::sync::atomic::AtomicPtr<()> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Sets (or with `None` removes) the [`StackHook`].
pub fn set_stack_hook(h: Option<StackHook>) {
    HOOK.store(
        h.map_or(std::ptr::null_mut(), |f| f as *mut ()),
        Ordering::Release,
    );
}

fn stack_hook() -> Option<StackHook> {
    let p = HOOK.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: only `set_stack_hook` stores here, always a `StackHook` cast to a pointer.
    Some(unsafe { std::mem::transmute::<*mut (), StackHook>(p) })
}

/// Most frames captured before snipping.
const CAPTURE: usize = 96;

/// Captures the current stack for a record into `out`: the frames above the tracker's own,
/// snipped per [`Config`], at most [`Config::depth`]. Call under [`Busy`].
#[inline(never)]
pub(crate) fn capture(out: &mut [u64; crate::codec::lws::MAX_DEPTH]) -> usize {
    let mut buf = [0u64; CAPTURE];
    let pre = SNIP_PRE.load(Ordering::Relaxed);
    let post = SNIP_POST.load(Ordering::Relaxed);
    let depth = DEPTH.load(Ordering::Relaxed).min(out.len());
    let stack = if PRECISE.load(Ordering::Relaxed) {
        None
    } else {
        crate::capture::stack_here()
    };
    // Frame 0 is the return into this function, frame 1 into the tier's record function:
    // both the tracker's. The next is the allocator entry (`__rg_alloc`, where the
    // `GlobalAlloc` methods are inlined), dropped by name in the views with the rest of the
    // allocation machinery.
    let n = match stack.and_then(|s| crate::capture::collect_raw(2, 0, s, &mut buf)) {
        Some(n) => n,
        None => {
            let mut bt = crate::Backtrace::new();
            let opts = crate::CaptureOptions {
                unwinder: if PRECISE.load(Ordering::Relaxed) {
                    crate::Unwinder::Precise
                } else {
                    crate::Unwinder::Auto
                },
                limit: CAPTURE.min(crate::CAPACITY),
                offset: 2,
                top: 0,
            };
            crate::capture::collect_into(&opts, &mut bt);
            let mut n = 0;
            for a in bt.frames().iter().filter_map(crate::Frame::address) {
                if n == buf.len() {
                    break;
                }
                buf[n] = a;
                n += 1;
            }
            n
        }
    };
    let lo = pre.min(n);
    let hi = n.saturating_sub(post).max(lo);
    let k = (hi - lo).min(out.len());
    out[..k].copy_from_slice(&buf[lo..lo + k]);
    // More frames than the record keeps (or than were captured: the walk may have gone on).
    if k > 0 && (hi - lo > k || (n == CAPTURE && post == 0)) {
        out[k - 1] = TRUNC_TAG;
    }
    let k = match stack_hook() {
        // A panic in the hook must not unwind out of the allocator (that aborts): the stack
        // keeps its native frames.
        Some(h) => {
            let mut copy = *out;
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(&mut copy, k))) {
                Ok(n) => {
                    *out = copy;
                    n.min(out.len())
                }
                Err(_) => k,
            }
        }
        None => k,
    };
    if k > depth && depth > 0 {
        out[depth - 1] = TRUNC_TAG;
    }
    k.min(depth)
}
