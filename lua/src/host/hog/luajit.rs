//! LuaJIT's part of reaching a safe point: its profiler (see the parent module).
//!
//! The host starts the profiler once, in line mode (compiled code checks the profiler's hook
//! bit wherever the source line changes; function mode would check only where a trace
//! crosses into another function, never in a loop within one), with its interval timer
//! disarmed at once: no signal comes unless asked. To ask, the requester sends `SIGPROF` to
//! the scheduler's thread ([`arm`]); LuaJIT's handler sets the hook bit, and the callback
//! ([`on_profile`]) serves what was asked.
//!
//! Costs and limits: compiled code carries a check (a load and a branch) per source line it
//! crosses — a few per cent on a hot numeric loop (`examples/safe_point_cost.sh` measures
//! it). LuaJIT's profiler serves one Lua state per process: the first host made takes it;
//! another host's running fibers are not read (its reports say so). A script that starts
//! `jit.profile` takes the profiler over (the prelude wraps the module's `start` and `stop`
//! and calls [`f_script_profiles`]): until it stops it, the reports of its running fibers say
//! so and no signal is sent; after its `stop` the host takes the profiler back. One started
//! through the FFI (`luaJIT_profile_start`) is not seen: the reports then say the fiber did
//! not reach a safe point, and once it is stopped `SIGPROF` has no handler — the arm checks
//! the handler before each signal and sends none.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use fibertrace_fiber::inspect::SafePointArm;
use mlua::ffi;

/// The kernel id of the thread whose host holds LuaJIT's profiler (0: none).
static OWNER: AtomicU64 = AtomicU64::new(0);
/// LuaJIT's `SIGPROF` handler, as installed when the host started the profiler.
static HANDLER: AtomicUsize = AtomicUsize::new(0);
/// Whether the script holds LuaJIT's profiler (`jit.profile.start` without its `stop`).
static SCRIPT: AtomicBool = AtomicBool::new(false);

type ProfileCallback =
    unsafe extern "C" fn(data: *mut c_void, l: *mut ffi::lua_State, samples: c_int, vmstate: c_int);

extern "C-unwind" {
    fn luaJIT_profile_start(
        l: *mut ffi::lua_State,
        mode: *const std::ffi::c_char,
        cb: ProfileCallback,
        data: *mut c_void,
    );
    fn luaJIT_profile_stop(l: *mut ffi::lua_State);
}

fn me() -> u64 {
    // SAFETY: gettid has no preconditions.
    u64::from(unsafe { libc::gettid() } as u32)
}

/// Takes LuaJIT's profiler for this thread's host; returns the scheduler's arm (`Err`: one
/// that refuses, nothing taken).
///
/// # Safety
/// `l` is the host's main state, on this thread, running nothing.
pub(super) unsafe fn start(l: *mut ffi::lua_State) -> Result<SafePointArm, SafePointArm> {
    if OWNER
        .compare_exchange(0, me(), Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err(arm_other_host);
    }
    if super::sigprof_handler() > 1 {
        // Another profiler's handler: leave SIGPROF to it.
        OWNER.store(0, Ordering::Release);
        return Err(super::arm_foreign_sigprof);
    }
    SCRIPT.store(false, Ordering::Release);
    // SAFETY: `l` is the main state, running nothing (the contract).
    unsafe { take(l) };
    Ok(arm)
}

/// Gives LuaJIT's profiler back, if this thread's host holds it.
///
/// # Safety
/// `l` is the host's main state, on this thread, not closed yet, running nothing.
pub(super) unsafe fn stop(l: *mut ffi::lua_State) {
    if OWNER.load(Ordering::Acquire) != me() {
        return;
    }
    // SAFETY: `l` is the state that started the profiler (this thread's host, the only one
    // per thread); LuaJIT stops it only for the state that started it.
    unsafe { luaJIT_profile_stop(l) };
    HANDLER.store(0, Ordering::Release);
    OWNER.store(0, Ordering::Release);
}

/// The hidden `script_profiles(taken)` the prelude's `jit.profile` wrapper calls: `true`
/// before the script's `start` (which stops the host's profiler), `false` after its `stop`
/// (the host takes the profiler back, when it is this thread's). Raises nothing.
pub(crate) unsafe extern "C-unwind" fn f_script_profiles(l: *mut ffi::lua_State) -> c_int {
    // SAFETY: a C function's own state.
    let taken = unsafe { ffi::lua_toboolean(l, 1) } != 0;
    if OWNER.load(Ordering::Acquire) == me() {
        SCRIPT.store(taken, Ordering::Release);
        if !taken {
            // SAFETY: `l` runs on the host's thread (it owns the profiler), inside a C
            // function, where LuaJIT allows flushing traces (as `jit.flush` does).
            unsafe { take(l) };
        }
    }
    0
}

/// Starts LuaJIT's profiler for the host and records its handler.
///
/// # Safety
/// `l` is a state of the host's Lua on this thread, in a C function or running nothing.
unsafe fn take(l: *mut ffi::lua_State) {
    // Line mode; an interval of ~23 days, and the timer disarmed right after.
    // SAFETY: the contract; the callback never raises and never unwinds into LuaJIT (see
    // `on_profile`).
    unsafe {
        luaJIT_profile_start(
            l,
            c"li2000000000".as_ptr(),
            on_profile,
            std::ptr::null_mut(),
        )
    };
    let zero = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let off = libc::itimerval {
        it_interval: zero,
        it_value: zero,
    };
    // SAFETY: disarming the process's profiling timer (LuaJIT armed it just above).
    unsafe { libc::setitimer(libc::ITIMER_PROF, &off, std::ptr::null_mut()) };
    HANDLER.store(super::sigprof_handler(), Ordering::Release);
}

/// The arm of the host that holds the profiler: `SIGPROF` to the scheduler's thread, if
/// LuaJIT's handler is still the one installed.
fn arm(tid: i32) -> Result<(), &'static str> {
    if OWNER.load(Ordering::Acquire) != u64::from(tid as u32) {
        return Err("LuaJIT's profiler, through which it is read, serves another Lua state");
    }
    if SCRIPT.load(Ordering::Acquire) {
        return Err("the script's jit.profile holds LuaJIT's profiler, through which it is read");
    }
    super::signal(tid, HANDLER.load(Ordering::Acquire))
}

fn arm_other_host(_tid: i32) -> Result<(), &'static str> {
    Err("LuaJIT's profiler, through which it is read, serves another Lua host of this process")
}

/// LuaJIT's profiler callback: at a safe point of the running Lua code, on the VM's thread.
unsafe extern "C" fn on_profile(
    _data: *mut c_void,
    _l: *mut ffi::lua_State,
    _samples: c_int,
    _vmstate: c_int,
) {
    super::serve();
}
