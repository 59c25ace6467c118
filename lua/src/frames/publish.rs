//! What another process needs to read this process's Lua stacks (`fibertrace dump PID` of a
//! `fibertrace run` process, or of any program that runs the Lua host): a header in an ELF
//! section of its own, `.fibertrace.lua`, beside the fiber runtime's `.fibertrace.registry`.
//! Each Lua fiber's control block carries its `lua_State` (the layer word); with this header
//! a reader walks that state's frames from outside (see [`super::foreign`]).
//!
//! The header has a magic, a version, which VM the process runs, and the layout of the
//! VM's objects a reader needs ([`Layout`]): where `lua_State` keeps its stack, base, top
//! and status; where a function keeps its kind, prototype and C function; where a prototype
//! keeps its chunk name, lines, constants and variable names; the string header; and the
//! bytecode numbers and mode table (`lj_bc_mode`, read from memory) that name a function
//! from its caller's call instruction, as LuaJIT's own `lua_getinfo` does.
//!
//! LuaJIT's structures are C structures of its own headers, which Rust cannot see: the
//! layout here is the one of LuaJIT 2.1 with 64-bit references (GC64, the x86-64 default).
//! It is *checked against the running VM* once, when the first Lua host is set up
//! ([`check`]): a state's stack, a Lua function's prototype (chunk name, first line, line
//! count), a C function's pointer and the bytecode modes of every instruction used are read
//! through this layout and compared with what the Lua API says. The header's `checked` word
//! says the outcome, and a reader refuses a layout that was not checked or did not match
//! (it says why) — a LuaJIT of another layout gives no Lua frames, never wrong ones.
//! A Lua 5.4 build publishes the header with its VM kind and no layout: its frames are not
//! read from outside (the reader says so).
//!
//! After the layout, where LuaJIT keeps the state of the code running now ([`JitLayout`]:
//! the VM state, the running state, a trace's entry base, the trace array), with a check word
//! of its own: checked from a C function Lua calls (VM state "C", the running state the one
//! called on, no trace) and against the registry's address. A header from before it ends
//! where it begins; a reader then reads suspended stacks only. Last, where a trace keeps its
//! snapshots ([`TraceLayout`]), which give compiled code's frames and lines.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use mlua::ffi;

/// The magic at the start of the header.
pub const MAGIC: [u8; 16] = *b"fibertrace-lua\0\0";
/// The version of the header's meanings.
pub const VERSION: u32 = 1;
/// `vm`: LuaJIT 2.1 with 64-bit references (GC64).
pub const VM_LUAJIT_GC64: u32 = 1;
/// `vm`: Lua 5.4 (no layout published).
pub const VM_LUA54: u32 = 2;

/// `checked`: the layout was not checked yet (no Lua host was set up).
pub const UNCHECKED: u32 = 0;
/// `checked`: the layout matches the running VM.
pub const MATCHES: u32 = 1;
/// `checked`: the layout does not match the running VM (another LuaJIT).
pub const MISMATCH: u32 = 2;

/// Where a reader finds what it needs in LuaJIT's objects (byte offsets, sizes; all plain
/// integers, so any bytes are a value of it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// `lua_State`: `u8` status, and the `TValue *` base, top and stack.
    pub state_status: u32,
    pub state_base: u32,
    pub state_top: u32,
    pub state_stack: u32,
    /// A function (`GCfunc`): `u8` fast-function id (0 Lua, 1 C, above: built-in), `u8`
    /// upvalue count, the bytecode pointer (`pc`: just after the prototype), the C function,
    /// and a C function's first upvalue (a `TValue`).
    pub func_ffid: u32,
    pub func_nupvalues: u32,
    pub func_pc: u32,
    pub func_cfunc: u32,
    pub func_c_upvalue: u32,
    /// A prototype (`GCproto`): its size (the bytecode follows it), `u32` instruction count,
    /// the constants' middle (`k`; strings at negative indices), the chunk name (a string),
    /// `u32` first line and line count, and the line, upvalue-name and variable-name arrays.
    pub proto_size: u32,
    pub proto_sizebc: u32,
    pub proto_k: u32,
    pub proto_chunkname: u32,
    pub proto_firstline: u32,
    pub proto_numline: u32,
    pub proto_lineinfo: u32,
    pub proto_uvinfo: u32,
    pub proto_varinfo: u32,
    /// A string (`GCstr`): its size (the bytes follow it) and `u32` length.
    pub str_size: u32,
    pub str_len: u32,
    /// Bytecode numbers: `MOV`, `KNIL`, `GGET`, `TGETS`, `UGET`, `ITERC`, `FUNCC` (a C
    /// function's pseudo-instruction; `FUNCCW` follows it, and is the last instruction); the
    /// metamethod numbers `MM_call` and `MM__MAX` (the bytecode mode's "none").
    pub op_mov: u8,
    pub op_knil: u8,
    pub op_gget: u8,
    pub op_tgets: u8,
    pub op_uget: u8,
    pub op_iterc: u8,
    pub op_funcc: u8,
    pub mm_call: u8,
    pub mm_max: u8,
}

