//! Unwind: walking a stack from a start state, bounded to known stacks.
//!
//! One walker serves the three unwinders. Each step takes the current frame `(ip, sp, fp)`
//! to its caller's:
//! * a *frame-pointer step* reads the frame record at `fp` (`[fp]` = caller's fp,
//!   `[fp+8]` = return address) — about a nanosecond;
//! * a *DWARF step* applies the `.eh_frame` rule for `ip`: for a return address, a compact
//!   rule cached per address and applied inline ([`rules`]); otherwise, and for rows with no
//!   compact form, through framehop. Both are allocation-free.
//!
//! `Fast` takes only frame-pointer steps, `Precise` only DWARF steps. `Auto` takes
//! frame-pointer steps while the code it is in keeps frame pointers (judged per image, see
//! [`crate::image`]) and DWARF steps where it does not (glibc), and tries a DWARF step
//! wherever a frame-pointer step fails.
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
//! of the given [`Stacks`]; within one stack each frame must lie above the previous one; a walk
//! may move to another stack at most once per stack; and it stops after [`MAX_WALK`] frames
//! (the trace then ends with `Truncated`).

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
use framehop::{FrameAddress, MustNotAllocateDuringUnwind, Unwinder as _};

use crate::backtrace::{FrameSink, Unwinder};
use crate::capture::{Registers, StackBounds};
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
/// In front of them, the compact rules of [`rules`] step most return addresses without
/// framehop.
pub struct DwarfCache {
    framehop: [CacheX86_64<MustNotAllocateDuringUnwind>; RULE_CACHES],
    pub(crate) compact: rules::RuleCache,
    use_compact: bool,
}

