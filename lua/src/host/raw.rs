//! Small helpers over the raw Lua API for the host's C functions.
//!
//! Every Lua-visible function of the host is a plain `lua_CFunction` written with
//! [`lua_fn!`](super::call::lua_fn): its body returns `Result<c_int, LErr>` and never raises a Lua
//! error itself (no `luaL_check*`, no `lua_error`); the wrapper turns an `Err` (or a Rust
//! panic, e.g. the fiber runtime's cancellation) into a Lua error *after* every Rust value of
//! the body is dropped, so Lua's error unwinding (a C++-style exception in LuaJIT, a longjmp in
//! Lua 5.4) crosses only the wrapper's frame, which owns nothing.
//!
//! Error texts follow Tarantool 2.6, which raises most argument errors with `luaL_error`: the
//! message gets the position of the Lua code that called the function (`file.lua:12: `) when
//! a Lua function called it directly, nothing when it was called from C (`pcall(f, ...)`) or
//! as a tail call ([`LErr::At`], what a `String` or `&str` converts to). Errors Tarantool
//! raises as error objects (`fiber is cancelled`, and every error of the functions added after
//! 2.6) carry no position ([`LErr::Plain`]).
//!
//! The Lua API calls that can raise by themselves are the allocating ones (a string, a table,
//! a userdata, a reference, a stack that must grow): `not enough memory` when the Lua heap is
//! full. LuaJIT raises with the system unwinder, which a body's frame cannot let through (the
//! wrapper's `catch_unwind` would abort the process on it). So a body makes every allocating
//! call inside [`protect`]: a protected call of its own, from which the error comes back as
//! [`LErr::Raised`], raised by the wrapper as it is, so `pcall` gets `not enough memory`.
//! What needs no protection: pushes of numbers, booleans, nil, light userdata and values that
//! exist (`lua_pushvalue`, `rawgeti`), within the `LUA_MINSTACK` slots a C function is given
//! or a successful `lua_checkstack`; `lua_xmove` into room so checked; stores into slots that
//! exist; `luaL_unref` (the registry's free-list slot is made at install).

use std::ffi::{c_int, CStr};

use mlua::ffi;

/// Pushes `t[n]` for the table `t` at `idx`, without a metamethod (`lua_rawgeti`). Under
/// LuaJIT it calls the C function directly: mlua's Lua 5.1 compatibility wrapper also asks
/// for the value's type, a second API call that every caller here throws away. A key past
/// the C function's `int` (a fiber id can be) goes through `lua_rawget`, where the wrapper
/// would panic.
///
/// # Safety
/// `l` valid, with a table at `idx` and a free stack slot.
#[inline(always)]
pub(crate) unsafe fn rawgeti(l: *mut ffi::lua_State, idx: c_int, n: ffi::lua_Integer) {
    // SAFETY: the caller's table at `idx` and free slot (the contract): a raw read; a key past
    // `int` goes through the key pushed in that slot.
    unsafe {
        #[cfg(feature = "luajit")]
        match c_int::try_from(n) {
            Ok(i) => ffi::lua_rawgeti_(l, idx, i),
            Err(_) => {
                let t = ffi::lua_absindex(l, idx);
                ffi::lua_pushinteger(l, n);
                ffi::lua_rawget(l, t);
            }
        }
        #[cfg(not(feature = "luajit"))]
        ffi::lua_rawgeti(l, idx, n);
    }
}

/// `t[n] = v` for the table `t` at `idx` and the value `v` on top, which is popped, without
/// a metamethod (`lua_rawseti`); a key past `int` under LuaJIT as in [`rawgeti`].
///
/// # Safety
/// `l` valid, with a table at `idx` and a value on top; with a free stack slot when `n`
/// is past `int` under LuaJIT.
#[inline(always)]
pub(crate) unsafe fn rawseti(l: *mut ffi::lua_State, idx: c_int, n: ffi::lua_Integer) {
    // SAFETY: the caller's table at `idx` and value on top (the contract): a raw store, which
    // pops the value; a key past `int` takes the free slot the contract gives.
    unsafe {
        #[cfg(feature = "luajit")]
        match c_int::try_from(n) {
            Ok(i) => ffi::lua_rawseti_(l, idx, i),
            Err(_) => {
                let t = ffi::lua_absindex(l, idx);
                ffi::lua_pushinteger(l, n);
                ffi::lua_insert(l, -2);
                ffi::lua_rawset(l, t);
            }
        }
        #[cfg(not(feature = "luajit"))]
        ffi::lua_rawseti(l, idx, n);
    }
}

