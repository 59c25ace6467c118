//! `__gc` finalizers and fiber switches.
//!
//! Lua runs a finalizer wherever the collector happens to step: inside any allocation of any
//! fiber, or in `collectgarbage()`. A finalizer that switches fibers (`fiber.yield()`,
//! `fiber.sleep()`, a `channel:get()` that waits, ...) cannot be made to work:
//!
//! * LuaJIT runs every finalizer on one Lua thread of its own (the "VM thread"), on the
//!   native stack of whichever fiber triggered it. Two finalizers suspended in two fibers
//!   interleave on that one Lua thread: each fiber resumes the other's Lua frames (seen: a
//!   finalizer started in fiber 3 went on in fiber 2), and frames of different shapes then
//!   corrupt the Lua stack;
//! * while a finalizer runs, LuaJIT stops the collector for the whole state (its threshold is
//!   set to the maximum) and disables hooks and the JIT: a suspended finalizer keeps them off
//!   for every fiber (memory grows without bound; the C stack overflow hook of
//!   `super::cstack` is not called) until it resumes — and a `collectgarbage()` meanwhile
//!   turns the collector back on under it;
//! * Lua 5.4 stops the collector (`GCSTPGC`) and the thread's hooks in the same way.
//!
//! So the contract: inside a finalizer, a fiber function that would switch raises
//! `NAME: cannot switch fibers inside a __gc finalizer` (with the caller's position), which
//! Lua reports as the finalizer's error (`fibertrace run`: `ERROR in finalizer: ...` on
//! standard error) and the program goes on; what completes without a switch works as
//! anywhere else (a `channel:put` with room or a reader waiting, a `channel:get` with a value
//! queued, any call with a zero timeout, a `join` of an ended fiber, `fiber.info()`), and
//! `fiber.create` makes and schedules its fiber without switching to it: it starts once the
//! fiber that ran the finalizer switches next (as one made by `fiber.new`).
//!
//! How "inside a finalizer" is known, whatever Lua thread the call comes from (a coroutine
//! resumed by the finalizer included): on LuaJIT, the VM thread has a Lua frame exactly
//! while a finalizer runs (the host learns which thread that is when it starts, from a
//! finalizer of its own); on Lua 5.4, `lua_gc` answers -1 exactly then. Both are global to
//! the Lua state: while a finalizer is suspended in another fiber (which no fiber function
//! allows; only a Rust callback that switches could), every fiber's switches are refused.

#[cfg(feature = "luajit")]
use std::cell::Cell;
#[cfg(feature = "luajit")]
use std::io::Write;
use std::time::Duration;

use mlua::ffi;

/// The text of the error, for the function `what`.
pub(crate) fn switch_error(what: &str) -> String {
    format!("{what}: cannot switch fibers inside a __gc finalizer")
}

#[cfg(feature = "luajit")]
thread_local! {
    /// LuaJIT's VM thread (the Lua thread finalizers run on) of this thread's host; null when
    /// unknown.
    static VM_THREAD: Cell<*mut ffi::lua_State> = const { Cell::new(std::ptr::null_mut()) };
}

/// The finalizer of the probe made by [`install`]: the thread it is called on is the VM
/// thread.
#[cfg(feature = "luajit")]
unsafe extern "C-unwind" fn probe_gc(l: *mut ffi::lua_State) -> std::ffi::c_int {
    VM_THREAD.with(|c| c.set(l));
    0
}

/// LuaJIT's handler of finalizer errors (the `errfin` VM event, called with the error):
/// `ERROR in finalizer: MESSAGE` on standard error, as LuaJIT's own (which only
/// `luaL_newstate` installs, and which prints `?` for an error that is not a string), for
/// any state of a host. Raises nothing; a standard error that cannot be written loses the
/// message.
#[cfg(feature = "luajit")]
unsafe extern "C-unwind" fn report_errfin(l: *mut ffi::lua_State) -> std::ffi::c_int {
    // SAFETY: called by the VM with the error at index 1.
    let text = unsafe { super::raw::error_text(l, 1) };
    // (After what the script printed before: see `flush_c_stdout`.)
    fibertrace_fiber::dump::flush_c_stdout();
    let _ = writeln!(std::io::stderr(), "ERROR in finalizer: {text}");
    0
}

/// Learns which Lua thread runs the finalizers of the host's state `l` (its main state): a
/// userdata whose `__gc` records it is made unreachable and collected; and reports their
/// errors with [`report_errfin`]. Lua 5.4 needs nothing (it warns of finalizer errors
/// itself, when warnings are on).
///
/// # Safety
/// `l` is the main state of the host being made on this thread, running no Lua code.
pub(crate) unsafe fn install(l: *mut ffi::lua_State) {
    #[cfg(feature = "luajit")]
    // SAFETY: per the contract; a zero-size userdata with a metatable holding a C function,
    // popped at once, then a full collection (which runs its finalizer on the VM thread);
    // `jit.attach(report_errfin, "errfin")` under `lua_pcall`; the stack is put back.
    unsafe {
        VM_THREAD.with(|c| c.set(std::ptr::null_mut()));
        let top = ffi::lua_gettop(l);
        ffi::lua_checkstack(l, 4);
        ffi::lua_newuserdata(l, 0);
        ffi::lua_createtable(l, 0, 1);
        ffi::lua_pushcfunction(l, probe_gc);
        ffi::lua_setfield(l, -2, c"__gc".as_ptr());
        ffi::lua_setmetatable(l, -2);
        ffi::lua_settop(l, top);
        ffi::lua_gc(l, ffi::LUA_GCCOLLECT, 0);
        ffi::lua_getglobal(l, c"jit".as_ptr());
        if ffi::lua_type(l, -1) == ffi::LUA_TTABLE {
            ffi::lua_getfield(l, -1, c"attach".as_ptr());
            if ffi::lua_type(l, -1) == ffi::LUA_TFUNCTION {
                ffi::lua_pushcfunction(l, report_errfin);
                ffi::lua_pushstring(l, c"errfin".as_ptr());
                ffi::lua_pcall(l, 2, 0, 0);
            }
        }
        ffi::lua_settop(l, top);
    }
    #[cfg(not(feature = "luajit"))]
    let _ = l;
}

