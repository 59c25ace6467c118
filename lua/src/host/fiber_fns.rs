//! The `fiber` functions and methods: switching, identity, names, status, storage,
//! cancel, wake-up, join, info and top.

use std::ffi::c_int;
use std::time::Instant;

use fibertrace_fiber::FiberId;
use mlua::ffi;

use super::objects::*;
use super::raw::lua_fn;
use super::raw::{self, push_str, to_number, type_of, LErr, LResult};
use super::spawn::*;
use super::with_host;

// ---- switching ----

pub(super) unsafe fn yield_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { super::finalize::check_switch(l, "fiber.yield") }?;
    fibertrace_fiber::yield_now();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_yield, yield_body);

/// `fiber.sleep(delay)`: exactly one argument, a number or numeric string; zero or less
/// yields; NaN or a billion seconds or more sleeps until woken (Tarantool's timer never
/// fires for NaN either).
pub(super) unsafe fn sleep_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let s = unsafe {
        if ffi::lua_gettop(l) != 1 {
            None
        } else {
            to_number(l, 1)
        }
    }
    .ok_or("fiber.sleep(delay): bad arguments")?;
    // SAFETY: C function contract.
    unsafe { super::finalize::check_switch(l, "fiber.sleep") }?;
    if s <= 0.0 {
        fibertrace_fiber::yield_now();
    } else {
        match raw::seconds(s) {
            Some(d) => fibertrace_fiber::sleep(d),
            None => fibertrace_fiber::suspend(),
        }
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_sleep, sleep_body);

pub(super) unsafe fn testcancel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 0 {
        return Err("fiber.testcancel(): bad arguments".into());
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_testcancel, testcancel_body);

/// The hidden `stall` of the task worker (Tarantool's): waits for a wakeup, outside the
/// timers.
pub(super) unsafe fn stall_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { super::finalize::check_switch(l, "fiber.stall") }?;
    fibertrace_fiber::suspend();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_stall, stall_body);

/// The hidden setter of compat's `fiber_channel_close_mode` (true: graceful).
pub(super) unsafe fn set_close_mode_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let graceful = unsafe { ffi::lua_toboolean(l, 1) } != 0;
    with_host(|h| h.graceful_close = graceful);
    Ok(0)
}
lua_fn!(f_set_close_mode, set_close_mode_body);

// ---- identity, names, status ----

pub(super) unsafe fn self_body(l: *mut ffi::lua_State) -> LResult {
    let fid = fibertrace_fiber::current_id();
    if fid == 0 {
        return Err("fiber.self(): not in a fiber".into());
    }
    // SAFETY: C function contract.
    unsafe { push_fiber_object(l, fid) }?;
    Ok(1)
}
lua_fn!(f_self, self_body);

/// `fiber.id([fiber])` and `fiber_object:id()`: no argument is the current fiber (so
/// `fiber.self().id()` too); otherwise a fiber object (of a dead fiber too).
pub(super) unsafe fn id_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe {
        if ffi::lua_gettop(l) == 0 {
            fibertrace_fiber::current_id()
        } else {
            check_fiber_id(l, 1)?
        }
    };
    // SAFETY: as above.
    unsafe { ffi::lua_pushinteger(l, fid as ffi::lua_Integer) };
    Ok(1)
}
lua_fn!(f_id, id_body);

/// `fiber.find(id)`: exactly one argument; a number or numeric string (truncated) names a
/// fiber; anything else names none.
pub(super) unsafe fn find_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 1 {
        return Err("fiber.find(id): bad arguments".into());
    }
    // SAFETY: as above.
    let fid = unsafe { to_number(l, 1) }.and_then(id_of_number);
    match fid.filter(|&f| find(f).is_some()) {
        // SAFETY: as above.
        Some(fid) => unsafe { push_fiber_object(l, fid) }?,
        // SAFETY: as above.
        None => unsafe { ffi::lua_pushnil(l) },
    }
    Ok(1)
}
lua_fn!(f_find, find_body);