impl DwarfCache {
    /// A new, empty cache.
    pub fn new() -> Self {
        DwarfCache {
            framehop: std::array::from_fn(|_| CacheX86_64::new_in()),
            compact: rules::RuleCache::new(),
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
    fn for_address(&mut self, addr: FrameAddress) -> &mut CacheX86_64<MustNotAllocateDuringUnwind> {
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
    /// When nonzero: the frame pointer of a runtime's entry frame. The walk ends at the frame
    /// whose caller's frame pointer is this value, without emitting the return address into
    /// the entry function (the runtime's frames are not the user's).
    pub stop_fp: u64,
}

/// How a walk ended.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WalkEnd {
    /// Cut at [`MAX_WALK`] although the stack went on.
    pub cut: bool,
    /// Met a code address outside every known image (a library loaded after the image
    /// table was built, or JIT code): a refreshed table may do better.
    pub unknown_code: bool,
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
    end.cut = walk_inner(
        start,
        stacks,
        mode,
        table,
        cache,
        sink,
        &mut end.unknown_code,
    );
    end
}

fn walk_inner(
    start: Start,
    stacks: &Stacks<'_>,
    mode: Unwinder,
    table: Option<&ImageTable>,
    mut cache: Option<&mut DwarfCache>,
    sink: &mut FrameSink<'_>,
    unknown_code: &mut bool,
) -> bool {
    let Registers { ip, sp, fp } = start.regs;
    if start.emit_ip && !sink.push(Frame::Pc(ip)) {
        return false;
    }
    if mode == Unwinder::Fast || table.is_none() || cache.is_none() {
        return fp_walk(fp, sp, start.stop_fp, stacks, sink);
    }
    let table = table.expect("checked");
    let mut regs = UnwindRegsX86_64::new(ip, sp, fp);
    let mut addr = FrameAddress::from_instruction_pointer(ip);
    let mut cur = SegCursor::at(stacks, sp);
    let mut fp_range: (u64, u64) = (0, 0); // last code range known to keep frame pointers
    let mut first = true;
    // Just resumed from a signal frame: the interrupted code may be in a prologue.
    let mut after_signal = false;
    for _ in 0..MAX_WALK {
        let pc = addr.address();
        let use_fp = match mode {
            Unwinder::Precise => false,
            _ if (first && start.first_step_dwarf) || after_signal => false,
            _ if pc >= fp_range.0 && pc < fp_range.1 => true,
            _ => match table.code_range(pc) {
                Some((s, e, true)) => {
                    fp_range = (s, e);
                    true
                }
                Some((_, _, false)) => false,
                // Code outside any image (JIT, a library loaded since the table was
                // built, or a bad address): frame pointers are the only hope.
                None => {
                    *unknown_code = true;
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
        if ra == 0
            || (start.stop_fp != 0 && regs.bp() == start.stop_fp)
            || !sink.push(Frame::Ra(ra))
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
            regs = UnwindRegsX86_64::new(next.ip, next.sp, next.fp);
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
    if !unsafe { crate::capture::x86_64::is_sigreturn(ra) } {
        return None;
    }
    let (ip, rsp, rbp) = crate::capture::x86_64::UCONTEXT_REGS;
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
    fn fp_step(&mut self, stacks: &Stacks<'_>, regs: &mut UnwindRegsX86_64) -> Option<u64> {
        let fp = regs.bp();
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
        regs.set_bp(self.hops.next_record(fp, ra, next));
        regs.set_ip(ra);
        Some(ra)
    }
}

fn dwarf_step(
    table: &ImageTable,
    cache: Option<&mut DwarfCache>,
    stacks: &Stacks<'_>,
    addr: FrameAddress,
    regs: &mut UnwindRegsX86_64,
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

/// Applies a compact rule (not `Other`) to a frame that is not the first: the caller's
/// registers into `regs`, its return address returned. The checks are framehop's for the
/// same rules: a null frame pointer or return address ends the walk, as does a frame record
/// below the stack pointer or a read outside the stacks.
#[inline(always)]
fn apply(rule: rules::Rule, stacks: &Stacks<'_>, regs: &mut UnwindRegsX86_64) -> Option<u64> {
    let (sp, bp) = (regs.sp(), regs.bp());
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
    regs.set_bp(new_bp);
    Some(ra)
}

/// State of a frame-pointer walk: the current frame pointer and the stack it is in.
struct FpWalk<'s, 'a> {
    stacks: &'s Stacks<'a>,
    stop_fp: u64,
    fp: u64,
    lo: u64,
    hi: u64,
    seg: usize,
    visited: u64,
    hops: hop::Hops,
}

impl FpWalk<'_, '_> {
    /// One step: the return address of the current frame, moving to its caller; `None` when
    /// the chain ends (null, misaligned, out of bounds, not moving up, or a stack revisited).
    #[inline(always)]
    fn step(&mut self) -> Option<u64> {
        let fp = self.fp;
        if !fp.is_multiple_of(8) || fp < self.lo || fp + 16 > self.hi {
            return None;
        }
        // SAFETY: [fp, fp+16) lies inside stack segment `seg` (checked just above), which the
        // caller vouched is mapped and readable.
        let (next, ra) = unsafe {
            (
                std::ptr::read_volatile(fp as *const u64),
                std::ptr::read_volatile((fp + 8) as *const u64),
            )
        };
        if ra == 0 || (self.stop_fp != 0 && next == self.stop_fp) {
            return None;
        }
        let next = self.hops.next_record(fp, ra, next);
        if next > fp && next < self.hi {
            self.lo = fp;
            self.fp = next;
            return Some(ra);
        }
        // Leaving this stack (a coroutine's frame chain continues in its resumer's stack):
        // allowed once per stack. Otherwise the walk ends after this frame.
        match self.stacks.find(next) {
            Some(s) if s != self.seg && self.visited & (1 << (s % 64)) == 0 => {
                self.seg = s;
                self.visited |= 1 << (s % 64);
                self.lo = self.stacks.segs[s].lo;
                self.hi = self.stacks.segs[s].hi;
                self.fp = next;
            }
            _ => self.fp = 1, // misaligned: the next step ends the walk
        }
        Some(ra)
    }
}

/// The pure frame-pointer walk (`Fast`, or when no image table / cache is available).
///
/// While the frames fit, they are written straight into the backtrace; past that, through
/// a small local buffer. Either way the loop is a tight dependent-load chain of about a
/// nanosecond per frame.
fn fp_walk(fp: u64, sp: u64, stop_fp: u64, stacks: &Stacks<'_>, sink: &mut FrameSink<'_>) -> bool {
    let Some(seg) = stacks.find(fp) else {
        return false;
    };
    if stacks.find(sp) == Some(seg) && fp < sp {
        return false;
    }
    let mut w = FpWalk {
        stacks,
        stop_fp,
        fp,
        lo: stacks.segs[seg].lo,
        hi: stacks.segs[seg].hi,
        seg,
        visited: 1 << (seg % 64),
        hops: hop::Hops::snapshot(),
    };
    let mut total = 0usize;
    // Direct phase.
    let room = sink.direct_room();
    if room > 0 {
        let dst = sink.direct_slots();
        let mut n = 0;
        while n < room {
            match w.step() {
                Some(ra) => {
                    dst[n] = std::mem::MaybeUninit::new(Frame::Ra(ra));
                    n += 1;
                }
                None => {
                    // SAFETY: slots 0..n of the direct region were written just above.
                    unsafe { sink.commit_direct(n) };
                    return false;
                }
            }
        }
        // SAFETY: all `room` slots were written.
        unsafe { sink.commit_direct(n) };
        total = n;
    }
    // Buffered phase: skipping, or past the head (counting for `top`).
    const CHUNK: usize = 32;
    let mut buf = [0u64; CHUNK];
    loop {
        let mut n = 0;
        let mut ended = false;
        while n < CHUNK {
            match w.step() {
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
