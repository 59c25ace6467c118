//! Installing the `fiber` and `clock` modules: Tarantool's API over fibertrace fibers, as raw
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
//!
//! The functions themselves are in the sibling modules, by job: `spawn`, `fiber_fns`, `slice`,
//! `channel`, `cond`; the fiber objects in `objects`.

use std::ffi::{c_int, CStr};

use mlua::ffi;

use super::channel::*;
use super::cond::*;
use super::fiber_fns::*;
use super::objects::*;
use super::raw::{self, push_str, set_field};
use super::slice::*;
use super::spawn::*;
use super::{HostState, Slice};

/// Runs a Lua chunk made from `src` with `nargs` arguments (on the stack) and `nres` results,
/// protected; the error as text.
///
/// # Safety
/// `l` valid with the arguments on top.
pub(super) unsafe fn run_chunk(
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
        // The layout another process reads this process's Lua stacks with, checked against
        // this VM once (a mismatch only means no Lua frames in `fibertrace dump PID`).
        let _ = crate::frames::publish::check(l);
        super::vm_allocations_outside(l);
        raw::install_protect(l);
        clear_pending();
        // The constructor of `fiber.info()` entries (see `info::push_fiber`).
        if let Err(e) = run_chunk(l, &super::info::entry_ctors_source(), c"=fiber.info", 0, 1) {
            ffi::lua_settop(l, base);
            return Err(format!("fibertrace: cannot set up fiber.info: {e}"));
        }
        let info_ctor_ids = super::info::ctor_ids(l, ffi::lua_gettop(l));
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
        let (fiber_mt_ref, fiber_mt) =
            new_metatable(l, c"fiber", FIBER_METHODS, FIBER_META, Some(f_index));
        let (channel_mt_ref, channel_mt) =
            new_metatable(l, c"fiber.channel", CHANNEL_METHODS, CHANNEL_META, None);
        let (cond_mt_ref, cond_mt) = new_metatable(l, c"fiber.cond", COND_METHODS, COND_META, None);

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
        push_lib(
            l,
            &[
                (c"dump", super::export::f_dump),
                (c"heap", super::export::f_heap),
            ],
        );
        set_field(l, loaded, c"fibertrace");
        // `os.execute` that lets a SIGQUIT dump through (see `execute`), where `os` is.
        ffi::lua_getfield(l, loaded, c"os".as_ptr());
        if ffi::lua_type(l, -1) == ffi::LUA_TTABLE {
            let os = ffi::lua_gettop(l);
            ffi::lua_pushcfunction(l, super::execute::f_execute);
            set_field(l, os, c"execute");
        }
        ffi::lua_pop(l, 1);

        // The Lua part (see `prelude`): (fiber, clock, hidden) -> make_error, info metatable.
        ffi::lua_pushvalue(l, fiber_t);
        ffi::lua_pushvalue(l, clock_t);
        ffi::lua_createtable(l, 0, 3);
        let hidden = ffi::lua_gettop(l);
        ffi::lua_pushcfunction(l, f_stall);
        set_field(l, hidden, c"stall");
        ffi::lua_pushcfunction(l, f_set_close_mode);
        set_field(l, hidden, c"set_close_mode");
        ffi::lua_pushcfunction(l, super::hog::f_script_profiles);
        set_field(l, hidden, c"script_profiles");
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
            info_ctor_ids,
            info_mt_ref,
            error_ctor_ref,
            objs_ref,
            weak_objs_ref,
            obj_free: Vec::new(),
            obj_next: 0,
            obj_ready: Vec::new(),
            lost_joins: Default::default(),
            fiber_mt_ref,
            channel_mt_ref,
            cond_mt_ref,
            mt_tables: [fiber_mt, channel_mt, cond_mt],
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
pub(super) const FIBER_FNS: &[(&CStr, ffi::lua_CFunction)] = &[
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
pub(super) const FIBER_METHODS: &[(&CStr, ffi::lua_CFunction)] = &[
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
pub(super) const FIBER_META: &[(&CStr, ffi::lua_CFunction)] =
    &[(c"__tostring", m_tostring), (c"__serialize", m_serialize)];

/// # Safety
/// `l` valid, room for 3 values.
pub(super) unsafe fn push_lib(l: *mut ffi::lua_State, fns: &[(&CStr, ffi::lua_CFunction)]) {
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
pub(super) unsafe fn new_metatable(
    l: *mut ffi::lua_State,
    name: &CStr,
    methods: &[(&CStr, ffi::lua_CFunction)],
    meta: &[(&CStr, ffi::lua_CFunction)],
    index: Option<ffi::lua_CFunction>,
) -> (c_int, usize) {
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
        // The table's identity (tables do not move: both collectors are non-moving).
        let id = ffi::lua_topointer(l, mt) as usize;
        (ffi::luaL_ref(l, REG), id)
    }
}
