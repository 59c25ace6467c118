//! The host's records of its Lua fibers ([`super::LuaFiber`]), by fiber id: kept dense, in one
//! vector, with a map from id to place.
//!
//! Why not a map of records: `fiber.info()` reads every record, and a hash map of ~100-byte
//! records spreads them over about twice their size in hash order (6 MiB at 30,000 fibers):
//! the listing's scan, then its reads in control-block order, missed the cache on most of
//! them. Here the records are contiguous, in creation order until removals move the last
//! one into a hole, and control blocks, allocated as the fibers are made, mostly follow the
//! same order: the listing reads them as a stream. A lookup by id is one probe in a map of
//! 16-byte entries and one index.
//!
//! Invariant: `at[id] == i` exactly when `all[i].0 == id`; a removal moves the last record
//! into the freed place and updates its index. A place remembered across removals and
//! inserts (a listing's, while finalizers end fibers) may hold another record by then: it is
//! checked against the id before use ([`Dense::get_at_mut`]), so a value never lands in
//! another fiber's record.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use fibertrace_fiber::FiberId;

type Hasher = BuildHasherDefault<fibertrace_core::symbolize::AddrHasher>;

/// The host's records.
pub(crate) type Recs = Dense<super::LuaFiber>;

/// Values by fiber id, dense.
pub(crate) struct Dense<T> {
    at: HashMap<FiberId, usize, Hasher>,
    all: Vec<(FiberId, T)>,
}

impl<T> Default for Dense<T> {
    fn default() -> Self {
        Dense {
            at: HashMap::default(),
            all: Vec::new(),
        }
    }
}

impl<T> Dense<T> {
    pub fn len(&self) -> usize {
        self.all.len()
    }

    pub fn get(&self, id: &FiberId) -> Option<&T> {
        self.at.get(id).map(|&i| &self.all[i].1)
    }

    pub fn get_mut(&mut self, id: &FiberId) -> Option<&mut T> {
        self.at.get(id).map(|&i| &mut self.all[i].1)
    }

    /// The record at `place` (from [`Dense::iter_placed`]) if it is still fiber `id`'s (a
    /// removal since may have moved another record there), else by a lookup.
    pub fn get_at_mut(&mut self, place: usize, id: FiberId) -> Option<&mut T> {
        match self.all.get(place) {
            Some((i, _)) if *i == id => Some(&mut self.all[place].1),
            _ => self.get_mut(&id),
        }
    }

    /// Adds (or replaces) fiber `id`'s record; returns the replaced one.
    pub fn insert(&mut self, id: FiberId, r: T) -> Option<T> {
        // (The table's growth is the host's own, not the heap of the fiber that made the
        // record's fiber.)
        // (A guard, not a closure: the record moved into one was copied once more.)
        let _outside = fibertrace_core::heap::OutsideFibers::enter();
        match self.at.entry(id) {
            Entry::Occupied(e) => Some(std::mem::replace(&mut self.all[*e.get()].1, r)),
            Entry::Vacant(e) => {
                e.insert(self.all.len());
                self.all.push((id, r));
                None
            }
        }
    }

    pub fn remove(&mut self, id: &FiberId) -> Option<T> {
        let i = self.at.remove(id)?;
        Some(self.remove_place(i))
    }

    /// Fiber `id`'s record, taken out when `take` says so (after it saw and may have changed
    /// it): one lookup.
    pub fn take_if(&mut self, id: FiberId, take: impl FnOnce(&mut T) -> bool) -> Option<T> {
        let Entry::Occupied(e) = self.at.entry(id) else {
            return None;
        };
        if !take(&mut self.all[*e.get()].1) {
            return None;
        }
        let i = e.remove();
        Some(self.remove_place(i))
    }

    /// Removes the record at `i` (its id already out of `at`), moving the last one there.
    fn remove_place(&mut self, i: usize) -> T {
        let (_, r) = self.all.swap_remove(i);
        if let Some((moved, _)) = self.all.get(i) {
            let p = self.at.get_mut(moved);
            debug_assert!(p.is_some(), "a record without its index");
            if let Some(p) = p {
                *p = i;
            }
        }
        r
    }

