//! Helpers shared by the benches (`core/benches/capture.rs`, `fiber/benches/speed.rs`, which
//! includes this file by path): a recursion of known depth, a suspended coroutine's parking
//! frames, and peers' backtrace functions opened privately. Not a bench of its own (cargo
//! finds benches at `benches/*.rs` and `benches/*/main.rs` only).

// Each including bench uses its own subset.
#![allow(dead_code)]

use std::hint::black_box;

use corosensei::Yielder;
use fibertrace_core::SavedContext;

/// Recurses `n` levels, then runs `f` at the bottom.
#[inline(never)]
pub fn deep(n: u32, f: &mut dyn FnMut()) {
    if n == 0 {
        f();
    } else {
        deep(n - 1, f);
    }
    black_box(());
}

/// Recurses `n` levels, then records its registers in `ctx` (as a runtime's suspend wrapper
/// does) and suspends the coroutine `y` belongs to.
#[inline(never)]
pub fn park(y: &Yielder<(), ()>, ctx: &std::cell::Cell<SavedContext>, n: u32) {
    if n > 0 {
        park(y, ctx, n - 1);
        black_box(());
        return;
    }
    let mut c = ctx.get();
    c.record();
    ctx.set(c);
    y.suspend(());
    black_box(());
}

/// The signature of glibc's `backtrace` and libunwind's `unw_backtrace`.
pub type BacktraceFn = unsafe extern "C" fn(*mut *mut libc::c_void, libc::c_int) -> libc::c_int;

/// Function `sym` of library `lib` opened privately (RTLD_LOCAL): glibc's `backtrace` or
/// libunwind's `unw_backtrace`, without letting either rebind anything in this process.
/// `None` when the library is not installed.
pub fn private_symbol(lib: &std::ffi::CStr, sym: &std::ffi::CStr) -> Option<BacktraceFn> {
    // SAFETY: dlopen/dlsym with valid NUL-terminated names; the handle is never closed, so
    // the function pointer stays valid.
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return None;
        }
        let p = libc::dlsym(h, sym.as_ptr());
        (!p.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, BacktraceFn>(p))
    }
}