/// Tarantool's status words: running, suspended (an ended fiber not joined yet too), dead.
pub(crate) fn status_word(fid: FiberId) -> &'static str {
    match find(fid) {
        None => "dead",
        Some(Found::Live(_)) if fid == fibertrace_fiber::current_id() => "running",
        Some(_) => "suspended",
    }
}

/// `fiber.status([fiber])`: no argument is the current fiber; otherwise a fiber object.
pub(super) unsafe fn status_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe {
        if ffi::lua_gettop(l) == 0 {
            fibertrace_fiber::current_id()
        } else {
            check_fiber_id(l, 1)?
        }
    };
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, status_word(fid)) }?;
    Ok(1)
}
lua_fn!(f_status, status_body);

/// The record's fiber handle of a found fiber, for name reads and writes (an ended fiber
/// keeps its control block in the record).
pub(super) fn rec_fiber(fid: FiberId) -> Option<fibertrace_fiber::Fiber> {
    with_host(|h| h.recs.get(&fid).map(|r| r.fiber.clone())).flatten()
}

/// `fiber.name([fiber,] [name [, {truncate = true}]])` and `fiber_object:name(...)`, as
/// Tarantool 2.6: a fiber object first names the fiber; then one or two more arguments set
/// the name (a string or a number; too long raises unless `truncate`; cut at a NUL byte),
/// and any other count reads it.
pub(super) unsafe fn name_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all reads below).
    let (fid, name_at) = unsafe {
        if type_of(l, 1) == ffi::LUA_TUSERDATA {
            (check_fiber(l, 1, true)?.0, 2)
        } else {
            (fibertrace_fiber::current_id(), 1)
        }
    };
    let f = rec_fiber(fid).ok_or("the fiber is dead")?;
    // SAFETY: as above.
    let top = unsafe { ffi::lua_gettop(l) };
    if top != name_at && top != name_at + 1 {
        // SAFETY: as above.
        unsafe { raw::push_str_p(l, &f.control_block().name_arc()) }?;
        return Ok(1);
    }
    // SAFETY: as above.
    let t = unsafe { type_of(l, name_at) };
    if t != ffi::LUA_TSTRING && t != ffi::LUA_TNUMBER {
        // SAFETY: as above.
        return Err(unsafe { raw::type_error(l, name_at, "string") });
    }
    // The name's bytes as they are (Tarantool's), cut at a NUL byte.
    // (A number is written as Lua writes it, without converting it in place: no allocation.)
    let mut len = 0usize;
    // SAFETY: as above; a string's bytes, copied before any other Lua call.
    let mut name = unsafe {
        if t == ffi::LUA_TNUMBER {
            raw::error_text(l, name_at).into_bytes()
        } else {
            let p = ffi::lua_tolstring(l, name_at, &mut len);
            std::slice::from_raw_parts(p.cast::<u8>(), len).to_vec()
        }
    };
    if let Some(nul) = name.iter().position(|&b| b == 0) {
        name.truncate(nul);
    }
    if name.len() + 1 > NAME_MAX {
        // SAFETY: as above; a raw read of a field of the options table (its key made in a
        // protected call).
        let truncate = unsafe {
            if top == name_at + 1 && ffi::lua_type(l, top) == ffi::LUA_TTABLE {
                raw::push_str_p(l, "truncate")?;
                ffi::lua_rawget(l, top);
                let b = ffi::lua_type(l, -1) == ffi::LUA_TBOOLEAN && ffi::lua_toboolean(l, -1) != 0;
                ffi::lua_settop(l, -2);
                b
            } else {
                false
            }
        };
        if !truncate {
            return Err("Fiber name is too long".into());
        }
        // Cut at the byte, as Tarantool does (a character may be cut: the bytes are kept).
        name.truncate(NAME_MAX - 1);
    }
    f.set_name_bytes(&name);
    Ok(0)
}
lua_fn!(f_name, name_body);

/// `tostring(fiber_object)`: `fiber: N`, with ` (dead)` once it is not found.
pub(super) unsafe fn tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { check_fiber_id(l, 1) }?;
    let dead = if find(fid).is_none() { " (dead)" } else { "" };
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, &format!("fiber: {fid}{dead}")) }?;
    Ok(1)
}
lua_fn!(m_tostring, tostring_body);

