//! `fiber.cond`: condition variables.

use std::ffi::c_int;
use std::rc::Rc;

use mlua::ffi;

use super::call::lua_fn;
use super::call::{Call, UdBlock};
use super::objects::*;
use super::raw::{LErr, LResult};

/// A condition's userdata: the runtime's condition, shared with the fibers waiting on it (a
/// waiter holds its own handle, so `__gc` — or a script calling `__gc` itself — never pulls
/// the condition from under one).
#[repr(C)]
pub(crate) struct CondUd {
    /// Read as the block's first word only ([`super::call::tagged_body`]).
    #[allow(dead_code)]
    tag: u64,
    cond: Option<Rc<fibertrace_fiber::Cond>>,
}

/// The first word of a condition's block (see [`UdBlock`]: no address has these top bits).
const COND_TAG: u64 = 0xF1BE_C0D0_0000_0002;

// SAFETY: the condition metatable is set only by `Protected::new_ud::<CondUd>` (in
// `cond_body`); the block is `repr(C)`, its first word the tag in every value (made only
// there); no other block type's tag and no address is `COND_TAG`.
unsafe impl UdBlock for CondUd {
    fn is_tag(word: u64) -> bool {
        word == COND_TAG
    }
    type Handle = Rc<fibertrace_fiber::Cond>;
    fn metatable() -> Option<(c_int, usize)> {
        metatable(2)
    }
    fn handle(&self) -> Option<Self::Handle> {
        self.cond.clone()
    }
    fn release(&mut self) {
        drop(self.cond.take());
    }
}

pub(super) fn cond_body(c: &mut Call) -> LResult {
    let mut block = Some(CondUd {
        tag: COND_TAG,
        cond: Some(Rc::new(fibertrace_fiber::Cond::new())),
    });
    c.protected(&[], |p| {
        if let Some(b) = block.take() {
            p.new_ud(b);
        }
        1
    })?;
    Ok(1)
}
lua_fn!(f_cond, cond_body);

/// The condition at index 1 (Tarantool's `luaT_checkfibercond`), as
/// [`channel_arg`](super::channel::channel_arg).
pub(super) fn cond_arg(c: &Call, usage: &str) -> Result<Rc<fibertrace_fiber::Cond>, LErr> {
    if c.top() < 1 {
        return Err(format!("usage: {usage}").into());
    }
    match c.ud::<CondUd>(1) {
        Some(Some(cond)) => Ok(cond),
        Some(None) => Err(format!("usage: {usage}").into()),
        None => Err(c.type_error(1, "fiber.cond")),
    }
}

pub(super) const WAIT_USAGE: &str = "usage: cond:wait([timeout])";

pub(super) fn cond_wait_body(c: &mut Call) -> LResult {
    let cond = cond_arg(c, "cond:wait([timeout])")?;
    let timeout = c.opt_timeout(2, WAIT_USAGE)?;
    super::finalize::check_switch(c, "cond:wait")?;
    let signalled = match timeout {
        None => {
            cond.wait();
            true
        }
        Some(d) => cond.wait_timeout(d),
    };
    if !signalled {
        cancelled_check()?;
    }
    // (A fiber cancelled while it waits, signalled first or not, raises `fiber is cancelled`
    // in the wait, the runtime's cancellation point: Tarantool since 2.7.1, gh-5013; 2.6
    // returned true.)
    c.push_bool(signalled)?;
    Ok(1)
}
lua_fn!(cond_wait, cond_wait_body);

pub(super) fn cond_signal_body(c: &mut Call) -> LResult {
    cond_arg(c, "cond:signal()")?.signal();
    Ok(0)
}
lua_fn!(cond_signal, cond_signal_body);

pub(super) fn cond_broadcast_body(c: &mut Call) -> LResult {
    cond_arg(c, "cond:broadcast()")?.broadcast();
    Ok(0)
}
lua_fn!(cond_broadcast, cond_broadcast_body);

pub(super) fn cond_tostring_body(c: &mut Call) -> LResult {
    // (Also of a condition released by its `__gc`, as a channel's: a text, not an error.)
    match c.ud::<CondUd>(1) {
        Some(Some(_)) => c.push_str("cond")?,
        Some(None) => c.push_str("cond: released")?,
        None => return Err(c.type_error(1, "fiber.cond")),
    }
    Ok(1)
}
lua_fn!(cond_tostring, cond_tostring_body);

pub(super) fn cond_gc_body(c: &mut Call) -> LResult {
    c.ud_release::<CondUd>(1);
    Ok(0)
}
lua_fn!(cond_gc, cond_gc_body);

/// The methods of condition objects.
pub(crate) const COND_METHODS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"wait", cond_wait),
    (c"signal", cond_signal),
    (c"broadcast", cond_broadcast),
];

/// The metamethods of condition objects.
pub(crate) const COND_META: &[(&std::ffi::CStr, ffi::lua_CFunction)] =
    &[(c"__gc", cond_gc), (c"__tostring", cond_tostring)];
