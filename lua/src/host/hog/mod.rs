//! A running fiber's Lua frames: read inside it, at a safe point reached on demand.
//!
//! A fiber that spins in Lua without yielding never comes back to the run loop, where the
//! runtime reads Lua frames; its Lua stack is being changed by the thread that runs it, so
//! no other thread may read it. A dump asked from another thread (the dump signal's, the
//! HTTP endpoint's) or the stall watchdog's report therefore asks *this* thread to stop the
//! fiber at its next Lua instruction and read the frames there
//! ([`fibertrace_fiber::inspect::serve_at_safe_point`]): the runtime calls the host's arm
//! (from the asking thread), which sends `SIGPROF` to the scheduler's thread; what that
//! signal does is the VM's part:
//!
//! * **LuaJIT** ([`luajit`]): hooks set with `lua_sethook` are never called by JIT-compiled
//!   code, so a hot loop would never stop. LuaJIT's profiler reaches it: while it is started,
//!   traces are compiled with a check of the profiler's hook bit, and its `SIGPROF` handler
//!   sets that bit; the interpreter then calls the profiler's callback at its next
//!   instruction, and a trace exits to the interpreter at its next check.
//! * **Lua 5.4** ([`lua54`]): the host's own `SIGPROF` handler sets a one-shot count hook
//!   (`lua_sethook`, which Lua allows from a signal handler) on the interrupted fiber's Lua
//!   thread; the hook runs at its next instruction.
//!
//! A fiber inside a C function gets there when that function returns to Lua (or calls back
//! into it); until then the reports keep its native frames and name the C function
//! ([`stall_note`]).
//!
//! Costs and limits: `FIBERTRACE_LUA_SAFE_POINTS=0` in the environment turns it all off (no
//! signal, no profiler; the reports then keep a running fiber's native frames and say why).
//! The process's `SIGPROF` disposition is the host's while it lives (it does not take it
//! if another handler was there: a CPU profiler's). The signal interrupts the thread like
//! any other: a C function blocked in a system call that signals interrupt (`poll`,
//! `nanosleep`) sees `EINTR`, as it would under LuaJIT's profiler or a debugger. The
//! flavours' own costs and limits are in their modules.
//!
//! How a result can be wrong: the frames are of the safe point, a little after the request
//! (after the C function the fiber was in returned); the other fibers are read at that same
//! moment, not at the request's.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use fibertrace_core::{Backtrace, Frame, Unwinder};
use mlua::ffi;

#[cfg(feature = "luajit")]
mod luajit;
#[cfg(feature = "luajit")]
use luajit as vm;

#[cfg(not(feature = "luajit"))]
mod lua54;
#[cfg(not(feature = "luajit"))]
use lua54 as vm;

pub(crate) use vm::f_script_profiles;

/// The environment variable that turns reading running fibers off (`0`).
const OFF_VAR: &str = "FIBERTRACE_LUA_SAFE_POINTS";

/// Says how the scheduler of the host of this thread (main state `l`) brings its running
/// fiber to a safe point, taking what the VM needs for it. Call it on the host's thread
/// before any fiber runs.
///
/// # Safety
/// `l` is the host's main state, on this thread, running nothing.
pub(crate) unsafe fn start(l: *mut ffi::lua_State, sched: &fibertrace_fiber::Scheduler) {
    if std::env::var_os(OFF_VAR).is_some_and(|v| v == "0") {
        sched.set_safe_point_arm(Some(arm_off));
        return;
    }
    // SAFETY: forwarded contract.
    let arm = match unsafe { vm::start(l) } {
        Ok(arm) => {
            STARTED.with(|s| s.set(true));
            LAST_ARM.store(arm as usize, Ordering::Release);
            arm
        }
        Err(refusing) => refusing,
    };
    sched.set_safe_point_arm(Some(arm));
}

/// The arm of the last host whose VM part started (0: none), for [`halt`].
static LAST_ARM: AtomicUsize = AtomicUsize::new(0);
/// Set by [`halt`]: the process is ending.
static HALT_ASKED: AtomicBool = AtomicBool::new(false);
/// Set while the script writes the exit's dumps itself ([`exempt_from_halt`]).
static EXEMPT: AtomicBool = AtomicBool::new(false);
/// Set once the script has stopped for the halt.
static PARKED: AtomicBool = AtomicBool::new(false);

