//! `require('fibertrace')`: the process's fibers exported from Lua.
//!
//! `fibertrace.dump([opts])` takes a snapshot of every fiber now (the caller's own trace
//! with its Lua frames too) and returns it in a format of
//! [`fibertrace_fiber::export::Format`] as a string, or writes it to a file:
//!
//! ```lua
//! local ft = require('fibertrace')
//! print(ft.dump())                                  -- text, as the SIGQUIT dump
//! local n = ft.dump{format = 'pprof', file = 'fibers.pb.gz'}   -- bytes written
//! local ok, err = ft.dump{format = 'svg', file = '/no/such/dir/x.svg'}  -- nil, message
//! ```
//!
//! `opts` is a table (or a format name alone); `format` is a string (default `text`),
//! `file` a string (a path, any bytes). A wrong type, an option it does not take or an
//! unknown format is an error; a file
//! that cannot be written is `nil, message` (as `io.open`), and what was at the path stays.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

use fibertrace_fiber::export::{self, Format};
use mlua::ffi;

use super::call::{lua_fn, Call};
use super::raw::{LErr, LResult};

const USAGE: &str = "fibertrace.dump([{format = 'text'|'grouped'|'json'|'pprof'|'folded'|'svg'|'speedscope', file = PATH}])";

/// Reads string field `key` of the options table at 1: `None` when nil; an error names the
/// function by its `usage`.
fn string_field(c: &mut Call, key: &str, usage: &str) -> Result<Option<Vec<u8>>, LErr> {
    c.push_field(1, key)?;
    let v = match c.type_of(-1) {
        ffi::LUA_TNIL => None,
        ffi::LUA_TSTRING => c.string_bytes(-1),
        _ => {
            c.pop(1);
            return Err(LErr::plain(format!("{usage}: {key} must be a string")));
        }
    };
    c.pop(1);
    Ok(v)
}

/// The argument of `usage` being neither a table nor a name: said with the function's name
/// (Lua's own message named it `?`: it is reached as a field of the module).
fn bad_argument(c: &Call, usage: &str) -> LErr {
    LErr::plain(format!(
        "{usage}: the argument is a table of options or a format name, not a {}",
        c.type_name(1)
    ))
}

/// An error naming the first key of the options table at 1 that `usage` does not take: a
/// misspelt option (`fromat`) was ignored, the default used without a word.
fn unknown_option(c: &mut Call, allowed: &[&str], usage: &str) -> Result<(), LErr> {
    match c.key_not_in(1, allowed)? {
        None => Ok(()),
        Some(k) => {
            let k = if k.starts_with('"') {
                format!("option {k}")
            } else {
                k
            };
            Err(LErr::plain(format!(
                "{usage}: {k} is not one it takes ({})",
                allowed.join(", ")
            )))
        }
    }
}

pub(super) fn dump_body(c: &mut Call) -> LResult {
    if c.top() > 1 {
        return Err(LErr::plain(format!("{USAGE}: one argument at most")));
    }
    let (format, file) = match c.type_of(1) {
        ffi::LUA_TNONE | ffi::LUA_TNIL => (None, None),
        ffi::LUA_TSTRING => (c.string_bytes(1), None),
        ffi::LUA_TTABLE => {
            unknown_option(c, &["format", "file"], USAGE)?;
            (
                string_field(c, "format", USAGE)?,
                string_field(c, "file", USAGE)?,
            )
        }
        _ => return Err(bad_argument(c, USAGE)),
    };
    let format = match format {
        None => Format::Text,
        Some(b) => {
            let name = String::from_utf8_lossy(&b);
            Format::parse(&name).map_err(|e| LErr::plain(format!("{USAGE}: {e}")))?
        }
    };
    if file.as_deref().is_some_and(<[u8]>::is_empty) {
        return Err(LErr::plain(format!("{USAGE}: file is empty")));
    }
    let snap = super::info::snapshot_here(c.state(), "f_dump");
    let bytes = export::to_bytes(&snap, format);
    give(c, &bytes, file)
}
lua_fn!(f_dump, dump_body);

