//! Unwind: walking a stack from a start state, bounded to known stacks.
//!
//! One walker serves the three unwinders. Each step takes the current frame `(ip, sp, fp)`
//! to its caller's:
//! * a *frame-pointer step* reads the frame record at `fp` (`[fp]` = caller's fp,
//!   `[fp+8]` = return address) — about a nanosecond;
//! * a *DWARF step* applies the `.eh_frame` rule for `ip`: for a return address, a compact
//!   rule cached per address and applied inline (`rules`); otherwise, and for rows with no
//!   compact form, through framehop. Both are allocation-free.
//!
//! `Fast` takes only frame-pointer steps, `Precise` only DWARF steps. `Auto` takes
//! frame-pointer steps while the function it is in keeps frame pointers (judged per function
//! from its call-frame information, see [`crate::image`]) and DWARF steps where it does not
//! (glibc, a crate built without frame pointers), and tries a DWARF step wherever a
//! frame-pointer step fails.
//!
//! `Fast` never steps out of a function that keeps no frame pointers (its `rbp` is not a frame
//! record: the step would skip its caller or follow garbage): when the image table is known,
//! the frame-pointer walk stops at such a frame and the walk goes on from there as `Auto`
//! (DWARF for that frame, frame pointers again where the code keeps them), or, without a
//! DWARF cache, ends and reports it (`WalkEnd::fp_unsafe`; the capture functions then end
//! the trace with `Truncated`). Without an image table (a signal handler before
//! [`crate::prepare`]) nothing can be judged and `Fast` trusts every frame record.
//!
//! The stop frame: a runtime that calls user code on a coroutine gives the stack pointer of
//! its function that made the call (`stop_sp`); the walk ends with the frame whose caller's
//! stack pointer (its CFA) is at or above it on that stack, so neither the runtime's frames
//! nor anything above them appear. A stack pointer, not a frame pointer: in code built without
//! frame pointers `rbp` is an ordinary register that may hold the same value for many frames.
//!
//! The frame-pointer walk's common step — the caller's record higher up in the same stack,
//! aligned, below the stop frame, and a return address into code known to keep frame pointers
//! with no hop in it — runs in a tight loop (`FpWalk::run`, about ten instructions a frame);
//! anything else takes the full step (`FpWalk::step`), which the loop never contradicts: the
//! loop accepts a subset of what the full step's fast path accepts (a test checks both
//! against a plain reference walk on random stacks). A suspended context's `Fast` walk runs
//! in one go (`fp_walk_into`, into the backtrace's storage without the general walk's sink
//! and DWARF state); where it cannot finish alone (code without frame pointers on the way,
//! more frames than fit) it gives up and the general walk starts over, so its result is
//! always the general walk's (a test compares the two). Its usual case — one code range
//! from the first frame to the stop frame — runs without even the frame-pointer walk's state
//! (`lean_run`), which hands over to it where that case ends (a test compares the results
//! on random stacks). An `Auto` walk takes the same path
//! when `fp_walk_is_auto` finds every step one `Auto` takes the same way (else, again, the
//! general walk).
//!
//! Frame-pointer steps honour registered [`hop`]s (code such as LuaJIT's interpreter that
//! calls out with a fixed C frame and no frame record of its own).
//!
//! Signal frames: when `Auto` or `Precise` meets a return into the kernel's signal-return
//! trampoline (recognised by its code, `mov $15,%rax; syscall`, inside a loaded image), the
//! walk resumes from the interrupted context saved in the signal frame — the interrupted
//! function is reported as a `Pc` frame, and the next step uses DWARF (it may have been
//! interrupted in a prologue). `Fast` does not: past a handler it follows the frame-pointer
//! chain, which skips the interrupted function's own frame (a missing frame).
//!
//! Invariants that keep a walk safe on a corrupted or cyclic chain: every read is inside one
//! of the given `Stacks`; within one stack each frame must lie above the previous one; a walk
//! may move to another stack at most once per stack; and it stops after [`MAX_WALK`] frames
//! (the trace then ends with `Truncated`).

use crate::arch::{regs_fp, set_regs_fp, unwind_regs, UnwindCache, UnwindRegs};
use framehop::{FrameAddress, MustNotAllocateDuringUnwind, Unwinder as _};

use crate::arch::{Registers, StackBounds};
use crate::backtrace::{FrameSink, Unwinder};
use crate::frame::Frame;
use crate::image::ImageTable;

pub mod hop;
#[cfg(feature = "libunwind")]
pub mod libunwind;
pub(crate) mod rules;

pub use hop::{fp_hops, register_fp_hop};

/// The most frames one walk visits before it gives up and marks the trace `Truncated`.
pub const MAX_WALK: usize = 1 << 17;

/// Entries of one framehop rule cache (a direct-mapped table indexed by address modulo this).
const RULES_PER_CACHE: u64 = 509;
/// framehop rule caches per [`DwarfCache`].
const RULE_CACHES: usize = 4;

/// A preallocated DWARF rule cache, reusable across walks. Creating one allocates; using
/// one does not.
///
/// framehop's rule cache is direct-mapped by address modulo 509: two hot code addresses
/// that differ by a multiple of 509 evict each other on every walk, and each then pays the
/// full CFI evaluation (measured: two such frames doubled the cost of a 42-frame precise
/// capture). Four caches chosen by `(address / 509) % 4` act as one direct-mapped cache
/// modulo 2,036, so such pairs rarely collide.
///
/// In front of them, the compact rules of `rules` step most return addresses without
/// framehop.
pub struct DwarfCache {
    framehop: [UnwindCache<MustNotAllocateDuringUnwind>; RULE_CACHES],
    pub(crate) compact: rules::RuleCache,
    use_compact: bool,
    /// Which code keeps frame pointers, for the walks that use this cache.
    pub(crate) ranges: RangeCache,
}

impl DwarfCache {
    /// A new, empty cache.
    pub fn new() -> Self {
        DwarfCache {
            framehop: std::array::from_fn(|_| UnwindCache::new_in()),
            compact: rules::RuleCache::new(),
            ranges: RangeCache::new(),
            use_compact: true,
        }
    }

    /// Whether DWARF steps use the compact rules (the default) or framehop for every frame
    /// (to compare the two).
    pub fn set_compact_rules(&mut self, on: bool) {
        self.use_compact = on;
    }

    /// The rule cache for the code address framehop will look up for `addr`.
    #[inline]
    fn for_address(&mut self, addr: FrameAddress) -> &mut UnwindCache<MustNotAllocateDuringUnwind> {
        let a = addr.address_for_lookup();
        &mut self.framehop[((a / RULES_PER_CACHE) % RULE_CACHES as u64) as usize]
    }
}

impl Default for DwarfCache {
    fn default() -> Self {
        Self::new()
    }
}

/// The stacks a walk may read.
pub(crate) struct Stacks<'a> {
    segs: &'a [StackBounds],
}

impl<'a> Stacks<'a> {
    pub fn new(segs: &'a [StackBounds]) -> Self {
        Stacks { segs }
    }

    #[inline]
    fn find(&self, addr: u64) -> Option<usize> {
        self.segs.iter().position(|s| s.contains(addr))
    }

    /// Reads the word at `addr` if `[addr, addr+8)` lies inside one of the stacks.
    #[inline]
    fn read(&self, addr: u64) -> Option<u64> {
        if !addr.is_multiple_of(8) {
            return None;
        }
        let end = addr.checked_add(8)?;
        if !self.segs.iter().any(|s| addr >= s.lo && end <= s.hi) {
            return None;
        }
        // SAFETY: the word lies inside a stack range the caller vouched is mapped and
        // readable (the current thread's live stack, or a suspended coroutine's stack that
        // cannot be resumed during the walk). A volatile read: another thread may own it.
        Some(unsafe { std::ptr::read_volatile(addr as *const u64) })
    }
}

/// Where a walk starts.
#[derive(Clone, Copy)]
pub(crate) struct Start {
    pub regs: Registers,
    /// Emit `ip` itself as the first frame (`Pc`); otherwise start with the caller.
    pub emit_ip: bool,
    /// Take the first step with DWARF when available (an interrupted context may be in a
    /// prologue, where the frame pointer is not set up yet).
    pub first_step_dwarf: bool,
    /// When nonzero: the stack pointer of a runtime's entry frame (the function that called
    /// the user's code, at the call). The walk ends with the frame whose caller's stack
    /// pointer is at or above this value on the stack holding it, without emitting the
    /// return address into the entry function (the runtime's frames are not the user's).
    pub stop_sp: u64,
}

/// How a walk ended.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WalkEnd {
    /// Cut at [`MAX_WALK`] although the stack went on.
    pub cut: bool,
    /// Met a code address outside every known image (a library loaded after the image
    /// table was built, or JIT code): a refreshed table may do better.
    pub unknown_code: bool,
    /// A `Fast` walk ended after a frame in code that keeps no frame pointers (the frames
    /// emitted are right; the ones beyond could not be trusted).
    pub fp_unsafe: bool,
}

/// Walks from `start`, feeding `sink`.
pub(crate) fn walk(
    start: Start,
    stacks: &Stacks<'_>,
    mode: Unwinder,
    table: Option<&ImageTable>,
    cache: Option<&mut DwarfCache>,
    sink: &mut FrameSink<'_>,
) -> WalkEnd {
    let mut end = WalkEnd::default();
    end.cut = walk_inner(start, stacks, mode, table, cache, sink, &mut end);
    end
}

