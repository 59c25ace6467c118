//! The `fiber` and `clock` modules: Tarantool's API over fibertrace fibers, as raw
//! `lua_CFunction`s (see [`super::raw`] for the error discipline), with Tarantool 2.6's
//! argument checks, error texts and their order, plus the fiber functions added after 2.6
//! (slices, `fiber_object:info()`/`csw()`, join with a timeout, `__serialize`, ...).
//!
//! How fibers are found (Tarantool's `fiber_find`): a fiber is found while its function runs,
//! and also, once it has ended, while it is joinable and not joined yet ("ended": its
//! status reads `suspended`, `cancel` and `wakeup` do nothing, as in Tarantool); a fiber
//! found by no record is dead. Invariants of the records: a record is removed exactly once
//! (by the end of a non-joinable fiber's function, by its join, or by making an ended fiber
//! unjoinable), and whoever removes it releases its object slot, storage and thread.

use std::collections::hash_map::Entry;
use std::ffi::{c_int, CStr};
use std::io::Write;
use std::time::{Duration, Instant};

use fibertrace_fiber::{Builder, FiberId, ParentTrace};
use mlua::ffi;

use super::raw::{self, push_str, set_field, to_number, type_of, LErr, LResult};
use super::{with_host, HostState, Rec, ScriptError, Slice};
use crate::lua_fn;

pub(crate) const REG: c_int = ffi::LUA_REGISTRYINDEX;
/// Longest fiber name with its terminating NUL, as Tarantool's `FIBER_NAME_MAX`.
const NAME_MAX: usize = 256;
/// Finished Lua threads kept for reuse.
const POOL_MAX: usize = 4096;

/// Stack slot of a fiber's Lua thread holding the message handler of its `lua_pcall`.
const MSGH_SLOT: c_int = 1;

/// The userdata of a fiber object: its id.
#[repr(C)]
struct FiberUd {
    fid: FiberId,
}

pub(crate) fn no_host() -> LErr {
    LErr::plain("fibertrace: no Lua host on this thread")
}

/// Runs a Lua chunk made from `src` with `nargs` arguments (on the stack) and `nres` results,
/// protected; the error as text.
///
/// # Safety
/// `l` valid with the arguments on top.
unsafe fn run_chunk(
    l: *mut ffi::lua_State,
    src: &str,
    name: &CStr,
    nargs: c_int,
    nres: c_int,
) -> Result<(), String> {
    // SAFETY: per the contract; the chunk goes below its arguments before the call.
    unsafe {
        if ffi::luaL_loadbuffer(l, src.as_ptr().cast(), src.len(), name.as_ptr()) != ffi::LUA_OK {
            let e = raw::error_text(l, -1);
            ffi::lua_settop(l, -(nargs + 2));
            return Err(e);
        }
        ffi::lua_insert(l, -(nargs + 1));
        if ffi::lua_pcall(l, nargs, nres, 0) != ffi::LUA_OK {
            let e = raw::error_text(l, -1);
            ffi::lua_settop(l, -2);
            return Err(e);
        }
    }
    Ok(())
}