/// For a process that is ending (an exit signal's handling: its dumps are being written, its
/// output flushed) while its script would go on meanwhile, printing and writing: stops the
/// Lua code of every host of this process at its next safe point — the running fiber's next
/// Lua instruction, reached on demand on the thread `tid` (the host's) — where it stays,
/// still serving what other threads ask of its scheduler (the dumps' traces), until the
/// process ends. Nothing comes back from there: call it only when the process ends next
/// (`_exit`). (Not at a fiber's switch as well: that one load on every Lua switch made a
/// yield 9% slower, by the code's layout.)
///
/// The signal that reaches the safe point is sent again every 2 ms until the script stops
/// (from a thread of its own): LuaJIT ignores it while a `__gc` finalizer or a VM event
/// callback runs, and Lua 5.4's handler when it lands between two fibers.
///
/// Returns why the running fiber could not be reached on demand, if so (safe points turned
/// off, `SIGPROF` taken by another handler or the script's `jit.profile`): the script then
/// goes on until the process ends. A fiber inside a C function (blocked in `io.read`) stops
/// when that function returns to Lua.
pub fn halt(tid: i32) -> Result<(), &'static str> {
    if HALT_ASKED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    let a = LAST_ARM.load(Ordering::Acquire);
    if a == 0 {
        return Err("no Lua host reaches safe points on demand");
    }
    // SAFETY: a non-zero value is a `SafePointArm` stored by `start`.
    let arm = unsafe { std::mem::transmute::<usize, fibertrace_fiber::inspect::SafePointArm>(a) };
    let first = arm(tid);
    if first.is_ok() {
        // (A thread that cannot be made, out of memory: the first signal only.)
        let _ = std::thread::Builder::new()
            .name("fibertrace-halt".into())
            .spawn(move || {
                while !PARKED.load(Ordering::SeqCst) {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    if !EXEMPT.load(Ordering::SeqCst) && arm(tid).is_err() {
                        break;
                    }
                }
            });
    }
    first
}

/// `true` while the script ends the process itself and writes the exit's dumps (which run
/// Lua code between them): a [`halt`] asked meanwhile does not stop it there; `false` once
/// they are written (an exit that then fails, `os.exit` with a bad argument, leaves the
/// script to the halt again). Call it on the script's thread.
pub fn exempt_from_halt(on: bool) {
    EXEMPT.store(on, Ordering::SeqCst);
}

/// At a safe point (no lock of the C library's held): once [`halt`] was called, stays here
/// for good (unless exempt), serving what other threads ask of the scheduler every
/// millisecond.
#[inline(always)]
pub(crate) fn park_if_halted() {
    if HALT_ASKED.load(Ordering::Relaxed) {
        park();
    }
}

#[cold]
#[inline(never)]
fn park() {
    if EXEMPT.load(Ordering::SeqCst) {
        return;
    }
    PARKED.store(true, Ordering::SeqCst);
    loop {
        serve_once();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

std::thread_local! {
    /// Whether this thread's host went through the VM's start (and so must stop).
    static STARTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Gives back what [`start`] took (the host of this thread is being dropped).
///
/// # Safety
/// `l` is the host's main state, on this thread, not closed yet, running nothing.
pub(crate) unsafe fn stop(l: *mut ffi::lua_State) {
    if STARTED.with(|s| s.replace(false)) {
        // SAFETY: forwarded contract.
        unsafe { vm::stop(l) };
    }
}

fn arm_off(_tid: i32) -> Result<(), &'static str> {
    Err("turned off (FIBERTRACE_LUA_SAFE_POINTS=0)")
}

fn arm_foreign_sigprof(_tid: i32) -> Result<(), &'static str> {
    Err("SIGPROF, which it needs to reach it, belongs to another handler")
}

/// The `SIGPROF` handler now (its address; `SIG_DFL` is 0, `SIG_IGN` 1).
fn sigprof_handler() -> usize {
    // SAFETY: reading the disposition only (a null new action).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGPROF, std::ptr::null(), &mut old) != 0 {
            return 0;
        }
        old.sa_sigaction
    }
}

