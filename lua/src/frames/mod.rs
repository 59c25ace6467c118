//! Lua frames: capture the Lua stack of a `lua_State` and intern each level.
//!
//! [`capture_lua_stack`] starts at a *root* state — the main state, or a fiber's own Lua
//! thread — and first follows the chain of Lua coroutines running inside it: while the top
//! level (level 0) of a thread is a C function that resumed another coroutine, it goes down
//! into that coroutine. The resumed thread is found as `coroutine.wrap`'s helper's upvalue 1,
//! or as argument 1 of `coroutine.resume` (read with `lua_getlocal`); a candidate counts only
//! if it is a live, non-suspended thread with frames that is not already in the chain. Then it
//! reads every level of every thread, innermost thread first, with
//! `lua_getstack`/`lua_getinfo("Slnf")`, and for C levels the `lua_CFunction` with
//! `lua_tocfunction` — for a LuaJIT fast function (which has none), the C fallback its
//! assembler calls when it cannot finish alone (`lj_ffh_*`, which raises its argument
//! errors), read from its function object where the VM's layout was checked
//! ([`publish::check`]).
//!
//! Invariants: at most [`MAX_LEVELS`] levels and [`MAX_THREADS`] threads are read: the
//! innermost [`HEAD_LEVELS`] and the outermost [`MAX_LEVELS`]` - HEAD_LEVELS` (so a deep
//! stack still shows the function the fiber started with), the ones between counted in
//! [`LuaStack::omitted`]. `lua_getstack(L, n)` costs O(n): a thread's depth is found by a
//! binary search, so a capture costs O(depth · log depth), not O(depth²). Each level's strings
//! are interned, not copied ([`intern`]); the Lua stacks are left as they were found.
//!
//! How a result can be wrong or incomplete:
//! * a coroutine resumed from Rust (mlua's `Thread::resume`) rather than by
//!   `coroutine.resume`/`wrap` leaves no trace in its resumer's Lua stack: capturing from the
//!   resumer's root misses the coroutine's levels (capture from the coroutine itself then);
//! * a C function at the top of a normal (resuming) thread that holds some *other* running
//!   thread in upvalue 1 or argument 1 would be taken for a resume;
//! * LuaJIT drops a Lua function that tail-calls a C function; Lua 5.4 drops every
//!   tail-calling Lua function (the callee's name is then unknown and falls back to
//!   `function <src:line>`);
//! * on a stack deeper than [`MAX_LEVELS`] the middle levels are left out and counted
//!   ([`LuaStack::omitted`], at [`LuaStack::omitted_at`]; [`LuaStack::truncated`] is set).

use std::ffi::{c_int, CStr};

use fibertrace_core::LuaFrameId;
use mlua::ffi;
use smallvec::SmallVec;

pub mod foreign;
pub mod intern;
pub mod publish;

/// The C fallback of the LuaJIT fast function at index -1 of `l` (its function object's C
/// function: `lj_ffh_*`, what its assembler calls when it cannot finish alone), where the
/// VM's layout was checked to match ([`publish::check`]); 0 otherwise, and on Lua 5.4 (no
/// fast functions).
///
/// # Safety
/// Index -1 of `l` is a C function (a level's function pushed by `lua_getinfo`'s "f").
unsafe fn fast_function_fallback(l: *mut ffi::lua_State) -> usize {
    if !cfg!(feature = "luajit") || publish::checked() != publish::MATCHES {
        return 0;
    }
    // SAFETY: per the contract, a function value: its object's address.
    let p = unsafe { ffi::lua_topointer(l, -1) } as usize;
    if p == 0 {
        return 0;
    }
    // SAFETY: a C function object (`GCfuncC`) of the linked LuaJIT, whose C-function field is
    // at `func_cfunc`, as the check verified on a C function of this VM.
    unsafe {
        std::ptr::read((p + publish::Layout::LUAJIT_GC64.func_cfunc as usize) as *const usize)
    }
}
pub(crate) mod shape;

use intern::{LuaKind, RawInfo};

/// Most Lua levels one capture reads (over all threads of the chain).
pub const MAX_LEVELS: usize = 128;

