//! Arch: the machine state a walk starts from and the code that reads it, below both
//! [`crate::capture`] (which records it) and [`crate::unwind`] (which walks from it).
//!
//! The types here are the same on every architecture (an instruction, a stack and a frame
//! pointer; a stack's bounds; a suspended context); what reads registers, decodes a signal
//! frame or prefetches lives in one leaf file per architecture (`x86_64.rs`: the only one
//! built so far; `aarch64.rs` says what it needs and why it is not built; `lib.rs` refuses
//! other targets with a clear error). Adding one adds a leaf file and its `cfg` lines here:
//! the code outside this folder names only what the leaf files export (framehop's types and
//! the DWARF register numbers under arch-neutral names, the cycle counter).

use serde::{Deserialize, Serialize};

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86_64;
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::{
    dwarf, regs_fp, regs_sp, set_regs_fp, unwind_regs, DwarfUnwinder, UnwindCache, UnwindRegs,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::{
    general_from_prstatus, general_from_user_regs, general_register, GeneralRegs,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::{is_sigreturn, UCONTEXT_REGS};
#[cfg(target_arch = "x86_64")]
pub use x86_64::{
    prefetch, prefetch_far, probe_copy, probe_fixup, register_from_ucontext,
    registers_from_ucontext, timestamp_counter,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::{registers_from_prstatus, registers_from_user_regs, ELF_MACHINE};

/// The registers a walk starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[repr(C)]
pub struct Registers {
    /// Instruction pointer.
    pub ip: u64,
    /// Stack pointer.
    pub sp: u64,
    /// Frame pointer (`rbp` on x86_64).
    pub fp: u64,
}

/// A stack's address range `[lo, hi)`; `hi` is the stack's base (stacks grow down).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(C)]
pub struct StackBounds {
    /// Lowest address.
    pub lo: u64,
    /// One past the highest address.
    pub hi: u64,
}

impl StackBounds {
    /// Bounds `[lo, hi)`.
    pub const fn new(lo: u64, hi: u64) -> Self {
        StackBounds { lo, hi }
    }

    /// Whether `addr` lies inside.
    #[inline]
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.lo && addr < self.hi
    }
}

/// The saved context of a suspended coroutine: registers at its suspension point and the
/// bounds of its stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[repr(C)]
pub struct SavedContext {
    /// Registers recorded at the suspension point.
    pub regs: Registers,
    /// The coroutine's stack. Walks read only `[regs.sp, stack.hi)`.
    pub stack: StackBounds,
    /// When nonzero, the stack pointer of the runtime's entry frame on this stack (at its
    /// call of the user's code): the trace ends with the frame that entry function called
    /// (see [`crate::capture::collect_until`]).
    pub stop_sp: u64,
}

impl SavedContext {
    /// A context for a stack whose registers are not recorded yet.
    pub const fn new(stack: StackBounds) -> Self {
        SavedContext {
            regs: Registers {
                ip: 0,
                sp: 0,
                fp: 0,
            },
            stack,
            stop_sp: 0,
        }
    }

    /// Records the registers of the calling function (inlined: three register reads and
    /// three stores). Call it in the runtime's `#[inline(never)]` suspend wrapper just before
    /// switching away; the wrapper is then the first frame of
    /// [`crate::capture::collect_from`] (skip it with `offset: 1`).
    #[inline(always)]
    pub fn record(&mut self) {
        self.regs = crate::__fibertrace_registers_here!();
    }

    /// Whether registers were recorded (a context never suspended has none).
    pub fn is_recorded(&self) -> bool {
        self.regs.sp != 0 && self.stack.contains(self.regs.sp)
    }
}
