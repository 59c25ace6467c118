//! The `fiber` and `clock` modules: Tarantool's API over fibertrace fibers, as raw
//! `lua_CFunction`s (see [`super::raw`] for the error discipline).

use std::collections::hash_map::Entry;
use std::ffi::{c_int, CStr};
use std::time::Duration;

use fibertrace_fiber::{Builder, FiberId, ParentTrace};
use mlua::ffi;

use super::raw::{self, push_str, set_field, to_number, type_of, LResult};
use super::{with_host, HostState, Rec, ScriptError};
use crate::lua_fn;

const REG: c_int = ffi::LUA_REGISTRYINDEX;
/// Longest fiber name, as Tarantool's `FIBER_NAME_MAX`.
const NAME_MAX: usize = 255;
/// Finished Lua threads kept for reuse.
const POOL_MAX: usize = 4096;

/// Stack slot of a fiber's Lua thread holding the message handler of its `lua_pcall`.
const MSGH_SLOT: c_int = 1;

/// The userdata of a fiber object: its id.
#[repr(C)]
struct FiberUd {
    fid: FiberId,
}

fn no_host() -> String {
    "fibertrace: no Lua host on this thread".to_string()
}

/// Creates the modules and metatables in the main state `l`.
///
/// # Safety
/// `l` is the main state of a fresh Lua on this thread.
pub(crate) unsafe fn install(l: *mut ffi::lua_State) -> Result<HostState, String> {
    // SAFETY: plain table construction on a valid state (fresh tables: no metamethods).
    unsafe {
        ffi::lua_checkstack(l, 8);
        let base = ffi::lua_gettop(l);
        // The constructor of `fiber.info()` entries (see `info::push_fiber`).
        let src = super::info::ENTRY_CTOR;
        if ffi::luaL_loadbuffer(l, src.as_ptr().cast(), src.len(), c"=fiber.info".as_ptr())
            != ffi::LUA_OK
            || ffi::lua_pcall(l, 0, 1, 0) != ffi::LUA_OK
        {
            let e = raw::error_text(l, -1);
            ffi::lua_settop(l, base);
            return Err(format!("fibertrace: cannot set up fiber.info: {e}"));
        }
        let info_ctor_ref = ffi::luaL_ref(l, REG);

        // Live fibers' objects, by slot (see `push_object`).
        ffi::lua_createtable(l, 256, 0);
        let objs_ref = ffi::luaL_ref(l, REG);
        // Objects of fibers with no record here (fibers made by Rust that call into Lua), by
        // id, weak: one object while anything refers to it.
        ffi::lua_createtable(l, 0, 0);
        ffi::lua_createtable(l, 0, 1);
        push_str(l, "v");
        set_field(l, base + 2, c"__mode");
        ffi::lua_setmetatable(l, base + 1);
        let weak_objs_ref = ffi::luaL_ref(l, REG);

        // Fiber objects.
        let fiber_mt_ref = new_metatable(
            l,
            &[
                (c"id", m_id),
                (c"name", f_name),
                (c"status", f_status),
                (c"info", m_info),
                (c"cancel", f_cancel),
                (c"kill", f_cancel),
                (c"join", f_join),
                (c"set_joinable", f_set_joinable),
                (c"wakeup", f_wakeup),
                (c"csw", m_csw),
            ],
            &[(c"__tostring", m_tostring)],
        );
        let channel_mt_ref = new_metatable(
            l,
            &[
                (c"put", ch_put),
                (c"get", ch_get),
                (c"close", ch_close),
                (c"is_closed", ch_is_closed),
                (c"count", ch_count),
                (c"size", ch_size),
                (c"is_empty", ch_is_empty),
                (c"is_full", ch_is_full),
            ],
            &[(c"__gc", ch_gc), (c"__tostring", ch_tostring)],
        );
        let cond_mt_ref = new_metatable(
            l,
            &[
                (c"wait", cond_wait),
                (c"signal", cond_signal),
                (c"broadcast", cond_broadcast),
            ],
            &[(c"__gc", cond_gc), (c"__tostring", cond_tostring)],
        );

        // The modules, in package.loaded.
        ffi::lua_getfield(l, REG, c"_LOADED".as_ptr());
        let loaded = ffi::lua_gettop(l);
        if ffi::lua_type(l, loaded) != ffi::LUA_TTABLE {
            ffi::lua_settop(l, base);
            return Err("fibertrace: package library not loaded".into());
        }
        let fiber_fns: &[(&CStr, ffi::lua_CFunction)] = &[
            (c"create", f_create),
            (c"new", f_new),
            (c"yield", f_yield),
            (c"sleep", f_sleep),
            (c"self", f_self),
            (c"id", f_id),
            (c"find", f_find),
            (c"status", f_status),
            (c"name", f_name),
            (c"info", f_info),
            (c"kill", f_cancel),
            (c"cancel", f_cancel),
            (c"testcancel", f_testcancel),
            (c"wakeup", f_wakeup),
            (c"join", f_join),
            (c"set_joinable", f_set_joinable),
            (c"time", c_time),
            (c"time64", c_time64),
            (c"clock", c_monotonic),
            (c"clock64", c_monotonic64),
            (c"channel", f_channel),
            (c"cond", f_cond),
            (c"parent_backtrace_enable", f_pbt_enable),
            (c"parent_backtrace_disable", f_pbt_disable),
            (c"set_max_slice", f_set_max_slice),
        ];
        push_lib(l, fiber_fns);
        set_field(l, loaded, c"fiber");
        let clock_fns: &[(&CStr, ffi::lua_CFunction)] = &[
            (c"monotonic", c_monotonic),
            (c"monotonic64", c_monotonic64),
            (c"time", c_time),
            (c"realtime", c_time),
            (c"time64", c_time64),
            (c"realtime64", c_time64),
            (c"proc", c_proc),
            (c"proc64", c_proc64),
            (c"thread", c_thread),
            (c"thread64", c_thread64),
        ];
        push_lib(l, clock_fns);
        set_field(l, loaded, c"clock");
        ffi::lua_settop(l, base);
        Ok(HostState {
            main_l: l,
            recs: Default::default(),
            parent_backtrace: false,
            pool: Vec::new(),
            info_ctor_ref,
            objs_ref,
            weak_objs_ref,
            obj_free: Vec::new(),
            obj_next: 0,
            fiber_mt_ref,
            channel_mt_ref,
            cond_mt_ref,
            report_errors: true,
            fiber_name: std::sync::Arc::from("lua"),
        })
    }
}

