//! `fiber.info()`: one table per Lua fiber, keyed by fiber id, with Tarantool's keys (`fid`,
//! `name`, `csw`, `time`, `memory = {used, total}`, `backtrace`) and fibertrace's (`status`,
//! `waiting = {on, seconds}`, `parent`, `parent_backtrace`).
//!
//! Each backtrace is the fiber's native stack (the running fiber's own, or a suspended one's
//! from its saved context, frame-pointer walk) interleaved with the Lua stack of the fiber's
//! Lua thread and the coroutines running in it ([`crate::interleave`]), in Tarantool's entry
//! format (`{C = "#1  0x… in name+off"}`, `{L = "#2  leaf in @script.lua:2"}`), numbered
//! from 1. Rendered entries are cached by (number, frame); a fiber's trace is cached with its
//! context-switch count (a fiber that has not run since has the same stacks); and fibers with
//! identical traces share one `backtrace` array within a result (treat it as read-only).
//!
//! How results can be wrong: as [`crate::interleave`]; `memory.used` is the fiber's stack in
//! use at its last suspension (there is no per-fiber heap region as in Tarantool), `total` its
//! stack size; `time` is the CPU time it ran.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::rc::Rc;

use fibertrace_core::{Frame, Unwinder};
use fibertrace_fiber::{FiberId, Status, WaitOn};
use mlua::ffi;

use super::raw::{push_str, set_field};
use super::with_host;
use crate::render::TarantoolEntry;

/// Options of `fiber.info([opts])`.
pub(crate) struct Opts {
    backtrace: bool,
}

/// Reads `{backtrace = bool}` / `{bt = bool}` (raw reads; anything else means true).
///
/// # Safety
/// `l` valid.
pub(crate) unsafe fn read_opts(l: *mut ffi::lua_State, idx: c_int) -> Opts {
    let mut backtrace = true;
    // SAFETY: raw reads of two fields; pushed values are popped.
    unsafe {
        if ffi::lua_type(l, idx) == ffi::LUA_TTABLE {
            ffi::lua_checkstack(l, 2);
            for key in ["backtrace", "bt"] {
                push_str(l, key);
                ffi::lua_rawget(l, idx);
                let t = ffi::lua_type(l, -1);
                let v = ffi::lua_toboolean(l, -1) != 0;
                ffi::lua_settop(l, -2);
                if t != ffi::LUA_TNIL {
                    backtrace = v;
                    break;
                }
            }
        }
    }
    Opts { backtrace }
}

/// A rendered entry: whether it is a C entry, and its text.
type Entry = (bool, Box<str>);

thread_local! {
    static ENTRIES: RefCell<HashMap<(u32, Frame), Entry>> = RefCell::new(HashMap::new());
}

/// Most cached rendered entries (the cache is cleared when it grows past this).
const CACHE_MAX: usize = 100_000;

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

/// Backtrace arrays already built during one `fiber.info()` call, by trace: fibers stopped at
/// the same place share one array in a result (read-only data, as Tarantool code treats it).
pub(crate) struct Shared {
    /// Absolute index of the scratch table holding the arrays.
    scratch: c_int,
    by_trace: HashMap<Rc<[Frame]>, ffi::lua_Integer>,
}

impl Shared {
    /// Pushes a scratch table and returns the dedup state over it.
    ///
    /// # Safety
    /// `l` valid.
    unsafe fn new(l: *mut ffi::lua_State) -> Shared {
        // SAFETY: per the contract.
        unsafe {
            ffi::lua_createtable(l, 8, 0);
            Shared {
                scratch: ffi::lua_gettop(l),
                by_trace: HashMap::new(),
            }
        }
    }

    /// Pushes the entries array of `frames` (shared with earlier identical traces).
    ///
    /// # Safety
    /// `l` valid; the scratch table is still at its index.
    unsafe fn push(&mut self, l: *mut ffi::lua_State, frames: &Rc<[Frame]>) {
        // SAFETY: per the contract.
        unsafe {
            if let Some(&k) = self.by_trace.get(frames) {
                ffi::lua_rawgeti(l, self.scratch, k);
                return;
            }
            push_entries(l, frames);
            let k = self.by_trace.len() as ffi::lua_Integer + 1;
            ffi::lua_pushvalue(l, -1);
            ffi::lua_rawseti(l, self.scratch, k);
            self.by_trace.insert(frames.clone(), k);
        }
    }
}

