//! Interleave: native frames and Lua levels merged into one trace.
//!
//! Both lists are innermost first. The native frames split into segments
//! `N0 V1 N1 V2 N2 …`, where each `V` is a run of VM-core frames ([`classify`]). The Lua
//! levels split into `c0 R1 c1 R2 …`, where each `c` is a C level with a `lua_CFunction` whose
//! native frame can be found (its *anchor*: the native frame inside the function that starts
//! at that pointer; a LuaJIT fast function's is its C fallback, `lj_ffh_*`, on the stack when
//! the fast function raised an error or fell back to C; and where the function is a thunk that
//! tail-jumps to another, as `lj_ffh_pairs` does to `ffh_pairs`, a frame in that other
//! function anchors it too: see [`thunk`]) and each `R` is a run of Lua levels
//! (plus C levels with no native frame of their own: fast functions such as `pcall` or
//! `coroutine.resume` running their assembler). The merge:
//! 1. if the innermost level is anchored in `N0`, emit `N0` up to its anchor;
//! 2. emit the rest of the non-VM segment; at a `V`, emit Lua levels until one is anchored in
//!    the non-VM segment after that `V` (the *nearest* match: all mlua callbacks share one
//!    trampoline, so only the nearest is right) — or, when that segment anchors none, in the
//!    nearest later one that does (native code that runs inside a C function and calls back
//!    into Lua through the VM's core: `load`'s reader, a C library's FFI callback); emit `V`
//!    itself only with [`InterleaveOptions::show_vm`]; emit the native frames up to and
//!    including the anchor, then the anchored C level itself (so a C function shows both as
//!    the native frame that implements it and as the Lua level naming it, e.g. `pcall in
//!    =[C]:-1`);
//! 3. repeat; Lua levels left when the native frames end are appended at the end (before a
//!    final `Truncated` marker). (A native `Omitted` marker between VM frames is dropped when
//!    the Lua stack has a gap of its own: the Lua gap's marker stands for that middle.)
//!
//! Invariants: every native frame and every Lua level appears exactly once, native frames in
//! their order, Lua levels in theirs (VM frames only when shown); the result is fitted to
//! [`fibertrace_core::CAPACITY`] like any appended trace (middle frames omitted).
//!
//! How a result can be wrong:
//! * a native walk that stopped early (a frame-pointer walk through C built without frame
//!   pointers) leaves the outer Lua levels at the end of the trace, after the last native
//!   frame, instead of between the frames that were lost;
//! * a C level whose anchor is missing from the segment after its run (frame lost, or the
//!   function lives in an image without a symbol table and does not resolve) is emitted as a
//!   plain Lua level, and the levels after it go into the same run — a Lua run then sits one
//!   VM segment too early;
//! * `Omitted` markers inside the native trace (deeper than its capacity) may hide anchors.

use fibertrace_core::{collect, Backtrace, CaptureOptions, Frame};
use mlua::ffi;
use smallvec::SmallVec;

use crate::frames::{capture_lua_stack, LuaLevel, LuaStack};

pub mod classify;
pub mod foreign;
pub mod held;
pub mod thunk;

pub use classify::{vm_map, VmMap};

/// How to interleave. The default hides VM frames and captures with core's default options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterleaveOptions {
    /// Keep the VM's own native frames (interpreter, `lua_pcall`, …) instead of hiding them.
    pub show_vm: bool,
    /// How the native stack is captured by [`capture_current`] (the unwinder, limits).
    pub capture: CaptureOptions,
}

impl InterleaveOptions {
    /// Default options with the given native unwinder.
    pub fn with_unwinder(unwinder: fibertrace_core::Unwinder) -> Self {
        InterleaveOptions {
            capture: CaptureOptions::with_unwinder(unwinder),
            ..Self::default()
        }
    }
}

/// Merges native frames with captured Lua levels (see the module docs).
pub fn interleave(native: &[Frame], lua: &LuaStack, opts: &InterleaveOptions) -> Backtrace {
    let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
    let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
    merge_with_gap(native, &lua.levels, gap, vm_map(), opts.show_vm, &mut out);
    Backtrace::from_frames(&out)
}

/// Interleaves a captured native trace with the Lua stack of `root` (and the coroutines
/// running inside it), VM frames hidden.
///
/// # Safety
/// As [`capture_lua_stack`]: `root` is a valid state of the linked Lua, not used by anything
/// else during the call. `native` should be the stack that runs `root` (the current stack, or
/// the suspended fiber's from [`fibertrace_core::collect_from`]); otherwise the Lua levels are
/// simply appended after the native frames they find no place among.
pub unsafe fn capture_interleaved(native: &Backtrace, root: *mut ffi::lua_State) -> Backtrace {
    // SAFETY: forwarded contract.
    unsafe { capture_interleaved_with(native, root, &InterleaveOptions::default()) }
}

