//! `fiber.channel`: channels of Lua values (each message a registry reference, released
//! when it is read or the channel is dropped).

use std::ffi::c_int;

use mlua::ffi;

use super::call::lua_fn;
use super::call::{Call, UdBlock};
use super::objects::*;
use super::raw::{LErr, LResult};
use super::with_host;

// ---- channels and conditions ----
//
// `fiber.channel` and `fiber.cond`: Tarantool's channel and condition objects over the
// runtime's `Channel` and `Cond`, with Tarantool 2.6's argument checks and texts.
// Invariants: a channel's values are registry references owned by exactly one `Msg` at a
// time (released exactly once, never while queued); a channel or condition object's block
// is initialised before its metatable (with `__gc`) is set, and emptied once by `__gc`; a
// blocked operation holds its own handle to the channel or condition (a clone), so it does
// not depend on the object staying alive or unreleased.

/// A channel's userdata: its tag, then the runtime's channel of registry references to the
/// values.
#[repr(C)]
pub(crate) struct ChannelUd {
    /// Read as the block's first word only ([`super::call::tagged_body`]).
    #[allow(dead_code)]
    tag: u64,
    ch: Option<fibertrace_fiber::Channel<Msg>>,
}

/// The first word of a channel's block (see [`UdBlock`]: no address has these top bits).
const CHANNEL_TAG: u64 = 0xF1BE_C4A2_0000_0001;

// SAFETY: the channel metatable is set only by `Protected::new_ud::<ChannelUd>` (in
// `channel_body`); the block is `repr(C)`, its first word the tag in every value (made only
// there); no other block type's tag and no address is `CHANNEL_TAG`.
unsafe impl UdBlock for ChannelUd {
    fn is_tag(word: u64) -> bool {
        word == CHANNEL_TAG
    }
    type Handle = fibertrace_fiber::Channel<Msg>;
    fn metatable() -> Option<(c_int, usize)> {
        metatable(1)
    }
    fn handle(&self) -> Option<Self::Handle> {
        self.ch.clone()
    }
    fn release(&mut self) {
        // The last handle's drop releases the queued messages (a blocked fiber holds a
        // handle, so this is not the last while one waits).
        drop(self.ch.take());
    }
}

/// `fiber.channel([size])`: absent or nil is 0; a number or numeric string is truncated to an
/// integer (`lua_tointeger`'s way: NaN and numbers past the 64-bit range are taken as
/// negative, as on x86_64); negative is an error. Room is not reserved up front, so any size
/// is accepted.
pub(super) fn channel_body(c: &mut Call) -> LResult {
    let cap = if c.is_none_or_nil(1) {
        0
    } else {
        match c.to_number(1) {
            Some(n) if n.is_finite() && (-9.3e18..9.2e18).contains(&n) && n.trunc() >= 0.0 => {
                n.trunc() as usize
            }
            Some(_) => return Err("fiber.channel(size): negative size".into()),
            None => return Err("fiber.channel(size): bad arguments".into()),
        }
    };
    let mut block = Some(ChannelUd {
        tag: CHANNEL_TAG,
        ch: Some(fibertrace_fiber::channel(cap)),
    });
    c.protected(&[], |p| {
        if let Some(b) = block.take() {
            p.new_ud(b);
        }
        1
    })?;
    Ok(1)
}
lua_fn!(f_channel, channel_body);