/// Returns `bytes` to Lua, or writes them to `file` and returns how many (`nil, message` as
/// `io.open` when the file cannot be written; what was at the path stays).
fn give(c: &mut Call, bytes: &[u8], file: Option<Vec<u8>>) -> LResult {
    match file {
        None => {
            c.push_bytes(bytes)?;
            Ok(1)
        }
        Some(path) => match export::write_file(Path::new(OsStr::from_bytes(&path)), bytes) {
            Ok(()) => {
                c.push_int(bytes.len() as i64)?;
                Ok(1)
            }
            Err(e) => {
                c.push_nil()?;
                c.push_str(&e.to_string())?;
                Ok(2)
            }
        },
    }
}

const HEAP_USAGE: &str =
    "fibertrace.heap([{format = 'table'|'text'|'pprof'|'lws', top = N, file = PATH}])";

/// Most stacks `fibertrace.heap` lists.
const HEAP_TOP_MAX: i64 = 100_000;

use crate::heap::fiber_name;

/// Reads `top` of the options table at 1: 20 when nil, else an integer in 1..=HEAP_TOP_MAX.
fn top_field(c: &mut Call) -> Result<usize, LErr> {
    c.push_field(1, "top")?;
    let r = match c.type_of(-1) {
        ffi::LUA_TNIL => Ok(20),
        ffi::LUA_TNUMBER => match c.to_number(-1) {
            Some(n) if n.fract() == 0.0 && n >= 1.0 && n <= HEAP_TOP_MAX as f64 => Ok(n as usize),
            _ => Err(LErr::plain(format!(
                "{HEAP_USAGE}: top must be an integer from 1 to {HEAP_TOP_MAX}"
            ))),
        },
        _ => Err(LErr::plain(format!("{HEAP_USAGE}: top must be a number"))),
    };
    c.pop(1);
    r
}

/// `fibertrace.heap([opts])`: the live heap (see the module doc of `fibertrace_core::heap`).
/// `format`: `table` (the default: figures, exited fibers and the top stacks as a Lua
/// table), `text` (the same as a report), `pprof` (a gzipped heap profile with Go's four
/// sample types), `lws` (one `~m#` line per live allocation). `nil, message` when the heap
/// is not tracked or the file cannot be written.
pub(super) fn heap_body(c: &mut Call) -> LResult {
    use fibertrace_core::heap;
    if c.top() > 1 {
        return Err(LErr::plain(format!("{HEAP_USAGE}: one argument at most")));
    }
    let (format, file, top) = match c.type_of(1) {
        ffi::LUA_TNONE | ffi::LUA_TNIL => (None, None, 20),
        ffi::LUA_TSTRING => (c.string_bytes(1), None, 20),
        ffi::LUA_TTABLE => {
            unknown_option(c, &["format", "file", "top"], HEAP_USAGE)?;
            (
                string_field(c, "format", HEAP_USAGE)?,
                string_field(c, "file", HEAP_USAGE)?,
                top_field(c)?,
            )
        }
        _ => return Err(bad_argument(c, HEAP_USAGE)),
    };
    let format = format.unwrap_or_else(|| b"table".to_vec());
    if file.as_deref().is_some_and(<[u8]>::is_empty) {
        return Err(LErr::plain(format!("{HEAP_USAGE}: file is empty")));
    }
    if !matches!(&format[..], b"table" | b"text" | b"pprof" | b"lws") {
        return Err(LErr::plain(format!(
            "{HEAP_USAGE}: unknown format {}",
            fibertrace_fiber::export::short_quoted(&String::from_utf8_lossy(&format))
        )));
    }
    if format == b"table" && file.is_some() {
        return Err(LErr::plain(format!(
            "{HEAP_USAGE}: a table is not written to a file (format text, pprof or lws is)"
        )));
    }
    if heap::tier() == heap::Tier::Off {
        c.push_nil()?;
        c.push_str(export::NOT_TRACKED)?;
        return Ok(2);
    }
    let label = |id| crate::render::lua_line(id);
    // The report's own work is not tracked (it would list itself).
    let _untracked = heap::pause();
    let bytes = match &format[..] {
        b"pprof" => match export::heap_pprof(&fiber_name, &label, heap::frames_of) {
            Ok(b) => b,
            Err(e) => {
                c.push_nil()?;
                c.push_str(&e.to_string())?;
                return Ok(2);
            }
        },
        b"lws" => match heap::m_lines() {
            Ok((text, _)) => text,
            Err(e) => {
                c.push_nil()?;
                c.push_str(&e.to_string())?;
                return Ok(2);
            }
        },
        b"text" => crate::heap_text(top).into_bytes(),
        _ => return heap_table(c, top),
    };
    give(c, &bytes, file)
}
lua_fn!(f_heap, heap_body);

