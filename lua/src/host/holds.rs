//! What a suspended Lua fiber holds: the channels and conditions in the named locals and upvalues
//! of its Lua frames, and in the tables those hold directly (keys and values, one level, the
//! first [`TABLE_ENTRIES`] entries), for the runtime's wait-for graph
//! ([`fibertrace_fiber::inspect::FrameSource::holds`]): a fiber that holds a channel could
//! send to it.
//!
//! Read through the debug API only (`lua_getstack`, `lua_getlocal`, `lua_getinfo("f")`,
//! `lua_getupvalue`, `lua_next`, `lua_getmetatable`: none calls a metamethod or raises), on
//! the scheduler's thread while the fiber is suspended; the values are pushed on the fiber's
//! own thread above its top and the top is restored.
//!
//! How it can be wrong: an object kept deeper (a table in a table, a coroutine's stack, a
//! closure that is not on the stack) is not seen; levels past [`MAX_LEVELS`] are not read.

use std::ffi::c_int;

use mlua::ffi;

use super::call::{tagged_body, UdBlock};
use super::channel::ChannelUd;
use super::cond::CondUd;

/// Levels of a fiber's stack read.
const MAX_LEVELS: c_int = 200;
/// Locals or upvalues read per level.
const MAX_SLOTS: c_int = 250;
/// Entries of a held table looked at.
const TABLE_ENTRIES: usize = 64;

/// The ids of the channels and conditions fiber thread `root` holds (see the module doc),
/// sorted, without repeats.
///
/// # Safety
/// `root` is a live fiber's Lua thread of this thread's host, suspended (not running), and no
/// other code uses its Lua universe during the call.
pub(crate) unsafe fn held(root: *mut ffi::lua_State) -> Vec<u64> {
    let mut out = Vec::new();
    let (Some((_, ch_mt)), Some((_, cond_mt))) = (ChannelUd::metatable(), CondUd::metatable())
    else {
        return out;
    };
    let seen = Seen { ch_mt, cond_mt };
    // SAFETY: `root` is a valid, suspended state used by no one else (the contract); every
    // push is within the room checked here and popped again, and the top is restored at the
    // end; the debug API calls used raise no error; a zeroed `lua_Debug` is valid (integers,
    // pointers and a char array) and read only after the API filled it.
    unsafe {
        let top = ffi::lua_gettop(root);
        if ffi::lua_checkstack(root, 8) == 0 {
            return out;
        }
        let mut ar: ffi::lua_Debug = std::mem::MaybeUninit::zeroed().assume_init();
        for level in 0..MAX_LEVELS {
            if ffi::lua_getstack(root, level, &mut ar) == 0 {
                break;
            }
            for n in 1..=MAX_SLOTS {
                let name = ffi::lua_getlocal(root, &ar, n);
                if name.is_null() {
                    break;
                }
                // Named locals only: a temporary slot (`(*temporary)`, `(temporary)`,
                // `(C temporary)`) may hold a stale value the VM no longer tracks.
                if *name != b'(' as std::ffi::c_char {
                    seen.value(root, &mut out, true);
                }
                ffi::lua_settop(root, -2);
            }
            if ffi::lua_getinfo(root, c"f".as_ptr(), &mut ar) == 0 {
                continue;
            }
            for n in 1..=MAX_SLOTS {
                if ffi::lua_getupvalue(root, -1, n).is_null() {
                    break;
                }
                seen.value(root, &mut out, true);
                ffi::lua_settop(root, -2);
            }
            ffi::lua_settop(root, top);
        }
        ffi::lua_settop(root, top);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The host's channel and condition metatables, by identity.
struct Seen {
    ch_mt: usize,
    cond_mt: usize,
}

impl Seen {
    /// Adds the object at the top of `l` (a channel or condition, or with `tables` those
    /// directly in the table there) to `out`. Leaves the stack as it was.
    ///
    /// # Safety
    /// As [`held`], with room for 5 more values on `l`.
    unsafe fn value(&self, l: *mut ffi::lua_State, out: &mut Vec<u64>, tables: bool) {
        // SAFETY: the contract; pushes stay within the room and are popped.
        unsafe {
            match ffi::lua_type(l, -1) {
                ffi::LUA_TUSERDATA => {
                    if ffi::lua_getmetatable(l, -1) == 0 {
                        return;
                    }
                    let mt = ffi::lua_topointer(l, -1) as usize;
                    ffi::lua_settop(l, -2);
                    // The block is initialised before its metatable is set (`UdBlock`'s
                    // contract); `handle` makes no Lua call. A script can put the metatable
                    // on another userdata (`debug.setmetatable`): `tagged_body` reads a
                    // block only with the type's size and tag.
                    let id = if mt == self.ch_mt {
                        tagged_body::<ChannelUd>(l, -1)
                            .and_then(|p| (*p).handle())
                            .map(|c| c.id())
                    } else if mt == self.cond_mt {
                        tagged_body::<CondUd>(l, -1)
                            .and_then(|p| (*p).handle())
                            .map(|c| c.id())
                    } else {
                        None
                    };
                    out.extend(id);
                }
                ffi::LUA_TTABLE if tables => {
                    let t = ffi::lua_gettop(l);
                    ffi::lua_pushnil(l);
                    let mut n = 0;
                    while ffi::lua_next(l, t) != 0 {
                        // The value, then the key (`set[ch] = true`).
                        self.value(l, out, false);
                        ffi::lua_pushvalue(l, -2);
                        self.value(l, out, false);
                        ffi::lua_settop(l, -3);
                        n += 1;
                        if n == TABLE_ENTRIES {
                            ffi::lua_settop(l, -2);
                            break;
                        }
                    }
                }
                _ => {}
            }
        }
    }
}
