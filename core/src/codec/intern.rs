//! An interned stack store: many traces kept as paths in one prefix tree, each trace a
//! [`StackId`].
//!
//! Stacks are keyed outermost frame first, so traces that share their outer part (`main`, the
//! runtime, a fiber trampoline, a common caller) share tree nodes; a trace is the id of the node
//! of its innermost frame. A repeated trace costs nothing but its id.
//!
//! # Memory
//!
//! A node is 8 bytes (parent id, frame index) plus about 6 bytes of hash index; each distinct
//! frame is stored once (16 bytes plus index). [`StackStore::stats`] reports the bytes held,
//! counted from capacities. The store is append-only: ids stay valid for the store's life.
//!
//! # When full
//!
//! The store holds at most `max_nodes` nodes (set at creation). A trace whose path is already
//! stored is always interned; a trace that would need new nodes beyond the limit is refused as
//! a whole ([`StoreFull`]; nothing is added, the refusal is counted in
//! [`StoreStats::refused`]). Nothing is ever evicted, so ids handed out stay valid.
//!
//! # Concurrency
//!
//! [`StackStore`] is `Sync`. A reader-writer lock guards the tree: lookups and inserts of
//! traces already present take the read side only; the write side is taken to add nodes.
//! Insert/lookup statistics are atomics.
//!
//! # How a result can be wrong
//!
//! It cannot be silently: [`StackStore::get`] returns exactly the frames inserted for that id.
//! An id from another store is meaningless here (it may name a different trace); ids out of
//! range give `None`.

use crate::Frame;
use hashbrown::HashTable;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The id of a stored trace. [`StackId::EMPTY`] is the empty trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackId(pub u32);

impl StackId {
    /// The empty trace (the tree's root).
    pub const EMPTY: StackId = StackId(0);
}

/// A trace was refused because the store is at its node limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFull {
    /// The store's node limit.
    pub max_nodes: usize,
}

impl std::fmt::Display for StoreFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stack store is full ({} nodes); trace not stored",
            self.max_nodes
        )
    }
}

impl std::error::Error for StoreFull {}

/// Counters of a [`StackStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Successful inserts.
    pub traces: u64,
    /// Frames in successful inserts (repeats included).
    pub frames: u64,
    /// Refused inserts.
    pub refused: u64,
    /// Tree nodes (the root included).
    pub nodes: usize,
    /// Distinct frames.
    pub distinct_frames: usize,
    /// Bytes held by the store's tables (from their capacities).
    pub bytes: usize,
}

impl StoreStats {
    /// Bytes held per frame inserted.
    pub fn bytes_per_frame(&self) -> f64 {
        self.bytes as f64 / self.frames.max(1) as f64
    }
}

/// Default node limit of [`StackStore::new`]: 2^24 nodes (about 250 MB at worst).
pub const DEFAULT_MAX_NODES: usize = 1 << 24;

#[derive(Default)]
struct Inner {
    /// Per node: parent node id; node 0 is the root.
    parent: Vec<u32>,
    /// Per node: index into `frames` (unused for the root).
    frame: Vec<u32>,
    /// Distinct frames.
    frames: Vec<Frame>,
    /// Frame → index, by hash of the frame.
    frame_index: HashTable<u32>,
    /// (parent, frame) → node, by hash of the pair.
    child_index: HashTable<u32>,
}

/// A small fixed multiply-xorshift hasher (inputs are addresses from our own process).
#[derive(Default)]
struct Mix(u64);

impl Hasher for Mix {
    fn finish(&self) -> u64 {
        let x = self.0;
        (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(23) ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn write_isize(&mut self, v: isize) {
        self.write_u64(v as u64);
    }
}

fn hash_frame(f: &Frame) -> u64 {
    let mut h = Mix::default();
    f.hash(&mut h);
    h.finish()
}

fn hash_edge(parent: u32, frame: u32) -> u64 {
    let mut h = Mix::default();
    h.write_u64((u64::from(parent) << 32) | u64::from(frame));
    h.finish()
}

/// Makes room for `n` more elements growing by a quarter (not doubling), so that at most about
/// 20% of a table's capacity is unused.
fn grow<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() - v.len() < n {
        v.reserve_exact(n.max(v.len() / 4).max(64));
    }
}

impl Inner {
    fn new() -> Self {
        Self {
            parent: vec![0],
            frame: vec![u32::MAX],
            ..Self::default()
        }
    }