/// `fiber_object:__serialize()`: `{id, name, status}`, or `{id, status = 'dead'}` for a
/// fiber no longer found.
pub(super) unsafe fn serialize_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { check_fiber_id(l, 1) }?;
    let name = find(fid)
        .and_then(|_| rec_fiber(fid))
        .map(|f| f.control_block().name_arc());
    let status = status_word(fid);
    // SAFETY: as above; a fresh table, made in a protected call.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            ffi::lua_createtable(l, 0, 3);
            ffi::lua_pushinteger(l, fid as ffi::lua_Integer);
            ffi::lua_setfield(l, -2, c"id".as_ptr());
            if let Some(name) = &name {
                push_str(l, name);
                ffi::lua_setfield(l, -2, c"name".as_ptr());
            }
            push_str(l, status);
            ffi::lua_setfield(l, -2, c"status".as_ptr());
            1
        })
    }?;
    Ok(1)
}
lua_fn!(m_serialize, serialize_body);

/// The context switches of a fiber as Tarantool counts them: switches away from it (its
/// yields, and its starts of other fibers). The runtime counts switches into it, one more
/// while it runs.
pub(crate) fn lua_csw(f: &fibertrace_fiber::Fiber) -> u64 {
    let n = f.control_block().csw();
    n.saturating_sub((f.id() == fibertrace_fiber::current_id()) as u64)
}

/// A live fiber of `fiber_object:info()`/`csw()` (`the fiber is dead` without position, as
/// those functions raise since Tarantool 2.10): no argument is the current fiber.
///
/// # Safety
/// `l` is the calling state of a C function.
pub(super) unsafe fn live_arg(l: *mut ffi::lua_State) -> Result<fibertrace_fiber::Fiber, LErr> {
    // SAFETY: per the contract.
    let fid = unsafe {
        if ffi::lua_gettop(l) == 0 {
            fibertrace_fiber::current_id()
        } else {
            check_fiber_id(l, 1)?
        }
    };
    match find(fid) {
        Some(Found::Live(f)) => Ok(f),
        _ => Err(LErr::plain("the fiber is dead")),
    }
}

pub(super) unsafe fn csw_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let f = unsafe { live_arg(l) }?;
    // SAFETY: as above.
    unsafe { ffi::lua_pushinteger(l, lua_csw(&f) as ffi::lua_Integer) };
    Ok(1)
}
lua_fn!(m_csw, csw_body);

// ---- storage and the fiber object's index ----

/// `fiber_object.storage`: the fiber's table, made on first use (from any fiber), dropped
/// when its function ends.
///
/// # Safety
/// `l` is the calling state of a C function; the object at index 1.
pub(super) unsafe fn push_storage(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: per the contract.
    let (fid, found) = unsafe { check_fiber(l, 1, true) }?;
    if !matches!(found, Found::Live(_)) {
        return Err("the fiber is dead".into());
    }
    let r = with_host(|h| h.recs.get(&fid).map(|r| r.storage_ref))
        .flatten()
        .unwrap_or(0);
    // SAFETY: per the contract; a registry reference of this host.
    unsafe {
        if r > 0 {
            super::raw::rawgeti(l, REG, r as ffi::lua_Integer);
        } else {
            let mut r = 0;
            raw::protect(l, &[], &mut |l| {
                ffi::lua_createtable(l, 0, 0);
                ffi::lua_pushvalue(l, -1);
                r = ffi::luaL_ref(l, REG);
                1
            })?;
            with_host(|h| {
                if let Some(rec) = h.recs.get_mut(&fid) {
                    rec.storage_ref = r;
                }
            });
        }
    }
    Ok(1)
}

/// `__index` of fiber objects: `storage`, or a method (the methods table is the upvalue).
pub(super) unsafe fn index_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe {
        if ffi::lua_gettop(l) < 2 {
            return Ok(0);
        }
        if ffi::lua_type(l, 2) == ffi::LUA_TSTRING {
            let mut len = 0usize;
            let p = ffi::lua_tolstring(l, 2, &mut len);
            if std::slice::from_raw_parts(p.cast::<u8>(), len) == b"storage" {
                return push_storage(l);
            }
        }
        ffi::lua_pushvalue(l, 2);
        ffi::lua_rawget(l, ffi::lua_upvalueindex(1));
    }
    Ok(1)
}
lua_fn!(f_index, index_body);

