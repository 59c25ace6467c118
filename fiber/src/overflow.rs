//! Stack overflow in a fiber: a fault in the guard below the running fiber's stack (see
//! `stack`) is reported — which fiber, how big its stack is — before the process
//! stops as it would have (the fault is re-raised with the default action: exit by SIGSEGV,
//! a core dump where enabled). Without this, a fiber whose C code recursed too deep (nested
//! `string.gsub` callbacks, say) ended the process with no word.
//!
//! The handler runs on the scheduler thread's alternate signal stack (set up by
//! [`crate::inspect::sample`]), touches only atomics and the stack, and writes with `write(2)`. It stays
//! installed: a fault anywhere else is handed to the handler that was there before (the
//! standard library's own stack-overflow report for threads), called directly; with no such
//! handler, the default action ends the process (a fault re-executes; a signal sent by
//! `kill` is raised again).
//!
//! **Recovering.** A thread may register an [`OverflowHandler`] ([`set_thread_handler`]; the
//! Lua host does). A fault in a running fiber's *reserve* (the inaccessible region between its
//! usable stack and its guard, see `stack`) then opens the reserve (`mprotect`),
//! records it in a fixed table of open reserves, calls the handler and returns: the faulting
//! instruction runs again, now with room. The handler only arms something (the Lua host sets
//! a Lua hook) that, at a point where the fiber's own code is in a consistent state, asks
//! [`poll`] and raises an error there; the stack unwinds, and a later [`poll`] (or the stack's
//! return to the pool) closes the reserve again, so the next overflow is caught the same way.
//!
//! **Probe reads.** The same handler turns a fault of [`ProbeReads::read`] (two known
//! instructions) into a failed read: a walk of memory that may hold stale pointers (the Lua
//! frames the heap tracker records at each allocation) reads without a system call per read.
//! It is checked first, before anything else the handler does.
//!
//! How it can be wrong: a frame larger than the guard (64 KiB) can step over it into other
//! memory; such an overflow is not caught here (and may not fault at all). Code that uses up
//! the whole reserve (256 KiB) before the handler's safe point comes (C code recursing with no
//! Lua instruction between) reaches the guard, and the process stops as without a handler.
//! At most [`MAX_OPEN`] reserves are open at once; past that an overflow stops the process.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

/// Bytes of inaccessible memory below every fiber stack.
pub(crate) const GUARD: usize = 64 * 1024;

/// Bytes between the guard and the usable part, opened only to recover from an overflow.
pub(crate) const RESERVE: usize = 256 * 1024;

/// Called from the fault handler (on the alternate signal stack, with the fault's thread
/// interrupted anywhere) after a fiber's reserve was opened: `(context, fiber id)`. It must be
/// async-signal-safe: it may only arm something to run later.
pub type OverflowHandler = unsafe fn(usize, u64);

std::thread_local! {
    /// This thread's overflow handler and its context (a plain pair: read in a signal handler).
    static HANDLER: std::cell::Cell<Option<(OverflowHandler, usize)>> =
        const { std::cell::Cell::new(None) };
}

/// Sets (or with `None` removes) the handler called when a fiber of a scheduler on this thread
/// overflows into its reserve. Without one, such an overflow stops the process with a report.
///
/// # Safety
/// The handler runs inside a SIGSEGV handler, with this thread stopped at any instruction: it
/// must be async-signal-safe (no lock, no allocation), and its context must stay valid while
/// it is registered.
pub unsafe fn set_thread_handler(handler: Option<(OverflowHandler, usize)>) {
    HANDLER.with(|h| h.set(handler));
}

/// Reserves open at once, at most.
pub const MAX_OPEN: usize = 32;

/// One open reserve: its start (0: free slot), the fiber that overflowed, whether [`poll`]
/// has told it to raise its error, and the stack pointer it last told it at.
struct Open {
    base: AtomicU64,
    fid: AtomicU64,
    raised: AtomicBool,
    raised_sp: AtomicU64,
}

/// How much deeper into an open reserve a fiber must go, past the shallowest point it came
/// back to since it was last told to raise, to be told again (a quarter of the reserve): code
/// that catches the error and recurses again inside the reserve (or a message handler that
/// does, again and again) gets another error each time, before the guard.
pub const RAISE_AGAIN_BELOW: usize = RESERVE / 4;

/// The deepest part of an open reserve, above the guard, where every safe point raises the
/// error again ([`poll`]).
pub const LAST_LINE: usize = RESERVE / 4;

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Open = Open {
    base: AtomicU64::new(0),
    fid: AtomicU64::new(0),
    raised: AtomicBool::new(false),
    raised_sp: AtomicU64::new(0),
};

