//! The safe layer over the Lua C API that the bodies of the host's C functions use.
//!
//! A body written with [`lua_fn!`](lua_fn) is a safe `fn(&mut Call) -> LResult`:
//! [`Call`] is the calling Lua state of one C function call, made once by the wrapper — the
//! one place that trusts Lua's call (a valid thread of this thread's host whose current frame
//! is the function's). Each method is a Lua API call (or a few) with one `unsafe` block and
//! its own reason, and holds whatever the call needs by checking it, not by trusting the body:
//!
//! * **indexes** are checked against the frame: a read past the top reads as no value, an
//!   index that names no value is refused (pseudo-indexes are not taken at all);
//! * **pushes** ask for their room first (`lua_checkstack`, which never raises) and fail with
//!   `stack overflow`;
//! * **reads never change a value**: a string's bytes only from a string (`lua_tolstring` on
//!   a number would convert it in place, an allocation); `lua_tonumberx` reads;
//! * **table access is raw** (no metamethod, so no Lua code of the user runs inside a body
//!   unless the body calls it), and only on a value checked to be a table;
//! * **whatever allocates** (strings, tables, userdata, registry references) runs inside
//!   [`Call::protected`]: a protected call whose closure gets a [`Protected`], where a Lua
//!   error (`not enough memory`, a full stack, a check that fails) unwinds to the protected
//!   call and comes back as [`LErr::Raised`], its value on top, for the body to return;
//! * **userdata blocks** are read through [`UdBlock`], which binds a Rust type to its
//!   metatable: a block is recognised by that metatable, written before the metatable is set,
//!   and what a body gets from it is a clone ([`UdBlock::handle`]), never a reference, so
//!   nothing a body holds (across a fiber switch, say) points into a block that `__gc` (or a
//!   script calling `__gc` itself) may empty.
//!
//! Methods that change the stack take `&mut self`, reads `&self`. The modules that work below
//! this layer (a fiber's Lua thread, hooks, the debug API: `spawn`, `info`, `finalize`,
//! `cstack`) get the raw state from [`Call::state`] and keep their own `unsafe`, one reason
//! each.
//!
//! How a result can be wrong: a body that reads an index past the top gets "no value", as Lua
//! functions do; a push that finds no room fails the call with `stack overflow` rather than
//! growing the stack past Lua's limit.

use std::ffi::{c_int, CStr};
use std::time::Duration;

use mlua::ffi;

use super::raw::{self, protect, push_str, LErr};

/// The registry pseudo-index.
const REG: c_int = ffi::LUA_REGISTRYINDEX;

/// Pushes the message of `e` on `l` (with the caller's position for [`LErr::At`]), for the
/// wrapper of [`lua_fn!`](lua_fn) to raise. The call's values are dropped first (raising
/// discards the frame anyway), so the message has room even when the body failed on a full
/// stack; an error value already on top ([`LErr::Raised`]) is left as it is.
///
/// # Safety
/// `l` is the calling state of a C function.
#[inline(never)]
pub(crate) unsafe fn push_error(l: *mut ffi::lua_State, e: LErr) {
    // SAFETY: per the contract; the top is only lowered (to 0, leaving at least the
    // `LUA_MINSTACK` slots the call was given); the message is made in a protected call (its
    // allocation can fail), whose error value is then the one raised.
    unsafe {
        if matches!(e, LErr::Raised) && ffi::lua_gettop(l) > 0 {
            return;
        }
        ffi::lua_settop(l, 0);
        let mut e = Some(e);
        let _ = protect(l, &[], &mut |l| {
            match e.take() {
                Some(LErr::At(msg)) => {
                    // Level 0 is the trampoline, 1 the C function, 2 its caller.
                    ffi::luaL_where(l, 2);
                    push_str(l, &msg);
                    ffi::lua_concat(l, 2);
                }
                Some(LErr::Plain(msg)) => push_str(l, &msg),
                _ => ffi::lua_pushnil(l),
            }
            1
        });
    }
}

/// Defines a `lua_CFunction` named `$name` from a safe body `fn(&mut Call) -> LResult`.
macro_rules! lua_fn {
    ($name:ident, $body:path) => {
        pub(crate) unsafe extern "C-unwind" fn $name(
            l: *mut mlua::ffi::lua_State,
        ) -> std::ffi::c_int {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: Lua calls this function as a C function: `l` is its calling state,
                // a thread of this thread's host (only the host registers these functions),
                // and the `Call` lives in this closure, inside the call.
                let mut c = unsafe { $crate::host::call::Call::new(l) };
                $body(&mut c)
            }));
            match r {
                // A count past the values there would make Lua read outside the frame.
                // SAFETY: `l` is the calling state; lua_gettop reads its frame.
                Ok(Ok(n)) => n.clamp(0, unsafe { mlua::ffi::lua_gettop(l) }),
                Ok(Err(e)) => {
                    // SAFETY: `l` is the calling state; the message is pushed (and the error
                    // dropped) before it is raised, with nothing owned by this frame alive.
                    unsafe { $crate::host::call::push_error(l, e) };
                    // SAFETY: raising from the C function Lua called is how Lua errors are made;
                    // the message is on top and nothing this frame owns is alive.
                    unsafe { mlua::ffi::lua_error(l) }
                }
                Err(payload) => {
                    drop(payload);
                    let msg = if fibertrace_fiber::is_cancelled() {
                        // The unwinding ends here, as a Lua error: the next yield of this
                        // fiber raises it again.
                        fibertrace_fiber::cancellation_caught();
                        "fiber is cancelled"
                    } else {
                        "fibertrace: internal error (Rust panic)"
                    };
                    // SAFETY: `l` is the calling state; the message is pushed in a protected
                    // call.
                    unsafe {
                        $crate::host::call::push_error(l, $crate::host::raw::LErr::plain(msg))
                    };
                    // SAFETY: raising from the C function Lua called, with the message on top
                    // and the panic payload dropped.
                    unsafe { mlua::ffi::lua_error(l) }
                }
            }
        }
    };
}
pub(crate) use lua_fn;