/// # Safety
/// `l` valid, room for 3 values.
unsafe fn push_lib(l: *mut ffi::lua_State, fns: &[(&CStr, ffi::lua_CFunction)]) {
    // SAFETY: fresh table, plain sets.
    unsafe {
        ffi::lua_createtable(l, 0, fns.len() as c_int);
        let t = ffi::lua_gettop(l);
        for (k, f) in fns {
            ffi::lua_pushcfunction(l, *f);
            set_field(l, t, k);
        }
    }
}

/// A metatable with `__index` = a table of methods, plus metamethods; returns its registry
/// reference.
///
/// # Safety
/// `l` valid, room for 3 values.
unsafe fn new_metatable(
    l: *mut ffi::lua_State,
    methods: &[(&CStr, ffi::lua_CFunction)],
    meta: &[(&CStr, ffi::lua_CFunction)],
) -> c_int {
    // SAFETY: fresh tables, plain sets.
    unsafe {
        ffi::lua_createtable(l, 0, meta.len() as c_int + 1);
        let mt = ffi::lua_gettop(l);
        push_lib(l, methods);
        set_field(l, mt, c"__index");
        for (k, f) in meta {
            ffi::lua_pushcfunction(l, *f);
            set_field(l, mt, k);
        }
        ffi::lua_pushboolean(l, 0);
        set_field(l, mt, c"__metatable");
        ffi::luaL_ref(l, REG)
    }
}

/// Whether the value at `idx` is a userdata with the metatable `mt_ref`; its block if so.
///
/// # Safety
/// `l` valid, room for 2 values.
unsafe fn check_ud<T>(l: *mut ffi::lua_State, idx: c_int, mt_ref: c_int) -> Option<*mut T> {
    // SAFETY: plain stack reads; both pushed values are popped.
    unsafe {
        if ffi::lua_type(l, idx) != ffi::LUA_TUSERDATA || ffi::lua_getmetatable(l, idx) == 0 {
            return None;
        }
        super::raw::rawgeti(l, REG, mt_ref as ffi::lua_Integer);
        let same = ffi::lua_rawequal(l, -1, -2) != 0;
        ffi::lua_settop(l, -3);
        same.then(|| ffi::lua_touserdata(l, idx).cast::<T>())
    }
}

fn mt_refs() -> Option<(c_int, c_int, c_int)> {
    with_host(|h| (h.fiber_mt_ref, h.channel_mt_ref, h.cond_mt_ref))
}

/// The fiber id named by the argument at `idx`: a fiber object or a number.
///
/// # Safety
/// `l` valid.
unsafe fn fiber_arg(l: *mut ffi::lua_State, idx: c_int) -> Option<FiberId> {
    let (fmt, _, _) = mt_refs()?;
    // SAFETY: per the contract.
    unsafe {
        if let Some(p) = check_ud::<FiberUd>(l, idx, fmt) {
            return Some((*p).fid);
        }
        if type_of(l, idx) == ffi::LUA_TNUMBER {
            return to_number(l, idx).map(|n| n as FiberId);
        }
    }
    None
}

/// Pushes the fiber object of `fid`: the same object every time while the fiber lives.
///
/// # Safety
/// `l` valid.
unsafe fn push_fiber_object(l: *mut ffi::lua_State, fid: FiberId) -> Result<(), String> {
    // SAFETY: per the contract.
    unsafe { push_object(l, fid) }
}

/// As [`push_fiber_object`]. (`fiber.create` and `fiber.new` make the object of a new
/// fiber together with its record, in [`spawn_lua`].)
///
/// A live fiber's object is held in the array part of one host table, at a slot kept in
/// the fiber's record and freed (for the next fiber) when the record goes. So it lives as
/// long as the fiber, and making one costs an array store, not an insert into a growing
/// hash (a weak table by id) or a registry reference. A fiber without a record (a fiber made
/// by Rust code that calls into Lua) keeps its object in a weak table by id.
///
/// # Safety
/// `l` valid.
unsafe fn push_object(l: *mut ffi::lua_State, fid: FiberId) -> Result<(), String> {
    let (known, objs, weak, fmt) = with_host(|h| {
        (
            h.recs.get(&fid).map(|r| r.obj_slot),
            h.objs_ref,
            h.weak_objs_ref,
            h.fiber_mt_ref,
        )
    })
    .ok_or_else(no_host)?;
    // SAFETY: a host table and a fresh userdata with the fiber metatable.
    unsafe {
        ffi::lua_checkstack(l, 4);
        match known {
            Some(slot) if slot > 0 => {
                super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
                super::raw::rawgeti(l, -1, slot as ffi::lua_Integer);
                ffi::lua_replace(l, -2);
                return Ok(());
            }
            None => {
                super::raw::rawgeti(l, REG, weak as ffi::lua_Integer);
                super::raw::rawgeti(l, -1, fid as ffi::lua_Integer);
                if ffi::lua_type(l, -1) == ffi::LUA_TUSERDATA {
                    ffi::lua_replace(l, -2);
                    return Ok(());
                }
                ffi::lua_settop(l, -3);
            }
            _ => {}
        }
        let p = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
        p.write(FiberUd { fid });
        super::raw::rawgeti(l, REG, fmt as ffi::lua_Integer);
        ffi::lua_setmetatable(l, -2);
        if known.is_some() {
            let slot = with_host(|h| {
                let s = h.obj_free.pop().unwrap_or_else(|| {
                    h.obj_next += 1;
                    h.obj_next
                });
                if let Some(rec) = h.recs.get_mut(&fid) {
                    rec.obj_slot = s;
                }
                s
            })
            .ok_or_else(no_host)?;
            super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
            ffi::lua_pushvalue(l, -2);
            super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
            ffi::lua_settop(l, -2);
        } else {
            super::raw::rawgeti(l, REG, weak as ffi::lua_Integer);
            ffi::lua_pushvalue(l, -2);
            super::raw::rawseti(l, -2, fid as ffi::lua_Integer);
            ffi::lua_settop(l, -2);
        }
    }
    Ok(())
}