// ---- cancel, wakeup, join ----

/// `fiber.cancel(f)` / `fiber.kill(f)` / `f:cancel()`: a fiber object or id; an ended fiber
/// is left as it is; then the caller's own cancellation is raised (so cancelling oneself
/// raises at once).
pub(super) unsafe fn cancel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let (_, found) = unsafe { check_fiber(l, 1, true) }?;
    if let Found::Live(f) = found {
        f.cancel();
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_cancel, cancel_body);

pub(super) unsafe fn wakeup_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let (fid, found) = unsafe { check_fiber(l, 1, true) }?;
    if let Found::Live(f) = found {
        if fid != fibertrace_fiber::current_id() {
            f.wakeup();
        }
    }
    Ok(0)
}
lua_fn!(f_wakeup, wakeup_body);

/// `fiber.set_joinable(f, yesno)`: exactly two arguments. Making an ended fiber unjoinable
/// releases it (nobody may join it any more).
pub(super) unsafe fn set_joinable_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 2 {
        return Err("fiber.set_joinable(id, yesno): bad arguments".into());
    }
    // SAFETY: as above.
    let (fid, found) = unsafe { check_fiber(l, 1, true) }?;
    // SAFETY: as above.
    let on = unsafe { ffi::lua_toboolean(l, 2) } != 0;
    with_host(|h| match found {
        Found::Live(_) => {
            if let Some(r) = h.recs.get_mut(&fid) {
                r.joinable = on;
            }
        }
        Found::Ended if !on => {
            if let Some(rec) = remove_rec(h, fid) {
                release_thread(h, rec.thread, rec.thread_ref);
            }
        }
        Found::Ended => {}
    })
    .ok_or_else(no_host)?;
    Ok(0)
}
lua_fn!(f_set_joinable, set_joinable_body);

/// Replaces the value on top with an error object (see [`super::prelude`]) of `etype` made
/// from it; if it cannot be made (a `__tostring` that fails), the value stays as it is; out
/// of memory is the error.
///
/// # Safety
/// `l` is the calling state of a C function, with a value on top.
pub(super) unsafe fn to_error_object(l: *mut ffi::lua_State, etype: &str) -> Result<(), LErr> {
    let ctor = with_host(|h| h.error_ctor_ref).unwrap_or(ffi::LUA_REFNIL);
    // SAFETY: per the contract; the constructor is a Lua function of this host, called
    // protected (it only allocates and calls `tostring`), in a protected call (the type's
    // name is a new string) that gets the value as its argument.
    unsafe {
        raw::protect(l, &[-1], &mut |l| {
            super::raw::rawgeti(l, REG, ctor as ffi::lua_Integer);
            push_str(l, etype);
            ffi::lua_pushvalue(l, 1);
            if ffi::lua_pcall(l, 2, 1, 0) != ffi::LUA_OK {
                // Out of memory, or a `__tostring` that failed: the value as it is.
                ffi::lua_settop(l, 1);
            }
            1
        })?;
        ffi::lua_replace(l, -2);
    }
    Ok(())
}

/// Pushes an error object of `etype` with the message `msg`.
///
/// # Safety
/// As [`to_error_object`], without the value.
pub(super) unsafe fn error_object(
    l: *mut ffi::lua_State,
    msg: &str,
    etype: &str,
) -> Result<(), LErr> {
    // SAFETY: per the contract.
    unsafe {
        raw::push_str_p(l, msg)?;
        to_error_object(l, etype)
    }
}

