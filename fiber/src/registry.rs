//! The process-wide registry of schedulers and their fibers, readable from any thread.
//!
//! Each scheduler's live fibers sit in a slab of atomic pointers (`FiberSlab`) that only the
//! scheduler's own thread writes and any thread may read, without a lock on either side: a
//! spawn is one pointer store, an exit one pointer swap (a mutex and a hash map cost a spawn
//! and an exit four atomic read-modify-writes and two hash-map updates).
//!
//! Invariants, and how a reading can be wrong:
//! - A slot holds either null or a pointer from `Arc::into_raw`, whose reference the slot
//!   owns. Only the owning scheduler's thread stores or swaps slots, and only through
//!   `SlabOwner`, which it alone holds (so two writers never race).
//! - A reader announces itself in `readers` (sequentially consistent) before loading any slot,
//!   and takes its own reference before it leaves. The writer empties a slot with a
//!   sequentially consistent swap, then drops the slot's reference only if it sees no reader;
//!   otherwise the reference waits in `retired` until a later exit sees none (or the slab is
//!   dropped, which no reader can outlive: readers hold the scheduler's `Arc`). A reader that
//!   announced itself after the swap cannot see the old pointer; one that announced itself
//!   before it is seen by the writer. So a pointer a reader loads is alive until it has its
//!   own reference.
//! - A reading is not a snapshot: a fiber spawned or ended while a reader scans may or may
//!   not be in it (as with a lock taken a moment earlier or later); every fiber that lives
//!   through the whole scan is in it exactly once.
//! - Chunks of slots are allocated as the high-water mark grows and freed only with the slab.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::running::OnThread;
use crate::task::{ControlBlock, FiberId};

static NEXT_SCHED: AtomicU64 = AtomicU64::new(1);
static SCHEDULERS: Mutex<Vec<Weak<SchedShared>>> = Mutex::new(Vec::new());

/// Slots per chunk.
pub(crate) const CHUNK: usize = 1024;
/// Chunks per slab: at most `CHUNK * MAX_CHUNKS` (4 Mi) fibers live at once per scheduler
/// (more go to a locked overflow list).
const MAX_CHUNKS: usize = 4096;
/// Most references kept for readers before an exit waits for them to finish.
const RETIRED_MAX: usize = 4096;

type Chunk = [AtomicPtr<ControlBlock>; CHUNK];

/// A scheduler's live fibers: see the module docs.
pub(crate) struct FiberSlab {
    /// The chunk directory (its length is the slab's capacity in chunks).
    pub(crate) chunks: Box<[AtomicPtr<Chunk>]>,
    /// Slots ever handed out (readers scan `[0, len)`).
    pub(crate) len: AtomicUsize,
    /// Readers scanning now.
    readers: AtomicUsize,
    /// Whether `retired` holds anything (read without its lock on every exit).
    has_retired: AtomicBool,
    /// References taken out of slots while a reader was scanning.
    retired: Mutex<Vec<Arc<ControlBlock>>>,
    /// Fibers past the slab's capacity (a mutex and a list: never used in practice).
    overflow: Mutex<Vec<Arc<ControlBlock>>>,
}

/// Where a fiber is in its scheduler's slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlabIndex {
    Slot(u32),
    Overflow,
}

/// The writing side of a [`FiberSlab`], held by the scheduler's own thread only.
#[derive(Default)]
pub(crate) struct SlabOwner {
    free: Vec<u32>,
    next: u32,
}

impl FiberSlab {
    fn new() -> Self {
        Self::with_chunks(MAX_CHUNKS)
    }

    fn with_chunks(max_chunks: usize) -> Self {
        FiberSlab {
            chunks: (0..max_chunks)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            len: AtomicUsize::new(0),
            readers: AtomicUsize::new(0),
            has_retired: AtomicBool::new(false),
            retired: Mutex::new(Vec::new()),
            overflow: Mutex::new(Vec::new()),
        }
    }

    /// The slot of index `i` (its chunk must exist).
    #[inline]
    fn slot(&self, i: usize) -> &AtomicPtr<ControlBlock> {
        let c = self.chunks[i / CHUNK].load(Ordering::Acquire);
        debug_assert!(!c.is_null());
        // SAFETY: a chunk pointer, once stored, stays valid until the slab is dropped; the
        // chunk of every index below `len` (and of every index handed out) was stored first.
        unsafe { &(*c)[i % CHUNK] }
    }

