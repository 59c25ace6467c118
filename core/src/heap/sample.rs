//! The sampled tier: Poisson sampling by bytes.
//!
//! Each thread counts down bytes to its next sample point, drawn from an exponential
//! distribution of mean [`super::Config::sample_interval`]; an allocation that crosses the
//! point is sampled (one sample however many points it crosses) and the countdown is drawn
//! anew. The chance that an allocation of `z` bytes is sampled is then `p = 1 − e^(−z/R)`,
//! whatever came before (the process is memoryless), so a sample standing for `1/p`
//! allocations and `z/p` bytes makes unbiased estimates.
//!
//! A sampled pointer goes into a table (its stack, size, weights, owner slot) and bumps a
//! counter in a filter of 64Ki counters indexed by a hash of the pointer; free reads that
//! counter — one load — and looks in the table only when it is non-zero.

use super::{owner, Busy};
use crate::codec::lws::MAX_DEPTH;
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Mutex;

const FILTER: usize = 1 << 16;
static FILTER_COUNTS: [AtomicU16; FILTER] = [const { AtomicU16::new(0) }; FILTER];

/// One sampled allocation.
#[derive(Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) size: usize,
    pub(crate) frames: [u64; MAX_DEPTH],
    pub(crate) depth: u8,
    pub(crate) slot: u32,
    /// Estimated bytes and allocations it stands for.
    pub(crate) bytes: i64,
    pub(crate) objects: i64,
}

pub(crate) static TABLE: Mutex<Option<HashMap<usize, Sample>>> = Mutex::new(None);

/// The table locked by this thread: the map's own growth frees its old buckets, which must
/// not look the table up again (they were allocated by the tracker's own work, so are never
/// samples).
fn lock_table() -> (
    std::sync::MutexGuard<'static, Option<HashMap<usize, Sample>>>,
    Holding,
) {
    let g = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let _ = HOLDING.try_with(|h| h.set(true));
    (g, Holding)
}

/// Clears the holding flag when dropped (after the guard it is paired with: declared
/// second, dropped first is fine either way — the flag only stops look-ups on this thread).
struct Holding;

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = HOLDING.try_with(|h| h.set(false));
    }
}

thread_local! {
    /// This thread holds the table's lock.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
    /// Bytes left before this thread's next sample point (≤ 0: the next allocation samples).
    static COUNTDOWN: Cell<i64> = const { Cell::new(0) };
    /// xorshift state (0: not seeded yet).
    static RNG: Cell<u64> = const { Cell::new(0) };
}

#[inline]
fn filter_index(p: usize) -> usize {
    // Fibonacci hashing of the address without its low (alignment) bits.
    ((p >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - 16)) & (FILTER - 1)
}

/// Whether `p` may be sampled (false: certainly not).
#[inline]
fn maybe_sampled(p: usize) -> bool {
    FILTER_COUNTS[filter_index(p)].load(Ordering::Relaxed) != 0
}

/// Counts `n` bytes against this thread's countdown; true when a sample point is crossed.
#[inline]
fn crosses(n: usize) -> bool {
    COUNTDOWN
        .try_with(|c| {
            let left = c.get() - n as i64;
            c.set(left);
            left <= 0
        })
        .unwrap_or(false)
}

/// A draw from the exponential distribution of mean `mean` (at least 1).
fn next_interval(mean: u64) -> i64 {
    let mut x = RNG.try_with(|r| r.get()).unwrap_or(0);
    if x == 0 {
        // Seeded per thread from its stack address and the clock.
        let probe = 0u8;
        x = ((&probe as *const u8 as u64) ^ clock_bits()) | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let _ = RNG.try_with(|r| r.set(x));
    // 53 random bits in (0, 1].
    let u = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let d = -u.ln() * mean as f64;
    (d as i64).max(1)
}

fn clock_bits() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_007) ^ ts.tv_nsec as u64
}

/// Allocates; samples when the countdown is crossed.
///
/// # Safety
/// `layout` has a non-zero size.
#[inline]
pub(crate) unsafe fn alloc<A: GlobalAlloc>(inner: &A, layout: Layout, zeroed: bool) -> *mut u8 {
    // SAFETY: the caller's contract.
    let p = unsafe {
        if zeroed {
            inner.alloc_zeroed(layout)
        } else {
            inner.alloc(layout)
        }
    };
    if !p.is_null() && crosses(layout.size()) {
        take(p as usize, layout.size());
    }
    p
}

/// Records a sample of `p` (or, when the tracker is busy or the thread not seeded yet, only
/// draws the next point).
#[inline(never)]
fn take(p: usize, size: usize) {
    let busy = Busy::enter();
    if let Some(mean) = draw(&busy) {
        let mut frames = [0u64; MAX_DEPTH];
        let depth = super::capture(&mut frames);
        record(p, size, mean, &frames, depth);
    }
}