/// Whether a frame-pointer walk may start at `ip`, whose code range (as the image table has
/// it) is `range`: its function keeps frame pointers, or lies outside every image (frame
/// pointers are the only hope), or in a hop. With the range to seed the walk's fast path
/// with (a function's first return addresses are often in it: a recursion, a loop's calls).
#[inline]
fn fp_at_ip(range: Option<(u64, u64, bool)>, ip: u64) -> (bool, Option<(u64, u64)>) {
    let ok = range.is_none_or(|r| r.2) || !hop::Hops::snapshot().misses(ip);
    (ok, range.filter(|r| r.2).map(|(s, e, _)| (s, e)))
}

/// The frame-pointer walk of a suspended context's stack, `[regs.sp, hi)`, into `dst`: its
/// `Pc`, then a return address per frame, ending at the frame whose caller's stack pointer
/// reaches `stop_sp` (when nonzero). The frames are those of the general walk (`walk` with
/// `Fast`, one stack, no skipping), written straight into `dst` without its generality (the
/// sink, the walk's state for DWARF): a few hundred instructions fewer a walk.
///
/// `None` when the general walk is needed: the code at `ip`, or at a return address on the
/// way, keeps no frame pointers (DWARF goes on from there), or the frames do not fit `dst`
/// (the general walk keeps the outermost ones).
pub(crate) fn fp_walk_into(
    regs: Registers,
    hi: u64,
    stop_sp: u64,
    table: &ImageTable,
    ranges: &mut RangeCache,
    dst: &mut [std::mem::MaybeUninit<Frame>],
) -> Option<usize> {
    let hops = hop::Hops::snapshot();
    // With hops registered (an interpreter such as LuaJIT's in the process), stacks go
    // between code ranges within a few frames, where the lean start would hand over at once:
    // a parked Lua fiber's walk cost ~110 instructions more with it.
    let lean = hops.is_empty();
    fp_walk_into_with(regs, hi, stop_sp, table, ranges, dst, (lean, hops))
}

/// [`fp_walk_into`] under the hops `hops`, with its lean start (`lean_run`) or without it
/// (the general walk alone: what tests compare it with).
#[inline(always)]
fn fp_walk_into_with(
    regs: Registers,
    hi: u64,
    stop_sp: u64,
    table: &ImageTable,
    ranges: &mut RangeCache,
    dst: &mut [std::mem::MaybeUninit<Frame>],
    (lean, hops): (bool, hop::Hops),
) -> Option<usize> {
    let Registers { ip, sp, fp } = regs;
    let range = ranges.range(table, ip);
    let ip_ok = range.is_none_or(|r| r.2) || !hops.misses(ip);
    let seed = range.filter(|r| r.2).map(|(s, e, _)| (s, e));
    if !ip_ok || dst.len() < 2 {
        return None;
    }
    dst[0] = std::mem::MaybeUninit::new(Frame::Pc(ip));
    // The common walk first, on its own (`lean_run`); the general one from where it stopped.
    let (from, n) = match seed {
        Some(code) if lean => match lean_run(fp, sp, hi, stop_sp, code, &hops, &mut dst[1..]) {
            Lean::Ended(n) => return Some(1 + n),
            Lean::Full => return None,
            Lean::From(at, n) => (at, n),
        },
        _ => (fp, 0),
    };
    fp_walk_on(
        (sp, hi, stop_sp),
        table,
        ranges,
        &mut dst[1 + n..],
        (from, seed, hops),
    )
    .map(|m| 1 + n + m)
}

/// The general frame-pointer walk of `[sp, hi)` from the record at `from`, with `seed` the
/// code range known to keep frame pointers, into `dst`: how many frames, `None` when it did
/// not end there.
#[inline(never)]
fn fp_walk_on(
    (sp, hi, stop_sp): (u64, u64, u64),
    table: &ImageTable,
    ranges: &mut RangeCache,
    dst: &mut [std::mem::MaybeUninit<Frame>],
    (from, seed, hops): (u64, Option<(u64, u64)>, hop::Hops),
) -> Option<usize> {
    let bounds = [StackBounds::new(sp, hi)];
    let stacks = Stacks::new(&bounds);
    let Some(seg) = fp_start(&stacks, from, sp) else {
        return Some(0);
    };
    let (mut w, mut fp) = FpWalk::new_with(&stacks, from, stop_sp, seg, Some(table), ranges, hops);
    if let Some((s, e)) = seed {
        w.set_ok(s, e - s);
    }
    let (m, ended) = w.fill(&mut fp, dst);
    (ended && w.not_fp.is_none()).then_some(m)
}

/// How [`lean_run`] ended.
enum Lean {
    /// The walk is over: this many frames were written, as the general walk writes them.
    Ended(usize),
    /// The slots ran out (the general walk gives up then too).
    Full,
    /// The general walk goes on from the frame record at the first value, the second value's
    /// frames written: exactly its state had it walked them itself.
    From(u64, usize),
}

impl Lean {
    /// `Full`, out of line: made in the loop's exit, the value was set at every turn.
    #[cold]
    #[inline(never)]
    fn full() -> Lean {
        Lean::Full
    }
}

/// A suspended context's frame-pointer walk as most of them go: the stop frame in this stack
/// `[sp, hi)`, every return address in the code range `code` known to keep frame pointers
/// (outside the hops), the chain ending at the stop frame's record. Those frames are what
/// `FpWalk::new`, `set_ok(code)` and `fill` give — the same loop (`FpWalk::run`) and the same
/// end (`FpWalk::step`'s two fast cases) — without building the general walk's state: a
/// 30-frame walk's fixed part was ~200 instructions of it. Anything else leaves the rest to
/// the general walk: `From` the record it stopped at (the general walk's state there is
/// what a fresh one started at that record has: the same segment, bounds and code range).
///
/// Out of line, so that the loop has the registers to itself: inlined beside the general
/// walk's state, its frame pointer went through memory at every step (a store and a reload
/// on the chain of dependent loads).
#[inline(never)]
fn lean_run(
    fp: u64,
    sp: u64,
    hi: u64,
    stop_sp: u64,
    (s, e): (u64, u64),
    hops: &hop::Hops,
    dst: &mut [std::mem::MaybeUninit<Frame>],
) -> Lean {
    // The start as `fp_start` and `FpWalk::new` take it: `fp` a readable record of this
    // stack, not the stop frame's, the stop in this stack (else the general walk decides).
    let readable =
        |a: u64| a.is_multiple_of(8) && a >= sp && a.checked_add(16).is_some_and(|e| e <= hi);
    if stop_sp < sp || stop_sp > hi || !readable(fp) || fp + 16 >= stop_sp {
        return Lean::From(fp, 0);
    }
    // `FpWalk::enter`'s bounds for this segment, and `set_ok`'s return addresses.
    let top = hi.saturating_sub(16).min(stop_sp.saturating_sub(24));
    let stop_at = stop_sp.saturating_sub(16);
    let (rlo, rhi) = run_ras(s, e - s, hops.span());
    let top8 = top >> 3;
    let mut at = fp;
    if at.wrapping_sub(1) >= top {
        return Lean::From(fp, 0);
    }
    if rlo > rhi {
        return Lean::From(fp, 0);
    }
    let rlen = rhi - rlo;
    // About fourteen operations a frame (the walk is bound by their number, not by its
    // chain of loads): each test one compare, no value kept from the loop's tests for
    // after it (that cost two more instructions a frame).
    let slots = dst.as_mut_ptr();
    let room = dst.len();
    // The record at `at`: the caller's record and the return address.
    let record = |at: u64| {
        // `at` is a record `[at, at + 16)` inside `[sp, hi)`: `readable` for the first one;
        // each next one is aligned, above the last and at most `top <= hi - 16`.
        // SAFETY: inside a stack the caller vouched is mapped and readable (see above).
        unsafe {
            (
                std::ptr::read_volatile(at as *const u64),
                std::ptr::read_volatile((at + 8) as *const u64),
            )
        }
    };
    let mut n = 0;
    // Nothing but `at` and `n` leaves the loop (the record where it stopped is read again
    // after it): values carried out of it cost instructions in every turn.
    while n < room {
        let (next, ra) = record(at);
        // `FpWalk::run`'s test.
        if next <= at || next.rotate_right(3) > top8 || ra.wrapping_sub(rlo) > rlen {
            break;
        }
        // SAFETY: `n < room` (`dst.len()`): one of the slots `dst` borrows exclusively.
        unsafe {
            slots
                .add(n)
                .write(std::mem::MaybeUninit::new(Frame::Ra(ra)))
        };
        n += 1;
        at = next;
    }
    if n == room {
        return Lean::full();
    }
    let (next, ra) = record(at);
    // `FpWalk::step` at that record. Its fast path cannot go on where the loop stopped: a
    // caller's record up to `top` with a return address in `run_ras` is the loop's own
    // step, and one outside it fails this end's test too, which leaves it to the general
    // walk. Its second case is the usual end, the caller's record the stop frame's.
    // (`at + 8 <= next`: `next > at` for an aligned `next`, written so that the loop keeps
    // no result of its own compare for it.)
    if ra.wrapping_sub(rlo) <= rlen && at + 8 <= next && next >= stop_at && readable(next) {
        dst[n] = std::mem::MaybeUninit::new(Frame::Ra(ra));
        n += 1;
        // (A walk that filled its slots with its last frame is not known to have ended.)
        return if n == dst.len() {
            Lean::Full
        } else {
            Lean::Ended(n)
        };
    }
    Lean::From(at, n)
}

