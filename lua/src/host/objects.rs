//! The fiber objects Lua sees (a userdata holding a fiber id, kept one per fiber in a
//! registry table) and how a fiber is found from one, as Tarantool's `fiber_find`: a fiber is
//! found while its function runs, and also, once it has ended, while it is joinable and not
//! joined yet ("ended": its status reads `suspended`, `cancel` and `wakeup` do nothing, as in
//! Tarantool); a fiber found by no record is dead. Invariants of the records: a record is
//! removed exactly once (by the end of a non-joinable fiber's function, by its join, or by
//! making an ended fiber unjoinable), and whoever removes it releases its object slot,
//! storage and thread.

use std::ffi::c_int;

use fibertrace_fiber::FiberId;
use mlua::ffi;

use super::call::{Call, UdBlock};
use super::raw::LErr;
use super::{with_host, HostState, LuaFiber};

pub(crate) const REG: c_int = ffi::LUA_REGISTRYINDEX;
/// Longest fiber name with its terminating NUL, as Tarantool's `FIBER_NAME_MAX`.
pub(super) const NAME_MAX: usize = 256;
/// Finished Lua threads kept for reuse.
pub(super) const POOL_MAX: usize = 4096;

/// Stack slot of a fiber's Lua thread holding the message handler of its `lua_pcall`.
pub(super) const MSGH_SLOT: c_int = 1;

/// The userdata of a fiber object: its id, with the fiber tag in the top byte (one word: a
/// second word for the tag made each object a size class larger in LuaJIT's allocator, ~12
/// ns a `fiber.create`). How it can be wrong: an id past 2^56 would be read as another (ids
/// are counted from 1; at this machine's fastest create, ~2.5 million a second, that is nine
/// centuries away).
#[repr(C)]
pub(super) struct FiberUd {
    word: u64,
}

/// The top byte of a fiber block's word (see [`UdBlock`]: no address has it, and the other
/// blocks' tags start with 0xF1).
const FIBER_TAG: u64 = 0xFB << 56;
const FID_MASK: u64 = (1 << 56) - 1;

impl FiberUd {
    /// The block of fiber `fid`'s object.
    pub(super) fn new(fid: FiberId) -> Self {
        debug_assert!(fid <= FID_MASK);
        FiberUd {
            word: FIBER_TAG | (fid & FID_MASK),
        }
    }

    /// The fiber's id.
    pub(super) fn fid(&self) -> FiberId {
        self.word & FID_MASK
    }
}

pub(crate) fn no_host() -> LErr {
    LErr::plain("fibertrace: no Lua host on this thread")
}

/// The registry reference and the identity of the host's metatable `i` (0: fiber, 1:
/// channel, 2: condition), for [`UdBlock::metatable`].
pub(crate) fn metatable(i: usize) -> Option<(c_int, usize)> {
    with_host(|h| {
        let r = [h.fiber_mt_ref, h.channel_mt_ref, h.cond_mt_ref][i];
        (r, h.mt_tables[i])
    })
}

// SAFETY: the fiber metatable is set only on blocks written first: by `Protected::new_ud`
// (`push_fiber_object`) and by `refill_ready` (in spawn.rs), which writes the block before
// setting it. The block is `repr(C)`, one word made only by `FiberUd::new`, whose top byte is
// the tag: no address and no other block type's tag starts with 0xFB.
unsafe impl UdBlock for FiberUd {
    fn is_tag(word: u64) -> bool {
        word & !FID_MASK == FIBER_TAG
    }
    type Handle = FiberId;
    fn metatable() -> Option<(c_int, usize)> {
        metatable(0)
    }
    fn handle(&self) -> Option<FiberId> {
        Some(self.fid())
    }
    fn release(&mut self) {}
}

/// The id of the fiber object at `idx`, if it is one.
pub(super) fn fiber_ud(c: &Call, idx: c_int) -> Option<FiberId> {
    c.ud::<FiberUd>(idx).flatten()
}

/// The fiber object at `idx` (`luaL_checkudata`): its id, or the bad-argument error.
pub(super) fn check_fiber_id(c: &Call, idx: c_int) -> Result<FiberId, LErr> {
    fiber_ud(c, idx).ok_or_else(|| c.type_error(idx, "fiber"))
}

/// A fiber id from a number: truncated, as Tarantool converts it (`None`: no fiber's id).
pub(super) fn id_of_number(n: f64) -> Option<FiberId> {
    (0.0..18_446_744_073_709_551_616.0)
        .contains(&n)
        .then_some(n as FiberId)
}

/// How a fiber is found (see the module docs).
#[derive(Clone)]
pub(super) enum Found {
    /// Its function runs (or has not started yet).
    Live(fibertrace_fiber::Fiber),
    /// Its function ended; joinable, not joined yet.
    Ended,
}

pub(super) fn find(fid: FiberId) -> Option<Found> {
    with_host(|h| {
        let r = h.recs.get(&fid)?;
        if r.done.is_some() {
            Some(Found::Ended)
        } else if r.fiber.control_block().is_dead() {
            // Cancelled before it started: kept for its joiner only.
            None
        } else {
            Some(Found::Live(r.fiber.clone()))
        }
    })
    .flatten()
}