    fn find_frame(&self, f: &Frame) -> Option<u32> {
        self.frame_index
            .find(hash_frame(f), |&i| self.frames[i as usize] == *f)
            .copied()
    }

    fn find_child(&self, parent: u32, frame: u32) -> Option<u32> {
        self.child_index
            .find(hash_edge(parent, frame), |&n| {
                self.parent[n as usize] == parent && self.frame[n as usize] == frame
            })
            .copied()
    }

    /// Walks from the root as far as the stored tree goes. Returns the deepest node and how many
    /// frames (from the outer end) it covers.
    fn walk(&self, frames: &[Frame]) -> (u32, usize) {
        let mut node = 0u32;
        for (k, f) in frames.iter().rev().enumerate() {
            let Some(fi) = self.find_frame(f) else {
                return (node, k);
            };
            let Some(c) = self.find_child(node, fi) else {
                return (node, k);
            };
            node = c;
        }
        (node, frames.len())
    }

    fn add(&mut self, frames: &[Frame], mut node: u32, done: usize) -> u32 {
        let need = frames.len() - done;
        grow(&mut self.parent, need);
        grow(&mut self.frame, need);
        for f in frames.iter().rev().skip(done) {
            let fi = match self.find_frame(f) {
                Some(i) => i,
                None => {
                    let i = self.frames.len() as u32;
                    grow(&mut self.frames, 1);
                    self.frames.push(*f);
                    let frames = &self.frames;
                    self.frame_index
                        .insert_unique(hash_frame(f), i, |&j| hash_frame(&frames[j as usize]));
                    i
                }
            };
            let n = self.parent.len() as u32;
            self.parent.push(node);
            self.frame.push(fi);
            let (parent, frame) = (&self.parent, &self.frame);
            self.child_index
                .insert_unique(hash_edge(node, fi), n, |&m| {
                    hash_edge(parent[m as usize], frame[m as usize])
                });
            node = n;
        }
        node
    }

    fn bytes(&self) -> usize {
        fn table(cap: usize) -> usize {
            if cap == 0 {
                0
            } else {
                // hashbrown: buckets = next power of two ≥ cap·8/7; 4-byte slot + 1 control byte.
                (cap * 8 / 7).next_power_of_two() * 5
            }
        }
        self.parent.capacity() * 4
            + self.frame.capacity() * 4
            + self.frames.capacity() * std::mem::size_of::<Frame>()
            + table(self.frame_index.capacity())
            + table(self.child_index.capacity())
    }
}

/// A thread-safe interned store of traces (see the module docs).
pub struct StackStore {
    inner: RwLock<Inner>,
    max_nodes: usize,
    traces: AtomicU64,
    frames: AtomicU64,
    refused: AtomicU64,
}

impl Default for StackStore {
    fn default() -> Self {
        Self::new()
    }
}

impl StackStore {
    /// A store with the [`DEFAULT_MAX_NODES`] limit.
    pub fn new() -> Self {
        Self::with_max_nodes(DEFAULT_MAX_NODES)
    }

