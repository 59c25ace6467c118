//! fibertrace-core: capture, unwind, resolve and format backtraces — of the current stack and
//! of suspended coroutines — and encode them compactly.
//!
//! The pipeline: [`capture`] (registers and stack bounds) → [`unwind`] (frame-pointer or DWARF
//! walk, bounded to known stacks) → [`symbolize`] (lazy, cached, per-image debug info) →
//! [`format`](mod@format) / [`codec`]. [`image`] is the table of loaded objects both unwinding and
//! symbolization use.
//!
//! ```
//! use fibertrace_core::{collect, CaptureOptions};
//! let bt = collect(&CaptureOptions::default());
//! assert!(!bt.is_empty());
//! println!("{}", fibertrace_core::format::display(bt.frames()));
//! ```

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
compile_error!("fibertrace-core supports x86_64 Linux only for now (aarch64 would add leaf files)");

pub mod arch;
pub mod backtrace;
pub mod capture;
pub mod codec;
pub mod format;
pub mod frame;
pub mod heap;
mod holding;
pub mod image;
pub mod remote;
pub mod symbolize;
mod untracked;
pub mod unwind;

pub use backtrace::{Backtrace, CaptureOptions, Unwinder, CAPACITY};
pub use capture::{
    collect, collect_from, collect_from_held, collect_from_into, collect_from_origin,
    collect_from_ucontext, collect_into, collect_raw, collect_until, enter_stack, prepare,
    Registers, SavedContext, StackBounds,
};
pub use frame::{FiberId, Frame, LuaFrameId};
pub use symbolize::{resolve, Resolved, Symbol};