/// `fiber.join(f [, timeout])` / `f:join([timeout])`: waits for a joinable fiber; returns
/// `true, results...`, or `false, error object` (its error, `fiber is cancelled`, or `timed
/// out` when the timeout passed). Checks, in Tarantool's order: found (`the fiber is dead`),
/// joinable, not itself, the timeout; a fiber another joiner took while this one waited is
/// an error.
pub(super) unsafe fn join_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe {
        if type_of(l, 1) == ffi::LUA_TNUMBER {
            to_number(l, 1).and_then(id_of_number)
        } else {
            Some(check_fiber_id(l, 1)?)
        }
    };
    let rec = fid.and_then(|fid| {
        with_host(|h| h.recs.get(&fid).map(|r| (r.joinable, r.fiber.clone()))).flatten()
    });
    let (Some(fid), Some((joinable, fiber))) = (fid, rec) else {
        return Err("the fiber is dead".into());
    };
    if !joinable {
        return Err("the fiber is not joinable".into());
    }
    if fid == fibertrace_fiber::current_id() {
        return Err(LErr::plain("cannot join itself"));
    }
    // SAFETY: as above.
    let timeout = unsafe {
        match type_of(l, 2) {
            t if t <= ffi::LUA_TNIL => None,
            _ => match to_number(l, 2) {
                Some(s) if s.is_nan() || s >= 0.0 => raw::seconds(s),
                _ => return Err(LErr::plain("fiber:join(timeout): bad arguments")),
            },
        }
    };
    let waits = !fiber.control_block().is_dead() && timeout != Some(std::time::Duration::ZERO);
    // SAFETY: C function contract.
    unsafe { super::finalize::check_wait(l, "fiber:join", waits) }?;
    let deadline = timeout.and_then(|d| Instant::now().checked_add(d));
    // A cancellation of this fiber does not end the wait (Tarantool's join).
    if !fiber.wait_until_ignoring_cancel(deadline) {
        // SAFETY: as above.
        unsafe {
            ffi::lua_pushboolean(l, 0);
            error_object(l, "timed out", "TimedOut")?;
        }
        return Ok(2);
    }
    let Some(rec) = with_host(|h| remove_rec(h, fid)).flatten() else {
        return Err(LErr::plain(
            "the fiber is already joined by concurrent fiber:join()",
        ));
    };
    let t = rec.thread;
    let cancelled = rec.fiber.control_block().is_cancelled();
    // SAFETY: the joined fiber is dead; its thread holds [handler, results...] or
    // [handler, error]; they move to `l`.
    let n = unsafe {
        match rec.done {
            Some(true) => {
                let n = (ffi::lua_gettop(t) - MSGH_SLOT).max(0);
                if ffi::lua_checkstack(l, n + 1) == 0 {
                    Err(LErr::plain(format!(
                        "fiber:join: too many results ({n}) for the joiner's Lua stack"
                    )))
                } else {
                    ffi::lua_pushboolean(l, 1);
                    ffi::lua_xmove(t, l, n);
                    Ok(n + 1)
                }
            }
            Some(false) => {
                ffi::lua_pushboolean(l, 0);
                ffi::lua_xmove(t, l, 1);
                let is_cancel = cancelled && {
                    let mut len = 0usize;
                    let p = ffi::lua_tolstring(l, -1, &mut len);
                    ffi::lua_type(l, -1) == ffi::LUA_TSTRING
                        && std::slice::from_raw_parts(p.cast::<u8>(), len) == b"fiber is cancelled"
                };
                to_error_object(
                    l,
                    if is_cancel {
                        "FiberIsCancelled"
                    } else {
                        "LuajitError"
                    },
                )
                .map(|()| 2)
            }
            // No outcome: it was cancelled before its function could start.
            None => {
                ffi::lua_pushboolean(l, 0);
                error_object(l, "fiber is cancelled", "FiberIsCancelled").map(|()| 2)
            }
        }
    };
    with_host(|h| release_thread(h, t, rec.thread_ref));
    n
}
lua_fn!(f_join, join_body);

// ---- info, top ----

pub(super) unsafe fn info_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let opts = unsafe { super::info::read_opts(l, 1) };
    // SAFETY: as above.
    unsafe { super::info::push_all(l, &opts) }?;
    let mt = with_host(|h| h.info_mt_ref).ok_or_else(no_host)?;
    // SAFETY: as above; the shared `{__serialize = 'mapping'}` of this host.
    unsafe {
        super::raw::rawgeti(l, REG, mt as ffi::lua_Integer);
        ffi::lua_setmetatable(l, -2);
    }
    Ok(1)
}
lua_fn!(f_info, info_body);