/// Removes a fiber's record, freeing its object's slot (the thread is the caller's).
fn remove_rec(h: &mut HostState, fid: FiberId) -> Option<Rec> {
    let rec = h.recs.remove(&fid)?;
    free_obj_slot(h, &rec);
    Some(rec)
}

/// Frees the object slot of a record just removed, for the next fiber's object. The slot is
/// cleared at once: a dead fiber's object must not stay reachable (a weak table keyed by
/// fiber objects would keep its entry).
fn free_obj_slot(h: &mut HostState, rec: &Rec) {
    if rec.obj_slot > 0 {
        // SAFETY: the host's main state and its object table; a plain array store.
        unsafe {
            let l = h.main_l;
            ffi::lua_checkstack(l, 2);
            super::raw::rawgeti(l, REG, h.objs_ref as ffi::lua_Integer);
            ffi::lua_pushnil(l);
            super::raw::rawseti(l, -2, rec.obj_slot as ffi::lua_Integer);
            ffi::lua_settop(l, -2);
        }
        h.obj_free.push(rec.obj_slot);
    }
}

fn cancelled_check() -> Result<(), String> {
    if fibertrace_fiber::is_cancelled() {
        Err("fiber is cancelled".into())
    } else {
        Ok(())
    }
}

// ---- fiber creation and the fiber body ----

/// The message handler of every fiber's `lua_pcall`: records the interleaved trace at the
/// point of the error, and returns the error unchanged.
unsafe fn msgh_body(l: *mut ffi::lua_State) -> LResult {
    let root = with_host(|h| {
        h.recs
            .get(&fibertrace_fiber::current_id())
            .map(|r| r.thread)
    })
    .flatten()
    .unwrap_or(l);
    // SAFETY: `root` is the running fiber's own thread (or `l`), on this thread.
    let frames = unsafe { super::info::current_frames(root, "f_msgh") };
    // The handler itself (its native frame and its Lua level) is not part of the error.
    let from = frames
        .iter()
        .position(|f| matches!(f, fibertrace_core::Frame::Lua(_)))
        .map_or(0, |i| i + 1);
    super::set_last_trace(Some(crate::render::tarantool(&frames[from..])));
    Ok(1)
}
lua_fn!(f_msgh, msgh_body);

/// Calls the function at index 2 of `t` with `nargs` arguments under the message handler at
/// [`MSGH_SLOT`]. Returns whether it succeeded; results (or the error) are left from index 2.
///
/// # Safety
/// `t` is a Lua thread of this host laid out as said, run only by the current fiber.
#[inline(never)]
unsafe fn call_in_thread(t: *mut ffi::lua_State, nargs: c_int) -> bool {
    // SAFETY: per the contract; lua_pcall catches every Lua error.
    let st = unsafe { ffi::lua_pcall(t, nargs, ffi::LUA_MULTRET, MSGH_SLOT) };
    std::hint::black_box(());
    st == ffi::LUA_OK
}

/// The body of a fiber made by `fiber.create`/`fiber.new`.
#[inline(never)]
fn lua_fiber_main(t: *mut ffi::lua_State, nargs: c_int) {
    // SAFETY: `t` was set up by `spawn_lua` and belongs to this fiber.
    let ok = unsafe { call_in_thread(t, nargs) };
    let fid = fibertrace_fiber::current_id();
    let trace = if ok { None } else { super::take_last_trace() };
    // SAFETY: the thread is ours and idle now.
    let msg = (!ok).then(|| unsafe { raw::error_text(t, -1) });
    let report = with_host(|h| {
        // One lookup: a joinable fiber's record stays for its joiner.
        let rec = match h.recs.entry(fid) {
            Entry::Occupied(e) if e.get().joinable => {
                e.into_mut().done = Some(ok);
                return None;
            }
            Entry::Occupied(e) => e.remove(),
            Entry::Vacant(_) => return None,
        };
        free_obj_slot(h, &rec);
        release_thread(h, rec.thread, rec.thread_ref);
        (h.report_errors && !ok).then(|| rec.fiber.name())
    })
    .flatten();
    if let (Some(name), Some(msg)) = (report, msg) {
        eprintln!(
            "fibertrace: fiber {fid} \"{name}\" failed: {msg}\nstack traceback:\n{}",
            trace.unwrap_or_default()
        );
    }
}

/// A Lua fiber's body as handed to the scheduler. Run, it calls the function on the fiber's
/// thread ([`lua_fiber_main`]). Dropped unrun — the fiber was cancelled before it started —
/// it settles the fiber's record as the end of its function would: the record, its object's
/// slot and its thread are released, except that a joinable fiber's record stays, with no
/// outcome, for its joiner (who is told the fiber was cancelled).
struct LuaBody {
    t: *mut ffi::lua_State,
    nargs: c_int,
}

impl LuaBody {
    fn run(self) {
        let me = std::mem::ManuallyDrop::new(self);
        lua_fiber_main(me.t, me.nargs);
    }
}

