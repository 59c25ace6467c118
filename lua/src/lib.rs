//! fibertrace-lua: Lua frames and the `fibertrace` command-line program.
//!
//! For now this crate holds the log decoder behind `fibertrace decode` ([`decode`], with
//! offline symbolization in [`symbols`]).

pub mod decode;
pub mod symbols;