impl Layout {
    /// LuaJIT 2.1's layout with 64-bit references (what [`check`] verifies).
    pub const LUAJIT_GC64: Layout = Layout {
        state_status: 11,
        state_base: 32,
        state_top: 40,
        state_stack: 56,
        func_ffid: 10,
        func_nupvalues: 11,
        func_pc: 32,
        func_cfunc: 40,
        func_c_upvalue: 48,
        proto_size: 104,
        proto_sizebc: 12,
        proto_k: 32,
        proto_chunkname: 64,
        proto_firstline: 72,
        proto_numline: 76,
        proto_lineinfo: 80,
        proto_uvinfo: 88,
        proto_varinfo: 96,
        str_size: 24,
        str_len: 20,
        op_mov: 18,
        op_knil: 44,
        op_gget: 54,
        op_tgets: 57,
        op_uget: 45,
        op_iterc: 69,
        op_funcc: 102,
        mm_call: 9,
        mm_max: 22,
    };
}

/// Where a reader finds what LuaJIT keeps of the code running now (byte offsets): the state's
/// global state and stack end, the global state's VM state (a trace's number while compiled
/// code runs), the state running now, the frame base a trace was entered with, the trace
/// array (from the global state: LuaJIT's `jit_State` follows it) and its size, and a
/// trace's start prototype, start instruction and number. With them a reader finds the Lua
/// frames of a fiber caught running Lua code (see [`super::foreign`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JitLayout {
    pub state_glref: u32,
    pub state_maxstack: u32,
    pub g_vmstate: u32,
    pub g_registrytv: u32,
    pub g_cur_l: u32,
    pub g_jit_base: u32,
    pub g_traces: u32,
    pub g_sizetrace: u32,
    pub trace_startpt: u32,
    pub trace_startpc: u32,
    pub trace_traceno: u32,
}

impl JitLayout {
    /// LuaJIT 2.1's (GC64, x86-64): `global_State` fields, and `jit_State`'s `trace` and
    /// `sizetrace` from the global state (`GG_State`: the global state at 96, the JIT state at
    /// 840). The check verifies all but the trace's, which a reader checks against the VM state
    /// (the trace's number) and the frame it was entered with.
    pub const LUAJIT_GC64: JitLayout = JitLayout {
        state_glref: 16,
        state_maxstack: 48,
        g_vmstate: 184,
        g_registrytv: 272,
        g_cur_l: 376,
        g_jit_base: 384,
        g_traces: 840 - 96 + 384,
        g_sizetrace: 840 - 96 + 396,
        trace_startpt: 64,
        trace_startpc: 72,
        trace_traceno: 104,
    };
}

