//! The process-wide table of Lua frame descriptions: what a [`LuaFrameId`] stands for.
//!
//! A description is `{kind, name, source, short_src, current line, line defined, cfunc}`.
//! Capturing a level looks its description up by value — hashing the bytes the Lua debug API
//! returned, comparing against the entries with that hash — and allocates only the first time
//! a description is seen. A hit costs one hash of a few dozen bytes and one shard read lock;
//! no `String` is built.
//!
//! Invariants:
//! * ids are never reused or removed: a [`Frame::Lua`](fibertrace_core::Frame::Lua) kept in a
//!   stored trace (a parent fiber's, a dump) names the same description forever;
//! * the table is bounded: at most [`MAX_DESCRIPTIONS`] entries. Once full, a new description
//!   is not stored and its level gets [`OVERFLOW`], described as `(lua frame table full)` —
//!   that is how a result can lose a Lua frame's name in a process that loads unbounded
//!   amounts of distinct code (each distinct *line* of each function is one entry);
//! * raw sources longer than [`MAX_SOURCE`] bytes (chunks loaded from strings carry their
//!   whole text as source) are cut there, on a character boundary, with `...` appended.

use fibertrace_core::symbolize::AddrHasher;
use std::borrow::Cow;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, OnceLock, RwLock};

use dashmap::DashMap;
use fibertrace_core::LuaFrameId;
use smallvec::SmallVec;

/// Most descriptions the table holds (ids `1..=MAX_DESCRIPTIONS`).
pub const MAX_DESCRIPTIONS: usize = 1 << 16;

/// The id given to levels whose description did not fit (the table is full).
pub const OVERFLOW: LuaFrameId = LuaFrameId(0);

/// Longest raw source kept, in bytes.
pub const MAX_SOURCE: usize = 120;

/// What kind of function a Lua level runs (`lua_Debug::what`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LuaKind {
    /// A Lua function.
    Lua,
    /// A C function (a `lua_CFunction`, or a LuaJIT fast function).
    C,
    /// The main chunk of a loaded piece of code.
    Main,
    /// Anything else (`what` not recognised), or the overflow entry.
    Other,
}

impl LuaKind {
    pub(crate) fn from_what(what: &[u8]) -> Self {
        match what {
            b"Lua" => LuaKind::Lua,
            b"C" => LuaKind::C,
            b"main" => LuaKind::Main,
            _ => LuaKind::Other,
        }
    }
}

/// One interned Lua frame description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuaFrameInfo {
    /// The kind of function.
    pub kind: LuaKind,
    /// The name the caller knows it by (`lua_Debug::name`), if any.
    pub name: Option<Box<str>>,
    /// The raw source (`lua_Debug::source`: `@file`, `=[C]`, or the chunk's text), at most
    /// [`MAX_SOURCE`] bytes.
    pub source: Box<str>,
    /// The printable source (`lua_Debug::short_src`).
    pub short_src: Box<str>,
    /// The line being executed, `-1` when unknown (C functions).
    pub current_line: i32,
    /// The line where the function is defined, `-1` for C functions.
    pub line_defined: i32,
    /// The `lua_CFunction` of a C level (0 for Lua functions and LuaJIT fast functions).
    pub cfunc: usize,
}

impl LuaFrameInfo {
    /// The name to print: the known name, else `function <short_src:line>` for Lua
    /// functions, `main chunk` for main chunks, `?` for C functions.
    pub fn display_name(&self) -> Cow<'_, str> {
        match (&self.name, self.kind) {
            (Some(n), _) => Cow::Borrowed(n),
            (None, LuaKind::Main) => Cow::Borrowed("main chunk"),
            (None, LuaKind::Lua) => Cow::Owned(format!(
                "function <{}:{}>",
                self.short_src, self.line_defined
            )),
            _ => Cow::Borrowed("?"),
        }
    }
}

/// A description as the debug API returned it, borrowed (nothing copied yet).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawInfo<'a> {
    pub kind: LuaKind,
    pub name: Option<&'a [u8]>,
    pub source: &'a [u8],
    pub short_src: &'a [u8],
    pub current_line: i32,
    pub line_defined: i32,
    pub cfunc: usize,
}

impl RawInfo<'_> {
    fn hash(&self) -> u64 {
        let mut h = AddrHasher::default();
        h.write_u64(self.kind as u64);
        h.write_u64(self.cfunc as u64);
        h.write_u64(((self.current_line as u32 as u64) << 32) | self.line_defined as u32 as u64);
        match self.name {
            Some(n) => {
                h.write_u64(n.len() as u64 + 1);
                h.write(n);
            }
            None => h.write_u64(0),
        }
        h.write_u64(self.source.len() as u64);
        h.write(self.source);
        h.write(self.short_src);
        h.finish()
    }

    fn matches(&self, info: &LuaFrameInfo) -> bool {
        self.kind == info.kind
            && self.cfunc == info.cfunc
            && self.current_line == info.current_line
            && self.line_defined == info.line_defined
            && match (self.name, &info.name) {
                (Some(a), Some(b)) => text_eq(a, b),
                (None, None) => true,
                _ => false,
            }
            && text_eq(self.short_src, &info.short_src)
            && source_eq(self.source, &info.source)
    }

    fn to_owned_info(self) -> LuaFrameInfo {
        LuaFrameInfo {
            kind: self.kind,
            name: self.name.map(|n| lossy(n).into()),
            source: trim_source(&lossy(self.source)).into(),
            short_src: lossy(self.short_src).into(),
            current_line: self.current_line,
            line_defined: self.line_defined,
            cfunc: self.cfunc,
        }
    }
}