/// Draws the next sample point; the mean interval when this allocation is to be recorded.
fn draw(busy: &Busy) -> Option<u64> {
    let mean = super::INTERVAL.load(Ordering::Relaxed);
    let first = RNG.try_with(|r| r.get() == 0).unwrap_or(true);
    let next = next_interval(mean);
    let _ = COUNTDOWN.try_with(|c| c.set(next));
    // The first allocation of a thread only starts its countdown (sampling it always would
    // bias toward threads' first allocations).
    (!busy.nested() && !first).then_some(mean)
}

fn record(p: usize, size: usize, mean: u64, frames: &[u64; MAX_DEPTH], depth: usize) {
    let frames = *frames;
    let prob = 1.0 - (-(size as f64) / mean as f64).exp();
    let w = if prob > 0.0 { 1.0 / prob } else { 1.0 };
    let bytes = (size as f64 * w).round() as i64;
    let objects = w.round().max(1.0) as i64;
    let slot = owner::current_slot();
    let s = Sample {
        size,
        frames,
        depth: depth as u8,
        slot,
        bytes,
        objects,
    };
    let (mut t, holding) = lock_table();
    let replaced = t.get_or_insert_with(HashMap::new).insert(p, s);
    drop(t);
    drop(holding);
    if let Some(old) = replaced {
        // A stale entry for the same address (freed without passing here): forget it.
        owner::credit(old.slot, old.bytes, old.objects);
    } else {
        FILTER_COUNTS[filter_index(p)].fetch_add(1, Ordering::Relaxed);
    }
    owner::charge(slot, bytes, objects);
    super::totals::add(
        &frames[..depth],
        owner::fiber_of(slot).0.unwrap_or(0),
        bytes,
        objects,
    );
}

/// Forgets `p` if it is a sample (before it goes back to the inner allocator, so that an
/// address reused at once is not confused with it).
#[inline]
fn forget(p: usize) {
    if maybe_sampled(p) {
        forget_slow(p);
    }
}

#[inline(never)]
fn forget_slow(p: usize) {
    if HOLDING.try_with(|h| h.get()).unwrap_or(true) {
        // The table's own buckets, freed while this thread holds it: never samples.
        return;
    }
    let _busy = Busy::enter();
    let (mut t, holding) = lock_table();
    let removed = t.as_mut().and_then(|m| m.remove(&p));
    drop(t);
    drop(holding);
    if let Some(s) = removed {
        FILTER_COUNTS[filter_index(p)].fetch_sub(1, Ordering::Relaxed);
        owner::credit(s.slot, s.bytes, s.objects);
    }
}

/// Frees.
///
/// # Safety
/// As `GlobalAlloc::dealloc`.
#[inline]
pub(crate) unsafe fn dealloc<A: GlobalAlloc>(inner: &A, p: *mut u8, layout: Layout) {
    forget(p as usize);
    // SAFETY: the caller's contract.
    unsafe { inner.dealloc(p, layout) }
}

/// Reallocates: the old block's sample (if any) is forgotten, the new size counted.
///
/// # Safety
/// As `GlobalAlloc::realloc`.
#[inline]
pub(crate) unsafe fn realloc<A: GlobalAlloc>(
    inner: &A,
    p: *mut u8,
    layout: Layout,
    new_size: usize,
) -> *mut u8 {
    forget(p as usize);
    if !crosses(new_size) {
        // SAFETY: the caller's contract.
        return unsafe { inner.realloc(p, layout, new_size) };
    }
    // Sampled: the stack is read before the block moves (a stack hook may read the memory
    // being reallocated: a Lua stack that grows).
    let busy = Busy::enter();
    let drawn = draw(&busy);
    let mut frames = [0u64; MAX_DEPTH];
    let depth = if drawn.is_some() {
        realloc_capture(&mut frames)
    } else {
        0
    };
    // SAFETY: the caller's contract.
    let q = unsafe { inner.realloc(p, layout, new_size) };
    if let (false, Some(mean)) = (q.is_null(), drawn) {
        record(q as usize, new_size, mean, &frames, depth);
    }
    q
}

/// [`super::capture`] from `realloc` (one frame like `take`'s, so the same frames are
/// skipped).
#[inline(never)]
fn realloc_capture(frames: &mut [u64; MAX_DEPTH]) -> usize {
    super::capture(frames)
}

/// Copies the samples (under [`Busy`]).
pub(crate) fn samples() -> Vec<(usize, Sample)> {
    let _busy = Busy::enter();
    let (t, _holding) = lock_table();
    t.as_ref()
        .map(|m| m.iter().map(|(&p, s)| (p, *s)).collect())
        .unwrap_or_default()
}