/// Forgets the VM thread (the host is going away).
pub(crate) fn uninstall() {
    #[cfg(feature = "luajit")]
    VM_THREAD.with(|c| c.set(std::ptr::null_mut()));
}

/// Whether a `__gc` finalizer is running now in the Lua state of `l`.
///
/// # Safety
/// `l` is a Lua thread of this thread's host (the calling state of a C function).
pub(crate) unsafe fn in_finalizer(l: *mut ffi::lua_State) -> bool {
    #[cfg(feature = "luajit")]
    {
        let _ = l;
        let vm = VM_THREAD.with(Cell::get);
        if vm.is_null() {
            return false;
        }
        // The common case first, with the checked layout: no frame at all on the VM thread
        // (its base at the bottom of its stack), which is where `lua_getstack`'s walk of
        // the frames stops before it begins. A third of a Lua fiber's switch went to that
        // call (38 instructions of about 570).
        if crate::frames::publish::checked() == crate::frames::publish::MATCHES {
            let lay = &crate::frames::publish::Layout::LUAJIT_GC64;
            // SAFETY: `vm` is a live thread of this host's state (see above), and the layout
            // was checked against this VM: the base and stack pointers are plain words at
            // these offsets (GC64).
            let (base, stack) = unsafe {
                (
                    std::ptr::read((vm as usize + lay.state_base as usize) as *const usize),
                    std::ptr::read((vm as usize + lay.state_stack as usize) as *const usize),
                )
            };
            // `lj_debug_frame`: frames from `base - 1` down to above `stack + LJ_FR2` (one
            // 8-byte slot each, LJ_FR2 = 1 under GC64).
            let none = base.wrapping_sub(8) <= stack.wrapping_add(8);
            if none {
                #[cfg(debug_assertions)]
                {
                    let mut ar = std::mem::MaybeUninit::<ffi::lua_Debug>::uninit();
                    // SAFETY: as below.
                    debug_assert_eq!(unsafe { ffi::lua_getstack(vm, 0, ar.as_mut_ptr()) }, 0);
                }
                return false;
            }
        }
        // SAFETY: the VM thread of this host's state lives as long as the state; its frame
        // links are saved whenever it calls out of the interpreter (a C function, a
        // coroutine resume), so a level-0 query reads a consistent stack. `lua_getstack`
        // only writes the record (its `i_ci`), never reads it: left uninitialised (this
        // runs at every switch of a Lua fiber; zeroing the record was a third of it).
        unsafe {
            let mut ar = std::mem::MaybeUninit::<ffi::lua_Debug>::uninit();
            ffi::lua_getstack(vm, 0, ar.as_mut_ptr()) != 0
        }
    }
    #[cfg(not(feature = "luajit"))]
    // SAFETY: per the contract; LUA_GCISRUNNING only reads the collector's state (and is
    // answered -1 while the collector is stopped for a finalizer).
    unsafe {
        ffi::lua_gc(l, ffi::LUA_GCISRUNNING, 0) == -1
    }
}

/// `Ok` unless a finalizer is running: then the error of [`switch_error`] for `what`.
pub(crate) fn check_switch(c: &super::call::Call, what: &str) -> Result<(), String> {
    if !may_switch(c) {
        Err(switch_error(what))
    } else {
        Ok(())
    }
}

/// [`check_switch`] for a call that switches only when it has to wait (`would_wait`).
pub(crate) fn check_wait(
    c: &super::call::Call,
    what: &str,
    would_wait: bool,
) -> Result<(), String> {
    if !would_wait {
        return Ok(());
    }
    check_switch(c, what)
}

/// Whether a `put` (`put = true`) or a `get` on `ch` with `timeout` would wait — switch —
/// rather than complete or fail at once (what `fibertrace_fiber::Channel` does: a full
/// channel, or a rendezvous channel with no receiver waiting, makes a sender wait; an empty
/// open channel a receiver; a zero timeout never waits).
pub(crate) fn channel_would_wait<T>(
    ch: &fibertrace_fiber::Channel<T>,
    put: bool,
    timeout: Option<Duration>,
) -> bool {
    if timeout == Some(Duration::ZERO) || ch.is_closed() {
        return false;
    }
    if put {
        ch.len() >= ch.capacity().max(1) || (ch.capacity() == 0 && !ch.has_readers())
    } else {
        ch.is_empty()
    }
}

/// Whether the calling fiber may switch now (no finalizer is running): `fiber.create` starts
/// its fiber at once only then.
pub(crate) fn may_switch(c: &super::call::Call) -> bool {
    // SAFETY: the state of a running C function call of this host (`Call`'s invariant).
    !unsafe { in_finalizer(c.state()) }
}
