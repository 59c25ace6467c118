//! `fiber.info()`: one table per Lua fiber, keyed by fiber id, with Tarantool's keys (`fid`,
//! `name`, `csw`, `time`, `memory = {used, total}`, `backtrace`, `max_slice` when finite) and
//! fibertrace's (`status`, `waiting = {on, seconds}`, `parent`, `parent_backtrace`). `csw`
//! counts switches away from the fiber, as Tarantool's.
//!
//! Each backtrace is the fiber's native stack (the running fiber's own, or a suspended one's
//! from its saved context, frame-pointer walk) interleaved with the Lua stack of the fiber's
//! Lua thread and the coroutines running in it ([`crate::interleave`]), in Tarantool's entry
//! format (`{C = "#1  0x… in name+off"}`, `{L = "#2  leaf in @script.lua:2"}`), numbered
//! from 1. Rendered entries are cached by (number, frame); a fiber's trace is cached with its
//! context-switch count (a fiber that has not run since has the same stacks); fibers with
//! identical traces share one `backtrace` array within a result, arrays share equal
//! entries' tables, and entries share equal `memory` tables (treat them as read-only: a
//! listing of many fibers allocates about a fifth less, and its collector's work follows).
//!
//! `parent_backtrace` lists the creators' traces at their `fiber.create` calls, nearest first,
//! numbered on from 1, at most `fibertrace_fiber::PARENT_DEPTH_SHOWN` creators; a
//! longer ancestry ends with a `{C = "#N ... K more parent fibers"}` entry counting the
//! creators left out (see `fibertrace_fiber::ParentTrace` for the ancestry kept in memory).
//! So one call costs O(fibers), whatever the depth of their ancestry.
//!
//! How results can be wrong: as [`crate::interleave`]; a creator's frames past 16 are cut in
//! the middle (`... N frames omitted`); `memory.used` is the fiber's stack in
//! use at its last suspension (there is no per-fiber heap region as in Tarantool), `total` its
//! stack size; `time` is the CPU time it ran.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::hash::BuildHasherDefault;
use std::rc::Rc;

use fibertrace_core::symbolize::AddrHasher;
use fibertrace_core::{Frame, Unwinder};
use fibertrace_fiber::{FiberId, Status, WaitOn};
use mlua::ffi;

use super::raw::{push_str, LErr};
use super::{with_host, Slice};
use crate::frames::shape::Words;
use crate::render::TarantoolEntry;

/// Options of `fiber.info([opts])`.
pub(crate) struct Opts {
    backtrace: bool,
}

/// Reads `{backtrace = bool}` / `{bt = bool}` (raw reads; anything else means true).
pub(crate) fn read_opts(c: &mut super::call::Call, idx: c_int) -> Result<Opts, LErr> {
    let mut backtrace = true;
    if c.type_of(idx) == ffi::LUA_TTABLE {
        for key in ["backtrace", "bt"] {
            c.push_field(idx, key)?;
            let t = c.type_of(-1);
            let v = c.to_boolean(-1);
            c.pop(1);
            if t != ffi::LUA_TNIL {
                backtrace = v;
                break;
            }
        }
    }
    Ok(Opts { backtrace })
}

/// A rendered entry: whether it is a C entry, and its text.
type Entry = (bool, Box<str>);

thread_local! {
    static ENTRIES: RefCell<HashMap<(u32, Frame), Entry>> = RefCell::new(HashMap::new());
}

/// Most cached rendered entries (the cache is cleared when it grows past this).
const CACHE_MAX: usize = 100_000;

/// A trace compared and hashed by its address (see [`intern`]).
#[derive(Clone)]
struct ByAddress(Rc<[Frame]>);

impl PartialEq for ByAddress {
    fn eq(&self, o: &ByAddress) -> bool {
        Rc::ptr_eq(&self.0, &o.0)
    }
}

impl Eq for ByAddress {}

impl std::hash::Hash for ByAddress {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_usize(self.0.as_ptr() as usize);
    }
}

type TraceSet = std::collections::HashSet<Rc<[Frame]>, BuildHasherDefault<AddrHasher>>;

thread_local! {
    /// Traces by content: fibers stopped at the same place hold one `Rc`, so a listing finds
    /// the array it built for a trace by the trace's address, without hashing its frames.
    static TRACES: RefCell<TraceSet> = RefCell::new(TraceSet::default());
}

/// Traces the set holds before it drops those nobody else holds (see [`intern`]).
const TRACES_MIN: usize = 4096;

thread_local! {
    /// The size of [`TRACES`] at which it next drops the traces only it holds.
    static TRACES_NEXT: std::cell::Cell<usize> = const { std::cell::Cell::new(TRACES_MIN) };
}

/// The one `Rc` of traces equal to `t`. When the set reaches its next size, the traces only
/// it holds (their fibers ended or moved on) are dropped and the next size is twice what
/// stays (at least [`TRACES_MIN`]): the set holds the live traces, which the fibers' records
/// hold anyway, and at most as many dropped ones again — and a live trace stays the one `Rc`
/// of its content.
fn intern(t: Rc<[Frame]>) -> Rc<[Frame]> {
    TRACES.with(|c| {
        let mut c = c.borrow_mut();
        if let Some(x) = c.get(&t) {
            return x.clone();
        }
        if c.len() >= TRACES_NEXT.get() {
            c.retain(|x| Rc::strong_count(x) > 1);
            TRACES_NEXT.set((c.len() * 2).max(TRACES_MIN));
        }
        c.insert(t.clone());
        t
    })
}

fn entry(n: u32, f: &Frame) -> Option<Entry> {
    if matches!(f, Frame::Parent(_)) {
        return None;
    }
    let key = (n, *f);
    if let Some(e) = ENTRIES.with(|c| c.borrow().get(&key).cloned()) {
        return Some(e);
    }
    let e =
        match crate::render::tarantool_entries_from(std::slice::from_ref(f), n as usize).pop()? {
            TarantoolEntry::C(s) => (true, s.into_boxed_str()),
            TarantoolEntry::L(s) => (false, s.into_boxed_str()),
        };
    ENTRIES.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= CACHE_MAX {
            c.clear();
        }
        c.insert(key, e.clone());
    });
    Some(e)
}

/// The strings one `fiber.info()` call uses over and over, pushed once per call at known
/// stack slots (pushing a slot skips interning the text again).
#[derive(Clone, Copy)]
enum K {
    C,
    L,
}

/// The text of each [`K`], then the status names (in [`Status`] order) and the wait words.
const TEXTS: [&str; 14] = [
    "C",
    "L",
    // status names
    "running",
    "ready",
    "suspended",
    "sleeping",
    "waiting",
    "dead",
    // wait words
    "sleep",
    "channel receive",
    "channel send",
    "condition wait",
    "join",
    "suspended",
];
const STATUS_AT: c_int = 2;
const WAIT_AT: c_int = 8;

/// State of one `fiber.info()` call: the strings slots, and the backtrace arrays already
/// built, by trace: fibers stopped at the same place share one array in a result (read-only
/// data, as Tarantool code treats it).
pub(crate) struct InfoBuild {
    /// Absolute index of the first string.
    base: c_int,
    /// Absolute index of the scratch table holding the arrays.
    scratch: c_int,
    /// Absolute index of the first of the 16 entry constructors ([`entry_ctors_source`]),
    /// in mask order on the stack.
    ctor: c_int,
    /// By frames and the count of parent fibers left out after them (0 for a fiber's own
    /// trace).
    /// Traces are interned ([`intern`]): equal traces are one `Rc`, found by its address
    /// (held here, so no other trace takes that address during the call).
    by_trace: HashMap<(ByAddress, u64), ffi::lua_Integer, BuildHasherDefault<AddrHasher>>,
    /// The entry tables already built, by (number, frame): arrays share them (a deep fiber's
    /// parent part repeats its ancestors' entries).
    by_entry: HashMap<(u32, Frame), ffi::lua_Integer, BuildHasherDefault<AddrHasher>>,
    /// Slots used in the scratch table.
    slots: ffi::lua_Integer,
    /// The clock, read once per call (see `fibertrace_fiber::clock`).
    now: u64,
    /// The tick rate, read once per call (not per fiber).
    rate: fibertrace_fiber::embed::Rate,
    /// The running fiber.
    me: FiberId,
    /// The running fiber's trace, taken before the protected call (see [`push_all`]).
    current: Option<Rc<[Frame]>>,
    /// Absolute index of the slot holding the name string pushed last.
    name_slot: c_int,
    /// The name pushed last (held: no other name takes its address during the call).
    last_name: Option<std::sync::Arc<str>>,
    /// The Lua levels read so far, by the shape of their stacks.
    lua_memo: LuaMemo,
    /// The `memory` tables made so far, by (used, total): entries share them (see
    /// [`InfoBuild::memory`]).
    by_memory: HashMap<(u64, u64), ffi::lua_Integer, BuildHasherDefault<AddrHasher>>,
    /// Where each fiber's native stack is walked (one buffer for the call: a backtrace is a
    /// kilobyte, copied twice when returned).
    native: fibertrace_core::Backtrace,
}