/// Whether `frames`, a suspended context's `Fast` walk done in one go ([`fp_walk_into`]), are
/// also what `Auto` finds: `Auto` takes a frame-pointer step wherever the code keeps frame
/// pointers, so they are its frames when every step was one it takes the same way. Checked
/// by following the chain again beside them: the code at `ip` and at each return address
/// known to the image table (`Auto` rereads the loader's list when it is not), each record at
/// least 16 bytes above the last (its rule: a frame pointer at or above the stack pointer;
/// elsewhere it tries DWARF), the last one's caller the stop frame (not a broken chain, where
/// it would try DWARF too), and no return address in a hop's span or at its edges (`Auto`
/// judges the code at `ra - 1`, the walk at `ra`) or in the C library's code (where `Auto`
/// looks for the signal trampoline).
///
/// Kept apart from the walk itself, so that `Fast` walks pay nothing for it.
pub(crate) fn fp_walk_is_auto(
    regs: Registers,
    hi: u64,
    stop_sp: u64,
    table: &ImageTable,
    ranges: &mut RangeCache,
    frames: &[Frame],
) -> bool {
    let Registers { ip, sp, fp } = regs;
    let (hl, hh) = hop::Hops::snapshot().span();
    let libc = table.libc_span;
    let plain = |ra: u64| (hl >= hh || ra < hl || ra > hh) && (ra < libc.0 || ra >= libc.1);
    // The stop frame's records start at `stop_at` (when the stop is in this stack).
    if stop_sp == 0 || stop_sp < sp || stop_sp > hi || !ranges.range(table, ip).is_some_and(|r| r.2)
    {
        return false;
    }
    let stop_at = stop_sp.saturating_sub(16);
    let readable =
        |at: u64| at.is_multiple_of(8) && at >= sp && at.checked_add(16).is_some_and(|e| e <= hi);
    let [Frame::Pc(first), ras @ ..] = frames else {
        return false;
    };
    if *first != ip || !readable(fp) {
        return false;
    }
    let mut at = fp;
    for (k, f) in ras.iter().enumerate() {
        let &Frame::Ra(want) = f else {
            return false;
        };
        let pc = want.wrapping_sub(1);
        if at >= stop_at || !plain(want) || !ranges.range(table, pc).is_some_and(|r| r.2) {
            return false;
        }
        // SAFETY: [at, at+16) lies inside the context's stack, `[sp, hi)` (`readable`
        // checked `fp` above and each next record below before it became `at`), which the
        // caller vouched is mapped and readable. Volatile: another thread may own the stack.
        let (next, ra) = unsafe {
            (
                std::ptr::read_volatile(at as *const u64),
                std::ptr::read_volatile((at + 8) as *const u64),
            )
        };
        if ra != want || next < at + 16 {
            return false;
        }
        if k + 1 == ras.len() {
            // The last: the walk ended because its caller's record is the stop frame's.
            // `Auto` steps to it by frame pointers when it may be read (exact). When not —
            // the runtime's stop record often reaches into the 16 bytes its stack bounds
            // leave out — it takes a DWARF step, whose frame address, for code the image
            // table judged to keep frame pointers, is that record plus 16 (rbp-based): at
            // the stop too. An rsp-based rule at such a return address would break this;
            // none is known (how the result could be wrong: one frame more from `Auto`).
            return next >= stop_at;
        }
        if !readable(next) {
            return false;
        }
        at = next;
    }
    // Only the `Pc`: the first record is the stop frame's.
    at >= stop_at
}

/// The stack holding frame pointer `fp`, if a frame-pointer walk may start there (inside a
/// stack, and not below the stack pointer `sp` in it).
#[inline]
fn fp_start(stacks: &Stacks<'_>, fp: u64, sp: u64) -> Option<usize> {
    let seg = stacks.find(fp)?;
    (stacks.find(sp) != Some(seg) || fp >= sp).then_some(seg)
}

/// Whether a walk at stack pointer `sp`, in the stack `[lo, hi)`, has reached the stop frame.
#[inline(always)]
fn at_stop(stop_sp: u64, sp: u64, lo: u64, hi: u64) -> bool {
    stop_sp != 0 && sp >= stop_sp && stop_sp >= lo && stop_sp <= hi
}

fn walk_inner(
    start: Start,
    stacks: &Stacks<'_>,
    mode: Unwinder,
    table: Option<&ImageTable>,
    mut cache: Option<&mut DwarfCache>,
    sink: &mut FrameSink<'_>,
    end: &mut WalkEnd,
) -> bool {
    let Registers { ip, sp, fp } = start.regs;
    if start.emit_ip && !sink.push(Frame::Pc(ip)) {
        return false;
    }
    // (The DWARF walk's state is made when it is needed: a frame-pointer walk that ends on
    // its own never needs it.)
    let (mut regs, mut addr);
    let mut first = true;
    let mut mode = mode;
    if mode != Unwinder::Fast && table.is_some() && cache.is_some() {
        regs = unwind_regs(ip, sp, fp);
        addr = FrameAddress::from_instruction_pointer(ip);
    } else {
        // The first frame record read is that of the function at `ip`.
        let (ip_ok, seed) = match table {
            None => (true, None),
            Some(t) => {
                let range = match cache.as_deref_mut() {
                    Some(c) => c.ranges.range_recent(t, ip),
                    None => t.code_range(ip),
                };
                fp_at_ip(range, ip)
            }
        };
        if ip_ok {
            let ranges = cache.as_deref_mut().map(|c| &mut c.ranges);
            match fp_walk((fp, sp), start.stop_sp, stacks, table, ranges, seed, sink) {
                FpEnd::Done(cut) => return cut,
                // Stopped at a return address into code without frame pointers (emitted):
                // the walk goes on from its caller's state.
                FpEnd::NotFp { ra, sp, bp } => {
                    regs = unwind_regs(ra, sp, bp);
                    match FrameAddress::from_return_address(ra) {
                        Some(a) => addr = a,
                        None => return false,
                    }
                    first = false;
                }
            }
        } else {
            regs = unwind_regs(ip, sp, fp);
            addr = FrameAddress::from_instruction_pointer(ip);
        }
        // Code without frame pointers: DWARF from here on, if there is a cache to do it with.
        if table.is_none() || cache.is_none() {
            end.fp_unsafe = true;
            return false;
        }
        mode = Unwinder::Auto;
    }
    let table = table.expect("checked");
    let mut cur = SegCursor::at(stacks, regs.sp());
    let mut fp_range: (u64, u64) = (0, 0); // last code range known to keep frame pointers
                                           // Just resumed from a signal frame: the interrupted code may be in a prologue.
    let mut after_signal = false;
    let mut steps = 0;
    while steps < MAX_WALK {
        steps += 1;
        // The common frames of a DWARF walk, in a tight loop; it stops at the first other one,
        // which the step below takes.
        if mode == Unwinder::Precise && addr.is_return_address() && !after_signal {
            if let Some(c) = cache.as_deref_mut().filter(|c| c.use_compact) {
                steps += compact_run(
                    table,
                    &mut c.compact,
                    (start.stop_sp, MAX_WALK - steps),
                    &cur,
                    &mut regs,
                    &mut addr,
                    sink,
                );
            }
        }
        // (`ra - 1` for a return address: a call may be a function's last instruction.)
        let pc = addr.address_for_lookup();
        let use_fp = match mode {
            Unwinder::Precise => false,
            _ if (first && start.first_step_dwarf) || after_signal => false,
            _ if pc >= fp_range.0 && pc < fp_range.1 => true,
            // A registered hop steps its code's frames (LuaJIT's interpreter).
            _ if !cur.hops.misses(pc) => true,
            // (The cache is there: the walk came here only with one.)
            _ => match cache.as_deref_mut().and_then(|c| c.ranges.range(table, pc)) {
                Some((s, e, true)) => {
                    fp_range = (s, e);
                    true
                }
                Some((_, _, false)) => false,
                // Code outside any image (JIT, a library loaded since the table was
                // built, or a bad address): frame pointers are the only hope.
                None => {
                    end.unknown_code = true;
                    true
                }
            },
        };
        first = false;
        after_signal = false;
        // A broken frame-pointer chain lets DWARF try the same frame.
        let fp = if use_fp {
            cur.fp_step(stacks, &mut regs)
        } else {
            None
        };
        let step = fp.or_else(|| {
            dwarf_step(
                table,
                cache.as_deref_mut(),
                stacks,
                addr,
                &mut regs,
                &mut cur,
            )
        });
        let Some(ra) = step else { return false };
        if ra == 0 || at_stop(start.stop_sp, regs.sp(), cur.lo, cur.hi) || !sink.push(Frame::Ra(ra))
        {
            return false;
        }
        // A signal handler returns to the kernel's trampoline, above which the signal frame
        // holds the interrupted context. The walk goes on from there; the interrupted
        // function (its pc is in that context, in no frame record) is reported as a `Pc`.
        if let Some(next) = signal_frame(table, stacks, ra, regs.sp()) {
            let same_stack = next.sp >= cur.lo && next.sp < cur.hi;
            if (same_stack && next.sp <= regs.sp())
                || (!same_stack && !cur.enter(stacks, next.sp))
                || !sink.push(Frame::Pc(next.ip))
            {
                return false;
            }
            regs = unwind_regs(next.ip, next.sp, next.fp);
            addr = FrameAddress::from_instruction_pointer(next.ip);
            after_signal = true;
            continue;
        }
        match FrameAddress::from_return_address(ra) {
            Some(a) => addr = a,
            None => return false,
        }
    }
    true
}

/// The last code ranges walks met, with whether their functions keep frame pointers: walks
/// go back and forth between a handful of them (the program's, the standard library's, the
/// C library's), and a lookup in the table is a binary search over thousands of ranges. Kept
/// across walks (in a [`DwarfCache`], or per thread); entries belong to one image table and
/// are dropped when another is used.
pub(crate) struct RangeCache {
    r: [(u64, u64, bool); RANGES],
    /// The image table the entries come from (its address).
    table: usize,
}