static OPEN: [Open; MAX_OPEN] = [FREE; MAX_OPEN];
/// How many slots of [`OPEN`] are taken (a fast "none" for the common path).
static OPEN_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Opens the reserve starting at `base` for fiber `fid`: false when the table is full or
/// `mprotect` failed (the overflow is then fatal). Async-signal-safe.
fn open_reserve(base: u64, fid: u64) -> bool {
    for slot in &OPEN {
        if slot
            .base
            .compare_exchange(0, base, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: [base, base + RESERVE) is the reserve of the running fiber's stack, a
            // mapping that stays alive while the fiber runs; mprotect is a plain system call.
            let rc = unsafe {
                libc::mprotect(
                    base as *mut libc::c_void,
                    RESERVE,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            if rc != 0 {
                slot.base.store(0, Ordering::Release);
                return false;
            }
            slot.fid.store(fid, Ordering::Relaxed);
            slot.raised.store(false, Ordering::Relaxed);
            OPEN_COUNT.fetch_add(1, Ordering::AcqRel);
            return true;
        }
    }
    false
}

/// Closes (when `reprotect`) and forgets the reserve at `base`, if it is open: a stack going
/// back to the pool, or being unmapped.
pub(crate) fn forget_reserve(base: u64, reprotect: bool) {
    if OPEN_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    for slot in &OPEN {
        if slot.base.load(Ordering::Acquire) == base {
            if reprotect {
                // SAFETY: the reserve of a stack no fiber runs on (it is being pooled).
                unsafe { libc::mprotect(base as *mut libc::c_void, RESERVE, libc::PROT_NONE) };
            }
            slot.base.store(0, Ordering::Release);
            OPEN_COUNT.fetch_sub(1, Ordering::AcqRel);
            return;
        }
    }
}

/// What the running fiber should do about an overflow (the answer of [`poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Nothing is open anywhere: the caller can stop polling.
    None,
    /// This fiber overflowed and has not raised yet (or went [`RAISE_AGAIN_BELOW`] deeper
    /// since it last raised): raise the error now.
    Raise,
    /// A reserve is still open (this fiber's stack is still deep, or another fiber's): poll
    /// again later.
    Pending,
}

/// Whether the fiber running on this thread has its reserve open (it overflowed and is not
/// back above the reserve yet, or has not reached a safe point since).
pub fn running_fiber_open() -> bool {
    if OPEN_COUNT.load(Ordering::Acquire) == 0 {
        return false;
    }
    let Some((_, lo, _)) = crate::running::running_stack() else {
        return false;
    };
    OPEN.iter().any(|s| s.base.load(Ordering::Acquire) == lo)
}

/// Asked by the running fiber at a safe point, with its current stack pointer `sp`: whether to
/// raise its overflow error, and (once `sp` is back above its reserve by a margin) closes its
/// reserve again. A fiber already back above its reserve at its first safe point (C code that
/// went deep and returned before any) is not told to raise: the code that overflowed ended
/// well.
pub fn poll(sp: usize) -> Overflow {
    if OPEN_COUNT.load(Ordering::Acquire) == 0 {
        return Overflow::None;
    }
    let Some((_, lo, _)) = crate::running::running_stack() else {
        return Overflow::Pending;
    };
    for slot in &OPEN {
        if slot.base.load(Ordering::Acquire) != lo {
            continue;
        }
        // Back a margin above the reserve (8 KiB: room for the rest of the caller's frame and
        // this call).
        let back = (sp as u64) >= lo + (RESERVE + 8 * 1024) as u64;
        if !slot.raised.load(Ordering::Acquire) {
            if back {
                // The code that used the reserve has returned (C code that nested deep with
                // no Lua instruction in between, then finished): nothing to raise.
                forget_reserve(lo, true);
                return if OPEN_COUNT.load(Ordering::Acquire) == 0 {
                    Overflow::None
                } else {
                    Overflow::Pending
                };
            }
            slot.raised.store(true, Ordering::Release);
            slot.raised_sp.store(sp as u64, Ordering::Relaxed);
            return Overflow::Raise;
        }
        // In the deepest quarter of the reserve, every safe point raises: code that catches
        // each error and goes deeper anyway (a `pcall` at every level of a recursion through
        // C) is not let through to the guard; the error climbs until it leaves that quarter.
        if (sp as u64) < lo.saturating_add(LAST_LINE as u64) {
            slot.raised_sp.store(sp as u64, Ordering::Relaxed);
            return Overflow::Raise;
        }
        // The shallowest point since the last error: where it was caught, or a message
        // handler running where it was raised.
        let from = slot
            .raised_sp
            .fetch_max(sp as u64, Ordering::Relaxed)
            .max(sp as u64);
        if (sp as u64).saturating_add(RAISE_AGAIN_BELOW as u64) < from {
            // Deeper again, by a quarter of the reserve, than it came back to.
            slot.raised_sp.store(sp as u64, Ordering::Relaxed);
            return Overflow::Raise;
        }
        // Closed once the caller's stack is back above the reserve.
        if back {
            forget_reserve(lo, true);
            if OPEN_COUNT.load(Ordering::Acquire) == 0 {
                return Overflow::None;
            }
        }
        return Overflow::Pending;
    }
    Overflow::Pending
}

static INSTALL: Once = Once::new();

/// What a fatal fault not ours calls before the handler that was there before (a crash
/// report: `dump::install_crash_report`).
pub(crate) type CrashHook = unsafe fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

/// The [`CrashHook`] (0: none), as an address: read in the handler.
static CRASH_HOOK: AtomicUsize = AtomicUsize::new(0);

/// Sets the hook a fault not ours calls first, and installs the handler.
///
/// # Safety
/// `hook` must be async-signal-safe: it runs in a SIGSEGV or SIGBUS handler, with the
/// faulting thread stopped at any instruction.
pub(crate) unsafe fn set_crash_hook(hook: CrashHook) {
    CRASH_HOOK.store(hook as usize, Ordering::Release);
    install();
}

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
    // A probe's read of an address that is not there (`ProbeReads`): it fails, nothing else.
    // SAFETY: `info` and `uc` are the kernel's for this handler.
    if unsafe { fibertrace_core::arch::probe_fixup(info, uc) } {
        return;
    }
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as u64;
    if let Some((fid, lo, hi)) = crate::running::running_stack() {
        let reserve = lo..lo + RESERVE as u64;
        if reserve.contains(&addr) {
            if let Some((handler, ctx)) = HANDLER.with(|h| h.get()) {
                if open_reserve(lo, fid) {
                    // SAFETY: the handler was registered for this thread as async-signal-safe.
                    unsafe { handler(ctx, fid) };
                    return;
                }
            }
        }
        if addr < reserve.end && addr >= lo.saturating_sub(GUARD as u64) {
            let mut buf = [0u8; 160];
            let mut w = Writer {
                buf: &mut buf,
                len: 0,
            };
            w.put(b"fibertrace: fiber ");
            w.num(fid);
            w.put(b" overflowed its stack of ");
            w.num(hi.saturating_sub(lo) + 16 - RESERVE as u64);
            w.put(b" bytes (calls nested too deep); the process stops\n");
            let n = w.len;
            // SAFETY: write(2) of a local buffer to stderr is async-signal-safe.
            unsafe { libc::write(2, buf.as_ptr().cast(), n) };
            default_action(sig, info);
            return;
        }
    }
    // Not ours: reported (when a report was asked for: `set_crash_hook`), then the handler
    // that was there before.
    let hook = CRASH_HOOK.load(Ordering::Acquire);
    if hook != 0 {
        // SAFETY: a `CrashHook` stored by `set_crash_hook` (async-signal-safe, its contract),
        // called with the kernel's `info` and `uc` for this handler.
        unsafe { std::mem::transmute::<usize, CrashHook>(hook)(sig, info, uc) };
    }
    let i = usize::from(sig == libc::SIGBUS);
    // SAFETY: PREVIOUS[i] was written by `install` before this handler was installed, and is
    // never written again.
    let prev = unsafe { *std::ptr::addr_of!(PREVIOUS[i]).cast::<libc::sigaction>() };
    // SAFETY: the kernel's `info` and `uc` for this handler.
    unsafe { call_previous(&prev, sig, info, uc) };
    // A handler before ours that put the default action back and returned (the standard
    // library's, for a fault that is not a stack overflow) counts on the fault to happen
    // again; a signal sent by a process (`kill -SEGV`) does not, and the process went on
    // (after a report that said it stops). Raised again then.
    // SAFETY: the kernel's siginfo for this handler; sigaction reads the disposition into a
    // struct of ours (async-signal-safe).
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        let sent = (*info).si_code <= 0;
        if sent
            && libc::sigaction(sig, std::ptr::null(), &mut now) == 0
            && now.sa_sigaction == libc::SIG_DFL
        {
            libc::raise(sig);
        }
    }
}