/// The identities (`lua_topointer`) of the entry constructors in the table at `table` (0 for
/// a value that is no function).
///
/// # Safety
/// `l` valid, with a table at `table` and a free stack slot.
pub(super) unsafe fn ctor_ids(l: *mut ffi::lua_State, table: c_int) -> Vec<usize> {
    (1..=CTORS as ffi::lua_Integer + 1)
        .map(|m| {
            // SAFETY: per the contract: a raw read of the table into the free slot, popped.
            unsafe {
                super::raw::rawgeti(l, table, m);
                let id = if ffi::lua_type(l, -1) == ffi::LUA_TFUNCTION {
                    ffi::lua_topointer(l, -1) as usize
                } else {
                    0
                };
                ffi::lua_settop(l, -2);
                id
            }
        })
        .collect()
}

impl InfoBuild {
    /// Pushes the strings and a scratch table; [`InfoBuild::finish`] removes them.
    ///
    /// # Safety
    /// `l` valid, in a protected call (this allocates).
    unsafe fn new(l: *mut ffi::lua_State, current: Option<Rc<[Frame]>>) -> InfoBuild {
        // SAFETY: `l` is in a protected call (the contract), so the strings and the table
        // (allocations) may raise there; room asked for first; the constructor is read raw.
        unsafe {
            ffi::lua_checkstack(l, TEXTS.len() as c_int + CTORS as c_int + 17);
            let base = ffi::lua_gettop(l) + 1;
            for t in TEXTS {
                push_str(l, t);
            }
            ffi::lua_createtable(l, 8, 0);
            let scratch = ffi::lua_gettop(l);
            // The constructors on the stack (a push of a slot per entry, not a table read).
            let (r, ids) = with_host(|h| (h.info_ctor_ref, h.info_ctor_ids.clone()))
                .unwrap_or((ffi::LUA_REFNIL, Vec::new()));
            super::raw::rawgeti(l, ffi::LUA_REGISTRYINDEX, r as ffi::lua_Integer);
            let table = ffi::lua_gettop(l);
            // A script reaches the table (`debug.getregistry()`): a listing reads it only as
            // a table, and calls only the functions the host made.
            let ours = ffi::lua_type(l, table) == ffi::LUA_TTABLE && ctor_ids(l, table) == ids;
            if !ours {
                // (Nothing with a destructor is left in this frame when the error unwinds it.)
                drop((ids, current));
                ffi::lua_pushstring(
                    l,
                    c"fibertrace: the host's fiber.info constructors were changed by the script"
                        .as_ptr(),
                );
                ffi::lua_error(l);
            }
            for m in 1..=CTORS as ffi::lua_Integer + 1 {
                super::raw::rawgeti(l, table, m);
            }
            ffi::lua_pushnil(l);
            InfoBuild {
                base,
                scratch,
                ctor: table + 1,
                name_slot: ffi::lua_gettop(l),
                last_name: None,
                by_trace: HashMap::default(),
                by_entry: HashMap::default(),
                slots: 0,
                now: fibertrace_fiber::embed::ticks(),
                rate: fibertrace_fiber::embed::Rate::now(),
                me: fibertrace_fiber::current_id(),
                current,
                lua_memo: LuaMemo::new(),
                by_memory: HashMap::default(),
                native: fibertrace_core::Backtrace::new(),
            }
        }
    }

    /// Moves the result on top down to where the strings began and drops the rest.
    ///
    /// # Safety
    /// `l` valid; the result is on top, above the slots pushed by [`InfoBuild::new`].
    unsafe fn finish(self, l: *mut ffi::lua_State) {
        // SAFETY: the result on top and the build's slots from `base` (the contract): the
        // result replaces the first slot and the top is lowered to it.
        unsafe {
            ffi::lua_replace(l, self.base);
            ffi::lua_settop(l, self.base);
        }
    }

    /// Pushes the key `k` (the value comes next, then [`ffi::lua_rawset`]).
    ///
    /// # Safety
    /// `l` valid; room on the stack.
    #[inline]
    unsafe fn key(&self, l: *mut ffi::lua_State, k: K) {
        // SAFETY: the slot holds a string pushed by `new`.
        unsafe { ffi::lua_pushvalue(l, self.base + k as c_int) };
    }

    /// Pushes the name of the fiber `sh`: the string pushed for the fiber before when it
    /// has the same name (fibers mostly share their default name: one string, not one
    /// interning per fiber).
    ///
    /// # Safety
    /// As `key`; in a protected call (a new string allocates).
    #[inline]
    unsafe fn name(&mut self, l: *mut ffi::lua_State, sh: &fibertrace_fiber::ControlBlock) {
        // Only compared under the name's lock: Lua runs (a string allocates, a collection
        // may run finalizers) after it is released.
        let new = sh.with_name(|n| match &self.last_name {
            Some(last) if std::sync::Arc::ptr_eq(last, n) => None,
            _ => Some(n.clone()),
        });
        // SAFETY: `name_slot` is the build's own slot (made by `new`); room on the stack
        // (the contract).
        unsafe {
            match new {
                None => ffi::lua_pushvalue(l, self.name_slot),
                Some(n) => {
                    push_str(l, &n);
                    ffi::lua_pushvalue(l, -1);
                    ffi::lua_replace(l, self.name_slot);
                    self.last_name = Some(n);
                }
            }
        }
    }

    /// Pushes the string of slot `i` of [`TEXTS`].
    #[inline]
    unsafe fn text(&self, l: *mut ffi::lua_State, i: c_int) {
        // SAFETY: as `key`.
        unsafe { ffi::lua_pushvalue(l, self.base + i) };
    }

    /// Pushes a `memory` table `{used = used, total = total}`: the one made before for the
    /// same values when `share` (entries share equal `memory` tables within a result, as
    /// they share backtraces: read-only data; fibers parked at the same place use the same
    /// stack), a fresh one otherwise (a table that gets more keys after).
    ///
    /// # Safety
    /// `l` valid, in a protected call; the scratch table and the constructors still at their
    /// indexes; room on the stack.
    unsafe fn memory(&mut self, l: *mut ffi::lua_State, used: u64, total: u64, share: bool) {
        // SAFETY: per the contract: the constructor is a Lua function of this host that
        // returns a fresh table; the scratch table holds the shared ones.
        unsafe {
            if share {
                if let Some(&k) = self.by_memory.get(&(used, total)) {
                    super::raw::rawgeti(l, self.scratch, k);
                    return;
                }
            }
            ffi::lua_pushvalue(l, self.ctor + CTORS as c_int);
            ffi::lua_pushinteger(l, used as ffi::lua_Integer);
            ffi::lua_pushinteger(l, total as ffi::lua_Integer);
            ffi::lua_call(l, 2, 1);
            if share && self.by_memory.len() < MEMORY_SHARED_MAX {
                let k = self.keep(l);
                self.by_memory.insert((used, total), k);
            }
        }
    }

    /// Pushes the entries array of `frames`, ended by a `... N more parent fibers` entry when
    /// `more` > 0 (shared with earlier identical traces).
    ///
    /// # Safety
    /// `l` valid; the scratch table is still at its index.
    unsafe fn push(&mut self, l: *mut ffi::lua_State, frames: &Rc<[Frame]>, more: u64) {
        // SAFETY: the scratch table at its index (the contract); arrays and entries are made
        // in the caller's protected call and stored raw into the scratch table and arrays.
        unsafe {
            let key = (ByAddress(frames.clone()), more);
            if let Some(&k) = self.by_trace.get(&key) {
                super::raw::rawgeti(l, self.scratch, k);
                return;
            }
            self.push_entries(l, frames, more);
            let k = self.keep(l);
            self.by_trace.insert(key, k);
        }
    }

    /// Keeps the value on top in the next scratch slot (the value stays on top); its slot.
    ///
    /// # Safety
    /// `l` valid; the scratch table is still at its index.
    unsafe fn keep(&mut self, l: *mut ffi::lua_State) -> ffi::lua_Integer {
        self.slots += 1;
        // SAFETY: the scratch table at its index and a value on top (the contract): a copy
        // is stored raw into the table's next slot.
        unsafe {
            ffi::lua_pushvalue(l, -1);
            super::raw::rawseti(l, self.scratch, self.slots);
        }
        self.slots
    }