    /// Adds a fiber; returns where, for [`FiberSlab::remove`].
    pub(crate) fn add(&self, owner: &mut SlabOwner, f: Arc<ControlBlock>) -> SlabIndex {
        let i = match owner.free.pop() {
            Some(i) => i as usize,
            None => {
                let i = owner.next as usize;
                if i >= CHUNK * self.chunks.len() {
                    lock(&self.overflow).push(f);
                    return SlabIndex::Overflow;
                }
                if i.is_multiple_of(CHUNK) {
                    let c: Box<Chunk> =
                        Box::new([const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNK]);
                    self.chunks[i / CHUNK].store(Box::into_raw(c), Ordering::Release);
                }
                owner.next += 1;
                // Published after its chunk: a reader that sees the new length sees the chunk.
                self.len.store(i + 1, Ordering::Release);
                i
            }
        };
        self.slot(i)
            .store(Arc::into_raw(f).cast_mut(), Ordering::Release);
        SlabIndex::Slot(i as u32)
    }

    /// Removes the fiber added at `at` (whose id is `id`).
    pub(crate) fn remove(&self, owner: &mut SlabOwner, at: SlabIndex, id: FiberId) {
        let i = match at {
            SlabIndex::Slot(i) => i,
            SlabIndex::Overflow => {
                lock(&self.overflow).retain(|f| f.id != id);
                return;
            }
        };
        let p = self
            .slot(i as usize)
            .swap(std::ptr::null_mut(), Ordering::SeqCst);
        owner.free.push(i);
        if p.is_null() {
            return;
        }
        // SAFETY: a non-null slot holds a reference from `Arc::into_raw` (module docs); the
        // swap moved it out, so it is ours to own once.
        let f = unsafe { Arc::from_raw(p) };
        if self.readers.load(Ordering::SeqCst) == 0 {
            if self.has_retired.load(Ordering::Relaxed) {
                self.has_retired.store(false, Ordering::Relaxed);
                lock(&self.retired).clear();
            }
            drop(f);
        } else {
            let mut retired = lock(&self.retired);
            retired.push(f);
            self.has_retired.store(true, Ordering::Relaxed);
            if retired.len() >= RETIRED_MAX {
                // Readers that keep overlapping would let the list grow without end: wait
                // for a moment with none (a scan only clones pointers, and never waits for
                // this thread).
                while self.readers.load(Ordering::SeqCst) != 0 {
                    std::thread::yield_now();
                }
                retired.clear();
                self.has_retired.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Calls `each` with every live fiber (see the module docs for what "every" means).
    fn scan(&self, mut each: impl FnMut(&Arc<ControlBlock>) -> bool) {
        struct Reading<'a>(&'a AtomicUsize);
        impl Drop for Reading<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Release);
            }
        }
        self.readers.fetch_add(1, Ordering::SeqCst);
        let _reading = Reading(&self.readers);
        let n = self.len.load(Ordering::Acquire);
        for i in 0..n {
            // SeqCst, as the writer's swap and the announcement: a reader announced after a
            // swap sees the slot emptied (module docs).
            let p = self.slot(i).load(Ordering::SeqCst);
            if p.is_null() {
                continue;
            }
            // SAFETY: `p` came from `Arc::into_raw` and its reference cannot be dropped while
            // this reader is announced (module docs); ManuallyDrop: the reference stays the
            // slot's.
            let f = std::mem::ManuallyDrop::new(unsafe { Arc::from_raw(p) });
            if !each(&f) {
                return;
            }
        }
        drop(_reading);
        for f in lock(&self.overflow).iter() {
            if !each(f) {
                return;
            }
        }
    }
}