/// Of [`MAX_LEVELS`], how many innermost levels a deeper stack keeps (the rest of the room
/// goes to its outermost levels).
pub const HEAD_LEVELS: usize = 96;

/// The deepest level a thread's depth is searched to (LuaJIT's and Lua's own stack limits
/// are far below).
const MAX_DEPTH: c_int = 1 << 24;

/// Most Lua threads one capture follows: above the VMs' own bound on nested resumes (each is
/// a nested C call: LuaJIT stops at 8,192 with "C stack overflow", Lua 5.4 at 200), so the
/// whole chain down to the innermost coroutine is read (with 16 the innermost ones of a
/// deeper nest were lost without a word, their levels' native frames left on a `resume`).
pub const MAX_THREADS: usize = 1 << 14;

/// One captured Lua level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LuaLevel {
    /// Its interned description.
    pub id: LuaFrameId,
    /// The kind of function.
    pub kind: LuaKind,
    /// For a C level, its `lua_CFunction`, or a LuaJIT fast function's C fallback (see the
    /// module doc; 0 where not known); 0 for Lua levels.
    pub cfunc: usize,
    /// Which thread of the chain it belongs to (0 = the innermost coroutine).
    pub thread: u16,
}

impl LuaLevel {
    /// Whether this level is a C function with a native frame to anchor to.
    #[inline]
    pub fn is_anchor(&self) -> bool {
        self.kind == LuaKind::C && self.cfunc != 0
    }
}

/// The Lua levels of a root state and the coroutines running inside it, innermost first.
#[derive(Clone, Debug, Default)]
pub struct LuaStack {
    /// The levels.
    pub levels: SmallVec<[LuaLevel; 64]>,
    /// How many threads the chain had.
    pub threads: usize,
    /// Whether levels were left out ([`MAX_LEVELS`] reached).
    pub truncated: bool,
    /// How many levels were left out between the innermost and the outermost ones kept.
    pub omitted: u64,
    /// Where in `levels` they were left out (the index of the first level after the gap).
    pub omitted_at: usize,
}

impl LuaStack {
    /// An empty stack.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes every level.
    pub fn clear(&mut self) {
        self.levels.clear();
        self.threads = 0;
        self.truncated = false;
        self.omitted = 0;
        self.omitted_at = 0;
    }
}

fn zeroed_debug() -> ffi::lua_Debug {
    // SAFETY: lua_Debug is a plain C struct of integers, pointers and a char array; all
    // zeroes is a valid value of each (null pointers, zero counts), and the Lua API only
    // reads fields it wrote itself.
    unsafe { std::mem::MaybeUninit::<ffi::lua_Debug>::zeroed().assume_init() }
}

/// Captures the Lua stack of `root` and of the coroutines running inside it into `out`
/// (cleared first), innermost first.
///
/// # Safety
/// `root` must be a valid `lua_State` of the Lua linked into this crate, and no other code may
/// use any state of its Lua universe during the call: either the call is made on the thread
/// that runs it (e.g. from inside a callback), or that thread is known not to touch it (a
/// suspended fiber that cannot be resumed meanwhile). The states are used only through the
/// debug API; their stacks are restored before returning.
pub unsafe fn capture_lua_stack(root: *mut ffi::lua_State, out: &mut LuaStack) {
    // SAFETY: forwarded contract.
    unsafe { capture_lua_stack_within(root, std::ptr::null_mut(), out) }
}