/// [`capture_interleaved`] with options.
///
/// # Safety
/// As [`capture_interleaved`].
pub unsafe fn capture_interleaved_with(
    native: &Backtrace,
    root: *mut ffi::lua_State,
    opts: &InterleaveOptions,
) -> Backtrace {
    let mut lua = LuaStack::new();
    // SAFETY: forwarded contract.
    unsafe { capture_lua_stack(root, &mut lua) };
    interleave(native.frames(), &lua, opts)
}

/// [`capture_interleaved`] with `inner`, the state running now, read as the innermost thread
/// when `root`'s chain does not reach it (see [`crate::frames::capture_lua_stack_within`]).
///
/// # Safety
/// As [`capture_interleaved`]; `inner` is null or a state of the same universe running on
/// this OS thread.
pub unsafe fn capture_interleaved_within(
    native: &Backtrace,
    root: *mut ffi::lua_State,
    inner: *mut ffi::lua_State,
) -> Backtrace {
    let mut lua = LuaStack::new();
    // SAFETY: forwarded contract.
    unsafe { crate::frames::capture_lua_stack_within(root, inner, &mut lua) };
    interleave(native.frames(), &lua, &InterleaveOptions::default())
}

/// Builds what interleaving needs ahead of time: the VM map, and (LuaJIT) the frame-record
/// hop that lets core's frame-pointer walk cross the interpreter. A native trace captured
/// with the frame-pointer walk *before* this ran stops at the first interpreter frame, so a
/// runtime calls it at start-up, before it captures suspended fibers with
/// [`fibertrace_core::collect_from`]. [`capture_current`] calls it itself.
pub fn prepare() {
    let _ = vm_map();
}

fn skip_own_frame(opts: &CaptureOptions) -> CaptureOptions {
    CaptureOptions {
        offset: opts.offset.saturating_add(1),
        ..*opts
    }
}

/// Captures the current stack, native and Lua, interleaved. `root` is the Lua thread at the
/// bottom of the current Lua activity: the main thread (mlua's `current_thread()` outside any
/// callback), or a fiber's own thread. The first frame is the return address into the caller.
#[inline(never)]
pub fn capture_current(root: &mlua::Thread, opts: &InterleaveOptions) -> Backtrace {
    prepare();
    let native = collect(&skip_own_frame(&opts.capture));
    // SAFETY: `root` is a live thread of a `Lua` that is not `Send`, so it belongs to this OS
    // thread, and nothing else runs Lua code while this function runs.
    let bt = unsafe { capture_interleaved_with(&native, root.state(), opts) };
    std::hint::black_box(&native);
    bt
}

/// [`capture_current`] from a raw root state.
///
/// # Safety
/// As [`capture_interleaved`], and the state must belong to the current OS thread.
#[inline(never)]
pub unsafe fn capture_current_raw(
    root: *mut ffi::lua_State,
    opts: &InterleaveOptions,
) -> Backtrace {
    prepare();
    let native = collect(&skip_own_frame(&opts.capture));
    // SAFETY: forwarded contract.
    let bt = unsafe { capture_interleaved_with(&native, root, opts) };
    std::hint::black_box(&native);
    bt
}

/// Whether native frame `f` lies inside the `lua_CFunction` starting at `cfunc`, or inside
/// the function `tail` that it tail-jumps to (see [`thunk`]).
#[inline]
fn anchored(
    f: &Frame,
    cfunc: usize,
    end: Option<u64>,
    tail: Option<(u64, u64)>,
    foreign: bool,
) -> bool {
    let Some(a) = f.lookup_address() else {
        return false;
    };
    if tail.is_some_and(|(s, e)| a >= s && a < e) {
        return true;
    }
    let c = cfunc as u64;
    match end {
        Some(e) => a >= c && a < e,
        // Another process's function that no symbol table gives an end: not known.
        None if foreign => false,
        // The function is not in any symbol table we read: ask the symbolizer (cached).
        None => {
            a >= c && fibertrace_core::symbolize::resolve_outer_address(a).function_start == Some(c)
        }
    }
}