    /// A store holding at most `max_nodes` tree nodes (the root counts as one; capped at
    /// 2^32 − 1).
    pub fn with_max_nodes(max_nodes: usize) -> Self {
        Self {
            inner: RwLock::new(Inner::new()),
            max_nodes: max_nodes.clamp(1, u32::MAX as usize),
            traces: AtomicU64::new(0),
            frames: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        // No code path panics while holding the lock, but a poisoned lock still holds a
        // consistent tree (nodes are pushed before they are indexed): keep using it.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores a trace (innermost frame first) and returns its id; the same frames always give
    /// the same id. Fails only when new nodes would exceed the limit.
    pub fn insert(&self, frames: &[Frame]) -> Result<StackId, StoreFull> {
        let (node, done) = self.read().walk(frames);
        let id = if done == frames.len() {
            node
        } else {
            let mut g = self.write();
            // Another thread may have added nodes meanwhile: walk again.
            let (node, done) = g.walk(frames);
            let need = frames.len() - done;
            if g.parent.len() + need > self.max_nodes {
                drop(g);
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(StoreFull {
                    max_nodes: self.max_nodes,
                });
            }
            g.add(frames, node, done)
        };
        self.traces.fetch_add(1, Ordering::Relaxed);
        self.frames
            .fetch_add(frames.len() as u64, Ordering::Relaxed);
        Ok(StackId(id))
    }

    /// The frames of a trace, innermost first, appended to `out`. Returns `false` (and appends
    /// nothing) for an id this store never gave out.
    pub fn get_into(&self, id: StackId, out: &mut Vec<Frame>) -> bool {
        let g = self.read();
        if id.0 as usize >= g.parent.len() {
            return false;
        }
        let mut n = id.0;
        while n != 0 {
            out.push(g.frames[g.frame[n as usize] as usize]);
            n = g.parent[n as usize];
        }
        true
    }

    /// The frames of a trace, innermost first; `None` for an id this store never gave out.
    pub fn get(&self, id: StackId) -> Option<Vec<Frame>> {
        let mut v = Vec::new();
        self.get_into(id, &mut v).then_some(v)
    }

    /// Counters and memory use.
    pub fn stats(&self) -> StoreStats {
        let g = self.read();
        StoreStats {
            traces: self.traces.load(Ordering::Relaxed),
            frames: self.frames.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            nodes: g.parent.len(),
            distinct_frames: g.frames.len(),
            bytes: g.bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_outer_frames() {
        let s = StackStore::new();
        let a = [Frame::Ra(3), Frame::Ra(2), Frame::Ra(1)];
        let b = [Frame::Pc(4), Frame::Ra(2), Frame::Ra(1)];
        let ia = s.insert(&a).unwrap();
        let ib = s.insert(&b).unwrap();
        assert_eq!(ia, StackId(3));
        assert_eq!(ib, StackId(4));
        assert_eq!(s.insert(&a).unwrap(), ia);
        assert_eq!(s.insert(&a[1..]).unwrap(), StackId(2));
        assert_eq!(s.insert(&[]).unwrap(), StackId::EMPTY);
        assert_eq!(s.get(ia).unwrap(), a);
        assert_eq!(s.get(ib).unwrap(), b);
        assert_eq!(s.get(StackId::EMPTY).unwrap(), []);
        assert_eq!(s.get(StackId(5)), None);
        let st = s.stats();
        assert_eq!(
            (st.traces, st.frames, st.nodes, st.distinct_frames),
            (5, 11, 5, 4)
        );
    }

    #[test]
    fn full_store_refuses_whole_traces() {
        let s = StackStore::with_max_nodes(5);
        let a = [Frame::Ra(3), Frame::Ra(2), Frame::Ra(1)];
        assert_eq!(s.insert(&a).unwrap(), StackId(3));
        assert_eq!(
            s.insert(&[Frame::Ra(9), Frame::Ra(8)]),
            Err(StoreFull { max_nodes: 5 })
        );
        assert_eq!(s.insert(&[Frame::Ra(9), Frame::Ra(1)]).unwrap(), StackId(4));
        assert_eq!(
            s.insert(&[Frame::Ra(7), Frame::Ra(1)]),
            Err(StoreFull { max_nodes: 5 })
        );
        assert_eq!(s.insert(&a).unwrap(), StackId(3));
        let st = s.stats();
        assert_eq!((st.refused, st.nodes, st.traces), (2, 5, 3));
    }
}