/// The fiber at `idx`, a fiber object or an id (Tarantool's `lbox_checkfiber`): found, or
/// `the fiber is dead` (with the caller's position when `at`); anything else is a bad
/// argument.
pub(super) fn check_fiber(c: &Call, idx: c_int, at: bool) -> Result<(FiberId, Found), LErr> {
    let fid = if c.type_of(idx) == ffi::LUA_TNUMBER {
        c.to_number(idx).and_then(id_of_number)
    } else {
        Some(check_fiber_id(c, idx)?)
    };
    match fid.and_then(|f| find(f).map(|x| (f, x))) {
        Some(found) => Ok(found),
        None if at => Err(LErr::At("the fiber is dead".into())),
        None => Err(LErr::plain("the fiber is dead")),
    }
}

/// Pushes the fiber object of `fid`: the same object every time while the fiber lives.
///
/// A live fiber's object is held in the array part of one host table, at a slot kept in
/// the fiber's record and freed (for the next fiber) when the record goes. So it lives as
/// long as the fiber, and making one costs an array store, not an insert into a growing
/// hash (a weak table by id) or a registry reference. A fiber without a record (a fiber made
/// by Rust code that calls into Lua) keeps its object in a weak table by id. (`fiber.create`
/// and `fiber.new` give a new fiber an object made ahead, see `spawn::take_ready_object`, with
/// its record, in `spawn_lua`.)
pub(super) fn push_fiber_object(c: &mut Call, fid: FiberId) -> Result<(), LErr> {
    let (known, objs, weak) = with_host(|h| {
        (
            h.recs.get(&fid).map(|r| r.obj_slot),
            h.objs_ref,
            h.weak_objs_ref,
        )
    })
    .ok_or_else(no_host)?;
    match known {
        Some(slot) if slot > 0 => {
            c.push_ref_index(objs, slot as i64)?;
            return Ok(());
        }
        None => {
            c.push_ref_index(weak, fid as i64)?;
            if c.type_of(-1) == ffi::LUA_TUSERDATA {
                return Ok(());
            }
            c.pop(1);
        }
        _ => {}
    }
    // The object is made in a protected call: its allocations can fail.
    let slot = if known.is_some() {
        with_host(|h| {
            h.obj_free.pop().unwrap_or_else(|| {
                h.obj_next += 1;
                h.obj_next
            })
        })
        .ok_or_else(no_host)?
    } else {
        0
    };
    // A fresh userdata with the fiber metatable, stored in the host's object table (at the
    // slot taken above) or in its weak table; left on top.
    let made = c.protected(&[], |p| {
        p.new_ud(FiberUd::new(fid));
        if slot > 0 {
            p.push_ref(objs);
            p.push_value(-2);
            p.set_index(-2, slot as i64);
        } else {
            p.push_ref(weak);
            p.push_value(-2);
            p.set_index(-2, fid as i64);
        }
        p.truncate(p.top() - 1);
        1
    });
    match made {
        Ok(_) if slot > 0 => {
            with_host(|h| match h.recs.get_mut(&fid) {
                Some(rec) => rec.obj_slot = slot,
                None => h.obj_free.push(slot),
            });
        }
        Ok(_) => {}
        Err(e) => {
            if slot > 0 {
                with_host(|h| h.obj_free.push(slot));
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Removes a fiber's record, freeing its object's slot and storage (the thread is the
/// caller's). Joins still waiting for the fiber are told `why` when they wake.
pub(super) fn remove_rec(h: &mut HostState, fid: FiberId, why: &'static str) -> Option<LuaFiber> {
    let mut rec = h.recs.remove(&fid)?;
    note_lost_joins(h, fid, &rec, why);
    free_obj_slot(h, &rec);
    release_storage(h, &mut rec);
    Some(rec)
}

/// What a join that waited is told when another join took the fiber's results first.
pub(super) const JOINED_BY_ANOTHER: &str = "the fiber is already joined by concurrent fiber:join()";
/// ... when the fiber was made non-joinable while it waited (it was released at its end).
pub(super) const UNJOINABLE_WAITED: &str =
    "the fiber was made non-joinable while it was being joined";
/// ... when the fiber was the main one: its end is the script's, its results are not kept.
pub(super) const MAIN_ENDED: &str =
    "the main fiber ended: its results are the script's, not kept for a join";

/// Leaves word for the joins still waiting for a fiber whose record was just removed.
#[inline]
pub(super) fn note_lost_joins(h: &mut HostState, fid: FiberId, rec: &LuaFiber, why: &'static str) {
    if rec.joiners > 0 {
        // (Ids are never reused: the entry is theirs until each has woken.)
        h.lost_joins.insert(fid, (rec.joiners, why));
    }
}

/// Frees the object slot of a record just removed, for the next fiber's object. The slot is
/// cleared at once: a dead fiber's object must not stay reachable (a weak table keyed by
/// fiber objects would keep its entry).
pub(super) fn free_obj_slot(h: &mut HostState, rec: &LuaFiber) {
    if rec.obj_slot > 0 {
        h.clear_index(h.objs_ref, rec.obj_slot as ffi::lua_Integer);
        h.obj_free.push(rec.obj_slot);
    }
}

/// Drops a fiber's `storage` table (when its function ends, as Tarantool's `on_stop`).
pub(super) fn release_storage(h: &HostState, rec: &mut LuaFiber) {
    if rec.storage_ref > 0 {
        h.unref(rec.storage_ref);
        rec.storage_ref = 0;
    }
}

/// Raises `fiber is cancelled` if the current fiber was cancelled (Tarantool raises it as an
/// error object, so without a position).
pub(crate) fn cancelled_check() -> Result<(), LErr> {
    if fibertrace_fiber::is_cancelled() {
        Err(LErr::plain("fiber is cancelled"))
    } else {
        Ok(())
    }
}