/// The calling Lua state of one C function call (see the module docs).
pub(crate) struct Call {
    l: *mut ffi::lua_State,
}

/// A userdata block type of the host, bound to its metatable and its tag.
///
/// A block's first 8 bytes are a word that tells its type ([`UdBlock::is_tag`]). The
/// metatable alone does not tell a block's type: a script can move any metatable onto any
/// userdata (`debug.setmetatable`), a channel's onto a condition or a fiber object, and the
/// methods would then read one block as the other (a fiber's id taken for a channel pointer:
/// a crash). A block is taken for a `Self` only when its metatable is `Self`'s, it is large
/// enough, and its first word is `Self`'s tag ([`tagged_body`]).
///
/// # Safety
/// `Self` is `#[repr(C)]`, at least 8 bytes, 8-aligned at most, and its first 8 bytes are a
/// `u64` for which `is_tag` holds in every value of `Self`; `is_tag` holds for no first word
/// of another host block type, nor for any address (its top 16 bits are neither all 0 nor
/// all 1: another library's userdata that starts with a pointer is no `Self`). The table
/// [`UdBlock::metatable`] names (by its registry reference, and by its identity,
/// `lua_topointer`, which stays the table's while the reference anchors it) is set as the
/// metatable only of userdata whose block is an initialised `Self` (written before the
/// metatable is set, by [`Protected::new_ud`] or by code that keeps the same order).
pub(crate) unsafe trait UdBlock: Sized {
    /// Whether `word`, a block's first 8 bytes, is this type's tag.
    fn is_tag(word: u64) -> bool;
    /// What a body gets from a block: a clone of what it holds.
    type Handle;
    /// The registry reference and the identity of this type's metatable in this thread's
    /// host (`None`: no host).
    fn metatable() -> Option<(c_int, usize)>;
    /// A handle to what the block holds, `None` once it is released.
    fn handle(&self) -> Option<Self::Handle>;
    /// Releases what the block holds (its `__gc`; a second call does nothing).
    fn release(&mut self);
}

/// The `T` in the userdata at stack index `i` of `l` if its block is a `T`'s: it is a full
/// userdata at least that large whose first word is `T`'s tag. Its metatable is the
/// caller's to check (that `T`'s metatable is set only on initialised blocks is what makes
/// the tag's word initialised for a block of `T`'s, and any block's first word is readable
/// once its size is checked).
///
/// # Safety
/// `i` is a valid index of `l`, a state of this thread's host. Allocates nothing, runs no Lua.
#[inline]
pub(crate) unsafe fn tagged_body<T: UdBlock>(l: *mut ffi::lua_State, i: c_int) -> Option<*mut T> {
    // (No `lua_type` call: a create pays for each call here.) lua_touserdata is null but for
    // a full or light userdata, and a light one's `lua_rawlen` is 0 (LuaJIT and Lua 5.4 count
    // only strings, tables and full userdata).
    // SAFETY: per the contract; so `p` is a full userdata's block, of `lua_rawlen` bytes and
    // Lua's alignment (8; `T` needs no more, `UdBlock`'s contract), and its first 8 bytes
    // (`T` has at least 8) are in it once the size is checked.
    unsafe {
        let p = ffi::lua_touserdata(l, i).cast::<T>();
        if p.is_null() || ffi::lua_rawlen(l, i) < std::mem::size_of::<T>() {
            return None;
        }
        T::is_tag(p.cast::<u64>().read()).then_some(p)
    }
}

impl Call {
    /// The call of a C function on `l`.
    ///
    /// # Safety
    /// `l` is the calling state of a running C function of this thread's host (Lua called it:
    /// a valid thread whose current frame is the function's), and the value lives no longer
    /// than that call.
    pub(crate) unsafe fn new(l: *mut ffi::lua_State) -> Call {
        Call { l }
    }

    /// The raw state, for the modules below this layer (see the module docs). Using it is
    /// `unsafe`; the pointer is valid for the call.
    pub(crate) fn state(&self) -> *mut ffi::lua_State {
        self.l
    }

    /// The number of values in the call's frame (its arguments, at first).
    pub(crate) fn top(&self) -> c_int {
        // SAFETY: `l` is the running call's state (`Call::new`); lua_gettop only reads its
        // frame.
        unsafe { ffi::lua_gettop(self.l) }
    }

    /// `idx` as the absolute index of a value of the frame (`1..=top`), if it names one.
    fn slot(&self, idx: c_int) -> Option<c_int> {
        let top = self.top();
        if idx > 0 && idx <= top {
            Some(idx)
        } else if idx < 0 && idx >= -top {
            Some(top + 1 + idx)
        } else {
            None
        }
    }