/// [`capture_lua_stack`] of `root` with `inner`, the state running now, as the innermost
/// thread when the chain of `root` does not reach it: a `__gc` finalizer runs on the VM's
/// main state, inside the C function that set off the collection (`collectgarbage`, an
/// allocation), not in a coroutine `root` resumed — its levels (the finalizer's, and the
/// functions it called) come first, then `root`'s. Null: none.
///
/// # Safety
/// As [`capture_lua_stack`]; `inner` is null or a state of the same universe running on
/// this OS thread.
pub unsafe fn capture_lua_stack_within(
    root: *mut ffi::lua_State,
    inner: *mut ffi::lua_State,
    out: &mut LuaStack,
) {
    out.clear();
    if root.is_null() {
        return;
    }
    let mut chain: SmallVec<[*mut ffi::lua_State; 4]> = SmallVec::new();
    chain.push(root);
    while chain.len() < MAX_THREADS {
        let top = chain[chain.len() - 1];
        // SAFETY: `top` is the root or a live thread found by `resumed_by`; the caller
        // guarantees exclusive use of the Lua universe.
        match unsafe { resumed_by(top, &chain) } {
            Some(next) => chain.push(next),
            None => break,
        }
    }
    if !inner.is_null() && !chain.contains(&inner) && chain.len() < MAX_THREADS {
        chain.push(inner);
    }
    out.threads = chain.len();
    let mut ar = zeroed_debug();
    // Each thread's depth, innermost thread first; the levels kept are the first HEAD_LEVELS
    // and the last (MAX_LEVELS - HEAD_LEVELS) of all of them in that order.
    let mut depths: SmallVec<[(*mut ffi::lua_State, c_int); 4]> = SmallVec::new();
    for &l in chain.iter().rev() {
        // SAFETY: `l` is a thread of the chain, a state of this universe (the contract); the
        // debug API reads its frames.
        depths.push((l, unsafe { depth(l, &mut ar) }));
    }
    let total: u64 = depths.iter().map(|&(_, d)| d as u64).sum();
    let (head, tail_from) = if total <= MAX_LEVELS as u64 {
        (total, total)
    } else {
        (
            HEAD_LEVELS as u64,
            total - (MAX_LEVELS - HEAD_LEVELS) as u64,
        )
    };
    let mut g = 0u64; // global index of the thread's level 0
    for (t, &(l, d)) in depths.iter().enumerate() {
        let d64 = d as u64;
        // SAFETY: `l` is a thread of the chain (the contract); lua_checkstack only grows its stack
        // if needed and never raises.
        if d == 0 || unsafe { ffi::lua_checkstack(l, 2) } == 0 {
            g += d64;
            continue;
        }
        for level in 0..d {
            let at = g + level as u64;
            if at >= head && at < tail_from {
                if at == head {
                    out.truncated = true;
                    out.omitted = tail_from - head;
                    out.omitted_at = out.levels.len();
                }
                continue;
            }
            // SAFETY: `ar` is a valid lua_Debug owned by this function.
            if unsafe { ffi::lua_getstack(l, level, &mut ar) } == 0 {
                break;
            }
            // SAFETY: `ar` was filled by lua_getstack for this state just above.
            let lv = unsafe { read_level(l, &mut ar, t as u16) };
            if let Some(lv) = lv {
                out.levels.push(lv);
            }
        }
        g += d64;
    }
}