/// Pushes an array of entries for `frames`.
///
/// # Safety
/// `l` valid.
unsafe fn push_entries(l: *mut ffi::lua_State, frames: &[Frame]) {
    // SAFETY: fresh tables; plain sets.
    unsafe {
        ffi::lua_checkstack(l, 4);
        ffi::lua_createtable(l, frames.len() as c_int, 0);
        let arr = ffi::lua_gettop(l);
        let mut n = 1u32;
        for f in frames {
            let Some((is_c, s)) = entry(n, f) else {
                continue;
            };
            ffi::lua_createtable(l, 0, 1);
            push_str(l, &s);
            set_field(l, arr + 1, if is_c { c"C" } else { c"L" });
            ffi::lua_rawseti(l, arr, n as ffi::lua_Integer);
            n += 1;
        }
    }
}

/// Leading frames of the current stack that belong to the capture itself are cut up to the
/// frame of the C function `upto` (kept: it is where Lua called in).
fn cut_to(frames: &[Frame], upto: &str) -> usize {
    for (i, f) in frames.iter().enumerate().take(24) {
        if f.is_marker() || matches!(f, Frame::Lua(_)) {
            break;
        }
        let hit = fibertrace_core::symbolize::resolve(f)
            .and_then(|r| r.function().map(|n| n.rsplit("::").next() == Some(upto)))
            .unwrap_or(false);
        if hit {
            return i;
        }
    }
    0
}

/// The running fiber's trace, interleaved with the Lua stack of `root`, starting at the
/// frame of the C function `upto` (the function Lua called).
///
/// # Safety
/// `root` is the current fiber's Lua thread (or a state running on this OS thread).
#[inline(never)]
pub(crate) unsafe fn current_frames(root: *mut ffi::lua_State, upto: &str) -> Vec<Frame> {
    let native = match fibertrace_fiber::current() {
        Some(f) => f.backtrace(Unwinder::Fast).unwrap_or_default(),
        None => fibertrace_core::collect(&fibertrace_core::CaptureOptions::with_unwinder(
            Unwinder::Fast,
        )),
    };
    let skip = cut_to(native.frames(), upto);
    let native = fibertrace_core::Backtrace::from_frames(&native.frames()[skip..]);
    // SAFETY: per the contract.
    let bt = unsafe { crate::capture_interleaved(&native, root) };
    fibertrace_fiber::info::user_frames(bt.frames()).to_vec()
}

/// A fiber's interleaved trace now: recomputed only when it has run since the last time
/// (a suspended fiber's native stack and Lua stack change only when it runs).
///
/// # Safety
/// `root` is the fiber's Lua thread; the fiber is the current one or suspended on this thread.
unsafe fn fiber_frames(
    f: &fibertrace_fiber::Fiber,
    root: *mut ffi::lua_State,
) -> Option<Rc<[Frame]>> {
    if f.id() == fibertrace_fiber::current_id() {
        // SAFETY: per the contract.
        let v = unsafe { current_frames(root, "f_info") };
        let k = cut_to(&v, "m_info");
        return Some(Rc::from(&v[k..]));
    }
    let csw = f.shared().csw();
    let cached = with_host(|h| {
        h.recs
            .get(&f.id())
            .and_then(|r| r.trace_cache.as_ref())
            .filter(|(c, _)| *c == csw && csw > 0)
            .map(|(_, t)| t.clone())
    })
    .flatten();
    if cached.is_some() {
        return cached;
    }
    let native = f.backtrace(Unwinder::Fast)?;
    // SAFETY: the fiber is suspended (or never ran) on this OS thread, so its Lua thread is
    // not running; it is read through the debug API only.
    let bt = unsafe { crate::capture_interleaved(&native, root) };
    let t: Rc<[Frame]> = Rc::from(fibertrace_fiber::info::user_frames(bt.frames()));
    // The count is read again: the capture may not race with a resume on this thread, but
    // the cache must only hold a trace taken while the fiber was suspended.
    if f.shared().csw() == csw && f.shared().status().0 != Status::Running {
        with_host(|h| {
            if let Some(r) = h.recs.get_mut(&f.id()) {
                r.trace_cache = Some((csw, t.clone()));
            }
        });
    }
    Some(t)
}

fn wait_word(on: &WaitOn) -> &'static str {
    match on {
        WaitOn::Sleep => "sleep",
        WaitOn::ChannelReceive(_) => "channel receive",
        WaitOn::ChannelSend(_) => "channel send",
        WaitOn::Condition(_) => "condition wait",
        WaitOn::Join(_) => "join",
        WaitOn::Wakeup => "suspended",
    }
}

fn status_name(s: Status) -> &'static str {
    match s {
        Status::Running => "running",
        Status::Ready => "ready",
        Status::Suspended => "suspended",
        Status::Sleeping => "sleeping",
        Status::Waiting => "waiting",
        Status::Dead => "dead",
    }
}

