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
//! **Where LuaJIT calls no hook.** LuaJIT runs `__gc` finalizers, and a hook's own code
//! (with it an `xpcall` message handler run for an error the hook raised), with its
//! "hook active" flag set, and calls no hook while it is set: an overflow there would reach
//! the guard. The flag is a bit of `global_State::hookmask`, which the public API does not
//! show; [`install`] finds that byte by probing (it checks the state's allocator fields at the
//! start of `global_State`, then sets hook masks and looks for the one byte that follows them
//! all). When found, the fault handler clears the flag before it sets the hook, and the hook
//! clears it before it raises: the error is then raised inside the finalizer (reported as the
//! finalizer's error; the program goes on) or inside the message handler (`error in error
//! handling`, which `xpcall` returns). LuaJIT puts the flag back as it leaves the finalizer or
//! the hook. Inside a finalizer or a hook that caught such an error, hooks (ours, or the
//! script's) may then run for the rest of it; so may they inside one whose deep C call used
//! the reserve and returned before any Lua instruction (the flag was cleared at the fault,
//! and nothing was raised). When the probe finds nothing (another LuaJIT layout), those
//! overflows reach the guard as before.
//!
//! How it can be wrong: while a reserve is open, a hook set before ours is not called (it is
//! restored afterwards), nor one the script sets meanwhile with `debug.sethook` (which the
//! host wraps, with `debug.gethook`: the new hook is kept and set once no reserve is open).
//! A hook set meanwhile from C (`lua_sethook`) replaces ours, so the reserve stays open until
//! the fiber ends: a second overflow of that fiber then stops the process. JIT-compiled code
//! calls no hooks: the error comes when the trace exits to the interpreter. C code that
//! recurses through the whole reserve (256 KiB) without running a Lua instruction reaches the
//! guard, and the process stops with the overflow report (LuaJIT's FFI has such paths: its C
//! declaration parser, guarded in the prelude by a limit on braces, and the conversion of
//! nested tables to a struct nested as deep, which is not guarded; the FFI can stop the
//! process in other ways anyway, a null pointer read among them). The main
//! Lua state's stack (code run outside any fiber, through [`crate::LuaHost::lua`]) has no
//! reserve.
//!
//! Lua 5.4 counts its C levels itself (`C stack overflow` at 200): the hook is set on LuaJIT
//! only, where hooks are global to the Lua state.

use mlua::ffi;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Levels looked at for the error's position.
const WHERE_LEVELS: c_int = 8;

/// Registers the overflow handler for this thread's fibers, with `l` (the main state).
pub(crate) fn install(l: *mut ffi::lua_State) {
    if HOOKMASK_AT.load(Ordering::Relaxed) == 0 {
        // SAFETY: `l` is the host's main state, running nothing (see `probe_hookmask`).
        if let Some(at) = unsafe { probe_hookmask(l) } {
            HOOKMASK_AT.store(at, Ordering::Relaxed);
        }
    }
    // SAFETY: `l` is the host's main state, running nothing; the stack is put back.
    unsafe { keep_sethook(l) };
    // SAFETY: `on_overflow` only reads and sets Lua hook fields (what Lua allows a signal
    // handler); `l`, the host's main state, outlives the registration (`uninstall` runs first
    // when the host is dropped).
    unsafe {
        fibertrace_fiber::embed::overflow::set_thread_handler(Some((on_overflow, l as usize)))
    };
}

/// Wraps `debug.sethook` and `debug.gethook` (when the state has them) so that the script's
/// hooks and ours do not get in each other's way while a reserve is open: a hook the script
/// sets then is kept as the hook to put back once no reserve is open (as a hook set before
/// the overflow is), and `debug.gethook()` answers with that kept hook, not ours. Without
/// this, the script's hook would replace ours, the reserve would stay open and the fiber's
/// next overflow would reach the guard.
///
/// # Safety
/// `l` is a live LuaJIT state running nothing.
unsafe fn keep_sethook(l: *mut ffi::lua_State) {
    let wrappers: [(&std::ffi::CStr, ffi::lua_CFunction); 2] =
        [(c"sethook", sethook_kept), (c"gethook", gethook_kept)];
    // SAFETY: plain stack operations on a live state; the stack's top is restored.
    unsafe {
        let top = ffi::lua_gettop(l);
        ffi::lua_getglobal(l, c"debug".as_ptr());
        if ffi::lua_type(l, -1) == ffi::LUA_TTABLE {
            for (name, wrapper) in wrappers {
                ffi::lua_getfield(l, -1, name.as_ptr());
                if ffi::lua_type(l, -1) == ffi::LUA_TFUNCTION {
                    ffi::lua_pushcclosure(l, wrapper, 1);
                    ffi::lua_setfield(l, -2, name.as_ptr());
                } else {
                    ffi::lua_settop(l, -2);
                }
            }
        }
        ffi::lua_settop(l, top);
    }
}

