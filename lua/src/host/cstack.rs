//! C stack overflow as a Lua error, as Lua 5.1 has it and LuaJIT lacks.
//!
//! LuaJIT counts no C levels: a script whose callbacks nest through C functions
//! (`string.gsub`, `table.sort`, `load` readers, `__tostring` in `string.format`,
//! `coroutine.wrap`) grows the fiber's C stack until it overflows. Each fiber stack has an
//! inaccessible reserve between its usable part and its guard (`fibertrace_fiber::overflow`).
//! When a fiber faults in it, the fault handler opens the reserve and calls
//! [`on_overflow`], which only sets a Lua count hook (`lua_sethook`, which Lua allows from a
//! signal handler). The fiber goes on, on the reserve, until the interpreter's next
//! instruction: the hook then raises `C stack overflow` there, where the VM's state is
//! consistent, and `pcall` catches it as any error. Later hook calls close the reserve once the
//! stack has unwound above it, and then put back the hook that was there before.
//!
//! How it can be wrong: while a reserve is open, a hook set before ours is not called (it is
//! restored afterwards), and one set meanwhile by the script (`debug.sethook`) replaces ours,
//! so the reserve stays open until the fiber ends: a second overflow of that fiber then stops
//! the process. JIT-compiled code calls no hooks: the error comes when the trace exits to the
//! interpreter. C code that recurses through the whole reserve (256 KiB) without running a Lua
//! instruction reaches the guard, and the process stops with the overflow report. The main
//! Lua state's stack (code run outside any fiber, through [`crate::LuaHost::lua`]) has no
//! reserve.
//!
//! Lua 5.4 counts its C levels itself (`C stack overflow` at 200): the hook is set on LuaJIT
//! only, where hooks are global to the Lua state.

use mlua::ffi;
use std::ffi::c_int;

/// Levels looked at for the error's position.
const WHERE_LEVELS: c_int = 8;

/// Registers the overflow handler for this thread's fibers, with `l` (the main state).
pub(crate) fn install(l: *mut ffi::lua_State) {
    // SAFETY: `on_overflow` only reads and sets Lua hook fields (what Lua allows a signal
    // handler); `l`, the host's main state, outlives the registration (`uninstall` runs first
    // when the host is dropped).
    unsafe { fibertrace_fiber::overflow::set_thread_handler(Some((on_overflow, l as usize))) };
}

/// Removes it (the host is going away).
pub(crate) fn uninstall() {
    // SAFETY: removing the handler asks nothing.
    unsafe { fibertrace_fiber::overflow::set_thread_handler(None) };
}

/// The hook found before ours: function, mask, count (restored when no reserve is open).
struct Saved {
    hook: Option<ffi::lua_Hook>,
    mask: c_int,
    count: c_int,
}

static mut SAVED: Saved = Saved {
    hook: None,
    mask: 0,
    count: 0,
};

/// Called by the fault handler (async-signal context, the fiber interrupted anywhere) once
/// the fiber's reserve is open.
unsafe fn on_overflow(ctx: usize, _fid: u64) {
    let l = ctx as *mut ffi::lua_State;
    // SAFETY: `l` is the host's main state (alive while the handler is registered); reading
    // the hook fields and `lua_sethook` are what Lua allows in a signal handler. SAVED is
    // written here and read by the hook, both on this thread, never at once (the hook runs
    // between instructions; a fault inside the hook finds our hook installed and skips the
    // write).
    unsafe {
        // (Compared by address: `hook` is taken in this module only.)
        if ffi::lua_gethook(l).map(|f| f as usize) != Some(hook as ffi::lua_Hook as usize) {
            let saved = &mut *std::ptr::addr_of_mut!(SAVED);
            saved.hook = ffi::lua_gethook(l);
            saved.mask = ffi::lua_gethookmask(l);
            saved.count = ffi::lua_gethookcount(l);
        }
        ffi::lua_sethook(l, Some(hook), ffi::LUA_MASKCOUNT | ffi::LUA_MASKCALL, 1);
    }
}

/// The hook, on every instruction and every call (a call hook sees every function entry, also
/// of a function whose JIT-compiled trace would run without calling a count hook): raises the error in the fiber that overflowed, closes reserves as stacks
/// unwind, and restores the previous hook when none is open.
unsafe extern "C-unwind" fn hook(l: *mut ffi::lua_State, _ar: *mut ffi::lua_Debug) {
    let here = 0u8;
    let sp = std::hint::black_box(&here) as *const u8 as usize;
    match fibertrace_fiber::overflow::poll(sp) {
        fibertrace_fiber::overflow::Overflow::Raise => {
            // SAFETY: `l` is the running state (a hook's argument); the message is built on
            // its stack and raised from this C-unwind frame, which owns nothing to drop.
            unsafe {
                // Where: the innermost Lua function with a line (at a call hook the running
                // one has none yet; its caller may be a C function).
                for level in 0..WHERE_LEVELS {
                    ffi::luaL_where(l, level);
                    if ffi::lua_objlen(l, -1) != 0 || level + 1 == WHERE_LEVELS {
                        break;
                    }
                    ffi::lua_settop(l, -2);
                }
                ffi::lua_pushstring(l, c"C stack overflow".as_ptr());
                ffi::lua_concat(l, 2);
                ffi::lua_error(l);
            }
        }
        fibertrace_fiber::overflow::Overflow::None => {
            // SAFETY: SAVED was written by `on_overflow` before our hook was set (see there).
            unsafe {
                let saved = &*std::ptr::addr_of!(SAVED);
                ffi::lua_sethook(l, saved.hook, saved.mask, saved.count);
            }
        }
        fibertrace_fiber::overflow::Overflow::Pending => {}
    }
}