/// Where a reader finds a trace's snapshots (byte offsets and sizes): with them, the Lua
/// frames of compiled code at a point of its machine code — the functions the trace inlined
/// and the line it runs — as LuaJIT's own exit from the trace would restore them (see
/// [`super::foreign`]). A trace's fields: `u16` snapshot count, the IR array (biased by
/// `REF_BIAS`), `u32` lowest constant, `u32` snapshot-map length, the snapshot array, the
/// snapshot map, `u32` machine-code size and the machine code; a snapshot's size, its `u16`
/// machine-code offset and `u8` entry count (its map offset is its first `u32`); the IR
/// opcodes of a garbage-collected constant and a 64-bit number constant; where the JIT state
/// names the trace exit in progress. Not checked at the
/// start (no trace exists then): a reader checks each against the trace it reads (its
/// number, its machine code holding the address, the snapshot's map inside the map, the
/// frames found making a chain down to the trace's base, the PC inside its function).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceLayout {
    pub trace_nsnap: u32,
    pub trace_ir: u32,
    pub trace_nk: u32,
    pub trace_nsnapmap: u32,
    pub trace_snap: u32,
    pub trace_snapmap: u32,
    pub trace_szmcode: u32,
    pub trace_mcode: u32,
    pub snap_size: u32,
    pub snap_mcofs: u32,
    pub snap_nent: u32,
    pub ir_kgc: u32,
    pub ir_knum: u32,
    /// From the global state, the `u32` trace and snapshot numbers of the trace exit in
    /// progress (`jit_State`'s `parent` and `exitno`).
    pub g_exit_trace: u32,
    pub g_exit_snap: u32,
}

impl TraceLayout {
    /// LuaJIT 2.1's (GC64, x86-64): `GCtrace`, `SnapShot` and `IROp` of `lj_jit.h` and
    /// `lj_ir.h`.
    pub const LUAJIT_GC64: TraceLayout = TraceLayout {
        trace_nsnap: 10,
        trace_ir: 32,
        trace_nk: 40,
        trace_nsnapmap: 44,
        trace_snap: 48,
        trace_snapmap: 56,
        trace_szmcode: 84,
        trace_mcode: 88,
        snap_size: 12,
        snap_mcofs: 6,
        snap_nent: 10,
        ir_kgc: 24,
        ir_knum: 28,
        g_exit_trace: 840 - 96 + 3016,
        g_exit_snap: 840 - 96 + 3020,
    };
}

/// The payload of a 64-bit reference (`LJ_GCVMASK`).
pub(crate) const GCV_MASK: u64 = (1 << 47) - 1;

/// The header a reader finds in `.fibertrace.lua`.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: [u8; 16],
    /// [`VERSION`].
    pub version: u32,
    /// `size_of::<Header>()`.
    pub header_size: u32,
    /// [`VM_LUAJIT_GC64`] or [`VM_LUA54`].
    pub vm: u32,
    /// `size_of::<usize>()` of the writer.
    pub pointer_size: u32,
    /// [`UNCHECKED`], [`MATCHES`] or [`MISMATCH`] (a `u32`).
    pub checked: &'static AtomicU32,
    /// The address of LuaJIT's bytecode mode table (`u16` per instruction; 0 until checked).
    pub bc_mode: &'static AtomicU64,
    /// The layout (meaningful for [`VM_LUAJIT_GC64`]).
    pub layout: Layout,
    /// The outcome of the check of [`Header::jit`] (as `checked`; added after version 1's
    /// first form: a reader finds it only in a header whose size covers it).
    pub jit_checked: &'static AtomicU32,
    /// Where the running code's state is ([`JitLayout`]).
    pub jit: JitLayout,
    /// Where a trace's snapshots are ([`TraceLayout`]; added after the running code's
    /// layout: a reader finds it only in a header whose size covers it, and uses it only
    /// where that layout was checked).
    pub trace: TraceLayout,
}

static CHECKED: AtomicU32 = AtomicU32::new(UNCHECKED);
static BC_MODE: AtomicU64 = AtomicU64::new(0);
static JIT_CHECKED: AtomicU32 = AtomicU32::new(UNCHECKED);

/// The header, in a section of its own (see the module doc).
#[used]
#[link_section = ".fibertrace.lua"]
pub static HEADER: Header = Header {
    magic: MAGIC,
    version: VERSION,
    header_size: std::mem::size_of::<Header>() as u32,
    vm: if cfg!(feature = "luajit") {
        VM_LUAJIT_GC64
    } else {
        VM_LUA54
    },
    pointer_size: std::mem::size_of::<usize>() as u32,
    checked: &CHECKED,
    bc_mode: &BC_MODE,
    layout: Layout::LUAJIT_GC64,
    jit_checked: &JIT_CHECKED,
    jit: JitLayout::LUAJIT_GC64,
    trace: TraceLayout::LUAJIT_GC64,
};

