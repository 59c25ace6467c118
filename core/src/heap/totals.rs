//! Cumulative allocations per (stack, fiber): what pprof's `alloc_objects`/`alloc_space`
//! report (the live ones are [`super::live`]).
//!
//! Every recorded allocation (every tier) or sample (sampled tier, with its estimated
//! figures) adds to its entry, under one lock, taken after the stack walk. The table holds at
//! most [`MAX_ENTRIES`] entries; records of new stacks past that are added to one entry with
//! an empty stack (counted, never lost).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::codec::lws::MAX_DEPTH;

/// Most (stack, fiber) entries kept.
pub const MAX_ENTRIES: usize = 1 << 16;

#[derive(Clone, Copy)]
struct Entry {
    addrs: [u64; MAX_DEPTH],
    depth: u8,
    fiber: u64,
    bytes: u64,
    objects: u64,
}

static TABLE: Mutex<Option<HashMap<u64, Entry>>> = Mutex::new(None);

fn key(addrs: &[u64], fiber: u64) -> u64 {
    let mut h = fiber.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ addrs.len() as u64;
    for &a in addrs {
        h = (h ^ a).wrapping_mul(0x100_0000_01B3).rotate_left(29);
    }
    h
}

/// Adds a record. Call under [`super::Busy`] (the table's own growth is not tracked).
pub(crate) fn add(addrs: &[u64], fiber: u64, bytes: i64, objects: i64) {
    let addrs = &addrs[..addrs.len().min(MAX_DEPTH)];
    let mut k = key(addrs, fiber);
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let t = t.get_or_insert_with(HashMap::new);
    let same = |e: &Entry| e.fiber == fiber && &e.addrs[..usize::from(e.depth)] == addrs;
    // A collision with another stack, or a full table: the overflow entry.
    let fits = match t.get(&k) {
        Some(e) => same(e),
        None => t.len() < MAX_ENTRIES,
    };
    let (addrs, fiber) = if fits {
        (addrs, fiber)
    } else {
        k = 0;
        (&[][..], 0)
    };
    let e = t.entry(k).or_insert_with(|| {
        let mut a = [0u64; MAX_DEPTH];
        a[..addrs.len()].copy_from_slice(addrs);
        Entry {
            addrs: a,
            depth: addrs.len() as u8,
            fiber,
            bytes: 0,
            objects: 0,
        }
    });
    e.bytes += bytes.max(0) as u64;
    e.objects += objects.max(0) as u64;
}

/// Allocations made so far by one stack in one fiber.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Total {
    /// The stack's return addresses, innermost first (empty: the overflow entry).
    pub addrs: Vec<u64>,
    /// The fiber (`None`: outside fibers, or the overflow entry).
    pub fiber: Option<u64>,
    /// Bytes allocated (estimated in the sampled tier).
    pub bytes: u64,
    /// Allocations made (estimated in the sampled tier).
    pub objects: u64,
}

/// Every entry of the table.
pub fn totals() -> Vec<Total> {
    let _busy = super::Busy::enter();
    let t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    t.as_ref()
        .map(|m| {
            m.values()
                .map(|e| Total {
                    addrs: e.addrs[..usize::from(e.depth)].to_vec(),
                    fiber: (e.fiber != 0).then_some(e.fiber),
                    bytes: e.bytes,
                    objects: e.objects,
                })
                .collect()
        })
        .unwrap_or_default()
}