const RANGES: usize = 16;
/// How many of them [`RangeCache::range_recent`] looks at inline.
const INLINE_RANGES: usize = 3;

impl RangeCache {
    pub(crate) const fn new() -> Self {
        RangeCache {
            r: [(0, 0, false); RANGES],
            table: 0,
        }
    }

    /// The range holding `pc` (see [`ImageTable::code_range`]).
    ///
    /// Inlined for the common case, the last range found (a walk's frames are mostly in
    /// one); the rest is [`RangeCache::range_slow`].
    #[inline(always)]
    pub(crate) fn range(&mut self, table: &ImageTable, pc: u64) -> Option<(u64, u64, bool)> {
        let r = self.r[0];
        if self.table == table as *const ImageTable as usize && pc >= r.0 && pc < r.1 {
            return Some(r);
        }
        self.range_slow(table, pc)
    }

    /// As [`RangeCache::range`], looking at the three ranges found last inline, for a walk
    /// that goes back and forth between a few: a parked Lua fiber's starts in the runtime's
    /// code and goes between the program's code and the VM's C code, four lookups a walk
    /// (out of line, each was a call, a scan and a swap: every fiber moved, `fiber.info()`
    /// over 10,000 fibers, medians 0.557 -> 0.537 us a fiber). A hit leaves the order as it
    /// is, so that those ranges all stay in front. (The suspended walk's first lookup keeps
    /// [`RangeCache::range`]: the two more compares were 8% of a 30-frame walk.)
    #[inline(always)]
    pub(crate) fn range_recent(&mut self, table: &ImageTable, pc: u64) -> Option<(u64, u64, bool)> {
        if self.table == table as *const ImageTable as usize {
            for &r in &self.r[..INLINE_RANGES] {
                if pc >= r.0 && pc < r.1 {
                    return Some(r);
                }
            }
        }
        self.range_slow(table, pc)
    }

    #[inline(never)]
    fn range_slow(&mut self, table: &ImageTable, pc: u64) -> Option<(u64, u64, bool)> {
        let t = table as *const ImageTable as usize;
        if self.table != t {
            *self = RangeCache::new();
            self.table = t;
        }
        for (i, &r) in self.r.iter().enumerate() {
            if pc >= r.0 && pc < r.1 {
                // Most recently found first next time.
                if i != 0 {
                    self.r.swap(0, i);
                }
                return Some(r);
            }
        }
        let r = table.code_range(pc)?;
        // Newest in front; the last one goes.
        self.r.copy_within(0..RANGES - 1, 1);
        self.r[0] = r;
        Some(r)
    }
}

/// The interrupted context when `ra` is the signal-return trampoline (its code checked
/// byte for byte, inside a loaded image) and `sp` the stack pointer it returns with, which
/// points at the signal frame's `ucontext_t`.
fn signal_frame(table: &ImageTable, stacks: &Stacks<'_>, ra: u64, sp: u64) -> Option<Registers> {
    // Only the C library's code holds the trampoline (a range check per frame, no lookup).
    let end = ra.checked_add(9)?;
    if ra < table.libc_span.0 || end > table.libc_span.1 {
        return None;
    }
    if !table.libc_code.iter().any(|&(s, e)| ra >= s && end <= e) {
        return None;
    }
    // SAFETY: [ra, ra+9) lies inside a loaded image's code, which stays mapped while the
    // image table lists it.
    if !unsafe { crate::arch::is_sigreturn(ra) } {
        return None;
    }
    let (ip, rsp, rbp) = crate::arch::UCONTEXT_REGS;
    Some(Registers {
        ip: stacks.read(sp.checked_add(ip)?)?,
        sp: stacks.read(sp.checked_add(rsp)?)?,
        fp: stacks.read(sp.checked_add(rbp)?)?,
    })
}

/// Which stack the walk is in (the one holding the current stack pointer), and which stacks
/// it has been in.
struct SegCursor {
    lo: u64,
    hi: u64,
    seg: usize,
    visited: u64,
    hops: hop::Hops,
}

impl SegCursor {
    fn at(stacks: &Stacks<'_>, sp: u64) -> Self {
        let mut c = SegCursor {
            lo: 0,
            hi: 0,
            seg: usize::MAX,
            visited: 0,
            hops: hop::Hops::snapshot(),
        };
        c.enter(stacks, sp);
        c
    }

    /// Moves to another stack, the one holding `addr`; returns false (and stays) if there
    /// is none, or it is the current one, or it was visited before — moving down within a
    /// stack or back to an earlier stack would let a corrupted chain cycle.
    fn enter(&mut self, stacks: &Stacks<'_>, addr: u64) -> bool {
        match stacks.find(addr) {
            Some(s) => {
                let bit = 1u64 << (s % 64);
                if self.visited & bit != 0 {
                    return false;
                }
                self.visited |= bit;
                self.seg = s;
                self.lo = stacks.segs[s].lo;
                self.hi = stacks.segs[s].hi;
                true
            }
            None => false,
        }
    }

    /// One frame-pointer step: from the frame whose frame pointer is `regs.bp` to its
    /// caller. Returns the return address and updates `regs` to the caller's state.
    #[inline(always)]
    fn fp_step(&mut self, stacks: &Stacks<'_>, regs: &mut UnwindRegs) -> Option<u64> {
        let fp = regs_fp(regs);
        if !fp.is_multiple_of(8) {
            return None;
        }
        // Within one stack the frame record lies above the stack pointer; a record in
        // another stack means the chain moves there (once per stack).
        let end = fp.checked_add(16)?;
        let in_current = fp >= regs.sp() && fp >= self.lo && end <= self.hi;
        if !in_current {
            let moved = self.enter(stacks, fp);
            if !moved || end > self.hi {
                return None;
            }
        }
        // SAFETY: [fp, fp+16) lies inside the current stack segment (checked above), which
        // the caller vouched is mapped and readable.
        let (next, ra) = unsafe {
            (
                std::ptr::read_volatile(fp as *const u64),
                std::ptr::read_volatile((fp + 8) as *const u64),
            )
        };
        regs.set_sp(fp + 16);
        set_regs_fp(regs, self.hops.next_record(fp, ra, next));
        regs.set_ip(ra);
        Some(ra)
    }
}

fn dwarf_step(
    table: &ImageTable,
    cache: Option<&mut DwarfCache>,
    stacks: &Stacks<'_>,
    addr: FrameAddress,
    regs: &mut UnwindRegs,
    cur: &mut SegCursor,
) -> Option<u64> {
    let cache = cache?;
    let before = regs.sp();
    let rule = if cache.use_compact && addr.is_return_address() {
        cache.compact.rule(table, addr.address_for_lookup())
    } else {
        rules::Rule::Other
    };
    let ra = match rule {
        rules::Rule::Other => {
            let mut read = |a: u64| stacks.read(a).ok_or(());
            match table
                .unwinder
                .unwind_frame(addr, regs, cache.for_address(addr), &mut read)
            {
                Ok(Some(ra)) => ra,
                _ => return None,
            }
        }
        rule => apply(rule, stacks, regs)?,
    };
    let sp = regs.sp();
    // The stack pointer moves up within a stack, or into another stack (once per stack).
    let moved_up = sp > before && sp >= cur.lo && sp < cur.hi;
    if !moved_up && !cur.enter(stacks, sp) {
        return None;
    }
    regs.set_ip(ra);
    Some(ra)
}