/// Reads of this process's memory that fail, instead of faulting, where nothing is mapped
/// (or nothing readable): what reading another process's memory through the kernel gives
/// (`process_vm_readv`), without a system call per read. A read that faults is resumed by
/// this module's fault handler as a failure ([`fibertrace_core::arch::probe_copy`]).
///
/// Lent by [`ProbeReads::with`] after it checked the conditions that make it sound: this
/// module's handler (installed then, if it was not) still the process's handler of SIGSEGV
/// and SIGBUS (code that installs its own takes them over), neither signal blocked on this
/// thread (a fault with its signal blocked ends the process), and an alternate signal stack
/// with room for the fault's frame (a fiber's stack may have none left). What it cannot
/// rule out: a handler another thread installs while the reads go on would get their
/// faults (most would end the process). Unlike `process_vm_readv`, a read reaches device
/// mappings too (a stale pointer into one reads it), and under a debugger each failed read
/// stops the program with a SIGSEGV first (`handle SIGSEGV nostop noprint` in gdb). A read
/// racing a write of the same bytes by another thread gives a mix of old and new bytes.
#[derive(Debug)]
pub struct ProbeReads {
    _this_thread: std::marker::PhantomData<*const ()>,
}

/// Bytes of the alternate signal stack a probe's fault needs beyond the kernel's own least
/// (`AT_MINSIGSTKSZ`): the handler's path for a probe is a few calls deep.
const PROBE_HANDLER_ROOM: usize = 4096;

