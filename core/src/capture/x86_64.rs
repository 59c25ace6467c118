//! x86_64 leaf: reading the registers a walk starts from.

use super::Registers;

/// Reads (ip, sp, fp) at this point of the enclosing function. A macro, not a function, so
/// that the registers are those of the caller's own frame at every optimisation level.
#[macro_export]
#[doc(hidden)]
macro_rules! __fibertrace_registers_here {
    () => {{
        let ip: u64;
        let sp: u64;
        let fp: u64;
        // SAFETY: reads three registers into outputs; touches no memory and no flags.
        unsafe {
            ::core::arch::asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {fp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                fp = out(reg) fp,
                options(nomem, nostack, preserves_flags)
            );
        }
        $crate::capture::Registers { ip, sp, fp }
    }};
}

/// Registers of an interrupted context.
///
/// # Safety
/// `uc` must point at a valid `ucontext_t`, such as the third argument of an `SA_SIGINFO`
/// signal handler.
#[inline]
pub unsafe fn registers_from_ucontext(uc: *const libc::c_void) -> Registers {
    // SAFETY: the caller guarantees `uc` is a valid ucontext_t.
    let uc = unsafe { &*(uc as *const libc::ucontext_t) };
    let g = &uc.uc_mcontext.gregs;
    Registers {
        ip: g[libc::REG_RIP as usize] as u64,
        sp: g[libc::REG_RSP as usize] as u64,
        fp: g[libc::REG_RBP as usize] as u64,
    }
}
