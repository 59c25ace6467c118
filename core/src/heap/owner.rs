//! Owners: who live heap bytes are charged to (a fiber, or slot 0 for code outside fibers).
//!
//! A runtime gives each fiber an [`Owner`] and makes it current ([`switch_to`]) while the
//! fiber runs. The first tracked allocation made under an owner takes a slot in a global
//! table of counters (chunks allocated from [`System`] on demand, never freed, no lock on the
//! allocation path); the allocation records the slot, so a free from anywhere credits the
//! slot it was charged to. When the fiber ends ([`Owner::close`]) its slot stays while any
//! allocation charged to it lives ("held by exited fiber N") and is reused after the last one
//! is freed.
//!
//! Invariants: a slot's `state` counts the records that name it (allocations in the every
//! tier, samples in the sampled tier) and has an exited bit; it is recycled exactly once, by
//! whichever of [`Owner::close`] and the last release sees both "exited" and "no records".
//! How a figure can be wrong: in the sampled tier the bytes and counts are estimates (each
//! sample stands for `1/p` allocations); an allocation made while the table is full (over
//! [`MAX_OWNERS`] owners with live bytes) is charged to slot 0.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// Slots per chunk of the table.
const CHUNK: usize = 1024;
/// Chunks the table can have.
const CHUNKS: usize = 4096;
/// Most owners with live bytes at once (the rest are charged to slot 0).
pub const MAX_OWNERS: usize = CHUNK * CHUNKS;

const EXITED: u64 = 1;
const REF: u64 = 2;

/// One owner's counters.
#[derive(Default)]
pub(crate) struct Slot {
    /// The fiber charged (0 for slot 0, threads).
    fiber: AtomicU64,
    /// Records naming this slot, times [`REF`], plus [`EXITED`].
    state: AtomicU64,
    live_bytes: AtomicI64,
    live_objects: AtomicI64,
    alloc_bytes: AtomicU64,
    alloc_objects: AtomicU64,
}

static TABLE: [AtomicPtr<Slot>; CHUNKS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS];
/// Next never-used slot index (slot 0 is for threads).
static NEXT: AtomicU32 = AtomicU32::new(1);
/// Recycled slots.
static FREE: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// The slot `i`, its chunk allocated if `create`.
fn slot(i: u32, create: bool) -> Option<&'static Slot> {
    let (c, o) = (i as usize / CHUNK, i as usize % CHUNK);
    let cell = TABLE.get(c)?;
    let mut p = cell.load(Ordering::Acquire);
    if p.is_null() {
        if !create {
            return None;
        }
        let layout = Layout::array::<Slot>(CHUNK).ok()?;
        // SAFETY: a non-zero-sized layout; zeroed memory is a valid `Slot` array (all atomics
        // at zero, which is `Slot::default()`).
        let fresh = unsafe { System.alloc_zeroed(layout) }.cast::<Slot>();
        if fresh.is_null() {
            return None;
        }
        match cell.compare_exchange(p, fresh, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => p = fresh,
            Err(won) => {
                // SAFETY: `fresh` was allocated just above with this layout and never shared.
                unsafe { System.dealloc(fresh.cast(), layout) };
                p = won;
            }
        }
    }
    // SAFETY: `p` is a chunk of CHUNK slots, never freed; `o < CHUNK`.
    Some(unsafe { &*p.add(o) })
}

/// The slot records charged to `i` go to: `i`'s, or slot 0's when its chunk cannot be had.
pub(crate) fn slot_or_zero(i: u32) -> &'static Slot {
    match slot(i, true) {
        Some(s) => s,
        None => slot(0, true).unwrap_or_else(|| {
            // Chunk 0 could not be allocated: the process is out of memory, and so is this.
            static ZERO: Slot = Slot {
                fiber: AtomicU64::new(0),
                state: AtomicU64::new(0),
                live_bytes: AtomicI64::new(0),
                live_objects: AtomicI64::new(0),
                alloc_bytes: AtomicU64::new(0),
                alloc_objects: AtomicU64::new(0),
            };
            &ZERO
        }),
    }
}

/// Takes a free slot for `fiber` (0 when none is left).
fn open_slot(fiber: u64) -> u32 {
    // The free list's own growth must not be tracked: a tracked allocation opens a slot.
    let _busy = super::Busy::enter();
    let reused = FREE.lock().ok().and_then(|mut f| f.pop());
    let i = match reused {
        Some(i) => i,
        None => {
            let i = NEXT.fetch_add(1, Ordering::Relaxed);
            if i as usize >= MAX_OWNERS {
                NEXT.store(MAX_OWNERS as u32, Ordering::Relaxed);
                return 0;
            }
            i
        }
    };
    match slot(i, true) {
        Some(s) => {
            s.fiber.store(fiber, Ordering::Relaxed);
            i
        }
        None => 0,
    }
}