/// The run of frames a DWARF walk meets most: return addresses whose compact rule is cached,
/// stepped inside the current stack, written straight into the backtrace — the state kept
/// in registers, one cache probe and two or three loads per frame. Takes the frames from
/// `addr` (a return address) on and leaves `regs` and `addr` at the first frame it did not
/// take, which the walk's general step then takes exactly as before: a rule not cached or
/// not compact, a read outside the current stack or misaligned, a stack pointer that does
/// not move up within it, the stop frame, a null return address, a return into the C
/// library (where a signal trampoline may be), no room left in the backtrace's head, or
/// entries of another image table. Each frame it takes is what [`dwarf_step`] and the
/// walk's checks give for it (the same rule, [`apply`]'s checks, the stop and the signal
/// frame checks), so the walk's result is unchanged. Takes at most `most` frames (what is
/// left of the walk's [`MAX_WALK`]); returns how many it took.
#[inline(always)]
fn compact_run(
    table: &ImageTable,
    rules: &mut rules::RuleCache,
    (stop_sp, most): (u64, usize),
    cur: &SegCursor,
    regs: &mut UnwindRegs,
    addr: &mut FrameAddress,
    sink: &mut FrameSink<'_>,
) -> usize {
    if sink.direct_room() == 0 || !rules.is_for(table) {
        return 0;
    }
    let (lo, hi) = (cur.lo, cur.hi);
    let (libc_lo, libc_hi) = table.libc_span;
    // A word of the current stack, if it lies there whole and aligned.
    let read = |a: u64| -> Option<u64> {
        if !a.is_multiple_of(8) || a < lo || a.checked_add(8)? > hi {
            return None;
        }
        // SAFETY: the word lies inside the current stack segment, which the walk's caller
        // vouched is mapped and readable (as `Stacks::read`); volatile: another thread may
        // own the stack.
        Some(unsafe { std::ptr::read_volatile(a as *const u64) })
    };
    let (mut sp, mut bp) = (regs.sp(), regs_fp(regs));
    let mut pc = addr.address_for_lookup();
    let mut last = 0u64;
    let dst = sink.direct_slots();
    let room = dst.len().min(most);
    // The loop's bounds, worked out once: a frame whose CFA reaches `stop` is the stop
    // frame's (`at_stop`), and a return address in `[near_libc, near_libc + libc_len)` is
    // one `ra < libc_hi && ra + 9 > libc_lo` refuses (see `dwarf_step`).
    let stop = if stop_sp != 0 && stop_sp >= lo && stop_sp <= hi {
        stop_sp
    } else {
        u64::MAX
    };
    let near_libc = libc_lo.saturating_sub(8);
    let libc_len = libc_hi.saturating_sub(near_libc);
    let mut n = 0;
    while n < room {
        let Some(rule) = rules.cached(pc) else { break };
        // The frame record first (the common rule), tested, not matched: a `match` became a
        // jump through a table whose target waited on the rule's load, and the samples of a
        // 42-frame capture piled up on that jump (`perf annotate`).
        let (cfa, new_bp, ra) = if rule == rules::Rule::Fp {
            // The record `[bp, bp + 16)`: the caller's `rbp`, then the return address.
            let Some(cfa) = bp.checked_add(16) else { break };
            if bp == 0 || !bp.is_multiple_of(8) || bp < lo || cfa <= sp || cfa >= hi {
                break;
            }
            // `[bp, bp + 16)` lies inside the current stack segment (`bp >= lo`, `bp + 16 <
            // hi`), aligned; volatile reads: another thread may own the stack.
            // SAFETY: a segment the walk's caller vouched is mapped and readable (as `read`).
            let (v, ra) = unsafe {
                (
                    std::ptr::read_volatile(bp as *const u64),
                    std::ptr::read_volatile((bp + 8) as *const u64),
                )
            };
            (cfa, v, ra)
        } else if let rules::Rule::Sp { cfa8, bp8 } = rule {
            let Some(cfa) = sp.checked_add(u64::from(cfa8) * 8) else {
                break;
            };
            let v = if bp8 == 0 {
                bp
            } else {
                let Some(v) = cfa.checked_add_signed(i64::from(bp8) * 8).and_then(read) else {
                    break;
                };
                v
            };
            if cfa <= sp || cfa >= hi {
                break;
            }
            let Some(ra) = read(cfa - 8) else { break };
            (cfa, v, ra)
        } else {
            break;
        };
        // Short of the stop frame, and a return into code the general step must judge.
        if cfa >= stop || ra == 0 || ra.wrapping_sub(near_libc) < libc_len {
            break;
        }
        dst[n] = std::mem::MaybeUninit::new(Frame::Ra(ra));
        n += 1;
        (sp, bp, pc, last) = (cfa, new_bp, ra - 1, ra);
    }
    if n > 0 {
        // SAFETY: slots 0..n of the direct region were written above; n is at most its
        // length, which is the direct room.
        unsafe { sink.commit_direct(n) };
        regs.set_sp(sp);
        set_regs_fp(regs, bp);
        regs.set_ip(last);
        *addr = FrameAddress::from_return_address(last).expect("a non-null return address");
    }
    n
}

/// Applies a compact rule (not `Other`) to a frame that is not the first: the caller's
/// registers into `regs`, its return address returned. The checks are framehop's for the
/// same rules: a null frame pointer or return address ends the walk, as does a frame record
/// below the stack pointer or a read outside the stacks.
#[inline(always)]
fn apply(rule: rules::Rule, stacks: &Stacks<'_>, regs: &mut UnwindRegs) -> Option<u64> {
    let (sp, bp) = (regs.sp(), regs_fp(regs));
    let (cfa, new_bp) = match rule {
        rules::Rule::Sp { cfa8, bp8 } => {
            let cfa = sp.checked_add(u64::from(cfa8) * 8)?;
            let new_bp = if bp8 == 0 {
                bp
            } else {
                stacks.read(cfa.checked_add_signed(i64::from(bp8) * 8)?)?
            };
            (cfa, new_bp)
        }
        rules::Rule::Fp => {
            if bp == 0 {
                return None;
            }
            let cfa = bp.checked_add(16)?;
            if cfa <= sp {
                return None;
            }
            (cfa, stacks.read(bp)?)
        }
        rules::Rule::End | rules::Rule::Other => return None,
    };
    let ra = stacks.read(cfa - 8)?;
    if ra == 0 {
        return None;
    }
    regs.set_sp(cfa);
    set_regs_fp(regs, new_bp);
    Some(ra)
}

/// The return addresses [`FpWalk::run`] may step out of, inclusive, for code known to keep
/// frame pointers at `[lo, lo + len)` and hops spanning `[hl, hh)`: `[lo + 1, lo + len]` (a
/// return address follows its call; never 0) without the hops' span. When the span lies
/// inside, the larger side is kept. Empty as `(1, 0)`.
#[inline]
fn run_ras(lo: u64, len: u64, (hl, hh): (u64, u64)) -> (u64, u64) {
    const EMPTY: (u64, u64) = (1, 0);
    // (Saturating: a range reaching past the address space's end is cut at it.)
    let (Some(a), b) = (lo.checked_add(1), lo.saturating_add(len)) else {
        return EMPTY;
    };
    if len == 0 {
        return EMPTY;
    }
    if hl >= hh || hh <= a || hl > b {
        return (a, b);
    }
    // Below the span: [a, hl - 1]; above it: [hh, b].
    let below = (hl > a).then(|| (a, hl - 1));
    let above = (hh <= b).then_some((hh, b));
    match (below, above) {
        (Some(x), Some(y)) if x.1 - x.0 >= y.1 - y.0 => x,
        (_, Some(y)) => y,
        (Some(x), None) => x,
        (None, None) => EMPTY,
    }
}

/// State of a frame-pointer walk: the stack it is in, and what ends it.
///
/// The current frame pointer is kept by the loop that drives the walk (in a register: as a
/// field it went through memory at every step). Invariant: that frame pointer is either 0
/// (the walk has ended) or a frame record that may be read — 8-byte aligned, with
/// `[fp, fp+16)` inside stack segment `seg`. Every value that becomes the frame pointer is
/// checked first, so a step reads without checking.
struct FpWalk<'s, 'a> {
    stacks: &'s Stacks<'a>,
    stop_sp: u64,
    /// The highest address the next record may start at on the fast path: `hi - 16`, or
    /// lower when `stop_sp` lies in this segment (a record whose caller's stack pointer,
    /// 16 above it, reaches `stop_sp` ends the walk; the fast path never looks for it).
    top: u64,
    /// Code known to keep frame pointers, `[ok_lo, ok_lo + ok_len)` (all code when no
    /// image table is given): a return address there may be stepped out of on the fast path.
    /// Set only through [`FpWalk::set_ok`], which keeps `run_ras` in step with it.
    ok_lo: u64,
    ok_len: u64,
    /// The return addresses [`FpWalk::run`] steps out of, inclusive: those `step`'s fast path
    /// accepts (in the `ok` code, not null) minus every hop's span. Empty as `(1, 0)`.
    run_ras: (u64, u64),
    table: Option<&'s ImageTable>,
    ranges: &'s mut RangeCache,
    /// Set when the walk ended after a return address into code without frame pointers:
    /// that frame's state (its pc, its stack pointer, `rbp` as saved by its callee).
    not_fp: Option<(u64, u64, u64)>,
    lo: u64,
    hi: u64,
    /// The lowest record address in this segment that is the stop frame's (its caller's
    /// stack pointer, 16 above it, reaches `stop_sp`): `u64::MAX` when the stop is elsewhere.
    stop_at: u64,
    seg: usize,
    visited: u64,
    hops: hop::Hops,
}

impl<'s, 'a> FpWalk<'s, 'a> {
    /// A walk whose first frame record is `fp`, in segment `seg`; returns it with the frame
    /// pointer to start from (0 when the record at `fp` may not be read).
    fn new(
        stacks: &'s Stacks<'a>,
        fp: u64,
        stop_sp: u64,
        seg: usize,
        table: Option<&'s ImageTable>,
        ranges: &'s mut RangeCache,
    ) -> (Self, u64) {
        Self::new_with(
            stacks,
            fp,
            stop_sp,
            seg,
            table,
            ranges,
            hop::Hops::snapshot(),
        )
    }

    /// [`FpWalk::new`] with the hops known to the caller (a snapshot it took).
    #[inline(always)]
    fn new_with(
        stacks: &'s Stacks<'a>,
        fp: u64,
        stop_sp: u64,
        seg: usize,
        table: Option<&'s ImageTable>,
        ranges: &'s mut RangeCache,
        hops: hop::Hops,
    ) -> (Self, u64) {
        let mut w = FpWalk {
            stacks,
            stop_sp,
            ok_lo: 0,
            ok_len: 0,
            run_ras: (1, 0),
            table,
            ranges,
            not_fp: None,
            top: 0,
            lo: 0,
            hi: 0,
            stop_at: u64::MAX,
            seg,
            visited: 1 << (seg % 64),
            hops,
        };
        if table.is_none() {
            w.set_ok(0, u64::MAX);
        }
        w.enter(seg);
        let mut fp = w.readable(fp);
        if fp != 0 && w.stops_at(fp) {
            fp = 0;
        }
        (w, fp)
    }

    /// Makes `[lo, lo + len)` the code known to keep frame pointers, and derives the return
    /// addresses [`FpWalk::run`] may step out of: `[lo + 1, lo + len]` (a return address
    /// follows its call) without the hops' span. When a hop lies inside, the larger side is
    /// kept; the other side's frames take `step`, which handles everything.
    fn set_ok(&mut self, lo: u64, len: u64) {
        (self.ok_lo, self.ok_len) = (lo, len);
        self.run_ras = run_ras(lo, len, self.hops.span());
    }