    /// Room for `n` more values, or `stack overflow`.
    fn room(&self, n: c_int) -> Result<(), LErr> {
        // SAFETY: the running call's state; lua_checkstack never raises (it reports a stack
        // at Lua's limit or a failed growth as 0), in LuaJIT 2.1 and Lua 5.4 alike.
        if unsafe { ffi::lua_checkstack(self.l, n) } == 0 {
            Err(LErr::plain("stack overflow"))
        } else {
            Ok(())
        }
    }

    /// The type of the value at `idx` (`LUA_TNONE` past the top).
    pub(crate) fn type_of(&self, idx: c_int) -> c_int {
        match self.slot(idx) {
            // SAFETY: the running call's state and a slot of its frame; lua_type reads.
            Some(i) => unsafe { ffi::lua_type(self.l, i) },
            None => ffi::LUA_TNONE,
        }
    }

    /// The name of the type of the value at `idx` (`no value` past the top).
    pub(crate) fn type_name(&self, idx: c_int) -> String {
        // SAFETY: lua_typename of a type tag (LUA_TNONE included) is a static string.
        unsafe { std::ffi::CStr::from_ptr(ffi::lua_typename(self.l, self.type_of(idx))) }
            .to_string_lossy()
            .into_owned()
    }

    /// The first key of the table at `idx` that is not one of `allowed` (a string key
    /// quoted, another as `a TYPE key`), if any; the table's metamethods are not called.
    pub(crate) fn key_not_in(
        &mut self,
        idx: c_int,
        allowed: &[&str],
    ) -> Result<Option<String>, LErr> {
        let Some(t) = self
            .slot(idx)
            .filter(|_| self.type_of(idx) == ffi::LUA_TTABLE)
        else {
            return Ok(None);
        };
        self.room(3)?;
        let l = self.l;
        let mut bad = None;
        // SAFETY: `t` is a table slot of the running call's frame; `lua_next` from nil walks
        // it raw (a string key is only read, never converted in place, so the walk stays
        // valid); room for the key and value was made; the stack is left as it was.
        unsafe {
            ffi::lua_pushnil(l);
            while ffi::lua_next(l, t) != 0 {
                let key = if ffi::lua_type(l, -2) == ffi::LUA_TSTRING {
                    let mut n = 0;
                    let p = ffi::lua_tolstring(l, -2, &mut n);
                    let k = std::slice::from_raw_parts(p.cast::<u8>(), n);
                    (!allowed.iter().any(|a| a.as_bytes() == k))
                        .then(|| format!("{:?}", String::from_utf8_lossy(k)))
                } else {
                    let name = std::ffi::CStr::from_ptr(ffi::lua_typename(l, ffi::lua_type(l, -2)));
                    Some(format!("a {} key", name.to_string_lossy()))
                };
                ffi::lua_settop(l, -2);
                if key.is_some() {
                    ffi::lua_settop(l, -2);
                    bad = key;
                    break;
                }
            }
        }
        Ok(bad)
    }

    /// Whether the value at `idx` is nil or absent.
    pub(crate) fn is_none_or_nil(&self, idx: c_int) -> bool {
        self.type_of(idx) <= ffi::LUA_TNIL
    }

    /// The number at `idx`, if it is a number or a numeric string (the string is not
    /// changed).
    pub(crate) fn to_number(&self, idx: c_int) -> Option<f64> {
        let i = self.slot(idx)?;
        let mut ok: c_int = 0;
        // SAFETY: a slot of the running call's frame; lua_tonumberx converts a copy of the
        // value, never the value itself, and writes `ok`.
        let v = unsafe { ffi::lua_tonumberx(self.l, i, &mut ok) };
        (ok != 0).then_some(v)
    }

    /// The value at `idx` as a condition (nil, false and no value are false).
    pub(crate) fn to_boolean(&self, idx: c_int) -> bool {
        // SAFETY: a slot of the running call's frame; lua_toboolean reads.
        self.slot(idx)
            .is_some_and(|i| unsafe { ffi::lua_toboolean(self.l, i) } != 0)
    }

    /// The bytes of the string at `idx` (a string only: a number is not converted).
    pub(crate) fn string_bytes(&self, idx: c_int) -> Option<Vec<u8>> {
        if self.type_of(idx) != ffi::LUA_TSTRING {
            return None;
        }
        let i = self.slot(idx)?;
        let mut len = 0usize;
        // SAFETY: a string in a slot of the running call's frame: lua_tolstring returns its
        // bytes without a conversion (no allocation); they are copied before any other call.
        unsafe {
            let p = ffi::lua_tolstring(self.l, i, &mut len);
            (!p.is_null()).then(|| std::slice::from_raw_parts(p.cast::<u8>(), len).to_vec())
        }
    }

    /// Whether the value at `idx` is the string `s`.
    pub(crate) fn is_string(&self, idx: c_int, s: &[u8]) -> bool {
        if self.type_of(idx) != ffi::LUA_TSTRING {
            return false;
        }
        let Some(i) = self.slot(idx) else {
            return false;
        };
        let mut len = 0usize;
        // SAFETY: as in `string_bytes`; the bytes are compared before any other call.
        unsafe {
            let p = ffi::lua_tolstring(self.l, i, &mut len);
            !p.is_null() && std::slice::from_raw_parts(p.cast::<u8>(), len) == s
        }
    }

