//! `fiber.cond`: condition variables.

use std::ffi::c_int;

use mlua::ffi;

use super::objects::*;
use super::raw::lua_fn;
use super::raw::{self, LErr, LResult};

pub(crate) struct CondUd {
    cond: Option<fibertrace_fiber::Cond>,
}

pub(super) unsafe fn cond_body(l: *mut ffi::lua_State) -> LResult {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: a new userdata block (made in a protected call) is initialised before its
    // metatable (with __gc) is set.
    unsafe {
        raw::protect(l, &[], &mut |l| {
            let p = ffi::lua_newuserdata(l, std::mem::size_of::<CondUd>()).cast::<CondUd>();
            p.write(CondUd {
                cond: Some(fibertrace_fiber::Cond::new()),
            });
            super::raw::rawgeti(l, REG, cmt as ffi::lua_Integer);
            ffi::lua_setmetatable(l, -2);
            1
        })
    }?;
    Ok(1)
}
lua_fn!(f_cond, cond_body);

/// The condition at index 1 (Tarantool's `luaT_checkfibercond`), as [`channel_arg`].
///
/// # Safety
/// `l` is the calling state of a C function.
pub(super) unsafe fn cond_arg(
    l: *mut ffi::lua_State,
    usage: &str,
) -> Result<*const fibertrace_fiber::Cond, LErr> {
    let (_, _, cmt) = mt_refs().ok_or_else(no_host)?;
    // SAFETY: per the contract; the block was initialised by `cond_body`.
    unsafe {
        if ffi::lua_gettop(l) < 1 {
            return Err(format!("usage: {usage}").into());
        }
        match check_ud::<CondUd>(l, 1, cmt) {
            Some(p) => (*p)
                .cond
                .as_ref()
                .map(|c| c as *const _)
                .ok_or_else(|| format!("usage: {usage}").into()),
            None => Err(raw::type_error(l, 1, "fiber.cond")),
        }
    }
}

pub(super) const WAIT_USAGE: &str = "usage: cond:wait([timeout])";

pub(super) unsafe fn cond_wait_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    let c = unsafe { cond_arg(l, "cond:wait([timeout])") }?;
    // SAFETY: as above.
    let timeout = unsafe { raw::opt_timeout(l, 2, WAIT_USAGE) }?;
    // SAFETY: as above.
    unsafe { super::finalize::check_switch(l, "cond:wait") }?;
    // SAFETY: the Cond lives in the userdata at index 1, which this call's frame references
    // across the wait.
    let signalled = unsafe {
        match timeout {
            None => {
                (*c).wait();
                true
            }
            Some(d) => (*c).wait_timeout(d),
        }
    };
    if !signalled {
        cancelled_check()?;
    }
    // Woken (not timed out) in a cancelled fiber: Tarantool returns true; the next
    // cancellation point raises.
    // SAFETY: as above.
    unsafe { ffi::lua_pushboolean(l, signalled as c_int) };
    Ok(1)
}
lua_fn!(cond_wait, cond_wait_body);

pub(super) unsafe fn cond_signal_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l, "cond:signal()")?).signal() };
    Ok(0)
}
lua_fn!(cond_signal, cond_signal_body);

pub(super) unsafe fn cond_broadcast_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract; the userdata is at index 1.
    unsafe { (*cond_arg(l, "cond:broadcast()")?).broadcast() };
    Ok(0)
}
lua_fn!(cond_broadcast, cond_broadcast_body);

pub(super) unsafe fn cond_tostring_body(l: *mut ffi::lua_State) -> LResult {
    // SAFETY: C function contract.
    unsafe { cond_arg(l, "") }?;
    // SAFETY: as above.
    unsafe { raw::push_str_p(l, "cond") }?;
    Ok(1)
}
lua_fn!(cond_tostring, cond_tostring_body);

pub(super) unsafe fn cond_gc_body(l: *mut ffi::lua_State) -> LResult {
    let Some((_, _, cmt)) = mt_refs() else {
        return Ok(0);
    };
    // SAFETY: __gc is called with our userdata; its block is taken out once.
    unsafe {
        if let Some(p) = check_ud::<CondUd>(l, 1, cmt) {
            drop((*p).cond.take());
        }
    }
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