/// The table view: `{tier, estimated, live_bytes, live_objects, outside = {bytes, objects},
/// exited = {{fiber, bytes, objects}...}, stacks = {{bytes, objects, fibers = {{fiber,
/// name, exited, bytes, objects}...}, frames = {line...}}...}}`.
fn heap_table(c: &mut Call, top: usize) -> LResult {
    use fibertrace_core::heap;
    let groups = crate::heap_groups();
    let summary = fibertrace_fiber::inspect::HeapSummary::now().unwrap_or_default();
    let tier = heap::tier();
    /// A share: fiber, its name (live), exited, bytes, allocations.
    type Share = (Option<u64>, Option<String>, bool, i64, i64);
    struct G {
        bytes: i64,
        objects: i64,
        fibers: Vec<Share>,
        frames: Vec<String>,
    }
    let gs: Vec<G> = groups
        .iter()
        .take(top)
        .map(|(g, frames)| G {
            bytes: g.bytes,
            objects: g.objects,
            fibers: g
                .fibers
                .iter()
                .map(|s| {
                    let name = s.fiber.filter(|_| !s.exited).and_then(fiber_name);
                    (s.fiber, name, s.exited, s.bytes, s.objects)
                })
                .collect(),
            frames: frames.clone(),
        })
        .collect();
    let (live_bytes, live_objects) = groups
        .iter()
        .fold((0i64, 0i64), |(b, o), (g, _)| (b + g.bytes, o + g.objects));
    let n = c.protected(&[], |p| {
        p.new_table(0, 8);
        let t = p.top();
        p.push_str(match tier {
            heap::Tier::Every => "every",
            heap::Tier::Sampled => "sampled",
            heap::Tier::Off => "off",
        });
        p.set_field(t, c"tier");
        p.push_bool_value(tier == heap::Tier::Sampled);
        p.set_field(t, c"estimated");
        p.push_int(live_bytes);
        p.set_field(t, c"live_bytes");
        p.push_int(live_objects);
        p.set_field(t, c"live_objects");
        p.new_table(0, 2);
        let o = p.top();
        p.push_int(summary.outside.live_bytes);
        p.set_field(o, c"bytes");
        p.push_int(summary.outside.live_objects);
        p.set_field(o, c"objects");
        p.set_field(t, c"outside");
        p.new_table(summary.exited.len() as i32, 0);
        let e = p.top();
        for (i, (f, u)) in summary.exited.iter().enumerate() {
            p.new_table(0, 3);
            let r = p.top();
            p.push_int(*f as i64);
            p.set_field(r, c"fiber");
            p.push_int(u.live_bytes);
            p.set_field(r, c"bytes");
            p.push_int(u.live_objects);
            p.set_field(r, c"objects");
            p.set_index(e, i as i64 + 1);
        }
        p.set_field(t, c"exited");
        p.new_table(gs.len() as i32, 0);
        let st = p.top();
        for (i, g) in gs.iter().enumerate() {
            p.new_table(0, 4);
            let r = p.top();
            p.push_int(g.bytes);
            p.set_field(r, c"bytes");
            p.push_int(g.objects);
            p.set_field(r, c"objects");
            p.new_table(g.fibers.len() as i32, 0);
            let fs = p.top();
            for (j, (fiber, name, exited, bytes, objects)) in g.fibers.iter().enumerate() {
                p.new_table(0, 5);
                let x = p.top();
                if let Some(f) = fiber {
                    p.push_int(*f as i64);
                    p.set_field(x, c"fiber");
                }
                if let Some(n) = name {
                    p.push_str(n);
                    p.set_field(x, c"name");
                }
                p.push_bool_value(*exited);
                p.set_field(x, c"exited");
                p.push_int(*bytes);
                p.set_field(x, c"bytes");
                p.push_int(*objects);
                p.set_field(x, c"objects");
                p.set_index(fs, j as i64 + 1);
            }
            p.set_field(r, c"fibers");
            p.new_table(g.frames.len() as i32, 0);
            let fr = p.top();
            for (j, line) in g.frames.iter().enumerate() {
                p.push_str(line);
                p.set_index(fr, j as i64 + 1);
            }
            p.set_field(r, c"frames");
            p.set_index(st, i as i64 + 1);
        }
        p.set_field(t, c"stacks");
        1
    })?;
    Ok(n)
}