    /// The value at `idx` as `lua` shows an error value (see [`raw::error_bytes`]): a string
    /// as it is, a number as Lua writes it, a `__tostring` result (Lua code runs: `&mut`).
    pub(crate) fn value_bytes(&mut self, idx: c_int) -> Vec<u8> {
        let Some(i) = self.slot(idx) else {
            return b"(error object is a no value value)".to_vec();
        };
        // SAFETY: a slot of the running call's frame, on a thread of this host;
        // error_bytes runs the metamethod in a protected call and leaves the stack as it was.
        unsafe { raw::error_bytes(self.l, i) }
    }

    /// The error of argument `narg` not being a `what` (see [`raw::type_error`]).
    pub(crate) fn type_error(&self, narg: c_int, what: &str) -> LErr {
        // SAFETY: as in `arg_error`; the type name of a slot past the top is `no value`.
        unsafe { raw::type_error(self.l, narg, what) }
    }

    /// An optional timeout argument in seconds, as Tarantool's channel and condition methods
    /// read it: absent or nil is no timeout; a number or a numeric string is taken (NaN and
    /// anything past a billion seconds wait forever, zero or less than a nanosecond does not
    /// wait); a negative number or anything else is `usage` (with the caller's position).
    pub(crate) fn opt_timeout(&self, idx: c_int, usage: &str) -> Result<Option<Duration>, LErr> {
        if self.is_none_or_nil(idx) {
            return Ok(None);
        }
        match self.to_number(idx) {
            Some(s) if s.is_nan() => Ok(None),
            Some(s) if s < 0.0 => Err(LErr::At(usage.to_string())),
            Some(s) => Ok(raw::seconds(s)),
            None => Err(LErr::At(usage.to_string())),
        }
    }

    /// The handle of the `T` block of the userdata at `idx`: `None` if it is no `T` (no
    /// userdata, another metatable), `Some(None)` if its block was released.
    pub(crate) fn ud<T: UdBlock>(&self, idx: c_int) -> Option<Option<T::Handle>> {
        let p = self.ud_block::<T>(idx)?;
        // SAFETY: `p` is an initialised `T` (`UdBlock`'s contract), alive while the value is
        // in the frame; only a shared reference exists while `handle` runs (which makes no
        // Lua call, so no `__gc` can run meanwhile), and none outlives this line.
        Some(unsafe { (*p).handle() })
    }

    /// Releases the `T` block of the userdata at `idx` (its `__gc`); whether it was a `T`.
    pub(crate) fn ud_release<T: UdBlock>(&mut self, idx: c_int) -> bool {
        let Some(p) = self.ud_block::<T>(idx) else {
            return false;
        };
        // SAFETY: as in `ud`; no other reference into the block exists (`ud` lends none),
        // and `release` makes no Lua call.
        unsafe { (*p).release() };
        true
    }

    /// The `T` in the userdata at `idx` if its metatable is `T`'s and its block a `T`'s.
    fn ud_block<T: UdBlock>(&self, idx: c_int) -> Option<*mut T> {
        let i = self.slot(idx)?;
        let (_, mt) = T::metatable()?;
        self.room(1).ok()?;
        // SAFETY: a slot of the running call's frame, with room for the value's metatable,
        // pushed and popped; the metatable is compared by identity with T's (a read). A
        // script can put T's metatable on another userdata (`debug.setmetatable`):
        // `tagged_body` takes the block only with T's size and tag.
        unsafe {
            if ffi::lua_type(self.l, i) != ffi::LUA_TUSERDATA
                || ffi::lua_getmetatable(self.l, i) == 0
            {
                return None;
            }
            let same = ffi::lua_topointer(self.l, -1) as usize == mt;
            ffi::lua_settop(self.l, -2);
            if !same {
                return None;
            }
            tagged_body::<T>(self.l, i)
        }
    }

    /// Pushes a boolean.
    pub(crate) fn push_bool(&mut self, b: bool) -> Result<(), LErr> {
        self.room(1)?;
        // SAFETY: the running call's state, with room checked; a boolean allocates nothing.
        unsafe { ffi::lua_pushboolean(self.l, b as c_int) };
        Ok(())
    }

    /// Pushes an integer (a number under LuaJIT).
    pub(crate) fn push_int(&mut self, n: i64) -> Result<(), LErr> {
        self.room(1)?;
        // SAFETY: as in `push_bool`; a number allocates nothing.
        unsafe { ffi::lua_pushinteger(self.l, n as ffi::lua_Integer) };
        Ok(())
    }

    /// Pushes nil.
    pub(crate) fn push_nil(&mut self) -> Result<(), LErr> {
        self.room(1)?;
        // SAFETY: as in `push_bool`.
        unsafe { ffi::lua_pushnil(self.l) };
        Ok(())
    }

    /// Pushes a copy of the value at `idx` (nil if there is none).
    pub(crate) fn push_value(&mut self, idx: c_int) -> Result<(), LErr> {
        let Some(i) = self.slot(idx) else {
            return self.push_nil();
        };
        self.room(1)?;
        // SAFETY: a slot of the frame and room checked; a copy of a value allocates nothing.
        unsafe { ffi::lua_pushvalue(self.l, i) };
        Ok(())
    }

