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
        $crate::arch::Registers { ip, sp, fp }
    }};
}

/// Stores `$v` (a `u64`) in the `AtomicU64` at `$p` with one instruction of the enclosing
/// function's own, at every optimisation level (an aligned 8-byte `mov`, a relaxed atomic
/// store on this architecture). A macro, not `AtomicU64::store`, which an unoptimised build
/// calls: a signal handler that interrupts the thread then finds the store done while the
/// thread is still in a callee's frame.
#[macro_export]
#[doc(hidden)]
macro_rules! __fibertrace_store_word_here {
    ($p:expr, $v:expr) => {{
        let p: &::core::sync::atomic::AtomicU64 = $p;
        let v: u64 = $v;
        // SAFETY: `p` is a reference to an `AtomicU64` (valid, 8-byte aligned): an aligned
        // 8-byte store to it is atomic on x86_64, as a relaxed `store` is.
        unsafe {
            ::core::arch::asm!(
                "mov qword ptr [{p}], {v}",
                p = in(reg) p.as_ptr(),
                v = in(reg) v,
                options(nostack, preserves_flags)
            );
        }
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

/// DWARF register `n` (x86-64's numbering, as `general_register`: 0 `rax` … 16 `rip`) of
/// the interrupted context `uc`; `None` for another number. Async-signal-safe.
///
/// # Safety
/// `uc` is a valid `ucontext_t` (a signal handler's third argument).
pub unsafe fn register_from_ucontext(uc: *const libc::c_void, n: u16) -> Option<u64> {
    // The `gregs` index each DWARF number names.
    const AT: [libc::c_int; 17] = [
        libc::REG_RAX,
        libc::REG_RDX,
        libc::REG_RCX,
        libc::REG_RBX,
        libc::REG_RSI,
        libc::REG_RDI,
        libc::REG_RBP,
        libc::REG_RSP,
        libc::REG_R8,
        libc::REG_R9,
        libc::REG_R10,
        libc::REG_R11,
        libc::REG_R12,
        libc::REG_R13,
        libc::REG_R14,
        libc::REG_R15,
        libc::REG_RIP,
    ];
    let i = *AT.get(n as usize)? as usize;
    // SAFETY: the caller guarantees `uc` is a valid ucontext_t.
    let uc = unsafe { &*(uc as *const libc::ucontext_t) };
    Some(uc.uc_mcontext.gregs[i] as u64)
}

/// Asks the CPU to start loading the cache lines of `[addr, addr + len)` (at most 4 KiB),
/// so that a walk of a cold stack that follows finds them in cache instead of taking one
/// memory round trip per frame. A hint only: it reads nothing, never faults (any address,
/// even unmapped, is fine) and changes no result.
#[inline]
pub fn prefetch(addr: u64, len: usize) {
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr, len);
}

/// [`prefetch`] into the second-level cache, for a bulk of lines read a few items later (a
/// listing's next fiber's stack). Asked into the first level, the ~20 lines of each fiber
/// of a large listing kept the prefetch instructions themselves waiting (a profile put most
/// of the listing's time on them); into the second, less: `fiber.info()` over 30,000 Lua
/// fibers that all ran since the last listing, medians of 5 alternating runs, 1.08 -> 1.01
/// us a fiber.
#[inline]
pub fn prefetch_far(addr: u64, len: usize) {
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T1 }>(addr, len);
}

#[inline]
fn prefetch_with<const HINT: i32>(addr: u64, len: usize) {
    use std::arch::x86_64::_mm_prefetch;
    let len = len.min(4096) as u64;
    let mut a = addr & !63;
    while a < addr.saturating_add(len) {
        // SAFETY: SSE is part of the x86_64 baseline; a prefetch of any address (mapped or
        // not) has no architectural effect and cannot fault.
        unsafe { _mm_prefetch::<HINT>(a as *const i8) };
        a += 64;
    }
}

/// The code of the kernel's signal-return trampoline in glibc (`__restore_rt`):
/// `mov $15, %rax; syscall` (15 is `rt_sigreturn`). A signal handler "returns" to it.
const SIGRETURN_CODE: [u8; 9] = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];

/// Whether the code at `addr` is the signal-return trampoline.
///
/// # Safety
/// `[addr, addr + 9)` must be readable (inside a loaded image's code).
pub(crate) unsafe fn is_sigreturn(addr: u64) -> bool {
    // SAFETY: per the contract.
    let code = unsafe { std::ptr::read_unaligned(addr as *const [u8; 9]) };
    code == SIGRETURN_CODE
}