impl Drop for LuaBody {
    fn drop(&mut self) {
        let t = self.t;
        // Dropped inside the fiber (cancelled before it started) the fiber is current; while
        // a scheduler is dropped it is not, and the record is found by its thread — a dead
        // fiber's (the scheduler marks a fiber dead before dropping its body): a thread that
        // went back to the pool may run a live fiber now.
        let fid = fibertrace_fiber::current_id();
        with_host(|h| {
            let fid = if h.recs.get(&fid).is_some_and(|r| r.thread == t) {
                fid
            } else {
                let dead = |r: &Rec| r.thread == t && r.fiber.shared().is_dead();
                match h.recs.iter().find(|(_, r)| dead(r)) {
                    Some((&id, _)) => id,
                    None => return,
                }
            };
            if h.recs.get(&fid).is_some_and(|r| r.joinable) {
                return;
            }
            if let Some(rec) = remove_rec(h, fid) {
                release_thread(h, rec.thread, rec.thread_ref);
            }
        });
    }
}

/// Gives a finished fiber's Lua thread back to the pool (or drops its reference).
fn release_thread(h: &mut HostState, t: *mut ffi::lua_State, r: c_int) {
    // SAFETY: `t` is a thread of this host that no fiber runs any more: all above the
    // message handler is dropped.
    unsafe {
        ffi::lua_settop(t, MSGH_SLOT);
        if h.pool.len() < POOL_MAX {
            h.pool.push((t, r));
        } else {
            ffi::luaL_unref(h.main_l, REG, r);
        }
    }
}

/// Takes a clean Lua thread (from the pool or new). Its stack holds only the message handler
/// ([`MSGH_SLOT`], made once per thread, not once per fiber: pushing a C function allocates a
/// closure); the fiber's function and arguments go above it.
fn take_thread(h: &mut HostState) -> (*mut ffi::lua_State, c_int) {
    if let Some(t) = h.pool.pop() {
        return t;
    }
    // SAFETY: main state of this host; lua_newthread pushes the thread, luaL_ref pops it.
    unsafe {
        ffi::lua_checkstack(h.main_l, 2);
        let t = ffi::lua_newthread(h.main_l);
        let r = ffi::luaL_ref(h.main_l, REG);
        ffi::lua_pushcfunction(t, f_msgh);
        (t, r)
    }
}

/// `fiber.create(fn, ...)` / `fiber.new(fn, ...)`: the function and its arguments are the
/// whole stack of `l`; they move to the new fiber, and its object is left in their place.
/// `starts_now`: the caller starts it right after (`fiber.create`), which dates it.
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn spawn_lua(
    l: *mut ffi::lua_State,
    what: &str,
    starts_now: bool,
) -> Result<FiberId, String> {
    // SAFETY: per the contract.
    if unsafe { type_of(l, 1) } != ffi::LUA_TFUNCTION {
        return Err(format!("fiber.{what}(function, ...): bad arguments"));
    }
    if fibertrace_fiber::current_id() == 0 {
        return Err(format!("fiber.{what}: not in a fiber"));
    }
    let (t, tref, parent_bt, creator_root, name) = with_host(|h| {
        let (t, r) = take_thread(h);
        let root = if h.parent_backtrace {
            h.recs
                .get(&fibertrace_fiber::current_id())
                .map(|r| r.thread)
        } else {
            None
        };
        (t, r, h.parent_backtrace, root, h.fiber_name.clone())
    })
    .ok_or_else(no_host)?;
    // SAFETY: `t` is a clean thread; the function and arguments move from `l` to it.
    let nargs = unsafe {
        let n = ffi::lua_gettop(l);
        ffi::lua_checkstack(t, n + 2);
        ffi::lua_xmove(l, t, n);
        n - 1
    };
    let parent = if parent_bt {
        // SAFETY: the creator's root thread runs on this OS thread (it is calling us).
        let frames = unsafe { super::info::current_frames(creator_root.unwrap_or(l), "f_create") };
        let me = fibertrace_fiber::current();
        Some(ParentTrace::new(me.as_ref(), &frames))
    } else {
        None
    };
    // The outcome is the record's `done` (see `lua_fiber_main`): the handle's result slot is
    // not needed, and its fiber moves into the record.
    let mut b = Builder::new().shared_name(name).parent_trace(parent);
    if starts_now {
        // Started as soon as its record and object exist: the start dates it.
        b = b.created_at_start();
    }
    let body = LuaBody { t, nargs };
    let fiber = b.spawn(move || body.run()).into_fiber();
    let fid = fiber.id();
    // The record and its object's slot in one visit to the host state.
    let (objs, mt, slot) = with_host(|h| {
        let slot = h.obj_free.pop().unwrap_or_else(|| {
            h.obj_next += 1;
            h.obj_next
        });
        h.recs.insert(
            fid,
            Rec {
                fiber,
                joining: false,
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                obj_slot: slot,
            },
        );
        (h.objs_ref, h.fiber_mt_ref, slot)
    })
    .ok_or_else(no_host)?;
    // SAFETY: `l`'s stack is empty (everything moved to `t`), and a C function is called
    // with at least LUA_MINSTACK (20) free slots, so the three used here need no check; a
    // fresh userdata with the fiber metatable goes into its slot of the host's object table
    // and stays on top.
    unsafe {
        let p = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
        p.write(FiberUd { fid });
        super::raw::rawgeti(l, REG, mt as ffi::lua_Integer);
        ffi::lua_setmetatable(l, -2);
        super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
        ffi::lua_pushvalue(l, -2);
        super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
        ffi::lua_settop(l, -2);
    }
    Ok(fid)
}

unsafe fn create_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { spawn_lua(l, "create", true) }?;
    // Start it now: it runs, and this fiber continues as soon as it yields.
    fibertrace_fiber::yield_to_id(fid);
    cancelled_check()?;
    Ok(1)
}
lua_fn!(f_create, create_body);

unsafe fn new_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { spawn_lua(l, "new", false) }?;
    Ok(1)
}
lua_fn!(f_new, new_body);