    /// Pushes the registry's value at the reference `r` (nil if there is none).
    pub(crate) fn push_ref(&mut self, r: c_int) -> Result<(), LErr> {
        self.room(1)?;
        // SAFETY: room checked; a raw read of the registry (a table) at any key is defined.
        unsafe { raw::rawgeti(self.l, REG, r as ffi::lua_Integer) };
        Ok(())
    }

    /// Pushes `registry[r][n]` (raw): an element of a host table held by reference; nil if
    /// `registry[r]` is no table. (One room check and no index check: the fast path of
    /// `fiber.self()`.)
    pub(crate) fn push_ref_index(&mut self, r: c_int, n: i64) -> Result<(), LErr> {
        self.room(2)?;
        // SAFETY: room for the table and the element (and a key past `int`, under LuaJIT,
        // in the slot the element takes); raw reads of the registry and of a table checked
        // to be one; the table is removed from under the element, or popped.
        unsafe {
            raw::rawgeti(self.l, REG, r as ffi::lua_Integer);
            if ffi::lua_type(self.l, -1) == ffi::LUA_TTABLE {
                raw::rawgeti(self.l, -1, n as ffi::lua_Integer);
                ffi::lua_remove(self.l, -2);
            } else {
                ffi::lua_settop(self.l, -2);
                ffi::lua_pushnil(self.l);
            }
        }
        Ok(())
    }

    /// Pushes `t[key]` (raw) for the table at `t`; nil if `t` is no table. The key is made in
    /// a protected call.
    pub(crate) fn push_field(&mut self, t: c_int, key: &str) -> Result<(), LErr> {
        if self.type_of(t) != ffi::LUA_TTABLE {
            return self.push_nil();
        }
        self.protected(&[t], |p| {
            p.push_str(key);
            p.raw_get(1);
            1
        })
        .map(|_| ())
    }

    /// Pushes `u[k]` (raw) for the value `k` at `key` and the table `u` that is the running C
    /// function's upvalue `n`; nil if that upvalue is no table.
    pub(crate) fn push_upvalue_field(&mut self, n: c_int, key: c_int) -> Result<(), LErr> {
        let u = ffi::lua_upvalueindex(n);
        // SAFETY: the running C function's upvalue index: lua_type reads it (an index past
        // its upvalues reads as nil under LuaJIT and as no value under Lua 5.4).
        if !(1..=255).contains(&n) || unsafe { ffi::lua_type(self.l, u) } != ffi::LUA_TTABLE {
            return self.push_nil();
        }
        self.push_value(key)?;
        // SAFETY: a table (checked) and the key on top (pushed above); a raw read replaces
        // the key with the value.
        unsafe { ffi::lua_rawget(self.l, u) };
        Ok(())
    }

    /// Pushes a Rust string (made in a protected call).
    pub(crate) fn push_str(&mut self, s: &str) -> Result<(), LErr> {
        self.protected(&[], |p| {
            p.push_str(s);
            1
        })
        .map(|_| ())
    }

    /// Pushes bytes as a Lua string (made in a protected call).
    pub(crate) fn push_bytes(&mut self, b: &[u8]) -> Result<(), LErr> {
        self.protected(&[], |p| {
            p.push_bytes(b);
            1
        })
        .map(|_| ())
    }

    /// Pops `n` values (at most every value of the frame).
    pub(crate) fn pop(&mut self, n: c_int) {
        let n = n.clamp(0, self.top());
        // SAFETY: the running call's state; a top lowered by at most its values.
        unsafe { ffi::lua_settop(self.l, -n - 1) };
    }

    /// Removes the value at `idx` (if there is one), shifting those above it down.
    pub(crate) fn remove(&mut self, idx: c_int) {
        if let Some(i) = self.slot(idx) {
            // SAFETY: a slot of the frame.
            unsafe { ffi::lua_remove(self.l, i) };
        }
    }

    /// Sets the table at the registry reference `mt` as the metatable of the value at `idx`.
    pub(crate) fn set_metatable_ref(&mut self, idx: c_int, mt: c_int) -> Result<(), LErr> {
        let Some(i) = self.slot(idx) else {
            return Err(LErr::plain("fibertrace: no value to set a metatable on"));
        };
        // Tables only: a userdata's metatable is its type (`UdBlock`), set only by `new_ud`.
        if self.type_of(i) != ffi::LUA_TTABLE {
            return Err(LErr::plain("fibertrace: a metatable is set on tables only"));
        }
        self.push_ref(mt)?;
        if self.type_of(-1) != ffi::LUA_TTABLE {
            self.pop(1);
            return Err(LErr::plain("fibertrace: metatable missing"));
        }
        // SAFETY: a slot of the frame and a table on top (checked): lua_setmetatable pops it
        // and allocates nothing.
        unsafe { ffi::lua_setmetatable(self.l, i) };
        Ok(())
    }

    /// Anchors a copy of the value at `idx` in the registry (a protected call: the registry
    /// may grow); its reference.
    pub(crate) fn ref_value(&mut self, idx: c_int) -> Result<c_int, LErr> {
        let mut r = ffi::LUA_REFNIL;
        self.protected(&[idx], |p| {
            r = p.ref_top();
            0
        })?;
        Ok(r)
    }

