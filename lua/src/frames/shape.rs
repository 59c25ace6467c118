//! The shape of a suspended LuaJIT state's stack: the raw words its levels are made from,
//! read through the layout checked against the running VM ([`super::publish`]), so that a
//! listing of many fibers parked at the same place reads their levels once
//! (`fiber.info()`'s memo in `host::info`).
//!
//! What the debug API gives for a state's levels (`lua_getstack`/`lua_getinfo("Slnf")`, as
//! [`super::capture_lua_stack`] reads them) is a function of: the distance from the stack's
//! start to its base; each frame's function and link word, walked from the base down (a
//! Lua frame's link is its caller's PC, whose call instruction gives the caller's frame
//! size; other frames carry a delta; a continuation frame also keeps the PC it returns to
//! and its continuation); of a Lua function, only its prototype (source, lines, variable
//! names and the bytecode — which LuaJIT patches as it compiles loops and specialises
//! iterators, always keeping the operands a name is read from — shared by every closure of
//! the same code); of
//! a C function, the object (its C function and kind); and, in the cases where LuaJIT looks
//! at the C frames, the C-frame chain. [`stack_shape`] gives the words of the first part (a
//! Lua function by its bytecode address, a C function by its value), and refuses (`false`)
//! every state in which the result could depend on anything else:
//!
//! * a Lua function on top, or one whose frame above is neither a call from Lua nor a
//!   continuation (a function called by C code, a finalizer, a hook, an error handler):
//!   LuaJIT finds its line through the C frames;
//! * a PC that is not in its function's bytecode (a trace's exit stub, after
//!   `lj_trace_exit` patched it: the line comes from the trace);
//! * dummy frames;
//! * a top-level C function holding a thread in its first upvalue or first argument (a
//!   resume: the capture goes down into the coroutine, whose state is not in the words);
//! * a top frame with more slots than the debug API's reader may add to (it reads nothing
//!   there);
//! * more than [`MAX_FRAMES`] frames, or a frame link that does not go down the stack.
//!
//! Two states with the same words whose prototypes and C functions are the same objects
//! therefore have the same levels. The words hold addresses: an address is the same object
//! only while that object lives, so a user of the shape must know that the objects it
//! compares against are still alive (the memo keeps the fiber it read them from, and takes
//! an entry only while that fiber has not run since and has not ended: its stack still
//! holds them).
//!
//! Invariants: every read is of a word inside the state's own stack (checked against its
//! start and base before it is made), of a function object a slot of that stack holds, of
//! that function's prototype, or of the call instruction before a caller's PC; the state is
//! not running (its fiber is suspended on this thread), so its stack and links are
//! consistent, as LuaJIT's own walk relies on.
//!
//! How a result can be wrong: only if the layout check passed for a VM whose frames differ
//! from LuaJIT 2.1's GC64 frames in a way the check does not see; the shape is then refused
//! or different from another state's, and the levels come from the debug API as before.

use mlua::ffi;
use smallvec::SmallVec;

use super::publish;

/// Most frames a shape covers (a deeper stack is read through the debug API).
pub const MAX_FRAMES: usize = 32;

/// LuaJIT's `LUAI_MAXCSTACK`: the most slots `lua_checkstack` grants above a state's base.
const LUAI_MAXCSTACK: u64 = 8000;

/// The words of a shape (two per frame, two more for a continuation frame, and one).
pub type Words = SmallVec<[u64; 2 * MAX_FRAMES + 1]>;

/// LuaJIT's GC64 value tags: the upper 17 bits of a `TValue`, and the object's address below.
const GCV_MASK: u64 = (1 << 47) - 1;
const T_THREAD: u64 = !6u64 & 0x1_ffff;
const T_FUNC: u64 = !8u64 & 0x1_ffff;

fn tag(tv: u64) -> u64 {
    tv >> 47
}