/// Offsets of the interrupted (ip, sp, fp) in the `ucontext_t` that a signal frame holds
/// right above the trampoline's return slot (at the stack pointer the handler returns to).
pub(crate) const UCONTEXT_REGS: (u64, u64, u64) = {
    let g = std::mem::offset_of!(libc::ucontext_t, uc_mcontext)
        + std::mem::offset_of!(libc::mcontext_t, gregs);
    (
        (g + 8 * libc::REG_RIP as usize) as u64,
        (g + 8 * libc::REG_RSP as usize) as u64,
        (g + 8 * libc::REG_RBP as usize) as u64,
    )
};

/// The registers a walk starts from, from a thread's `ptrace` register set.
pub(crate) fn registers_from_user_regs(r: &libc::user_regs_struct) -> super::Registers {
    super::Registers {
        ip: r.rip,
        sp: r.rsp,
        fp: r.rbp,
    }
}

/// A thread's general registers as the words of its `user_regs_struct` (`ptrace`'s register
/// set, and a core file's `pr_reg`), read by DWARF number with [`general_register`].
pub(crate) type GeneralRegs = [u64; 27];

/// The words of a thread's `ptrace` register set.
pub(crate) fn general_from_user_regs(r: &libc::user_regs_struct) -> GeneralRegs {
    [
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi, r.orig_rax, r.rip, r.cs, r.eflags, r.rsp, r.ss, r.fs_base, r.gs_base, r.ds,
        r.es, r.fs, r.gs,
    ]
}

/// The words of a core file's `NT_PRSTATUS` register set (`pr_reg` at 112).
pub(crate) fn general_from_prstatus(desc: &[u8]) -> Option<GeneralRegs> {
    let mut out = [0u64; 27];
    for (i, w) in out.iter_mut().enumerate() {
        let at = 112 + 8 * i;
        *w = u64::from_le_bytes(desc.get(at..at + 8)?.try_into().ok()?);
    }
    Some(out)
}

/// DWARF register `n` (x86-64's numbering: 0 `rax`, 1 `rdx`, 2 `rcx`, 3 `rbx`, 4 `rsi`, 5
/// `rdi`, 6 `rbp`, 7 `rsp`, 8–15 `r8`–`r15`, 16 the return address, `rip`) of `g`.
pub(crate) fn general_register(g: &GeneralRegs, n: u16) -> Option<u64> {
    // The word of `user_regs_struct` each DWARF number names.
    const AT: [usize; 17] = [10, 12, 11, 5, 13, 14, 4, 19, 9, 8, 7, 6, 3, 2, 1, 0, 16];
    AT.get(n as usize).map(|&i| g[i])
}

/// A thread's id and registers from a core file's `NT_PRSTATUS` note (x86_64's
/// `elf_prstatus`: `pr_pid` at 32, `pr_reg` — a `user_regs_struct` — at 112).
pub(crate) fn registers_from_prstatus(desc: &[u8]) -> Option<(i32, super::Registers)> {
    let pid = i32::from_le_bytes(desc.get(32..36)?.try_into().ok()?);
    let reg = |i: usize| -> Option<u64> {
        let at = 112 + 8 * i;
        Some(u64::from_le_bytes(desc.get(at..at + 8)?.try_into().ok()?))
    };
    // user_regs_struct: rbp is the 5th word, rip the 17th, rsp the 20th.
    Some((
        pid,
        super::Registers {
            ip: reg(16)?,
            sp: reg(19)?,
            fp: reg(4)?,
        },
    ))
}

/// The ELF machine of this architecture's programs (`EM_X86_64`), and its name.
pub(crate) const ELF_MACHINE: (u16, &str) = (62, "x86_64");

/// framehop's DWARF unwinder for this architecture.
pub(crate) type DwarfUnwinder<D, P> = framehop::x86_64::UnwinderX86_64<D, P>;
/// framehop's rule cache for this architecture.
pub(crate) type UnwindCache<P> = framehop::x86_64::CacheX86_64<P>;
/// framehop's register set for this architecture.
pub(crate) type UnwindRegs = framehop::x86_64::UnwindRegsX86_64;

