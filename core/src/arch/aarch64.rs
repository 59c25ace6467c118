//! aarch64: not built yet.
//!
//! This file is where aarch64's side of [`super`] goes: register reads from a `ucontext_t`
//! (`uc_mcontext.regs[29]` is the frame pointer, `sp` and `pc` beside it), the
//! `rt_sigreturn` check (`mov x8, #139; svc #0`), a prefetch (`prfm pldl1keep`), framehop's
//! `aarch64` types with the same names as `x86_64.rs` gives them (`DwarfUnwinder`,
//! `UnwindCache`, `UnwindRegs`, `unwind_regs`, `regs_fp`, `set_regs_fp`), the DWARF numbers
//! (`SP` 31, `FP` 29, `RA` 30), the cycle counter (`cntvct_el0`), the one-instruction store (`str`) of
//! `__fibertrace_store_word_here!`, and the probe copy
//! (`probe_copy`, `probe_fixup`: a copy whose faulting loads are known instructions, the
//! handler moving `pc` to its failure return).
//!
//! Why it is not here yet: this machine cannot build or run aarch64 code (the
//! `aarch64-unknown-linux-gnu` standard library cannot be installed with rustup here, and
//! there is no aarch64 machine or emulator to run the exact-frame tests on), and code that is
//! never compiled or tested would be a guess. `lib.rs` refuses other targets with a clear
//! error until then.