/// Creates the modules and metatables in the main state `l`.
///
/// # Safety
/// `l` is the main state of a fresh Lua on this thread.
pub(crate) unsafe fn install(l: *mut ffi::lua_State) -> Result<HostState, String> {
    // SAFETY: plain table construction on a valid state (fresh tables: no metamethods).
    unsafe {
        ffi::lua_checkstack(l, 16);
        let base = ffi::lua_gettop(l);
        raw::install_protect(l);
        clear_pending();
        // The constructor of `fiber.info()` entries (see `info::push_fiber`).
        if let Err(e) = run_chunk(l, super::info::ENTRY_CTOR, c"=fiber.info", 0, 1) {
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

        // Fiber objects: methods found through `__index` (a C function: `storage` is a
        // per-fiber value), as Tarantool's.
        let fiber_mt_ref = new_metatable(l, c"fiber", FIBER_METHODS, FIBER_META, Some(f_index));
        let channel_mt_ref =
            new_metatable(l, c"fiber.channel", CHANNEL_METHODS, CHANNEL_META, None);
        let cond_mt_ref = new_metatable(l, c"fiber.cond", COND_METHODS, COND_META, None);

        // The modules, in package.loaded.
        ffi::lua_getfield(l, REG, c"_LOADED".as_ptr());
        let loaded = ffi::lua_gettop(l);
        if ffi::lua_type(l, loaded) != ffi::LUA_TTABLE {
            ffi::lua_settop(l, base);
            return Err("fibertrace: package library not loaded".into());
        }
        push_lib(l, FIBER_FNS);
        let fiber_t = ffi::lua_gettop(l);
        for (k, f) in super::clock::FIBER_CLOCK_FNS {
            ffi::lua_pushcfunction(l, *f);
            set_field(l, fiber_t, k);
        }
        ffi::lua_pushvalue(l, fiber_t);
        set_field(l, loaded, c"fiber");
        push_lib(l, super::clock::CLOCK_FNS);
        let clock_t = ffi::lua_gettop(l);
        ffi::lua_pushvalue(l, clock_t);
        set_field(l, loaded, c"clock");

        // The Lua part (see `prelude`): (fiber, clock, hidden) -> make_error, info metatable.
        ffi::lua_pushvalue(l, fiber_t);
        ffi::lua_pushvalue(l, clock_t);
        ffi::lua_createtable(l, 0, 3);
        let hidden = ffi::lua_gettop(l);
        ffi::lua_pushcfunction(l, f_stall);
        set_field(l, hidden, c"stall");
        ffi::lua_pushcfunction(l, f_set_close_mode);
        set_field(l, hidden, c"set_close_mode");
        if cfg!(feature = "luajit") {
            let ptrs = super::clock::ffi_pointers();
            ffi::lua_createtable(l, 0, ptrs.len() as c_int);
            for (name, p) in ptrs {
                push_str(l, name);
                ffi::lua_pushlightuserdata(l, p);
                ffi::lua_rawset(l, -3);
            }
            set_field(l, hidden, c"ptr");
        }
        if let Err(e) = run_chunk(l, super::prelude::PRELUDE, c"=fiber", 3, 2) {
            ffi::lua_settop(l, base);
            return Err(format!("fibertrace: cannot set up the fiber module: {e}"));
        }
        let info_mt_ref = ffi::luaL_ref(l, REG);
        let error_ctor_ref = ffi::luaL_ref(l, REG);
        ffi::lua_settop(l, base);
        Ok(HostState {
            main_l: l,
            recs: Default::default(),
            parent_backtrace: false,
            pool: Vec::new(),
            info_ctor_ref,
            info_mt_ref,
            error_ctor_ref,
            objs_ref,
            weak_objs_ref,
            obj_free: Vec::new(),
            obj_next: 0,
            fiber_mt_ref,
            channel_mt_ref,
            cond_mt_ref,
            report_errors: true,
            fiber_name: std::sync::Arc::from("lua"),
            default_slice: Slice::NONE,
            run_slice: None,
            watchdog_by_slice: false,
            graceful_close: false,
        })
    }
}

/// The functions of the `fiber` module (the clocks come from [`super::clock`]).
const FIBER_FNS: &[(&CStr, ffi::lua_CFunction)] = &[
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
    (c"top", f_top),
    (c"top_enable", f_top_enable),
    (c"top_disable", f_top_disable),
    (c"kill", f_cancel),
    (c"cancel", f_cancel),
    (c"testcancel", f_testcancel),
    (c"wakeup", f_wakeup),
    (c"join", f_join),
    (c"set_joinable", f_set_joinable),
    (c"channel", f_channel),
    (c"cond", f_cond),
    (c"parent_backtrace_enable", f_pbt_enable),
    (c"parent_backtrace_disable", f_pbt_disable),
    (c"check_slice", f_check_slice),
    (c"set_slice", f_set_slice),
    (c"extend_slice", f_extend_slice),
    (c"set_max_slice", f_set_max_slice),
];

/// The methods of fiber objects (Tarantool's `lbox_fiber_meta`).
const FIBER_METHODS: &[(&CStr, ffi::lua_CFunction)] = &[
    (c"id", f_id),
    (c"name", f_name),
    (c"cancel", f_cancel),
    (c"status", f_status),
    (c"testcancel", f_testcancel),
    (c"info", m_info),
    (c"csw", m_csw),
    (c"join", f_join),
    (c"set_joinable", f_set_joinable),
    (c"set_max_slice", f_set_max_slice),
    (c"wakeup", f_wakeup),
    (c"__serialize", m_serialize),
    (c"__tostring", m_tostring),
];

/// The metamethods of fiber objects.
const FIBER_META: &[(&CStr, ffi::lua_CFunction)] =
    &[(c"__tostring", m_tostring), (c"__serialize", m_serialize)];

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

/// A metatable with its methods (found through a table `__index`, or through the C
/// function `index` given the methods table as its upvalue), metamethods, and `__metatable`
/// = `name` (what `getmetatable` shows, as Tarantool's type names); returns its registry
/// reference.
///
/// # Safety
/// `l` valid, room for 4 values.
unsafe fn new_metatable(
    l: *mut ffi::lua_State,
    name: &CStr,
    methods: &[(&CStr, ffi::lua_CFunction)],
    meta: &[(&CStr, ffi::lua_CFunction)],
    index: Option<ffi::lua_CFunction>,
) -> c_int {
    // SAFETY: fresh tables, plain sets.
    unsafe {
        ffi::lua_createtable(l, 0, meta.len() as c_int + 2);
        let mt = ffi::lua_gettop(l);
        push_lib(l, methods);
        if let Some(f) = index {
            ffi::lua_pushcclosure(l, f, 1);
        }
        set_field(l, mt, c"__index");
        for (k, f) in meta {
            ffi::lua_pushcfunction(l, *f);
            set_field(l, mt, k);
        }
        ffi::lua_pushstring(l, name.as_ptr());
        set_field(l, mt, c"__metatable");
        ffi::luaL_ref(l, REG)
    }
}

/// Whether the value at `idx` is a userdata with the metatable `mt_ref`; its block if so.
///
/// # Safety
/// `l` valid, room for 2 values.
pub(crate) unsafe fn check_ud<T>(
    l: *mut ffi::lua_State,
    idx: c_int,
    mt_ref: c_int,
) -> Option<*mut T> {
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

pub(crate) fn mt_refs() -> Option<(c_int, c_int, c_int)> {
    with_host(|h| (h.fiber_mt_ref, h.channel_mt_ref, h.cond_mt_ref))
}

/// The id of the fiber object at `idx`, if it is one.
///
/// # Safety
/// `l` valid.
unsafe fn fiber_ud(l: *mut ffi::lua_State, idx: c_int) -> Option<FiberId> {
    let (fmt, _, _) = mt_refs()?;
    // SAFETY: per the contract.
    unsafe { check_ud::<FiberUd>(l, idx, fmt).map(|p| (*p).fid) }
}

/// The fiber object at `idx` (`luaL_checkudata`): its id, or the bad-argument error.
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn check_fiber_id(l: *mut ffi::lua_State, idx: c_int) -> Result<FiberId, LErr> {
    // SAFETY: per the contract.
    unsafe { fiber_ud(l, idx).ok_or_else(|| raw::type_error(l, idx, "fiber")) }
}

/// A fiber id from a number: truncated, as Tarantool converts it (`None`: no fiber's id).
fn id_of_number(n: f64) -> Option<FiberId> {
    (0.0..18_446_744_073_709_551_616.0)
        .contains(&n)
        .then_some(n as FiberId)
}

/// How a fiber is found (see the module docs).
#[derive(Clone)]
enum Found {
    /// Its function runs (or has not started yet).
    Live(fibertrace_fiber::Fiber),
    /// Its function ended; joinable, not joined yet.
    Ended,
}

fn find(fid: FiberId) -> Option<Found> {
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
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn check_fiber(
    l: *mut ffi::lua_State,
    idx: c_int,
    at: bool,
) -> Result<(FiberId, Found), LErr> {
    // SAFETY: per the contract.
    let fid = unsafe {
        if type_of(l, idx) == ffi::LUA_TNUMBER {
            to_number(l, idx).and_then(id_of_number)
        } else {
            Some(check_fiber_id(l, idx)?)
        }
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
/// and `fiber.new` make the object of a new fiber together with its record, in
/// [`spawn_lua`].)
///
/// # Safety
/// `l` valid.
unsafe fn push_fiber_object(l: *mut ffi::lua_State, fid: FiberId) -> Result<(), LErr> {
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
    // SAFETY: a fresh userdata with the fiber metatable, stored in the host's object table
    // (at the slot taken above) or in its weak table; left on top.
    let made = unsafe {
        raw::protect(l, &[], &mut |l| {
            let p = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
            p.write(FiberUd { fid });
            super::raw::rawgeti(l, REG, fmt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            if slot > 0 {
                super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
                ffi::lua_pushvalue(l, -2);
                super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
            } else {
                super::raw::rawgeti(l, REG, weak as ffi::lua_Integer);
                ffi::lua_pushvalue(l, -2);
                super::raw::rawseti(l, -2, fid as ffi::lua_Integer);
            }
            ffi::lua_settop(l, -2);
            1
        })
    };
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
/// caller's).
fn remove_rec(h: &mut HostState, fid: FiberId) -> Option<Rec> {
    let mut rec = h.recs.remove(&fid)?;
    free_obj_slot(h, &rec);
    release_storage(h, &mut rec);
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

/// Drops a fiber's `storage` table (when its function ends, as Tarantool's `on_stop`).
fn release_storage(h: &HostState, rec: &mut Rec) {
    if rec.storage_ref > 0 {
        // SAFETY: the reference was made by `storage` in this host's registry.
        unsafe { ffi::luaL_unref(h.main_l, REG, rec.storage_ref) };
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
    let msg = (!ok).then(|| unsafe { raw::error_bytes(t, -1) });
    let report = with_host(|h| {
        // One lookup: a joinable fiber's record stays for its joiner. Its storage goes now.
        let mut rec = match h.recs.entry(fid) {
            Entry::Occupied(e) if e.get().joinable => {
                let r = e.into_mut();
                r.done = Some(ok);
                let storage = std::mem::take(&mut r.storage_ref);
                if storage > 0 {
                    // SAFETY: the reference was made by `storage` in this host's registry.
                    unsafe { ffi::luaL_unref(h.main_l, REG, storage) };
                }
                return None;
            }
            Entry::Occupied(e) => e.remove(),
            Entry::Vacant(_) => return None,
        };
        free_obj_slot(h, &rec);
        release_storage(h, &mut rec);
        release_thread(h, rec.thread, rec.thread_ref);
        // A cancelled fiber's error is not a failure to report (Tarantool's rule).
        let report = h.report_errors && !ok && !rec.fiber.control_block().is_cancelled();
        report.then(|| rec.fiber.name())
    })
    .flatten();
    if let (Some(name), Some(msg)) = (report, msg) {
        // (A closed stderr is no reason to fail: the write's error is dropped.) The name is
        // written as its bytes.
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "fibertrace: fiber {fid} \"")
            .and_then(|()| err.write_all(&fibertrace_fiber::sched::name_to_bytes(&name)))
            .and_then(|()| err.write_all(b"\" failed: "))
            .and_then(|()| err.write_all(&msg))
            .and_then(|()| writeln!(err, "\nstack traceback:\n{}", trace.unwrap_or_default()));
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
        if SPAWNING.with(|s| s.0.get()) == t as usize {
            // Its spawn failed: the spawner takes the thread back.
            return;
        }
        // Dropped inside the fiber (cancelled before it started) the fiber is current; while
        // a scheduler is dropped it is not, and the record is found by its thread — a dead
        // fiber's (the scheduler marks a fiber dead before dropping its body): a thread that
        // went back to the pool may run a live fiber now.
        let fid = fibertrace_fiber::current_id();
        with_host(|h| {
            let fid = if h.recs.get(&fid).is_some_and(|r| r.thread == t) {
                fid
            } else {
                let dead = |r: &Rec| r.thread == t && r.fiber.control_block().is_dead();
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
/// closure); the fiber's function and arguments go above it. A new one is made on `l` (the
/// calling state, or the idle main state), in a protected call (`not enough memory` comes
/// back as the error), outside the host state's borrow: an allocation can run `__gc`
/// finalizers, which may use the host (`fiber.create`).
///
/// # Safety
/// `l` is a running Lua thread of this thread's host, or its idle main state.
unsafe fn take_thread(l: *mut ffi::lua_State) -> Result<(*mut ffi::lua_State, c_int), LErr> {
    let pooled = with_host(|h| h.pool.pop()).ok_or_else(no_host)?;
    if let Some(p) = pooled {
        return Ok(p);
    }
    let mut made = (std::ptr::null_mut(), 0);
    // SAFETY: per the contract; the thread is made on `l` and anchored in the registry, and
    // its handler is made on `l` and moved to it (a fresh thread has room for it).
    unsafe {
        raw::protect(l, &[], &mut |l| {
            let t = ffi::lua_newthread(l);
            ffi::lua_pushcfunction(l, f_msgh);
            ffi::lua_xmove(l, t, 1);
            made = (t, ffi::luaL_ref(l, REG));
            0
        })
    }?;
    Ok(made)
}

/// Set while a fiber for the thread in it is being spawned: if the spawn fails, the body
/// dropped unrun is not a fiber cancelled before it started (the caller takes the thread
/// back).
#[derive(Default)]
struct Spawning(std::cell::Cell<usize>);

thread_local! {
    static SPAWNING: Spawning = Spawning::default();
}

/// `fiber.create(fn, ...)` / `fiber.new(fn, ...)`: the function and its arguments are the
/// whole stack of `l`; they move to the new fiber, and its object is left in their place.
/// `starts_now`: the caller starts it right after (`fiber.create`), which dates it.
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn spawn_lua(l: *mut ffi::lua_State, what: &str, starts_now: bool) -> Result<FiberId, LErr> {
    // SAFETY: per the contract.
    if unsafe { type_of(l, 1) } != ffi::LUA_TFUNCTION {
        return Err(format!("fiber.{what}(function, ...): bad arguments").into());
    }
    if fibertrace_fiber::current_id() == 0 {
        return Err(format!("fiber.{what}: not in a fiber").into());
    }
    // SAFETY: per the contract.
    let n = unsafe { ffi::lua_gettop(l) };
    // SAFETY: per the contract.
    let (t, tref) = unsafe { take_thread(l) }?;
    let (parent_bt, creator_root, name, objs, mt, slot) = with_host(|h| {
        let root = if h.parent_backtrace {
            h.recs
                .get(&fibertrace_fiber::current_id())
                .map(|r| r.thread)
        } else {
            None
        };
        let slot = h.obj_free.pop().unwrap_or_else(|| {
            h.obj_next += 1;
            h.obj_next
        });
        (
            h.parent_backtrace,
            root,
            h.fiber_name.clone(),
            h.objs_ref,
            h.fiber_mt_ref,
            slot,
        )
    })
    .ok_or_else(no_host)?;
    // Undoes the above when the fiber cannot be made.
    let give_back = |err: LErr| {
        with_host(|h| {
            h.obj_free.push(slot);
            release_thread(h, t, tref);
        });
        err
    };
    // The new thread takes the function and its arguments (the message handler is below
    // them): room for them, or an error as Tarantool's `lua_checkstack` would give.
    // SAFETY: `t` is a clean thread of this host.
    if unsafe { ffi::lua_checkstack(t, n) } == 0 {
        return Err(give_back(LErr::At(format!(
            "fiber.{what}: too many arguments ({}) for the fiber's Lua stack",
            n - 1
        ))));
    }
    // The fiber's object, made first (the allocations that can fail), in its slot of the
    // host's object table (which lives as long as the fiber); its id is written once known.
    let mut ud: *mut FiberUd = std::ptr::null_mut();
    // SAFETY: a fresh userdata with the fiber metatable goes into its slot of the host's
    // object table and is left on top of `l`, above the function and its arguments.
    let made = unsafe {
        raw::protect(l, &[], &mut |l| {
            ud = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
            ud.write(FiberUd { fid: 0 });
            super::raw::rawgeti(l, REG, mt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
            ffi::lua_pushvalue(l, -2);
            super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
            ffi::lua_settop(l, -2);
            1
        })
    };
    if let Err(e) = made {
        // (The error value stays on top for the wrapper.)
        return Err(give_back(e));
    }
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
    let body = LuaBody { t, nargs: n - 1 };
    SPAWNING.with(|s| s.0.set(t as usize));
    let spawned = b.try_spawn(move || body.run());
    SPAWNING.with(|s| s.0.set(0));
    let fiber = match spawned {
        Ok(h) => h.into_fiber(),
        Err(e) => {
            // SAFETY: the slot was filled above: emptied (a store into a slot that exists).
            unsafe {
                super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
                ffi::lua_pushnil(l);
                super::raw::rawseti(l, -2, slot as ffi::lua_Integer);
                ffi::lua_settop(l, -3);
            }
            return Err(give_back(LErr::plain(format!("fiber.{what}: {e}"))));
        }
    };
    let fid = fiber.id();
    with_host(|h| {
        h.recs.insert(
            fid,
            Rec {
                fiber,
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                obj_slot: slot,
                storage_ref: 0,
                max_slice: None,
            },
        );
    })
    .ok_or_else(no_host)?;
    // SAFETY: the object is on top, its block ours; the function and its arguments move to
    // `t` (room checked above), leaving the object alone on `l`'s stack.
    unsafe {
        (*ud).fid = fid;
        ffi::lua_insert(l, 1);
        ffi::lua_xmove(l, t, n);
    }
    Ok(fid)
}

unsafe fn create_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let fid = unsafe { spawn_lua(l, "create", true) }?;
    // Inside a finalizer it starts at this fiber's next switch (see `finalize`).
    // SAFETY: C function contract.
    if !unsafe { super::finalize::may_switch(l) } {
        return Ok(1);
    }
    // Start it now: it runs, and this fiber continues as soon as it yields. Not a
    // cancellation point (Tarantool's `fiber_start`): a cancellation of this fiber meanwhile
    // is raised at its next one.
    let quiet = fibertrace_fiber::sched::CancelQuiet::new();
    fibertrace_fiber::yield_to_id(fid);
    drop(quiet);
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
    name: &[u8],
    source: &[u8],
    args: &[Vec<u8>],
) -> Result<(), ScriptError> {
    let err = ScriptError::text;
    let Some(main_l) = with_host(|h| h.main_l) else {
        return Err(err("fibertrace: no Lua host on this thread".into()));
    };
    // SAFETY: the host's main state, idle (no Lua runs on it).
    let (t, tref) = match unsafe { take_thread(main_l) } {
        Ok(t) => t,
        Err(e) => {
            let m = match e {
                // SAFETY: as above; a failed protected call left its error on top.
                LErr::Raised => unsafe {
                    let m = raw::error_text(main_l, -1);
                    ffi::lua_settop(main_l, -2);
                    m
                },
                LErr::At(m) | LErr::Plain(m) => m,
            };
            return Err(err(format!("fibertrace: cannot start the script: {m}")));
        }
    };
    let Some(me) = fibertrace_fiber::current() else {
        with_host(|h| release_thread(h, t, tref));
        return Err(err("fibertrace: not in a fiber".into()));
    };
    let fid = me.id();
    let chunkname = std::ffi::CString::new(
        name.iter()
            .map(|&b| if b == 0 { b'?' } else { b })
            .collect::<Vec<u8>>(),
    )
    .unwrap_or_default();
    // SAFETY: `t` is a clean thread of this host, idle; the source bytes outlive the load.
    // The arguments are pushed in a protected call (as many as the stack takes: past it, or
    // out of memory, the script does not start, with the error said).
    let loaded = unsafe {
        let st = ffi::luaL_loadbuffer(t, source.as_ptr().cast(), source.len(), chunkname.as_ptr());
        if st != ffi::LUA_OK {
            Err(raw::error_text(t, -1))
        } else {
            let pushed = raw::protect(t, &[], &mut |t| {
                #[cfg(not(feature = "luajit"))]
                if ffi::lua_checkstack(t, args.len() as c_int + 1) == 0 {
                    push_str(t, "stack overflow");
                    ffi::lua_error(t);
                }
                // (LuaJIT grows the stack at each push, or raises `stack overflow`.)
                for a in args {
                    ffi::lua_pushlstring(t, a.as_ptr().cast(), a.len());
                }
                args.len() as c_int
            });
            match pushed {
                Ok(_) => Ok(()),
                Err(_) => Err(format!(
                    "fibertrace: cannot pass {} arguments to the script: {} (they are all in \
                     the global table arg)",
                    args.len(),
                    raw::error_text(t, -1)
                )),
            }
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
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                obj_slot: 0,
                storage_ref: 0,
                max_slice: None,
            },
        )
    });
    // SAFETY: `t` holds the handler, the chunk and its arguments, and is ours.
    let ok = unsafe { call_in_thread(t, args.len() as c_int) };
    let r = if ok {
        Ok(())
    } else {
        // SAFETY: the error is on top of our idle thread.
        let b = unsafe { raw::error_bytes(t, -1) };
        Err(ScriptError {
            message: String::from_utf8_lossy(&b).into_owned(),
            message_bytes: b,
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

unsafe fn yield_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn sleep_body(l: *mut ffi::lua_State) -> LResult {
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

unsafe fn testcancel_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn stall_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { super::finalize::check_switch(l, "fiber.stall") }?;
    fibertrace_fiber::suspend();
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_stall, stall_body);

/// The hidden setter of compat's `fiber_channel_close_mode` (true: graceful).
unsafe fn set_close_mode_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let graceful = unsafe { ffi::lua_toboolean(l, 1) } != 0;
    with_host(|h| h.graceful_close = graceful);
    Ok(0)
}
lua_fn!(f_set_close_mode, set_close_mode_body);

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

/// `fiber.id([fiber])` and `fiber_object:id()`: no argument is the current fiber (so
/// `fiber.self().id()` too); otherwise a fiber object (of a dead fiber too).
unsafe fn id_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn find_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn status_body(l: *mut ffi::lua_State) -> LResult {
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
fn rec_fiber(fid: FiberId) -> Option<fibertrace_fiber::Fiber> {
    with_host(|h| h.recs.get(&fid).map(|r| r.fiber.clone())).flatten()
}

/// `fiber.name([fiber,] [name [, {truncate = true}]])` and `fiber_object:name(...)`, as
/// Tarantool 2.6: a fiber object first names the fiber; then one or two more arguments set
/// the name (a string or a number; too long raises unless `truncate`; cut at a NUL byte),
/// and any other count reads it.
unsafe fn name_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn tostring_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn serialize_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn live_arg(l: *mut ffi::lua_State) -> Result<fibertrace_fiber::Fiber, LErr> {
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

unsafe fn csw_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn push_storage(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn index_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn cancel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let (_, found) = unsafe { check_fiber(l, 1, true) }?;
    if let Found::Live(f) = found {
        f.cancel();
    }
    cancelled_check()?;
    Ok(0)
}
lua_fn!(f_cancel, cancel_body);

unsafe fn wakeup_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn set_joinable_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn to_error_object(l: *mut ffi::lua_State, etype: &str) -> Result<(), LErr> {
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
unsafe fn error_object(l: *mut ffi::lua_State, msg: &str, etype: &str) -> Result<(), LErr> {
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
unsafe fn join_body(l: *mut ffi::lua_State) -> LResult {
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

unsafe fn info_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn m_info_body(l: *mut ffi::lua_State) -> LResult {
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
unsafe fn push_top_row(l: *mut ffi::lua_State, row: &fibertrace_fiber::sched::TopRow) {
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
unsafe fn top_body(l: *mut ffi::lua_State) -> LResult {
    if !fibertrace_fiber::sched::top_enabled() {
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
unsafe fn top_table(l: *mut ffi::lua_State, fibers: &[(FiberId, std::sync::Arc<str>)]) {
    // SAFETY: per the contract; fresh tables.
    unsafe {
        ffi::lua_createtable(l, 0, 2);
        ffi::lua_pushnumber(l, 0.0);
        ffi::lua_setfield(l, -2, c"cpu_misses".as_ptr());
        ffi::lua_createtable(l, 0, fibers.len() as c_int + 1);
        if let Some(row) = fibertrace_fiber::sched::top_sched_row() {
            push_top_row(l, &row);
            ffi::lua_setfield(l, -2, c"1/sched".as_ptr());
        }
        for (fid, name) in fibers {
            if let Some(row) = fibertrace_fiber::sched::top_fiber_row(*fid) {
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

unsafe fn top_enable_body(_l: *mut ffi::lua_State) -> LResult {
    fibertrace_fiber::sched::top_enable();
    Ok(0)
}
lua_fn!(f_top_enable, top_enable_body);

unsafe fn top_disable_body(_l: *mut ffi::lua_State) -> LResult {
    fibertrace_fiber::sched::top_disable();
    Ok(0)
}
lua_fn!(f_top_disable, top_disable_body);

// ---- slices ----

const BAD_SLICE: &str = "slice must be a number or a table {warn = <number>, err = <number>}";

/// Reads a slice argument: a number (the error part; no warning) or `{warn = n, err = n}`
/// (numbers or numeric strings, read raw); each part `>= 0` (NaN is not).
///
/// # Safety
/// `l` valid.
unsafe fn slice_arg(l: *mut ffi::lua_State, idx: c_int) -> Result<Slice, LErr> {
    // SAFETY: per the contract; raw reads of two fields (their keys are made in a protected
    // call), popped.
    let slice = unsafe {
        if ffi::lua_type(l, idx) == ffi::LUA_TTABLE {
            raw::protect(l, &[], &mut |l| {
                push_str(l, "warn");
                push_str(l, "err");
                2
            })?;
            let idx = ffi::lua_absindex(l, idx);
            let part = |k: c_int| {
                ffi::lua_pushvalue(l, k);
                ffi::lua_rawget(l, idx);
                let v = if ffi::lua_type(l, -1) == ffi::LUA_TNUMBER
                    || ffi::lua_type(l, -1) == ffi::LUA_TSTRING
                {
                    to_number(l, -1)
                } else {
                    None
                };
                ffi::lua_settop(l, -2);
                v
            };
            let parts = (part(-2), part(-1));
            ffi::lua_settop(l, -3);
            match parts {
                (Some(warn), Some(err)) => Slice { warn, err },
                _ => return Err(LErr::plain(BAD_SLICE)),
            }
        } else if let Some(err) = to_number(l, idx) {
            Slice {
                warn: Slice::INFINITE,
                err,
            }
        } else {
            return Err(LErr::plain(BAD_SLICE));
        }
    };
    if !(slice.warn >= 0.0 && slice.err >= 0.0) {
        return Err(LErr::plain("slice value must be >= 0"));
    }
    Ok(slice)
}

/// The current run of the current fiber: its id and the switch count the run began with.
fn current_run() -> (FiberId, u64) {
    match fibertrace_fiber::current() {
        Some(f) => (f.id(), f.control_block().csw()),
        None => (0, 0),
    }
}

/// The slice of the current run (its max slice unless set or extended in this run).
fn run_slice(h: &HostState, run: (FiberId, u64)) -> Slice {
    match h.run_slice {
        Some((r, s)) if r == run => s,
        _ => h
            .recs
            .get(&run.0)
            .and_then(|r| r.max_slice)
            .unwrap_or(h.default_slice),
    }
}

unsafe fn set_slice_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 1 {
        return Err(LErr::plain("fiber.set_slice(slice): bad arguments"));
    }
    // SAFETY: as above.
    let s = unsafe { slice_arg(l, 1) }?;
    let run = current_run();
    with_host(|h| h.run_slice = Some((run, s)));
    Ok(0)
}
lua_fn!(f_set_slice, set_slice_body);

unsafe fn extend_slice_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 1 {
        return Err(LErr::plain("fiber.extend_slice(slice): bad arguments"));
    }
    // SAFETY: as above.
    let s = unsafe { slice_arg(l, 1) }?;
    let run = current_run();
    with_host(|h| {
        let cur = run_slice(h, run);
        let ext = Slice {
            warn: cur.warn + s.warn,
            err: cur.err + s.err,
        };
        h.run_slice = Some((run, ext));
    });
    Ok(0)
}
lua_fn!(f_extend_slice, extend_slice_body);

/// `fiber.check_slice()`: warns once per run (stderr) past the warning part, raises `fiber
/// slice is exceeded` past the error part, counted from when the fiber last got the CPU.
unsafe fn check_slice_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    if unsafe { ffi::lua_gettop(l) } != 0 {
        return Err(LErr::plain("fiber.check_slice(): bad arguments"));
    }
    let Some(ran) = fibertrace_fiber::sched::current_run_time() else {
        return Ok(0);
    };
    let ran = ran.as_secs_f64();
    let run = current_run();
    let warn = with_host(|h| {
        let mut s = run_slice(h, run);
        let warn = (s.warn < ran).then_some(s.warn);
        if warn.is_some() {
            s.warn = Slice::INFINITE;
            h.run_slice = Some((run, s));
        }
        (warn, s.err < ran)
    })
    .ok_or_else(no_host)?;
    if let Some(w) = warn.0 {
        let name = fibertrace_fiber::current()
            .map(|f| f.name())
            .unwrap_or_default();
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "fibertrace: fiber {} \"", run.0)
            .and_then(|()| err.write_all(&fibertrace_fiber::sched::name_to_bytes(&name)))
            .and_then(|()| {
                writeln!(
                    err,
                    "\": fiber has not yielded for more than {w:.3} seconds"
                )
            });
    }
    if warn.1 {
        return Err(LErr::plain("fiber slice is exceeded"));
    }
    Ok(0)
}
lua_fn!(f_check_slice, check_slice_body);

/// `fiber.set_max_slice(slice)` (the default of fibers without their own) and
/// `fiber.set_max_slice(f, slice)` / `f:set_max_slice(slice)` (a fiber's own). A new max
/// slice applies to the current run at once when it is the current fiber's.
///
/// The default also drives fibertrace's stall detector (an addition to Tarantool): while it
/// has a finite part, a fiber that runs longer than that (the warning part, else the error
/// part) without yielding is reported with its stack, whether or not it calls
/// `check_slice()`.
unsafe fn set_max_slice_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let top = unsafe { ffi::lua_gettop(l) };
    if top != 1 && top != 2 {
        return Err(LErr::plain(
            "fiber.set_max_slice([id,] slice): bad arguments",
        ));
    }
    // SAFETY: as above.
    let s = unsafe { slice_arg(l, top) }?;
    let run = current_run();
    if top == 2 {
        // SAFETY: as above.
        let (fid, _) = unsafe { check_fiber(l, 1, false) }?;
        with_host(|h| {
            if let Some(r) = h.recs.get_mut(&fid) {
                r.max_slice = Some(s);
            }
            if fid == run.0 {
                h.run_slice = Some((run, s));
            }
        });
        return Ok(0);
    }
    let started_by_us = with_host(|h| {
        h.default_slice = s;
        let own = h.recs.get(&run.0).and_then(|r| r.max_slice).is_some();
        if !own {
            h.run_slice = Some((run, s));
        }
        h.watchdog_by_slice
    })
    .ok_or_else(no_host)?;
    let part = if s.warn < Slice::INFINITE {
        s.warn
    } else {
        s.err
    };
    if part < Slice::INFINITE && part > 0.0 {
        let threshold = Duration::from_secs_f64(part);
        if fibertrace_fiber::watchdog::is_running() {
            fibertrace_fiber::watchdog::set_threshold(threshold);
        } else {
            fibertrace_fiber::watchdog::start(fibertrace_fiber::watchdog::Config {
                threshold,
                ..Default::default()
            });
            with_host(|h| h.watchdog_by_slice = true);
        }
    } else if started_by_us && part >= Slice::INFINITE {
        fibertrace_fiber::watchdog::stop();
        with_host(|h| h.watchdog_by_slice = false);
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

// ---- channels and conditions ----
//
// `fiber.channel` and `fiber.cond`: Tarantool's channel and condition objects over the
// runtime's `Channel` and `Cond`, with Tarantool 2.6's argument checks and texts.
// Invariants: a channel's values are registry references owned by exactly one `Msg` at a
// time (released exactly once, never while queued); a channel or condition object's block
// is initialised before its metatable (with `__gc`) is set, and emptied once by `__gc`; a
// blocked operation keeps its object alive (it stays at index 1 of the call).

/// A channel's userdata: the runtime's channel of registry references to the values.
pub(crate) struct ChannelUd {
    ch: Option<fibertrace_fiber::Channel<Msg>>,
}

pub(crate) struct CondUd {
    cond: Option<fibertrace_fiber::Cond>,
}

/// `fiber.channel([size])`: absent or nil is 0; a number or numeric string is truncated to an
/// integer (`lua_tointeger`'s way: NaN and numbers past the 64-bit range are taken as
/// negative, as on x86_64); negative is an error. Room is not reserved up front, so any size
/// is accepted.
unsafe fn channel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let cap = match unsafe { type_of(l, 1) } {
        t if t <= ffi::LUA_TNIL => 0,
        // SAFETY: as above.
        _ => match unsafe { to_number(l, 1) } {
            Some(n) if n.is_finite() && (-9.3e18..9.2e18).contains(&n) && n.trunc() >= 0.0 => {
                n.trunc() as usize
            }
            Some(_) => return Err("fiber.channel(size): negative size".into()),
            None => return Err("fiber.channel(size): bad arguments".into()),
        },
    };
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block (made in a protected call) is initialised before its
    // metatable (with __gc) is set.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            let p = ffi::lua_newuserdata(l, std::mem::size_of::<ChannelUd>()).cast::<ChannelUd>();
            p.write(ChannelUd {
                ch: Some(fibertrace_fiber::channel(cap)),
            });
            super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            1
        })
    }?;
    Ok(1)
}
lua_fn!(f_channel, channel_body);

/// The channel at index 1 (Tarantool's `luaT_checkfiberchannel`): none there is `usage:
/// <usage>`; anything but a channel is a bad argument.
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn channel_arg(
    l: *mut ffi::lua_State,
    usage: &str,
) -> Result<fibertrace_fiber::Channel<Msg>, LErr> {
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `channel_body`.
    unsafe {
        if ffi::lua_gettop(l) < 1 {
            return Err(format!("usage: {usage}").into());
        }
        match check_ud::<ChannelUd>(l, 1, cmt) {
            Some(p) => (*p)
                .ch
                .clone()
                .ok_or_else(|| format!("usage: {usage}").into()),
            None => Err(raw::type_error(l, 1, "fiber.channel")),
        }
    }
}

/// A value in a channel: a reference in the registry, released when the message is dropped —
/// whoever drops it (a receiver after pushing the value, a send that failed, a channel that
/// is closed or collected with values in it, a sender's cancellation). A message is owned by
/// exactly one place at a time, so its reference is released exactly once and never while
/// it is still queued.
pub(crate) struct Msg(c_int);

impl Drop for Msg {
    fn drop(&mut self) {
        // The registry is shared by all threads of the state: the main state will do. While
        // the host is borrowed (a message dropped by a `__gc` finalizer that an allocation ran
        // inside the host's borrow), the reference waits in a queue for the next message
        // dropped outside it. Without a host (it is being torn down, its state about to
        // close) the reference goes with the state.
        let r = self.0;
        let done = with_host(|h| {
            // SAFETY: the main state of this thread's host; the reference was made by
            // `ch_put_body` and is released only here (or by `release_pending`).
            unsafe {
                release_pending(h.main_l);
                ffi::luaL_unref(h.main_l, REG, r);
            }
        });
        if done.is_none() {
            PENDING_UNREFS.with(|p| {
                if let Ok(mut p) = p.try_borrow_mut() {
                    p.push(r);
                    PENDING.with(|f| f.set(true));
                }
            });
        }
    }
}

thread_local! {
    /// References of messages dropped while the host was borrowed, to release.
    static PENDING_UNREFS: std::cell::RefCell<Vec<c_int>> = const { std::cell::RefCell::new(Vec::new()) };
    /// `PENDING_UNREFS` is not empty.
    static PENDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Releases the references of messages dropped while the host was borrowed.
///
/// # Safety
/// `l` is a state of this thread's host.
unsafe fn release_pending(l: *mut ffi::lua_State) {
    if !PENDING.with(|f| f.replace(false)) {
        return;
    }
    let refs = PENDING_UNREFS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for r in refs {
        // SAFETY: per the contract; each reference was queued once, by its message's drop.
        unsafe { ffi::luaL_unref(l, REG, r) };
    }
}

/// Releases the queued references now, if any and the host is not borrowed.
fn drain_pending() {
    if PENDING.with(|f| f.get()) {
        // SAFETY: the main state of this thread's host.
        with_host(|h| unsafe { release_pending(h.main_l) });
    }
}

/// Forgets references queued for another host (a new host on this thread starts clean).
fn clear_pending() {
    PENDING_UNREFS.with(|p| p.borrow_mut().clear());
    PENDING.with(|f| f.set(false));
}

const PUT_USAGE: &str = "usage: channel:put(var [, timeout])";
const GET_USAGE: &str = "usage: channel:get([timeout])";

unsafe fn ch_put_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all Lua calls below).
    let ch = unsafe { channel_arg(l, "channel:put(var [, timeout])") }?;
    // SAFETY: as above.
    if unsafe { ffi::lua_gettop(l) } < 2 {
        return Err(PUT_USAGE.into());
    }
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 3, PUT_USAGE) }?;
    let waits = super::finalize::channel_would_wait(&ch, true, timeout);
    // SAFETY: as above.
    unsafe { super::finalize::check_wait(l, "channel:put", waits) }?;
    let mut r = ffi::LUA_REFNIL;
    // SAFETY: as above: the message is referenced in the registry (in a protected call: the
    // registry may grow).
    unsafe {
        raw::protect(l, &[2], &mut |l| {
            r = ffi::luaL_ref(l, REG);
            0
        })
    }?;
    let msg = Msg(r);
    drain_pending();
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
    let ch = unsafe { channel_arg(l, "channel:get([timeout])") }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, GET_USAGE) }?;
    let waits = super::finalize::channel_would_wait(&ch, false, timeout);
    // SAFETY: as above.
    unsafe { super::finalize::check_wait(l, "channel:get", waits) }?;
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
    let ch = unsafe { channel_arg(l, "channel:close()") }?;
    if with_host(|h| h.graceful_close).unwrap_or(false) {
        // Graceful (compat 'new'): queued values stay readable; blocked senders fail.
        ch.close();
    } else {
        // Tarantool 2.6: queued messages are dropped; blocked senders and receivers fail.
        ch.close_discarding();
    }
    Ok(0)
}
lua_fn!(ch_close, ch_close_body);

macro_rules! ch_query {
    ($name:ident, $body:ident, $usage:literal, |$ch:ident, $l:ident| $e:expr) => {
        unsafe fn $body($l: *mut ffi::lua_State) -> LResult {
            // SAFETY: C function contract.
            let $ch = unsafe { channel_arg($l, $usage) }?;
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
    "channel:is_closed()",
    |c, l| ffi::lua_pushboolean(l, c.is_closed() as c_int)
);
ch_query!(ch_count, ch_count_body, "channel:count()", |c, l| {
    ffi::lua_pushinteger(l, c.len() as ffi::lua_Integer)
});
ch_query!(ch_size, ch_size_body, "channel:size()", |c, l| {
    ffi::lua_pushinteger(l, c.capacity() as ffi::lua_Integer)
});
ch_query!(
    ch_is_empty,
    ch_is_empty_body,
    "channel:is_empty()",
    |c, l| ffi::lua_pushboolean(l, c.is_empty() as c_int)
);
ch_query!(ch_is_full, ch_is_full_body, "channel:is_full()", |c, l| {
    ffi::lua_pushboolean(l, c.is_full() as c_int)
});
ch_query!(
    ch_has_readers,
    ch_has_readers_body,
    "channel:has_readers()",
    |c, l| ffi::lua_pushboolean(l, c.has_readers() as c_int)
);
ch_query!(
    ch_has_writers,
    ch_has_writers_body,
    "channel:has_writers()",
    |c, l| ffi::lua_pushboolean(l, c.has_writers() as c_int)
);

unsafe fn ch_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let ch = unsafe { channel_arg(l, "") }?;
    let text = if ch.is_closed() {
        "channel: closed".to_string()
    } else {
        format!("channel: {}", ch.len())
    };
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, &text) }?;
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

/// The methods of channel objects.
pub(crate) const CHANNEL_METHODS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"put", ch_put),
    (c"get", ch_get),
    (c"close", ch_close),
    (c"is_closed", ch_is_closed),
    (c"count", ch_count),
    (c"size", ch_size),
    (c"is_empty", ch_is_empty),
    (c"is_full", ch_is_full),
    (c"has_readers", ch_has_readers),
    (c"has_writers", ch_has_writers),
];

/// The metamethods of channel objects.
pub(crate) const CHANNEL_META: &[(&std::ffi::CStr, ffi::lua_CFunction)] =
    &[(c"__gc", ch_gc), (c"__tostring", ch_tostring)];

unsafe fn cond_body(l: *mut ffi::lua_State) -> LResult {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block (made in a protected call) is initialised before its
    // metatable (with __gc) is set.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            let p = ffi::lua_newuserdata(l, std::mem::size_of::<CondUd>()).cast::<CondUd>();
            p.write(CondUd {
                cond: Some(fibertrace_fiber::Cond::new()),
            });
            super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            1
        })
    }?;
    Ok(1)
}
lua_fn!(f_cond, cond_body);

/// The condition at index 1 (Tarantool's `luaT_checkfibercond`), as [`channel_arg`].
///
/// # Safety
/// `l` is the calling state of a C function.
unsafe fn cond_arg(
    l: *mut ffi::lua_State,
    usage: &str,
) -> Result<*const fibertrace_fiber::Cond, LErr> {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `cond_body`.
    unsafe {
        if ffi::lua_gettop(l) < 1 {
            return Err(format!("usage: {usage}").into());
        }
        match check_ud::<CondUd>(l, 1, cmt) {
            Some(p) => (*p)
                .cond
                .as_ref()
                .map(|c| c as *const _)
                .ok_or_else(|| format!("usage: {usage}").into()),
            None => Err(raw::type_error(l, 1, "fiber.cond")),
        }
    }
}

const WAIT_USAGE: &str = "usage: cond:wait([timeout])";

unsafe fn cond_wait_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let c = unsafe { cond_arg(l, "cond:wait([timeout])") }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, WAIT_USAGE) }?;
    // SAFETY: as above.
    unsafe { super::finalize::check_switch(l, "cond:wait") }?;
    // SAFETY: the Cond lives in the userdata at index 1, which this call's frame references
    // across the wait.
    let signalled = unsafe {
        match timeout {
            None => {
                (*c).wait();
                true
            }
            Some(d) => (*c).wait_timeout(d),
        }
    };
    if !signalled {
        cancelled_check()?;
    }
    // Woken (not timed out) in a cancelled fiber: Tarantool returns true; the next
    // cancellation point raises.
    // SAFETY: as above.
    unsafe { ffi::lua_pushboolean(l, signalled as c_int) };
    Ok(1)
}
lua_fn!(cond_wait, cond_wait_body);

unsafe fn cond_signal_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l, "cond:signal()")?).signal() };
    Ok(0)
}
lua_fn!(cond_signal, cond_signal_body);

unsafe fn cond_broadcast_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l, "cond:broadcast()")?).broadcast() };
    Ok(0)
}
lua_fn!(cond_broadcast, cond_broadcast_body);

