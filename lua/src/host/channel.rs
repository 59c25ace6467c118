//! `fiber.channel`: channels of Lua values (each message a registry reference, released
//! when it is read or the channel is dropped).

use std::ffi::c_int;

use mlua::ffi;

use super::objects::*;
use super::raw::lua_fn;
use super::raw::{self, to_number, type_of, LErr, LResult};
use super::with_host;

// ---- channels and conditions ----
//
// `fiber.channel` and `fiber.cond`: Tarantool's channel and condition objects over the
// runtime's `Channel` and `Cond`, with Tarantool 2.6's argument checks and texts.
// Invariants: a channel's values are registry references owned by exactly one `Msg` at a
// time (released exactly once, never while queued); a channel or condition object's block
// is initialised before its metatable (with `__gc`) is set, and emptied once by `__gc`; a
// blocked operation keeps its object alive (it stays at index 1 of the call).

/// A channel's userdata: the runtime's channel of registry references to the values.
pub(crate) struct ChannelUd {
    ch: Option<fibertrace_fiber::Channel<Msg>>,
}

/// `fiber.channel([size])`: absent or nil is 0; a number or numeric string is truncated to an
/// integer (`lua_tointeger`'s way: NaN and numbers past the 64-bit range are taken as
/// negative, as on x86_64); negative is an error. Room is not reserved up front, so any size
/// is accepted.
pub(super) unsafe fn channel_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let cap = match unsafe { type_of(l, 1) } {
        t if t <= ffi::LUA_TNIL => 0,
        // SAFETY: as above.
        _ => match unsafe { to_number(l, 1) } {
            Some(n) if n.is_finite() && (-9.3e18..9.2e18).contains(&n) && n.trunc() >= 0.0 => {
                n.trunc() as usize
            }
            Some(_) => return Err("fiber.channel(size): negative size".into()),
            None => return Err("fiber.channel(size): bad arguments".into()),
        },
    };
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block (made in a protected call) is initialised before its
    // metatable (with __gc) is set.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            let p = ffi::lua_newuserdata(l, std::mem::size_of::<ChannelUd>()).cast::<ChannelUd>();
            p.write(ChannelUd {
                ch: Some(fibertrace_fiber::channel(cap)),
            });
            super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            1
        })
    }?;
    Ok(1)
}
lua_fn!(f_channel, channel_body);

/// The channel at index 1 (Tarantool's `luaT_checkfiberchannel`): none there is `usage:
/// <usage>`; anything but a channel is a bad argument.
///
/// # Safety
/// `l` is the calling state of a C function.
pub(super) unsafe fn channel_arg(
    l: *mut ffi::lua_State,
    usage: &str,
) -> Result<fibertrace_fiber::Channel<Msg>, LErr> {
    let (_, cmt, _) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `channel_body`.
    unsafe {
        if ffi::lua_gettop(l) < 1 {
            return Err(format!("usage: {usage}").into());
        }
        match check_ud::<ChannelUd>(l, 1, cmt) {
            Some(p) => (*p)
                .ch
                .clone()
                .ok_or_else(|| format!("usage: {usage}").into()),
            None => Err(raw::type_error(l, 1, "fiber.channel")),
        }
    }
}

/// A value in a channel: a reference in the registry, released when the message is dropped —
/// whoever drops it (a receiver after pushing the value, a send that failed, a channel that
/// is closed or collected with values in it, a sender's cancellation). A message is owned by
/// exactly one place at a time, so its reference is released exactly once and never while
/// it is still queued.
pub(crate) struct Msg(c_int);

impl Drop for Msg {
    fn drop(&mut self) {
        // The registry is shared by all threads of the state: the main state will do. While
        // the host is borrowed (a message dropped by a `__gc` finalizer that an allocation ran
        // inside the host's borrow), the reference waits in a queue for the next message
        // dropped outside it. Without a host (it is being torn down, its state about to
        // close) the reference goes with the state.
        let r = self.0;
        let done = with_host(|h| {
            // SAFETY: the main state of this thread's host; the reference was made by
            // `ch_put_body` and is released only here (or by `release_pending`).
            unsafe {
                release_pending(h.main_l);
                ffi::luaL_unref(h.main_l, REG, r);
            }
        });
        if done.is_none() {
            PENDING_UNREFS.with(|p| {
                if let Ok(mut p) = p.try_borrow_mut() {
                    p.push(r);
                    PENDING.with(|f| f.set(true));
                }
            });
        }
    }
}