/// A C function body's error.
#[derive(Debug)]
pub(crate) enum LErr {
    /// Raised with the calling Lua line's position in front (`luaL_error`).
    At(String),
    /// Raised as it is.
    Plain(String),
    /// The error value of a failed [`protect`] is on top of the stack: raised as it is.
    Raised,
}

impl LErr {
    /// An error raised as it is (no position).
    pub(crate) fn plain(msg: impl Into<String>) -> LErr {
        LErr::Plain(msg.into())
    }
}

impl From<String> for LErr {
    fn from(s: String) -> LErr {
        LErr::At(s)
    }
}

impl From<&str> for LErr {
    fn from(s: &str) -> LErr {
        LErr::At(s.to_string())
    }
}

/// The result of a C function body: the number of results pushed, or an error.
pub(crate) type LResult = Result<c_int, LErr>;

thread_local! {
    /// The closure of the innermost [`protect`] under way (null: none), which alone the
    /// trampoline runs.
    static PROTECTING: std::cell::Cell<*mut std::ffi::c_void> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    /// Registry reference of [`protect`]'s trampoline in this thread's host state (0: none).
    static TRAMPOLINE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
}

/// A protected call's body as the trampoline gets it.
type ProtectFn<'a> = &'a mut dyn FnMut(*mut ffi::lua_State) -> c_int;

/// The C function [`protect`] calls: runs the closure whose address is its first argument,
/// with its other arguments at 1..; returns what the closure pushed.
unsafe extern "C-unwind" fn trampoline(l: *mut ffi::lua_State) -> c_int {
    // SAFETY: reads of the first argument; a call that is not `protect`'s (the function
    // reached through its registry reference by other code) does nothing: the pointer must
    // be the one `protect` set for this call.
    let f = unsafe {
        let f = ffi::lua_touserdata(l, 1);
        if ffi::lua_type(l, 1) != ffi::LUA_TLIGHTUSERDATA || f != PROTECTING.with(|p| p.get()) {
            return 0;
        }
        ffi::lua_remove(l, 1);
        f.cast::<ProtectFn<'_>>()
    };
    // SAFETY: `protect` passed a pointer to its live `ProtectFn` (checked above).
    let n = unsafe { (*f)(l) };
    // Not a tail call: the trampoline keeps a frame of its own while the closure runs, the
    // native frame its Lua level (`? in =[C]`) is anchored at. Without it, a trace taken
    // inside (a running fiber in `fiber.info()`, at a safe point) had no anchor for that level
    // and put every Lua level above the host's frames.
    std::hint::black_box(n)
}

/// Makes [`protect`] work on the main state `l` of this thread's host (one reference in its
/// registry), and the registry's free-list slot, so that `luaL_unref` never allocates.
///
/// # Safety
/// `l` is a host's main state, running nothing, with room for 2 values.
pub(crate) unsafe fn install_protect(l: *mut ffi::lua_State) {
    // SAFETY: per the contract; pushed values are popped (luaL_ref pops its value).
    unsafe {
        ffi::lua_pushcfunction(l, trampoline);
        let r = ffi::luaL_ref(l, ffi::LUA_REGISTRYINDEX);
        TRAMPOLINE.with(|t| t.set(r));
        ffi::lua_pushboolean(l, 1);
        let tmp = ffi::luaL_ref(l, ffi::LUA_REGISTRYINDEX);
        ffi::luaL_unref(l, ffi::LUA_REGISTRYINDEX, tmp);
    }
}