    /// Every record with its id, in their (dense) order.
    pub fn iter(&self) -> impl Iterator<Item = (&FiberId, &T)> {
        self.all.iter().map(|(id, r)| (id, r))
    }

    /// As [`Dense::iter`], with each record's place (for [`Dense::get_at_mut`]).
    pub fn iter_placed(&self) -> impl Iterator<Item = (usize, &FiberId, &T)> {
        self.all.iter().enumerate().map(|(i, (id, r))| (i, id, r))
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.all.iter().map(|(_, r)| r)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.all.iter_mut().map(|(_, r)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A place taken before removals and inserts: while it still holds the id it is used;
    /// once another record sits there (the last one moved into it, or a new one put where
    /// the moved one was), or it is past the end, or it is no place at all, the record is
    /// found by its id.
    #[test]
    fn a_stale_place_finds_the_record_by_its_id() {
        let mut d: Dense<&str> = Dense::default();
        for (id, v) in [(1, "one"), (2, "two"), (3, "three")] {
            d.insert(id, v);
        }
        let places: HashMap<FiberId, usize> = d.iter_placed().map(|(p, id, _)| (*id, p)).collect();
        assert_eq!(d.get_at_mut(places[&2], 2).map(|v| *v), Some("two"));
        // 1 goes: 3 (the last) moves into its place; 3's old place is past the end.
        assert_eq!(d.remove(&1), Some("one"));
        assert_eq!(d.get_at_mut(places[&3], 3).map(|v| *v), Some("three"));
        assert_eq!(d.get_at_mut(places[&1], 3).map(|v| *v), Some("three"));
        // A new record where 3 was: 3's old place holds 4 now.
        d.insert(4, "four");
        assert_eq!(
            d.iter_placed().find(|(_, id, _)| **id == 4).map(|p| p.0),
            Some(places[&3])
        );
        *d.get_at_mut(places[&3], 3).unwrap() = "THREE";
        assert_eq!(d.get(&3), Some(&"THREE"));
        assert_eq!(d.get(&4), Some(&"four"));
        assert_eq!(d.get_at_mut(usize::MAX, 2).map(|v| *v), Some("two"));
        // Gone: nothing, wherever it is asked for.
        assert_eq!(d.get_at_mut(places[&1], 1), None);
        assert_eq!(d.get_at_mut(usize::MAX, 1), None);
        assert_eq!(d.values().count(), 3);
    }

    /// Against a plain map, through a long run of inserts, replacements, removals and
    /// conditional takes (ids reused), checking every id's value and the index after each.
    #[test]
    fn the_dense_store_is_a_map() {
        let mut d: Dense<u64> = Dense::default();
        let mut m: HashMap<FiberId, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = x % 300;
            match x >> 60 {
                0..=6 => assert_eq!(d.insert(id, step), m.insert(id, step)),
                7..=11 => assert_eq!(d.remove(&id), m.remove(&id)),
                12 | 13 => {
                    let odd = |v: &mut u64| {
                        *v += 2;
                        *v % 4 < 2
                    };
                    let take = m.get_mut(&id).is_some_and(odd);
                    let want = if take { m.remove(&id) } else { None };
                    assert_eq!(d.take_if(id, odd), want);
                }
                _ => {
                    let nth = d
                        .iter_placed()
                        .nth((x % 7) as usize)
                        .map(|(p, at, _)| (p, *at));
                    if let Some((place, at)) = nth {
                        *d.get_at_mut(place, at).unwrap() += 1;
                        *m.get_mut(&at).unwrap() += 1;
                    }
                    // A stale place finds the record by id, or nothing.
                    assert_eq!(d.get_at_mut(0, id).copied(), m.get(&id).copied());
                }
            }
            assert_eq!(d.len(), m.len());
            for (id, v) in &m {
                assert_eq!(d.get(id), Some(v));
            }
            for (i, (id, _)) in d.all.iter().enumerate() {
                assert_eq!(d.at[id], i);
            }
            assert_eq!(d.at.len(), d.all.len());
        }
    }
}