    /// The common steps in a tight loop, writing each return address to `dst[n..]`
    /// (`n <= dst.len()`): from the record at `*fp`, as long as the caller's record is higher
    /// up in the same stack, aligned and below the stop frame's, and the return address is
    /// one of `run_ras` (a subset of the steps `step` takes on its fast path, with fewer
    /// compares per frame). Returns the new count: at `dst`'s end, or at the first record
    /// that needs `step` (left at `*fp`).
    ///
    /// About ten instructions a frame: two loads, five compares with their branches (taken
    /// only at the end), the frame's two words stored.
    #[inline(always)]
    fn run(&self, fp: &mut u64, dst: &mut [std::mem::MaybeUninit<Frame>], n: usize) -> usize {
        let (top, (lo, hi)) = (self.top, self.run_ras);
        let mut at = *fp;
        // (0: the walk has ended; above `top`: a stop frame below the start, for `step`.)
        if at.wrapping_sub(1) >= top {
            return n;
        }
        // One pointer through the free slots, no count beside it; `next` aligned and at most
        // `top` in one compare (rotated, a misaligned value's low bits make it huge).
        let top8 = top >> 3;
        assert!(n <= dst.len(), "a count within the slots");
        let base = dst.as_mut_ptr();
        let end = base.wrapping_add(dst.len());
        let mut slot = base.wrapping_add(n);
        while slot < end {
            // SAFETY: by the invariant, [at, at+16) lies inside stack segment `seg`, which
            // the caller vouched is mapped and readable (`at` is nonzero and at most `top`,
            // checked above for the first record and below for each next one). Volatile:
            // another thread may own the stack.
            let (next, ra) = unsafe {
                (
                    std::ptr::read_volatile(at as *const u64),
                    std::ptr::read_volatile((at + 8) as *const u64),
                )
            };
            // (`next > at`, aligned, and `next <= top` keep the invariant for `next`.)
            if next <= at || next.rotate_right(3) > top8 || ra < lo || ra > hi {
                break;
            }
            // SAFETY: `slot` is one of `dst`'s slots (n <= slot - base < dst.len()), which
            // `dst` borrows exclusively.
            unsafe { slot.write(std::mem::MaybeUninit::new(Frame::Ra(ra))) };
            slot = slot.wrapping_add(1);
            at = next;
        }
        *fp = at;
        // SAFETY: `slot` lies in [base, end], inside (or one past) the same slice.
        unsafe { slot.offset_from(base) as usize }
    }

    /// Fills `dst` with the walk's next frames: how many, and whether the walk has ended.
    #[inline(always)]
    fn fill(&mut self, fp: &mut u64, dst: &mut [std::mem::MaybeUninit<Frame>]) -> (usize, bool) {
        let mut n = 0;
        loop {
            n = self.run(fp, dst, n);
            if n == dst.len() {
                return (n, false);
            }
            match self.step(fp) {
                Some(ra) => {
                    dst[n] = std::mem::MaybeUninit::new(Frame::Ra(ra));
                    n += 1;
                }
                None => return (n, true),
            }
        }
    }

    /// Whether the frame whose record is at `fp` (in the current segment) is the last: its
    /// caller's stack pointer, `fp + 16`, reaches the stop.
    #[inline]
    fn stops_at(&self, fp: u64) -> bool {
        at_stop(self.stop_sp, fp.saturating_add(16), self.lo, self.hi)
    }

    /// Makes `seg` the current segment.
    fn enter(&mut self, seg: usize) {
        let b = self.stacks.segs[seg];
        self.seg = seg;
        self.visited |= 1 << (seg % 64);
        self.lo = b.lo;
        self.hi = b.hi;
        self.top = b.hi.saturating_sub(16);
        self.stop_at = u64::MAX;
        if self.stop_sp != 0 && self.stop_sp >= b.lo && self.stop_sp <= b.hi {
            // A record at or above `stop_sp - 16` is the stop frame's: the slow path.
            self.top = self.top.min(self.stop_sp.saturating_sub(24));
            self.stop_at = self.stop_sp.saturating_sub(16);
        }
    }

    /// `fp` if a frame record there may be read in the current segment, else 0.
    #[inline]
    fn readable(&self, fp: u64) -> u64 {
        if fp.is_multiple_of(8) && fp >= self.lo && fp.checked_add(16).is_some_and(|e| e <= self.hi)
        {
            fp
        } else {
            0
        }
    }

    /// One step from the frame record at `*fp`: its return address, moving `*fp` to the
    /// caller's record; `None` when the chain has ended (null, misaligned, out of bounds, not
    /// moving up, the stop frame, or a stack revisited).
    ///
    /// The common case — the caller's record higher up in the same stack, aligned, below the
    /// stop frame, with a return address that is not null and not in a hop — is two
    /// compares, so the loop is the dependent load of the saved frame pointer and little
    /// else. Everything else is [`FpWalk::step_slow`].
    #[inline(always)]
    fn step(&mut self, fp: &mut u64) -> Option<u64> {
        let at = *fp;
        if at == 0 {
            return None;
        }
        // SAFETY: by the invariant, [at, at+16) lies inside stack segment `seg`, which the
        // caller vouched is mapped and readable. Volatile: another thread may own the stack.
        let (next, ra) = unsafe {
            (
                std::ptr::read_volatile(at as *const u64),
                std::ptr::read_volatile((at + 8) as *const u64),
            )
        };
        // `next` aligned and in [at+8, top]: the rotation moves misaligned low bits to the
        // top, so that one unsigned compare checks both. (When `at` is above `top`, which
        // only a stop frame below the start can cause, the bound is 0: always the slow path.)
        let up = next.wrapping_sub(at + 8).rotate_right(3) < (self.top.saturating_sub(at) >> 3);
        let fp_code = ra.wrapping_sub(1).wrapping_sub(self.ok_lo) < self.ok_len;
        if up & (ra != 0) & self.hops.misses(ra) & fp_code {
            *fp = next;
            return Some(ra);
        }
        // The usual end of a suspended walk, without the slow path's call: a return address
        // the fast path takes, whose caller's record (readable, up) is the stop frame's.
        let (lo, hi) = self.run_ras;
        if ra >= lo && ra <= hi && next > at && next >= self.stop_at && self.readable(next) != 0 {
            *fp = 0;
            return Some(ra);
        }
        // (`step_slow` is not inlined: it takes and returns the frame pointer by value, since
        // a reference to it would keep it in memory.)
        let (ra, next) = self.step_slow(at, next, ra);
        *fp = next;
        ra
    }

    /// The step's uncommon cases, given the record at `at` read as (`next`, `ra`): the
    /// return address to emit, if any, and the next frame pointer (0: the walk ends).
    #[cold]
    #[inline(never)]
    fn step_slow(&mut self, at: u64, next: u64, ra: u64) -> (Option<u64>, u64) {
        if ra == 0 {
            return (None, 0);
        }
        // The caller (at `ra`) must keep frame pointers for its own record to be `next`; a
        // hop knows its code's frames.
        if self.hops.misses(ra) && ra.wrapping_sub(1).wrapping_sub(self.ok_lo) >= self.ok_len {
            if let Some(t) = self.table {
                let pc = ra.wrapping_sub(1);
                match self.ranges.range_recent(t, pc) {
                    // The fast path's range from now on.
                    Some((s, e, true)) => self.set_ok(s, e - s),
                    Some((_, _, false)) => {
                        // Right as far as it goes; the caller's caller cannot be found
                        // this way, but from the caller's state DWARF can go on.
                        self.not_fp = Some((ra, at + 16, next));
                        return (Some(ra), 0);
                    }
                    // Outside every image (JIT code): frame pointers are the only hope.
                    None => {}
                }
            }
        }
        let next = self.hops.next_record(at, ra, next);
        if next > at && next < self.hi {
            // Up in the same stack (possibly through a hop); the next step ends the walk
            // unless the record there may be read, or it is the stop frame's.
            let next = self.readable(next);
            if next != 0 && self.stops_at(next) {
                return (Some(ra), 0);
            }
            return (Some(ra), next);
        }
        // Leaving this stack (a coroutine's frame chain continues in its resumer's stack):
        // allowed once per stack. Otherwise the walk ends after this frame.
        if let Some(s) = self.stacks.find(next) {
            if s != self.seg && self.visited & (1 << (s % 64)) == 0 {
                self.enter(s);
                let next = self.readable(next);
                if next != 0 && self.stops_at(next) {
                    return (Some(ra), 0);
                }
                return (Some(ra), next);
            }
        }
        (Some(ra), 0)
    }
}

/// The pure frame-pointer walk (`Fast`, or when no image table / cache is available).
///
/// While the frames fit, they are written straight into the backtrace; past that, through
/// a small local buffer. Either way the loop is a tight dependent-load chain of about a
/// nanosecond per frame.
/// How a frame-pointer walk ended.
enum FpEnd {
    /// For good (`true`: cut at [`MAX_WALK`]).
    Done(bool),
    /// After emitting `ra`, a return address into code that keeps no frame pointers: the
    /// state of that frame, from which a DWARF step can go on.
    NotFp { ra: u64, sp: u64, bp: u64 },
}