/// `SIGPROF` to the scheduler's thread `tid`, if `handler` is still the one installed.
fn signal(tid: i32, handler: usize) -> Result<(), &'static str> {
    if handler == 0 || sigprof_handler() != handler {
        return Err("SIGPROF, which it needs to reach it, was taken by another handler");
    }
    // (By kernel id: a thread that exited is an error, not a crash; the handler only sets
    // a hook on the Lua thread of the fiber it interrupted, if any.)
    if !fibertrace_fiber::inspect::signal_thread(tid, libc::SIGPROF) {
        return Err("the signal could not be sent to its thread");
    }
    Ok(())
}

/// At a safe point of the Lua code the running fiber runs (a hook, on its thread): serves the
/// parts other threads asked of this scheduler, with the running fiber's frames read here.
/// Nothing here raises a Lua error or unwinds into the VM (a panic is caught).
fn serve() {
    serve_once();
    park_if_halted();
    hold_for_dump();
}

/// At a safe point reached for the dump signal's dump: flushes what the script printed
/// (no `print` is half done here) and stays, serving, until the dump is written (at most
/// [`HOLD_MAX`]), so that the dump comes between two whole lines of the script's output
/// (see `fibertrace_fiber::dump::dump_wants_hold`).
fn hold_for_dump() {
    if !fibertrace_fiber::dump::dump_wants_hold() {
        return;
    }
    fibertrace_fiber::dump::flush_c_stdout();
    let t0 = std::time::Instant::now();
    while fibertrace_fiber::dump::dump_wants_hold() && t0.elapsed() < HOLD_MAX {
        std::thread::sleep(std::time::Duration::from_micros(200));
        serve_once();
        park_if_halted();
    }
}

/// The longest a fiber is kept at its safe point while the dump is written (a dump into a
/// pipe nobody reads must not stop the script).
const HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// [`serve`]'s work, once.
fn serve_once() {
    let _ = std::panic::catch_unwind(|| {
        fibertrace_fiber::inspect::serve_at_safe_point(&mut || {
            let me = fibertrace_fiber::current_id();
            let root = super::with_host(|h| h.recs.get(&me).map(|r| r.thread)).flatten()?;
            // SAFETY: `root` is the running fiber's own Lua thread, and this is a safe point
            // of the Lua code it runs (a hook), on its OS thread.
            Some(unsafe { frames_here(root) })
        });
    });
}

/// The running fiber's frames from a hook inside its Lua code: the native frames below the
/// hook's (the hook's own and those of the VM that called it are left out), the Lua stack of
/// `root` interleaved.
///
/// # Safety
/// `root` is the running fiber's Lua thread, and this is called from a hook of the Lua code
/// it runs, on its OS thread.
#[inline(never)]
unsafe fn frames_here(root: *mut ffi::lua_State) -> Vec<Frame> {
    let Some(native) = fibertrace_fiber::current().and_then(|f| f.backtrace(Unwinder::Fast)) else {
        return Vec::new();
    };
    let vm = crate::interleave::vm_map();
    let below_hook = native
        .frames()
        .iter()
        .position(|f| f.lookup_address().is_some_and(|a| vm.is_vm(a)))
        .unwrap_or(0);
    let native = Backtrace::from_frames(&native.frames()[below_hook..]);
    // SAFETY: the contract: the running fiber's Lua thread, at a hook, on its thread.
    let bt = unsafe { crate::capture_interleaved(&native, root) };
    fibertrace_fiber::info::user_frames(bt.frames()).to_vec()
}

/// The note of a stall report whose fiber could not be stopped at a safe point in time:
/// which C function it is in, when its innermost frame is one (not the VM, not JIT-compiled
/// code); `None` leaves the runtime's note.
pub(crate) fn stall_note(bt: &Backtrace) -> Option<String> {
    let top = bt.frames().first()?;
    let a = top.lookup_address()?;
    if crate::interleave::vm_map().is_vm(a) {
        return None;
    }
    let r = fibertrace_core::symbolize::resolve(top)?;
    let name = r.symbols.last()?.name.clone()?;
    Some(format!(
        "Lua frames not shown: the fiber runs C code ({name}) that did not return to Lua \
         within {} ms; its native frames are above",
        fibertrace_fiber::inspect::SOURCE_WAIT.as_millis()
    ))
}
