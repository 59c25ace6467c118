//! Format: backtraces as text (a readable default and Tarantool's G3 format) and as
//! serializable resolved values.
//!
//! The default format, one line per frame, with inline frames as continuation lines:
//!
//! ```text
//! #0  0x55d4c3a01234 in app::leaf+0x1f at src/app.rs:12
//!     inlined into app::middle at src/app.rs:20
//! #1  0x55d4c3a01300 in app::root+0x40 at src/app.rs:31
//! #2  ... 91 frames omitted ...
//! --- created by fiber 7 ---
//! #3  0x7f0c1a2b3c4d in ?? (libfoo.so+0x3c4d)
//! ```
//!
//! Names come from [`crate::symbolize`]; nothing is resolved until a formatter runs.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::frame::{Frame, LuaFrameId};
use crate::symbolize::{self, Resolved};

/// Names a Lua frame for text output (the Lua side provides it).
pub type LuaNamer<'a> = &'a dyn Fn(LuaFrameId) -> Option<String>;

/// Options of the default text format.
#[derive(Clone, Copy, Default)]
pub struct TextOptions<'a> {
    /// Number of the first frame (0 by default; Tarantool numbers from 1).
    pub first_index: usize,
    /// Names Lua frames; without it they print as `[lua frame N]`.
    pub lua: Option<LuaNamer<'a>>,
    /// Leave inline frames out (one line per address).
    pub hide_inlined: bool,
    /// Leaves out the function levels it says are glue (a runtime's or a host's own calls
    /// between the user's code and what it called: `catch_unwind` and its closures, a
    /// trampoline): a frame whose every level is glue is left out and the frames are
    /// numbered without it; of a frame with some glue levels, the others are shown.
    pub hide: Option<GlueFilter<'a>>,
}

/// Says whether a resolved function level is glue (see [`TextOptions::hide`]).
pub type GlueFilter<'a> = &'a dyn Fn(&crate::symbolize::Symbol) -> bool;

/// Formats frames in the default format.
pub fn display(frames: &[Frame]) -> String {
    text(frames, &TextOptions::default())
}

/// Formats frames in the default format with options.
pub fn text(frames: &[Frame], opts: &TextOptions<'_>) -> String {
    let mut out = String::new();
    let mut n = opts.first_index;
    for f in frames {
        match f {
            Frame::Parent(id) => {
                let _ = writeln!(out, "--- created by fiber {id} ---");
                continue;
            }
            Frame::Omitted(k) => {
                let _ = writeln!(out, "#{n:<2} ... {k} frames omitted ...");
            }
            Frame::Truncated => {
                let _ = writeln!(out, "#{n:<2} ... truncated ...");
            }
            Frame::Lua(id) => {
                let name = opts.lua.and_then(|l| l(*id));
                match name {
                    Some(s) => {
                        let _ = writeln!(out, "#{n:<2} {s}");
                    }
                    None => {
                        let _ = writeln!(out, "#{n:<2} [lua frame {}]", id.0);
                    }
                }
            }
            Frame::Pc(a) | Frame::Ra(a) | Frame::Async(a) => {
                let r = symbolize::resolve(f).expect("native frames resolve");
                if !native_line(&mut out, n, *a, &r, opts) {
                    continue;
                }
            }
        }
        n += 1;
    }
    out
}

/// Formats frames already resolved (another process's, whose names this process's
/// symbolizer cannot find) in the default format.
pub fn text_resolved(frames: &[ResolvedFrame], opts: &TextOptions<'_>) -> String {
    let mut out = String::new();
    let mut n = opts.first_index;
    for rf in frames {
        match (&rf.frame, &rf.resolved) {
            (Frame::Pc(a) | Frame::Ra(a) | Frame::Async(a), Some(r)) => {
                if !native_line(&mut out, n, *a, r, opts) {
                    continue;
                }
            }
            (Frame::Pc(a) | Frame::Ra(a) | Frame::Async(a), None) => {
                let _ = writeln!(out, "#{n:<2} {a:#x} in ??");
            }
            (Frame::Lua(_), Some(r)) if r.symbols.len() == 1 => {
                // A Lua frame another process's layer described: `name in source:line`.
                let sym = &r.symbols[0];
                let line = sym.line.map_or(-1, i64::from);
                // (Names and sources come from another process's memory: written escaped.)
                let _ = writeln!(
                    out,
                    "#{n:<2} {} in {}:{line}",
                    Escaped(sym.name.as_deref().unwrap_or("?")),
                    Escaped(sym.file.as_deref().unwrap_or("?"))
                );
            }
            (Frame::Parent(_), _) => {
                // Not a frame: not numbered.
                out.push_str(&text(std::slice::from_ref(&rf.frame), opts));
                continue;
            }
            (f, _) => {
                // Markers and Lua frames as `text` writes them.
                let one = text(
                    std::slice::from_ref(f),
                    &TextOptions {
                        first_index: n,
                        ..*opts
                    },
                );
                if one.is_empty() {
                    continue;
                }
                out.push_str(&one);
            }
        }
        n += 1;
    }
    out
}