/// Runs the main chunk in the current fiber (the scheduler's main fiber).
pub(crate) fn run_main_fiber(
    name: &str,
    source: &[u8],
    args: &[String],
) -> Result<(), ScriptError> {
    let err = |m: String| ScriptError {
        message: m,
        traceback: String::new(),
    };
    let (t, tref) = with_host(take_thread).ok_or_else(|| err(no_host()))?;
    let Some(me) = fibertrace_fiber::current() else {
        return Err(err("fibertrace: not in a fiber".into()));
    };
    let fid = me.id();
    let chunkname = std::ffi::CString::new(name.replace('\0', "?")).unwrap_or_default();
    // SAFETY: `t` is a clean thread of this host; the source bytes outlive the load.
    let loaded = unsafe {
        ffi::lua_checkstack(t, args.len() as c_int + 3);
        let st = ffi::luaL_loadbuffer(t, source.as_ptr().cast(), source.len(), chunkname.as_ptr());
        if st != ffi::LUA_OK {
            Err(raw::error_text(t, -1))
        } else {
            for a in args {
                push_str(t, a);
            }
            Ok(())
        }
    };
    if let Err(m) = loaded {
        with_host(|h| release_thread(h, t, tref));
        return Err(err(m));
    }
    with_host(|h| {
        h.recs.insert(
            fid,
            Rec {
                fiber: me,
                joining: false,
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                obj_slot: 0,
            },
        )
    });
    // SAFETY: `t` holds the handler, the chunk and its arguments, and is ours.
    let ok = unsafe { call_in_thread(t, args.len() as c_int) };
    let r = if ok {
        Ok(())
    } else {
        Err(ScriptError {
            // SAFETY: the error is on top of our idle thread.
            message: unsafe { raw::error_text(t, -1) },
            traceback: super::take_last_trace().unwrap_or_default(),
        })
    };
    with_host(|h| {
        remove_rec(h, fid);
        release_thread(h, t, tref);
    });
    r
}

// ---- switching ----

unsafe fn yield_body(_l: *mut ffi::lua_State) -> LResult {
    fibertrace_fiber::yield_now();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_yield, yield_body);

unsafe fn sleep_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let s = unsafe { to_number(l, 1) }.ok_or("fiber.sleep(delay): bad arguments")?;
    if s.is_nan() {
        return Err("fiber.sleep(delay): bad arguments".into());
    }
    if s <= 0.0 {
        fibertrace_fiber::yield_now();
    } else {
        fibertrace_fiber::sleep(Duration::from_secs_f64(s.min(1e9)));
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_sleep, sleep_body);

unsafe fn testcancel_body(_l: *mut ffi::lua_State) -> LResult {
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_testcancel, testcancel_body);

// ---- identity, names, status ----

unsafe fn self_body(l: *mut ffi::lua_State) -> LResult {
    let fid = fibertrace_fiber::current_id();
    if fid == 0 {
        return Err("fiber.self(): not in a fiber".into());
    }
    // SAFETY: C function contract.
    unsafe { push_fiber_object(l, fid) }?;
    Ok(1)
}
lua_fn!(f_self, self_body);

unsafe fn id_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = match unsafe { type_of(l, 1) } {
        t if t <= ffi::LUA_TNIL => fibertrace_fiber::current_id(),
        // SAFETY: as above.
        _ => unsafe { fiber_arg(l, 1) }.ok_or("fiber.id([fiber]): bad arguments")?,
    };
    // SAFETY: as above.
    unsafe { ffi::lua_pushinteger(l, fid as ffi::lua_Integer) };
    Ok(1)
}
lua_fn!(f_id, id_body);

unsafe fn m_id_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("usage: fiber:id()")?;
    // SAFETY: as above.
    unsafe { ffi::lua_pushinteger(l, fid as ffi::lua_Integer) };
    Ok(1)
}
lua_fn!(m_id, m_id_body);

unsafe fn find_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("fiber.find(id): bad arguments")?;
    let alive = with_host(|h| {
        h.recs
            .get(&fid)
            .is_some_and(|r| r.done.is_none() && !r.fiber.shared().is_dead())
    })
    .unwrap_or(false);
    if alive {
        // SAFETY: as above.
        unsafe { push_fiber_object(l, fid) }?;
    } else {
        // SAFETY: as above.
        unsafe { ffi::lua_pushnil(l) };
    }
    Ok(1)
}
lua_fn!(f_find, find_body);

fn live_fiber(fid: FiberId) -> Option<fibertrace_fiber::Fiber> {
    with_host(|h| {
        h.recs
            .get(&fid)
            .filter(|r| r.done.is_none() && !r.fiber.shared().is_dead())
            .map(|r| r.fiber.clone())
    })
    .flatten()
}

/// Tarantool's status words: running, suspended, dead.
pub(crate) fn status_word(fid: FiberId) -> &'static str {
    match live_fiber(fid) {
        None => "dead",
        Some(_) if fid == fibertrace_fiber::current_id() => "running",
        Some(_) => "suspended",
    }
}

unsafe fn status_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = match unsafe { type_of(l, 1) } {
        t if t <= ffi::LUA_TNIL => fibertrace_fiber::current_id(),
        // SAFETY: as above.
        _ => unsafe { fiber_arg(l, 1) }.ok_or("fiber.status([fiber]): bad arguments")?,
    };
    // SAFETY: as above.
    unsafe { push_str(l, status_word(fid)) };
    Ok(1)
}
lua_fn!(f_status, status_body);