/// Fills `out` with the words of the shape of `root`'s stack (see the module doc) and
/// returns `true`, or returns `false` when the levels could depend on more than the words.
///
/// # Safety
/// `root` is a live LuaJIT state of this thread that is not running (its fiber is suspended
/// or never ran, and stays so during the call), and the layout check passed
/// ([`publish::checked`] is [`publish::MATCHES`]).
pub unsafe fn stack_shape(root: *mut ffi::lua_State, out: &mut Words) -> bool {
    out.clear();
    let lay = &publish::HEADER.layout;
    let state = root as u64;
    // SAFETY: words inside the live state (the contract) where the checked layout puts them.
    let (base, top, stack) = unsafe {
        (
            read64(state + lay.state_base as u64),
            read64(state + lay.state_top as u64),
            read64(state + lay.state_stack as u64),
        )
    };
    if base < stack.saturating_add(16) || base & 7 != 0 || stack & 7 != 0 || top < base {
        return false;
    }
    // The debug API's reader first asks for two more slots, which LuaJIT refuses past
    // `LUAI_MAXCSTACK` slots above the base (then it reads no level): refused here too.
    if (top - base) / 8 + 2 > LUAI_MAXCSTACK {
        return false;
    }
    out.push(base - stack);
    // The words of the stack at `at`, if it lies between its start and its base.
    let slot = |at: u64| -> Option<u64> {
        // SAFETY: a word inside the live state's stack array (checked just here), which
        // holds initialized values from its start to its top.
        (at >= stack && at.checked_add(8).is_some_and(|e| e <= base) && at & 7 == 0)
            .then(|| unsafe { read64(at) })
    };
    let bot = stack + 8;
    let mut frame = base - 8;
    // (Addresses below a frame are computed wrapping: one below the stack's start fails the
    // slot check like any other outside it.)
    // The PC the frame above gives the one below: its link when it is a call from Lua, its
    // continuation's PC when it is a continuation (`None`: no PC, or `frame` is on top).
    let mut above: Option<u64> = None;
    // Whether `frame` is the lower half of a vararg function's frame (the same function as
    // the frame above, not a level of its own: LuaJIT's walk skips it).
    let mut lower_half = false;
    let mut frames = 0;
    while frame > bot {
        frames += 1;
        if frames > MAX_FRAMES {
            return false;
        }
        let (Some(tv), Some(link)) = (slot(frame.wrapping_sub(8)), slot(frame)) else {
            return false;
        };
        if tag(tv) != T_FUNC {
            // A dummy frame (the state itself).
            return false;
        }
        // A continuation frame (a metamethod's, or a call stitched to a trace) keeps the PC
        // of the Lua code it returns to two slots below its function (and the continuation
        // below that): the line of the function under it comes from there.
        let cont = if link & 7 == 2 {
            let (Some(pc), Some(k)) = (slot(frame.wrapping_sub(16)), slot(frame.wrapping_sub(24)))
            else {
                return false;
            };
            Some((pc, k))
        } else {
            None
        };
        let func = tv & GCV_MASK;
        // SAFETY: `func` is the function object a slot of the live stack holds: alive, and
        // its kind byte is where the checked layout says.
        let ffid = unsafe { read8(func + lay.func_ffid as u64) };
        // A Lua function is named in the words by its bytecode (its prototype's: what its
        // levels are read from, shared by every closure of the same code), a C function by
        // its value (its object: what its C function and kind are read from).
        let word = if ffid == 0 {
            // SAFETY: a live Lua function's bytecode pointer, where the checked layout says.
            let bc = unsafe { read64(func + lay.func_pc as u64) };
            if !lower_half {
                // Its line comes from the frame above, which must be a call from Lua (its
                // link a PC) or a continuation (its PC), inside this function's bytecode.
                let Some(pc) = above else {
                    return false;
                };
                let proto = bc.wrapping_sub(lay.proto_size as u64);
                // SAFETY: the count of instructions of the live function's prototype, which
                // lies just before its bytecode.
                let sizebc = unsafe { read32(proto + lay.proto_sizebc as u64) } as u64;
                if pc < bc.saturating_add(4)
                    || pc > bc.saturating_add(4 * (sizebc + 1))
                    || pc & 3 != 0
                {
                    return false;
                }
            }
            bc
        } else {
            if frames == 1 && resumes(lay, func, base, top) {
                return false;
            }
            tv
        };
        out.push(word);
        out.push(link);
        if let Some((pc, k)) = cont {
            out.push(pc);
            out.push(k);
        }
        // The PC the frame below is at, when it is a Lua function.
        above = match cont {
            Some((pc, _)) => Some(pc),
            None => (link & 3 == 0).then_some(link),
        };
        lower_half = link & 7 == 3;
        let prev = if link & 3 == 0 {
            // A Lua frame: the caller's call instruction (just before the PC) says how far
            // down the caller's frame starts. (A link in the first page is no PC.)
            if link < 4096 {
                return false;
            }
            // SAFETY: `link` is a PC into the bytecode of the live function below (the
            // walk of a consistent stack, as LuaJIT's own); the instruction before it is
            // the call.
            let ins = unsafe { read32(link - 4) } as u64;
            frame.wrapping_sub(8 * (2 + ((ins >> 8) & 0xff)))
        } else {
            frame.wrapping_sub(link & !7)
        };
        if prev >= frame {
            return false;
        }
        frame = prev;
    }
    true
}

/// Whether the top-level C function `func` may be resuming a coroutine: a thread in its
/// first upvalue or its first argument (the capture follows those).
fn resumes(lay: &publish::Layout, func: u64, base: u64, top: u64) -> bool {
    // SAFETY: a live function object's upvalue count and, when it has one, its first
    // upvalue, where the checked layout says.
    let uv = unsafe {
        (read8(func + lay.func_nupvalues as u64) >= 1)
            .then(|| read64(func + lay.func_c_upvalue as u64))
    };
    if uv.is_some_and(|v| tag(v) == T_THREAD) {
        return true;
    }
    // The first argument, at the base when the top frame has one.
    if top > base {
        // SAFETY: a word inside the stack's used part (between its base and top).
        let a = unsafe { read64(base) };
        return tag(a) == T_THREAD;
    }
    false
}

/// # Safety
/// `at` is the address of 8 readable bytes.
unsafe fn read64(at: u64) -> u64 {
    // SAFETY: per the function's contract.
    unsafe { std::ptr::read_unaligned(at as *const u64) }
}

/// # Safety
/// `at` is the address of 4 readable bytes.
unsafe fn read32(at: u64) -> u32 {
    // SAFETY: per the function's contract.
    unsafe { std::ptr::read_unaligned(at as *const u32) }
}

/// # Safety
/// `at` is the address of a readable byte.
unsafe fn read8(at: u64) -> u8 {
    // SAFETY: per the function's contract.
    unsafe { std::ptr::read(at as *const u8) }
}