/// Resets slot `i` and puts it on the free list.
fn recycle(i: u32) {
    if i == 0 {
        return;
    }
    // As in `open_slot`: the push may grow the list, under its lock.
    let _busy = super::Busy::enter();
    if let Some(s) = slot(i, false) {
        s.live_bytes.store(0, Ordering::Relaxed);
        s.live_objects.store(0, Ordering::Relaxed);
        s.alloc_bytes.store(0, Ordering::Relaxed);
        s.alloc_objects.store(0, Ordering::Relaxed);
        s.fiber.store(0, Ordering::Relaxed);
        s.state.store(0, Ordering::Release);
        if let Ok(mut f) = FREE.lock() {
            f.push(i);
        }
    }
}

/// Charges a record of `bytes` standing for `objects` allocations to slot `i`.
#[inline]
pub(crate) fn charge(i: u32, bytes: i64, objects: i64) {
    let s = slot_or_zero(i);
    s.state.fetch_add(REF, Ordering::Relaxed);
    s.live_bytes.fetch_add(bytes, Ordering::Relaxed);
    s.live_objects.fetch_add(objects, Ordering::Relaxed);
    s.alloc_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    s.alloc_objects.fetch_add(objects as u64, Ordering::Relaxed);
}

/// Credits back a record charged with [`charge`] (the same figures).
#[inline]
pub(crate) fn credit(i: u32, bytes: i64, objects: i64) {
    let s = slot_or_zero(i);
    s.live_bytes.fetch_sub(bytes, Ordering::Relaxed);
    s.live_objects.fetch_sub(objects, Ordering::Relaxed);
    if s.state.fetch_sub(REF, Ordering::AcqRel) == REF | EXITED {
        recycle(i);
    }
}

/// Heap figures of one owner. In the sampled tier they are estimates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Live bytes charged.
    pub live_bytes: i64,
    /// Live allocations charged.
    pub live_objects: i64,
    /// Bytes allocated since the owner's first allocation.
    pub alloc_bytes: u64,
    /// Allocations made since the owner's first allocation.
    pub alloc_objects: u64,
}

fn usage_of(s: &Slot) -> Usage {
    Usage {
        live_bytes: s.live_bytes.load(Ordering::Relaxed),
        live_objects: s.live_objects.load(Ordering::Relaxed),
        alloc_bytes: s.alloc_bytes.load(Ordering::Relaxed),
        alloc_objects: s.alloc_objects.load(Ordering::Relaxed),
    }
}

/// What a fiber's heap is charged to: one per fiber, made current while it runs.
#[derive(Debug)]
pub struct Owner {
    /// Slot index + 1 once opened; 0 before the first allocation, `u32::MAX` once closed.
    slot: AtomicU32,
    fiber: u64,
}

const CLOSED: u32 = u32::MAX;

impl Owner {
    /// The owner of fiber `fiber` (no slot is taken before its first tracked allocation).
    pub const fn new(fiber: u64) -> Owner {
        Owner {
            slot: AtomicU32::new(0),
            fiber,
        }
    }

    /// The fiber.
    pub fn fiber(&self) -> u64 {
        self.fiber
    }

    /// The slot to charge an allocation made now (taken on first use; 0 once closed).
    #[inline]
    pub(crate) fn slot_for_charge(&self) -> u32 {
        match self.slot.load(Ordering::Relaxed) {
            0 => {
                let i = open_slot(self.fiber);
                // Only the owner's own thread charges it (it is current there); a close
                // racing from elsewhere wins and the slot is closed at once.
                match self
                    .slot
                    .compare_exchange(0, i + 1, Ordering::AcqRel, Ordering::Relaxed)
                {
                    Ok(_) => i,
                    Err(_) => {
                        recycle(i);
                        0
                    }
                }
            }
            CLOSED => 0,
            s => s - 1,
        }
    }

    /// The heap charged to this fiber and still live.
    pub fn usage(&self) -> Usage {
        match self.slot.load(Ordering::Acquire) {
            0 | CLOSED => Usage::default(),
            s => slot(s - 1, false).map(usage_of).unwrap_or_default(),
        }
    }