/// `fiber.name([fiber,] [name [, {truncate = true}]])` and `fiber_object:name(...)`.
unsafe fn name_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all reads below).
    let (fid, at) = match unsafe { type_of(l, 1) } {
        ffi::LUA_TUSERDATA => (
            // SAFETY: as above.
            unsafe { fiber_arg(l, 1) }.ok_or("fiber.name(): bad arguments")?,
            2,
        ),
        _ => (fibertrace_fiber::current_id(), 1),
    };
    let f = live_fiber(fid).ok_or("the fiber is dead")?;
    // SAFETY: as above.
    match unsafe { type_of(l, at) } {
        t if t <= ffi::LUA_TNIL => {
            // SAFETY: as above.
            unsafe { push_str(l, &f.name()) };
            Ok(1)
        }
        ffi::LUA_TSTRING => {
            // SAFETY: as above.
            let mut name = unsafe { raw::to_string(l, at) }.unwrap_or_default();
            if name.len() > NAME_MAX {
                // SAFETY: as above; a raw read of a field of the options table.
                let truncate = unsafe {
                    ffi::lua_type(l, at + 1) == ffi::LUA_TTABLE && {
                        push_str(l, "truncate");
                        ffi::lua_rawget(l, at + 1);
                        let b = ffi::lua_toboolean(l, -1) != 0;
                        ffi::lua_settop(l, -2);
                        b
                    }
                };
                if !truncate {
                    return Err("Fiber name is too long".into());
                }
                let mut cut = NAME_MAX;
                while !name.is_char_boundary(cut) {
                    cut -= 1;
                }
                name.truncate(cut);
            }
            f.set_name(&name);
            Ok(0)
        }
        _ => Err("fiber.name(name): name must be a string".into()),
    }
}
lua_fn!(f_name, name_body);

unsafe fn tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("bad fiber object")?;
    // SAFETY: as above.
    unsafe { push_str(l, &format!("fiber: {fid}")) };
    Ok(1)
}
lua_fn!(m_tostring, tostring_body);

unsafe fn csw_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("usage: fiber:csw()")?;
    let f = live_fiber(fid).ok_or("the fiber is dead")?;
    // SAFETY: as above.
    unsafe { ffi::lua_pushinteger(l, f.shared().csw() as ffi::lua_Integer) };
    Ok(1)
}
lua_fn!(m_csw, csw_body);

// ---- cancel, wakeup, join ----

unsafe fn cancel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("fiber.cancel(fiber): bad arguments")?;
    let f = live_fiber(fid).ok_or("the fiber is dead")?;
    f.cancel();
    if fid == fibertrace_fiber::current_id() {
        cancelled_check()?;
    }
    Ok(0)
}
lua_fn!(f_cancel, cancel_body);

unsafe fn wakeup_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("fiber.wakeup(fiber): bad arguments")?;
    if let Some(f) = live_fiber(fid) {
        if fid != fibertrace_fiber::current_id() {
            f.wakeup();
        }
    }
    Ok(0)
}
lua_fn!(f_wakeup, wakeup_body);

unsafe fn set_joinable_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("fiber.set_joinable(fiber, bool): bad arguments")?;
    // SAFETY: as above.
    let on = unsafe { ffi::lua_toboolean(l, 2) } != 0;
    with_host(|h| match h.recs.get_mut(&fid) {
        // A joinable fiber cancelled before it started keeps its record (no outcome) for its
        // joiner, but is dead: it cannot be made unjoinable any more.
        Some(r) if r.done.is_none() && !r.fiber.shared().is_dead() => {
            r.joinable = on;
            Ok(())
        }
        _ => Err("the fiber is dead".to_string()),
    })
    .ok_or_else(no_host)??;
    Ok(0)
}
lua_fn!(f_set_joinable, set_joinable_body);

/// `fiber.join(f[, timeout])`: waits for a joinable fiber; returns `true, results...` or
/// `false, error`.
unsafe fn join_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("fiber.join(fiber): bad arguments")?;
    if fid == fibertrace_fiber::current_id() {
        return Err("the fiber cannot join itself".into());
    }
    let (joinable, fiber) = with_host(|h| match h.recs.get_mut(&fid) {
        Some(r) if r.joinable && !r.joining => {
            r.joining = true;
            (true, Some(r.fiber.clone()))
        }
        Some(r) => (r.joinable, None),
        None => (false, None),
    })
    .ok_or_else(no_host)?;
    if !joinable {
        return Err("the fiber is not joinable".into());
    }
    let Some(fiber) = fiber else {
        return Err("the fiber is already being joined".into());
    };
    // A joiner cancelled while it waits (an error or an unwinding) lets the next one join.
    struct Joining(FiberId);
    impl Drop for Joining {
        fn drop(&mut self) {
            with_host(|h| {
                if let Some(r) = h.recs.get_mut(&self.0) {
                    r.joining = false;
                }
            });
        }
    }
    let joining = Joining(fid);
    fiber.wait();
    cancelled_check()?;
    drop(joining);
    let rec = with_host(|h| remove_rec(h, fid)).flatten();
    let Some(rec) = rec else {
        return Err("the fiber is dead".into());
    };
    let t = rec.thread;
    // SAFETY: the joined fiber is dead; its thread holds [handler, results...] or
    // [handler, error]; they move to `l`.
    let n = unsafe {
        // No outcome: it was cancelled before its function could finish.
        match rec.done {
            Some(ok) => {
                let n = ffi::lua_gettop(t) - MSGH_SLOT;
                ffi::lua_checkstack(l, n + 2);
                ffi::lua_pushboolean(l, ok as c_int);
                ffi::lua_xmove(t, l, n.max(0));
                n.max(0) + 1
            }
            _ => {
                ffi::lua_checkstack(l, 2);
                ffi::lua_pushboolean(l, 0);
                push_str(l, "fiber is cancelled");
                2
            }
        }
    };
    with_host(|h| release_thread(h, t, rec.thread_ref));
    Ok(n)
}
lua_fn!(f_join, join_body);

// ---- info ----

unsafe fn info_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let opts = unsafe { super::info::read_opts(l, 1) };
    // SAFETY: as above.
    unsafe { super::info::push_all(l, &opts) }?;
    Ok(1)
}
lua_fn!(f_info, info_body);

unsafe fn m_info_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { fiber_arg(l, 1) }.ok_or("usage: fiber:info([opts])")?;
    live_fiber(fid).ok_or("the fiber is dead")?;
    // SAFETY: as above.
    let opts = unsafe { super::info::read_opts(l, 2) };
    // SAFETY: as above.
    unsafe { super::info::push_one(l, fid, &opts) }?;
    Ok(1)
}
lua_fn!(m_info, m_info_body);

