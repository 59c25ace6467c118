//! fibertrace-lua: Lua frames and the `fibertrace` command-line program.
//!
//! For now this crate holds the log decoder behind `fibertrace decode` ([`decode`]).

pub mod decode;