    /// The fiber ended: its slot stays listed as an exited fiber's while allocations charged
    /// to it live.
    pub fn close(&self) {
        let s = self.slot.swap(CLOSED, Ordering::AcqRel);
        if s == 0 || s == CLOSED {
            return;
        }
        let i = s - 1;
        if i == 0 {
            return;
        }
        if let Some(sl) = slot(i, false) {
            if sl.state.fetch_or(EXITED, Ordering::AcqRel) == 0 {
                recycle(i);
            }
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.close();
    }
}

/// One row of [`owners`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OwnerRow {
    /// The fiber, or `None` for code outside fibers.
    pub fiber: Option<u64>,
    /// Whether the fiber has ended (its bytes are "held by exited fiber N").
    pub exited: bool,
    /// Its figures.
    pub usage: Usage,
}

/// Every owner with a slot: slot 0 (code outside fibers) first, then fibers, live or exited.
pub fn owners() -> Vec<OwnerRow> {
    let _busy = super::Busy::enter();
    let n = (NEXT.load(Ordering::Relaxed) as usize).min(MAX_OWNERS);
    let mut out = Vec::new();
    for i in 0..n as u32 {
        let Some(s) = slot(i, false) else { continue };
        let st = s.state.load(Ordering::Acquire);
        let fiber = s.fiber.load(Ordering::Relaxed);
        if i != 0 && fiber == 0 {
            continue;
        }
        out.push(OwnerRow {
            fiber: (i != 0).then_some(fiber),
            exited: st & EXITED != 0,
            usage: usage_of(s),
        });
    }
    out
}

/// The fiber charged through slot `i` (`None` for slot 0), and whether it has ended.
pub(crate) fn fiber_of(i: u32) -> (Option<u64>, bool) {
    if i == 0 {
        return (None, false);
    }
    match slot(i, false) {
        Some(s) => (
            Some(s.fiber.load(Ordering::Relaxed)).filter(|&f| f != 0),
            s.state.load(Ordering::Relaxed) & EXITED != 0,
        ),
        None => (None, false),
    }
}

thread_local! {
    static CURRENT: Cell<*const Owner> = const { Cell::new(std::ptr::null()) };
}

/// Makes `owner` the one this thread's allocations are charged to (`None`: code outside
/// fibers); returns the previous one, to restore with [`restore`] when the fiber suspends.
///
/// The owner must stay alive until it is replaced: a runtime keeps it in the fiber's
/// control block and restores the previous owner when the fiber stops running.
#[inline]
pub fn switch_to(owner: Option<&Owner>) -> *const Owner {
    let p = owner.map_or(std::ptr::null(), |o| o as *const Owner);
    CURRENT
        .try_with(|c| c.replace(p))
        .unwrap_or(std::ptr::null())
}

/// Puts back an owner returned by [`switch_to`].
#[inline]
pub fn restore(prev: *const Owner) {
    let _ = CURRENT.try_with(|c| c.set(prev));
}

/// Runs `f` with this thread's allocations charged to code outside fibers (slot 0), then
/// puts back the owner that was current, also when `f` unwinds: for a runtime's own work
/// done while a fiber runs (its tables' growth, objects it makes ahead for whichever fibers
/// come next), which is not that fiber's heap.
/// When the heap is not tracked, nothing is charged: `f` only runs (a load of the tier,
/// where switching owners cost a fiber creation ~10% in a loop of them).
#[inline]
pub fn outside_fibers<R>(f: impl FnOnce() -> R) -> R {
    let _outside = OutsideFibers::enter();
    f()
}

/// [`outside_fibers`] as a guard: this thread's allocations are charged to code outside
/// fibers until it is dropped, which puts back the owner that was current.
pub struct OutsideFibers {
    /// The owner to put back (`None`: the heap is not tracked, nothing was switched).
    prev: Option<*const Owner>,
}

impl OutsideFibers {
    /// Starts charging this thread's allocations to code outside fibers.
    #[inline]
    pub fn enter() -> OutsideFibers {
        OutsideFibers {
            prev: super::tracking().then(|| switch_to(None)),
        }
    }
}

impl Drop for OutsideFibers {
    #[inline]
    fn drop(&mut self) {
        if let Some(p) = self.prev {
            restore(p);
        }
    }
}

/// The slot the current thread's allocation is charged to.
#[inline]
pub(crate) fn current_slot() -> u32 {
    let p = CURRENT.try_with(|c| c.get()).unwrap_or(std::ptr::null());
    if p.is_null() {
        return 0;
    }
    // SAFETY: `switch_to`'s contract: the current owner is alive while it is current.
    unsafe { &*p }.slot_for_charge()
}