thread_local! {
    /// References of messages dropped while the host was borrowed, to release.
    static PENDING_UNREFS: std::cell::RefCell<Vec<c_int>> = const { std::cell::RefCell::new(Vec::new()) };
    /// `PENDING_UNREFS` is not empty.
    static PENDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Releases the references of messages dropped while the host was borrowed.
///
/// # Safety
/// `l` is a state of this thread's host.
pub(super) unsafe fn release_pending(l: *mut ffi::lua_State) {
    if !PENDING.with(|f| f.replace(false)) {
        return;
    }
    let refs = PENDING_UNREFS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for r in refs {
        // SAFETY: per the contract; each reference was queued once, by its message's drop.
        unsafe { ffi::luaL_unref(l, REG, r) };
    }
}

/// Releases the queued references now, if any and the host is not borrowed.
pub(super) fn drain_pending() {
    if PENDING.with(|f| f.get()) {
        // SAFETY: the main state of this thread's host.
        with_host(|h| unsafe { release_pending(h.main_l) });
    }
}

/// Forgets references queued for another host (a new host on this thread starts clean).
pub(super) fn clear_pending() {
    PENDING_UNREFS.with(|p| p.borrow_mut().clear());
    PENDING.with(|f| f.set(false));
}

pub(super) const PUT_USAGE: &str = "usage: channel:put(var [, timeout])";
pub(super) const GET_USAGE: &str = "usage: channel:get([timeout])";

pub(super) unsafe fn ch_put_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all Lua calls below).
    let ch = unsafe { channel_arg(l, "channel:put(var [, timeout])") }?;
    // SAFETY: as above.
    if unsafe { ffi::lua_gettop(l) } < 2 {
        return Err(PUT_USAGE.into());
    }
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 3, PUT_USAGE) }?;
    let waits = super::finalize::channel_would_wait(&ch, true, timeout);
    // SAFETY: as above.
    unsafe { super::finalize::check_wait(l, "channel:put", waits) }?;
    let mut r = ffi::LUA_REFNIL;
    // SAFETY: as above: the message is referenced in the registry (in a protected call: the
    // registry may grow).
    unsafe {
        raw::protect(l, &[2], &mut |l| {
            r = ffi::luaL_ref(l, REG);
            0
        })
    }?;
    let msg = Msg(r);
    drain_pending();
    // A send that completed is reported as such, even if the fiber was cancelled meanwhile
    // (Tarantool's rule); a failed one drops its message (releasing it) unless the channel
    // discarded it already. Cancellation while blocked unwinds out of the send, dropping the
    // message on the way (see `fibertrace_fiber::sync`).
    let sent = match ch.send_back(msg, timeout) {
        Ok(()) => true,
        Err(e) => {
            drop(e);
            cancelled_check()?;
            false
        }
    };
    // SAFETY: as above.
    unsafe { ffi::lua_pushboolean(l, sent as c_int) };
    Ok(1)
}
lua_fn!(ch_put, ch_put_body);

pub(super) unsafe fn ch_get_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract (all Lua calls below).
    let ch = unsafe { channel_arg(l, "channel:get([timeout])") }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, GET_USAGE) }?;
    let waits = super::finalize::channel_would_wait(&ch, false, timeout);
    // SAFETY: as above.
    unsafe { super::finalize::check_wait(l, "channel:get", waits) }?;
    let got = match timeout {
        None => ch.recv(),
        Some(d) => ch.recv_timeout(d).ok(),
    };
    match got {
        // A value taken is returned, even if the fiber was cancelled meanwhile.
        // SAFETY: as above; the message's value is pushed, then the message released.
        Some(msg) => unsafe {
            super::raw::rawgeti(l, REG, msg.0 as ffi::lua_Integer);
            drop(msg);
        },
        None => {
            cancelled_check()?;
            // SAFETY: as above.
            unsafe { ffi::lua_pushnil(l) };
        }
    }
    Ok(1)
}
lua_fn!(ch_get, ch_get_body);

pub(super) unsafe fn ch_close_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let ch = unsafe { channel_arg(l, "channel:close()") }?;
    if with_host(|h| h.graceful_close).unwrap_or(false) {
        // Graceful (compat 'new'): queued values stay readable; blocked senders fail.
        ch.close();
    } else {
        // Tarantool 2.6: queued messages are dropped; blocked senders and receivers fail.
        ch.close_discarding();
    }
    Ok(0)
}
lua_fn!(ch_close, ch_close_body);