/// The channel at index 1 (Tarantool's `luaT_checkfiberchannel`): none there is `usage:
/// <usage>`; anything but a channel is a bad argument.
pub(super) fn channel_arg(c: &Call, usage: &str) -> Result<fibertrace_fiber::Channel<Msg>, LErr> {
    if c.top() < 1 {
        return Err(format!("usage: {usage}").into());
    }
    match c.ud::<ChannelUd>(1) {
        Some(Some(ch)) => Ok(ch),
        Some(None) => Err(format!("usage: {usage}").into()),
        None => Err(c.type_error(1, "fiber.channel")),
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
            release_pending(h);
            h.unref(r);
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
pub(super) fn release_pending(h: &super::HostState) {
    if !PENDING.with(|f| f.replace(false)) {
        return;
    }
    let refs = PENDING_UNREFS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for r in refs {
        // Each reference was queued once, by its message's drop.
        h.unref(r);
    }
}

/// Releases the queued references now, if any and the host is not borrowed.
pub(super) fn drain_pending() {
    if PENDING.with(|f| f.get()) {
        with_host(|h| release_pending(h));
    }
}

/// Forgets references queued for another host (a new host on this thread starts clean).
pub(super) fn clear_pending() {
    PENDING_UNREFS.with(|p| p.borrow_mut().clear());
    PENDING.with(|f| f.set(false));
}

pub(super) const PUT_USAGE: &str = "usage: channel:put(var [, timeout])";
pub(super) const GET_USAGE: &str = "usage: channel:get([timeout])";

pub(super) fn ch_put_body(c: &mut Call) -> LResult {
    let ch = channel_arg(c, "channel:put(var [, timeout])")?;
    if c.top() < 2 {
        return Err(PUT_USAGE.into());
    }
    let timeout = c.opt_timeout(3, PUT_USAGE)?;
    let waits = super::finalize::channel_would_wait(&ch, true, timeout);
    super::finalize::check_wait(c, "channel:put", waits)?;
    // The message is referenced in the registry (in a protected call: the registry may grow).
    let msg = Msg(c.ref_value(2)?);
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
    c.push_bool(sent)?;
    Ok(1)
}
lua_fn!(ch_put, ch_put_body);

pub(super) fn ch_get_body(c: &mut Call) -> LResult {
    let ch = channel_arg(c, "channel:get([timeout])")?;
    let timeout = c.opt_timeout(2, GET_USAGE)?;
    let waits = super::finalize::channel_would_wait(&ch, false, timeout);
    super::finalize::check_wait(c, "channel:get", waits)?;
    let got = match timeout {
        // (`recv` panics where it cannot wait, outside a fiber: there this gives nil.)
        None if fibertrace_fiber::current_id() != 0 => ch.recv(),
        None => ch.try_recv().ok(),
        Some(d) => ch.recv_timeout(d).ok(),
    };
    match got {
        // A value taken is returned, even if the fiber was cancelled meanwhile: its value
        // is pushed, then the message released (also when the push fails).
        Some(msg) => {
            let pushed = c.push_ref(msg.0);
            drop(msg);
            pushed?;
        }
        None => {
            cancelled_check()?;
            c.push_nil()?;
        }
    }
    Ok(1)
}
lua_fn!(ch_get, ch_get_body);

pub(super) fn ch_close_body(c: &mut Call) -> LResult {
    let ch = channel_arg(c, "channel:close()")?;
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
    ($name:ident, $body:ident, $usage:literal, |$ch:ident, $c:ident| $e:expr) => {
        fn $body($c: &mut Call) -> LResult {
            let $ch = channel_arg($c, $usage)?;
            $e?;
            Ok(1)
        }
        lua_fn!($name, $body);
    };
}
ch_query!(
    ch_is_closed,
    ch_is_closed_body,
    "channel:is_closed()",
    |ch, c| c.push_bool(ch.is_closed())
);
ch_query!(ch_count, ch_count_body, "channel:count()", |ch, c| c
    .push_int(ch.len() as i64));
ch_query!(ch_size, ch_size_body, "channel:size()", |ch, c| c
    .push_int(ch.capacity() as i64));
ch_query!(
    ch_is_empty,
    ch_is_empty_body,
    "channel:is_empty()",
    |ch, c| c.push_bool(ch.is_empty())
);
ch_query!(ch_is_full, ch_is_full_body, "channel:is_full()", |ch, c| c
    .push_bool(ch.is_full()));
ch_query!(
    ch_has_readers,
    ch_has_readers_body,
    "channel:has_readers()",
    |ch, c| c.push_bool(ch.has_readers())
);
ch_query!(
    ch_has_writers,
    ch_has_writers_body,
    "channel:has_writers()",
    |ch, c| c.push_bool(ch.has_writers())
);

pub(super) fn ch_tostring_body(c: &mut Call) -> LResult {
    let text = match c.ud::<ChannelUd>(1) {
        Some(Some(ch)) if ch.is_closed() => "channel: closed".to_string(),
        Some(Some(ch)) => format!("channel: {}", ch.len()),
        // Released by its `__gc`, which a script may call itself: a text, not an error
        // (`tostring` is what a script prints while it looks for a problem).
        Some(None) => "channel: released".to_string(),
        None => return Err(c.type_error(1, "fiber.channel")),
    };
    c.push_str(&text)?;
    Ok(1)
}
lua_fn!(ch_tostring, ch_tostring_body);

pub(super) fn ch_gc_body(c: &mut Call) -> LResult {
    c.ud_release::<ChannelUd>(1);
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
            // SAFETY: the host's main state, running nothing; the reference is anchored here
            // and owned by the message.
            let msg = Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            });
            with_host(|_| drop(msg)).unwrap();
            // The next message dropped outside a borrow releases the queued ones.
            // SAFETY: the host's main state, running nothing; luaL_ref pops its value.
            drop(Msg(unsafe {
                ffi::lua_pushboolean(l, 1);
                ffi::luaL_ref(l, REG)
            }));
        }
        // SAFETY: the host's main state, running nothing; the value pushed is popped by
        // luaL_ref, whose reference is released at once.
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
