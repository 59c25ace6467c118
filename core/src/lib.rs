//! fibertrace-core: capture, unwind, resolve and format backtraces — of the current stack and
//! of suspended coroutines — and encode them compactly.
//!
//! The pipeline: `capture` (registers and stack bounds) → `unwind` (frame-pointer or DWARF
//! walk, bounded to one stack) → `symbolize` (lazy, cached) → `format` / `codec`.

pub mod codec;
pub mod frame;

pub use frame::{FiberId, Frame, LuaFrameId};