    /// Pushes an array of entries for `frames`, and the `more` entry (see [`InfoBuild::push`]).
    ///
    /// # Safety
    /// `l` valid.
    unsafe fn push_entries(&mut self, l: *mut ffi::lua_State, frames: &[Frame], more: u64) {
        // SAFETY: fresh tables (or entry tables of this call, kept in the scratch table);
        // plain sets.
        unsafe {
            ffi::lua_checkstack(l, 4);
            ffi::lua_createtable(l, frames.len() as c_int + (more > 0) as c_int, 0);
            let arr = ffi::lua_gettop(l);
            let mut n = 1u32;
            for f in frames {
                if let Some(&k) = self.by_entry.get(&(n, *f)) {
                    super::raw::rawgeti(l, self.scratch, k);
                } else {
                    let Some((is_c, s)) = entry(n, f) else {
                        continue;
                    };
                    ffi::lua_createtable(l, 0, 1);
                    self.key(l, if is_c { K::C } else { K::L });
                    push_str(l, &s);
                    ffi::lua_rawset(l, arr + 1);
                    let k = self.keep(l);
                    self.by_entry.insert((n, *f), k);
                }
                super::raw::rawseti(l, arr, n as ffi::lua_Integer);
                n += 1;
            }
            if more > 0 {
                ffi::lua_createtable(l, 0, 1);
                self.key(l, K::C);
                let line = fibertrace_fiber::dump::more_parents_line(more);
                push_str(l, &format!("#{n:<2} {line}"));
                ffi::lua_rawset(l, arr + 1);
                super::raw::rawseti(l, arr, n as ffi::lua_Integer);
            }
        }
    }
}

/// Leading frames of the current stack that belong to the capture itself are cut up to the
/// frame of the C function `upto` (kept: it is where Lua called in).
fn cut_to(frames: &[Frame], upto: &'static str) -> usize {
    for (i, f) in frames.iter().enumerate().take(24) {
        if f.is_marker() || matches!(f, Frame::Lua(_)) {
            break;
        }
        if is_frame_of(f, upto) {
            return i;
        }
    }
    0
}

/// (lookup address, name pointer, name length) -> whether the frame is in that function.
type FrameOfCache = HashMap<(u64, usize, usize), bool, BuildHasherDefault<AddrHasher>>;

thread_local! {
    /// Whether a native frame belongs to a given function, by (address, name): `cut_to` runs
    /// at every `fiber.create` with parent traces on, from the same few call sites.
    static FRAME_OF: RefCell<FrameOfCache> =
        RefCell::new(HashMap::default());
}

fn is_frame_of(f: &Frame, upto: &'static str) -> bool {
    let Some(addr) = f.lookup_address() else {
        return false;
    };
    let key = (addr, upto.as_ptr() as usize, upto.len());
    if let Some(hit) = FRAME_OF.with(|c| c.borrow().get(&key).copied()) {
        return hit;
    }
    let skipped = fibertrace_core::symbolize::skipped_for_memory();
    let hit = fibertrace_core::symbolize::resolve_outer(f)
        .and_then(|r| r.function().map(|n| n.rsplit("::").next() == Some(upto)))
        .unwrap_or(false);
    if fibertrace_core::symbolize::skipped_for_memory() != skipped {
        // Left unnamed for want of memory: not an answer to keep.
        return hit;
    }
    FRAME_OF.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= CACHE_MAX {
            c.clear();
        }
        c.insert(key, hit);
    });
    hit
}

/// Most shapes a call's [`LuaMemo`] keeps (a bound on its memory; the fibers of further
/// shapes are read through the debug API).
const LUA_MEMO_MAX: usize = 4096;

/// One fiber's Lua levels, by the shape of the stack they were read from.
struct LuaMemoEntry {
    levels: smallvec::SmallVec<[crate::LuaLevel; 8]>,
    /// The fiber whose stack gave them, and its switch count then: the entry is taken only
    /// while that fiber has not run since and has not ended, so that its stack still holds
    /// the functions (and through them the prototypes) whose addresses are in `words`: an
    /// equal address is then the same object.
    from: fibertrace_fiber::Fiber,
    csw: u64,
}

thread_local! {
    /// Whether listings use [`LuaMemo`] (tests compare with and without).
    static LUA_MEMO_ON: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    /// How many fibers' levels [`LuaMemo`] gave on this thread.
    static LUA_MEMO_HITS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Turns the listings' memo of Lua levels on or off on this thread, and forgets the traces
/// the fibers' records keep and the merges this thread keeps (so that the next listing
/// reads and merges every stack again): for tests
/// that compare what the memo gives with what the debug API gives. Returns how many
/// fibers' levels the memo gave on this thread so far. Called from a function of the host
/// running on this thread.
#[doc(hidden)]
pub fn set_lua_level_memo(on: bool) -> u64 {
    LUA_MEMO_ON.with(|c| c.set(on));
    with_host(|h| {
        for r in h.recs.values_mut() {
            r.trace_cache = None;
        }
    });
    let _ = MERGED.try_with(|m| m.borrow_mut().clear());
    LUA_MEMO_HITS.with(|c| c.get())
}

/// The Lua levels read during one `fiber.info()` call, by the shape of the stack they were
/// read from ([`crate::frames::shape`]): fibers parked at the same place (their stacks run
/// the same code — closures of the same functions — called from the same places, at the
/// same depth) are read through the debug API once per call; the others cost a walk of
/// their frames' words more. Off when the VM's layout was not checked (Lua 5.4, another
/// LuaJIT). A fiber whose stack has no shape (see the shape's refusals) is always read.
/// Kept for one call only: it holds no Lua object, and nothing it answers outlives the
/// fibers it read.
struct LuaMemo {
    on: bool,
    /// The entries by their words, as indices into `entries`.
    shapes: HashMap<Box<[u64]>, usize, BuildHasherDefault<AddrHasher>>,
    entries: Vec<(Box<[u64]>, LuaMemoEntry)>,
    /// The entry last taken or made: compared first, before the words are hashed (a
    /// listing meets fibers parked alike one after another).
    last: usize,
}

impl LuaMemo {
    fn new() -> LuaMemo {
        LuaMemo {
            on: LUA_MEMO_ON.with(|c| c.get())
                && crate::frames::publish::checked() == crate::frames::publish::MATCHES,
            shapes: HashMap::default(),
            entries: Vec::new(),
            last: 0,
        }
    }

    /// The entry for these words, if any.
    fn find(&mut self, words: &[u64]) -> Option<&LuaMemoEntry> {
        let at = match self.entries.get(self.last) {
            Some((w, _)) if **w == *words => self.last,
            _ => *self.shapes.get(words)?,
        };
        self.last = at;
        Some(&self.entries[at].1)
    }

    /// Fills `out` with the Lua levels of `f`'s state `root`.
    ///
    /// # Safety
    /// `root` is `f`'s Lua thread, `f` is suspended (or never ran) on this thread.
    unsafe fn levels(
        &mut self,
        f: &fibertrace_fiber::Fiber,
        root: *mut ffi::lua_State,
        out: &mut crate::LuaStack,
    ) {
        let mut words = Words::new();
        // SAFETY: `root` is a live state of this thread that is not running (the contract),
        // and `on` says the layout matched.
        let shaped = self.on && unsafe { crate::frames::shape::stack_shape(root, &mut words) };
        if let Some(e) = shaped.then(|| self.find(&words)).flatten() {
            let from = e.from.control_block();
            if from.csw() == e.csw && !matches!(from.state(), Status::Dead | Status::Running) {
                out.clear();
                out.levels.extend_from_slice(&e.levels);
                out.threads = 1;
                LUA_MEMO_HITS.with(|c| c.set(c.get() + 1));
                return;
            }
        }
        let csw = f.control_block().csw();
        // SAFETY: forwarded contract: the state is not running; the debug API reads it.
        unsafe { crate::capture_lua_stack(root, out) };
        // (No levels from a stack with frames: the debug API could not read it, for want of
        // memory to grow its stack — not something to hand the next fiber.)
        let read = !out.levels.is_empty() || words.len() == 1;
        if shaped && read && out.threads == 1 && !out.truncated && self.entries.len() < LUA_MEMO_MAX
        {
            let e = LuaMemoEntry {
                levels: out.levels.iter().copied().collect(),
                from: f.clone(),
                csw,
            };
            // A shape met again (its entry's fiber ran since, or ended) takes the new read.
            self.last = match self.shapes.get(&words[..]) {
                Some(&at) => {
                    self.entries[at].1 = e;
                    at
                }
                None => {
                    let at = self.entries.len();
                    self.shapes.insert(words[..].into(), at);
                    self.entries.push((words[..].into(), e));
                    at
                }
            };
        }
    }
}

/// Slots of each thread's [`MERGED`] memo (a power of two).
const MERGED_SLOTS: usize = 256;

/// The longest native trace whose merge [`MERGED`] keeps (a bound on its memory: 256
/// slots of at most 4 KiB of native frames).
const MERGED_MAX_FRAMES: usize = 256;

/// The slot of [`MERGED`] for a merge's inputs.
fn merged_slot(native: &[Frame], lua: &crate::LuaStack) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = AddrHasher::default();
    native.hash(&mut h);
    lua.levels.hash(&mut h);
    (lua.omitted_at, lua.omitted).hash(&mut h);
    (h.finish() >> 32) as usize % MERGED_SLOTS
}

/// One merge remembered: its inputs and the trace they gave.
struct Merged {
    native: Box<[Frame]>,
    lua: Box<[crate::LuaLevel]>,
    gap: (usize, u64),
    /// The symbolizer's generation it was made in (the merge asks it where C functions end
    /// and whether the last frame is the runtime's trampoline).
    generation: u64,
    trace: Rc<[Frame]>,
}