impl ProbeReads {
    /// Calls `f` with probe reads on this thread when they are sound now (see
    /// [`ProbeReads`]), with `None` otherwise (another fault handler, a blocked signal, no
    /// alternate stack, or running on it in a signal handler): then read some other way. Four system calls (the two
    /// dispositions, the signal mask, the alternate stack), no allocation.
    pub fn with<R>(f: impl FnOnce(Option<&ProbeReads>) -> R) -> R {
        if Self::sound_here() {
            f(Some(&ProbeReads {
                _this_thread: std::marker::PhantomData,
            }))
        } else {
            f(None)
        }
    }

    fn sound_here() -> bool {
        install();
        for sig in SIGNALS {
            // SAFETY: sigaction with no new disposition only reads the current one into a
            // zeroed struct of ours.
            let cur = unsafe {
                let mut cur: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut cur) != 0 {
                    return false;
                }
                cur
            };
            let flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            if cur.sa_sigaction != on_fault as *const () as usize || cur.sa_flags & flags != flags {
                return false;
            }
        }
        // SAFETY: pthread_sigmask with no new set only reads this thread's mask into ours;
        // sigismember reads that set; sigaltstack with no new stack only reads the current
        // one; getauxval reads the process's auxiliary vector.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            if libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut set) != 0
                || SIGNALS.iter().any(|&s| libc::sigismember(&set, s) != 0)
            {
                return false;
            }
            let mut ss: libc::stack_t = std::mem::zeroed();
            // (Running on it already, inside a signal handler: how much is left is not known.)
            if libc::sigaltstack(std::ptr::null(), &mut ss) != 0
                || ss.ss_flags & (libc::SS_DISABLE | libc::SS_ONSTACK) != 0
            {
                return false;
            }
            // The kernel's least room for a signal frame on this machine (AT_MINSIGSTKSZ,
            // 51: its size follows the CPU's register state), 2 KiB where it does not say.
            let least = (libc::getauxval(51) as usize).max(2048);
            ss.ss_size >= least + PROBE_HANDLER_ROOM
        }
    }

    /// Fills `out` from this process's address `addr`; `false` if any of it could not be
    /// read (unmapped, unreadable, or past the end of the address space), `out` then holding
    /// anything.
    #[inline]
    pub fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        if addr.checked_add(out.len() as u64).is_none() {
            return false;
        }
        let (dst, len) = (out.as_mut_ptr(), out.len());
        // SAFETY: `dst` is `out`, ours to write for `len` bytes (`addr` may point into it:
        // the copy allows overlap); `self` is only lent by `with`, inside a call where this
        // module's handler was found in place for both signals, neither blocked on this
        // thread, with an alternate stack: a faulting read comes back as `false`.
        unsafe { fibertrace_core::arch::probe_copy(dst, addr as *const u8, len) }
    }
}

/// Hands signal `sig` to `prev`, the disposition found before ours: the default action, none
/// (ignored), or its handler, called as the kernel would have called it.
///
/// # Safety
/// In a handler of `sig`: `info` and `uc` are the kernel's for it.
pub(crate) unsafe fn call_previous(
    prev: &libc::sigaction,
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    uc: *mut libc::c_void,
) {
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
pub(crate) fn default_action(sig: libc::c_int, info: *mut libc::siginfo_t) {
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
pub(crate) struct Writer<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) len: usize,
}

impl Writer<'_> {
    pub(crate) fn put(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    /// `v` in hexadecimal, lowercase, without leading zeros.
    pub(crate) fn hex(&mut self, v: u64) {
        let mut d = [0u8; 16];
        let mut i = d.len();
        let mut v = v;
        loop {
            i -= 1;
            d[i] = b"0123456789abcdef"[(v & 15) as usize];
            v >>= 4;
            if v == 0 {
                break;
            }
        }
        self.put(&d[i..]);
    }

    pub(crate) fn num(&mut self, mut v: u64) {
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
