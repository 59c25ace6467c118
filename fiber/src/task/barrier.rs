//! The process-wide memory barrier behind the inspection handshake of [`super::state`]: one
//! call makes every thread of the process pass a full memory barrier (Linux's
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`), so that the scheduler's side of the
//! handshake needs only a compiler barrier — no locked instruction per switch.
//!
//! Opt-in (`FIBERTRACE_MEMBARRIER=1`): a listing from another thread that keeps retrying a
//! fiber parked only briefly, on a loaded machine, starved its scheduler thread (each try a
//! barrier, each barrier a resume that waited). Platform code: Linux only; elsewhere, where
//! the kernel refuses it (before 4.14, under a seccomp filter), or not asked for,
//! [`available`] says no and the handshake uses a compare-and-swap on each side instead.
//!
//! How it can fail: a forked child is not registered (registration is per address space);
//! [`heavy`] then registers again, and when that fails too it says so (the inspection is
//! refused rather than made unsafe).

/// Whether the heavy barrier is to be used in this process: `FIBERTRACE_MEMBARRIER` set to
/// anything but `0` or the empty string, and the kernel registered the process for it.
pub(crate) fn available() -> bool {
    let on = std::env::var_os("FIBERTRACE_MEMBARRIER").is_some_and(|v| !v.is_empty() && v != "0");
    on && register()
}

#[cfg(target_os = "linux")]
const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
#[cfg(target_os = "linux")]
const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

#[cfg(target_os = "linux")]
fn register() -> bool {
    // SAFETY: membarrier takes a command and two integer arguments; registration changes
    // nothing but the process's own membarrier state.
    unsafe { libc::syscall(libc::SYS_membarrier, CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn register() -> bool {
    false
}

thread_local! {
    /// Barriers this thread asked for (see [`barriers_made_here`]).
    static MADE_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many process-wide barriers this thread has made for its walks of fibers on other
/// threads (each one interrupts every CPU that runs a thread of the process): what a listing
/// from another thread costs them. For tests and soaks.
pub fn barriers_made_here() -> u64 {
    MADE_HERE.try_with(std::cell::Cell::get).unwrap_or(0)
}

/// Set once the kernel refused the barrier after it had been granted (a seccomp filter
/// installed since, say): every later inspection from another thread is refused at once.
#[cfg(target_os = "linux")]
static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A full memory barrier on every thread of the process that runs now (and, on this one, a
/// sequentially consistent fence): whether it was made. Only after [`available`] said yes.
/// Refused once, it is refused from then on (said once on the standard error).
#[cfg(target_os = "linux")]
pub(crate) fn heavy() -> bool {
    use std::sync::atomic::{fence, Ordering};
    if REFUSED.load(Ordering::Relaxed) {
        return false;
    }
    fence(Ordering::SeqCst);
    let _ = MADE_HERE.try_with(|m| m.set(m.get() + 1));
    // SAFETY: as in `register`; the command only makes the other threads pass a barrier.
    let ok = || unsafe { libc::syscall(libc::SYS_membarrier, CMD_PRIVATE_EXPEDITED, 0, 0) == 0 };
    // (A forked child inherits the handshake but not, on every kernel, the registration.)
    let done = ok() || (register() && ok());
    fence(Ordering::SeqCst);
    if !done && !REFUSED.swap(true, Ordering::Relaxed) {
        let msg = b"fibertrace: membarrier was refused after it had been granted: stacks of \
fibers are no longer walked from other threads (leave FIBERTRACE_MEMBARRIER unset where the \
system call is filtered)\n";
        // SAFETY: writes a static message to the standard error.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
    done
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn heavy() -> bool {
    false
}
