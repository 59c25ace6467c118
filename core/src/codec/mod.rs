//! Backtrace codecs: how traces leave the process (logs, files) and how many of them are kept.
//!
//! * [`lws`]: libwebsockets' compressed backtrace, bit-exact, and its `~m#` / `~b#` log lines.
//! * [`cbf`]: Swift's Compact Backtrace Format v0 (16/32/64-bit words).
//! * [`native`]: fibertrace's own compact per-trace format, smallest of the three, optionally
//!   module-relative against an image table so that a logged trace can be symbolized offline.
//! * [`intern`]: an interned stack store (prefix tree of shared stack suffixes) for keeping many
//!   traces, each one a small id.
//! * [`text`]: the textual frame list (`pc:0x… ra:0x… omit:N trunc`) used by tests and tools.
//!
//! Every decoder takes hostile input: it returns [`Error`] instead of panicking and caps what it
//! allocates. Frames are listed innermost first everywhere.

pub mod base64;
pub(crate) mod bits;
mod error;
pub mod lws;

pub use error::Error;
pub mod cbf;
pub mod intern;
pub mod native;
pub mod text;