    /// Runs `f` in a protected call (see [`raw::protect`]): it gets copies of the values at
    /// `args` (at most 4; an index that names no value is refused) at 1.. and returns how many
    /// of the values on its stack are results (the top ones; clamped to what is there); the
    /// results are left on this frame's top and their count returned. A Lua error inside ends
    /// it: the error value is left on top and [`LErr::Raised`] returned.
    pub(crate) fn protected(
        &mut self,
        args: &[c_int],
        mut f: impl FnMut(&mut Protected) -> c_int,
    ) -> Result<c_int, LErr> {
        let mut abs = [0; 4];
        if args.len() > abs.len() {
            return Err(LErr::plain(
                "fibertrace: too many arguments to a protected call",
            ));
        }
        for (a, &idx) in abs.iter_mut().zip(args) {
            *a = self.slot(idx).ok_or_else(|| {
                LErr::plain("fibertrace: no value at a protected call's argument")
            })?;
        }
        // SAFETY: the running call's state (a running thread of this host) and absolute
        // indexes of its frame, checked above; the closure only gets a `Protected` over the
        // protected call's own frame, and its result count is clamped to that frame.
        unsafe {
            raw::protect(self.l, &abs[..args.len()], &mut |l| {
                let mut p = Protected { l };
                let n = f(&mut p);
                n.clamp(0, ffi::lua_gettop(l))
            })
        }
    }
}

/// The state of a protected call made by [`Call::protected`]: its methods may allocate and
/// raise (a Lua error ends the protected call, see there), so each checks what it needs and
/// raises when it does not hold.
pub(crate) struct Protected {
    l: *mut ffi::lua_State,
}

impl Protected {
    /// Raises `msg` (ends the protected call).
    fn fail(&mut self, msg: &CStr) -> ! {
        // SAFETY: inside the protected call (`Call::protected`), where a Lua error is caught
        // by its lua_pcall; the message is a new string (an allocation may raise first,
        // which ends the call the same way).
        unsafe {
            ffi::luaL_checkstack(self.l, 1, std::ptr::null());
            ffi::lua_pushstring(self.l, msg.as_ptr());
            ffi::lua_error(self.l)
        }
    }

    /// Room for `n` more values, else the call ends with `stack overflow`.
    fn room(&mut self, n: c_int) {
        // SAFETY: inside the protected call: luaL_checkstack raises on failure, which ends it.
        unsafe { ffi::luaL_checkstack(self.l, n, std::ptr::null()) };
    }

    /// The number of values in the protected call's frame.
    pub(crate) fn top(&self) -> c_int {
        // SAFETY: the protected call's running state; a read.
        unsafe { ffi::lua_gettop(self.l) }
    }

    /// `idx` as an absolute slot of this frame, or the call ends.
    fn slot(&mut self, idx: c_int) -> c_int {
        let top = self.top();
        if idx > 0 && idx <= top {
            idx
        } else if idx < 0 && idx >= -top {
            top + 1 + idx
        } else {
            self.fail(c"fibertrace: bad stack index")
        }
    }

    /// The absolute slot of a table at `idx`, or the call ends.
    fn table(&mut self, idx: c_int) -> c_int {
        let i = self.slot(idx);
        // SAFETY: a slot of this frame; a read.
        if unsafe { ffi::lua_type(self.l, i) } != ffi::LUA_TTABLE {
            self.fail(c"fibertrace: table expected");
        }
        i
    }

    /// The type of the value at `idx` (`LUA_TNONE` past the top).
    pub(crate) fn type_of(&self, idx: c_int) -> c_int {
        let top = self.top();
        if (idx > 0 && idx <= top) || (idx < 0 && idx >= -top) {
            // SAFETY: a slot of this frame; a read.
            unsafe { ffi::lua_type(self.l, idx) }
        } else {
            ffi::LUA_TNONE
        }
    }

    /// Pushes a new table with room for `narr` array and `nrec` hash entries.
    pub(crate) fn new_table(&mut self, narr: c_int, nrec: c_int) {
        self.room(1);
        // SAFETY: room checked; an allocation, which may raise inside the protected call.
        unsafe { ffi::lua_createtable(self.l, narr.max(0), nrec.max(0)) };
    }

    /// Pushes a Rust string (see [`raw::push_str`]).
    pub(crate) fn push_str(&mut self, s: &str) {
        self.room(1);
        // SAFETY: room checked; an allocation inside the protected call.
        unsafe { raw::push_str(self.l, s) };
    }

    /// Pushes bytes as a Lua string, as they are.
    pub(crate) fn push_bytes(&mut self, b: &[u8]) {
        self.room(1);
        // SAFETY: room checked; the pointer and length describe `b`, which Lua copies; an
        // allocation inside the protected call.
        unsafe { ffi::lua_pushlstring(self.l, b.as_ptr().cast(), b.len()) };
    }

    /// Pushes an integer.
    pub(crate) fn push_int(&mut self, n: i64) {
        self.room(1);
        // SAFETY: room checked.
        unsafe { ffi::lua_pushinteger(self.l, n as ffi::lua_Integer) };
    }

    /// Pushes a boolean.
    pub(crate) fn push_bool_value(&mut self, b: bool) {
        self.room(1);
        // SAFETY: room checked.
        unsafe { ffi::lua_pushboolean(self.l, c_int::from(b)) };
    }

    /// Pushes a number.
    pub(crate) fn push_number(&mut self, n: f64) {
        self.room(1);
        // SAFETY: room checked.
        unsafe { ffi::lua_pushnumber(self.l, n) };
    }