unsafe fn cond_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { cond_arg(l, "") }?;
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, "cond") }?;
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

/// The methods of condition objects.
pub(crate) const COND_METHODS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"wait", cond_wait),
    (c"signal", cond_signal),
    (c"broadcast", cond_broadcast),
];

/// The metamethods of condition objects.
pub(crate) const COND_META: &[(&std::ffi::CStr, ffi::lua_CFunction)] =
    &[(c"__gc", cond_gc), (c"__tostring", cond_tostring)];

#[cfg(test)]
mod msg_tests {
    use super::*;

    /// A message dropped while the host is borrowed (as by a `__gc` finalizer run by an
    /// allocation inside the borrow) has its reference released later: the registry does not
    /// grow over 10^5 such drops.
    #[test]
    fn messages_dropped_while_the_host_is_borrowed_release_their_references() {
        let host = super::super::LuaHost::new().unwrap();
        let l = with_host(|h| h.main_l).unwrap();
        // SAFETY: the host's main state, running nothing; every pushed value is popped
        // (luaL_ref pops its value).
        let first = unsafe {
            ffi::lua_pushboolean(l, 1);
            let r = ffi::luaL_ref(l, REG);
            ffi::luaL_unref(l, REG, r);
            r
        };
        for _ in 0..100_000 {
            // SAFETY: as above; the reference is the message's.
            let msg = Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            });
            with_host(|_| drop(msg)).unwrap();
            // The next message dropped outside a borrow releases the queued ones.
            // SAFETY: as above.
            drop(Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            }));
        }
        // SAFETY: as above.
        let last = unsafe {
            ffi::lua_pushboolean(l, 1);
            let r = ffi::luaL_ref(l, REG);
            ffi::luaL_unref(l, REG, r);
            r
        };
        assert!(last <= first + 2, "{first} -> {last}");
        drop(host);
    }
}
