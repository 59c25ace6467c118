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
//! `file` a string (a path, any bytes). A wrong type or an unknown format is an error; a file
//! that cannot be written is `nil, message` (as `io.open`), and what was at the path stays.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

use fibertrace_fiber::export::{self, Format};
use mlua::ffi;

use super::call::{lua_fn, Call};
use super::raw::{LErr, LResult};

const USAGE: &str = "fibertrace.dump([{format = 'text'|'grouped'|'json'|'pprof'|'folded'|'svg'|'speedscope', file = PATH}])";

/// Reads string field `key` of the options table at 1: `None` when nil.
fn string_field(c: &mut Call, key: &str) -> Result<Option<Vec<u8>>, LErr> {
    c.push_field(1, key)?;
    let v = match c.type_of(-1) {
        ffi::LUA_TNIL => None,
        ffi::LUA_TSTRING => c.string_bytes(-1),
        _ => {
            c.pop(1);
            return Err(LErr::plain(format!("{USAGE}: {key} must be a string")));
        }
    };
    c.pop(1);
    Ok(v)
}

pub(super) fn dump_body(c: &mut Call) -> LResult {
    if c.top() > 1 {
        return Err(LErr::plain(format!("{USAGE}: one argument at most")));
    }
    let (format, file) = match c.type_of(1) {
        ffi::LUA_TNONE | ffi::LUA_TNIL => (None, None),
        ffi::LUA_TSTRING => (c.string_bytes(1), None),
        ffi::LUA_TTABLE => (string_field(c, "format")?, string_field(c, "file")?),
        _ => return Err(c.type_error(1, "table")),
    };
    let format = match format {
        None => Format::Text,
        Some(b) => {
            let name = String::from_utf8_lossy(&b);
            Format::parse(&name).map_err(|e| LErr::plain(e.to_string()))?
        }
    };
    if file.as_deref().is_some_and(<[u8]>::is_empty) {
        return Err(LErr::plain(format!("{USAGE}: file is empty")));
    }
    let snap = super::info::snapshot_here("f_dump");
    let bytes = export::to_bytes(&snap, format);
    match file {
        None => {
            c.push_bytes(&bytes)?;
            Ok(1)
        }
        Some(path) => match export::write_file(Path::new(OsStr::from_bytes(&path)), &bytes) {
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
lua_fn!(f_dump, dump_body);