    /// Pushes a copy of the value at `idx`.
    pub(crate) fn push_value(&mut self, idx: c_int) {
        let i = self.slot(idx);
        self.room(1);
        // SAFETY: a slot of this frame, room checked.
        unsafe { ffi::lua_pushvalue(self.l, i) };
    }

    /// Pushes the registry's value at the reference `r`.
    pub(crate) fn push_ref(&mut self, r: c_int) {
        self.room(2);
        // SAFETY: room checked; a raw read of the registry.
        unsafe { raw::rawgeti(self.l, REG, r as ffi::lua_Integer) };
    }

    /// `t.key = v` (raw) for the table at `t` and the value on top, which is popped.
    pub(crate) fn set_field(&mut self, t: c_int, key: &CStr) {
        let t = self.table(t);
        let v = self.slot(-1);
        if v == t {
            self.fail(c"fibertrace: no value to store");
        }
        self.room(1);
        // SAFETY: a table (checked) and a value above it; the key is a new string (may
        // raise); the raw store pops key and value.
        unsafe {
            ffi::lua_pushstring(self.l, key.as_ptr());
            ffi::lua_insert(self.l, -2);
            ffi::lua_rawset(self.l, t);
        }
    }

    /// `t[k] = v` (raw) for the table at `t` and `k`, `v` the two values on top, popped.
    pub(crate) fn raw_set(&mut self, t: c_int) {
        let t = self.table(t);
        if self.top() - t < 2 {
            self.fail(c"fibertrace: no key and value to store");
        }
        // SAFETY: a table below a key and a value (checked); a nil or NaN key raises, inside
        // the protected call.
        unsafe { ffi::lua_rawset(self.l, t) };
    }

    /// `t[n] = v` (raw) for the table at `t` and the value on top, popped.
    pub(crate) fn set_index(&mut self, t: c_int, n: i64) {
        let t = self.table(t);
        if self.top() - t < 1 {
            self.fail(c"fibertrace: no value to store");
        }
        self.room(1);
        // SAFETY: a table below a value (checked), room for a key past `int`.
        unsafe { raw::rawseti(self.l, t, n as ffi::lua_Integer) };
    }

    /// Replaces the key on top with `t[key]` (raw) for the table at `t`.
    pub(crate) fn raw_get(&mut self, t: c_int) {
        let t = self.table(t);
        if self.top() - t < 1 {
            self.fail(c"fibertrace: no key to read");
        }
        // SAFETY: a table below a key (checked); a raw read.
        unsafe { ffi::lua_rawget(self.l, t) };
    }

    /// Replaces the `n` strings on top with their concatenation.
    pub(crate) fn concat(&mut self, n: c_int) {
        if n < 1 || n > self.top() {
            self.fail(c"fibertrace: nothing to concatenate");
        }
        for i in 1..=n {
            if self.type_of(-i) != ffi::LUA_TSTRING {
                self.fail(c"fibertrace: string expected");
            }
        }
        // SAFETY: `n` strings on top (checked), so no metamethod runs; an allocation.
        unsafe { ffi::lua_concat(self.l, n) };
    }

    /// Pushes a new userdata holding `v`, with `T`'s metatable (set after the block is
    /// written: [`UdBlock`]'s contract).
    pub(crate) fn new_ud<T: UdBlock>(&mut self, v: T) {
        let Some((mt, _)) = T::metatable() else {
            drop(v);
            self.fail(c"fibertrace: no Lua host on this thread")
        };
        const {
            assert!(
                std::mem::align_of::<T>() <= 8 && std::mem::size_of::<T>() >= 8,
                "a userdata block is 8-aligned and starts with its tag word"
            )
        };
        self.room(2);
        // SAFETY: room checked; a fresh block of `T`'s size and Lua's alignment (8 bytes in
        // LuaJIT and Lua 5.4; `T`'s is at most that, asserted above at compile time) is
        // written before its metatable is set; the metatable reference is `T`'s, checked to
        // be a table.
        unsafe {
            let p = ffi::lua_newuserdata(self.l, std::mem::size_of::<T>()).cast::<T>();
            debug_assert!(p.is_aligned());
            p.write(v);
            raw::rawgeti(self.l, REG, mt as ffi::lua_Integer);
            if ffi::lua_type(self.l, -1) != ffi::LUA_TTABLE {
                // (The block stays without metatable: no `__gc` releases it; it holds
                // nothing then.)
                (*p).release();
                self.fail(c"fibertrace: metatable missing");
            }
            ffi::lua_setmetatable(self.l, -2);
        }
    }

    /// Anchors the value on top (popped) in the registry; its reference.
    pub(crate) fn ref_top(&mut self) -> c_int {
        if self.top() < 1 {
            self.fail(c"fibertrace: no value to anchor");
        }
        // SAFETY: a value on top (checked); luaL_ref pops it and may allocate (raise). (The
        // registry's growth is the host's, not the calling fiber's heap.)
        fibertrace_core::heap::outside_fibers(|| unsafe { ffi::luaL_ref(self.l, REG) })
    }