/// Whether raw bytes equal a stored (lossily decoded) text, without allocating when they
/// are valid UTF-8.
fn text_eq(raw: &[u8], stored: &str) -> bool {
    raw == stored.as_bytes() || (std::str::from_utf8(raw).is_err() && lossy(raw) == stored)
}

/// Whether a raw source equals a stored (cut) one, without allocating for valid UTF-8.
fn source_eq(raw: &[u8], stored: &str) -> bool {
    match std::str::from_utf8(raw) {
        Ok(s) if s.len() <= MAX_SOURCE => s == stored,
        Ok(s) => {
            let end = char_floor(s, MAX_SOURCE);
            stored.len() == end + 3 && stored.starts_with(&s[..end]) && stored.ends_with("...")
        }
        Err(_) => *trim_source(&lossy(raw)) == *stored,
    }
}

fn char_floor(s: &str, mut end: usize) -> usize {
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}

fn lossy(b: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(b)
}

fn trim_source(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_SOURCE {
        return Cow::Borrowed(s);
    }
    let end = char_floor(s, MAX_SOURCE);
    Cow::Owned(format!("{}...", &s[..end]))
}

/// Keys are already hashes: pass them through.
#[derive(Default, Clone, Copy)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // dashmap picks the shard from high bits, hashbrown the bucket from low ones: both
        // are well mixed by AddrHasher's final multiply and fold.
        self.0 = v;
    }
}

type Bucket = SmallVec<[(u32, Arc<LuaFrameInfo>); 1]>;

struct Table {
    by_hash: DashMap<u64, Bucket, BuildHasherDefault<IdentityHasher>>,
    by_id: RwLock<Vec<Arc<LuaFrameInfo>>>,
}

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| {
        // This library's own table: not tracked by the heap tracker, whose stack hook interns
        // frames itself (it would re-enter this initialisation).
        let _untracked = fibertrace_core::heap::pause();
        Table {
            by_hash: DashMap::default(),
            by_id: RwLock::new(vec![Arc::new(LuaFrameInfo {
                kind: LuaKind::Other,
                name: Some("(lua frame table full)".into()),
                source: "=?".into(),
                short_src: "?".into(),
                current_line: -1,
                line_defined: -1,
                cfunc: 0,
            })]),
        }
    })
}

/// Interns a description; allocates only when it is new.
pub(crate) fn intern(raw: &RawInfo<'_>) -> LuaFrameId {
    let t = table();
    let h = raw.hash();
    if let Some(bucket) = t.by_hash.get(&h) {
        if let Some((id, _)) = bucket.iter().find(|(_, i)| raw.matches(i)) {
            return LuaFrameId(*id);
        }
    }
    // Not tracked by the heap tracker: the table is this library's, and the tracker's stack
    // hook interns Lua frames itself (it would wait on this shard's lock, held here).
    let _untracked = fibertrace_core::heap::pause();
    let mut entry = t.by_hash.entry(h).or_default();
    if let Some((id, _)) = entry.iter().find(|(_, i)| raw.matches(i)) {
        return LuaFrameId(*id);
    }
    let info = Arc::new(raw.to_owned_info());
    let id = {
        let mut ids = t.by_id.write().unwrap_or_else(|e| e.into_inner());
        if ids.len() > MAX_DESCRIPTIONS {
            return OVERFLOW;
        }
        ids.push(Arc::clone(&info));
        (ids.len() - 1) as u32
    };
    entry.push((id, info));
    LuaFrameId(id)
}

/// The description of an id given out by this process (`None` for an id it never gave out,
/// e.g. one decoded from another process's trace).
pub fn describe(id: LuaFrameId) -> Option<Arc<LuaFrameInfo>> {
    let ids = table().by_id.read().unwrap_or_else(|e| e.into_inner());
    ids.get(id.0 as usize).cloned()
}

/// How many descriptions are interned (the overflow entry included).
pub fn interned_count() -> usize {
    table()
        .by_id
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw<'a>(name: Option<&'a [u8]>, line: i32) -> RawInfo<'a> {
        RawInfo {
            kind: LuaKind::Lua,
            name,
            source: b"@intern_test.lua",
            short_src: b"intern_test.lua",
            current_line: line,
            line_defined: 1,
            cfunc: 0,
        }
    }

    #[test]
    fn same_description_same_id_and_distinct_otherwise() {
        let a = intern(&raw(Some(b"f"), 3));
        let b = intern(&raw(Some(b"f"), 3));
        let c = intern(&raw(Some(b"f"), 4));
        let d = intern(&raw(None, 3));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert_ne!(c, d);
        let info = describe(a).unwrap();
        assert_eq!(info.display_name(), "f");
        assert_eq!(&*info.source, "@intern_test.lua");
        assert_eq!(
            describe(d).unwrap().display_name(),
            "function <intern_test.lua:1>"
        );
        assert!(describe(LuaFrameId(u32::MAX)).is_none());
        assert_eq!(describe(OVERFLOW).unwrap().kind, LuaKind::Other);
    }

    #[test]
    fn long_sources_are_cut_on_a_char_boundary() {
        let src = "é".repeat(100);
        let r = RawInfo {
            source: src.as_bytes(),
            ..raw(None, 1)
        };
        let id = intern(&r);
        let info = describe(id).unwrap();
        assert!(info.source.len() <= MAX_SOURCE + 3);
        assert!(info.source.ends_with("..."));
        assert_eq!(
            intern(&r),
            id,
            "a cut source still matches its own description"
        );
    }

    #[test]
    fn hasher_distinguishes_tails() {
        let mut a = AddrHasher::default();
        a.write(b"abc");
        let mut b = AddrHasher::default();
        b.write(b"abc\0");
        assert_ne!(a.finish(), b.finish());
    }
}