/// Runs `f` on `l` in a protected call, for Lua work that can raise (allocations): `f` runs
/// in a C frame of its own, with copies of the values at `args` (indexes of the caller's
/// frame) at 1.. and nothing else; the values it pushes (it returns how many) are then
/// left on top of the caller's stack. A Lua error inside (`not enough memory`, a full stack)
/// ends it: its error value is left on top and `Err(LErr::Raised)` returned, for the body to
/// return at once. `f` must not panic nor switch fibers; its Rust values are dropped if an
/// error unwinds through it.
///
/// # Safety
/// `l` is a running Lua thread of this thread's host (or idle, made by it), and `args`
/// acceptable indexes of its current frame.
pub(crate) unsafe fn protect(
    l: *mut ffi::lua_State,
    args: &[c_int],
    f: &mut dyn FnMut(*mut ffi::lua_State) -> c_int,
) -> Result<c_int, LErr> {
    let tr = TRAMPOLINE.with(|t| t.get());
    // SAFETY: per the contract; the trampoline is a C function in this state's registry, and
    // the closure outlives the call.
    unsafe {
        if ffi::lua_checkstack(l, args.len() as c_int + 2) == 0 {
            return Err(LErr::plain("stack overflow"));
        }
        let base = ffi::lua_gettop(l);
        let abs: [c_int; 4] = std::array::from_fn(|i| {
            args.get(i).map_or(0, |&a| {
                if a < 0 && a > ffi::LUA_REGISTRYINDEX {
                    base + 1 + a
                } else {
                    a
                }
            })
        });
        if tr != 0 {
            rawgeti(l, ffi::LUA_REGISTRYINDEX, tr as ffi::lua_Integer);
            // A script reaches the registry (`debug.getregistry()`): what is there is called
            // only if it is still the trampoline, else a fresh one is (an allocation: such a
            // script pays for it at each protected call; so would a build whose code units
            // gave the function two addresses: never a wrong call, only a slower one).
            let ours = ffi::lua_tocfunction(l, -1)
                .is_some_and(|f| std::ptr::fn_addr_eq(f, trampoline as ffi::lua_CFunction));
            if !ours {
                ffi::lua_settop(l, -2);
                ffi::lua_pushcfunction(l, trampoline);
            }
        } else {
            ffi::lua_pushcfunction(l, trampoline);
        }
        let mut f: ProtectFn<'_> = f;
        let fp: *mut std::ffi::c_void = (&mut f as *mut ProtectFn<'_>).cast();
        ffi::lua_pushlightuserdata(l, fp);
        for &a in &abs[..args.len().min(4)] {
            ffi::lua_pushvalue(l, a);
        }
        // The innermost protect's closure is the one the trampoline runs; the outer one is
        // back once this returns (also when an error ends it).
        let outer = PROTECTING.with(|p| p.replace(fp));
        let st = ffi::lua_pcall(l, args.len().min(4) as c_int + 1, ffi::LUA_MULTRET, 0);
        PROTECTING.with(|p| p.set(outer));
        if st != ffi::LUA_OK {
            return Err(LErr::Raised);
        }
        Ok(ffi::lua_gettop(l) - base)
    }
}

/// The type name of the value at `idx`, as `luaL_typename` (`no value` past the top).
///
/// # Safety
/// `l` valid.
pub(crate) unsafe fn type_name(l: *mut ffi::lua_State, idx: c_int) -> String {
    // SAFETY: per the contract; lua_typename returns a static NUL-terminated name.
    unsafe {
        let t = if idx > ffi::lua_gettop(l) {
            ffi::LUA_TNONE
        } else {
            ffi::lua_type(l, idx)
        };
        CStr::from_ptr(ffi::lua_typename(l, t))
            .to_string_lossy()
            .into_owned()
    }
}

/// The error of a bad argument `narg` of the running C function, worded as LuaJIT's
/// `luaL_argerror` words it: `bad argument #1 to 'name' (msg)` — the name as the caller
/// called it, `?` when not known (called from C) — or, for the object of a method call,
/// `calling 'name' on bad self (msg)`; with the caller's position (see [`LErr::At`]).
///
/// # Safety
/// `l` is the calling state of a C function.
pub(crate) unsafe fn arg_error(l: *mut ffi::lua_State, narg: c_int, msg: &str) -> LErr {
    // SAFETY: a zeroed lua_Debug is a valid out-parameter; level 0 is the running function.
    let (name, method) = unsafe {
        let mut ar: ffi::lua_Debug = std::mem::zeroed();
        if ffi::lua_getstack(l, 0, &mut ar) != 0 && ffi::lua_getinfo(l, c"n".as_ptr(), &mut ar) != 0
        {
            let name = (!ar.name.is_null())
                .then(|| CStr::from_ptr(ar.name).to_string_lossy().into_owned());
            let method = !ar.namewhat.is_null() && CStr::from_ptr(ar.namewhat) == c"method";
            (name, method)
        } else {
            (None, false)
        }
    };
    let name = name.unwrap_or_else(|| "?".to_string());
    if method && narg == 1 {
        LErr::At(format!("calling '{name}' on bad self ({msg})"))
    } else {
        let narg = if method { narg - 1 } else { narg };
        LErr::At(format!("bad argument #{narg} to '{name}' ({msg})"))
    }
}

/// The error of argument `narg` not being a `what` (`luaL_checkudata`'s).
///
/// # Safety
/// `l` is the calling state of a C function.
pub(crate) unsafe fn type_error(l: *mut ffi::lua_State, narg: c_int, what: &str) -> LErr {
    // SAFETY: `l` is a C function's calling state (the contract): the type name is a read,
    // the debug query of `arg_error` reads the call's own frame.
    unsafe {
        let got = type_name(l, narg);
        arg_error(l, narg, &format!("{what} expected, got {got}"))
    }
}

/// Pushes a Rust string: its bytes, except that a fiber name's bytes that are not UTF-8 (kept
/// as private-use code points, see [`fibertrace_fiber::embed::name_from_bytes`]) are given
/// back as they were, wherever the text shows the name.
///
/// # Safety
/// `l` is a valid state with room for one value; allocates (see [`protect`]).
pub(crate) unsafe fn push_str(l: *mut ffi::lua_State, s: &str) {
    let b = fibertrace_fiber::embed::name_to_bytes(s);
    // SAFETY: the pointer and length describe `b`; Lua copies the bytes.
    unsafe { ffi::lua_pushlstring(l, b.as_ptr().cast(), b.len()) };
}

/// Sets `t[k] = v` for the value on top (popped) on the table at `idx` (a fresh table with no
/// metatable, so no metamethod runs).
///
/// # Safety
/// `idx` is an absolute index of a table without a metatable; a value is on top.
pub(crate) unsafe fn set_field(l: *mut ffi::lua_State, idx: c_int, k: &CStr) {
    // SAFETY: a table without metatable at the absolute index `idx` and a value on top (the
    // contract): the store pops the value and runs no metamethod.
    unsafe { ffi::lua_setfield(l, idx, k.as_ptr()) };
}

/// The type of the value at `idx`.
///
/// # Safety
/// `l` is valid.
pub(crate) unsafe fn type_of(l: *mut ffi::lua_State, idx: c_int) -> c_int {
    // SAFETY: `l` valid (the contract); lua_type reads any acceptable index.
    unsafe { ffi::lua_type(l, idx) }
}

/// A non-negative number of seconds as a timeout (`None`: forever, for NaN and from
/// Tarantool's `TIMEOUT_INFINITY` on, 100 years; `Duration::from_secs_f64` would panic past
/// its range). Below it, a timer: a fiber that sleeps a billion seconds is not "asleep
/// forever" to the deadlock report (it was, from a billion on). A positive timeout below a
/// nanosecond is one nanosecond, not zero: it waits once, as any positive timeout does in
/// Tarantool (`ch:put(v, 1e-12)` failed at once, before a receiver could come).
pub(crate) fn seconds(s: f64) -> Option<std::time::Duration> {
    if s.is_nan() || s >= crate::host::Slice::INFINITE {
        None
    } else {
        let d = std::time::Duration::from_secs_f64(s.max(0.0));
        Some(if s > 0.0 && d.is_zero() {
            std::time::Duration::from_nanos(1)
        } else {
            d
        })
    }
}

/// A readable description of an error value, as [`error_bytes`] (bytes that are not UTF-8
/// replaced).
///
/// # Safety
/// As [`error_bytes`].
pub(crate) unsafe fn error_text(l: *mut ffi::lua_State, idx: c_int) -> String {
    // SAFETY: `l` and `idx` as error_bytes requires (this function's contract is its own).
    let b = unsafe { error_bytes(l, idx) };
    match String::from_utf8(b) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}

/// An error value as `lua` shows it, as bytes: a string as it is, a number as Lua writes it,
/// a value whose metatable has `__tostring` as the string that returns (Lua code, run in a
/// protected call here), anything else (or a `__tostring` that fails or returns no string)
/// `(error object is a T value)`.
///
/// # Safety
/// `l` is a Lua thread of this thread's host, running or idle, and `idx` an acceptable index
/// of its current frame.
pub(crate) unsafe fn error_bytes(l: *mut ffi::lua_State, idx: c_int) -> Vec<u8> {
    // SAFETY: an acceptable index of a valid state (the contract); a read.
    let t = unsafe { type_of(l, idx) };
    if t == ffi::LUA_TSTRING {
        // SAFETY: a string at an acceptable index: its bytes are read and copied.
        return unsafe { to_bytes(l, idx) }.unwrap_or_default();
    }
    if t == ffi::LUA_TNUMBER {
        // As Lua writes it, without converting it in place (an allocation).
        #[cfg(not(feature = "luajit"))]
        // SAFETY: a number at an acceptable index; a read.
        if unsafe { ffi::lua_isinteger(l, idx) } != 0 {
            // SAFETY: an integer at an acceptable index; a read.
            return unsafe { ffi::lua_tointeger(l, idx) }
                .to_string()
                .into_bytes();
        }
        // SAFETY: a number at an acceptable index; lua_tonumber reads it (no conversion).
        return number_text(unsafe { ffi::lua_tonumber(l, idx) }).into_bytes();
    }
    if t != ffi::LUA_TNONE {
        // SAFETY: per the contract; the metamethod runs in a protected call whose results
        // are read and popped here.
        unsafe {
            if ffi::lua_checkstack(l, 4) != 0 {
                let r = protect(l, &[idx], &mut |l| {
                    if ffi::luaL_getmetafield(l, 1, c"__tostring".as_ptr()) == 0 {
                        return 0;
                    }
                    ffi::lua_pushvalue(l, 1);
                    ffi::lua_call(l, 1, 1);
                    1
                });
                match r {
                    Ok(n) => {
                        let b = (n == 1 && type_of(l, -1) == ffi::LUA_TSTRING)
                            .then(|| to_bytes(l, -1))
                            .flatten();
                        ffi::lua_settop(l, -(n + 1));
                        if let Some(b) = b {
                            return b;
                        }
                    }
                    Err(_) => ffi::lua_settop(l, -2),
                }
            }
        }
    }
    // SAFETY: lua_typename returns a static NUL-terminated name.
    let name = unsafe { CStr::from_ptr(ffi::lua_typename(l, t)) };
    format!("(error object is a {} value)", name.to_string_lossy()).into_bytes()
}

/// The bytes of the string (or number) at `idx`.
///
/// # Safety
/// `l` is valid and `idx` an acceptable index.
pub(crate) unsafe fn to_bytes(l: *mut ffi::lua_State, idx: c_int) -> Option<Vec<u8>> {
    let mut len = 0usize;
    // SAFETY: lua_tolstring returns null or a pointer to `len` bytes owned by the value.
    let p = unsafe { ffi::lua_tolstring(l, idx, &mut len) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` points at `len` bytes owned by the value (lua_tolstring's result, not
    // null); they are copied before any other Lua call.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec())
}

/// A number as Lua writes it (`%.14g`).
fn number_text(n: f64) -> String {
    let mut buf = [0u8; 64];
    // SAFETY: the buffer and its length are given; the format takes one double.
    let len = unsafe { libc::snprintf(buf.as_mut_ptr().cast(), buf.len(), c"%.14g".as_ptr(), n) };
    String::from_utf8_lossy(&buf[..(len.max(0) as usize).min(buf.len() - 1)]).into_owned()
}

#[cfg(test)]
mod index_tests {
    use super::*;

    /// Keys inside and past `int` (a fiber id can be past it) store and load alike.
    #[test]
    fn raw_integer_keys_inside_and_past_int() {
        // SAFETY: a fresh state of our own, closed at the end; every push has room (the
        // stack starts with LUA_MINSTACK free slots and holds at most three values here).
        unsafe {
            let l = ffi::luaL_newstate();
            assert!(!l.is_null());
            ffi::lua_createtable(l, 0, 0);
            let keys: [ffi::lua_Integer; 4] = [1, 7, 1 << 31, (1 << 40) + 3];
            for (i, &k) in keys.iter().enumerate() {
                ffi::lua_pushinteger(l, 100 + i as ffi::lua_Integer);
                rawseti(l, 1, k);
            }
            assert_eq!(ffi::lua_gettop(l), 1);
            for (i, &k) in keys.iter().enumerate() {
                rawgeti(l, -1, k);
                assert_eq!(
                    ffi::lua_tointeger(l, -1),
                    100 + i as ffi::lua_Integer,
                    "{k}"
                );
                ffi::lua_settop(l, 1);
            }
            rawgeti(l, 1, 1 << 33);
            assert_eq!(ffi::lua_type(l, -1), ffi::LUA_TNIL);
            ffi::lua_close(l);
        }
    }
}
