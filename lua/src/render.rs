//! Render: names for Lua frames, for core's text formatters and Tarantool's format.
//!
//! A Lua frame prints as Tarantool's L line body `%s in %s:%d`: the function's name (or
//! `function <short_src:linedefined>` for an unnamed Lua function, `?` for an unnamed C
//! function), the *raw* source (with its `@`/`=` prefix, as Tarantool prints it) and the
//! current line (`-1` for C functions). A whole trace prints in Tarantool's G3 format, C and
//! Lua lines numbered together from 1:
//!
//! ```text
//! #1  0x55d4c3a01234 in capture_cb+52
//! #2  leaf in @script.lua:2
//! #3  pcall in =[C]:-1
//! ```
//!
//! Ids this process never gave out (a trace decoded from elsewhere) print as core's
//! `[lua frame N]`.

use fibertrace_core::format::{self, TextOptions};
use fibertrace_core::{Frame, LuaFrameId};

use crate::frames::intern::describe;

/// The body of a Lua frame's line: `name in source:line`.
pub fn lua_line(id: LuaFrameId) -> Option<String> {
    let info = describe(id)?;
    // (A chunk's name is any string a script gave `load`, and another process's is read
    // from its memory: written with control characters escaped, as for a terminal.)
    Some(format!(
        "{} in {}:{}",
        fibertrace_core::format::Escaped(&info.display_name()),
        fibertrace_core::format::Escaped(&info.source),
        info.current_line
    ))
}

/// Core's default text format with Lua frames named.
pub fn text(frames: &[Frame]) -> String {
    let namer = lua_line;
    format::text(
        frames,
        &TextOptions {
            lua: Some(&namer),
            ..TextOptions::default()
        },
    )
}

/// Tarantool's G3 format, one line per frame, numbered from 1.
pub fn tarantool(frames: &[Frame]) -> String {
    let namer = lua_line;
    format::tarantool(frames, Some(&namer))
}

/// [`tarantool`] as reports print it: without the glue frames of the runtime and the host
/// (`fibertrace_fiber::glue`), unless the process asked for every native frame.
pub fn tarantool_report(frames: &[Frame]) -> String {
    let namer = lua_line;
    format::tarantool_hiding(frames, Some(&namer), fibertrace_fiber::glue::filter())
}

/// One entry of a Tarantool-style `backtrace` array: `{C = "..."}` or `{L = "..."}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TarantoolEntry {
    /// A native frame (or a marker), `#%-2d %p in %s+%lu`.
    C(String),
    /// A Lua frame, `#%-2d %s in %s:%d`.
    L(String),
}

/// The entries of a trace as Tarantool's `fiber.info()` lists them, numbered from 1
/// (parent-fiber boundaries are skipped and do not take a number).
pub fn tarantool_entries(frames: &[Frame]) -> Vec<TarantoolEntry> {
    tarantool_entries_from(frames, 1)
}

/// [`tarantool_entries`] numbered from `first`.
pub fn tarantool_entries_from(frames: &[Frame], first: usize) -> Vec<TarantoolEntry> {
    let mut out = Vec::with_capacity(frames.len());
    let mut n = first;
    for f in frames {
        let e = match f {
            Frame::Parent(_) => continue,
            Frame::Lua(id) => TarantoolEntry::L(match lua_line(*id) {
                Some(s) => format!("#{n:<2} {s}"),
                None => format!("#{n:<2} [lua frame {}]", id.0),
            }),
            Frame::Omitted(k) => TarantoolEntry::C(format!("#{n:<2} ... {k} frames omitted")),
            Frame::Truncated => TarantoolEntry::C(format!("#{n:<2} ... truncated")),
            _ => TarantoolEntry::C(
                format::tarantool_c_frame(n, f).unwrap_or_else(|| format!("#{n:<2} ??")),
            ),
        };
        out.push(e);
        n += 1;
    }
    out
}
