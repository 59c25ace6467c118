//! Frame-record hops: code that calls out without a frame record of its own.
//!
//! Some code keeps a fixed C frame and uses `rbp` as a general register, yet calls out to
//! functions that do keep frame records — LuaJIT's assembler interpreter is the case in point.
//! A frame-pointer walk reads the callee's record at `fp` (`[fp]` = saved `rbp`, `[fp+8]` =
//! return address into that code) and would then follow the saved `rbp`, which is garbage.
//! A *hop* says instead: when a return address lies in `[start, end)`, the caller's frame
//! record is at `fp + 16 + offset` (`fp` being the address of the record just read), i.e. the
//! code keeps `offset` bytes of its own frame between the callee's record and the record of
//! its caller. For LuaJIT on x64 (GC64, external unwinding) `offset` is 64.
//!
//! Registration is process-wide, append-only, and lock-free to read (a signal handler walking
//! a stack reads it): at most [`MAX_HOPS`] ranges. Reads use relaxed/acquire atomics only.
//!
//! How a result can be wrong: a hop registered with the wrong offset sends the walk to an
//! arbitrary word of the same stack — the usual bound checks (inside a known stack, moving up)
//! still apply, so the walk ends or shows a wrong caller, but never reads outside the stacks.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Most hop ranges that can be registered.
pub const MAX_HOPS: usize = 8;

struct Slot {
    start: AtomicU64,
    end: AtomicU64,
    offset: AtomicU64,
}

static SLOTS: [Slot; MAX_HOPS] = [const {
    Slot {
        start: AtomicU64::new(0),
        end: AtomicU64::new(0),
        offset: AtomicU64::new(0),
    }
}; MAX_HOPS];
/// Slots published (fully written) so far.
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Slots claimed by writers (registration serialises on this).
static CLAIMED: AtomicUsize = AtomicUsize::new(0);

/// Registers a hop: frames whose return address lies in `[start, end)` find their caller's
/// frame record at `fp + 16 + offset`. Returns `false` when the range is empty, already
/// registered, or the table is full.
pub fn register_fp_hop(start: u64, end: u64, offset: u64) -> bool {
    if start >= end || !offset.is_multiple_of(8) {
        return false;
    }
    let n = COUNT.load(Ordering::Acquire);
    if SLOTS[..n]
        .iter()
        .any(|s| s.start.load(Ordering::Relaxed) == start && s.end.load(Ordering::Relaxed) == end)
    {
        return false;
    }
    let i = CLAIMED.fetch_add(1, Ordering::AcqRel);
    if i >= MAX_HOPS {
        CLAIMED.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    SLOTS[i].start.store(start, Ordering::Relaxed);
    SLOTS[i].end.store(end, Ordering::Relaxed);
    SLOTS[i].offset.store(offset, Ordering::Relaxed);
    // Publish in order: a slot becomes visible only once every earlier one is.
    while COUNT
        .compare_exchange_weak(i, i + 1, Ordering::Release, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    true
}

/// The hop ranges registered so far: `(start, end, offset)`.
pub fn fp_hops() -> Vec<(u64, u64, u64)> {
    let n = COUNT.load(Ordering::Acquire);
    SLOTS[..n]
        .iter()
        .map(|s| {
            (
                s.start.load(Ordering::Relaxed),
                s.end.load(Ordering::Relaxed),
                s.offset.load(Ordering::Relaxed),
            )
        })
        .collect()
}

/// The hops registered when a walk began, read once per walk rather than once per frame:
/// the per-frame test is then two compares against the union of their ranges (empty when
/// none is registered), and only a return address inside it looks at the ranges themselves.
#[derive(Clone, Copy)]
pub(crate) struct Hops {
    n: usize,
    lo: u64,
    hi: u64,
}

impl Hops {
    /// The hops published so far.
    #[inline]
    pub(crate) fn snapshot() -> Hops {
        let n = COUNT.load(Ordering::Acquire).min(MAX_HOPS);
        let mut h = Hops { n, lo: 0, hi: 0 };
        if n > 0 {
            h.lo = u64::MAX;
            for s in &SLOTS[..n] {
                h.lo = h.lo.min(s.start.load(Ordering::Relaxed));
                h.hi = h.hi.max(s.end.load(Ordering::Relaxed));
            }
        }
        h
    }

    /// A span `[lo, hi)` that holds no hop (walks judge return addresses in it as they do
    /// near real hops, and step over them as ordinary frames): for tests of code that must
    /// agree with the general walk around hops, without registering one process-wide.
    #[cfg(test)]
    pub(crate) fn empty_span(lo: u64, hi: u64) -> Hops {
        Hops { n: 0, lo, hi }
    }

    /// Whether no hop is registered.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The span of every hop's range, `[lo, hi)`: empty (`lo == hi`) when none is registered.
    #[inline]
    pub(crate) fn span(&self) -> (u64, u64) {
        (self.lo, self.hi)
    }

    /// Whether `ra` lies outside every hop (one subtraction and one compare: the span is
    /// empty when no hop is registered).
    #[inline(always)]
    pub(crate) fn misses(&self, ra: u64) -> bool {
        ra.wrapping_sub(self.lo) >= self.hi.wrapping_sub(self.lo)
    }

    /// Where the caller's frame record is, given the record at `fp` whose return address is
    /// `ra`, and the saved frame pointer `next` read from it: `next` unless `ra` lies in a
    /// hop.
    #[inline(always)]
    pub(crate) fn next_record(&self, fp: u64, ra: u64, next: u64) -> u64 {
        if ra >= self.lo && ra < self.hi {
            hop_slow(fp, ra, next, self.n)
        } else {
            next
        }
    }
}

/// [`Hops::next_record`] with the hops registered now.
#[cfg(test)]
fn next_record(fp: u64, ra: u64, next: u64) -> u64 {
    Hops::snapshot().next_record(fp, ra, next)
}

#[cold]
#[inline(never)]
fn hop_slow(fp: u64, ra: u64, next: u64, n: usize) -> u64 {
    for s in &SLOTS[..n.min(MAX_HOPS)] {
        if ra >= s.start.load(Ordering::Relaxed) && ra < s.end.load(Ordering::Relaxed) {
            return fp
                .wrapping_add(16)
                .wrapping_add(s.offset.load(Ordering::Relaxed));
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hops_apply_only_inside_their_range() {
        assert!(register_fp_hop(0x1000, 0x2000, 64));
        assert!(!register_fp_hop(0x1000, 0x2000, 64), "duplicate");
        assert!(!register_fp_hop(0x3000, 0x3000, 64), "empty");
        assert!(!register_fp_hop(0x3000, 0x4000, 3), "misaligned");
        assert_eq!(next_record(0x7000, 0x1800, 0xdead), 0x7000 + 16 + 64);
        assert_eq!(next_record(0x7000, 0x2000, 0xdead), 0xdead);
        assert_eq!(next_record(0x7000, 0x0fff, 0xdead), 0xdead);
        assert!(fp_hops().contains(&(0x1000, 0x2000, 64)));
    }
}