/// `fiber.set_max_slice(seconds)`: a fiber that runs longer than this without yielding is
/// reported (with its native frames) by the stall detector, which this starts.
unsafe fn set_max_slice_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let s = unsafe { to_number(l, 1) }.ok_or("fiber.set_max_slice(seconds): bad arguments")?;
    if !(s.is_finite() && s > 0.0) {
        return Err("fiber.set_max_slice(seconds): a positive number of seconds".into());
    }
    let threshold = Duration::from_secs_f64(s.min(1e6));
    if fibertrace_fiber::watchdog::is_running() {
        fibertrace_fiber::watchdog::set_threshold(threshold);
    } else {
        fibertrace_fiber::watchdog::start(fibertrace_fiber::watchdog::Config {
            threshold,
            ..Default::default()
        });
    }
    Ok(0)
}
lua_fn!(f_set_max_slice, set_max_slice_body);

unsafe fn pbt_enable_body(_l: *mut ffi::lua_State) -> LResult {
    with_host(|h| h.parent_backtrace = true);
    Ok(0)
}
lua_fn!(f_pbt_enable, pbt_enable_body);

unsafe fn pbt_disable_body(_l: *mut ffi::lua_State) -> LResult {
    with_host(|h| h.parent_backtrace = false);
    Ok(0)
}
lua_fn!(f_pbt_disable, pbt_disable_body);

// ---- clocks ----

fn clock_ns(id: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock ids used are supported on Linux.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

macro_rules! clock_fns {
    ($($secs:ident, $int:ident, $clock:expr, $div:expr;)*) => {$(
        unsafe extern "C-unwind" fn $secs(l: *mut ffi::lua_State) -> c_int {
            // SAFETY: pushes one number on the calling state.
            unsafe { ffi::lua_pushnumber(l, clock_ns($clock) as f64 / 1e9) };
            1
        }
        unsafe extern "C-unwind" fn $int(l: *mut ffi::lua_State) -> c_int {
            // SAFETY: pushes one number on the calling state.
            unsafe { ffi::lua_pushinteger(l, (clock_ns($clock) / $div) as ffi::lua_Integer) };
            1
        }
    )*};
}

clock_fns! {
    c_monotonic, c_monotonic64, libc::CLOCK_MONOTONIC, 1;
    c_time, c_time64_ns, libc::CLOCK_REALTIME, 1;
    c_proc, c_proc64, libc::CLOCK_PROCESS_CPUTIME_ID, 1;
    c_thread, c_thread64, libc::CLOCK_THREAD_CPUTIME_ID, 1;
}

/// `fiber.time64()`: microseconds (Tarantool's unit for it).
unsafe extern "C-unwind" fn c_time64(l: *mut ffi::lua_State) -> c_int {
    let _ = c_time64_ns;
    // SAFETY: pushes one number on the calling state.
    unsafe {
        ffi::lua_pushinteger(
            l,
            (clock_ns(libc::CLOCK_REALTIME) / 1000) as ffi::lua_Integer,
        )
    };
    1
}

// ---- channels and conditions ----

/// A channel's userdata: the runtime's channel of registry references to the values.
struct ChannelUd {
    ch: Option<fibertrace_fiber::Channel<Msg>>,
}

struct CondUd {
    cond: Option<fibertrace_fiber::Cond>,
}

unsafe fn channel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let cap = match unsafe { type_of(l, 1) } {
        t if t <= ffi::LUA_TNIL => 0,
        // SAFETY: as above.
        _ => match unsafe { to_number(l, 1) } {
            Some(n) if (0.0..1e9).contains(&n) => n as usize,
            _ => return Err("fiber.channel(size): bad arguments".into()),
        },
    };
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block is initialised before its metatable (with __gc) is set.
    unsafe {
        let p = ffi::lua_newuserdata(l, std::mem::size_of::<ChannelUd>()).cast::<ChannelUd>();
        p.write(ChannelUd {
            ch: Some(fibertrace_fiber::channel(cap)),
        });
        super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
        ffi::lua_setmetatable(l, -2);
    }
    Ok(1)
}
lua_fn!(f_channel, channel_body);

/// # Safety
/// `l` valid.
unsafe fn channel_arg(l: *mut ffi::lua_State) -> Result<fibertrace_fiber::Channel<Msg>, String> {
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `channel_body`.
    unsafe { check_ud::<ChannelUd>(l, 1, cmt).and_then(|p| (*p).ch.clone()) }
        .ok_or_else(|| "usage: channel:method(...)".to_string())
}

/// A value in a channel: a reference in the registry, released when the message is dropped —
/// whoever drops it (a receiver after pushing the value, a send that failed, a channel that
/// is closed or collected with values in it, a sender's cancellation). A message is owned by
/// exactly one place at a time, so its reference is released exactly once and never while
/// it is still queued.
pub(crate) struct Msg(c_int);

impl Drop for Msg {
    fn drop(&mut self) {
        // The registry is shared by all threads of the state: the main state will do. Without
        // a host (it is being torn down, its state about to close) the reference goes with
        // the state.
        if let Some(l) = with_host(|h| h.main_l) {
            // SAFETY: the main state of this thread's host; the reference was made by
            // `ch_put_body` and is released only here.
            unsafe { ffi::luaL_unref(l, REG, self.0) };
        }
    }
}

unsafe fn ch_put_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all Lua calls below).
    let ch = unsafe { channel_arg(l) }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 3, "channel:put") }?;
    // SAFETY: as above: the message (nil if absent) is referenced in the registry.
    let msg = Msg(unsafe {
        ffi::lua_settop(l, 2);
        ffi::luaL_ref(l, REG)
    });
    // A send that completed is reported as such, even if the fiber was cancelled meanwhile
    // (Tarantool's rule); a failed one drops its message (releasing it) unless the channel
    // discarded it already. Cancellation while blocked unwinds out of the send, dropping the
    // message on the way (see `fibertrace_fiber::sync`).
    let sent = match ch.send_back(msg, timeout) {
        Ok(()) => true,
        Err(e) => {
            drop(e);
            cancelled_check()?;
            false
        }
    };
    // SAFETY: as above.
    unsafe { ffi::lua_pushboolean(l, sent as c_int) };
    Ok(1)
}
lua_fn!(ch_put, ch_put_body);