/// Whether `l`'s hook is ours.
///
/// # Safety
/// `l` is a live state.
unsafe fn ours_set(l: *mut ffi::lua_State) -> bool {
    // SAFETY: reads the hook field.
    unsafe { ffi::lua_gethook(l).map(|f| f as usize) == Some(hook as ffi::lua_Hook as usize) }
}

/// `debug.sethook` as wrapped by [`keep_sethook`]: the original (upvalue 1) runs on this
/// frame's arguments (called directly when it is a C function, so its errors name `sethook`
/// and the caller's line as before); if our hook was set before, or this fiber has a reserve
/// open now (it may have opened during the call), and ours is not set after, the new hook is
/// kept to be put back later and ours is set again.
unsafe extern "C-unwind" fn sethook_kept(l: *mut ffi::lua_State) -> c_int {
    // SAFETY: `l` is the calling state, with this C function's frame: the original reads the
    // same arguments as if it had been called. An error of the original propagates through
    // this frame, which owns nothing to drop. SAVED is written on this thread, in no fault
    // handler; a fault between its write and our `lua_sethook` (a fault handler writing it
    // too) writes the same hook, the script's, read from the same state.
    unsafe {
        let was_ours = ours_set(l);
        match ffi::lua_tocfunction(l, ffi::lua_upvalueindex(1)) {
            Some(original) => {
                original(l);
            }
            None => {
                let n = ffi::lua_gettop(l);
                ffi::lua_pushvalue(l, ffi::lua_upvalueindex(1));
                ffi::lua_insert(l, 1);
                ffi::lua_call(l, n, 0);
            }
        }
        if (was_ours || fibertrace_fiber::embed::overflow::running_fiber_open()) && !ours_set(l) {
            let saved = &mut *std::ptr::addr_of_mut!(SAVED);
            saved.hook = ffi::lua_gethook(l);
            saved.mask = ffi::lua_gethookmask(l);
            saved.count = ffi::lua_gethookcount(l);
            ffi::lua_sethook(l, Some(hook), ffi::LUA_MASKCOUNT | ffi::LUA_MASKCALL, 1);
        }
        0
    }
}

/// `debug.gethook` as wrapped by [`keep_sethook`]: while our hook is set, the original
/// (upvalue 1) answers about the hook kept to be put back (set for the call, in a protected
/// call, and ours set again whatever happens).
unsafe extern "C-unwind" fn gethook_kept(l: *mut ffi::lua_State) -> c_int {
    // SAFETY: `l` is the calling state; the original is called through the API on this
    // frame's arguments; an error is raised again only after our hook is back. SAVED is read
    // on this thread; no fault handler writes it while our hook is set.
    unsafe {
        let ours = ours_set(l);
        if ours {
            let saved = &*std::ptr::addr_of!(SAVED);
            ffi::lua_sethook(l, saved.hook, saved.mask, saved.count);
        }
        let n = ffi::lua_gettop(l);
        ffi::lua_pushvalue(l, ffi::lua_upvalueindex(1));
        ffi::lua_insert(l, 1);
        let status = ffi::lua_pcall(l, n, ffi::LUA_MULTRET, 0);
        if ours {
            ffi::lua_sethook(l, Some(hook), ffi::LUA_MASKCOUNT | ffi::LUA_MASKCALL, 1);
        }
        if status != ffi::LUA_OK {
            ffi::lua_error(l);
        }
        ffi::lua_gettop(l)
    }
}

/// Removes it (the host is going away).
pub(crate) fn uninstall() {
    // SAFETY: removing the handler asks nothing.
    unsafe { fibertrace_fiber::embed::overflow::set_thread_handler(None) };
}

/// LuaJIT's "hook active" bit of `global_State::hookmask` (`HOOK_ACTIVE` in `lj_obj.h`).
const HOOK_ACTIVE: u8 = 0x10;
/// Offset of `lua_State::glref` (the pointer to `global_State`) with 64-bit GC references:
/// after the GC header (`nextgc`, `marked`, `gct`), `dummy_ffid` and `status`.
const GLREF_AT: usize = 16;
/// Bytes of `global_State` searched for the hook mask (it follows the allocator, the GC
/// state and the empty string, about 100 bytes in; the structure is several KiB long).
const PROBE_BYTES: usize = 256;

/// Offset of `hookmask` in `global_State` (0: not found, the flag is left alone).
static HOOKMASK_AT: AtomicUsize = AtomicUsize::new(0);

/// The address of `global_State::hookmask` of `l`'s Lua universe, when it was found.
///
/// # Safety
/// `l` is a live LuaJIT state.
unsafe fn hookmask(l: *mut ffi::lua_State) -> Option<*mut u8> {
    let at = HOOKMASK_AT.load(Ordering::Relaxed);
    if at == 0 {
        return None;
    }
    // SAFETY: the probe checked that the word at GLREF_AT of a state is its global_State
    // (its allocator fields matched), a structure longer than PROBE_BYTES.
    unsafe {
        let g = (l as *const u8)
            .add(GLREF_AT)
            .cast::<*mut u8>()
            .read_unaligned();
        Some(g.add(at))
    }
}

