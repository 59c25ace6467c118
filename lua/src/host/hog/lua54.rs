//! Lua 5.4's part of reaching a safe point: a one-shot count hook set from a signal handler
//! (see the parent module).
//!
//! The host installs its `SIGPROF` handler once per process (while a host lives). The
//! handler reads the Lua thread of the fiber it interrupted (the word the host attached to
//! the fiber, [`fibertrace_fiber::Fiber::set_layer_word`]; none when the scheduler itself
//! was interrupted) and, when that thread has no hook, sets a count hook of 1 on it; the
//! hook ([`on_hook`]) clears itself and serves what was asked. Any number of hosts share the
//! handler (each fiber names its own Lua thread).
//!
//! Costs and limits: nothing while not asked (no check in the interpreter beyond Lua's own
//! hook test). A hook is per Lua thread in Lua 5.4: a fiber running a coroutine of its own
//! (`coroutine.wrap`) is stopped only when that coroutine yields back, and a fiber whose
//! thread has a hook of the script's (`debug.sethook`) is not stopped (the hook is left as
//! it is) — the reports then say the fiber did not reach a safe point.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use fibertrace_fiber::inspect::SafePointArm;
use mlua::ffi;

/// Hosts alive, and the disposition of `SIGPROF` before the first took it.
static HOSTS: Mutex<(usize, Option<libc::sigaction>)> = Mutex::new((0, None));
/// The handler's address while installed (0: not installed).
static HANDLER: AtomicUsize = AtomicUsize::new(0);

/// Installs the handler (the first host); returns the scheduler's arm (`Err`: one that
/// refuses, nothing taken).
///
/// # Safety
/// `l` is the host's main state, on this thread, running nothing.
pub(super) unsafe fn start(_l: *mut ffi::lua_State) -> Result<SafePointArm, SafePointArm> {
    let mut g = HOSTS.lock().unwrap_or_else(|e| e.into_inner());
    if g.0 == 0 {
        if super::sigprof_handler() > 1 {
            return Err(super::arm_foreign_sigprof);
        }
        // SAFETY: installs an SA_SIGINFO handler that only reads atomics and sets a hook
        // (which Lua allows from a signal handler); the old action is kept to put back.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigprof as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGPROF, &sa, &mut old) != 0 {
                return Err(super::arm_foreign_sigprof);
            }
            g.1 = Some(old);
        }
        HANDLER.store(on_sigprof as *const () as usize, Ordering::Release);
    }
    g.0 += 1;
    Ok(arm)
}

/// The last host gone, puts `SIGPROF`'s disposition back.
///
/// # Safety
/// Called once per host that [`start`] counted, on its thread.
pub(super) unsafe fn stop(_l: *mut ffi::lua_State) {
    let mut g = HOSTS.lock().unwrap_or_else(|e| e.into_inner());
    if g.0 == 0 {
        return;
    }
    g.0 -= 1;
    if g.0 == 0 {
        if let Some(old) = g.1.take() {
            // SAFETY: restores the disposition saved when the handler was installed.
            unsafe { libc::sigaction(libc::SIGPROF, &old, std::ptr::null_mut()) };
        }
        HANDLER.store(0, Ordering::Release);
    }
}

/// (LuaJIT's `jit.profile` does not exist here.)
pub(crate) unsafe extern "C-unwind" fn f_script_profiles(_l: *mut ffi::lua_State) -> c_int {
    0
}

fn arm(tid: i32) -> Result<(), &'static str> {
    super::signal(tid, HANDLER.load(Ordering::Acquire))
}

extern "C" fn on_sigprof(_sig: c_int, _info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    // SAFETY: errno is thread-local; saved and put back so the interrupted code sees its own.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: `uc` is the kernel's ucontext of this handler.
    let l = unsafe { fibertrace_fiber::sample::interrupted_layer_word(uc) } as *mut ffi::lua_State;
    if !l.is_null() {
        // SAFETY: `l` is the Lua thread of the fiber interrupted on this thread (the host
        // attached it when it made the fiber; the fiber's record keeps it alive while the
        // fiber lives). Reading and setting its hook is what Lua allows a signal handler.
        unsafe {
            if ffi::lua_gethook(l).is_none() {
                ffi::lua_sethook(l, Some(on_hook), ffi::LUA_MASKCOUNT, 1);
            }
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The one-shot hook: clears itself, then serves (see the parent module).
unsafe extern "C-unwind" fn on_hook(l: *mut ffi::lua_State, _ar: *mut ffi::lua_Debug) {
    // SAFETY: a hook's own state, on its thread; only our hook is cleared.
    unsafe {
        if ffi::lua_gethook(l).is_some_and(|h| std::ptr::fn_addr_eq(h, on_hook as ffi::lua_Hook)) {
            ffi::lua_sethook(l, None, 0, 0);
        }
    }
    super::serve();
}
