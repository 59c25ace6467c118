//! The process-wide table of Lua frame descriptions: what a [`LuaFrameId`] stands for.
//!
//! A description is `{kind, name, source, short_src, current line, line defined, cfunc}`.
//! Capturing a level looks its description up by value — hashing the bytes the Lua debug API
//! returned, comparing against the entries with that hash — and allocates only the first time
//! a description is seen. A hit costs one hash of a few dozen bytes and one shard read lock;
//! no `String` is built. In front of the table, each thread keeps a small memo found by the
//! strings' addresses: a level seen before costs a compare of its bytes with the description
//! (an address reused by other bytes is a miss, never a wrong id). Only descriptions stored
//! as they came are remembered (valid UTF-8, a source not cut), so a hit is always the id the
//! table gives for the same bytes.
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
use std::cell::RefCell;
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
    /// The `lua_CFunction` of a C level, or a LuaJIT fast function's C fallback (0 for Lua
    /// functions, and where not known).
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

    /// Whether the description is stored exactly as these bytes (valid UTF-8, a source of
    /// at most [`MAX_SOURCE`] bytes).
    fn is_stored_as_is(&self) -> bool {
        self.source.len() <= MAX_SOURCE
            && std::str::from_utf8(self.source).is_ok()
            && std::str::from_utf8(self.short_src).is_ok()
            && self.name.is_none_or(|n| std::str::from_utf8(n).is_ok())
    }

    /// Whether `info` is this description byte for byte (no decoding, no cut).
    fn same_bytes(&self, info: &LuaFrameInfo) -> bool {
        self.kind == info.kind
            && self.cfunc == info.cfunc
            && self.current_line == info.current_line
            && self.line_defined == info.line_defined
            && self.name == info.name.as_deref().map(str::as_bytes)
            && self.short_src == info.short_src.as_bytes()
            && self.source == info.source.as_bytes()
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
///
/// Looked up first in this thread's memo ([`MEMO_SLOTS`] descriptions, by the addresses
/// of the strings the debug API returned and the numbers): a level read again — every
/// fiber parked in the same code — skips the hash of its strings and the shared table's
/// lock. A memo entry is only a guess (a string freed and another made at its address has
/// the same key): it is taken when the description compares equal, byte for byte, as in
/// the table.
pub(crate) fn intern(raw: &RawInfo<'_>) -> LuaFrameId {
    let key = MemoKey::of(raw);
    let slot = key.slot();
    // (A thread being torn down, or a lookup from inside one, goes to the table.)
    let hit = MEMO
        .try_with(|m| {
            let m = m.try_borrow().ok()?;
            let e = m.get(slot)?.as_ref()?;
            (e.key == key && raw.same_bytes(&e.info)).then_some(e.id)
        })
        .ok()
        .flatten();
    if let Some(id) = hit {
        return id;
    }
    let (id, info) = intern_shared(raw);
    // Only descriptions stored as they came (valid UTF-8, a source not cut): a hit, equal
    // byte for byte to the stored one, is then the same raw description, whose id the
    // table gives.
    if let Some(info) = info.filter(|_| raw.is_stored_as_is()) {
        remember(slot, MemoEntry { key, id, info });
    }
    id
}

/// Entries of each thread's memo in front of the table (a power of two).
const MEMO_SLOTS: usize = 512;

/// What a memo entry is found by: the strings' addresses (not their bytes) and the rest.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MemoKey {
    source: usize,
    name: usize,
    lines: u64,
    cfunc: usize,
    kind: LuaKind,
}

impl MemoKey {
    fn of(raw: &RawInfo<'_>) -> MemoKey {
        MemoKey {
            source: raw.source.as_ptr() as usize,
            name: raw.name.map_or(0, |n| n.as_ptr() as usize),
            lines: ((raw.current_line as u32 as u64) << 32) | raw.line_defined as u32 as u64,
            cfunc: raw.cfunc,
            kind: raw.kind,
        }
    }

    fn slot(&self) -> usize {
        let mut h = AddrHasher::default();
        h.write_u64(self.source as u64);
        h.write_u64(self.name as u64 ^ self.lines.rotate_left(17) ^ self.cfunc as u64);
        (h.finish() >> 32) as usize % MEMO_SLOTS
    }
}

struct MemoEntry {
    key: MemoKey,
    id: LuaFrameId,
    /// The table's description (the table holds it too: dropping this never frees it).
    info: Arc<LuaFrameInfo>,
}

thread_local! {
    /// This thread's memo: empty until the first description is remembered.
    static MEMO: RefCell<Vec<Option<MemoEntry>>> = const { RefCell::new(Vec::new()) };
}

/// Puts `e` in the memo's `slot` (replacing what was there). Allocates the memo once, not
/// tracked by the heap tracker (whose stack hook interns frames itself). Every access to the
/// memo tries its borrow: a lookup or store made from inside another (an allocation hook)
/// finds it busy and goes to the table, never panics.
fn remember(slot: usize, e: MemoEntry) {
    let fresh = MEMO
        .try_with(|m| m.try_borrow().is_ok_and(|m| m.is_empty()))
        .unwrap_or(false);
    let table = fresh.then(|| {
        let _untracked = fibertrace_core::heap::pause();
        let mut v = Vec::with_capacity(MEMO_SLOTS);
        v.resize_with(MEMO_SLOTS, || None);
        v
    });
    let old = MEMO.try_with(|m| {
        let mut m = m.try_borrow_mut().ok()?;
        if let Some(t) = table {
            if m.is_empty() {
                *m = t;
            }
        }
        m.get_mut(slot).map(|s| s.replace(e))
    });
    // Dropped with the memo released (the entry's description is still in the table).
    drop(old);
}