/// Finds `hookmask` in `l`'s `global_State`: the word at [`GLREF_AT`] must point to a
/// structure that starts with the state's allocator function and data (as `lua_getallocf`
/// gives them), and exactly one byte of its first [`PROBE_BYTES`] must read as the event mask
/// of every hook set in turn. The hook that was set is put back.
///
/// # Safety
/// `l` is a live LuaJIT state running nothing (no hook active).
unsafe fn probe_hookmask(l: *mut ffi::lua_State) -> Option<usize> {
    unsafe extern "C-unwind" fn nothing(_l: *mut ffi::lua_State, _ar: *mut ffi::lua_Debug) {}
    // SAFETY: `l` is live and a lua_State is longer than GLREF_AT + 8 bytes. The word there
    // is `glref` with LuaJIT's 64-bit GC references (the x86_64 default), a pointer to the
    // global_State, which is several KiB long; in a build without them it is `L->base`, a
    // pointer into the live Lua stack: either way a non-null, aligned pointer to readable
    // memory of at least two words, so the allocator check may read them. Only once they
    // match (a global_State) are PROBE_BYTES read. The hook calls are the public API.
    unsafe {
        let g = (l as *const u8)
            .add(GLREF_AT)
            .cast::<*const u8>()
            .read_unaligned();
        if g.is_null() || !g.cast::<usize>().is_aligned() {
            return None;
        }
        let mut ud = std::ptr::null_mut();
        let allocf = ffi::lua_getallocf(l, &mut ud);
        let words = g.cast::<usize>();
        if words.read() != allocf as usize || words.add(1).read() != ud as usize {
            return None;
        }
        let before = (
            ffi::lua_gethook(l),
            ffi::lua_gethookmask(l),
            ffi::lua_gethookcount(l),
        );
        let masks = [
            ffi::LUA_MASKCALL,
            ffi::LUA_MASKRET,
            ffi::LUA_MASKLINE,
            ffi::LUA_MASKCOUNT,
            ffi::LUA_MASKCALL | ffi::LUA_MASKCOUNT,
            0,
        ];
        let mut candidates = [true; PROBE_BYTES];
        candidates[..2 * std::mem::size_of::<usize>()].fill(false);
        for mask in masks {
            let hook = if mask == 0 {
                None
            } else {
                Some(nothing as ffi::lua_Hook)
            };
            ffi::lua_sethook(l, hook, mask, 1000);
            for (i, c) in candidates.iter_mut().enumerate() {
                *c = *c && g.add(i).read() & 0x0f == mask as u8;
            }
        }
        ffi::lua_sethook(l, before.0, before.1, before.2);
        let mut found = candidates.iter().enumerate().filter(|(_, c)| **c);
        match (found.next(), found.next()) {
            (Some((i, _)), None) => Some(i),
            _ => None,
        }
    }
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
    // write). The hook mask byte (when found) is written as `lua_sethook` writes its
    // neighbour bits: a plain store on the interrupted thread, whose faulting instruction
    // was a stack access, not an update of that byte.
    unsafe {
        // (Compared by address: `hook` is taken in this module only.)
        if ffi::lua_gethook(l).map(|f| f as usize) != Some(hook as ffi::lua_Hook as usize) {
            let saved = &mut *std::ptr::addr_of_mut!(SAVED);
            saved.hook = ffi::lua_gethook(l);
            saved.mask = ffi::lua_gethookmask(l);
            saved.count = ffi::lua_gethookcount(l);
        }
        // In a finalizer or a hook (see the module docs), let the hook run.
        if let Some(mask) = hookmask(l) {
            *mask &= !HOOK_ACTIVE;
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
    match fibertrace_fiber::embed::overflow::poll(sp) {
        fibertrace_fiber::embed::overflow::Overflow::Raise => {
            // SAFETY: `l` is the running state (a hook's argument); the message is built on
            // its stack and raised from this C-unwind frame, which owns nothing to drop. The
            // hook mask byte belongs to `l`'s universe and is written on its own thread.
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
                // Hooks stay callable while the error is handled (a message handler that
                // nests C calls again), and where the error is caught inside a finalizer.
                if let Some(mask) = hookmask(l) {
                    *mask &= !HOOK_ACTIVE;
                }
                ffi::lua_error(l);
            }
        }
        fibertrace_fiber::embed::overflow::Overflow::None => {
            // SAFETY: SAVED was written by `on_overflow` before our hook was set (see there).
            unsafe {
                let saved = &*std::ptr::addr_of!(SAVED);
                ffi::lua_sethook(l, saved.hook, saved.mask, saved.count);
            }
        }
        fibertrace_fiber::embed::overflow::Overflow::Pending => {}
    }
}