unsafe fn ch_get_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all Lua calls below).
    let ch = unsafe { channel_arg(l) }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, "channel:get") }?;
    let got = match timeout {
        None => ch.recv(),
        Some(d) => ch.recv_timeout(d).ok(),
    };
    match got {
        // A value taken is returned, even if the fiber was cancelled meanwhile.
        // SAFETY: as above; the message's value is pushed, then the message released.
        Some(msg) => unsafe {
            super::raw::rawgeti(l, REG, msg.0 as ffi::lua_Integer);
            drop(msg);
        },
        None => {
            cancelled_check()?;
            // SAFETY: as above.
            unsafe { ffi::lua_pushnil(l) };
        }
    }
    Ok(1)
}
lua_fn!(ch_get, ch_get_body);

unsafe fn ch_close_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let ch = unsafe { channel_arg(l) }?;
    // Tarantool 2.6: queued messages are dropped; blocked senders and receivers fail.
    ch.close_discarding();
    Ok(0)
}
lua_fn!(ch_close, ch_close_body);

macro_rules! ch_query {
    ($name:ident, $body:ident, |$ch:ident, $l:ident| $e:expr) => {
        unsafe fn $body($l: *mut ffi::lua_State) -> LResult {
            // SAFETY: C function contract.
            let $ch = unsafe { channel_arg($l) }?;
            // SAFETY: as above.
            unsafe { $e };
            Ok(1)
        }
        lua_fn!($name, $body);
    };
}
ch_query!(
    ch_is_closed,
    ch_is_closed_body,
    |c, l| ffi::lua_pushboolean(l, c.is_closed() as c_int)
);
ch_query!(ch_count, ch_count_body, |c, l| ffi::lua_pushinteger(
    l,
    c.len() as ffi::lua_Integer
));
ch_query!(ch_size, ch_size_body, |c, l| ffi::lua_pushinteger(
    l,
    c.capacity() as ffi::lua_Integer
));
ch_query!(ch_is_empty, ch_is_empty_body, |c, l| ffi::lua_pushboolean(
    l,
    c.is_empty() as c_int
));
ch_query!(ch_is_full, ch_is_full_body, |c, l| ffi::lua_pushboolean(
    l,
    c.is_full() as c_int
));

unsafe fn ch_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let ch = unsafe { channel_arg(l) }?;
    // SAFETY: as above.
    unsafe { push_str(l, &format!("channel: {}", ch.len())) };
    Ok(1)
}
lua_fn!(ch_tostring, ch_tostring_body);

unsafe fn ch_gc_body(l: *mut ffi::lua_State) -> LResult {
    let Some((_, cmt, _)) = mt_refs() else {
        return Ok(0);
    };
    // SAFETY: __gc is called with our userdata; its block is taken out once.
    unsafe {
        if let Some(p) = check_ud::<ChannelUd>(l, 1, cmt) {
            // The last handle's drop releases the queued messages (a blocked fiber holds a
            // handle, so this is not the last while one waits).
            drop((*p).ch.take());
        }
    }
    Ok(0)
}
lua_fn!(ch_gc, ch_gc_body);

unsafe fn cond_body(l: *mut ffi::lua_State) -> LResult {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block is initialised before its metatable (with __gc) is set.
    unsafe {
        let p = ffi::lua_newuserdata(l, std::mem::size_of::<CondUd>()).cast::<CondUd>();
        p.write(CondUd {
            cond: Some(fibertrace_fiber::Cond::new()),
        });
        super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
        ffi::lua_setmetatable(l, -2);
    }
    Ok(1)
}
lua_fn!(f_cond, cond_body);

/// # Safety
/// `l` valid.
unsafe fn cond_arg(l: *mut ffi::lua_State) -> Result<*const fibertrace_fiber::Cond, String> {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `cond_body`.
    unsafe { check_ud::<CondUd>(l, 1, cmt).and_then(|p| (*p).cond.as_ref().map(|c| c as *const _)) }
        .ok_or_else(|| "usage: cond:method(...)".to_string())
}

unsafe fn cond_wait_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let c = unsafe { cond_arg(l) }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, "cond:wait") }?;
    // Keep the userdata alive across the wait: it stays at index 1 of this call.
    // SAFETY: the Cond lives in the userdata at index 1, which this call's frame references.
    let signalled = unsafe {
        match timeout {
            None => {
                (*c).wait();
                true
            }
            Some(d) => (*c).wait_timeout(d),
        }
    };
    cancelled_check()?;
    // SAFETY: as above.
    unsafe { ffi::lua_pushboolean(l, signalled as c_int) };
    Ok(1)
}
lua_fn!(cond_wait, cond_wait_body);

unsafe fn cond_signal_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l)?).signal() };
    Ok(0)
}
lua_fn!(cond_signal, cond_signal_body);

unsafe fn cond_broadcast_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l)?).broadcast() };
    Ok(0)
}
lua_fn!(cond_broadcast, cond_broadcast_body);

unsafe fn cond_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let c = unsafe { cond_arg(l) }?;
    // SAFETY: as above.
    unsafe { push_str(l, &format!("cond: {}", (*c).id())) };
    Ok(1)
}
lua_fn!(cond_tostring, cond_tostring_body);

unsafe fn cond_gc_body(l: *mut ffi::lua_State) -> LResult {
    let Some((_, _, cmt)) = mt_refs() else {
        return Ok(0);
    };
    // SAFETY: __gc is called with our userdata; its block is taken out once.
    unsafe {
        if let Some(p) = check_ud::<CondUd>(l, 1, cmt) {
            drop((*p).cond.take());
        }
    }
    Ok(0)
}
lua_fn!(cond_gc, cond_gc_body);