/// Writes one native frame; `false` when the glue filter left it out whole.
fn native_line(out: &mut String, n: usize, addr: u64, r: &Resolved, opts: &TextOptions) -> bool {
    let levels = &r.symbols;
    if levels.is_empty() || r.function().is_none() && levels.iter().all(|s| s.name.is_none()) {
        let _ = write!(out, "#{n:<2} {addr:#x} in ??");
        if let Some(img) = &r.image {
            let name = img.path.rsplit('/').next().unwrap_or(&img.path);
            let _ = write!(
                out,
                " ({}+{:#x})",
                Escaped(name),
                addr.wrapping_sub(img.base)
            );
        }
        out.push('\n');
        return true;
    }
    let last = levels.len() - 1;
    let glue = |i: usize| opts.hide.is_some_and(|h| h(&levels[i]));
    let shown: Vec<usize> = if opts.hide_inlined {
        if glue(last) {
            vec![]
        } else {
            vec![last]
        }
    } else {
        (0..levels.len()).filter(|&i| !glue(i)).collect()
    };
    if shown.is_empty() {
        return false;
    }
    let _ = write!(out, "#{n:<2} {addr:#x} in ");
    for (k, &i) in shown.iter().enumerate() {
        let s = &levels[i];
        if k > 0 {
            out.push_str("    inlined into ");
        }
        // (Names and paths may come from another process's files: written escaped.)
        let _ = write!(out, "{}", Escaped(s.name.as_deref().unwrap_or("??")));
        if i == last {
            if let Some(off) = r.offset_of(addr) {
                let _ = write!(out, "+{off:#x}");
            }
        }
        // With inline levels hidden, the line shown is the innermost one's.
        let loc = if opts.hide_inlined { &levels[0] } else { s };
        if let Some(file) = &loc.file {
            let _ = write!(out, " at {}", Escaped(file));
            if let Some(line) = loc.line {
                let _ = write!(out, ":{line}");
            }
        }
        out.push('\n');
    }
    true
}

/// One native frame in Tarantool's G3 format: `#%-2d %p in %s+%lu` — the outermost
/// function's demangled name and the decimal offset of the address from its start, as the
/// symbol table gives them (as Tarantool's do: the program's DWARF is not loaded for them);
/// `??+0` when unresolved.
pub fn tarantool_c_frame(index: usize, frame: &Frame) -> Option<String> {
    let addr = frame.address()?;
    let r = symbolize::resolve_outer(frame)?;
    Some(match (r.function(), r.offset_of(addr)) {
        (Some(name), Some(off)) => format!("#{index:<2} {addr:#x} in {name}+{off}"),
        (Some(name), None) => format!("#{index:<2} {addr:#x} in {name}+0"),
        _ => format!("#{index:<2} {addr:#x} in ??+0"),
    })
}

/// A whole trace in Tarantool's G3 format, numbered from 1, one frame per line. Markers
/// print as `#N  ... k frames omitted` / `... truncated`; Lua frames through `lua` (or as
/// `[lua frame N]`).
pub fn tarantool(frames: &[Frame], lua: Option<LuaNamer<'_>>) -> String {
    tarantool_hiding(frames, lua, None)
}