macro_rules! ch_query {
    ($name:ident, $body:ident, $usage:literal, |$ch:ident, $l:ident| $e:expr) => {
        unsafe fn $body($l: *mut ffi::lua_State) -> LResult {
            // SAFETY: C function contract.
            let $ch = unsafe { channel_arg($l, $usage) }?;
            // SAFETY: as above.
            unsafe { $e };
            Ok(1)
        }
        lua_fn!($name, $body);
    };
}
ch_query!(
    ch_is_closed,
    ch_is_closed_body,
    "channel:is_closed()",
    |c, l| ffi::lua_pushboolean(l, c.is_closed() as c_int)
);
ch_query!(ch_count, ch_count_body, "channel:count()", |c, l| {
    ffi::lua_pushinteger(l, c.len() as ffi::lua_Integer)
});
ch_query!(ch_size, ch_size_body, "channel:size()", |c, l| {
    ffi::lua_pushinteger(l, c.capacity() as ffi::lua_Integer)
});
ch_query!(
    ch_is_empty,
    ch_is_empty_body,
    "channel:is_empty()",
    |c, l| ffi::lua_pushboolean(l, c.is_empty() as c_int)
);
ch_query!(ch_is_full, ch_is_full_body, "channel:is_full()", |c, l| {
    ffi::lua_pushboolean(l, c.is_full() as c_int)
});
ch_query!(
    ch_has_readers,
    ch_has_readers_body,
    "channel:has_readers()",
    |c, l| ffi::lua_pushboolean(l, c.has_readers() as c_int)
);
ch_query!(
    ch_has_writers,
    ch_has_writers_body,
    "channel:has_writers()",
    |c, l| ffi::lua_pushboolean(l, c.has_writers() as c_int)
);

pub(super) unsafe fn ch_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let ch = unsafe { channel_arg(l, "") }?;
    let text = if ch.is_closed() {
        "channel: closed".to_string()
    } else {
        format!("channel: {}", ch.len())
    };
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, &text) }?;
    Ok(1)
}
lua_fn!(ch_tostring, ch_tostring_body);

pub(super) unsafe fn ch_gc_body(l: *mut ffi::lua_State) -> LResult {
    let Some((_, cmt, _)) = mt_refs() else {
        return Ok(0);
    };
    // SAFETY: __gc is called with our userdata; its block is taken out once.
    unsafe {
        if let Some(p) = check_ud::<ChannelUd>(l, 1, cmt) {
            // The last handle's drop releases the queued messages (a blocked fiber holds a
            // handle, so this is not the last while one waits).
            drop((*p).ch.take());
        }
    }
    Ok(0)
}
lua_fn!(ch_gc, ch_gc_body);

/// The methods of channel objects.
pub(crate) const CHANNEL_METHODS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"put", ch_put),
    (c"get", ch_get),
    (c"close", ch_close),
    (c"is_closed", ch_is_closed),
    (c"count", ch_count),
    (c"size", ch_size),
    (c"is_empty", ch_is_empty),
    (c"is_full", ch_is_full),
    (c"has_readers", ch_has_readers),
    (c"has_writers", ch_has_writers),
];

/// The metamethods of channel objects.
pub(crate) const CHANNEL_META: &[(&std::ffi::CStr, ffi::lua_CFunction)] =
    &[(c"__gc", ch_gc), (c"__tostring", ch_tostring)];

#[cfg(test)]
mod msg_tests {
    use super::*;

    /// A message dropped while the host is borrowed (as by a `__gc` finalizer run by an
    /// allocation inside the borrow) has its reference released later: the registry does not
    /// grow over 10^5 such drops.
    #[test]
    fn messages_dropped_while_the_host_is_borrowed_release_their_references() {
        let host = super::super::LuaHost::new().unwrap();
        let l = with_host(|h| h.main_l).unwrap();
        // SAFETY: the host's main state, running nothing; every pushed value is popped
        // (luaL_ref pops its value).
        let first = unsafe {
            ffi::lua_pushboolean(l, 1);
            let r = ffi::luaL_ref(l, REG);
            ffi::luaL_unref(l, REG, r);
            r
        };
        for _ in 0..100_000 {
            // SAFETY: as above; the reference is the message's.
            let msg = Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            });
            with_host(|_| drop(msg)).unwrap();
            // The next message dropped outside a borrow releases the queued ones.
            // SAFETY: as above.
            drop(Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            }));
        }
        // SAFETY: as above.
        let last = unsafe {
            ffi::lua_pushboolean(l, 1);
            let r = ffi::luaL_ref(l, REG);
            ffi::luaL_unref(l, REG, r);
            r
        };
        assert!(last <= first + 2, "{first} -> {last}");
        drop(host);
    }
}