impl Drop for FiberSlab {
    fn drop(&mut self) {
        let n = *self.len.get_mut();
        for i in 0..n {
            let p = self.slot(i).load(Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: the slot's own reference (module docs); nobody else can read the
                // slab any more (`&mut self`).
                drop(unsafe { Arc::from_raw(p) });
            }
        }
        for c in self.chunks.iter_mut() {
            let c = *c.get_mut();
            if !c.is_null() {
                // SAFETY: allocated by `Box::into_raw` in `add`, freed once, here.
                drop(unsafe { Box::from_raw(c) });
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What other threads may see of a scheduler.
pub struct SchedShared {
    /// Its id.
    pub id: u64,
    /// Its name.
    pub name: String,
    pub(crate) fibers: FiberSlab,
    pub(crate) on_thread: OnThread,
    /// Whether it is idle, waiting for a timer (a stall detector must not fire then).
    pub(crate) idle: AtomicBool,
    /// Whether it has ever timed its runs (counted its fibers' CPU time): from its start with
    /// `SchedulerOptions::cpu_time`, or since `fiber.top` accounting was first turned on.
    pub(crate) cpu_counted: AtomicBool,
    /// What a reader in another process needs of the fields above (see `crate::publish`).
    pub(crate) published: SchedPublished,
}

/// A scheduler's name and slab as a reader in another process reads them (see
/// `crate::publish`): plain words where `SchedShared` keeps a `String` and a boxed slice.
/// Both point into heap buffers that do not move while the scheduler lives.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct SchedPublished {
    pub name_ptr: u64,
    pub name_len: u64,
    pub chunk_dir: u64,
    pub chunk_count: u64,
}

impl std::fmt::Debug for SchedShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedShared")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish()
    }
}

impl SchedShared {
    /// Its live fibers, in id order.
    pub fn fibers(&self) -> Vec<Arc<ControlBlock>> {
        let mut v = Vec::with_capacity(self.fibers.len.load(Ordering::Relaxed));
        self.fibers.scan(|f| {
            v.push(f.clone());
            true
        });
        // Slots are reused, so slab order is not id order.
        v.sort_unstable_by_key(|f| f.id);
        v
    }

    /// Its live fiber `id`, if it has one.
    pub fn fiber(&self, id: FiberId) -> Option<Arc<ControlBlock>> {
        let mut found = None;
        self.fibers.scan(|f| {
            if f.id == id {
                found = Some(f.clone());
            }
            found.is_none()
        });
        found
    }
}

pub(crate) fn register(name: String) -> Arc<SchedShared> {
    let fibers = FiberSlab::new();
    let published = SchedPublished {
        name_ptr: name.as_ptr() as u64,
        name_len: name.len() as u64,
        chunk_dir: fibers.chunks.as_ptr() as u64,
        chunk_count: fibers.chunks.len() as u64,
    };
    let s = Arc::new(SchedShared {
        id: NEXT_SCHED.fetch_add(1, Ordering::Relaxed),
        name,
        fibers,
        on_thread: OnThread::new(),
        idle: AtomicBool::new(false),
        cpu_counted: AtomicBool::new(false),
        published,
    });
    let mut all = SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.push(Arc::downgrade(&s));
    s
}

pub(crate) fn unregister(s: &Arc<SchedShared>) {
    let mut all = SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(s)));
}

/// Every live scheduler of the process.
pub fn schedulers() -> Vec<Arc<SchedShared>> {
    SCHEDULERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect()
}

/// Finds a fiber by id in any scheduler (a scan of each scheduler's fibers).
pub fn find(id: FiberId) -> Option<(Arc<SchedShared>, Arc<ControlBlock>)> {
    schedulers()
        .into_iter()
        .find_map(|s| s.fiber(id).map(|f| (s, f)))
}