/// [`tarantool`] without the native frames whose every function level `hide` says is glue
/// (see [`TextOptions::hide`]), numbered without them.
pub fn tarantool_hiding(
    frames: &[Frame],
    lua: Option<LuaNamer<'_>>,
    hide: Option<GlueFilter<'_>>,
) -> String {
    let mut out = String::new();
    let mut n = 1;
    for f in frames {
        if let (Some(h), Some(r)) = (hide, f.address().and_then(|_| symbolize::resolve(f))) {
            if !r.symbols.is_empty() && r.symbols.iter().all(h) {
                continue;
            }
        }
        let line = match f {
            Frame::Parent(id) => {
                let _ = writeln!(out, "--- created by fiber {id} ---");
                continue;
            }
            Frame::Omitted(k) => format!("#{n:<2} ... {k} frames omitted"),
            Frame::Truncated => format!("#{n:<2} ... truncated"),
            Frame::Lua(id) => match lua.and_then(|l| l(*id)) {
                Some(s) => format!("#{n:<2} {s}"),
                None => format!("#{n:<2} [lua frame {}]", id.0),
            },
            _ => tarantool_c_frame(n, f).expect("native frame"),
        };
        out.push_str(&line);
        out.push('\n');
        n += 1;
    }
    out
}

/// A backtrace with every native frame resolved: serializable (serde) for JSON dumps.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedBacktrace {
    /// The frames in order.
    pub frames: Vec<ResolvedFrame>,
}

/// One resolved frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedFrame {
    /// The raw frame.
    pub frame: Frame,
    /// Its resolution (native frames only).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub resolved: Option<Resolved>,
}

/// Resolves every native frame of a trace into a serializable value.
pub fn resolve_all(frames: &[Frame]) -> ResolvedBacktrace {
    ResolvedBacktrace {
        frames: frames
            .iter()
            .map(|f| ResolvedFrame {
                frame: *f,
                resolved: symbolize::resolve(f).map(|r| (*r).clone()),
            })
            .collect(),
    }
}

/// Text from outside (another process's thread names, paths, a log line's token) written for
/// a terminal: control characters — C0, DEL and C1, which a terminal takes as commands (an
/// escape sequence that clears the screen or sets the window's title) — as `\xNN` (or `\n`,
/// `\t`, `\r`, `\e`); everything else as it is (a backslash too: a message that already
/// escaped a character, `'\u{1b}'`, is not escaped twice).
pub struct Escaped<'a>(pub &'a str);

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        escape_into(f, self.0, false)
    }
}

/// [`Escaped`] between double quotes, a quote and a backslash inside escaped (`\"`, `\\`):
/// `"name"`, unambiguous.
pub struct Quoted<'a>(pub &'a str);

impl std::fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_char('"')?;
        escape_into(f, self.0, true)?;
        f.write_char('"')
    }
}

fn escape_into(f: &mut std::fmt::Formatter<'_>, s: &str, quoted: bool) -> std::fmt::Result {
    // (Most text has nothing to escape: written at once.)
    let plain = |c: char| !(c.is_control() || (quoted && (c == '\\' || c == '"')));
    if s.chars().all(plain) {
        return f.write_str(s);
    }
    for c in s.chars() {
        match c {
            '\\' if quoted => f.write_str("\\\\")?,
            '"' if quoted => f.write_str("\\\"")?,
            '\n' => f.write_str("\\n")?,
            '\t' => f.write_str("\\t")?,
            '\r' => f.write_str("\\r")?,
            '\x1b' => f.write_str("\\e")?,
            c if c.is_control() => match c as u32 {
                n @ 0..=0xff => write!(f, "\\x{n:02x}")?,
                n => write!(f, "\\u{{{n:x}}}")?,
            },
            c => f.write_char(c)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod escape_tests {
    use super::{Escaped, Quoted};

    #[test]
    fn control_characters_are_written_escaped_and_the_rest_as_is() {
        // A thread name that would clear the screen and set the window's title.
        assert_eq!(
            Quoted("\x1b]0;pwn\x07\x1b[2J").to_string(),
            "\"\\e]0;pwn\\x07\\e[2J\""
        );
        assert_eq!(Quoted("a\"b\\c").to_string(), "\"a\\\"b\\\\c\"");
        assert_eq!(Escaped("a\"b").to_string(), "a\"b");
        // A message that escaped a character already keeps its one backslash.
        assert_eq!(
            Escaped("'\\u{1b}' in \x1b[2J").to_string(),
            "'\\u{1b}' in \\e[2J"
        );
        // C1 controls (8-bit CSI), DEL, tabs and lines.
        assert_eq!(
            Escaped("\u{9b}2J\x7f\t\n\r").to_string(),
            "\\x9b2J\\x7f\\t\\n\\r"
        );
        // Text with nothing to escape, any script.
        assert_eq!(Quoted("worker-7 è 名前").to_string(), "\"worker-7 è 名前\"");
        assert_eq!(Escaped("").to_string(), "");
    }
}
