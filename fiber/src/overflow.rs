//! Stack overflow in a fiber: a fault in the guard below the running fiber's stack (see
//! [`crate::stack`]) is reported — which fiber, how big its stack is — before the process
//! stops as it would have (the fault is re-raised with the default action: exit by SIGSEGV,
//! a core dump where enabled). Without this, a fiber whose C code recursed too deep (nested
//! `string.gsub` callbacks, say) ended the process with no word.
//!
//! The handler runs on the scheduler thread's alternate signal stack (set up by
//! [`crate::sample`]), touches only atomics and the stack, and writes with `write(2)`. It stays
//! installed: a fault anywhere else is handed to the handler that was there before (the
//! standard library's own stack-overflow report for threads), called directly; with no such
//! handler, the default action ends the process (a fault re-executes; a signal sent by
//! `kill` is raised again).
//!
//! How it can be wrong: a frame larger than the guard (64 KiB) can step over it into other
//! memory; such an overflow is not caught here (and may not fault at all).

use std::sync::Once;

static INSTALL: Once = Once::new();

/// The dispositions found when installing (SIGSEGV, SIGBUS), restored for faults not ours.
static mut PREVIOUS: [std::mem::MaybeUninit<libc::sigaction>; 2] = [
    std::mem::MaybeUninit::uninit(),
    std::mem::MaybeUninit::uninit(),
];

const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

/// Installs the handler (once per process).
pub(crate) fn install() {
    INSTALL.call_once(|| {
        for (i, &sig) in SIGNALS.iter().enumerate() {
            // SAFETY: installs an SA_SIGINFO handler on the alternate stack; the previous
            // disposition is saved first, before any fault can reach the new handler, and is
            // only read by the handler afterwards.
            unsafe {
                let prev = std::ptr::addr_of_mut!(PREVIOUS[i]).cast::<libc::sigaction>();
                // The previous disposition is read first, then ours installed.
                libc::sigaction(sig, std::ptr::null(), prev);
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_fault as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    });
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as u64;
    if let Some((fid, lo, hi)) = crate::sample::running_stack() {
        if addr < lo && addr >= lo.saturating_sub(crate::stack::GUARD as u64) {
            let mut buf = [0u8; 160];
            let mut w = Writer {
                buf: &mut buf,
                len: 0,
            };
            w.put(b"fibertrace: fiber ");
            w.num(fid);
            w.put(b" overflowed its stack of ");
            w.num(hi.saturating_sub(lo) + 16);
            w.put(b" bytes (calls nested too deep); the process stops\n");
            let n = w.len;
            // SAFETY: write(2) of a local buffer to stderr is async-signal-safe.
            unsafe { libc::write(2, buf.as_ptr().cast(), n) };
            default_action(sig, info);
            return;
        }
    }
    // Not ours: the handler that was there before.
    let i = usize::from(sig == libc::SIGBUS);
    // SAFETY: PREVIOUS[i] was written by `install` before this handler was installed, and is
    // never written again.
    let prev = unsafe { *std::ptr::addr_of!(PREVIOUS[i]).cast::<libc::sigaction>() };
    match prev.sa_sigaction {
        libc::SIG_DFL => default_action(sig, info),
        libc::SIG_IGN => {}
        h if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: an SA_SIGINFO handler installed by someone else, called as the kernel
            // would have called it.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, uc);
        }
        h => {
            // SAFETY: a plain handler installed by someone else, called as the kernel would.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
    }
}

/// The default action: for a fault, returning re-executes the faulting access, which then
/// ends the process as the fault would have; a signal sent by a process (`si_code <= 0`) is
/// raised again.
fn default_action(sig: libc::c_int, info: *mut libc::siginfo_t) {
    // SAFETY: sigaction with a zeroed (SIG_DFL) disposition, and raise, are async-signal-safe;
    // `info` is the kernel's siginfo for this handler.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut());
        if (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

/// Formats into a fixed buffer without allocating (a signal handler may not).
struct Writer<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Writer<'_> {
    fn put(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    fn num(&mut self, mut v: u64) {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.put(&d[i..]);
    }
}