/// Where the VM state of `l`'s global state is (an `i32`: `~LJ_VMST_GC` while the collector
/// runs, the JIT compiler's states while it records and assembles a trace), when the
/// layout of the running code's state was checked and matched; `None` otherwise (Lua 5.4,
/// another LuaJIT).
///
/// # Safety
/// `l` is a valid state of the linked Lua.
pub unsafe fn vmstate_of(l: *mut ffi::lua_State) -> Option<*const i32> {
    if !cfg!(feature = "luajit") || JIT_CHECKED.load(Ordering::Acquire) != MATCHES {
        return None;
    }
    let lay = &HEADER.jit;
    // SAFETY: per the contract, `l` is a live state; the checked layout says its global
    // state's address is at this offset (a plain pointer under GC64).
    let g = unsafe {
        std::ptr::read_unaligned((l as usize + lay.state_glref as usize) as *const usize)
    };
    (g != 0).then(|| (g + lay.g_vmstate as usize) as *const i32)
}

/// The outcome of the check so far ([`UNCHECKED`], [`MATCHES`], [`MISMATCH`]).
pub fn checked() -> u32 {
    CHECKED.load(Ordering::Acquire)
}

/// Checks the published layout against the running VM, once per process (the first call
/// does it; see the module doc), with `l` a state of a Lua host being set up; returns the
/// outcome, with what did not match.
///
/// # Safety
/// `l` is a valid state of the linked Lua, used only by this thread during the call.
pub unsafe fn check(l: *mut ffi::lua_State) -> Result<(), String> {
    // A reference the linker sees: a section nothing refers to may be dropped.
    std::hint::black_box(&HEADER);
    static ONCE: std::sync::Mutex<Option<Result<(), String>>> = std::sync::Mutex::new(None);
    let mut once = ONCE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = &*once {
        return r.clone();
    }
    // SAFETY: forwarded contract.
    let r = unsafe { imp::check(l, &HEADER.layout) };
    match &r {
        Ok(bc) => {
            BC_MODE.store(*bc, Ordering::Relaxed);
            // SAFETY: forwarded contract; the main layout matched (the state's own fields).
            let jit = unsafe { imp::check_jit(l, &HEADER.jit) };
            JIT_CHECKED.store(
                if jit.is_ok() { MATCHES } else { MISMATCH },
                Ordering::Release,
            );
            CHECKED.store(MATCHES, Ordering::Release);
        }
        Err(_) => CHECKED.store(MISMATCH, Ordering::Release),
    }
    let r = r.map(|_| ());
    *once = Some(r.clone());
    r
}

#[cfg(feature = "luajit")]
mod imp {
    use super::{ffi, JitLayout, Layout};

    /// Entries of LuaJIT's mode table this code reads: up to `FUNCCW` (the last
    /// instruction; `Layout::op_funcc + 1`).
    pub(super) const MODES: usize = Layout::LUAJIT_GC64.op_funcc as usize + 2;

    // SAFETY: LuaJIT's bytecode mode table, a constant array of `u16`, one per instruction,
    // in the statically linked LuaJIT: `MODES` of them in the LuaJIT this layout is for (an
    // older one has fewer: the read of the last ones then reads the constant data after
    // the table, which the check finds does not match, and says so).
    unsafe extern "C" {
        static lj_bc_mode: [u16; MODES];
    }

    /// Bytecode operand modes (LuaJIT's `BCMode` numbers), as this check needs them.
    const BCM_NONE: u16 = 0;
    const BCM_DST: u16 = 1;
    const BCM_BASE: u16 = 2;
    const BCM_VAR: u16 = 3;
    const BCM_RBASE: u16 = 4;
    const BCM_UV: u16 = 5;
    const BCM_LIT: u16 = 6;
    const BCM_STR: u16 = 10;

    fn mode(a: u16, b: u16, c: u16, mm: u8) -> u16 {
        a | (b << 3) | (c << 7) | ((mm as u16) << 11)
    }

    unsafe extern "C-unwind" fn probe_c(_: *mut ffi::lua_State) -> std::ffi::c_int {
        0
    }

    /// # Safety
    /// `p` .. `p + 8` readable.
    unsafe fn rd<T: Copy>(p: usize) -> T {
        // SAFETY: the caller's contract; unaligned-safe read of a plain integer.
        unsafe { std::ptr::read_unaligned(p as *const T) }
    }

