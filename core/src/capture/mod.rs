//! Capture: where a walk starts (registers) and which memory it may read (stack bounds).
//!
//! * [`collect`] captures the current stack. The capture call itself never appears: the walk
//!   starts from `collect`'s own frame record, whose return address is the caller's.
//! * [`collect_from`] captures a suspended coroutine from its [`SavedContext`]: registers
//!   recorded at the suspension point ([`SavedContext::record`], three register reads) and the
//!   bounds of the coroutine's stack. Reads are confined to `[sp, hi)` of that stack, so a
//!   stale link out of it (corosensei's parent link while suspended) is never followed.
//! * [`collect_from_ucontext`] captures an interrupted context inside a signal handler: no
//!   lock, no allocation, no thread-local access; the caller passes the stacks it may read and
//!   the DWARF cache to use.
//!
//! Which stacks the current thread may read: its own stack (from `pthread_getattr_np`, once
//! per thread) and the coroutine stacks a runtime declares with [`enter_stack`] while it runs
//! code on them. A frame chain that leaves these bounds ends the walk — the frames beyond are
//! missing from the trace, never read from unknown memory.
//!
//! How a result can be wrong: a walk started inside a function's prologue or epilogue by a
//! signal can lose one caller with the frame-pointer unwinder (DWARF does not); a function
//! without a frame record inside code that keeps them hides its caller from the fast walk;
//! the registers recorded by [`SavedContext::record`] are those of the function that called
//! it, so a runtime's suspend wrapper shows as the first frame unless skipped (`offset`).

use std::cell::{Cell, RefCell};

use crate::backtrace::{new_ring, Backtrace, CaptureOptions, FrameSink, Unwinder};
use crate::unwind::{self, DwarfCache, RangeCache, Stacks, Start};

pub use crate::arch::{
    prefetch, prefetch_far, register_from_ucontext, registers_from_ucontext, Registers,
    SavedContext, StackBounds,
};

/// Most entered coroutine stacks a walk of the current stack follows (the innermost ones).
const MAX_ENTERED: usize = 8;

struct ThreadStacks {
    own: Cell<StackBounds>,
    entered: [Cell<StackBounds>; MAX_ENTERED],
    depth: Cell<usize>,
}

thread_local! {
    static STACKS: ThreadStacks = const {
        ThreadStacks {
            own: Cell::new(StackBounds::new(0, 0)),
            entered: [const { Cell::new(StackBounds::new(0, 0)) }; MAX_ENTERED],
            depth: Cell::new(0),
        }
    };
    static CACHE: RefCell<Option<Box<DwarfCache>>> = const { RefCell::new(None) };
    /// The code ranges of the one-go suspended walks (`fp_walk_whole`): in place, not behind
    /// the DWARF cache's box and its lazy creation (a dozen instructions fewer a walk).
    static RANGES: RefCell<RangeCache> = const { RefCell::new(RangeCache::new()) };
}

/// `f` with this thread's range cache for one-go walks (a fresh one if it is in use: a
/// walk re-entered from a signal handler's code, say).
#[inline(always)]
fn with_ranges<R>(f: impl FnOnce(&mut RangeCache) -> R) -> R {
    let mut f = Some(f);
    let r = RANGES.try_with(|c| {
        c.try_borrow_mut()
            .ok()
            .map(|mut r| (f.take().expect("called once"))(&mut r))
    });
    match r {
        Ok(Some(r)) => r,
        _ => (f.take().expect("called once"))(&mut RangeCache::new()),
    }
}

/// The current thread's own stack (cached after the first call).
pub fn thread_stack() -> StackBounds {
    STACKS.with(|s| {
        let b = s.own.get();
        if b.hi != 0 {
            return b;
        }
        let b = thread_stack_uncached().unwrap_or_default();
        s.own.set(b);
        b
    })
}

fn thread_stack_uncached() -> Option<StackBounds> {
    // SAFETY: pthread_attr_t is plain data; it is initialised by pthread_getattr_np before use
    // and destroyed after; pthread_self() is always valid for the calling thread.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let rc = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        (rc == 0).then(|| StackBounds::new(addr as u64, addr as u64 + size as u64))
    }
}

