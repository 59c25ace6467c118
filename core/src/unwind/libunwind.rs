//! libunwind (through the `unwind` crate) as an independent oracle: a third unwinder,
//! written by other people, that our walks must agree with. Slow (hundreds of ns per frame:
//! its cursor blocks signals around every step), so for tests and comparisons only.
//!
//! Linking libunwind must not take over the process's `_Unwind_*` functions (see this
//! crate's build script); [`unwind_abi_provider`] tells which library provides them.

use unwind::{get_context, Cursor, RegNum};

use crate::arch::SavedContext;

/// Return addresses of the current stack as libunwind sees them, starting with the caller
/// of this function (so the list lines up with [`crate::collect`]'s).
#[inline(never)]
pub fn current_stack(max: usize) -> Vec<u64> {
    let mut out = Vec::new();
    get_context!(ctx);
    let Ok(mut cur) = Cursor::local(ctx) else {
        return out;
    };
    // The cursor starts inside this function: step once before recording.
    while out.len() < max {
        match cur.step() {
            Ok(true) => {}
            _ => break,
        }
        let Ok(ip) = cur.register(RegNum::IP) else {
            break;
        };
        out.push(ip);
    }
    out
}

/// Program counter then return addresses of a suspended coroutine, walked by libunwind from
/// its saved registers and stopped as soon as the stack pointer leaves the coroutine's stack
/// (libunwind would otherwise follow a stale link out of it).
pub fn suspended(ctx: &SavedContext, max: usize) -> Vec<u64> {
    let mut out = Vec::new();
    if !ctx.is_recorded() {
        return out;
    }
    get_context!(uc);
    let mut uc = uc;
    // SAFETY: `Context.0` is the `ucontext_t` libunwind reads registers from; we overwrite
    // rip/rsp/rbp with a context recorded on a stack that stays suspended (not running)
    // while the cursor lives, and the walk below reads only within its bounds.
    unsafe {
        let raw = &mut uc.as_mut().get_unchecked_mut().0;
        raw.uc_mcontext.gregs[libc::REG_RIP as usize] = ctx.regs.ip as i64;
        raw.uc_mcontext.gregs[libc::REG_RSP as usize] = ctx.regs.sp as i64;
        raw.uc_mcontext.gregs[libc::REG_RBP as usize] = ctx.regs.fp as i64;
    }
    let Ok(mut cur) = Cursor::local(uc) else {
        return out;
    };
    while out.len() < max {
        let (Ok(ip), Ok(sp)) = (cur.register(RegNum::IP), cur.register(RegNum::SP)) else {
            break;
        };
        if !ctx.stack.contains(sp) {
            break;
        }
        out.push(ip);
        match cur.step() {
            Ok(true) => {}
            _ => break,
        }
    }
    out
}

/// The file of the library whose `_Unwind_RaiseException` the process uses (the one Rust
/// panics go through).
pub fn unwind_abi_provider() -> Option<String> {
    let name = c"_Unwind_RaiseException";
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name is always valid to call.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: Dl_info is plain data filled by dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; any address is accepted.
    if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    Some(
        unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}