    /// Checks `lay` against the VM `l` runs; `Ok`: the address of the bytecode mode table.
    ///
    /// # Safety
    /// `l` is a valid state used only by this thread during the call.
    pub(super) unsafe fn check(l: *mut ffi::lua_State, lay: &Layout) -> Result<u64, String> {
        let o = |v: u32| v as usize;
        // Every read below is of an object the Lua API just handed out (a state, a function,
        // its prototype, its chunk name, a C function's pseudo-instruction), at offsets inside
        // those objects if the layout is right; if it is wrong, the reads stay inside the
        // first 112 bytes of a live heap object (all offsets are below that) or follow a
        // pointer read from one only after the first checks passed, which the values compared
        // make unlikely to be wild; the mode table is read through its declared array, with
        // bounds checks. The stack is restored before returning.
        // SAFETY: reads of live objects the API handed out, as said just above.
        unsafe {
            ffi::lua_checkstack(l, 8);
            let top0 = ffi::lua_gettop(l);
            let done = |r: Result<u64, String>| {
                ffi::lua_settop(l, top0);
                r
            };
            // A state: three values pushed on a new thread.
            let th = ffi::lua_newthread(l);
            for i in 0..3 {
                ffi::lua_pushinteger(th, i);
            }
            let t = th as usize;
            let base: usize = rd(t + o(lay.state_base));
            let top: usize = rd(t + o(lay.state_top));
            let stack: usize = rd(t + o(lay.state_stack));
            let status: u8 = rd(t + o(lay.state_status));
            if top.wrapping_sub(base) != 3 * 8 || stack == 0 || stack > base || status != 0 {
                return done(Err(format!(
                    "lua_State: base/top/stack/status read {base:#x}/{top:#x}/{stack:#x}/{status}"
                )));
            }
            // A Lua function from a known chunk, defined on line 3, one line long.
            let src = b"\n\nreturn function(a)\n  return a end";
            let name = c"=fibertrace-probe";
            if ffi::luaL_loadbuffer(l, src.as_ptr().cast(), src.len(), name.as_ptr()) != 0
                || ffi::lua_pcall(l, 0, 1, 0) != 0
            {
                return done(Err("the probe chunk did not load".into()));
            }
            let f = ffi::lua_topointer(l, -1) as usize;
            let ffid: u8 = rd(f + o(lay.func_ffid));
            let pc: usize = rd(f + o(lay.func_pc));
            if ffid != 0 || pc < o(lay.proto_size) {
                return done(Err(format!("Lua function: ffid {ffid}, pc {pc:#x}")));
            }
            let pt = pc - o(lay.proto_size);
            let firstline: u32 = rd(pt + o(lay.proto_firstline));
            let numline: u32 = rd(pt + o(lay.proto_numline));
            let sizebc: u32 = rd(pt + o(lay.proto_sizebc));
            let chunk: usize = rd(pt + o(lay.proto_chunkname));
            if firstline != 3 || numline != 1 || sizebc == 0 || sizebc > 16 || chunk == 0 {
                return done(Err(format!(
                    "prototype: first line {firstline}, {numline} lines, {sizebc} instructions"
                )));
            }
            let len: u32 = rd(chunk + o(lay.str_len));
            let want = name.to_bytes();
            if len as usize != want.len()
                || std::slice::from_raw_parts((chunk + o(lay.str_size)) as *const u8, want.len())
                    != want
            {
                return done(Err(format!("chunk name: length {len}")));
            }
            // A C function.
            ffi::lua_pushcfunction(l, probe_c);
            let c = ffi::lua_topointer(l, -1) as usize;
            let cffid: u8 = rd(c + o(lay.func_ffid));
            let cf: usize = rd(c + o(lay.func_cfunc));
            let cpc: usize = rd(c + o(lay.func_pc));
            if cffid != 1 || cf != probe_c as *const () as usize || cpc == 0 {
                return done(Err(format!("C function: ffid {cffid}")));
            }
            // Its pseudo-instruction (the global state's `bc_cfunc_ext`): FUNCC.
            let cop = (rd::<u32>(cpc) & 0xff) as u8;
            if cop != lay.op_funcc {
                return done(Err(format!(
                    "C function: instruction {cop}, not FUNCC ({})",
                    lay.op_funcc
                )));
            }
            // The bytecode modes of the instructions a reader decodes.
            let bc = std::ptr::addr_of!(lj_bc_mode);
            let m = |op: u8| (*bc).get(op as usize).copied().unwrap_or(0);
            let none = lay.mm_max;
            let want = [
                (lay.op_mov, mode(BCM_DST, BCM_NONE, BCM_VAR, none), "MOV"),
                (
                    lay.op_knil,
                    mode(BCM_BASE, BCM_NONE, BCM_BASE, none),
                    "KNIL",
                ),
                (lay.op_gget, mode(BCM_DST, BCM_NONE, BCM_STR, 0), "GGET"),
                (lay.op_tgets, mode(BCM_DST, BCM_VAR, BCM_STR, 0), "TGETS"),
                (lay.op_uget, mode(BCM_DST, BCM_NONE, BCM_UV, none), "UGET"),
                (
                    lay.op_iterc,
                    mode(BCM_BASE, BCM_LIT, BCM_LIT, lay.mm_call),
                    "ITERC",
                ),
                (
                    lay.op_funcc,
                    mode(BCM_RBASE, BCM_NONE, BCM_NONE, none),
                    "FUNCC",
                ),
                (
                    lay.op_funcc.wrapping_add(1),
                    mode(BCM_RBASE, BCM_NONE, BCM_NONE, none),
                    "FUNCCW",
                ),
            ];
            for (op, want, what) in want {
                if m(op) != want {
                    return done(Err(format!(
                        "bytecode {what} ({op}) has mode {:#x}, not {want:#x}",
                        m(op)
                    )));
                }
            }
            done(Ok(bc as u64))
        }
    }