/// The walk from frame pointer and stack pointer `(fp, sp)`; `seed` is a code range known to
/// keep frame pointers (none: learnt on the way).
fn fp_walk(
    (fp, sp): (u64, u64),
    stop_sp: u64,
    stacks: &Stacks<'_>,
    table: Option<&ImageTable>,
    ranges: Option<&mut RangeCache>,
    seed: Option<(u64, u64)>,
    sink: &mut FrameSink<'_>,
) -> FpEnd {
    let Some(seg) = fp_start(stacks, fp, sp) else {
        return FpEnd::Done(false);
    };
    // (Made only when needed: zeroing it cost a nanosecond or two per walk.)
    let mut own;
    let ranges = match ranges {
        Some(r) => r,
        None => {
            own = RangeCache::new();
            &mut own
        }
    };
    let (mut w, fp) = FpWalk::new(stacks, fp, stop_sp, seg, table, ranges);
    if let Some((s, e)) = seed.filter(|_| table.is_some()) {
        // Code known to keep frame pointers, as a lookup of a return address there finds.
        w.set_ok(s, e - s);
    }
    let cut = fp_walk_loop(&mut w, fp, sink);
    match w.not_fp {
        Some((ra, sp, bp)) if !cut => FpEnd::NotFp { ra, sp, bp },
        _ => FpEnd::Done(cut),
    }
}