/// The shared table's lookup (and insertion): the id, and the description unless the table
/// is full.
fn intern_shared(raw: &RawInfo<'_>) -> (LuaFrameId, Option<Arc<LuaFrameInfo>>) {
    let t = table();
    let h = raw.hash();
    if let Some(bucket) = t.by_hash.get(&h) {
        if let Some((id, i)) = bucket.iter().find(|(_, i)| raw.matches(i)) {
            return (LuaFrameId(*id), Some(Arc::clone(i)));
        }
    }
    // Not tracked by the heap tracker: the table is this library's, and the tracker's stack
    // hook interns Lua frames itself (it would wait on this shard's lock, held here).
    let _untracked = fibertrace_core::heap::pause();
    let mut entry = t.by_hash.entry(h).or_default();
    if let Some((id, i)) = entry.iter().find(|(_, i)| raw.matches(i)) {
        return (LuaFrameId(*id), Some(Arc::clone(i)));
    }
    let info = Arc::new(raw.to_owned_info());
    let id = {
        let mut ids = t.by_id.write().unwrap_or_else(|e| e.into_inner());
        if ids.len() > MAX_DESCRIPTIONS {
            return (OVERFLOW, None);
        }
        ids.push(Arc::clone(&info));
        (ids.len() - 1) as u32
    };
    entry.push((id, Arc::clone(&info)));
    (LuaFrameId(id), Some(info))
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

    /// The memo is found by the strings' addresses, but gives an id only for equal bytes:
    /// the same buffers holding another description (a string freed and another made at
    /// its address) get that description's id, on this thread and on another.
    #[test]
    fn the_memo_never_gives_the_id_of_other_bytes_at_the_same_address() {
        let mut source = *b"@memo_test_a.lua";
        let mut name = *b"fa";
        let raw = |source: &[u8; 16], name: &[u8; 2]| -> LuaFrameId {
            intern(&RawInfo {
                kind: LuaKind::Lua,
                name: Some(&name[..]),
                source: &source[..],
                short_src: b"memo_test.lua",
                current_line: 7,
                line_defined: 1,
                cfunc: 0,
            })
        };
        let a = raw(&source, &name);
        assert_eq!(raw(&source, &name), a, "the memo's hit is the table's id");
        name[1] = b'b';
        let b = raw(&source, &name);
        assert_ne!(a, b);
        assert_eq!(&*describe(b).unwrap().name.clone().unwrap(), "fb");
        source[11] = b'b';
        let c = raw(&source, &name);
        assert_ne!(b, c);
        assert_eq!(&*describe(c).unwrap().source, "@memo_test_b.lua");
        name[1] = b'a';
        source[11] = b'a';
        assert_eq!(
            raw(&source, &name),
            a,
            "back to the first bytes: the first id"
        );
        // Another thread (its own memo) agrees.
        let other = std::thread::spawn(move || {
            let mut source = source;
            let n = *b"fa";
            let first = raw(&source, &n);
            source[11] = b'b';
            (first, raw(&source, b"fb"))
        })
        .join()
        .unwrap();
        assert_eq!(other, (a, c));
    }

    /// Descriptions stored otherwise than they came (a source cut at [`MAX_SOURCE`], bytes
    /// that are not UTF-8) get the table's id for their own bytes, never the id of other
    /// bytes at the same addresses that read the same once stored.
    #[test]
    fn the_memo_keeps_only_descriptions_stored_as_they_came() {
        let mut source = vec![b'x'; MAX_SOURCE + 10];
        source[0] = b'=';
        // Leaked: the same addresses for both descriptions (as a Lua string's bytes).
        let source: &'static mut [u8] = Box::leak(source.into_boxed_slice());
        let name: &'static mut [u8] = Box::leak(b"g\xff".to_vec().into_boxed_slice());
        let (sp, np) = (source.as_mut_ptr(), name.as_mut_ptr());
        let raw = || RawInfo {
            kind: LuaKind::Lua,
            // SAFETY: the leaked buffers, alive forever, written only between the uses.
            name: Some(unsafe { std::slice::from_raw_parts(np, 2) }),
            // SAFETY: as above.
            source: unsafe { std::slice::from_raw_parts(sp, MAX_SOURCE + 10) },
            short_src: b"memo_cut.lua",
            current_line: 3,
            line_defined: 1,
            cfunc: 0,
        };
        assert!(!raw().is_stored_as_is());
        let first = intern(&raw());
        assert_eq!(intern(&raw()), first);
        // Other bytes past the cut, another byte that is not UTF-8: stored the same, yet
        // another raw description.
        // SAFETY: the leaked buffers, owned by this test alone; no slice of them is live.
        unsafe {
            *sp.add(MAX_SOURCE + 5) = b'y';
            *np.add(1) = 0xfe;
        }
        let (table, _) = intern_shared(&raw());
        assert_ne!(table, first);
        assert_eq!(intern(&raw()), table);
        assert_eq!(describe(first).unwrap(), describe(table).unwrap());
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