/// A register set from an instruction, a stack and a frame pointer (the other registers 0,
/// as framehop's `new` leaves them).
///
/// Copied from a template made once by `new`, then set: `new` is not inlined across crates
/// (no LTO), and the call that fills a 136-byte temporary, then the `memcpy` of it into
/// place, were ~6% of a 42-frame precise capture (`perf`, the speed bench).
///
/// Signal handlers walk stacks through this, so it never waits: a `OnceLock` made a handler
/// that interrupted its own thread in the middle of the template's first making wait for
/// that thread forever (the sampler's thread then waited for the handler: a test hung).
/// Until the template is published, each call makes its own.
#[inline(always)]
pub(crate) fn unwind_regs(ip: u64, sp: u64, fp: u64) -> UnwindRegs {
    let mut r = zeroed_regs();
    r.set_ip(ip);
    r.set_sp(sp);
    r.set_bp(fp);
    r
}

/// The template of [`unwind_regs`]: published once (state 2) by whichever call first claims
/// it (state 1); a call that finds it unpublished makes one itself.
#[inline(always)]
fn zeroed_regs() -> UnwindRegs {
    use std::sync::atomic::{AtomicU8, Ordering};
    struct Template(std::cell::UnsafeCell<std::mem::MaybeUninit<UnwindRegs>>);
    // SAFETY: written once, by the call that moved the state from 0 to 1, before it publishes
    // state 2 (release); read only after state 2 was seen (acquire).
    unsafe impl Sync for Template {}
    static STATE: AtomicU8 = AtomicU8::new(0);
    static TEMPLATE: Template =
        Template(std::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit()));
    if STATE.load(Ordering::Acquire) == 2 {
        // SAFETY: state 2: written and published (see `Template`).
        return unsafe { (*TEMPLATE.0.get()).assume_init() };
    }
    make_zeroed_regs(&STATE, &TEMPLATE.0)
}

/// [`zeroed_regs`]'s slow path, out of line.
#[cold]
#[inline(never)]
fn make_zeroed_regs(
    state: &std::sync::atomic::AtomicU8,
    slot: &std::cell::UnsafeCell<std::mem::MaybeUninit<UnwindRegs>>,
) -> UnwindRegs {
    use std::sync::atomic::Ordering;
    let r = UnwindRegs::new(0, 0, 0);
    if state
        .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // SAFETY: this call alone moved the state from 0 to 1: nothing else writes the slot,
        // and nothing reads it before state 2.
        unsafe { (*slot.get()).write(r) };
        state.store(2, Ordering::Release);
    }
    r
}

/// The frame pointer of a register set (`rbp`).
#[inline(always)]
pub(crate) fn regs_fp(r: &UnwindRegs) -> u64 {
    r.bp()
}

/// The stack pointer of a register set (`rsp`).
#[inline(always)]
pub(crate) fn regs_sp(r: &UnwindRegs) -> u64 {
    r.sp()
}

/// Sets the frame pointer of a register set (`rbp`).
#[inline(always)]
pub(crate) fn set_regs_fp(r: &mut UnwindRegs, fp: u64) {
    r.set_bp(fp)
}

/// DWARF register numbers of the stack pointer, the frame pointer and the return address.
pub(crate) mod dwarf {
    use addr2line::gimli::{Register, X86_64};
    pub(crate) const SP: Register = X86_64::RSP;
    pub(crate) const FP: Register = X86_64::RBP;
    pub(crate) const RA: Register = X86_64::RA;
}

