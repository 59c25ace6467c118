//! The process-wide memory barrier behind the inspection handshake of [`super::state`]: one
//! call makes every thread of the process pass a full memory barrier (Linux's
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`), so that the scheduler's side of the
//! handshake needs only a compiler barrier — no locked instruction per switch.
//!
//! Platform code: Linux only; elsewhere (and where the kernel refuses it: before 4.14, under a
//! seccomp filter, `FIBERTRACE_NO_MEMBARRIER` set) [`available`] says no and the handshake
//! uses a compare-and-swap on each side instead.
//!
//! How it can fail: a forked child is not registered (registration is per address space);
//! [`heavy`] then registers again, and when that fails too it says so (the inspection is
//! refused rather than made unsafe).

/// Whether the heavy barrier can be used in this process: asked the kernel once (and
/// registered for it), unless `FIBERTRACE_NO_MEMBARRIER` is set to anything but `0` or the
/// empty string (for systems where the interrupts it sends to other CPUs are unwelcome).
pub(crate) fn available() -> bool {
    let off =
        std::env::var_os("FIBERTRACE_NO_MEMBARRIER").is_some_and(|v| !v.is_empty() && v != "0");
    !off && register()
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

/// A full memory barrier on every thread of the process that runs now (and, on this one, a
/// sequentially consistent fence): whether it was made. Only after [`available`] said yes.
#[cfg(target_os = "linux")]
pub(crate) fn heavy() -> bool {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: as in `register`; the command only makes the other threads pass a barrier.
    let ok = |()| unsafe { libc::syscall(libc::SYS_membarrier, CMD_PRIVATE_EXPEDITED, 0, 0) == 0 };
    // (A forked child inherits the mode but not the registration.)
    let done = ok(()) || (register() && ok(()));
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    done
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn heavy() -> bool {
    false
}