/// The merge proper, over an explicit VM map.
pub fn merge<const N: usize>(
    native: &[Frame],
    lua: &[LuaLevel],
    map: &VmMap,
    show_vm: bool,
    out: &mut SmallVec<[Frame; N]>,
) where
    [Frame; N]: smallvec::Array<Item = Frame>,
{
    merge_with_gap(native, lua, None, map, show_vm, out)
}

/// [`merge`] of a Lua stack whose levels have a gap: `gap = (at, n)` puts `Omitted(n)` before
/// level `at` (see [`LuaStack::omitted`]).
pub fn merge_with_gap<const N: usize>(
    native: &[Frame],
    lua: &[LuaLevel],
    gap: Option<(usize, u64)>,
    map: &VmMap,
    show_vm: bool,
    out: &mut SmallVec<[Frame; N]>,
) where
    [Frame; N]: smallvec::Array<Item = Frame>,
{
    let lua_frame = |j: usize, out: &mut SmallVec<[Frame; N]>| {
        if let Some((at, n)) = gap {
            if at == j {
                out.push(Frame::Omitted(n));
            }
        }
        out.push(Frame::Lua(lua[j].id));
    };
    // A native trace cut in its middle (`Omitted`) between VM frames, beside a Lua stack cut
    // in its middle: the native frames left out are those of the same deep middle (the VM's
    // own, between the Lua levels left out, which are not shown), and the Lua gap's marker
    // stands for both — the native one sat after the last Lua level (the fiber's entry
    // function) with a count of frames that are not there. A cut with other code beside it
    // stays.
    let is_vm = |f: Option<&Frame>| {
        f.and_then(Frame::lookup_address)
            .is_none_or(|a| map.is_vm(a))
    };
    let vm_cut = |k: usize| {
        matches!(native[k], Frame::Omitted(_))
            && is_vm(k.checked_sub(1).and_then(|p| native.get(p)))
            && is_vm(native.get(k + 1))
    };
    let filtered: SmallVec<[Frame; 64]>;
    let native = if gap.is_some() && (0..native.len()).any(vm_cut) {
        filtered = (0..native.len())
            .filter(|&k| !vm_cut(k))
            .map(|k| native[k])
            .collect();
        &filtered[..]
    } else {
        native
    };
    let n = native.len();
    let vm: SmallVec<[bool; 64]> = native
        .iter()
        .map(|f| f.lookup_address().is_some_and(|a| map.is_vm(a)))
        .collect();
    let ends: SmallVec<[Option<u64>; 64]> = lua
        .iter()
        .map(|l| {
            l.is_anchor()
                .then(|| map.function_end(l.cfunc as u64))
                .flatten()
        })
        .collect();
    let find_anchor = |from: usize, to: usize, j: usize| -> Option<usize> {
        let l = &lua[j];
        if !l.is_anchor() {
            return None;
        }
        let tail = map.tail_target(l.cfunc as u64);
        (from..to).find(|&k| anchored(&native[k], l.cfunc, ends[j], tail, map.foreign))
    };
    let next = |from: usize, want_vm: bool| (from..n).find(|&k| vm[k] == want_vm).unwrap_or(n);

    let mut i = 0;
    let mut j = 0;
    if !lua.is_empty() {
        if let Some(k) = find_anchor(0, next(0, true), 0) {
            out.extend_from_slice(&native[..=k]);
            lua_frame(0, out);
            i = k + 1;
            j = 1;
        }
    }
    loop {
        while i < n && !vm[i] {
            out.push(native[i]);
            i += 1;
        }
        if i >= n {
            break;
        }
        let v_end = next(i, false);
        // The nearest non-VM segment after this VM stretch where a level left is anchored
        // (the first such level): the next one, as a rule. When it anchors none, a later
        // one: the native code between (a VM-core stretch that runs no Lua, and the C it
        // calls) ran inside that C function — `load` reading its chunk through a Lua reader
        // (`lj_cf_load` … the parser … `reader_func` → the reader), a C library calling an
        // FFI callback (`__call` … `qsort` → the callback). (Emitting every level here put
        // those native frames after the main chunk.)
        let mut anchor = None;
        let mut seg = v_end;
        while seg < n && anchor.is_none() {
            let seg_end = next(seg, true);
            anchor = (j..lua.len()).find_map(|jj| find_anchor(seg, seg_end, jj).map(|k| (jj, k)));
            seg = next(seg_end, false);
        }
        let upto = anchor.map_or(lua.len(), |(jj, _)| jj);
        while j < upto {
            lua_frame(j, out);
            j += 1;
        }
        if show_vm {
            out.extend_from_slice(&native[i..v_end]);
        }
        i = v_end;
        if let Some((_, k)) = anchor {
            // The native frames up to the anchor (the VM's hidden unless shown).
            for kk in v_end..=k {
                if show_vm || !vm[kk] {
                    out.push(native[kk]);
                }
            }
            lua_frame(j, out);
            i = k + 1;
            j += 1;
        }
    }
    // Unplaced levels: at the end, before a final Truncated marker.
    if j < lua.len() {
        let trailing = matches!(out.last(), Some(Frame::Truncated));
        if trailing {
            out.pop();
        }
        for k in j..lua.len() {
            lua_frame(k, out);
        }
        if trailing {
            out.push(Frame::Truncated);
        }
    }
    // A gap after the last level kept (the outermost levels could not be read).
    if let Some((at, n)) = gap {
        if at == lua.len() {
            out.push(Frame::Omitted(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::intern::LuaKind;
    use fibertrace_core::LuaFrameId;

    // Addresses: VM code in [1000, 2000); functions: 100..200 (cfunc A), 300..400 (cfunc B).
    fn map() -> VmMap {
        VmMap::from_ranges(&[(1000, 2000)], &[(100, 200), (300, 400), (500, 600)])
    }
    fn ra(a: u64) -> Frame {
        Frame::Ra(a + 1)
    }
    fn lua_l(id: u32) -> LuaLevel {
        LuaLevel {
            id: LuaFrameId(id),
            kind: LuaKind::Lua,
            cfunc: 0,
            thread: 0,
        }
    }
    fn c_l(id: u32, cfunc: usize) -> LuaLevel {
        LuaLevel {
            id: LuaFrameId(id),
            kind: LuaKind::C,
            cfunc,
            thread: 0,
        }
    }
    fn run(native: &[Frame], lua: &[LuaLevel], show_vm: bool) -> Vec<Frame> {
        let mut out: SmallVec<[Frame; 64]> = SmallVec::new();
        merge(native, lua, &map(), show_vm, &mut out);
        out.to_vec()
    }

    #[test]
    fn callback_lua_callback_lua() {
        // capture (cfunc 100) <- h <- g (cfunc 300) <- f <- main chunk
        let native = [
            ra(50),   // capture's body
            ra(150),  // trampoline of capture (anchor, A)
            ra(1100), // VM
            ra(1200), // VM
            ra(320),  // g's trampoline (anchor, B)
            ra(1300), // VM
            ra(700),  // Rust caller
            Frame::Truncated,
        ];
        let lua = [c_l(1, 100), lua_l(2), c_l(3, 300), lua_l(4), lua_l(5)];
        let got = run(&native, &lua, false);
        let want = vec![
            ra(50),
            ra(150),
            Frame::Lua(LuaFrameId(1)),
            Frame::Lua(LuaFrameId(2)),
            ra(320),
            Frame::Lua(LuaFrameId(3)),
            Frame::Lua(LuaFrameId(4)),
            Frame::Lua(LuaFrameId(5)),
            ra(700),
            Frame::Truncated,
        ];
        assert_eq!(got, want);
        let shown = run(&native, &lua, true);
        assert_eq!(shown.len(), want.len() + 3);
        assert_eq!(shown[4], ra(1100));
    }

    #[test]
    fn fast_functions_fold_into_the_run_and_nearest_anchor_wins() {
        // Two levels share trampoline 100: the nearest native match is taken each time.
        let native = [ra(150), ra(1100), ra(160), ra(1100), ra(800)];
        let lua = [c_l(1, 100), lua_l(2), c_l(9, 0), c_l(3, 100), lua_l(4)];
        let got = run(&native, &lua, false);
        assert_eq!(
            got,
            vec![
                ra(150),
                Frame::Lua(LuaFrameId(1)),
                Frame::Lua(LuaFrameId(2)),
                Frame::Lua(LuaFrameId(9)),
                ra(160),
                Frame::Lua(LuaFrameId(3)),
                Frame::Lua(LuaFrameId(4)),
                ra(800),
            ]
        );
    }

    #[test]
    fn leftover_levels_go_before_a_final_truncated() {
        let native = [ra(150), ra(700), Frame::Truncated];
        let lua = [c_l(1, 100), lua_l(2)];
        assert_eq!(
            run(&native, &lua, false),
            vec![
                ra(150),
                Frame::Lua(LuaFrameId(1)),
                ra(700),
                Frame::Lua(LuaFrameId(2)),
                Frame::Truncated
            ]
        );
        assert_eq!(run(&[], &lua, false).len(), 2);
        assert_eq!(run(&native, &[], false), native.to_vec());
    }
}