/// Declares that the current thread runs code on `stack` until the returned guard is
/// dropped, so that walks from inside it may read it. A runtime wraps each resume of a
/// coroutine in one. Walks follow the innermost 8 entered stacks (nested deeper, a walk from
/// the innermost stops where it would leave the eighth).
#[inline]
pub fn enter_stack(stack: StackBounds) -> EnteredStack {
    // The entries form a ring holding the innermost MAX_ENTERED stacks; a guard puts back
    // the entry it replaced, so leaving a deeper nesting restores the outer ones.
    let (slot, replaced) = STACKS.with(|s| {
        let d = s.depth.get();
        let slot = d % MAX_ENTERED;
        s.depth.set(d + 1);
        // Below the ring's size the entry is free: nothing to read back (a read of the
        // entry just written by the last guard's restore stalls on store forwarding).
        let replaced = if d >= MAX_ENTERED {
            s.entered[slot].get()
        } else {
            StackBounds::new(0, 0)
        };
        s.entered[slot].set(stack);
        (slot, replaced)
    });
    EnteredStack {
        slot,
        replaced,
        _not_send: std::marker::PhantomData,
    }
}

/// Guard of [`enter_stack`] (guards drop in reverse order of entering: they are scoped).
pub struct EnteredStack {
    slot: usize,
    replaced: StackBounds,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for EnteredStack {
    #[inline]
    fn drop(&mut self) {
        STACKS.with(|s| {
            let d = s.depth.get().saturating_sub(1);
            if d >= MAX_ENTERED {
                s.entered[self.slot].set(self.replaced);
            }
            s.depth.set(d);
        });
    }
}

/// The stacks the current thread may read: the entered coroutine stacks (innermost first)
/// and its own stack.
pub fn current_stacks() -> Vec<StackBounds> {
    let mut buf = [StackBounds::default(); MAX_ENTERED + 1];
    let n = fill_current_stacks(&mut buf);
    buf[..n].to_vec()
}

/// The known stack (an entered coroutine stack or the thread's own) that holds the caller's
/// stack pointer, without allocating: what [`collect_raw`] reads. `None` when the current
/// stack is none of them.
#[inline(never)]
pub fn stack_here() -> Option<StackBounds> {
    let sp = crate::__fibertrace_registers_here!().sp;
    let mut buf = [StackBounds::default(); MAX_ENTERED + 1];
    let n = fill_current_stacks(&mut buf);
    buf[..n].iter().copied().find(|s| s.contains(sp))
}

/// Writes the current thread's readable stacks into `buf`; returns how many.
#[inline]
fn fill_current_stacks(buf: &mut [StackBounds; MAX_ENTERED + 1]) -> usize {
    STACKS.with(|s| {
        let mut own = s.own.get();
        if own.hi == 0 {
            own = thread_stack();
        }
        let depth = s.depth.get();
        let d = depth.min(MAX_ENTERED);
        // Innermost first: the ring's entries from the newest back.
        for (i, slot) in buf[..d].iter_mut().enumerate() {
            *slot = s.entered[(depth - 1 - i) % MAX_ENTERED].get();
        }
        let mut n = d;
        if own.hi != 0 {
            buf[n] = own;
            n += 1;
        }
        n
    })
}

fn with_thread_cache<R>(f: impl FnOnce(&mut DwarfCache) -> R) -> R {
    let mut f = Some(f);
    let r = CACHE.try_with(|c| match c.try_borrow_mut() {
        Ok(mut slot) => {
            let cache = slot.get_or_insert_with(new_cache);
            Some((f.take().expect("called once"))(cache))
        }
        Err(_) => None,
    });
    match r {
        Ok(Some(r)) => r,
        // Re-entered (or during thread teardown): use a fresh cache.
        _ => (f.take().expect("called once"))(&mut new_cache()),
    }
}

/// A new DWARF cache, on the heap. Made on a larger stack where the runtime has one (see
/// [`crate::symbolize::set_large_stack_runner`]): the cache is built on the stack before it
/// is boxed in a debug build, and a fiber with a small stack whose first walk made it (a
/// dump taken from the fiber) overflowed there.
fn new_cache() -> Box<DwarfCache> {
    crate::symbolize::on_large_stack(|| Box::new(DwarfCache::new()))
}

/// Captures the current stack. The first frame is the return address into the caller of
/// `collect`.
#[inline(never)]
pub fn collect(opts: &CaptureOptions) -> Backtrace {
    let regs = crate::__fibertrace_registers_here!();
    let mut bt = Backtrace::new();
    collect_current(regs, opts, &mut bt);
    std::hint::black_box(&mut bt);
    bt
}

/// Captures the current stack into `out` (no copy of the result). Same frames as
/// [`collect`].
#[inline(never)]
pub fn collect_into(opts: &CaptureOptions, out: &mut Backtrace) {
    let regs = crate::__fibertrace_registers_here!();
    collect_current(regs, opts, out);
    std::hint::black_box(&mut *out);
}

/// Captures the current stack up to a runtime's entry frame: `stop_sp` is the stack pointer
/// of the runtime's function that called the user's code, at that call (recorded by the
/// runtime when the coroutine started); the trace ends with the user's outermost frame.
/// With `stop_sp == 0` this is [`collect_into`].
#[inline(never)]
pub fn collect_until(opts: &CaptureOptions, stop_sp: u64, out: &mut Backtrace) {
    let regs = crate::__fibertrace_registers_here!();
    collect_current_impl(regs, opts, stop_sp, out);
    std::hint::black_box(&mut *out);
}

/// Captures the current stack from an outer frame of it: `origin` are registers recorded
/// (with `fibertrace_core::__fibertrace_registers_here!()`, which reads them in the function
/// it is written in) by a function that is still running on this thread — the
/// trace starts with that function's caller, so the frames below it (a report's own
/// machinery, say) never appear, whatever was inlined. `stop_sp` as in [`collect_until`].
///
/// Registers that are not of a live frame of this thread give a wrong (but memory-safe:
/// reads stay inside this thread's known stacks) trace.
#[inline(never)]
pub fn collect_from_origin(
    origin: Registers,
    opts: &CaptureOptions,
    stop_sp: u64,
    out: &mut Backtrace,
) {
    let here = crate::__fibertrace_registers_here!();
    // The origin must lie above this frame on the current stack; anything else is not a live
    // frame of this thread, and the walk starts here instead.
    let regs = if origin.sp >= here.sp && same_stack(origin.sp, here.sp) {
        origin
    } else {
        here
    };
    collect_current_impl(regs, opts, stop_sp, out);
    std::hint::black_box(&mut *out);
}

/// Whether two stack addresses lie in the same known stack of this thread.
fn same_stack(a: u64, b: u64) -> bool {
    let mut buf = [StackBounds::default(); MAX_ENTERED + 1];
    let n = fill_current_stacks(&mut buf);
    buf[..n].iter().any(|s| s.contains(a) && s.contains(b))
}

thread_local! {
    /// `collect_raw`'s code ranges (see `RangeCache`), and the one it was last in.
    static RAW_RANGES: RefCell<crate::unwind::RangeCache> =
        const { RefCell::new(crate::unwind::RangeCache::new()) };
    static RAW_RANGE: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Whether `collect_raw`'s own code keeps frame pointers (0: not known yet, 1: yes, 2: no).
static RAW_FP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The leanest capture: return addresses of the current stack by frame-pointer walk into
/// `out`, skipping `skip` frames (the first is the caller of this function), ending at the
/// frame whose caller's stack pointer reaches `stop_sp` (0: none; see [`collect_until`]),
/// reading only `stack` (which must contain the current stack pointer). No omission
/// markers, no allocation once the image table is built (the first call may build it): what
/// a runtime uses on a hot path (a parent trace at spawn). Not for signal handlers (it keeps
/// a per-thread cache of which code keeps frame pointers).
///
/// Returns how many addresses were written, or `None` when the frame-pointer chain cannot
/// be trusted: this code, or a caller on the way, keeps no frame pointers (a crate built
/// without `force-frame-pointers`). Use [`collect_until`] with `Auto` then. A caller in the
/// C library (a thread's start code, mostly) ends the trace after its frame instead.
#[inline(never)]
pub fn collect_raw(
    skip: usize,
    stop_sp: u64,
    stack: StackBounds,
    out: &mut [u64],
) -> Option<usize> {
    let regs = crate::__fibertrace_registers_here!();
    let table = crate::image::table();
    match RAW_FP.load(std::sync::atomic::Ordering::Relaxed) {
        1 => {}
        2 => return None,
        _ => {
            let ok = table.frame_pointer_code(regs.ip);
            RAW_FP.store(if ok { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
            if !ok {
                return None;
            }
        }
    }
    let hops = crate::unwind::hop::Hops::snapshot();
    let (mut ok_lo, mut ok_hi) = RAW_RANGE.with(|r| r.get());
    let lo = regs.sp.max(stack.lo);
    let hi = stack.hi;
    let stops = stop_sp != 0 && stop_sp >= lo && stop_sp <= hi;
    let mut fp = regs.fp;
    let (mut n, mut skipped) = (0usize, 0usize);
    while n < out.len() {
        if !fp.is_multiple_of(8) || fp < lo || fp.saturating_add(16) > hi {
            break;
        }
        if stops && fp + 16 >= stop_sp {
            break;
        }
        // SAFETY: [fp, fp+16) lies in `stack` above our own stack pointer: the live part of
        // the stack this thread runs on, mapped and readable.
        let (next, ra) = unsafe {
            (
                std::ptr::read_volatile(fp as *const u64),
                std::ptr::read_volatile((fp + 8) as *const u64),
            )
        };
        if ra == 0 {
            break;
        }
        // The caller must keep frame pointers for its record to be `next`.
        let at = ra - 1;
        let mut last = false;
        if (at < ok_lo || at >= ok_hi) && hops.misses(ra) {
            match RAW_RANGES.with(|c| c.borrow_mut().range(table, at)) {
                Some((s, e, true)) => {
                    (ok_lo, ok_hi) = (s, e);
                    RAW_RANGE.with(|r| r.set((s, e)));
                }
                Some((_, _, false)) if table.code_image(at).is_some_and(|i| i.is_libc) => {
                    last = true;
                }
                Some((_, _, false)) => return None,
                None => {}
            }
        }
        if skipped < skip {
            skipped += 1;
        } else {
            out[n] = ra;
            n += 1;
        }
        if last {
            break;
        }
        let next = hops.next_record(fp, ra, next);
        if next <= fp {
            break;
        }
        fp = next;
    }
    Some(n)
}

fn collect_current(regs: Registers, opts: &CaptureOptions, out: &mut Backtrace) {
    collect_current_impl(regs, opts, 0, out)
}

fn collect_current_impl(regs: Registers, opts: &CaptureOptions, stop_sp: u64, out: &mut Backtrace) {
    let mut buf = [StackBounds::default(); MAX_ENTERED + 1];
    let n = fill_current_stacks(&mut buf);
    let stacks = &mut buf[..n];
    // The live part of the stack we run on starts at our own stack pointer.
    if let Some(cur) = stacks.iter_mut().find(|s| s.contains(regs.sp)) {
        cur.lo = regs.sp;
    }
    let start = Start {
        regs,
        emit_ip: false,
        first_step_dwarf: false,
        stop_sp,
    };
    walk_with_refresh(start, &Stacks::new(stacks), opts, out);
}

/// Walks; if the walk met code outside every known image and the loader's list changed
/// since the image table was built, walks again with a refreshed table.
fn walk_with_refresh(
    start: Start,
    stacks: &Stacks<'_>,
    opts: &CaptureOptions,
    out: &mut Backtrace,
) {
    let mut ring = new_ring();
    let mut table = crate::image::table();
    // (`Fast` gets the cache too: it goes on with DWARF where frame pointers end.)
    let mode = opts.unwinder;
    loop {
        let mut sink = FrameSink::new(out, &mut ring, opts);
        let end = with_thread_cache(|cache| {
            unwind::walk(start, stacks, mode, Some(table), Some(cache), &mut sink)
        });
        sink.finish(end.cut);
        // (Not while this thread holds another still: the refresh takes the loader's lock,
        // which the held thread may hold. The walk ends at that code then.)
        if !end.unknown_code || crate::holding::active() {
            return;
        }
        let fresh = crate::image::refresh();
        if std::ptr::eq(fresh, table) {
            return;
        }
        table = fresh;
    }
}

/// Captures a suspended coroutine from its saved context. A context with no recorded
/// registers yields an empty trace.
pub fn collect_from(ctx: &SavedContext, opts: &CaptureOptions) -> Backtrace {
    let mut bt = Backtrace::new();
    collect_from_into(ctx, opts, &mut bt);
    bt
}

/// Where a walk of a saved context starts (its registers, the recorded frame itself first,
/// stopping at its entry) and the one stack it may read (from its stack pointer up).
fn saved_start(ctx: &SavedContext) -> ([StackBounds; 1], Start) {
    (
        [StackBounds::new(ctx.regs.sp, ctx.stack.hi)],
        Start {
            regs: ctx.regs,
            emit_ip: true,
            first_step_dwarf: false,
            stop_sp: ctx.stop_sp,
        },
    )
}

/// [`collect_from`] into an existing backtrace.
pub fn collect_from_into(ctx: &SavedContext, opts: &CaptureOptions, out: &mut Backtrace) {
    if !ctx.is_recorded() {
        out.clear();
        return;
    }
    if opts.unwinder != Unwinder::Precise
        && opts.offset <= MAX_ONE_GO_OFFSET
        && fp_walk_whole(ctx, opts, out)
    {
        return;
    }
    collect_from_general(ctx, opts, out);
}

pub use crate::holding::Holding;

/// Marks this thread as holding another thread of the process still (stopped while this one
/// reads its stack and memory) until the guard is dropped: meanwhile it waits for no lock
/// the held thread may hold — the symbolizer answers from its caches only (else the address
/// alone, not kept) and walks do not reread the loader's list when they meet unknown code
/// (they end there). Nested guards keep the mark until the outermost ends.
pub fn holding_another_thread() -> Holding {
    crate::holding::enter()
}

/// Whether this thread is inside a [`holding_another_thread`] guard.
pub fn is_holding_another_thread() -> bool {
    crate::holding::active()
}

/// [`collect_from_into`] for a context of a thread another one holds still (stopped in a
/// signal handler while this one reads its stack): the general walk, with the image table as
/// it is — code outside every known image ends the walk there instead of refreshing the
/// table, which reads the loader's list under the loader's lock, a lock the held thread may
/// hold.
pub fn collect_from_held(ctx: &SavedContext, opts: &CaptureOptions, out: &mut Backtrace) {
    if !ctx.is_recorded() {
        out.clear();
        return;
    }
    let (bounds, start) = saved_start(ctx);
    let stacks = Stacks::new(&bounds);
    let mut ring = new_ring();
    let table = crate::image::table();
    let mut sink = FrameSink::new(out, &mut ring, opts);
    let end = with_thread_cache(|cache| {
        unwind::walk(
            start,
            &stacks,
            opts.unwinder,
            Some(table),
            Some(cache),
            &mut sink,
        )
    });
    sink.finish(end.cut);
}

/// [`collect_from_into`] by the general walk, for a recorded context. Out of line: inlined,
/// its state made the one-go walk's caller save six registers and a 470-byte frame.
#[inline(never)]
fn collect_from_general(ctx: &SavedContext, opts: &CaptureOptions, out: &mut Backtrace) {
    let (bounds, start) = saved_start(ctx);
    walk_with_refresh(start, &Stacks::new(&bounds), opts, out);
}

/// The largest `offset` a suspended walk in one go takes (the runtimes skip one frame, their
/// suspend wrapper).
const MAX_ONE_GO_OFFSET: usize = 4;

/// A suspended context's `Fast` walk in one go, when it needs none of the general walk's
/// machinery (see `unwind::fp_walk_into`), and its `Auto` walk the same way when the frames
/// are provably `Auto`'s (`unwind::fp_walk_is_auto`): `false` when the general walk must do
/// it (and `out` is then empty).
///
/// An `offset` of `k` frames: the walk is given `limit + k` slots (at most the backtrace's
/// capacity) and its first `k` frames are dropped. It succeeds only when the whole walk fits
/// with a slot to spare, so what is left is under the limit and nothing was cut: exactly
/// the general walk's frames, which skip the same `k` (none when the walk is shorter).
#[inline]
fn fp_walk_whole(ctx: &SavedContext, opts: &CaptureOptions, out: &mut Backtrace) -> bool {
    // (The first walk builds the table, through the general walk.)
    let Some(table) = crate::image::published() else {
        return false;
    };
    let skip = opts.offset;
    let room = (opts.effective_limit() + skip).min(crate::backtrace::CAPACITY);
    let whole = with_ranges(|ranges| {
        // SAFETY: `fp_walk_into` returns `Some(n)` only having written `dst[..n]` (its `Pc`,
        // then the frames its walk's `fill` wrote after it).
        unsafe {
            out.fill_with(room, |dst| {
                unwind::fp_walk_into(ctx.regs, ctx.stack.hi, ctx.stop_sp, table, ranges, dst)
            })
        }
    });
    // (Apart, so that a `Fast` walk pays one compare for it.)
    let whole = whole && (opts.unwinder != Unwinder::Auto || fp_walk_is_auto(ctx, table, out));
    if whole && skip > 0 {
        out.drop_front(skip);
    }
    #[cfg(test)]
    tests::ONE_GO.with(|n| n.set(n.get() + usize::from(whole)));
    whole
}

/// Whether a one-go walk's frames in `out` are also `Auto`'s (`unwind::fp_walk_is_auto`);
/// if not, `out` is emptied.
#[inline(never)]
fn fp_walk_is_auto(
    ctx: &SavedContext,
    table: &crate::image::ImageTable,
    out: &mut Backtrace,
) -> bool {
    let (regs, hi, stop) = (ctx.regs, ctx.stack.hi, ctx.stop_sp);
    let is =
        with_ranges(|ranges| unwind::fp_walk_is_auto(regs, hi, stop, table, ranges, out.frames()));
    if !is {
        out.clear();
    }
    is
}

/// [`collect_from_into`] for a signal handler: async-signal-safe (no lock, no allocation, no
/// thread-local access). Uses the image table only if one was built ([`prepare`]) and the
/// caller's DWARF cache; a `Fast` walk that meets code without frame pointers goes on with
/// DWARF when a cache is given, and otherwise ends with `Truncated`.
pub fn collect_from_in_handler(
    ctx: &SavedContext,
    opts: &CaptureOptions,
    cache: Option<&mut DwarfCache>,
    out: &mut Backtrace,
) {
    out.clear();
    if !ctx.is_recorded() {
        return;
    }
    let (bounds, start) = saved_start(ctx);
    walk_in_handler(start, &Stacks::new(&bounds), opts, cache, out);
}

/// A walk that a signal handler may run (see [`collect_from_ucontext`]).
fn walk_in_handler(
    start: Start,
    stacks: &Stacks<'_>,
    opts: &CaptureOptions,
    cache: Option<&mut DwarfCache>,
    out: &mut Backtrace,
) {
    let table = crate::image::published();
    let mut ring = new_ring();
    let mut sink = FrameSink::new(out, &mut ring, opts);
    let end = unwind::walk(start, stacks, opts.unwinder, table, cache, &mut sink);
    // A walk that met code without frame pointers and had no DWARF cache to go on with says
    // that the trace ends early.
    sink.finish(end.cut || end.fp_unsafe);
}

/// Captures an interrupted context from inside a signal handler: async-signal-safe.
///
/// It takes no lock, allocates nothing and touches no thread-local storage. `stacks` are the
/// stacks the walk may read (the interrupted thread's and, if it runs a coroutine, that
/// coroutine's — a runtime publishes them where the handler can find them). `cache` is a
/// DWARF cache owned by the caller (one per thread that may be interrupted); with `None`, or
/// before the image table was built ([`prepare`]), only the frame-pointer walk is used.
/// `stop_sp` as in [`collect_until`]. A `Fast` walk that meets code without frame pointers
/// goes on with DWARF when it has a cache, and otherwise ends with `Truncated` after the last
/// frame it can vouch for.
///
/// # Safety
/// `uc` must be the `ucontext_t` given to an `SA_SIGINFO` handler, and every range in
/// `stacks` must be mapped, readable memory for the duration of the call.
pub unsafe fn collect_from_ucontext(
    uc: *const libc::c_void,
    stacks: &[StackBounds],
    stop_sp: u64,
    opts: &CaptureOptions,
    cache: Option<&mut DwarfCache>,
    out: &mut Backtrace,
) {
    // SAFETY: forwarded from the caller's contract.
    let regs = unsafe { registers_from_ucontext(uc) };
    let start = Start {
        regs,
        emit_ip: true,
        first_step_dwarf: true,
        stop_sp,
    };
    walk_in_handler(start, &Stacks::new(stacks), opts, cache, out);
}

/// Builds what signal-time capture needs ahead of time: the image table with its DWARF
/// unwinder. Call it before installing a sampling signal handler.
pub fn prepare() {
    let _ = crate::image::table();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backtrace, CaptureOptions, Frame, Unwinder};

    #[test]
    fn entered_stacks_nested_deeper_than_the_ring_keep_the_innermost() {
        let own = thread_stack();
        let s = |i: u64| StackBounds::new(0x1000_0000 * i, 0x1000_0000 * i + 0x1000);
        let mut guards = Vec::new();
        for i in 1..=12 {
            guards.push(enter_stack(s(i)));
        }
        // The innermost eight, innermost first, then the thread's own stack.
        let want: Vec<StackBounds> = (5..=12).rev().map(s).chain([own]).collect();
        assert_eq!(current_stacks(), want);
        // Leaving the deepest levels restores the outer entries the ring had overwritten.
        for _ in 0..9 {
            drop(guards.pop());
        }
        assert_eq!(current_stacks(), [s(3), s(2), s(1), own]);
        while let Some(g) = guards.pop() {
            drop(g);
        }
        assert_eq!(current_stacks(), [own]);
    }

    thread_local! {
        /// One-go walks taken on this thread (`fp_walk_whole`).
        pub(super) static ONE_GO: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A coroutine suspended `depth` calls deep, with its saved context (its entry's stack
    /// pointer as the stop, as the runtime records it).
    fn parked(
        depth: u32,
    ) -> (
        corosensei::Coroutine<(), (), ()>,
        std::rc::Rc<std::cell::Cell<SavedContext>>,
    ) {
        #[inline(never)]
        fn park(y: &corosensei::Yielder<(), ()>, ctx: &std::cell::Cell<SavedContext>, n: u32) {
            if n > 0 {
                park(y, ctx, n - 1);
                std::hint::black_box(());
                return;
            }
            let mut c = ctx.get();
            c.record();
            ctx.set(c);
            y.suspend(());
        }
        let stack = corosensei::stack::DefaultStack::new(256 * 1024).unwrap();
        use corosensei::stack::Stack;
        // (As the runtime has them: the top 16 bytes, corosensei's parent link, left out.)
        let bounds = StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16);
        let ctx = std::rc::Rc::new(std::cell::Cell::new(SavedContext::new(bounds)));
        let c2 = ctx.clone();
        let mut co =
            corosensei::Coroutine::with_stack(stack, move |y: &corosensei::Yielder<(), ()>, ()| {
                let here = crate::__fibertrace_registers_here!();
                let mut c = c2.get();
                c.stop_sp = here.sp;
                c2.set(c);
                park(y, &c2, depth);
                std::hint::black_box(());
            });
        co.resume(());
        (co, ctx)
    }

    /// The one-go walk of a suspended context (`fp_walk_whole`) gives exactly the general
    /// walk's frames, `Fast`'s and `Auto`'s, and is taken whenever the frames fit:
    /// coroutines parked shallower than, as deep as and deeper than the backtrace's
    /// capacity, with the entry's stop and without, under limits and tops that cut, omit, or
    /// leave room.
    #[test]
    fn a_suspended_walk_in_one_go_gives_the_general_walks_frames() {
        let mut taken = [0, 0];
        for depth in [0, 1, 5, 30, 55, 60, 61, 62, 63, 64, 90] {
            let (mut co, ctx) = parked(depth);
            for (u, unwinder) in [Unwinder::Fast, Unwinder::Auto].into_iter().enumerate() {
                for stop in [true, false] {
                    let mut c = ctx.get();
                    if !stop {
                        c.stop_sp = 0;
                    }
                    for (limit, top, offset) in [
                        (64, 16, 0),
                        (64, 0, 0),
                        (10, 3, 0),
                        (2, 0, 0),
                        (1, 0, 0),
                        (0, 0, 0),
                        (64, 16, 1),
                        (63, 16, 1),
                        (10, 3, 1),
                        (1, 0, 1),
                        (64, 0, 4),
                        (5, 0, 4),
                        (2, 0, 3),
                    ] {
                        let opts = CaptureOptions {
                            unwinder,
                            limit,
                            offset,
                            top,
                        };
                        let mut general = Backtrace::new();
                        collect_from_general(&c, &opts, &mut general);
                        let mut one_go = Backtrace::new();
                        let whole = fp_walk_whole(&c, &opts, &mut one_go);
                        // The public call takes the one-go walk exactly when it can.
                        let mut api = Backtrace::new();
                        let before = ONE_GO.with(|n| n.get());
                        collect_from_into(&c, &opts, &mut api);
                        let used = ONE_GO.with(|n| n.get()) - before;
                        assert_eq!(
                            used,
                            usize::from(whole),
                            "depth {depth}, stop {stop}, {opts:?}"
                        );
                        assert_eq!(api, general, "depth {depth}, stop {stop}, {opts:?}");
                        let fits = !general
                            .frames()
                            .iter()
                            .any(|f| matches!(f, Frame::Omitted(_) | Frame::Truncated));
                        if whole {
                            assert_eq!(one_go, general, "depth {depth}, stop {stop}, {opts:?}");
                            taken[u] += 1;
                        } else {
                            assert!(one_go.is_empty());
                        }
                        // With the entry's stop and room to spare, the one-go walk does it (a
                        // stack that fills the limit exactly goes to the general walk, which
                        // alone knows what is cut; without the stop the chain runs on into the
                        // coroutine library's entry code, which keeps no frame pointers: DWARF).
                        // (With an offset, the walk's frames before it take slots too.)
                        if stop
                            && fits
                            && general.len() < opts.effective_limit()
                            && general.len() + offset < crate::backtrace::CAPACITY
                        {
                            assert!(whole, "depth {depth}, stop {stop}, {opts:?}: {general:?}");
                        }
                    }
                }
            }
            while let corosensei::CoroutineResult::Yield(()) = co.resume(()) {}
        }
        assert!(
            taken.iter().all(|&t| t >= 15),
            "the one-go walk was taken {taken:?} times (Fast, Auto)"
        );
    }

    /// A precise capture, with the given cache, of the stack from `regs` (a frame of the
    /// caller's, live while this runs).
    #[inline(never)]
    fn precise_with(regs: Registers, cache: &mut DwarfCache, out: &mut Backtrace) {
        let stack = thread_stack();
        let stacks = [StackBounds::new(regs.sp.max(stack.lo), stack.hi)];
        let opts = CaptureOptions::with_unwinder(Unwinder::Precise);
        let mut ring = new_ring();
        let mut sink = FrameSink::new(out, &mut ring, &opts);
        let start = Start {
            regs,
            emit_ip: false,
            first_step_dwarf: false,
            stop_sp: 0,
        };
        let table = crate::image::table();
        let end = unwind::walk(
            start,
            &Stacks::new(&stacks),
            Unwinder::Precise,
            Some(table),
            Some(cache),
            &mut sink,
        );
        sink.finish(end.cut);
    }

    /// Both walks from the same registers, so the stacks are the same: (compact, framehop
    /// only). (Not from two call sites: the compiler may duplicate a loop around one.)
    #[inline(never)]
    fn both() -> (Vec<Frame>, Vec<Frame>) {
        let regs = crate::__fibertrace_registers_here!();
        let mut out = [Backtrace::new(), Backtrace::new()];
        let mut caches = [DwarfCache::new(), DwarfCache::new()];
        caches[1].set_compact_rules(false);
        caches[0].set_compact_rules(true);
        // Cold caches, then warm ones.
        for _ in 0..2 {
            for (cache, out) in caches.iter_mut().zip(&mut out) {
                precise_with(regs, cache, out);
            }
        }
        let [a, b] = out;
        (a.frames().to_vec(), b.frames().to_vec())
    }

    thread_local! {
        static GOT: std::cell::RefCell<Option<(Vec<Frame>, Vec<Frame>)>> =
            const { std::cell::RefCell::new(None) };
    }

    extern "C" fn compare(a: *const libc::c_void, b: *const libc::c_void) -> libc::c_int {
        if GOT.with(|g| g.borrow().is_none()) {
            let r = both();
            GOT.with(|g| *g.borrow_mut() = Some(r));
        }
        // SAFETY: qsort passes pointers to elements of the i32 array below.
        unsafe { (*(a as *const i32)).cmp(&*(b as *const i32)) as libc::c_int }
    }

    #[test]
    fn compact_rules_walk_exactly_as_framehop_does() {
        // Straight through this program's own frames.
        let (compact, framehop) = both();
        assert!(compact.len() > 5, "{compact:?}");
        assert_eq!(compact, framehop);
        // Through glibc's qsort, whose code keeps no frame pointers: its CFI rules are the
        // stack-pointer kind, with rbp saved or not.
        let mut v = [5i32, 3, 9, 1, 7, 2, 8];
        // SAFETY: a valid i32 array and a comparator for it.
        unsafe {
            libc::qsort(
                v.as_mut_ptr().cast(),
                v.len(),
                std::mem::size_of::<i32>(),
                Some(compare),
            )
        };
        let (compact, framehop) = GOT.with(|g| g.borrow_mut().take()).expect("compared");
        assert!(compact.len() > 7, "{compact:?}");
        assert_eq!(compact, framehop);
        let table = crate::image::table();
        let in_libc = compact
            .iter()
            .filter_map(|f| f.lookup_address())
            .filter(|&a| table.code_image(a).is_some_and(|i| i.is_libc))
            .count();
        assert!(in_libc >= 1, "no glibc frame in {compact:?}");
        // And the glibc frames did take compact rules (stack-pointer based: glibc keeps no
        // frame pointers), so the comparison above covered them.
        let mut cache = DwarfCache::new();
        let sp_rules = compact
            .iter()
            .filter_map(|f| f.lookup_address())
            .filter(|&a| table.code_image(a).is_some_and(|i| i.is_libc))
            .filter(|&a| {
                matches!(
                    cache.compact.rule(table, a),
                    crate::unwind::rules::Rule::Sp { .. }
                )
            })
            .count();
        assert!(
            sp_rules >= 1,
            "no compact rule for glibc frames in {compact:?}"
        );
    }
}