/// The live scheduler `id`.
pub fn scheduler(id: u64) -> Option<Arc<SchedShared>> {
    schedulers().into_iter().find(|s| s.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{NewFiber, ParentInit};
    use fibertrace_core::StackBounds;

    fn block(id: FiberId) -> Arc<ControlBlock> {
        ControlBlock::new_shared(&mut NewFiber {
            id,
            now: 0,
            created_at_start: false,
            sched: 0,
            name: Arc::from("t"),
            parent: 0,
            parent_trace: ParentInit::None,
            stack: StackBounds::new(0x1000, 0x2000),
            stack_size: 0x1000,
            entry_fn: 0,
            entry_name: "t",
            traced: false,
        })
    }

    fn ids(slab: &FiberSlab) -> Vec<FiberId> {
        let mut v = Vec::new();
        slab.scan(|f| {
            v.push(f.id);
            true
        });
        v.sort_unstable();
        v
    }

    /// One writer adds and removes (reusing slots) while reader threads scan and clone: every
    /// reading is sorted, has no repeats and holds the fibers that live throughout; every
    /// reference is released at the end.
    #[test]
    fn readers_and_the_writer_race_without_losing_or_freeing_early() {
        let slab = Arc::new(FiberSlab::with_chunks(2));
        let stayers: Vec<_> = (1..=8).map(block).collect();
        let mut owner = SlabOwner::default();
        for b in &stayers {
            slab.add(&mut owner, b.clone());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (slab, stop) = (slab.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 100 {
                        let mut got = Vec::new();
                        slab.scan(|f| {
                            got.push(f.clone());
                            true
                        });
                        let mut ids: Vec<_> = got.iter().map(|f| f.id).collect();
                        ids.sort_unstable();
                        assert!(ids.windows(2).all(|w| w[0] < w[1]));
                        assert!((1..=8).all(|i| ids.binary_search(&i).is_ok()));
                        n += 1;
                    }
                })
            })
            .collect();
        let mut next = 100;
        let mut live: Vec<(SlabIndex, Arc<ControlBlock>)> = Vec::new();
        let mut all = Vec::new();
        for round in 0..20_000 {
            if live.len() < 64 && round % 3 != 2 {
                let b = block(next);
                next += 1;
                all.push(b.clone());
                live.push((slab.add(&mut owner, b.clone()), b));
            } else if let Some((at, b)) = live.pop() {
                slab.remove(&mut owner, at, b.id);
            }
        }
        for (at, b) in live.drain(..) {
            slab.remove(&mut owner, at, b.id);
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        drop(Arc::try_unwrap(slab).ok().expect("readers gone"));
        // Every reference the slab took, retired ones included, is released.
        assert!(stayers.iter().all(|b| Arc::strong_count(b) == 1));
        assert!(all.iter().all(|b| Arc::strong_count(b) == 1));
    }

    /// Past its capacity the slab keeps fibers in its overflow list: none is lost, and each
    /// is removed from where it was put; slots freed are reused; every reference is
    /// released (the blocks are unique again at the end).
    #[test]
    fn a_full_slab_overflows_and_loses_nothing() {
        let slab = FiberSlab::with_chunks(1);
        let mut owner = SlabOwner::default();
        let blocks: Vec<_> = (1..=CHUNK as u64 + 5).map(block).collect();
        let mut at: Vec<_> = blocks
            .iter()
            .map(|b| slab.add(&mut owner, b.clone()))
            .collect();
        assert_eq!(at[CHUNK - 1], SlabIndex::Slot(CHUNK as u32 - 1));
        assert!(at[CHUNK..].iter().all(|a| *a == SlabIndex::Overflow));
        assert_eq!(ids(&slab), (1..=CHUNK as u64 + 5).collect::<Vec<_>>());
        // Remove one from the slab and one from the overflow; a new fiber reuses the slot.
        slab.remove(&mut owner, at[3], 4);
        slab.remove(&mut owner, at[CHUNK + 1], CHUNK as u64 + 2);
        let extra = block(9999);
        at.push(slab.add(&mut owner, extra.clone()));
        assert_eq!(at.last(), Some(&SlabIndex::Slot(3)));
        let want: Vec<u64> = (1..=CHUNK as u64 + 5)
            .filter(|&i| i != 4 && i != CHUNK as u64 + 2)
            .chain([9999])
            .collect();
        assert_eq!(ids(&slab), want);
        // A removal while a reader scans retires the reference instead of dropping it.
        slab.readers.fetch_add(1, Ordering::SeqCst);
        slab.remove(&mut owner, at[0], 1);
        assert_eq!(Arc::strong_count(&blocks[0]), 2, "kept for the reader");
        slab.readers.fetch_sub(1, Ordering::SeqCst);
        slab.remove(&mut owner, at[1], 2);
        assert_eq!(
            Arc::strong_count(&blocks[0]),
            1,
            "released once no reader is left"
        );
        drop(slab);
        assert!(blocks.iter().all(|b| Arc::strong_count(b) == 1));
        assert_eq!(Arc::strong_count(&extra), 1);
    }
}