/// `fiber_object:info([opts])`: no argument is the current fiber.
pub(super) unsafe fn m_info_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let f = unsafe { live_arg(l) }?;
    // SAFETY: as above.
    let opts = unsafe { super::info::read_opts(l, 2) };
    // SAFETY: as above.
    unsafe { super::info::push_one(l, f.id(), &opts) }?;
    Ok(1)
}
lua_fn!(m_info, m_info_body);

/// Pushes one `fiber.top()` row.
///
/// # Safety
/// `l` valid, room for 3 values.
pub(super) unsafe fn push_top_row(l: *mut ffi::lua_State, row: &fibertrace_fiber::embed::TopRow) {
    // SAFETY: a fresh table; plain sets.
    unsafe {
        ffi::lua_createtable(l, 0, 3);
        ffi::lua_pushnumber(l, row.average);
        ffi::lua_setfield(l, -2, c"average".as_ptr());
        ffi::lua_pushnumber(l, row.instant);
        ffi::lua_setfield(l, -2, c"instant".as_ptr());
        ffi::lua_pushnumber(l, row.time.as_secs_f64());
        ffi::lua_setfield(l, -2, c"time".as_ptr());
    }
}

/// `fiber.top()`: `{cpu_misses = 0, cpu = {["1/sched"] = row, ["id/name"] = row, ...}}` for
/// the scheduler and every live Lua fiber; an error while it is off.
pub(super) unsafe fn top_body(l: *mut ffi::lua_State) -> LResult {
    if !fibertrace_fiber::embed::top_enabled() {
        return Err("fiber.top() is disabled. Enable it with fiber.top_enable() first".into());
    }
    let fibers: Vec<(FiberId, std::sync::Arc<str>)> = with_host(|h| {
        h.recs
            .values()
            .filter(|r| r.done.is_none() && !r.fiber.control_block().is_dead())
            .map(|r| (r.fiber.id(), r.fiber.control_block().name_arc()))
            .collect()
    })
    .ok_or_else(no_host)?;
    // SAFETY: C function contract; fresh tables, made in a protected call.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            top_table(l, &fibers);
            1
        })
    }?;
    Ok(1)
}
lua_fn!(f_top, top_body);

/// Pushes `fiber.top()`'s table for `fibers`.
///
/// # Safety
/// `l` valid, room for 4 values; allocates (call it protected).
pub(super) unsafe fn top_table(l: *mut ffi::lua_State, fibers: &[(FiberId, std::sync::Arc<str>)]) {
    // SAFETY: per the contract; fresh tables.
    unsafe {
        ffi::lua_createtable(l, 0, 2);
        ffi::lua_pushnumber(l, 0.0);
        ffi::lua_setfield(l, -2, c"cpu_misses".as_ptr());
        ffi::lua_createtable(l, 0, fibers.len() as c_int + 1);
        if let Some(row) = fibertrace_fiber::embed::top_sched_row() {
            push_top_row(l, &row);
            ffi::lua_setfield(l, -2, c"1/sched".as_ptr());
        }
        for (fid, name) in fibers {
            if let Some(row) = fibertrace_fiber::embed::top_fiber_row(*fid) {
                push_str(l, &format!("{fid}/"));
                push_str(l, name);
                ffi::lua_concat(l, 2);
                push_top_row(l, &row);
                ffi::lua_rawset(l, -3);
            }
        }
        ffi::lua_setfield(l, -2, c"cpu".as_ptr());
    }
}

pub(super) unsafe fn top_enable_body(_l: *mut ffi::lua_State) -> LResult {
    fibertrace_fiber::embed::top_enable();
    Ok(0)
}
lua_fn!(f_top_enable, top_enable_body);

pub(super) unsafe fn top_disable_body(_l: *mut ffi::lua_State) -> LResult {
    fibertrace_fiber::embed::top_disable();
    Ok(0)
}
lua_fn!(f_top_disable, top_disable_body);