/// The CPU's timestamp counter (`rdtsc`): invariant (constant rate, all cores) on every
/// x86_64 CPU of the last decade.
#[inline(always)]
pub fn timestamp_counter() -> u64 {
    // SAFETY: RDTSC is available on every x86_64 CPU and has no side effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

// A copy whose only memory accesses that can fault are two known instructions (a word's
// load, or `rep movsb` for any other length), so a fault handler can tell a failed probe
// from any other fault by the faulting instruction's address alone, and resume after it
// with a failure (see `probe_copy`, `probe_fixup`). A leaf with no stack of its own (the
// CFI directives give unwinders its one rule: the return address on top). Symbols hidden:
// the program's own, not exported from a shared object (two semver-incompatible copies of
// this crate in one program would clash at link time: hence the version in the names).
core::arch::global_asm!(
    ".pushsection .text.fibertrace_probe_copy_v1,\"ax\",@progbits",
    ".p2align 4",
    ".globl fibertrace_probe_copy_v1",
    ".hidden fibertrace_probe_copy_v1",
    ".type fibertrace_probe_copy_v1,@function",
    "fibertrace_probe_copy_v1:",
    ".cfi_startproc",
    "cmp rdx, 8",
    "jne 2f",
    // The common read, a word: one load.
    ".globl fibertrace_probe_copy_v1_word",
    ".hidden fibertrace_probe_copy_v1_word",
    "fibertrace_probe_copy_v1_word:",
    "mov rax, qword ptr [rsi]",
    "mov qword ptr [rdi], rax",
    "xor eax, eax",
    "ret",
    "2:",
    "mov rcx, rdx",
    ".globl fibertrace_probe_copy_v1_at",
    ".hidden fibertrace_probe_copy_v1_at",
    "fibertrace_probe_copy_v1_at:",
    "rep movsb",
    "xor eax, eax",
    "ret",
    ".globl fibertrace_probe_copy_v1_fault",
    ".hidden fibertrace_probe_copy_v1_fault",
    "fibertrace_probe_copy_v1_fault:",
    "mov eax, 1",
    "ret",
    ".cfi_endproc",
    ".size fibertrace_probe_copy_v1, . - fibertrace_probe_copy_v1",
    ".popsection",
);

extern "C" {
    /// Copies `len` bytes from `src` to `dst`: 0 when done, 1 when a read faulted and a
    /// handler resumed at the fault label (`probe_fixup`).
    fn fibertrace_probe_copy_v1(dst: *mut u8, src: *const u8, len: usize) -> u32;
    /// The copy's two faulting instructions: the word's load, the byte copy.
    static fibertrace_probe_copy_v1_word: u8;
    static fibertrace_probe_copy_v1_at: u8;
    /// Where a fault of that instruction resumes: returns 1.
    static fibertrace_probe_copy_v1_fault: u8;
}

/// Copies `len` bytes from `src` into `dst` (forward, a byte at a time as far as the result
/// goes: overlapping ranges are allowed), `false` if a read of `src` faulted (an unmapped or
/// unreadable address); after a failure `dst`'s contents are unspecified.
///
/// # Safety
/// `dst` is valid for `len` bytes of writes; and every fault this copy can take reaches a
/// handler that calls [`probe_fixup`] first and returns when it says true: a SIGSEGV and
/// SIGBUS handler installed for the process, run where the kernel has room for its frame,
/// neither signal blocked on this thread. Without it, a read of an unmapped address ends
/// the process.
#[inline]
pub unsafe fn probe_copy(dst: *mut u8, src: *const u8, len: usize) -> bool {
    // SAFETY: per the contract: `dst` is writable for `len` bytes, and a faulting read of
    // `src` is turned into a return of 1 by the handler (the copy writes only `dst`).
    unsafe { fibertrace_probe_copy_v1(dst, src, len) == 0 }
}

/// In a SIGSEGV or SIGBUS handler: when the fault is [`probe_copy`]'s read (raised by the
/// kernel for one of its two faulting instructions, not sent by a process), moves the
/// interrupted context to the copy's failure return and says true (the handler then returns
/// at once); false, and `uc` untouched, for anything else. Async-signal-safe.
///
/// # Safety
/// `info` and `uc` are the `siginfo_t` and `ucontext_t` the kernel passed to the handler
/// (its second and third arguments).
pub unsafe fn probe_fixup(info: *const libc::siginfo_t, uc: *mut libc::c_void) -> bool {
    // A signal sent by `kill` or `tgkill` (`si_code <= 0`) while the copy runs is not its
    // fault.
    // SAFETY: the caller passes the handler's own siginfo.
    if unsafe { (*info).si_code } <= 0 {
        return false;
    }
    // SAFETY: the caller passes the handler's own ucontext, valid and ours to change while
    // the handler runs (the kernel restores the context from it when the handler returns).
    let uc = unsafe { &mut *(uc as *mut libc::ucontext_t) };
    let ip = &mut uc.uc_mcontext.gregs[libc::REG_RIP as usize];
    // Only the labels' addresses are taken; nothing is read through them.
    let (word, at, fault) = (
        &raw const fibertrace_probe_copy_v1_word as usize,
        &raw const fibertrace_probe_copy_v1_at as usize,
        &raw const fibertrace_probe_copy_v1_fault as usize,
    );
    if *ip as usize != at && *ip as usize != word {
        return false;
    }
    *ip = fault as i64;
    true
}