    /// What the probe C function read of the global state: VM state, running state, trace
    /// base, and the state it was called on.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    struct Seen {
        vmstate: i32,
        cur_l: usize,
        jit_base: usize,
        called_on: usize,
    }

    thread_local! {
        static SEEN: std::cell::Cell<Option<(JitLayout, Seen)>> =
            const { std::cell::Cell::new(None) };
    }

    unsafe extern "C-unwind" fn probe_vm(l: *mut ffi::lua_State) -> std::ffi::c_int {
        SEEN.with(|s| {
            if let Some((lay, _)) = s.get() {
                let o = |v: u32| v as usize;
                // SAFETY: `l` is the running state; its global state's address was checked
                // by `check_jit` before it called this (two states agree on it, and the
                // registry is where the layout says), and the offsets read are inside it.
                let seen = unsafe {
                    let g: usize = rd(l as usize + o(lay.state_glref));
                    Seen {
                        vmstate: rd(g + o(lay.g_vmstate)),
                        cur_l: rd(g + o(lay.g_cur_l)),
                        jit_base: rd(g + o(lay.g_jit_base)),
                        called_on: l as usize,
                    }
                };
                s.set(Some((lay, seen)));
            }
        });
        0
    }

    /// Checks `lay` against the VM `l` runs (whose main layout matched): the global state of
    /// two states, its registry, and — from a C function that Lua calls — the VM state (C),
    /// the running state (the one called on) and the trace base (none).
    ///
    /// # Safety
    /// `l` is a valid state used only by this thread during the call.
    pub(super) unsafe fn check_jit(l: *mut ffi::lua_State, lay: &JitLayout) -> Result<(), String> {
        let o = |v: u32| v as usize;
        // SAFETY: reads of the states the API handed out at the offset checked first (two
        // states of one VM agree on their global state, a heap object of ~6 KiB that every
        // offset read is inside of); the stack is restored before returning.
        unsafe {
            ffi::lua_checkstack(l, 4);
            let top0 = ffi::lua_gettop(l);
            let done = |r: Result<(), String>| {
                ffi::lua_settop(l, top0);
                r
            };
            let th = ffi::lua_newthread(l);
            let g: usize = rd(l as usize + o(lay.state_glref));
            let g2: usize = rd(th as usize + o(lay.state_glref));
            if g == 0 || g != g2 || !g.is_multiple_of(8) {
                return done(Err(format!("global state: {g:#x} and {g2:#x}")));
            }
            ffi::lua_pushvalue(l, ffi::LUA_REGISTRYINDEX);
            let reg = ffi::lua_topointer(l, -1) as u64;
            let tv: u64 = rd(g + o(lay.g_registrytv));
            if tv & super::GCV_MASK != reg {
                return done(Err(format!("registry: {tv:#x}, not {reg:#x}")));
            }
            SEEN.with(|s| s.set(Some((*lay, Seen::default()))));
            ffi::lua_pushcfunction(th, probe_vm);
            let rc = ffi::lua_pcall(th, 0, 0, 0);
            let seen = SEEN.with(|s| s.take()).map(|(_, s)| s).unwrap_or_default();
            let want = Seen {
                vmstate: -2,
                cur_l: th as usize,
                jit_base: 0,
                called_on: th as usize,
            };
            if rc != 0 || seen != want {
                return done(Err(format!("running state: {seen:?}, not {want:?}")));
            }
            done(Ok(()))
        }
    }
}