thread_local! {
    /// The last merge made in each slot (by a hash of its inputs); empty until the first.
    static MERGED: RefCell<Vec<Option<Merged>>> = const { RefCell::new(Vec::new()) };
    /// The slot last taken or filled: compared first, before the inputs are hashed (a
    /// listing meets fibers parked alike one after another).
    static MERGED_LAST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Merged {
    /// Whether these are its inputs.
    fn holds(
        &self,
        native: &[Frame],
        lua: &crate::LuaStack,
        gap: (usize, u64),
        generation: u64,
    ) -> bool {
        self.gap == gap
            && self.generation == generation
            && *self.native == *native
            && *self.lua == *lua.levels
    }
}

/// A suspended fiber's trace from its native frames and Lua stack: the two interleaved, the
/// runtime's trampoline left out (whatever it inlined: the host's start of the fiber;
/// [`fibertrace_fiber::info::without_trampoline`]), interned ([`intern`]). That is a function of these inputs
/// alone (the VM map it consults is made once, at start-up), so each thread remembers the
/// last merge per slot of a hash of them, taken only when the inputs compare equal: fibers
/// parked at the same place (a pool of workers waiting on one channel, connections waiting
/// for input) are merged once, then cost a comparison of their frames with the last merge
/// taken (and a hash of them when they are not its).
fn merged(native: &[Frame], lua: &crate::LuaStack) -> Rc<[Frame]> {
    let gap = (lua.omitted_at, lua.omitted);
    let generation = fibertrace_core::symbolize::cache_generation();
    let last = MERGED_LAST.with(|c| c.get());
    let taken = |slot: usize| {
        MERGED
            .try_with(|m| {
                let m = m.try_borrow().ok()?;
                let e = m.get(slot)?.as_ref()?;
                e.holds(native, lua, gap, generation)
                    .then(|| e.trace.clone())
            })
            .ok()
            .flatten()
    };
    if let Some(t) = taken(last) {
        return t;
    }
    let slot = merged_slot(native, lua);
    MERGED_LAST.with(|c| c.set(slot));
    if slot != last {
        if let Some(t) = taken(slot) {
            return t;
        }
    }
    let bt = crate::interleave::interleave(native, lua, &Default::default());
    let trace = intern(Rc::from(fibertrace_fiber::info::without_trampoline(
        bt.frames(),
    )));
    let e = Merged {
        native: native.into(),
        lua: lua.levels.as_slice().into(),
        gap,
        generation,
        trace: trace.clone(),
    };
    if native.len() > MERGED_MAX_FRAMES {
        return trace;
    }
    let _ = MERGED.try_with(|m| {
        if let Ok(mut m) = m.try_borrow_mut() {
            if m.is_empty() {
                m.resize_with(MERGED_SLOTS, || None);
            }
            m[slot] = Some(e);
        }
    });
    trace
}

/// The running fiber's trace, interleaved with the Lua stack of `root`, starting at the
/// frame of the C function `upto` (the function Lua called) on state `cur` (the state of that
/// call: when `root` does not run it, as in a `__gc` finalizer, which runs on the VM's main
/// state, its levels come first), without the runtime's trampoline when no user code is
/// inlined into it ([`fibertrace_fiber::info::user_frames`]).
///
/// # Safety
/// `root` is the current fiber's Lua thread (or a state running on this OS thread); `cur` is
/// the state of the running call (or null).
pub(crate) unsafe fn current_frames(
    root: *mut ffi::lua_State,
    cur: *mut ffi::lua_State,
    upto: &'static str,
) -> Vec<Frame> {
    // SAFETY: the contract, passed on.
    unsafe { current_frames_trimmed(root, cur, upto, fibertrace_fiber::info::user_frames) }
}

/// [`current_frames`], its trailing runtime frames left out by `trim`.
///
/// # Safety
/// As [`current_frames`].
#[inline(never)]
unsafe fn current_frames_trimmed(
    root: *mut ffi::lua_State,
    cur: *mut ffi::lua_State,
    upto: &'static str,
    trim: fn(&[Frame]) -> &[Frame],
) -> Vec<Frame> {
    let native = match fibertrace_fiber::current() {
        Some(f) => f.backtrace(Unwinder::Fast).unwrap_or_default(),
        None => fibertrace_core::collect(&fibertrace_core::CaptureOptions::with_unwinder(
            Unwinder::Fast,
        )),
    };
    let skip = cut_to(native.frames(), upto);
    let native = fibertrace_core::Backtrace::from_frames(&native.frames()[skip..]);
    // SAFETY: `root` is the running fiber's Lua thread on this OS thread (the contract), so
    // its stack is read through the debug API while nothing else runs it.
    let bt = unsafe { crate::interleave::capture_interleaved_within(&native, root, cur) };
    trim(bt.frames()).to_vec()
}

/// The running fiber's trace for `fiber.info()` or `fiber_object:info()`, from the Lua call
/// on: taken before the result is built in a protected call, whose trampoline would show as
/// a Lua level of its own. The runtime's trampoline is left out whatever it inlined (the
/// host's start of the fiber, never the script's code), as in the other fibers' traces
/// ([`merged`]): so a listing needs the symbol table alone, not the DWARF.
///
/// # Safety
/// As [`current_frames`].
#[inline(never)]
unsafe fn running_frames(root: *mut ffi::lua_State, cur: *mut ffi::lua_State) -> Rc<[Frame]> {
    // SAFETY: `root` is the running fiber's Lua thread, `cur` the call's state (the contract
    // of `current_frames`).
    let v = unsafe {
        current_frames_trimmed(
            root,
            cur,
            "f_info",
            fibertrace_fiber::info::without_trampoline,
        )
    };
    let k = cut_to(&v, "m_info");
    Rc::from(&v[k..])
}

/// A fiber's last interleaved trace and its context-switch count then (its record's, read
/// when the listing gathers the fibers).
type TraceCache = (u64, Rc<[Frame]>);

/// What a fiber's record keeps for its listing: its last trace (with its switch count then)
/// and whether it has a creator's trace.
#[derive(Clone)]
struct Kept {
    trace: Option<TraceCache>,
    parent_bt: bool,
    /// The record's place among the host's (where a new trace is stored: checked then).
    place: usize,
}

impl Kept {
    fn of(r: &super::LuaFiber, place: usize, backtrace: bool) -> Kept {
        Kept {
            trace: backtrace.then(|| r.trace_cache.clone()).flatten(),
            parent_bt: r.parent_bt,
            place,
        }
    }
}

/// Whether a kept trace is of the fiber's last suspension (`csw`: its switch count now; a
/// fiber that never ran has no trace to keep).
fn is_current(cache: &TraceCache, csw: u64) -> bool {
    cache.0 == csw && csw > 0
}

/// A fiber's interleaved trace now: `cache` unless it has run since (a suspended fiber's
/// native stack and Lua stack change only when it runs).
///
/// # Safety
/// `root` is the fiber's Lua thread; the fiber is the current one or suspended on this thread.
unsafe fn fiber_frames(
    f: &fibertrace_fiber::Fiber,
    root: *mut ffi::lua_State,
    call: &mut InfoBuild,
    cache: Option<TraceCache>,
    place: usize,
) -> Option<Rc<[Frame]>> {
    if f.id() == call.me {
        return call.current.clone();
    }
    let csw = f.control_block().csw();
    if let Some((_, t)) = cache.as_ref().filter(|c| is_current(c, csw)) {
        return Some(t.clone());
    }
    // Not kept in the fiber: the interleaved trace is kept here, in the fiber's record.
    if !f.backtrace_unkept_into(Unwinder::Fast, &mut call.native) {
        return None;
    }
    let mut lua = crate::LuaStack::new();
    // SAFETY: `root` is `f`'s Lua thread and `f` is suspended (or never ran) on this OS
    // thread (the contract; the walk gave nothing for a fiber that ended), as
    // `LuaMemo::levels` asks.
    unsafe { call.lua_memo.levels(f, root, &mut lua) };
    let t = merged(call.native.frames(), &lua);
    // The count is read again: the capture may not race with a resume on this thread, but
    // the cache must only hold a trace taken while the fiber was suspended.
    if f.control_block().csw() == csw && f.control_block().state() != Status::Running {
        with_host(|h| {
            if let Some(r) = h.recs.get_at_mut(place, f.id()) {
                r.trace_cache = Some((csw, t.clone()));
            }
        });
    }
    Some(t)
}

fn wait_slot(on: &WaitOn) -> c_int {
    WAIT_AT
        + match on {
            WaitOn::Sleep => 0,
            WaitOn::ChannelReceive(_) => 1,
            WaitOn::ChannelSend(_) => 2,
            WaitOn::Condition(_) => 3,
            WaitOn::Join(_) => 4,
            WaitOn::Wakeup => 5,
        }
}

fn status_slot(s: Status) -> c_int {
    STATUS_AT
        + match s {
            Status::Running => 0,
            Status::Ready => 1,
            Status::Suspended => 2,
            Status::Sleeping => 3,
            Status::Waiting => 4,
            Status::Dead => 5,
        }
}

/// Most distinct `memory` tables one listing shares (further ones are made per entry).
const MEMORY_SHARED_MAX: usize = 4096;

/// How many entry constructors there are (one per mask of [`entry_ctors_source`]; the
/// `memory` table's constructor follows them).
const CTORS: usize = 16;

/// The Lua functions that make one entry from its values, one per set of optional keys
/// present (bit 0 `waiting`, 1 `parent`, 2 `backtrace`, 3 `parent_backtrace`; the function
/// for mask `m` at index `m + 1`). A table constructor with constant keys is one template copy
/// plus a store per value (LuaJIT's `TDUP`), where building the same table through the C API
/// inserts key by key: about a third of the cost of `fiber.info()`. One constructor per shape
/// sizes each template to the keys it has: a template with every key holds 16 slots where a
/// sleeping fiber without backtraces needs 8, and a smaller table is less for the collector.
pub(crate) fn entry_ctors_source() -> String {
    let mut s = String::from("local c = {}\n");
    for mask in 0..CTORS as u8 {
        s.push_str(&format!(
            "c[{}] = function(fid, name, csw, time, memory, status, on, seconds, parent, bt, pbt)\n  \
             return {{fid = fid, name = name, csw = csw, time = time, \
             memory = memory, status = status",
            mask + 1
        ));
        for (bit, field) in [
            (1, "waiting = {on = on, seconds = seconds}"),
            (2, "parent = parent"),
            (4, "backtrace = bt"),
            (8, "parent_backtrace = pbt"),
        ] {
            if mask & bit != 0 {
                s.push_str(", ");
                s.push_str(field);
            }
        }
        s.push_str("}\nend\n");
    }
    s.push_str(&format!(
        "c[{}] = function(used, total) return {{used = used, total = total}} end\n",
        CTORS + 1
    ));
    s.push_str("return c\n");
    s
}

/// Pushes one fiber's info table.
///
/// # Safety
/// `l` valid, in a protected call (an error, out of memory, is raised); `root` the fiber's
/// Lua thread, when the fiber has not ended (it is not touched for one that has); `call`
/// made on `l`.
unsafe fn push_fiber(
    l: *mut ffi::lua_State,
    f: &fibertrace_fiber::Fiber,
    root: *mut ffi::lua_State,
    slice: Slice,
    opts: &Opts,
    call: &mut InfoBuild,
    kept: Kept,
) {
    let sh = f.control_block();
    let (status, on, secs) = sh.status_with(call.now, call.rate);
    let status = if f.id() == call.me {
        Status::Running
    } else {
        status
    };
    let parent = f.parent();
    // A fiber that ended (not joined yet): no stack, and its Lua thread may be gone.
    let bt = if status == Status::Dead {
        opts.backtrace.then(|| Rc::from(&[][..]))
    } else {
        opts.backtrace
            // SAFETY: `root` is the Lua thread of a fiber that has not ended, on this thread
            // (the contract).
            .then(|| unsafe { fiber_frames(f, root, call, kept.trace, kept.place) })
            .flatten()
    };
    // The nearest ancestors only, and a count of the others: bounded per fiber.
    let pbt = (opts.backtrace && kept.parent_bt)
        .then(|| f.parent_trace())
        .flatten();
    let mask = on.is_some() as ffi::lua_Integer
        | (parent.is_some() as ffi::lua_Integer) << 1
        | (bt.is_some() as ffi::lua_Integer) << 2
        | (pbt.is_some() as ffi::lua_Integer) << 3;
    // SAFETY: the constructor (a Lua function of this host, on the stack since `new`) gets
    // up to 11 values (plain ones, the `memory` table and the arrays) and returns a fresh
    // table.
    unsafe {
        ffi::lua_checkstack(l, 16);
        ffi::lua_pushvalue(l, call.ctor + mask as c_int);
        ffi::lua_pushinteger(l, f.id() as ffi::lua_Integer);
        call.name(l, sh);
        // Tarantool counts switches away: the runtime's count of switches in, one less
        // for the running fiber.
        let csw = sh.csw() - (f.id() == call.me && sh.csw() > 0) as u64;
        ffi::lua_pushinteger(l, csw as ffi::lua_Integer);
        ffi::lua_pushnumber(l, sh.cpu_time_with(call.rate).as_secs_f64());
        // Shared unless the heap's figure is added to it below.
        let heap = fibertrace_core::heap::tier() != fibertrace_core::heap::Tier::Off;
        call.memory(l, sh.stack_used() as u64, sh.stack_size() as u64, !heap);
        call.text(l, status_slot(status));
        match on {
            Some(on @ WaitOn::Join(_)) => push_str(l, &on.to_string()),
            Some(on) => call.text(l, wait_slot(&on)),
            None => ffi::lua_pushnil(l),
        }
        ffi::lua_pushnumber(l, secs.as_secs_f64());
        match parent {
            Some(p) => ffi::lua_pushinteger(l, p as ffi::lua_Integer),
            None => ffi::lua_pushnil(l),
        }
        // The last arguments only when present (missing ones are nil to the constructor).
        let args = if pbt.is_some() {
            11
        } else if bt.is_some() {
            10
        } else {
            9
        };
        match bt {
            Some(frames) => call.push(l, &frames, 0),
            None if args > 9 => ffi::lua_pushnil(l),
            None => {}
        }
        if let Some(pt) = pbt {
            call.push(l, &intern(Rc::from(pt.flatten())), pt.omitted());
        }
        // An error (out of memory) ends the protected call this runs in.
        ffi::lua_call(l, args, 1);
        // The heap charged to the fiber, when the process's allocator tracks it.
        if heap {
            ffi::lua_getfield(l, -1, c"memory".as_ptr());
            ffi::lua_pushinteger(l, sh.heap_usage().live_bytes as ffi::lua_Integer);
            ffi::lua_setfield(l, -2, c"heap".as_ptr());
            ffi::lua_pop(l, 1);
        }
        // The effective max slice when it has a finite part (only those parts, as
        // Tarantool shows it).
        if slice.warn < Slice::INFINITE || slice.err < Slice::INFINITE {
            ffi::lua_createtable(l, 0, 2);
            for (k, part) in [(c"warn", slice.warn), (c"err", slice.err)] {
                if part < Slice::INFINITE {
                    ffi::lua_pushnumber(l, part);
                    ffi::lua_setfield(l, -2, k.as_ptr());
                }
            }
            ffi::lua_setfield(l, -2, c"max_slice".as_ptr());
        }
    }
}

/// Runs `build` in a protected call on `l` with the debug hook off (no hook runs Lua code —
/// raising an error or switching fibers — while entries are built), restored whatever
/// happens: a full Lua heap gives `not enough memory`, raised by the caller.
///
/// # Safety
/// `l` valid, running the calling C function; `build` pushes one value and raises only Lua
/// errors.
unsafe fn built(
    l: *mut ffi::lua_State,
    build: &mut dyn FnMut(*mut ffi::lua_State),
) -> Result<(), LErr> {
    // SAFETY: per the contract; the hook is put back before returning.
    unsafe {
        let hook = (
            ffi::lua_gethook(l),
            ffi::lua_gethookmask(l),
            ffi::lua_gethookcount(l),
        );
        ffi::lua_sethook(l, None, 0, 0);
        let r = super::raw::protect(l, &[], &mut |l| {
            build(l);
            1
        });
        ffi::lua_sethook(l, hook.0, hook.1, hook.2);
        r.map(|_| ())
    }
}

/// The sizes to create `fiber.info()`'s result with (`lua_createtable`'s array and hash
/// parts) for `count` fibers whose largest id is `max`: when the ids are dense enough (at most about
/// half the slots up to the largest id unused), every id goes to the array part — a store at
/// its index, where a hash part of the same fibers is a node three times the size, placed at
/// random (at 30,000 fibers the hash inserts were 9% of a listing, most of it cache misses).
/// Otherwise (ids spread out: old fibers among many that ended) the hash part, sized to the
/// count. Which part holds a key is invisible to Lua (`pairs`, `next`, `#` aside).
fn result_shape(max: FiberId, count: usize) -> (c_int, c_int) {
    let dense = max <= (2 * count as u64).saturating_add(16) && max <= MAX_ARRAY;
    match c_int::try_from(max) {
        Ok(max) if dense => (max, 0),
        _ => (0, c_int::try_from(count).unwrap_or(c_int::MAX)),
    }
}

/// The largest array part [`result_shape`] asks for (far below what the VMs can make: LuaJIT
/// refuses more than 2^27 slots).
const MAX_ARRAY: u64 = 1 << 26;

/// Most bytes of a Lua stack asked for ahead of its walk.
const PREFETCH_LUA_STACK: u64 = 2048;

/// Asks the CPU for the used part of `root`'s Lua stack (its slots from the bottom to the
/// top, at most [`PREFETCH_LUA_STACK`] bytes), which the debug API's walk of its levels reads
/// next: a hint, through the layout the running VM was checked against
/// ([`crate::frames::publish`]); an address that makes no sense asks for nothing.
///
/// # Safety
/// `root` is a live Lua state of this thread, not running, and the layout matched the VM.
unsafe fn prefetch_lua_stack(root: *mut ffi::lua_State) {
    let lay = &crate::frames::publish::HEADER.layout;
    let at = |off: u32| (root as usize + off as usize) as *const u64;
    // SAFETY: two words inside the live state (the contract), where the checked layout says
    // its stack and top are.
    let (stack, top) = unsafe {
        (
            std::ptr::read_volatile(at(lay.state_stack)),
            std::ptr::read_volatile(at(lay.state_top)),
        )
    };
    if top > stack {
        fibertrace_core::capture::prefetch_far(
            stack,
            (top - stack).min(PREFETCH_LUA_STACK) as usize,
        );
    }
}

/// Sorts `(key, value)` pairs by key (distinct keys: control block addresses). A large
/// listing's order is sorted by its digits (LSD radix, 11 bits a pass, over the bits the keys
/// differ in), in the same time whatever the order it is given: the records' order follows
/// the blocks' while fibers are only made, and drifts from it as fibers end and others take
/// their places; a comparison sort of 30,000 addresses in an unrelated order cost ~60 clock
/// ticks an element, a tenth of `fiber.info({backtrace = false})` over them, mostly
/// mispredicted branches; three passes cost a fraction of that. Small ones go to
/// `sort_unstable`.
fn sort_by_key(v: &mut Vec<(usize, usize)>) {
    const BITS: u32 = 11;
    if v.len() < 2048 {
        v.sort_unstable();
        return;
    }
    let lo = v.iter().map(|p| p.0).min().unwrap_or(0);
    let differ = v.iter().fold(0, |a, p| a | (p.0 - lo));
    let (mut shift, end) = (
        differ.trailing_zeros(),
        usize::BITS - differ.leading_zeros(),
    );
    let mut other = vec![(0, 0); v.len()];
    while shift < end {
        let digit = |p: &(usize, usize)| ((p.0 - lo) >> shift) & ((1 << BITS) - 1);
        let mut at = [0usize; 1 << BITS];
        for p in v.iter() {
            at[digit(p)] += 1;
        }
        let mut sum = 0;
        for a in at.iter_mut() {
            (*a, sum) = (sum, sum + *a);
        }
        for p in v.iter() {
            let d = digit(p);
            other[at[d]] = *p;
            at[d] += 1;
        }
        std::mem::swap(v, &mut other);
        shift += BITS;
    }
}

/// How many fibers ahead of the one being listed the listing asks for the control block.
const PREFETCH_AHEAD: usize = 7;
/// How many fibers ahead of the one being listed the listing asks for the stacks of a fiber
/// to be walked again (read through its block, asked for earlier). One ahead, the walks
/// still waited for them: `fiber.info()` over 30,000 Lua fibers that all ran since the last
/// listing, best of 10 calls, medians of 5 runs 0.61 -> 0.52 us per fiber (10,000: 0.59 ->
/// 0.45); two and three ahead were no better than one, eight worse than four.
const STACK_AHEAD: usize = 4;

/// Pushes `fiber.info()`'s table: every live Lua fiber of this host by id; a full Lua heap
/// is `Err(LErr::Raised)` with `not enough memory` on top.
pub(crate) fn push_all(c: &mut super::call::Call, opts: &Opts) -> Result<(), LErr> {
    let l = c.state();
    // The id is the record's key. The last: the addresses of the record's id and trace
    // (only asked for ahead, never read through: a trace is stored through
    // `Dense::get_at_mut`, which compares the id first).
    type Entry = (
        fibertrace_fiber::Fiber,
        FiberId,
        *mut ffi::lua_State,
        Slice,
        Kept,
        [u64; 2],
    );
    // Whether each fiber ended is read in the listing's loop, where its block is prefetched.
    // The largest id, from the records' keys (a fiber's own id is in its control block, not
    // read before the listing's prefetch reaches it).
    let mut max_id: FiberId = 0;
    // The entries in their control blocks' memory order (the records are in creation order
    // with holes filled, see `recs`; blocks are mostly, not always, in the same order):
    // the records' addresses are sorted by their blocks' (16-byte pairs; no block is read),
    // then the entries made in that order, so that the handles' clones (each touching its
    // block's count, on the line before the block) and the listing's loop below stream
    // through the blocks, with the prefetch, instead of missing on each. (Sorting the
    // entries themselves moved ~90-byte entries; visiting them through a sorted index read
    // them out of order: a miss per fiber at 10,000 and more.)
    let fibers: Vec<Entry> = with_host(|h| {
        // (One pass over the records: each live one's block address, and where it is in
        // the `recs` gathered here.)
        let mut recs: Vec<(usize, &FiberId, &super::LuaFiber)> = Vec::with_capacity(h.recs.len());
        let mut order: Vec<(usize, usize)> = Vec::with_capacity(h.recs.len());
        // (A fiber that ended and is not joined yet is listed, as Tarantool lists it, with
        // no frames: its record keeps its result until the join.)
        let listed = |r: &super::LuaFiber| r.done.is_none() || r.fiber.control_block().is_dead();
        for (place, id, r) in h.recs.iter_placed().filter(|(.., r)| listed(r)) {
            order.push((
                std::sync::Arc::as_ptr(r.fiber.control_block()) as usize,
                recs.len(),
            ));
            recs.push((place, id, r));
        }
        sort_by_key(&mut order);
        order
            .iter()
            .map(|&(_, i)| {
                let (place, id, r) = recs[i];
                max_id = max_id.max(*id);
                let slice = r.max_slice.unwrap_or(h.default_slice);
                let rec = [&raw const *id as u64, &raw const r.trace_cache as u64];
                (
                    r.fiber.clone(),
                    *id,
                    r.thread,
                    slice,
                    Kept::of(r, place, opts.backtrace),
                    rec,
                )
            })
            .collect()
    })
    .ok_or_else(|| LErr::plain("fibertrace: no Lua host on this thread"))?;
    let me = fibertrace_fiber::current_id();
    let current = fibers
        .iter()
        .find(|(_, id, ..)| opts.backtrace && *id == me)
        // SAFETY: the running fiber's own Lua thread.
        .map(|(_, _, root, ..)| unsafe { running_frames(*root, l) });
    // Whether the Lua stacks of the fibers to walk are asked for ahead (the VM's layout,
    // which says where a state keeps its stack, was checked against the running VM).
    let lua_stacks =
        opts.backtrace && crate::frames::publish::checked() == crate::frames::publish::MATCHES;
    // SAFETY: `l` is the state of the running call `c` (`f_info`); fresh tables; each
    // fiber's table is set under its id; the build's slots (below the result) are removed at
    // the end; in a protected call.
    unsafe {
        built(l, &mut |l| {
            let mut call = InfoBuild::new(l, current.clone());
            let (narr, nrec) = result_shape(max_id, fibers.len());
            ffi::lua_createtable(l, narr, nrec);
            let all = ffi::lua_gettop(l);
            for (i, (f, fid, root, slice, kept, _)) in fibers.iter().enumerate() {
                if let Some((ahead, ..)) = fibers.get(i + PREFETCH_AHEAD) {
                    ahead.control_block().prefetch();
                }
                // The stacks of the fiber `STACK_AHEAD` on, when they are to be walked again:
                // the trace kept here is not of its last suspension (it ran since).
                if let Some((next, next_id, root, _, kept, rec)) =
                    fibers.get(i + STACK_AHEAD).filter(|_| opts.backtrace)
                {
                    let due = !kept
                        .trace
                        .as_ref()
                        .is_some_and(|c| is_current(c, next.control_block().csw()));
                    if due {
                        next.control_block().prefetch_walk();
                        // Its record, where the new trace is stored (missed the cache on each
                        // fiber of a large listing).
                        for a in rec {
                            fibertrace_core::capture::prefetch(*a, 8);
                        }
                    }
                    // Only for a fiber that has not ended and is not this one: then (in the
                    // build's unsafe block) `root` is the Lua thread of a live fiber of this
                    // thread, which stays alive while the listing runs — a live fiber's record
                    // leaves only when the fiber ends, and nothing switches during it — and
                    // is not running; the layout matched, per `lua_stacks`. (The record of a
                    // fiber that ended before it ran stays until it is joined, which a
                    // finalizer run by this listing may do: its thread may be freed then.)
                    let live = !next.control_block().is_dead() && *next_id != call.me;
                    if due && live && lua_stacks {
                        prefetch_lua_stack(*root);
                    }
                }
                // The Lua state of the one after it, whose stack is asked for at the next
                // fiber (when it is to be walked: its block, asked for earlier, says).
                if let Some((after, _, root, _, kept, _)) =
                    fibers.get(i + STACK_AHEAD + 1).filter(|_| lua_stacks)
                {
                    if !kept
                        .trace
                        .as_ref()
                        .is_some_and(|c| is_current(c, after.control_block().csw()))
                    {
                        fibertrace_core::capture::prefetch(*root as u64, 128);
                    }
                }
                // (A fiber that ended: `push_fiber` does not touch its Lua thread.)
                push_fiber(l, f, *root, *slice, opts, &mut call, kept.clone());
                super::raw::rawseti(l, all, *fid as ffi::lua_Integer);
            }
            call.finish(l);
        })
    }
}

/// Pushes one fiber's info table (`fiber_object:info()`); a full Lua heap is
/// `Err(LErr::Raised)` as for [`push_all`].
///
pub(crate) fn push_one(c: &mut super::call::Call, fid: FiberId, opts: &Opts) -> Result<(), LErr> {
    let l = c.state();
    let (f, root, slice, kept) = with_host(|h| {
        h.recs.get(&fid).map(|r| {
            let slice = r.max_slice.unwrap_or(h.default_slice);
            (
                r.fiber.clone(),
                r.thread,
                slice,
                // (No place: the trace is stored by a lookup.)
                Kept::of(r, usize::MAX, opts.backtrace),
            )
        })
    })
    .flatten()
    .ok_or("the fiber is dead")?;
    let current = (opts.backtrace && fid == fibertrace_fiber::current_id())
        // SAFETY: the running fiber's own Lua thread.
        .then(|| unsafe { running_frames(root, l) });
    // SAFETY: `l` is the state of the running call `c` (`m_info`); the build's slots are
    // removed after; in a protected call.
    unsafe {
        built(l, &mut |l| {
            let mut call = InfoBuild::new(l, current.clone());
            push_fiber(l, &f, root, slice, opts, &mut call, kept.clone());
            call.finish(l);
        })
    }
}

/// The Lua host's frames for the runtime's own text reports (the deadlock report, a dump
/// taken on this thread): each suspended Lua fiber's native frames interleaved with its Lua
/// stack, as `fiber.info()` shows them (see [`fibertrace_fiber::inspect`]).
pub(crate) struct LuaFrames;

impl fibertrace_fiber::inspect::FrameSource for LuaFrames {
    fn frames(&self, fiber: fibertrace_fiber::FiberId, native: &[Frame]) -> Option<Vec<Frame>> {
        let root = with_host(|h| {
            h.recs
                .get(&fiber)
                .filter(|r| r.done.is_none())
                .map(|r| r.thread)
        })
        .flatten()?;
        let native = fibertrace_core::Backtrace::from_frames(native);
        // SAFETY: the runtime asks on this (the scheduler's) thread about a fiber that is
        // suspended or never ran (the `FrameSource` contract), so its Lua thread is not
        // running; it is read through the debug API only.
        let bt = unsafe { crate::capture_interleaved(&native, root) };
        Some(fibertrace_fiber::info::user_frames(bt.frames()).to_vec())
    }

    fn name(&self, id: fibertrace_core::LuaFrameId) -> Option<String> {
        crate::render::lua_line(id)
    }

    fn holds(&self, fiber: fibertrace_fiber::FiberId) -> Vec<u64> {
        let root = with_host(|h| {
            h.recs
                .get(&fiber)
                .filter(|r| r.done.is_none())
                .map(|r| r.thread)
        })
        .flatten();
        match root {
            // SAFETY: as in `frames`: asked on the scheduler's thread about a suspended
            // fiber (the `FrameSource` contract), whose Lua thread is not running.
            Some(root) => unsafe { super::holds::held(root) },
            None => Vec::new(),
        }
    }
}

/// A snapshot of the whole process now, as the runtime takes it (suspended Lua fibers with
/// their Lua frames interleaved: [`LuaFrames`]), with the calling fiber's own trace read here,
/// from the Lua call of the C function `upto` on, interleaved with its Lua stack — the one
/// trace the runtime cannot give (it does not read a running fiber's Lua stack).
pub(crate) fn snapshot_here(
    cur: *mut ffi::lua_State,
    upto: &'static str,
) -> fibertrace_fiber::Snapshot {
    let me = fibertrace_fiber::current_id();
    let root = with_host(|h| h.recs.get(&me).map(|r| r.thread)).flatten();
    // The other fibers first, as of the call: reading this fiber's frames may load the
    // symbolizer (its first use takes tens of milliseconds), and a wait read after it was
    // that much longer than when the dump was asked for.
    let mut snap = fibertrace_fiber::inspect::snapshot(&fibertrace_fiber::InfoOptions::default());
    // SAFETY: `root` is the running fiber's own Lua thread (its record's), on this thread;
    // `cur` the state of the running call.
    let mut mine = root.map(|root| unsafe { current_frames(root, cur, upto) });
    // The frame of `upto` itself (kept by `current_frames` as the anchor of its Lua level) is
    // the dump, not the caller's stack: a debug build hides it as glue, but in a release
    // build the body inlined into it (`dump_body`) made it show as the fiber's innermost
    // frame.
    if let Some(v) = mine.as_mut() {
        if v.first().is_some_and(|f| is_frame_of(f, upto)) {
            v.remove(0);
        }
        // Called from the host program's own Lua (`os.exit` as `--dump-on-exit` wraps it,
        // chunk [`super::HOST_CHUNK`]): that call, the wrapper's levels and the C functions
        // it called (its `pcall`) are the host's, not the script's, whose own call
        // (`os.exit(0)` in `leave`) comes after the last of them.
        let mut wrapped = None;
        for (i, f) in v
            .iter()
            .enumerate()
            .filter(|(_, f)| matches!(f, Frame::Lua(_)))
            .skip(1)
        {
            let Frame::Lua(id) = f else { continue };
            let Some(info) = crate::describe(*id) else {
                break;
            };
            if info.source.as_bytes() == super::HOST_CHUNK.as_bytes() {
                wrapped = Some(i);
            } else if info.kind != crate::LuaKind::C {
                break;
            }
        }
        if let Some(i) = wrapped {
            v.drain(..=i);
        }
    }
    let Some(frames) = mine else {
        return snap;
    };
    let list = frame_infos(&frames);
    for fi in snap.schedulers.iter_mut().flat_map(|s| s.fibers.iter_mut()) {
        if fi.id == me {
            fi.backtrace = Some(list.clone());
        }
    }
    snap
}

/// Frames as a report carries them: native ones resolved, Lua ones labelled.
pub(crate) fn frame_infos(frames: &[Frame]) -> std::sync::Arc<[fibertrace_fiber::FrameInfo]> {
    frames
        .iter()
        .map(|f| fibertrace_fiber::FrameInfo {
            frame: *f,
            resolved: match f {
                Frame::Lua(_) => None,
                _ => fibertrace_core::symbolize::resolve(f),
            },
            label: match f {
                Frame::Lua(id) => crate::render::lua_line(*id).map(std::sync::Arc::from),
                _ => None,
            },
        })
        .collect()
}

/// The main fiber as it ended by an uncaught error (its scheduler's id, its info with the
/// trace where the error was raised, the message): the program's exit dumps are written
/// after it ended, and would not show it otherwise (see [`with_failed_main`]).
static FAILED_MAIN: std::sync::Mutex<Option<(fibertrace_fiber::FiberInfo, String)>> =
    std::sync::Mutex::new(None);

/// Records the main fiber `fid`, failing now with `message`, its frames at the error
/// `frames` (taken by the message handler).
pub(crate) fn record_failed_main(fid: FiberId, frames: &[Frame], message: &[u8]) {
    let opts = fibertrace_fiber::InfoOptions {
        backtrace: false,
        ..Default::default()
    };
    let Some(mut fi) = fibertrace_fiber::inspect::info::fiber_info(fid, &opts) else {
        return;
    };
    fi.status = Status::Dead;
    fi.waiting = None;
    // (None: the error was raised without the message handler — out of memory.)
    fi.backtrace = (!frames.is_empty()).then(|| frame_infos(frames));
    // Its bytes, at most 500 of them: text as it is, a byte that is not UTF-8 as `\xNN`
    // (control characters are escaped where it is shown).
    let mut msg = String::new();
    // (Cut at a character's start: not inside one, whose bytes would show as escapes.)
    let mut end = message.len().min(500);
    while end > 0 && end < message.len() && message[end] & 0xc0 == 0x80 && end > 496 {
        end -= 1;
    }
    for chunk in message[..end].utf8_chunks() {
        msg.push_str(chunk.valid());
        for b in chunk.invalid() {
            msg.push_str(&format!("\\x{b:02x}"));
        }
    }
    if message.len() > end {
        msg.push_str("...");
    }
    if let Ok(mut g) = FAILED_MAIN.lock() {
        *g = Some((fi, msg));
    }
}

/// Forgets the main fiber's end recorded by an earlier run (see [`record_failed_main`]).
pub(crate) fn clear_failed_main() {
    if let Ok(mut g) = FAILED_MAIN.lock() {
        *g = None;
    }
}

/// Adds the main fiber that ended by an uncaught error (recorded by the host as it ended) to a
/// snapshot taken after it ended, with a note on its scheduler that says so: an exit dump
/// then shows where the script failed. A snapshot that still has it is left as it is.
pub fn with_failed_main(snap: &mut fibertrace_fiber::Snapshot) {
    let Some((fi, msg)) = FAILED_MAIN.lock().ok().and_then(|g| g.clone()) else {
        return;
    };
    let Some(s) = snap.schedulers.iter_mut().find(|s| s.id == fi.scheduler) else {
        return;
    };
    if s.fibers.iter().any(|f| f.id == fi.id) {
        return;
    }
    let line = format!(
        "fiber {} \"{}\" ended by an uncaught error: {}; its trace is where the error was raised",
        fi.id,
        fibertrace_core::format::Escaped(&fi.name),
        fibertrace_core::format::Escaped(&msg)
    );
    s.note = Some(match s.note.take() {
        Some(n) => format!("{n}; {line}"),
        None => line,
    });
    let at = s
        .fibers
        .iter()
        .position(|f| f.id > fi.id)
        .unwrap_or(s.fibers.len());
    s.fibers.insert(at, fi);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::intern::LuaKind;
    use crate::{LuaLevel, LuaStack};

    /// What `merged` must give: the merge made afresh.
    fn fresh(native: &[Frame], lua: &LuaStack) -> Vec<Frame> {
        let bt = crate::interleave::interleave(native, lua, &Default::default());
        fibertrace_fiber::info::user_frames(bt.frames()).to_vec()
    }

    fn level(id: u32, kind: LuaKind, cfunc: usize) -> LuaLevel {
        LuaLevel {
            id: fibertrace_core::LuaFrameId(id),
            kind,
            cfunc,
            thread: 0,
        }
    }

    fn stack(levels: &[LuaLevel], gap: Option<(usize, u64)>) -> LuaStack {
        let mut s = LuaStack::new();
        s.levels.extend_from_slice(levels);
        s.threads = 1;
        if let Some((at, n)) = gap {
            (s.truncated, s.omitted_at, s.omitted) = (true, at, n);
        }
        s
    }

    /// The listing's sort orders as a comparison sort does: small and large inputs, keys
    /// 64-byte aligned in a heap-sized span (control blocks), keys differing in every bit
    /// (the top one included), keys close in their low bits and far apart in a high one, one
    /// key, none.
    #[test]
    fn the_listing_sort_orders_as_a_comparison_sort() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut inputs: Vec<Vec<usize>> = Vec::new();
        for n in [0, 1, 2, 2047, 2048, 5000, 40_000] {
            let mut set = std::collections::HashSet::new();
            while set.len() < n {
                set.insert(0x5555_0000_0000 + ((next() % (1 << 25)) as usize & !63));
            }
            inputs.push(set.into_iter().collect());
        }
        let mut wide = std::collections::HashSet::new();
        while wide.len() < 10_000 {
            wide.insert(next() as usize);
        }
        let mut wide: Vec<usize> = wide.into_iter().collect();
        wide.push(usize::MAX);
        wide.push(0);
        inputs.push(wide);
        inputs.push(
            (0..3000)
                .map(|i| if i % 2 == 0 { 1 << 40 } else { 0 } + i)
                .collect(),
        );
        for keys in inputs {
            let mut got: Vec<(usize, usize)> =
                keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
            let mut want = got.clone();
            want.sort_unstable();
            sort_by_key(&mut got);
            assert_eq!(got, want, "{} keys", keys.len());
        }
    }

    /// The merge memo gives the trace a fresh merge gives, for inputs that differ in one
    /// native frame anywhere, in one Lua level's description, kind or C function, in the gap
    /// left in a deep Lua stack, and for two inputs that fall in the same slot, taken in
    /// turns (each evicts the other); a repeat is the one interned trace.
    #[test]
    fn the_merge_memo_gives_what_a_fresh_merge_gives() {
        let native: Vec<Frame> = (0..30).map(|i| Frame::Ra(0x5000_0000 + 0x40 * i)).collect();
        let mut deep = native.clone();
        deep[29] = Frame::Ra(0x6000_0000);
        let mut top = native.clone();
        top[0] = Frame::Pc(0x5000_0000);
        let a = [level(1, LuaKind::C, 0x1234), level(2, LuaKind::Lua, 0)];
        let other_line = [level(1, LuaKind::C, 0x1234), level(3, LuaKind::Lua, 0)];
        let other_kind = [level(1, LuaKind::C, 0x1234), level(2, LuaKind::Main, 0)];
        let other_c = [level(1, LuaKind::C, 0x1235), level(2, LuaKind::Lua, 0)];
        let inputs = [
            (native.clone(), stack(&a, None)),
            (deep.clone(), stack(&a, None)),
            (top.clone(), stack(&a, None)),
            (native.clone(), stack(&other_line, None)),
            (native.clone(), stack(&other_kind, None)),
            (native.clone(), stack(&other_c, None)),
            (native.clone(), stack(&a, Some((1, 7)))),
            (native.clone(), stack(&a, Some((1, 8)))),
            (native.clone(), stack(&a, Some((2, 7)))),
            (native[..3].to_vec(), stack(&[], None)),
            (Vec::new(), stack(&a, None)),
        ];
        for round in 0..3 {
            for (n, l) in &inputs {
                assert_eq!(&*merged(n, l), fresh(n, l).as_slice(), "round {round}");
            }
        }
        // The inputs that merge differently (a kind or an unanchored C function changes
        // nothing in the frames) are told apart: a memo that answered for another fails.
        let all: std::collections::HashSet<Vec<Frame>> =
            inputs.iter().map(|(n, l)| merged(n, l).to_vec()).collect();
        assert_eq!(all.len(), inputs.len() - 2);
        for (i, j) in [
            (0, 1),
            (0, 2),
            (0, 3),
            (0, 6),
            (6, 7),
            (6, 8),
            (0, 9),
            (0, 10),
        ] {
            assert_ne!(
                fresh(&inputs[i].0, &inputs[i].1),
                fresh(&inputs[j].0, &inputs[j].1)
            );
        }
        // A repeat is the interned trace itself.
        let (n, l) = &inputs[0];
        assert!(Rc::ptr_eq(&merged(n, l), &merged(n, l)));
        // Two inputs in one slot, in turns.
        let base = stack(&a, None);
        let slot = merged_slot(&native, &base);
        let mut twin = native.clone();
        let mut k = 0u64;
        loop {
            twin[15] = Frame::Ra(0x7000_0000 + k);
            if merged_slot(&twin, &base) == slot {
                break;
            }
            k += 1;
        }
        for _ in 0..3 {
            assert_eq!(&*merged(&native, &base), fresh(&native, &base).as_slice());
            assert_eq!(&*merged(&twin, &base), fresh(&twin, &base).as_slice());
        }
        assert_ne!(fresh(&native, &base), fresh(&twin, &base));
        // A trace longer than the memo keeps: merged right every time.
        let long: Vec<Frame> = (0..300)
            .map(|i| Frame::Ra(0x5100_0000 + 0x40 * i))
            .collect();
        for _ in 0..2 {
            assert_eq!(&*merged(&long, &base), fresh(&long, &base).as_slice());
        }
    }

    #[test]
    fn dense_ids_go_to_the_array_part_and_spread_ones_to_the_hash_part() {
        // Every id up to the largest, and up to about half the slots unused: array.
        assert_eq!(result_shape(1000, 1000), (1000, 0));
        assert_eq!(result_shape(2016, 1000), (2016, 0));
        assert_eq!(result_shape(16, 1), (16, 0));
        // Sparser: hash, sized to the count.
        assert_eq!(result_shape(2017, 1000), (0, 1000));
        assert_eq!(result_shape(1 << 40, 3), (0, 3));
        // An id past what `lua_createtable` takes, however many fibers: hash.
        let big = c_int::MAX as u64 + 1;
        assert_eq!(result_shape(big, big as usize), (0, c_int::MAX));
        // Past the largest array asked for, however dense: hash.
        assert_eq!(
            result_shape(c_int::MAX as u64, c_int::MAX as usize),
            (0, c_int::MAX)
        );
        assert_eq!(
            result_shape(MAX_ARRAY, MAX_ARRAY as usize),
            (MAX_ARRAY as c_int, 0)
        );
        assert_eq!(
            result_shape(MAX_ARRAY + 1, MAX_ARRAY as usize + 1),
            (0, MAX_ARRAY as c_int + 1)
        );
        // Nothing listed.
        assert_eq!(result_shape(0, 0), (0, 0));
    }

    #[test]
    fn interned_traces_nobody_holds_are_dropped_and_held_ones_stay_one() {
        let trace = |i: u64| -> Rc<[Frame]> { Rc::from(vec![Frame::Ra(0x1000 + i)]) };
        let held: Vec<Rc<[Frame]>> = (0..10).map(|i| intern(trace(i))).collect();
        for i in 100..100 + 3 * TRACES_MIN as u64 {
            intern(trace(i));
        }
        let len = TRACES.with(|c| c.borrow().len());
        assert!((10..=TRACES_MIN).contains(&len), "{len} traces kept");
        for (i, h) in held.iter().enumerate() {
            assert!(Rc::ptr_eq(h, &intern(trace(i as u64))), "trace {i}");
        }
    }
}