fn fp_walk_loop(w: &mut FpWalk<'_, '_>, mut fp: u64, sink: &mut FrameSink<'_>) -> bool {
    let mut total = 0usize;
    // Direct phase.
    if sink.direct_room() > 0 {
        let (n, ended) = w.fill(&mut fp, sink.direct_slots());
        // SAFETY: `fill` wrote slots 0..n of the direct region (n <= its length, the room).
        unsafe { sink.commit_direct(n) };
        if ended {
            return false;
        }
        total = n;
    }
    // Buffered phase: skipping, or past the head (counting for `top`).
    const CHUNK: usize = 32;
    let mut buf = [0u64; CHUNK];
    loop {
        let mut n = 0;
        let mut ended = false;
        while n < CHUNK {
            match w.step(&mut fp) {
                Some(ra) => {
                    buf[n] = ra;
                    n += 1;
                }
                None => {
                    ended = true;
                    break;
                }
            }
        }
        if !sink.push_ras(&buf[..n]) || ended {
            return false;
        }
        total += n;
        if total >= MAX_WALK {
            return true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame-pointer walk as first written (every check on every step, the frame pointer
    /// in the walk's state): the oracle the fast-path walk must agree with exactly.
    fn reference(stacks: &Stacks<'_>, fp0: u64, stop_sp: u64, seg0: usize) -> Vec<u64> {
        let hops = hop::Hops::snapshot();
        let (mut fp, mut seg) = (fp0, seg0);
        let (mut lo, mut hi) = (stacks.segs[seg].lo, stacks.segs[seg].hi);
        let mut visited = 1u64 << seg;
        let mut out = Vec::new();
        while out.len() < 1000 {
            if !fp.is_multiple_of(8) || fp < lo || fp + 16 > hi {
                break;
            }
            // The stop frame: its caller's stack pointer reaches `stop_sp`, in the stop's stack.
            let seg_b = stacks.segs[seg];
            if stop_sp != 0 && stop_sp >= seg_b.lo && stop_sp <= seg_b.hi && fp + 16 >= stop_sp {
                break;
            }
            let (next, ra) = (stacks.read(fp).unwrap(), stacks.read(fp + 8).unwrap());
            if ra == 0 {
                break;
            }
            let next = hops.next_record(fp, ra, next);
            out.push(ra);
            if next > fp && next < hi {
                lo = fp;
                fp = next;
                continue;
            }
            match stacks.find(next) {
                Some(s) if s != seg && visited & (1 << s) == 0 => {
                    seg = s;
                    visited |= 1 << s;
                    (lo, hi) = (stacks.segs[s].lo, stacks.segs[s].hi);
                    fp = next;
                }
                _ => fp = 1,
            }
        }
        out
    }

    /// Return addresses into those of `fns` (functions of this module) that keep frame pointers,
    /// as the image table judges them (one word past each function's start).
    fn fp_code_returns(table: &ImageTable, fns: &[usize]) -> Vec<u64> {
        fns.iter()
            .map(|&f| f as u64 + 8)
            .filter(|a| table.code_range(a - 1).is_some_and(|r| r.2))
            .collect()
    }

    /// A xorshift generator from `seed`: each call, a number below `n`.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        }
    }

    /// `fp_walk_is_auto` accepts a one-go walk only when every step is one `Auto` takes the
    /// same way: on a stack built by hand (return addresses into this program's own code,
    /// which keeps frame pointers), the walk's frames pass, and each broken condition fails.
    #[test]
    fn an_auto_walk_in_one_go_needs_every_step_as_auto_takes_it() {
        let table = crate::image::table();
        // Addresses inside functions of this module that keep frame pointers (what a
        // return address into them is to the range checks).
        let fns = [
            fp_walk_is_auto as *const () as usize,
            fp_walk_into as *const () as usize,
            run_ras as *const () as usize,
            fp_start as *const () as usize,
        ];
        let mut code = fp_code_returns(table, &fns);
        code.truncate(3);
        assert_eq!(
            code.len(),
            3,
            "functions keeping frame pointers among {fns:x?}"
        );
        let mut mem = vec![0u64; 64];
        let base = mem.as_ptr() as u64;
        let hi = base + 64 * 8;
        let at = |i: usize| base + 8 * i as u64;
        // Records at words 4 and 10; word 20 is the stop frame's (its caller's stack pointer,
        // 16 above it, is the stop).
        let build = |mem: &mut Vec<u64>, ras: [u64; 2]| {
            mem[4] = at(10);
            mem[5] = ras[0];
            mem[10] = at(20);
            mem[11] = ras[1];
        };
        let regs = Registers {
            ip: code[0],
            sp: base,
            fp: at(4),
        };
        let stop = at(20) + 16;
        let check = |mem: &mut Vec<u64>, ras: [u64; 2], stop: u64| {
            build(mem, ras);
            let mut dst = [const { std::mem::MaybeUninit::<Frame>::uninit() }; 8];
            let mut ranges = RangeCache::new();
            let n = fp_walk_into(regs, hi, stop, table, &mut ranges, &mut dst)?;
            // SAFETY: `fp_walk_into` wrote the first `n` slots.
            let frames: Vec<Frame> = dst[..n]
                .iter()
                .map(|f| unsafe { f.assume_init() })
                .collect();
            Some((
                fp_walk_is_auto(regs, hi, stop, table, &mut ranges, &frames),
                frames,
            ))
        };
        let good = [code[1], code[2]];
        let (ok, frames) = check(&mut mem, good, stop).expect("the one-go walk");
        assert_eq!(
            frames,
            [Frame::Pc(code[0]), Frame::Ra(code[1]), Frame::Ra(code[2])]
        );
        assert!(ok, "a plain chain ending at the stop");
        // No stop, or a chain that ends before it: `Auto` would try DWARF where it broke.
        let (ok, _) = check(&mut mem, good, 0).expect("the one-go walk");
        assert!(!ok, "no stop");
        let (ok, _) = check(&mut mem, good, at(40)).expect("the one-go walk");
        assert!(!ok, "ended before the stop");
        // A return address in the C library's code (where `Auto` looks for the signal
        // trampoline), when the library keeps frame pointers; else the walk leaves the path.
        let libc = table.libc_span.0 + 16;
        if let Some((ok, _)) = check(&mut mem, [libc, code[2]], stop) {
            assert!(!ok, "a return into the C library");
        }
        // Code outside every image: `Auto` would reread the loader's list.
        if let Some((ok, _)) = check(&mut mem, [0x10, code[2]], stop) {
            assert!(!ok, "code outside every image");
        }
        // Frames that are not this stack's.
        build(&mut mem, good);
        let mut ranges = RangeCache::new();
        let other = [Frame::Pc(code[0]), Frame::Ra(code[2]), Frame::Ra(code[2])];
        assert!(!fp_walk_is_auto(regs, hi, stop, table, &mut ranges, &other));
        drop(mem);
    }

    /// The walk as the capture runs it (`fill`: the tight loop, `step` where it stops), into
    /// chunks of `chunk` frames.
    fn walked(stacks: &Stacks<'_>, fp0: u64, stop_sp: u64, seg0: usize, chunk: usize) -> Vec<u64> {
        let mut ranges = RangeCache::new();
        let (mut w, mut fp) = FpWalk::new(stacks, fp0, stop_sp, seg0, None, &mut ranges);
        let mut out = Vec::new();
        let mut buf = [const { std::mem::MaybeUninit::<Frame>::uninit() }; 8];
        while out.len() < 1000 {
            let (n, ended) = w.fill(&mut fp, &mut buf[..chunk]);
            // SAFETY: `fill` wrote the first `n` slots.
            out.extend(buf[..n].iter().map(|f| match unsafe { f.assume_init() } {
                Frame::Ra(a) => a,
                other => panic!("a frame-pointer walk gave {other:?}"),
            }));
            if ended {
                break;
            }
        }
        out
    }

    /// Both lookups of the range cache answer as the image table does, for addresses that go
    /// back and forth between a few ranges (the cache's inline hits, the order a hit leaves)
    /// and over many (its scans, its evictions), and past the last range.
    #[test]
    fn the_range_cache_answers_as_the_table() {
        let table = crate::image::table();
        // Consecutive ranges from this function's on (the table's ranges cover the code).
        let mut ranges = Vec::new();
        let mut at = Some(the_range_cache_answers_as_the_table as *const () as u64);
        while let Some(r) = at.and_then(|pc| table.code_range(pc)) {
            ranges.push(r);
            at = (ranges.len() < 64).then_some(r.1);
        }
        assert!(
            ranges.len() >= 4,
            "too few code ranges to test with: {ranges:?}"
        );
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let past = ranges.last().unwrap().1;
        let mut cache = RangeCache::new();
        for round in 0..20_000usize {
            // Mostly among three ranges, now and then anywhere.
            let i = if round % 16 == 0 {
                next() as usize
            } else {
                (round / 997 + next() as usize % 3) * 5
            };
            // A pc in range `i` (its start, its last byte or between), or past every range.
            let (s, e, _) = ranges[i % ranges.len()];
            let pc = match next() % 4 {
                0 => s,
                1 => e - 1,
                2 => s + next() % (e - s),
                _ => past + next() % 64,
            };
            let want = table.code_range(pc);
            if round % 2 == 0 {
                assert_eq!(cache.range_recent(table, pc), want, "{pc:#x}");
            } else {
                assert_eq!(cache.range(table, pc), want, "{pc:#x}");
            }
        }
    }

    /// Every return address the tight loop accepts is one `step`'s fast path accepts (in the
    /// frame-pointer code, not null, outside every hop), and it accepts some whenever
    /// either side of the hops has any: checked exhaustively over small values and at the
    /// ends of the address space.
    #[test]
    fn the_tight_loop_accepts_only_what_the_step_accepts() {
        let vals = [0u64, 1, 2, 3, 5, 8, u64::MAX - 2, u64::MAX - 1, u64::MAX];
        let small = 0..10u64;
        let cands: Vec<u64> = small.clone().chain(vals).collect();
        for &lo in &cands {
            for &len in &cands {
                for &hl in &cands {
                    // (A span is never reversed: `lo == hi` when no hop is registered.)
                    for &hh in cands.iter().filter(|&&hh| hh >= hl) {
                        let (a, b) = run_ras(lo, len, (hl, hh));
                        let step_ok = |ra: u64| {
                            ra.wrapping_sub(1).wrapping_sub(lo) < len
                                && ra != 0
                                && ra.wrapping_sub(hl) >= hh.wrapping_sub(hl)
                        };
                        for &ra in &cands {
                            if ra >= a && ra <= b {
                                assert!(
                                    step_ok(ra),
                                    "{ra} in {:?} for {lo} {len} {hl} {hh}",
                                    (a, b)
                                );
                            }
                        }
                        if a > b && hh > hl && lo.checked_add(len).is_some() {
                            // Empty: no address on either side of the hops is fast (for a
                            // range inside the address space, as every code range is).
                            let any = cands.iter().any(|&ra| step_ok(ra));
                            assert!(!any, "nothing kept for {lo} {len} {hl} {hh}");
                        }
                    }
                }
            }
        }
    }

    /// A suspended context's one-go walk gives the same frames with its lean start as the
    /// general walk alone, on random stacks: chains that go up, break, loop, leave the stack,
    /// reach or pass the stop frame; return addresses into code that keeps frame pointers,
    /// the C library, no image, a hop, null; slots that run out; stops in and outside the
    /// stack, misaligned.
    #[test]
    fn the_lean_suspended_walk_gives_the_general_walks_frames_on_random_stacks() {
        let table = crate::image::table();
        let fns = [
            fp_walk_is_auto as *const () as usize,
            fp_walk_into as *const () as usize,
            run_ras as *const () as usize,
            fp_start as *const () as usize,
            lean_run as *const () as usize,
        ];
        let code = fp_code_returns(table, &fns);
        assert!(
            code.len() >= 3,
            "functions keeping frame pointers among {fns:x?}"
        );
        let others = [0, 0x10, 0x5000 + 24, table.libc_span.0 + 16];
        let mut rnd = xorshift(0x2545_f491_4f6c_dd1d);
        const WORDS: usize = 64;
        let mut mem = vec![0u64; WORDS];
        let (mut ended_long, mut disagreements) = (0, Vec::new());
        for round in 0..20_000 {
            let base = mem.as_ptr() as u64;
            let sp = base + 8 * rnd(4);
            let hi = base + 8 * WORDS as u64 - [0, 0, 3, 8][rnd(4) as usize];
            let stop_sp = match rnd(6) {
                0 => 0,
                1 => hi + 64,
                _ => {
                    base + 8 * (WORDS as u64 / 2 + rnd(WORDS as u64 / 2))
                        + [0, 0, 0, 3][rnd(4) as usize]
                }
            };
            for i in (0..WORDS).step_by(2) {
                let here = base + 8 * i as u64;
                let up = 16 * (1 + rnd(3));
                mem[i] = match rnd(60) {
                    0 => 0,
                    1 => here + up + 3,
                    2 => here.wrapping_sub(up),
                    3 => stop_sp.saturating_sub(16),
                    4 => here,
                    5 => hi,
                    _ => here + up,
                };
                mem[i + 1] = match rnd(40) {
                    0..=3 => others[rnd(4) as usize],
                    _ => code[rnd(code.len() as u64) as usize],
                };
            }
            let regs = Registers {
                ip: if rnd(10) == 0 {
                    0x10
                } else {
                    code[rnd(code.len() as u64) as usize]
                },
                sp,
                fp: sp + 8 * rnd(8) + [0, 0, 0, 4][rnd(4) as usize],
            };
            let slots = [2, 3, 5, 8, 64, 64, 64, 64][rnd(8) as usize];
            // The hops registered now, or a span of none around some of the code's return
            // addresses (the lean walk then leaves those frames to the general one).
            let hops = match rnd(4) {
                0 => {
                    let (a, b) = (
                        code[rnd(code.len() as u64) as usize],
                        code[rnd(code.len() as u64) as usize],
                    );
                    hop::Hops::empty_span(a.min(b), a.max(b) + rnd(2))
                }
                _ => hop::Hops::snapshot(),
            };
            let walk = |lean: bool| {
                let mut dst = vec![std::mem::MaybeUninit::<Frame>::uninit(); slots];
                let mut ranges = RangeCache::new();
                let n = fp_walk_into_with(
                    regs,
                    hi,
                    stop_sp,
                    table,
                    &mut ranges,
                    &mut dst,
                    (lean, hops),
                )?;
                let frames = dst[..n].iter().map(|f| {
                    // SAFETY: the walk wrote the first `n` slots.
                    unsafe { f.assume_init() }
                });
                Some(frames.collect::<Vec<_>>())
            };
            let (got, want) = (walk(true), walk(false));
            ended_long += usize::from(want.as_ref().is_some_and(|f| f.len() >= 6));
            if got != want {
                disagreements.push((round, got, want));
            }
        }
        assert!(disagreements.is_empty(), "{:x?}", &disagreements[..1]);
        assert!(
            ended_long > 500,
            "only {ended_long} walks of 6 frames or more ended"
        );
    }

    /// Random stacks full of plausible and implausible frame records — links up, down, to
    /// the other stack, misaligned, past the top, to the stop frame; return addresses null,
    /// in a hop, ordinary — walked from random starts: the fast-path walk and the oracle
    /// give the same frames, every time.
    #[test]
    fn fast_path_walk_agrees_with_the_plain_walk_on_random_stacks() {
        // The hop table is process-wide: a range of its own (hop.rs's test registers another).
        assert!(hop::register_fp_hop(0x5000, 0x6000, 64));
        let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15);
        const WORDS: usize = 96;
        let mut mem = vec![[0u64; WORDS]; 2];
        let mut disagreements = Vec::new();
        let mut long_walks = 0;
        for round in 0..20_000 {
            let base = [mem[0].as_ptr() as u64, mem[1].as_ptr() as u64];
            // Segment 1 sometimes ends short of its storage, with an unaligned top.
            let hi1 = base[1] + 8 * WORDS as u64 - [0, 3, 8, 24][rnd(4) as usize];
            let segs = [
                StackBounds::new(base[0], base[0] + 8 * WORDS as u64),
                StackBounds::new(base[1], hi1),
            ];
            // (Sometimes misaligned: a stop frame's record can then lie below the start.)
            let stop_sp = match rnd(3) {
                0 | 1 => 0,
                _ => base[rnd(2) as usize] + 8 * rnd(WORDS as u64) + [0, 0, 0, 3][rnd(4) as usize],
            };
            for s in 0..2 {
                for i in (0..WORDS).step_by(2) {
                    let here = base[s] + 8 * i as u64;
                    let up = 16 * (1 + rnd(6));
                    mem[s][i] = match rnd(40) {
                        0 => 0,
                        1 => here + up + 3,
                        2 => here.wrapping_sub(up),
                        3 => base[1 - s] + 8 * rnd(WORDS as u64),
                        4 => stop_sp.saturating_sub(16),
                        5 => u64::MAX - 7,
                        6 => here,
                        _ => here + up,
                    };
                    mem[s][i + 1] = match rnd(30) {
                        0 => 0,
                        1 => 0x5000 + rnd(0x1000),
                        _ => 0x40_0000 + rnd(0x10_0000),
                    };
                }
            }
            let stacks = Stacks::new(&segs);
            let seg0 = rnd(2) as usize;
            let fp0 = base[seg0] + 8 * rnd(WORDS as u64) + [0, 0, 0, 4][rnd(4) as usize];
            let want = reference(&stacks, fp0, stop_sp, seg0);
            let got = walked(&stacks, fp0, stop_sp, seg0, 1 + rnd(8) as usize);
            long_walks += usize::from(want.len() >= 8);
            if want != got {
                disagreements.push((round, want, got));
            }
        }
        assert!(disagreements.is_empty(), "{:?}", &disagreements[..1]);
        // The generator makes real chains, not only walks that end at once.
        assert!(
            long_walks > 1000,
            "only {long_walks} walks of 8 frames or more"
        );
    }
}
