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

/// The userdata of a fiber object: its id.
#[repr(C)]
pub(super) struct FiberUd {
    pub(super) fid: FiberId,
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
// (`push_fiber_object`) and by `spawn_lua`, which writes the block before setting it.
unsafe impl UdBlock for FiberUd {
    type Handle = FiberId;
    fn metatable() -> Option<(c_int, usize)> {
        metatable(0)
    }
    fn handle(&self) -> Option<FiberId> {
        Some(self.fid)
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
/// and `fiber.new` give a new fiber an object made ahead, see [`take_ready_object`], with
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
        p.new_ud(FiberUd { fid });
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

/// How many fiber objects one refill of the ready objects makes.
const READY_BATCH: usize = 32;

/// Pushes onto `l` a fiber object made ahead, and returns its slot in the host's object
/// table (`objs`, a registry reference), where it stays, and its block (id 0: the caller
/// writes the fiber's id before Lua can see the object). When none is left, a batch is made
/// first, in one protected call ([`refill_ready`]): making an object allocates, which can
/// raise, and a protected call per object was a tenth of a `fiber.create`. A slot given back
/// unused (the fiber could not be made) goes to `obj_ready` again, its object unchanged.
///
/// # Safety
/// `l` is a running Lua thread of this thread's host; `objs` and `mt` are the host's object
/// table and fiber metatable references.
pub(super) unsafe fn take_ready_object(
    l: *mut ffi::lua_State,
    objs: c_int,
    mt: c_int,
) -> Result<(c_int, *mut FiberUd), LErr> {
    // SAFETY: per the contract; lua_checkstack never raises.
    if unsafe { ffi::lua_checkstack(l, 2) } == 0 {
        return Err(LErr::plain("stack overflow"));
    }
    let slot = match with_host(|h| h.obj_ready.pop()).ok_or_else(no_host)? {
        Some(slot) => slot,
        // SAFETY: per the contract.
        None => unsafe { refill_ready(l, objs, mt) }?,
    };
    // SAFETY: room for two values (above); raw reads of the registry and of the object
    // table, which allocate nothing; the slot holds a fiber object made by `refill_ready`
    // (slots in `obj_ready` are cleared by nothing else), whose block is a `FiberUd`.
    unsafe {
        super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
        super::raw::rawgeti(l, -1, slot as ffi::lua_Integer);
        ffi::lua_remove(l, -2);
        let ud = ffi::lua_touserdata(l, -1).cast::<FiberUd>();
        debug_assert!(!ud.is_null() && (*ud).fid == 0);
        Ok((slot, ud))
    }
}

/// Makes up to [`READY_BATCH`] fiber objects (id 0, the fiber metatable) into free slots of
/// the object table in one protected call, keeps all but one in `obj_ready`, and returns that
/// one's slot. When an allocation fails part way, the objects made so far are kept (the
/// error is dropped) and the slots not filled go back to `obj_free`; when none was made, the
/// error is returned, its value left on top of `l` (as [`super::raw::protect`] leaves it).
///
/// # Safety
/// As [`take_ready_object`].
unsafe fn refill_ready(l: *mut ffi::lua_State, objs: c_int, mt: c_int) -> Result<c_int, LErr> {
    let slots: Vec<c_int> = with_host(|h| {
        (0..READY_BATCH)
            .map(|_| {
                h.obj_free.pop().unwrap_or_else(|| {
                    h.obj_next += 1;
                    h.obj_next
                })
            })
            .collect()
    })
    .ok_or_else(no_host)?;
    let mut made = 0;
    // SAFETY: per the contract; each userdata's block is written before its metatable is
    // set, then it is stored (popped) into its slot of the object table; an error part way
    // leaves `made` counting the objects stored.
    let res = unsafe {
        super::raw::protect(l, &[], &mut |l| {
            super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
            for &slot in &slots {
                let ud = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
                ud.write(FiberUd { fid: 0 });
                super::raw::rawgeti(l, REG, mt as ffi::lua_Integer);
                ffi::lua_setmetatable(l, -2);
                super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
                made += 1;
            }
            ffi::lua_settop(l, -2);
            0
        })
    };
    if let Err(e) = res {
        if made == 0 {
            with_host(|h| h.obj_free.extend_from_slice(&slots));
            return Err(e);
        }
        // SAFETY: the failed call left its error value on top of `l`.
        unsafe { ffi::lua_settop(l, -2) };
    }
    with_host(|h| {
        h.obj_free.extend_from_slice(&slots[made..]);
        // Taken from the back: the first slot made goes first.
        h.obj_ready.extend(slots[1..made].iter().rev());
    })
    .ok_or_else(no_host)?;
    Ok(slots[0])
}

/// Removes a fiber's record, freeing its object's slot and storage (the thread is the
/// caller's).
pub(super) fn remove_rec(h: &mut HostState, fid: FiberId) -> Option<LuaFiber> {
    let mut rec = h.recs.remove(&fid)?;
    free_obj_slot(h, &rec);
    release_storage(h, &mut rec);
    Some(rec)
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