/// How many levels thread `l` has: `lua_getstack` succeeds exactly for the levels below it.
/// Found by doubling then bisecting: O(depth · log depth) steps in all, where reading every
/// level would take O(depth²).
///
/// # Safety
/// `l` a valid state used by no one else during the call (see [`capture_lua_stack`]).
unsafe fn depth(l: *mut ffi::lua_State, ar: &mut ffi::lua_Debug) -> c_int {
    // SAFETY: per the contract; lua_getstack only reads the state.
    let has = |k: c_int, ar: &mut ffi::lua_Debug| unsafe { ffi::lua_getstack(l, k, ar) } != 0;
    if !has(0, ar) {
        return 0;
    }
    // has(lo) holds, has(hi) does not.
    let (mut lo, mut hi) = (0 as c_int, 1 as c_int);
    while hi < MAX_DEPTH && has(hi, ar) {
        lo = hi;
        hi = hi.saturating_mul(2);
    }
    if hi >= MAX_DEPTH && has(MAX_DEPTH - 1, ar) {
        return MAX_DEPTH;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if has(mid, ar) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo + 1
}

/// Reads one level whose `ar` was filled by `lua_getstack`.
///
/// # Safety
/// `ar` must come from `lua_getstack(l, ..)` with no Lua call in between; `l` must have room
/// for one more stack slot.
unsafe fn read_level(
    l: *mut ffi::lua_State,
    ar: &mut ffi::lua_Debug,
    thread: u16,
) -> Option<LuaLevel> {
    // SAFETY: per the function's contract; "Slnf" fills the string fields and pushes the
    // running function.
    if unsafe { ffi::lua_getinfo(l, c"Slnf".as_ptr(), ar) } == 0 {
        return None;
    }
    // SAFETY: the strings returned by lua_getinfo are NUL-terminated (static strings, or the
    // function's source string kept alive by the function we keep on the stack until the
    // level is interned); short_src is a NUL-terminated array inside `ar`.
    let (what, name, source, short_src) = unsafe {
        (
            cstr(ar.what).unwrap_or(b"?"),
            cstr(ar.name),
            cstr(ar.source).unwrap_or(b"=?"),
            CStr::from_ptr(ar.short_src.as_ptr()).to_bytes(),
        )
    };
    let kind = LuaKind::from_what(what);
    let cfunc = if kind == LuaKind::C {
        // SAFETY: index -1 is the function pushed by lua_getinfo's "f".
        match unsafe { ffi::lua_tocfunction(l, -1) } {
            Some(f) => f as usize,
            // SAFETY: as above.
            None => unsafe { fast_function_fallback(l) },
        }
    } else {
        0
    };
    let raw = RawInfo {
        kind,
        name,
        source,
        short_src,
        current_line: ar.currentline,
        line_defined: ar.linedefined,
        cfunc,
    };
    let id = intern::intern(&raw);
    // SAFETY: pops the function pushed by "f".
    unsafe { ffi::lua_settop(l, -2) };
    Some(LuaLevel {
        id,
        kind,
        cfunc,
        thread,
    })
}

/// # Safety
/// `p` is null or points at a NUL-terminated string that outlives the returned slice's use.
unsafe fn cstr<'a>(p: *const std::ffi::c_char) -> Option<&'a [u8]> {
    // SAFETY: per the function's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// The coroutine that the top level of `l` is running, if that level is a resume: a C
/// function holding a live, non-suspended thread with frames in upvalue 1
/// (`coroutine.wrap`'s helper) or argument 1 (`coroutine.resume`).
///
/// # Safety
/// `l` must be a valid state of the linked Lua, used exclusively by this call.
unsafe fn resumed_by(
    l: *mut ffi::lua_State,
    chain: &[*mut ffi::lua_State],
) -> Option<*mut ffi::lua_State> {
    let mut ar = zeroed_debug();
    // SAFETY: plain debug-API calls on a valid state; each push is popped before returning,
    // and lua_checkstack guarantees the room for the two values pushed at most.
    unsafe {
        if ffi::lua_getstack(l, 0, &mut ar) == 0 || ffi::lua_checkstack(l, 3) == 0 {
            return None;
        }
        let top = ffi::lua_gettop(l);
        if ffi::lua_getinfo(l, c"f".as_ptr(), &mut ar) == 0 {
            return None;
        }
        let mut found: *mut ffi::lua_State = std::ptr::null_mut();
        if ffi::lua_iscfunction(l, -1) != 0 {
            if !ffi::lua_getupvalue(l, -1, 1).is_null() {
                if ffi::lua_type(l, -1) == ffi::LUA_TTHREAD {
                    found = ffi::lua_tothread(l, -1);
                }
                ffi::lua_settop(l, -2);
            }
            if !usable(found, chain) {
                found = std::ptr::null_mut();
                if !ffi::lua_getlocal(l, &ar, 1).is_null() {
                    if ffi::lua_type(l, -1) == ffi::LUA_TTHREAD {
                        found = ffi::lua_tothread(l, -1);
                    }
                    ffi::lua_settop(l, -2);
                }
            }
        }
        ffi::lua_settop(l, top);
        usable(found, chain).then_some(found)
    }
}

/// Whether `co` is a thread the chain may go down into: not null, not already in the chain
/// (a C function given a thread that resumes this one — `fiber.yield(co)` — is taken for a
/// resume, and the chain would loop), not suspended in a yield, and with at least one frame.
fn usable(co: *mut ffi::lua_State, chain: &[*mut ffi::lua_State]) -> bool {
    if co.is_null() || chain.contains(&co) {
        return false;
    }
    let mut ar = zeroed_debug();
    // SAFETY: `co` is a thread object read from a live function's upvalue or argument slot,
    // alive while that function runs; lua_status and lua_getstack only read it.
    unsafe { ffi::lua_status(co) == ffi::LUA_OK && ffi::lua_getstack(co, 0, &mut ar) != 0 }
}