/// Pushes one fiber's info table.
///
/// # Safety
/// `l` valid; `root` the fiber's Lua thread.
unsafe fn push_fiber(
    l: *mut ffi::lua_State,
    f: &fibertrace_fiber::Fiber,
    root: *mut ffi::lua_State,
    opts: &Opts,
    shared: &mut Shared,
) {
    let sh = f.shared();
    let (status, on, secs) = sh.status();
    // SAFETY: fresh tables; plain sets.
    unsafe {
        ffi::lua_checkstack(l, 6);
        ffi::lua_createtable(l, 0, 10);
        let t = ffi::lua_gettop(l);
        ffi::lua_pushinteger(l, f.id() as ffi::lua_Integer);
        set_field(l, t, c"fid");
        push_str(l, &sh.name_arc());
        set_field(l, t, c"name");
        ffi::lua_pushinteger(l, sh.csw() as ffi::lua_Integer);
        set_field(l, t, c"csw");
        ffi::lua_pushnumber(l, sh.cpu_time().as_secs_f64());
        set_field(l, t, c"time");
        ffi::lua_createtable(l, 0, 2);
        ffi::lua_pushinteger(l, sh.stack_used() as ffi::lua_Integer);
        set_field(l, t + 1, c"used");
        ffi::lua_pushinteger(l, sh.stack_size() as ffi::lua_Integer);
        set_field(l, t + 1, c"total");
        set_field(l, t, c"memory");
        let status = if f.id() == fibertrace_fiber::current_id() {
            Status::Running
        } else {
            status
        };
        push_str(l, status_name(status));
        set_field(l, t, c"status");
        if let Some(on) = on {
            ffi::lua_createtable(l, 0, 2);
            match on {
                WaitOn::Join(_) => push_str(l, &on.to_string()),
                _ => push_str(l, wait_word(&on)),
            }
            set_field(l, t + 1, c"on");
            ffi::lua_pushnumber(l, secs.as_secs_f64());
            set_field(l, t + 1, c"seconds");
            set_field(l, t, c"waiting");
        }
        if let Some(p) = f.parent() {
            ffi::lua_pushinteger(l, p as ffi::lua_Integer);
            set_field(l, t, c"parent");
        }
        if opts.backtrace {
            if let Some(frames) = fiber_frames(f, root) {
                shared.push(l, &frames);
                set_field(l, t, c"backtrace");
            }
            if let Some(pt) = f.parent_trace() {
                shared.push(l, &Rc::from(pt.flatten()));
                set_field(l, t, c"parent_backtrace");
            }
        }
    }
}

/// Pushes `fiber.info()`'s table: every live Lua fiber of this host by id.
///
/// # Safety
/// `l` valid.
pub(crate) unsafe fn push_all(l: *mut ffi::lua_State, opts: &Opts) -> Result<(), String> {
    let mut fibers: Vec<(fibertrace_fiber::Fiber, *mut ffi::lua_State)> = with_host(|h| {
        h.recs
            .values()
            .filter(|r| r.done.is_none() && !r.fiber.shared().is_dead())
            .map(|r| (r.fiber.clone(), r.thread))
            .collect()
    })
    .ok_or("fibertrace: no Lua host on this thread")?;
    fibers.sort_unstable_by_key(|(f, _)| f.id());
    // SAFETY: fresh tables; each fiber's table is set under its id; the scratch table
    // (below the result) is removed at the end.
    unsafe {
        let mut shared = Shared::new(l);
        ffi::lua_createtable(l, 0, fibers.len() as c_int);
        let all = ffi::lua_gettop(l);
        for (f, root) in &fibers {
            push_fiber(l, f, *root, opts, &mut shared);
            ffi::lua_rawseti(l, all, f.id() as ffi::lua_Integer);
        }
        ffi::lua_remove(l, shared.scratch);
    }
    Ok(())
}

/// Pushes one fiber's info table (`fiber_object:info()`).
///
/// # Safety
/// `l` valid.
pub(crate) unsafe fn push_one(
    l: *mut ffi::lua_State,
    fid: FiberId,
    opts: &Opts,
) -> Result<(), String> {
    let (f, root) = with_host(|h| h.recs.get(&fid).map(|r| (r.fiber.clone(), r.thread)))
        .flatten()
        .ok_or("the fiber is dead")?;
    // SAFETY: per the contract; the scratch table is removed after.
    unsafe {
        let mut shared = Shared::new(l);
        push_fiber(l, &f, root, opts, &mut shared);
        ffi::lua_remove(l, shared.scratch);
    }
    Ok(())
}
