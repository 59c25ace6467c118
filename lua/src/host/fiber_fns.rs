//! The `fiber` functions and methods: switching, identity, names, status, storage,
//! cancel, wake-up, join, info and top.

use std::ffi::c_int;
use std::time::Instant;

use fibertrace_fiber::FiberId;
use mlua::ffi;

use super::call::lua_fn;
use super::call::{Call, Protected};
use super::objects::*;
use super::raw::{self, LErr, LResult};
use super::spawn::*;
use super::with_host;

// ---- switching ----

pub(super) fn yield_body(c: &mut Call) -> LResult {
    super::finalize::check_switch(c, "fiber.yield")?;
    fibertrace_fiber::yield_now();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_yield, yield_body);

/// `fiber.sleep(delay)`: exactly one argument, a number or numeric string; zero or less
/// yields; NaN or a billion seconds or more sleeps until woken (Tarantool's timer never
/// fires for NaN either).
pub(super) fn sleep_body(c: &mut Call) -> LResult {
    let s = if c.top() != 1 { None } else { c.to_number(1) }
        .ok_or("fiber.sleep(delay): bad arguments")?;
    super::finalize::check_switch(c, "fiber.sleep")?;
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

pub(super) fn testcancel_body(c: &mut Call) -> LResult {
    if c.top() != 0 {
        return Err("fiber.testcancel(): bad arguments".into());
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_testcancel, testcancel_body);

/// The hidden `stall` of the task worker (Tarantool's): waits for a wakeup, outside the
/// timers.
pub(super) fn stall_body(c: &mut Call) -> LResult {
    super::finalize::check_switch(c, "fiber.stall")?;
    fibertrace_fiber::suspend();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_stall, stall_body);

/// The hidden setter of compat's `fiber_channel_close_mode` (true: graceful).
pub(super) fn set_close_mode_body(c: &mut Call) -> LResult {
    let graceful = c.to_boolean(1);
    with_host(|h| h.graceful_close = graceful);
    Ok(0)
}
lua_fn!(f_set_close_mode, set_close_mode_body);

// ---- identity, names, status ----

pub(super) fn self_body(c: &mut Call) -> LResult {
    let fid = fibertrace_fiber::current_id();
    if fid == 0 {
        return Err("fiber.self(): not in a fiber".into());
    }
    push_fiber_object(c, fid)?;
    Ok(1)
}
lua_fn!(f_self, self_body);

/// `fiber.id([fiber])` and `fiber_object:id()`: no argument is the current fiber (so
/// `fiber.self().id()` too); otherwise a fiber object (of a dead fiber too).
pub(super) fn id_body(c: &mut Call) -> LResult {
    let fid = if c.top() == 0 {
        fibertrace_fiber::current_id()
    } else {
        check_fiber_id(c, 1)?
    };
    c.push_int(fid as i64)?;
    Ok(1)
}
lua_fn!(f_id, id_body);

/// `fiber.find(id)`: exactly one argument; a number or numeric string (truncated) names a
/// fiber; anything else names none.
pub(super) fn find_body(c: &mut Call) -> LResult {
    if c.top() != 1 {
        return Err("fiber.find(id): bad arguments".into());
    }
    let fid = c.to_number(1).and_then(id_of_number);
    match fid.filter(|&f| find(f).is_some()) {
        Some(fid) => push_fiber_object(c, fid)?,
        None => c.push_nil()?,
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
pub(super) fn status_body(c: &mut Call) -> LResult {
    let fid = if c.top() == 0 {
        fibertrace_fiber::current_id()
    } else {
        check_fiber_id(c, 1)?
    };
    c.push_str(status_word(fid))?;
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
pub(super) fn name_body(c: &mut Call) -> LResult {
    let (fid, name_at) = if c.type_of(1) == ffi::LUA_TUSERDATA {
        (check_fiber(c, 1, true)?.0, 2)
    } else {
        (fibertrace_fiber::current_id(), 1)
    };
    let f = rec_fiber(fid).ok_or("the fiber is dead")?;
    let top = c.top();
    if top != name_at && top != name_at + 1 {
        c.push_str(&f.control_block().name_arc())?;
        return Ok(1);
    }
    let t = c.type_of(name_at);
    if t != ffi::LUA_TSTRING && t != ffi::LUA_TNUMBER {
        return Err(c.type_error(name_at, "string"));
    }
    // The name's bytes as they are (Tarantool's), cut at a NUL byte. (A number is written as
    // Lua writes it, without converting it in place: no allocation.)
    let mut name = if t == ffi::LUA_TNUMBER {
        c.value_bytes(name_at)
    } else {
        c.string_bytes(name_at).unwrap_or_default()
    };
    if let Some(nul) = name.iter().position(|&b| b == 0) {
        name.truncate(nul);
    }
    if name.len() + 1 > NAME_MAX {
        // A raw read of the options table's field.
        let truncate = if top == name_at + 1 && c.type_of(top) == ffi::LUA_TTABLE {
            c.push_field(top, "truncate")?;
            let b = c.type_of(-1) == ffi::LUA_TBOOLEAN && c.to_boolean(-1);
            c.pop(1);
            b
        } else {
            false
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
pub(super) fn tostring_body(c: &mut Call) -> LResult {
    let fid = check_fiber_id(c, 1)?;
    let dead = if find(fid).is_none() { " (dead)" } else { "" };
    c.push_str(&format!("fiber: {fid}{dead}"))?;
    Ok(1)
}
lua_fn!(m_tostring, tostring_body);

/// `fiber_object:__serialize()`: `{id, name, status}`, or `{id, status = 'dead'}` for a
/// fiber no longer found.
pub(super) fn serialize_body(c: &mut Call) -> LResult {
    let fid = check_fiber_id(c, 1)?;
    let name = find(fid)
        .and_then(|_| rec_fiber(fid))
        .map(|f| f.control_block().name_arc());
    let status = status_word(fid);
    c.protected(&[], |p| {
        p.new_table(0, 3);
        p.push_int(fid as i64);
        p.set_field(-2, c"id");
        if let Some(name) = &name {
            p.push_str(name);
            p.set_field(-2, c"name");
        }
        p.push_str(status);
        p.set_field(-2, c"status");
        1
    })?;
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
pub(super) fn live_arg(c: &Call) -> Result<fibertrace_fiber::Fiber, LErr> {
    let fid = if c.top() == 0 {
        fibertrace_fiber::current_id()
    } else {
        check_fiber_id(c, 1)?
    };
    match find(fid) {
        Some(Found::Live(f)) => Ok(f),
        _ => Err(LErr::plain("the fiber is dead")),
    }
}

pub(super) fn csw_body(c: &mut Call) -> LResult {
    let f = live_arg(c)?;
    c.push_int(lua_csw(&f) as i64)?;
    Ok(1)
}
lua_fn!(m_csw, csw_body);

// ---- storage and the fiber object's index ----

/// `fiber_object.storage`: the fiber's table, made on first use (from any fiber), dropped
/// when its function ends. The object is at index 1.
pub(super) fn push_storage(c: &mut Call) -> LResult {
    let (fid, found) = check_fiber(c, 1, true)?;
    if !matches!(found, Found::Live(_)) {
        return Err("the fiber is dead".into());
    }
    let r = with_host(|h| h.recs.get(&fid).map(|r| r.storage_ref))
        .flatten()
        .unwrap_or(0);
    if r > 0 {
        c.push_ref(r)?;
    } else {
        let mut r = 0;
        c.protected(&[], |p| {
            p.new_table(0, 0);
            p.push_value(-1);
            r = p.ref_top();
            1
        })?;
        with_host(|h| {
            if let Some(rec) = h.recs.get_mut(&fid) {
                rec.storage_ref = r;
            }
        });
    }
    Ok(1)
}

/// `__index` of fiber objects: `storage`, or a method (the methods table is the upvalue).
pub(super) fn index_body(c: &mut Call) -> LResult {
    if c.top() < 2 {
        return Ok(0);
    }
    if c.is_string(2, b"storage") {
        return push_storage(c);
    }
    c.push_upvalue_field(1, 2)?;
    Ok(1)
}
lua_fn!(f_index, index_body);

// ---- cancel, wakeup, join ----

/// `fiber.cancel(f)` / `fiber.kill(f)` / `f:cancel()`: a fiber object or id; an ended fiber
/// is left as it is; then the caller's own cancellation is raised (so cancelling oneself
/// raises at once).
pub(super) fn cancel_body(c: &mut Call) -> LResult {
    let (_, found) = check_fiber(c, 1, true)?;
    if let Found::Live(f) = found {
        f.cancel();
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_cancel, cancel_body);

pub(super) fn wakeup_body(c: &mut Call) -> LResult {
    let (_, found) = check_fiber(c, 1, true)?;
    // (Its own too: its next sleep or wait then ends at once, as in Tarantool.)
    if let Found::Live(f) = found {
        f.wakeup();
    }
    Ok(0)
}
lua_fn!(f_wakeup, wakeup_body);

/// `fiber.set_joinable(f, yesno)`: exactly two arguments. Making an ended fiber unjoinable
/// releases it (nobody may join it any more).
pub(super) fn set_joinable_body(c: &mut Call) -> LResult {
    if c.top() != 2 {
        return Err("fiber.set_joinable(id, yesno): bad arguments".into());
    }
    let (fid, found) = check_fiber(c, 1, true)?;
    let on = c.to_boolean(2);
    with_host(|h| match found {
        Found::Live(_) => {
            if let Some(r) = h.recs.get_mut(&fid) {
                r.joinable = on;
            }
        }
        Found::Ended if !on => {
            if let Some(rec) = remove_rec(h, fid, UNJOINABLE_WAITED) {
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
pub(super) fn to_error_object(c: &mut Call, etype: &str) -> Result<(), LErr> {
    let ctor = with_host(|h| h.error_ctor_ref).unwrap_or(ffi::LUA_REFNIL);
    // The constructor is a Lua function of this host (it only allocates and calls
    // `tostring`), called protected, in a protected call (the type's name is a new string)
    // that gets the value as its argument.
    c.protected(&[-1], |p| {
        p.push_ref(ctor);
        p.push_str(etype);
        p.push_value(1);
        if !p.pcall(2, 1) {
            // Out of memory, or a `__tostring` that failed: the value as it is.
            p.truncate(1);
        }
        1
    })?;
    c.remove(-2);
    Ok(())
}

/// Pushes an error object of `etype` with the message `msg`.
pub(super) fn error_object(c: &mut Call, msg: &str, etype: &str) -> Result<(), LErr> {
    c.push_str(msg)?;
    to_error_object(c, etype)
}

/// `fiber.join(f [, timeout])` / `f:join([timeout])`: waits for a joinable fiber; returns
/// `true, results...`, or `false, error object` (its error, `fiber is cancelled`, or `timed
/// out` when the timeout passed). Checks, in Tarantool's order: found (`the fiber is dead`),
/// joinable, not itself, the timeout; a fiber another joiner took while this one waited is
/// an error.
pub(super) fn join_body(c: &mut Call) -> LResult {
    let fid = if c.type_of(1) == ffi::LUA_TNUMBER {
        c.to_number(1).and_then(id_of_number)
    } else {
        Some(check_fiber_id(c, 1)?)
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
    let timeout = if c.is_none_or_nil(2) {
        None
    } else {
        match c.to_number(2) {
            Some(s) if s.is_nan() || s >= 0.0 => raw::seconds(s),
            _ => return Err(LErr::plain("fiber:join(timeout): bad arguments")),
        }
    };
    let waits = !fiber.control_block().is_dead() && timeout != Some(std::time::Duration::ZERO);
    super::finalize::check_wait(c, "fiber:join", waits)?;
    let deadline = timeout.and_then(|d| Instant::now().checked_add(d));
    // Counted while it waits: whoever removes the record meanwhile leaves word of why.
    with_host(|h| h.recs.get_mut(&fid).map(|r| r.joiners += 1));
    // A cancellation of this fiber does not end the wait (Tarantool's join).
    let ended = fiber.wait_until_ignoring_cancel(deadline);
    // The record as this join left it, or why it is gone.
    let lost = with_host(|h| match h.recs.get_mut(&fid) {
        Some(r) => {
            r.joiners -= 1;
            None
        }
        None => {
            let (left, why) = h.lost_joins.get_mut(&fid).map(|e| {
                e.0 -= 1;
                (e.0, e.1)
            })?;
            if left == 0 {
                h.lost_joins.remove(&fid);
            }
            Some(why)
        }
    })
    .flatten();
    if !ended {
        c.push_bool(false)?;
        error_object(c, "timed out", "TimedOut")?;
        return Ok(2);
    }
    let removed = match lost {
        Some(why) => Err(why),
        None => with_host(|h| remove_rec(h, fid, JOINED_BY_ANOTHER))
            .flatten()
            .ok_or(JOINED_BY_ANOTHER),
    };
    let rec = removed.map_err(LErr::plain)?;
    let cancelled = rec.fiber.control_block().is_cancelled();
    let n = match rec.done {
        // Its results (or its error) move to this call; the thread is released after.
        Some(ok) => match move_outcome(c, &rec) {
            Ok(n) if ok => Ok(n),
            Ok(_) => {
                let is_cancel = cancelled && c.is_string(-1, b"fiber is cancelled");
                to_error_object(
                    c,
                    if is_cancel {
                        "FiberIsCancelled"
                    } else {
                        "LuajitError"
                    },
                )
                .map(|()| 2)
            }
            Err(e) => Err(e),
        },
        // No outcome: it was cancelled before its function could start.
        None => c
            .push_bool(false)
            .and_then(|()| error_object(c, "fiber is cancelled", "FiberIsCancelled"))
            .map(|()| 2),
    };
    with_host(|h| release_thread(h, rec.thread, rec.thread_ref));
    n
}
lua_fn!(f_join, join_body);

// ---- info, top ----

pub(super) fn info_body(c: &mut Call) -> LResult {
    let opts = super::info::read_opts(c, 1)?;
    super::info::push_all(c, &opts)?;
    let mt = with_host(|h| h.info_mt_ref).ok_or_else(no_host)?;
    // The shared `{__serialize = 'mapping'}` of this host.
    c.set_metatable_ref(-1, mt)?;
    Ok(1)
}
lua_fn!(f_info, info_body);

/// `fiber_object:info([opts])`: no argument is the current fiber.
pub(super) fn m_info_body(c: &mut Call) -> LResult {
    let f = live_arg(c)?;
    let opts = super::info::read_opts(c, 2)?;
    super::info::push_one(c, f.id(), &opts)?;
    Ok(1)
}
lua_fn!(m_info, m_info_body);

/// Pushes one `fiber.top()` row.
fn push_top_row(p: &mut Protected, row: &fibertrace_fiber::embed::TopRow) {
    p.new_table(0, 3);
    p.push_number(row.average);
    p.set_field(-2, c"average");
    p.push_number(row.instant);
    p.set_field(-2, c"instant");
    p.push_number(row.time.as_secs_f64());
    p.set_field(-2, c"time");
}

/// `fiber.top()`: `{cpu_misses = 0, cpu = {["1/sched"] = row, ["id/name"] = row, ...}}` for
/// the scheduler and every Lua fiber, a joinable one that ended included until it is joined
/// (as Tarantool lists it; its time kept, its share 0, its average decaying); an error while
/// it is off.
pub(super) fn top_body(c: &mut Call) -> LResult {
    use fibertrace_fiber::embed::{top_ended_row, top_fiber_row, TopRow};
    if !fibertrace_fiber::embed::top_enabled() {
        return Err("fiber.top() is disabled. Enable it with fiber.top_enable() first".into());
    }
    let fibers: Vec<(FiberId, std::sync::Arc<str>, Option<TopRow>)> = with_host(|h| {
        h.recs
            .values()
            .map(|r| {
                let ended = r.done.is_some() || r.fiber.control_block().is_dead();
                let row = if ended {
                    top_ended_row(r.ended_top.as_deref())
                } else {
                    top_fiber_row(r.fiber.id())
                };
                (r.fiber.id(), r.fiber.control_block().name_arc(), row)
            })
            .collect()
    })
    .ok_or_else(no_host)?;
    // Fresh tables, made in a protected call.
    c.protected(&[], |p| {
        p.new_table(0, 2);
        p.push_number(0.0);
        p.set_field(-2, c"cpu_misses");
        p.new_table(0, fibers.len().min(1 << 20) as c_int + 1);
        if let Some(row) = fibertrace_fiber::embed::top_sched_row() {
            push_top_row(p, &row);
            p.set_field(-2, c"1/sched");
        }
        for (fid, name, row) in &fibers {
            if let Some(row) = row {
                p.push_str(&format!("{fid}/"));
                p.push_str(name);
                p.concat(2);
                push_top_row(p, row);
                p.raw_set(-3);
            }
        }
        p.set_field(-2, c"cpu");
        1
    })?;
    Ok(1)
}
lua_fn!(f_top, top_body);

pub(super) fn top_enable_body(_c: &mut Call) -> LResult {
    fibertrace_fiber::embed::top_enable();
    Ok(0)
}
lua_fn!(f_top_enable, top_enable_body);

pub(super) fn top_disable_body(_c: &mut Call) -> LResult {
    fibertrace_fiber::embed::top_disable();
    Ok(0)
}
lua_fn!(f_top_disable, top_disable_body);