    /// Calls the value below the `nargs` values on top in a protected call of its own
    /// (`lua_pcall`): `nresults` results, or its error value (whether it succeeded).
    pub(crate) fn pcall(&mut self, nargs: c_int, nresults: c_int) -> bool {
        if nargs < 0 || nargs >= self.top() {
            self.fail(c"fibertrace: nothing to call");
        }
        if nresults < 0 && nresults != ffi::LUA_MULTRET {
            self.fail(c"fibertrace: bad result count");
        }
        self.room(nresults.max(1));
        // SAFETY: a value and its arguments on the stack (checked); calling a non-function
        // is a Lua error caught by this lua_pcall.
        unsafe { ffi::lua_pcall(self.l, nargs, nresults, 0) == ffi::LUA_OK }
    }

    /// Keeps the `n` first values of the frame (a top lowered, never raised).
    pub(crate) fn truncate(&mut self, n: c_int) {
        let n = n.clamp(0, self.top());
        // SAFETY: a top lowered to a slot of this frame.
        unsafe { ffi::lua_settop(self.l, n) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::raw::LResult;
    use super::*;

    /// A block type whose metatable no userdata carries: every value reads as no `Probe`.
    struct Probe;

    // SAFETY: no table has the identity 1 (and the reference is none), so no userdata has
    // this metatable.
    unsafe impl UdBlock for Probe {
        fn is_tag(_: u64) -> bool {
            false
        }
        type Handle = ();
        fn metatable() -> Option<(c_int, usize)> {
            Some((ffi::LUA_NOREF, 1))
        }
        fn handle(&self) -> Option<()> {
            Some(())
        }
        fn release(&mut self) {}
    }

    /// Pushes values until the stack is full: the call fails with `stack overflow` instead of
    /// writing past the stack.
    fn flood_body(c: &mut Call) -> LResult {
        for _ in 0..2_000_000 {
            c.push_int(1)?;
        }
        Ok(0)
    }
    lua_fn!(t_flood, flood_body);

    /// Reads past the top and through indexes that name no value; returns what it read.
    fn reads_body(c: &mut Call) -> LResult {
        let top = c.top();
        let none = [
            top + 1,
            -(top + 1),
            0,
            ffi::LUA_REGISTRYINDEX,
            c_int::MAX,
            c_int::MIN,
        ]
        .iter()
        .all(|&i| c.type_of(i) == ffi::LUA_TNONE && c.to_number(i).is_none());
        // A number is not converted in place by a string read.
        let num_kept = c.string_bytes(1).is_none() && c.type_of(1) == ffi::LUA_TNUMBER;
        // A userdata of another type, and values that are no userdata, are no `Probe`.
        let not_ud = c.ud::<Probe>(2).is_none()
            && c.ud::<Probe>(1).is_none()
            && c.ud::<Probe>(top + 5).is_none();
        c.push_bool(none)?;
        c.push_bool(num_kept)?;
        c.push_bool(not_ud)?;
        Ok(3)
    }
    lua_fn!(t_reads, reads_body);

    /// A protected call given an index that names no value is refused; one that raises
    /// comes back as `Raised` with its error on top.
    fn protected_body(c: &mut Call) -> LResult {
        let top = c.top();
        let refused = matches!(c.protected(&[top + 1], |_| 0), Err(LErr::Plain(_)));
        let raised = c.protected(&[], |p| {
            p.push_int(1);
            p.set_field(-1, c"x"); // not a table: raises
            0
        });
        let raised = matches!(raised, Err(LErr::Raised));
        let msg = c.string_bytes(-1).unwrap_or_default();
        c.pop(1);
        c.push_bool(refused)?;
        c.push_bool(raised)?;
        c.push_str(&String::from_utf8_lossy(&msg))?;
        Ok(3)
    }
    lua_fn!(t_protected, protected_body);

    #[test]
    fn the_safe_layer_refuses_what_it_cannot_do_instead_of_doing_it() {
        let host = super::super::LuaHost::new().unwrap();
        let l = super::super::with_host(|h| h.main_l).unwrap();
        // SAFETY: the host's main state, running nothing; each function is pushed and popped
        // into a global.
        unsafe {
            for (name, f) in [
                (c"t_flood", t_flood as ffi::lua_CFunction),
                (c"t_reads", t_reads),
                (c"t_protected", t_protected),
            ] {
                ffi::lua_pushcfunction(l, f);
                ffi::lua_setglobal(l, name.as_ptr());
            }
        }
        let src = r#"
            FLOOD_OK, FLOOD_ERR = pcall(t_flood)
            NONE, NUM_KEPT, NOT_UD = t_reads(42, newproxy and newproxy() or io.stdout)
            NUM_TYPE = type(42)
            REFUSED, RAISED, MSG = t_protected()
        "#;
        host.run_main("@t.lua", src.as_bytes(), &[]).unwrap();
        let g = host.lua().globals();
        assert!(!g.get::<bool>("FLOOD_OK").unwrap());
        assert_eq!(g.get::<String>("FLOOD_ERR").unwrap(), "stack overflow");
        assert!(g.get::<bool>("NONE").unwrap());
        assert!(g.get::<bool>("NUM_KEPT").unwrap());
        assert!(g.get::<bool>("NOT_UD").unwrap());
        assert!(g.get::<bool>("REFUSED").unwrap());
        assert!(g.get::<bool>("RAISED").unwrap());
        assert_eq!(
            g.get::<String>("MSG").unwrap(),
            "fibertrace: table expected"
        );
        drop(host);
    }
}