#[cfg(not(feature = "luajit"))]
mod imp {
    use super::{ffi, Layout};

    /// # Safety
    /// Nothing is read.
    pub(super) unsafe fn check(_: *mut ffi::lua_State, _: &Layout) -> Result<u64, String> {
        Err("Lua 5.4's frames are not published for other processes".into())
    }

    /// # Safety
    /// Nothing is read.
    pub(super) unsafe fn check_jit(
        _: *mut ffi::lua_State,
        _: &super::JitLayout,
    ) -> Result<(), String> {
        Err("Lua 5.4's frames are not published for other processes".into())
    }
}

#[cfg(all(test, feature = "luajit"))]
mod tests {
    use super::*;

    #[test]
    fn the_layout_matches_the_linked_luajit_and_a_wrong_one_is_found() {
        let lua = mlua::Lua::new();
        let l = lua.current_thread();
        // SAFETY: the main state of a Lua used by this thread only.
        let ok = unsafe { imp::check(l.state(), &Layout::LUAJIT_GC64) };
        assert!(ok.is_ok(), "{ok:?}");
        let wrong = [
            (
                Layout {
                    state_top: 48,
                    ..Layout::LUAJIT_GC64
                },
                "lua_State",
            ),
            (
                Layout {
                    proto_firstline: 76,
                    ..Layout::LUAJIT_GC64
                },
                "prototype",
            ),
            (
                Layout {
                    func_cfunc: 32,
                    ..Layout::LUAJIT_GC64
                },
                "C function",
            ),
            (
                Layout {
                    op_uget: 44,
                    ..Layout::LUAJIT_GC64
                },
                "bytecode UGET (44)",
            ),
            (
                Layout {
                    op_funcc: 101,
                    ..Layout::LUAJIT_GC64
                },
                "C function: instruction 102, not FUNCC (101)",
            ),
        ];
        for (lay, what) in wrong {
            // SAFETY: as above; a wrong layout reads within the probe objects (see `check`).
            let e = unsafe { imp::check(l.state(), &lay) }.unwrap_err();
            assert!(e.starts_with(what), "{what}: {e}");
        }
        // SAFETY: as above.
        let jit = unsafe { imp::check_jit(l.state(), &JitLayout::LUAJIT_GC64) };
        assert_eq!(jit, Ok(()));
        let wrong = [
            (
                JitLayout {
                    g_registrytv: 264,
                    ..JitLayout::LUAJIT_GC64
                },
                "registry",
            ),
            (
                JitLayout {
                    g_cur_l: 368,
                    ..JitLayout::LUAJIT_GC64
                },
                "running state",
            ),
            (
                JitLayout {
                    g_vmstate: 188,
                    ..JitLayout::LUAJIT_GC64
                },
                "running state",
            ),
        ];
        for (lay, what) in wrong {
            // SAFETY: as above; the offsets stay inside the global state.
            let e = unsafe { imp::check_jit(l.state(), &lay) }.unwrap_err();
            assert!(e.starts_with(what), "{what}: {e}");
        }
        // The published one, through the once-only entry.
        // SAFETY: as above.
        assert_eq!(unsafe { check(l.state()) }, Ok(()));
        assert_eq!(checked(), MATCHES);
        assert_eq!(JIT_CHECKED.load(Ordering::Relaxed), MATCHES);
    }
}
