//! Lua frames of another process: a LuaJIT state's stack read from its memory, with the
//! layout the process published ([`super::publish`]), into the same [`LuaStack`] that
//! [`super::capture_lua_stack`] gives in-process (levels interned in *this* process's table).
//!
//! The walk is LuaJIT's own `lua_getstack`/`lua_getinfo("Slnf")` done from outside: from the
//! state's base down its frame links (a Lua frame's link is its caller's PC, whose call
//! instruction gives the caller's frame size; other frames carry a delta), dummy frames and
//! the lower half of a vararg frame skipped; per level, the function's kind, chunk name,
//! first line, current line (its caller's PC in the line table) and the name its caller
//! knows it by (decoded from the caller's call instruction: a global, field, method, local
//! or upvalue, or the metamethod the instruction invokes). Coroutines running inside the
//! state are followed as in-process (a C level holding a running thread in its first
//! upvalue or first argument). Levels beyond [`super::MAX_LEVELS`] are cut as in-process.
//!
//! Invariants: every read is bounded (frames per thread, threads, bytes of a name); a
//! frame link that does not go down the stack, or a read that fails, ends the walk with an
//! error that says where, never a loop or a wild read (the memory is read through
//! [`Memory`], which fails on an unmapped address).
//!
//! How a result can differ from the target's own `lua_getinfo`: the current line of a Lua
//! function on top of a state (only when a hook or error handler runs) and of a Lua
//! function below a frame called from C by the runtime (a `__gc` finalizer, an error
//! handler) need LuaJIT's C-frame chain, which is not read: the line is `-1` there; a PC
//! inside a trace's exit stub (after `lj_trace_exit` patched it) gives `-1` too. A state
//! that runs while it is read (a non-blocking dump) may give a torn walk: the caller checks
//! the fiber did not switch meanwhile.
//!
//! A state caught running Lua code ([`Reader::running_top`]) has no current base of its own:
//! in the interpreter it is the thread's register, in compiled code the base the trace was
//! entered with. Each is used only after it checks out (inside the running state's stack,
//! below a Lua function, the interpreter's PC inside that function's code). In a trace, the
//! frames are its snapshot's nearest before the thread's PC or the return address of its
//! call out (`snapshot`): the functions it inlined are levels, the line the snapshot's — with
//! Lua safe points on (LuaJIT's profiler in line mode), a trace takes a snapshot at every
//! line and function it enters, so the line and function are the code's; without them, a
//! trace's snapshots are at its guards only, and a function entered after the last guard
//! before the address is missing, its caller's line shown. Where no snapshot checks out (no
//! address in the trace's code is known: a dump that does not hold the thread), a function
//! the trace inlined has no level, and the innermost level's line is the trace's start (the
//! loop's head), `-1` when the trace starts in another function. The native frames
//! below a trace are walked from the record of the call that entered the VM
//! ([`Reader::vm_entry_record`]): a fixed offset into LuaJIT's C frame (`L->cframe`) of
//! LuaJIT 2.1's x86-64 GC64 build, the one the published layout is checked against; another
//! layout of that frame would send the walk to a wrong record, which the walk's bounds stop
//! (it ends or shows a wrong caller, never reads outside the stack).

use std::collections::HashMap;

use smallvec::SmallVec;

use super::intern::{self, LuaKind, RawInfo};
use super::publish::{self, Header, JitLayout, Layout, TraceLayout, GCV_MASK};
use super::{LuaLevel, LuaStack, HEAD_LEVELS, MAX_LEVELS, MAX_THREADS};

mod snapshot;

/// Another process's memory.
pub trait Memory {
    /// Fills `out` from address `addr`; `false` if any of it cannot be read.
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool;
}

impl Memory for fibertrace_core::remote::Session {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        fibertrace_core::remote::Session::read(self, addr, out)
    }
}

/// This process's memory read as another's: an address that is not mapped is a failed read.
pub struct SelfMem;

impl Memory for SelfMem {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        let local = libc::iovec {
            iov_base: out.as_mut_ptr().cast(),
            iov_len: out.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: out.len(),
        };
        // SAFETY: process_vm_readv writes at most `out.len()` bytes into `out` and reads the
        // other range through the kernel (an unmapped address is an error, not a fault).
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        n == out.len() as isize
    }
}

/// This process's memory read in place, a read of an unmapped address failing instead of
/// faulting (`ProbeReads`: the fault handler resumes it as a failure): [`SelfMem`] without
/// its system call per read, where the handler is in place on this thread.
pub struct ProbeMem<'a>(pub &'a fibertrace_fiber::embed::overflow::ProbeReads);

impl Memory for ProbeMem<'_> {
    #[inline]
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        self.0.read(addr, out)
    }
}

/// Bytes of one block of [`Blocks`] (aligned: a block never spans two pages, so a block
/// of mapped memory is read whole).
const BLOCK: usize = 256;
/// Blocks [`Blocks`] keeps.
const BLOCKS: usize = 8;

/// Reads through `inner` (memory that does not change while this is used: a thread held in
/// the allocator for one capture) in aligned blocks, keeping the last eight: the reads
/// of one stack's walk — a thread's slots, a prototype's header, its line and name tables —
/// mostly fall in blocks already read, one read of `inner` (a system call for [`SelfMem`])
/// instead of one each. A read larger than a few blocks goes to `inner` whole.
pub struct Blocks<M> {
    inner: M,
    /// Each block's address (`u64::MAX`: none) and bytes.
    at: [u64; BLOCKS],
    bytes: [[u8; BLOCK]; BLOCKS],
    /// The next block to replace.
    next: usize,
}

impl<M: Memory> Blocks<M> {
    /// A cache in front of `inner`, empty.
    pub fn new(inner: M) -> Blocks<M> {
        Blocks {
            inner,
            at: [u64::MAX; BLOCKS],
            bytes: [[0; BLOCK]; BLOCKS],
            next: 0,
        }
    }

    /// The index of the block at `base` (aligned), read now if it is not kept.
    fn block(&mut self, base: u64) -> Option<usize> {
        if let Some(i) = self.at.iter().position(|&a| a == base) {
            return Some(i);
        }
        let i = self.next;
        self.next = (i + 1) % BLOCKS;
        self.at[i] = u64::MAX;
        if !self.inner.read(base, &mut self.bytes[i]) {
            return None;
        }
        self.at[i] = base;
        Some(i)
    }
}

impl<M: Memory> Memory for Blocks<M> {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        let Some(end) = addr.checked_add(out.len() as u64) else {
            return false;
        };
        if out.len() > BLOCK * (BLOCKS / 2) {
            return self.inner.read(addr, out);
        }
        let mut at = addr;
        while at < end {
            let base = at & !(BLOCK as u64 - 1);
            let Some(i) = self.block(base) else {
                // (A block partly unmapped cannot be: it is within one page. The exact
                // range, for what it says.)
                return self.inner.read(addr, out);
            };
            let from = (at - base) as usize;
            let n = (BLOCK - from).min((end - at) as usize);
            let o = (at - addr) as usize;
            out[o..o + n].copy_from_slice(&self.bytes[i][from..from + n]);
            at += n as u64;
        }
        true
    }
}

/// Frames read per thread at most (LuaJIT's own stack limit is about 65,500 slots).
const MAX_FRAMES: usize = 1 << 16;
/// Time one stack's read may take at most (its target may be held stopped meanwhile).
const MAX_TIME: std::time::Duration = std::time::Duration::from_secs(2);
/// Bytes the caches keep at most.
const MAX_CACHED_BYTES: usize = 16 << 20;
/// Bytes of a string read at most (chunk names loaded from text carry the whole text).
const MAX_STR: usize = 4096;
/// Bytes of a prototype's variable-name list read at most.
const MAX_VARINFO: u64 = 1 << 20;
/// Bytes of variable and upvalue names one name's search reads at most, over all its
/// restarts (each `MOV` it follows restarts it).
const NAME_BUDGET: usize = 64 << 10;
/// Time all the stacks one reader reads may take together (a target stopped meanwhile is
/// let go at most this late because of them, whatever its memory holds).
const MAX_TOTAL_TIME: std::time::Duration = std::time::Duration::from_secs(10);
/// LuaJIT's `LUA_IDSIZE` (the printable source's room, with its NUL).
const IDSIZE: usize = 60;
/// LuaJIT's VM state while its collector runs (`~LJ_VMST_GC`).
const VMST_GC: i32 = !2;
/// LuaJIT's VM state while a trace exits (`lj_trace_exit`, the snapshot restored).
const VMST_EXIT: i32 = !3;
/// The VM states of the interpreter, of the trace recorder (the interpreter runs each
/// instruction it records), and of the JIT compiler's optimiser and assembler.
const VMST_INTERP: i32 = !0;
const VMST_RECORD: i32 = !4;
const VMST_OPT: i32 = !5;
const VMST_ASM: i32 = !6;

/// Whether the interpreter is the one running Lua code in VM state `vmstate` (not compiled
/// code, the collector, C code Lua called or a trace's exit).
fn interpreting(vmstate: i32) -> bool {
    [VMST_INTERP, VMST_RECORD, VMST_OPT, VMST_ASM].contains(&vmstate)
}
/// The type tags of a thread and a function in a 64-bit `TValue` (`~6`, `~8`).
const T_THREAD: u32 = !6;
const T_FUNC: u32 = !8;
/// The names LuaJIT gives the for-loop's hidden variables (`VARNAME_*`, 1 to 6).
const HIDDEN_VARS: [&str; 6] = [
    "(for index)",
    "(for limit)",
    "(for step)",
    "(for generator)",
    "(for state)",
    "(for control)",
];
/// Metamethod names by number (LuaJIT's `MMS` order, FFI and 5.2 extensions included).
const MM_NAMES: [&str; 22] = [
    "__index",
    "__newindex",
    "__gc",
    "__mode",
    "__eq",
    "__len",
    "__lt",
    "__le",
    "__concat",
    "__call",
    "__add",
    "__sub",
    "__mul",
    "__div",
    "__mod",
    "__pow",
    "__unm",
    "__metatable",
    "__tostring",
    "__new",
    "__pairs",
    "__ipairs",
];

/// The layouts a header carries: `repr(C)` structures of plain integers only, so any bytes
/// are a value of each.
trait Plain: Copy {}
impl Plain for Layout {}
impl Plain for JitLayout {}
impl Plain for TraceLayout {}

/// The `T` at byte `at` of a header, if the header holds it whole.
fn read_plain<T: Plain>(head: &[u8], at: usize) -> Option<T> {
    let b = head.get(at..at.checked_add(std::mem::size_of::<T>())?)?;
    // SAFETY: `b` holds `size_of::<T>()` bytes; `T` is `repr(C)` of plain integers only
    // (`Plain`), so any bytes are a value of it; the read is unaligned-safe.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

/// Reads Lua stacks of one process, with its layout and caches of what every stack shares
/// (strings, prototypes).
pub struct Reader {
    l: Layout,
    /// Where the running code's state is, if the process published it and found it right.
    jit: Option<JitLayout>,
    /// Where a trace keeps its snapshots, if the process published it (and `jit` is known).
    trace: Option<TraceLayout>,
    /// The stack words the last [`Reader::running_top`] found in a trace's snapshot, for
    /// the frames at `(state, base)` (see `snapshot`).
    overlay: Option<(u64, u64, snapshot::Words)>,
    bc_mode: Vec<u16>,
    strings: HashMap<u64, Option<Box<[u8]>>>,
    /// What each prototype read gives a level: first line, line count, source, printable
    /// source.
    protos: HashMap<u64, std::sync::Arc<ProtoInfo>>,
    /// The name a caller gives the function it calls at a position of its code:
    /// `(prototype, position)`.
    names: HashMap<(u64, u32), Option<Vec<u8>>>,
    /// Bytes the caches hold (about).
    cached: usize,
    /// Time spent reading stacks so far.
    spent: std::time::Duration,
    /// Most threads of a chain read (see [`Reader::set_max_threads`]).
    max_threads: usize,
    /// Most levels read, and how many of them are the innermost ones (see
    /// [`Reader::set_max_levels`]).
    max_levels: (usize, usize),
    /// The stack the reading runs on, when Lua code another state runs for the one read
    /// is read too (see [`Reader::set_called_states`]).
    called_states: Option<fibertrace_core::StackBounds>,
}

/// A prototype's description, read once per dump.
struct ProtoInfo {
    firstline: u32,
    numline: u32,
    source: Box<[u8]>,
    short: String,
}

/// Entries a cache keeps at most (a bound on this process's memory).
const MAX_CACHED: usize = 1 << 16;

/// One level found by the walk: its frame, the frame above it (`None`: it is on top), and
/// the thread it belongs to.
#[derive(Clone, Copy)]
struct Slot {
    th: u64,
    frame: u64,
    next: Option<u64>,
    thread: u16,
    /// The top level's PC when it is known otherwise than from a frame above it (the
    /// interpreter's register, a trace's start): as a frame link holds it, the instruction
    /// after the current one.
    pc: Option<u64>,
}

/// Where the Lua code running now is, read from the VM and the thread's registers (see
/// [`Reader::running_top`]): the state that runs it, its frame base, and the PC of the
/// function at that base (the instruction after the current one; `None`: not known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningTop {
    pub th: u64,
    pub base: u64,
    pub pc: Option<u64>,
    /// In compiled code (a trace) rather than the interpreter.
    pub compiled: bool,
    /// Compiled code whose frames are its trace's snapshot's (see `snapshot`): the
    /// functions it inlined are levels, and the PC is the snapshot's.
    pub snapshot: bool,
}

/// Frame link types (the low three bits of a non-Lua frame's link): a vararg function's
/// upper half, and a call from C (`FRAME_C`; a protected one, `FRAME_CP`, is 5: the same
/// low two bits).
const FRAME_VARG: u64 = 3;
const FRAME_C: u64 = 1;

/// Where a Lua state keeps its innermost C frame (`L->cframe`: LuaJIT 2.1, GC64, x86-64).
const STATE_CFRAME: u64 = 80;
/// Where a C frame keeps the PC of the Lua code that called out of the VM (`SAVE_PC`).
const CFRAME_PC: u64 = 24;
/// Where a C frame keeps the C frame it was made from (`SAVE_CFRAME`, `cframe_prev`).
const CFRAME_PREV: u64 = 32;
/// Where a C frame keeps its `i32` result count (`SAVE_NRES`: negative for a C frame with
/// no Lua frame, a protected call of the VM's own).
const CFRAME_NRES: u64 = 8;
/// Where a C frame keeps its state (`SAVE_L`).
const CFRAME_L: u64 = 16;
/// Where, in a C frame, the frame record of the call that entered the VM is: past the
/// frame's own space and the registers the entry saved (`vm_x64.dasc`'s `saveregs`): the
/// interpreter's frame-pointer hop crosses the same bytes
/// (`crate::interleave::classify`'s `LUAJIT_CFRAME_HOP`).
pub(crate) const VM_ENTRY_RECORD: u64 = 64;

fn itype(tv: u64) -> u32 {
    ((tv as i64) >> 47) as u32
}

impl Reader {
    /// A reader for the process whose `.fibertrace.lua` header is `head` (the section's
    /// bytes); `Err`: why its Lua frames cannot be read.
    pub fn open(mem: &mut dyn Memory, head: &[u8]) -> Result<Reader, String> {
        use std::mem::offset_of;
        let u32_at = |off: usize| {
            head.get(off..off + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
        };
        let u64_at = |off: usize| {
            head.get(off..off + 8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        };
        if head.len() < 24 || head[..16] != publish::MAGIC {
            return Err("its .fibertrace.lua section holds no Lua layout (bad magic)".into());
        }
        let version = u32_at(offset_of!(Header, version)).unwrap_or(0);
        if version != publish::VERSION {
            return Err(format!(
                "its Lua layout is version {version}; this fibertrace reads version {}",
                publish::VERSION
            ));
        }
        let size = u32_at(offset_of!(Header, header_size)).unwrap_or(0) as usize;
        // (Headers before the running code's layout end where it begins.)
        let least = offset_of!(Header, jit_checked);
        if size < least || head.len() < least || u32_at(offset_of!(Header, pointer_size)) != Some(8)
        {
            return Err(format!("its Lua layout header is malformed (size {size})"));
        }
        match u32_at(offset_of!(Header, vm)).unwrap_or(0) {
            publish::VM_LUAJIT_GC64 => {}
            publish::VM_LUA54 => {
                return Err(
                    "it runs Lua 5.4, whose frames are not read from another process \
                            (only LuaJIT's are)"
                        .into(),
                )
            }
            vm => {
                return Err(format!(
                    "it runs a Lua VM this fibertrace does not know ({vm})"
                ))
            }
        }
        let word = |off: usize, mem: &mut dyn Memory| {
            let a = u64_at(off)?;
            let mut b = [0u8; 8];
            mem.read(a, &mut b).then(|| u64::from_le_bytes(b))
        };
        let checked = word(offset_of!(Header, checked), mem).map(|w| w as u32);
        match checked {
            Some(publish::MATCHES) => {}
            Some(publish::UNCHECKED) => {
                return Err("its Lua host was not set up yet (the layout is not checked)".into())
            }
            Some(publish::MISMATCH) => {
                return Err(
                    "its LuaJIT's layout is not the one this fibertrace reads (the \
                            process found the mismatch at its start)"
                        .into(),
                )
            }
            _ => return Err("its Lua layout's check word could not be read".into()),
        }
        let l: Layout = read_plain(head, offset_of!(Header, layout))
            .ok_or("its Lua layout header is cut short")?;
        let offsets = [
            l.state_status,
            l.state_base,
            l.state_top,
            l.state_stack,
            l.func_ffid,
            l.func_nupvalues,
            l.func_pc,
            l.func_cfunc,
            l.func_c_upvalue,
            l.proto_size,
            l.proto_sizebc,
            l.proto_k,
            l.proto_chunkname,
            l.proto_firstline,
            l.proto_numline,
            l.proto_lineinfo,
            l.proto_uvinfo,
            l.proto_varinfo,
            l.str_size,
            l.str_len,
        ];
        if offsets.iter().any(|&o| o > 4096) || l.mm_max as usize > MM_NAMES.len() {
            return Err("its Lua layout is malformed (offsets out of range)".into());
        }
        let table = word(offset_of!(Header, bc_mode), mem).unwrap_or(0);
        // Up to FUNCCW, the last instruction.
        let mut raw = vec![0u8; 2 * (l.op_funcc as usize + 2)];
        if table == 0 || !mem.read(table, &mut raw) {
            return Err("its bytecode mode table could not be read".into());
        }
        let bc_mode = raw
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        // The running code's layout: in headers that carry it, checked by the process.
        let jit_at = offset_of!(Header, jit);
        let jit = (size >= jit_at + std::mem::size_of::<JitLayout>()
            && word(offset_of!(Header, jit_checked), mem).map(|w| w as u32)
                == Some(publish::MATCHES))
        .then(|| read_plain::<JitLayout>(head, jit_at))
        .flatten()
        .filter(|j| {
            [
                j.state_glref,
                j.state_maxstack,
                j.trace_startpt,
                j.trace_startpc,
            ]
            .iter()
            .all(|&o| o <= 4096)
                && [
                    j.g_vmstate,
                    j.g_cur_l,
                    j.g_jit_base,
                    j.g_traces,
                    j.g_sizetrace,
                ]
                .iter()
                .all(|&o| o <= 1 << 16)
                && j.trace_traceno <= 4096
        });
        let trace_at = offset_of!(Header, trace);
        let trace = (jit.is_some() && size >= trace_at + std::mem::size_of::<TraceLayout>())
            .then(|| read_plain::<TraceLayout>(head, trace_at))
            .flatten()
            .filter(|t| {
                [
                    t.trace_nsnap,
                    t.trace_ir,
                    t.trace_nk,
                    t.trace_nsnapmap,
                    t.trace_snap,
                    t.trace_snapmap,
                    t.trace_szmcode,
                    t.trace_mcode,
                    t.snap_mcofs,
                    t.snap_nent,
                ]
                .iter()
                .all(|&o| o <= 4096)
                    && t.g_exit_trace <= 1 << 16
                    && t.g_exit_snap <= 1 << 16
                    && (4..=64).contains(&t.snap_size)
                    && t.snap_mcofs + 2 <= t.snap_size
                    && t.snap_nent < t.snap_size
            });
        Ok(Reader {
            l,
            jit,
            trace,
            overlay: None,
            bc_mode,
            strings: HashMap::new(),
            protos: HashMap::new(),
            names: HashMap::new(),
            cached: 0,
            spent: std::time::Duration::ZERO,
            max_threads: MAX_THREADS,
            max_levels: (MAX_LEVELS, HEAD_LEVELS),
            called_states: None,
        })
    }

    /// A reader of this process's own layout (to compare with the Lua API in tests; the
    /// layout must have been checked, see [`publish::check`]).
    #[doc(hidden)]
    pub fn own() -> Result<Reader, String> {
        if publish::checked() != publish::MATCHES {
            return Err("the layout was not checked or does not match".into());
        }
        let table = publish::HEADER
            .bc_mode
            .load(std::sync::atomic::Ordering::Relaxed);
        let entries = publish::HEADER.layout.op_funcc as u64 + 2;
        let bc_mode = (0..entries)
            // SAFETY: `table` is the address of LuaJIT's mode table, which the check found
            // has these entries (one `u16` per instruction, up to FUNCCW, the last), in a
            // read-only section.
            .map(|i| unsafe { std::ptr::read_unaligned((table + 2 * i) as *const u16) })
            .collect();
        let jit = (publish::HEADER
            .jit_checked
            .load(std::sync::atomic::Ordering::Acquire)
            == publish::MATCHES)
            .then_some(publish::HEADER.jit);
        Ok(Reader {
            l: publish::HEADER.layout,
            jit,
            trace: jit.map(|_| publish::HEADER.trace),
            overlay: None,
            bc_mode,
            strings: HashMap::new(),
            protos: HashMap::new(),
            names: HashMap::new(),
            cached: 0,
            spent: std::time::Duration::ZERO,
            max_threads: MAX_THREADS,
            max_levels: (MAX_LEVELS, HEAD_LEVELS),
            called_states: None,
        })
    }

    /// `N` bytes at `a`.
    fn bytes<const N: usize>(mem: &mut dyn Memory, a: u64) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        if mem.read(a, &mut b) {
            Ok(b)
        } else {
            Err(format!("cannot read {a:#x}"))
        }
    }

    fn u64(mem: &mut dyn Memory, a: u64) -> Result<u64, String> {
        Self::bytes(mem, a).map(u64::from_le_bytes)
    }

    fn u32(mem: &mut dyn Memory, a: u64) -> Result<u32, String> {
        Self::bytes(mem, a).map(u32::from_le_bytes)
    }

    fn u8(mem: &mut dyn Memory, a: u64) -> Result<u8, String> {
        Self::bytes::<1>(mem, a).map(|[b]| b)
    }

    /// A string object's bytes (at most [`MAX_STR`]), cached by address.
    fn string(&mut self, mem: &mut dyn Memory, s: u64) -> Option<Box<[u8]>> {
        if let Some(v) = self.strings.get(&s) {
            return v.clone();
        }
        let v = (|| {
            let len = Self::u32(mem, s.wrapping_add(self.l.str_len as u64)).ok()? as usize;
            let mut b = vec![0u8; len.min(MAX_STR)];
            if !mem.read(s.wrapping_add(self.l.str_size as u64), &mut b) {
                return None;
            }
            // As a C string (what the debug API hands out): up to its first NUL.
            if let Some(z) = b.iter().position(|&c| c == 0) {
                b.truncate(z);
            }
            Some(b.into_boxed_slice())
        })();
        let bytes = v.as_ref().map_or(0, |b| b.len()) + 32;
        if self.strings.len() < MAX_CACHED && self.cached + bytes <= MAX_CACHED_BYTES {
            self.cached += bytes;
            self.strings.insert(s, v.clone());
        }
        v
    }

    /// Reads ahead the states `roots` and their stacks' used parts (see
    /// `Session::prefetch`).
    pub fn prefetch(&self, s: &mut fibertrace_core::remote::Session, roots: &[u64]) {
        let l = self.l;
        let end = l.state_stack.max(l.state_base).max(l.state_top) as u64 + 8;
        let states: Vec<(u64, u64)> = roots.iter().map(|&r| (r, r.wrapping_add(end))).collect();
        s.prefetch(&states);
        let stacks: Vec<(u64, u64)> = roots
            .iter()
            .filter_map(|&r| {
                let stack = s.read_u64(r.wrapping_add(l.state_stack as u64))?;
                let top = s.read_u64(r.wrapping_add(l.state_top as u64))?;
                (top > stack).then(|| (stack, top.min(stack.saturating_add(1 << 16))))
            })
            .collect();
        s.prefetch(&stacks);
    }

    /// Reads at most `n` threads (at least 1) of a chain of coroutines: past them, only the
    /// thread running now (when known) as the innermost, the ones between left out and the
    /// stack marked truncated. A dump reads whole chains ([`MAX_THREADS`], the default); the
    /// heap tracker's hook, which reads at every allocation, a few.
    pub fn set_max_threads(&mut self, n: usize) {
        self.max_threads = n.clamp(1, MAX_THREADS);
    }

    /// Reads at most `n` levels (at least 1), the innermost ones: the levels past them are
    /// counted as omitted, not read (each level read costs its function's description and
    /// line). A dump reads [`MAX_LEVELS`], the innermost [`HEAD_LEVELS`] and the outermost
    /// rest (the default); the heap tracker's hook, which reads at every allocation and
    /// records the innermost frames only, as many as it records.
    pub fn set_max_levels(&mut self, n: usize) {
        let n = n.clamp(1, MAX_LEVELS);
        self.max_levels = (n, n);
    }

    /// Reads, as the innermost levels, the Lua code another state runs now on behalf of the
    /// state read, called from C code that state called: a `__gc` finalizer, which the
    /// collector runs on the VM's main thread while the state read allocates (LuaJIT's
    /// `gc_call_finalizer`), or a C function's `lua_pcall` on another state — that state's
    /// levels down to the outermost call from C the reading runs inside: `stack` is the
    /// stack the reading runs on, in this process (the heap tracker's hook, inside the
    /// allocation), and each of the state's C frames on it is one such call, matched to a
    /// level called from C (the state the VM last ran may be another fiber's, whose C frames
    /// are on its own stack: not read). `None`: not read (the default).
    pub fn set_called_states(&mut self, stack: Option<fibertrace_core::StackBounds>) {
        self.called_states = stack;
    }

    /// The Lua stack of state `root` and of the coroutines running inside it, innermost
    /// first (see the module doc).
    pub fn stack(&mut self, mem: &mut dyn Memory, root: u64) -> Result<LuaStack, String> {
        self.stack_running(mem, root, None)
    }

    /// As [`Reader::stack`], with the frames of state `top.th` read from `top`'s base (the
    /// Lua code running now, see [`Reader::running_top`]) rather than from the base the state
    /// recorded at its last call out of Lua.
    pub fn stack_running(
        &mut self,
        mem: &mut dyn Memory,
        root: u64,
        top: Option<RunningTop>,
    ) -> Result<LuaStack, String> {
        if self.spent > MAX_TOTAL_TIME {
            return Err(format!(
                "not read: reading Lua stacks took {MAX_TOTAL_TIME:?} already"
            ));
        }
        let t0 = std::time::Instant::now();
        // Compiled code's frames from its trace's snapshot: the walk sees the slots an exit
        // would restore.
        let words = match (top, self.overlay.take()) {
            (Some(t), Some((th, base, w))) if t.snapshot && t.th == th && t.base == base => {
                Some((th, base, w))
            }
            _ => None,
        };
        let r = match &words {
            Some((_, _, w)) => self.stack_inner(
                &mut snapshot::Overlay {
                    inner: mem,
                    words: w,
                },
                root,
                top,
            ),
            None => self.stack_inner(mem, root, top),
        };
        self.overlay = words;
        self.spent += t0.elapsed();
        r
    }

    fn stack_inner(
        &mut self,
        mem: &mut dyn Memory,
        root: u64,
        top: Option<RunningTop>,
    ) -> Result<LuaStack, String> {
        let mut chain: SmallVec<[u64; 4]> = SmallVec::new();
        chain.push(root);
        // (The threads of the chain as a set: memory read from another process may loop.)
        let mut seen = std::collections::HashSet::from([root]);
        let deadline = std::time::Instant::now() + MAX_TIME;
        let mut left = MAX_FRAMES;
        let mut per_thread: SmallVec<[Vec<Slot>; 4]> = SmallVec::new();
        per_thread.push(self.slots(mem, root, top, &mut left, deadline)?);
        let mut cut = false;
        loop {
            // The thread running now is the innermost: nothing above its top runs.
            if top.is_some_and(|t| t.th == chain[chain.len() - 1]) {
                break;
            }
            let head = per_thread[per_thread.len() - 1].first().copied();
            let Some(next) = head.and_then(|s| self.resumed_by(mem, s, &seen, top)) else {
                break;
            };
            if chain.len() >= self.max_threads {
                cut = true;
                break;
            }
            chain.push(next);
            seen.insert(next);
            per_thread.push(self.slots(mem, next, top, &mut left, deadline)?);
        }
        // Cut short (see `Reader::set_max_threads`): the thread running now is read as the
        // innermost, the ones between left out.
        if let Some(t) = top.filter(|t| cut && !seen.contains(&t.th)) {
            chain.push(t.th);
            per_thread.push(self.slots(mem, t.th, top, &mut left, deadline)?);
        }
        // Lua code another state runs now for this one, called from C code this one called
        // (see `Reader::set_called_states`): that state's levels down to its call from C, as
        // the innermost.
        if let Some(stack) = self.called_states {
            if let Some(cur) = self.running_state(mem, root).filter(|c| !chain.contains(c)) {
                // Its calls from C this reading runs inside: its C frames on this stack that
                // have a Lua frame (a protected call the VM makes for itself has none: its
                // result count is negative).
                let (mut on_stack, mut frames) = (0, 0);
                let mut cf = Self::u64(mem, cur.wrapping_add(STATE_CFRAME)).unwrap_or(0) & !3;
                while frames < 64 && cf != 0 && stack.contains(cf) {
                    frames += 1;
                    let nres = Self::u32(mem, cf.wrapping_add(CFRAME_NRES)).unwrap_or(0) as i32;
                    if nres >= 0 {
                        on_stack += 1;
                    }
                    cf = Self::u64(mem, cf.wrapping_add(CFRAME_PREV)).unwrap_or(0) & !3;
                }
                // (Not a coroutine waiting to be resumed, that its resume's growing of its
                // stack made the running one: only a state that runs now, status 0.)
                let runs = Self::u8(mem, cur.wrapping_add(self.l.state_status as u64)) == Ok(0);
                let on_stack = if runs { on_stack } else { 0 };
                let slots = (on_stack > 0)
                    .then(|| self.slots_from_c(mem, cur, on_stack, top, &mut left, deadline))
                    .flatten();
                if let Some(slots) = slots {
                    // The state it runs for called out from inside an instruction (the
                    // collector's step): its innermost level's line is the PC it saved —
                    // unless compiled code called the step (a trace keeps its PC nowhere;
                    // the state's recorded base is then its last call out's).
                    let th = chain[chain.len() - 1];
                    let in_trace = self.jit.is_some_and(|j| {
                        Self::u64(mem, root.wrapping_add(j.state_glref as u64))
                            .and_then(|g| Self::u64(mem, g.wrapping_add(j.g_jit_base as u64)))
                            .ok()
                            .is_none_or(|b| b != 0)
                    });
                    let last = per_thread.len() - 1;
                    if let Some(first) = per_thread[last].first_mut() {
                        if !in_trace && first.next.is_none() && first.pc.is_none() {
                            first.pc = self.saved_pc(mem, th, first.frame.wrapping_add(8));
                        }
                    }
                    chain.push(cur);
                    per_thread.push(slots);
                }
            }
        }
        // Innermost thread first.
        let mut all: Vec<Slot> = Vec::new();
        for (t, slots) in per_thread.into_iter().rev().enumerate() {
            all.extend(slots.into_iter().map(|s| Slot {
                thread: t as u16,
                ..s
            }));
        }
        let mut out = LuaStack::new();
        out.threads = chain.len();
        out.truncated = cut;
        let total = all.len();
        let (max, head_max) = self.max_levels;
        let (head, tail_from) = if total <= max {
            (total, total)
        } else {
            (head_max, total - (max - head_max))
        };
        for (at, s) in all.iter().enumerate() {
            if at >= head && at < tail_from {
                if at == head {
                    out.truncated = true;
                    out.omitted = (tail_from - head) as u64;
                    out.omitted_at = out.levels.len();
                }
                continue;
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("its read was cut after {MAX_TIME:?}"));
            }
            out.levels.push(self.level(mem, s)?);
        }
        Ok(out)
    }

    /// The state running Lua code now in the VM of state `root` (`cur_L`).
    fn running_state(&self, mem: &mut dyn Memory, root: u64) -> Option<u64> {
        let j = self.jit?;
        let g = Self::u64(mem, root.wrapping_add(j.state_glref as u64)).ok()?;
        let cur = Self::u64(mem, g.wrapping_add(j.g_cur_l as u64)).ok()? & GCV_MASK;
        (cur != 0).then_some(cur)
    }

    /// The PC state `th` saved in its innermost C frame when it called out of Lua, if it
    /// checks out against the Lua function at `base`.
    fn saved_pc(&self, mem: &mut dyn Memory, th: u64, base: u64) -> Option<u64> {
        let cf = Self::u64(mem, th.wrapping_add(STATE_CFRAME)).ok()? & !3;
        if cf == 0 {
            return None;
        }
        let pc = Self::u64(mem, cf.wrapping_add(CFRAME_PC)).ok()?;
        if pc == 0 || pc == Self::u64(mem, cf.wrapping_add(CFRAME_L)).ok()? {
            return None;
        }
        self.interpreted_top(mem, th, base, pc).ok().map(|_| pc)
    }

    /// The levels of state `th` down to the `calls`-th one C code called (its frame link a
    /// C one, `FRAME_C` or `FRAME_CP`: `lua_call` or `lua_pcall` from C, the collector's
    /// call of a finalizer — each the C frame of one call from C), that one included;
    /// `None` when fewer of its levels were called so.
    fn slots_from_c(
        &mut self,
        mem: &mut dyn Memory,
        th: u64,
        calls: usize,
        top: Option<RunningTop>,
        left: &mut usize,
        deadline: std::time::Instant,
    ) -> Option<Vec<Slot>> {
        let mut slots = self.slots(mem, th, top, left, deadline).ok()?;
        let (mut n, mut seen) = (None, 0);
        for (i, s) in slots.iter().enumerate() {
            let mut ftsz = Self::u64(mem, s.frame).ok()?;
            if ftsz & 7 == FRAME_VARG {
                // A vararg function: its link is the lower half's.
                ftsz = Self::u64(mem, s.frame.wrapping_sub(ftsz & !7)).ok()?;
            }
            if ftsz & 3 == FRAME_C {
                seen += 1;
                if seen == calls {
                    n = Some(i + 1);
                    break;
                }
            }
        }
        slots.truncate(n?);
        Some(slots)
    }

    /// Every level of one thread, innermost first (LuaJIT's `lj_debug_frame` order), at most
    /// `left` of them (less those found), until `deadline`.
    fn slots(
        &mut self,
        mem: &mut dyn Memory,
        th: u64,
        top: Option<RunningTop>,
        left: &mut usize,
        deadline: std::time::Instant,
    ) -> Result<Vec<Slot>, String> {
        let l = &self.l;
        let running = top.filter(|t| t.th == th);
        let base = match running {
            Some(t) => t.base,
            None => Self::u64(mem, th.wrapping_add(l.state_base as u64))?,
        };
        let stack = Self::u64(mem, th.wrapping_add(l.state_stack as u64))?;
        let bot = stack.wrapping_add(8);
        let mut frame = base.wrapping_sub(8);
        let mut next = frame;
        let mut out = Vec::new();
        let mut lower_half = false;
        let mut steps = 0usize;
        while frame > bot {
            // Every frame counts, the ones that are not levels too (a chain of dummy frames
            // in garbage memory).
            steps += 1;
            if out.len() >= *left || steps > 2 * MAX_FRAMES {
                return Err(format!("more than {MAX_FRAMES} frames"));
            }
            if steps.is_multiple_of(1024) && std::time::Instant::now() > deadline {
                return Err(format!("its read was cut after {MAX_TIME:?}"));
            }
            let tv = Self::u64(mem, frame.wrapping_sub(8))?;
            let func = tv & GCV_MASK;
            let ftsz = Self::u64(mem, frame)?;
            if func != th && itype(tv) != T_FUNC {
                return Err(format!("the frame at {frame:#x} holds no function"));
            }
            if func == th {
                // A dummy frame (LuaJIT puts the state itself there): not a level.
            } else if lower_half {
                // The lower half of a vararg frame: the level above was the function.
                lower_half = false;
            } else {
                out.push(Slot {
                    th,
                    frame,
                    next: (next != frame).then_some(next),
                    thread: 0,
                    pc: running.filter(|_| next == frame).and_then(|t| t.pc),
                });
            }
            next = frame;
            let prev = if ftsz & 3 == 0 {
                // A Lua frame: the caller's PC; its call instruction's A is the frame size.
                let ins = Self::u32(mem, ftsz.wrapping_sub(4))?;
                frame.wrapping_sub(8 * (2 + ((ins >> 8) & 0xff) as u64))
            } else {
                lower_half = ftsz & 7 == 3;
                frame.wrapping_sub(ftsz & !7)
            };
            if prev >= frame {
                return Err(format!(
                    "a frame link at {frame:#x} does not go down the stack"
                ));
            }
            frame = prev;
        }
        *left -= out.len();
        Ok(out)
    }

    /// Where the Lua code runs now in the VM of state `root` (whose fiber runs), when its
    /// thread is in LuaJIT's interpreter (`interp`: the thread's frame base and PC registers,
    /// given when its PC is in the interpreter's code) or in compiled code (the VM state is a
    /// trace's number): the state running (the VM's current one), and its frame base — the
    /// interpreter's register; in a trace, the innermost frame of its snapshot nearest before
    /// the first of `code`'s frames in its machine code (the thread's frames, innermost
    /// first: see `snapshot`), or else the base the trace was entered with — with the PC of
    /// the function there (the interpreter's; the snapshot's; a trace's start when the trace
    /// starts in that function, else not known — as while the collector runs a step the
    /// trace called). A snapshot's frames are then what [`Reader::stack_running`] walks for
    /// that top. `Ok(None)`: neither (the state's recorded base is current, it called out of
    /// Lua). `Err`: the VM says Lua code runs but what it holds does not
    /// check out (a base outside the state's stack or below no Lua function, a PC outside
    /// that function's code): never a guess.
    pub fn running_top(
        &mut self,
        mem: &mut dyn Memory,
        root: u64,
        interp: Option<(u64, u64)>,
        code: &[fibertrace_core::Frame],
    ) -> Result<Option<RunningTop>, String> {
        self.overlay = None;
        let Some(j) = self.jit else {
            return Err(
                "the process does not publish where its running code's state is \
                        (an older fibertrace)"
                    .into(),
            );
        };
        let g = Self::u64(mem, root.wrapping_add(j.state_glref as u64))?;
        let vmstate = Self::u32(mem, g.wrapping_add(j.g_vmstate as u64))? as i32;
        let cur = Self::u64(mem, g.wrapping_add(j.g_cur_l as u64))? & GCV_MASK;
        // A trace runs (the VM state is its number), or the collector runs a step a trace
        // called (`lj_gc_step_jit`: the VM state is "GC", the trace's base still recorded).
        let jit_base = Self::u64(mem, g.wrapping_add(j.g_jit_base as u64))?;
        if vmstate > 0 || (vmstate == VMST_GC && jit_base != 0) {
            let base = jit_base;
            let func = self.lua_function_at(mem, cur, base)?;
            // The trace the VM state names.
            let trace = self.trace_numbered(mem, g, vmstate);
            // The frames at the code address, from the trace's snapshot, when they check out.
            if let Some(t) = trace {
                if let Some(top) = self.snapshot_top(mem, t, base, code) {
                    let mut seen = snapshot::Overlay {
                        inner: &mut *mem,
                        words: &top.words,
                    };
                    let ok = self
                        .lua_function_at(&mut seen, cur, top.base)
                        .ok()
                        .and_then(|f| self.pc_position(&mut seen, f, top.pc))
                        .is_some();
                    if ok {
                        self.overlay = Some((cur, top.base, top.words));
                        return Ok(Some(RunningTop {
                            th: cur,
                            base: top.base,
                            pc: Some(top.pc),
                            compiled: true,
                            snapshot: true,
                        }));
                    }
                }
            }
            // The trace's start, when it starts in the function at the base it was entered
            // with.
            let pc = (|| -> Option<u64> {
                let t = trace?;
                let pt = Self::u64(mem, t.wrapping_add(j.trace_startpt as u64)).ok()? & GCV_MASK;
                if self.proto(mem, func).ok()? != pt {
                    return None;
                }
                let start = Self::u64(mem, t.wrapping_add(j.trace_startpc as u64)).ok()?;
                // As a frame link holds it: the instruction after.
                let pc = start.wrapping_add(4);
                self.pc_position(mem, func, pc).map(|_| pc)
            })();
            return Ok(Some(RunningTop {
                th: cur,
                base,
                pc,
                compiled: true,
                snapshot: false,
            }));
        }
        // (The interpreter's registers, only in the state the interpreter itself sets: the
        // thread held in the VM's glue — a return from C code, say — has other values there
        // while the recorder's or the C state holds.)
        if vmstate == VMST_INTERP {
            let Some((base, pc)) = interp else {
                return Ok(None);
            };
            return self.interpreted_top(mem, cur, base, pc).map(Some);
        }
        Ok(None)
    }

    /// Trace number `no` of the JIT state after global state `g`, checked: its number is that.
    fn trace_numbered(&self, mem: &mut dyn Memory, g: u64, no: i32) -> Option<u64> {
        let j = self.jit?;
        let traces = Self::u64(mem, g.wrapping_add(j.g_traces as u64)).ok()?;
        let size = Self::u32(mem, g.wrapping_add(j.g_sizetrace as u64)).ok()?;
        if no <= 0 || no as u32 >= size {
            return None;
        }
        let t = Self::u64(mem, traces.wrapping_add(8 * no as u64)).ok()? & GCV_MASK;
        let mut b = [0u8; 2];
        if !mem.read(t.wrapping_add(j.trace_traceno as u64), &mut b)
            || u16::from_le_bytes(b) as i32 != no
        {
            return None;
        }
        Some(t)
    }

    /// The interpreter's frame at `base` of state `th` with `pc` (as a frame link holds it),
    /// checked: a Lua function there, the PC inside its code.
    fn interpreted_top(
        &self,
        mem: &mut dyn Memory,
        th: u64,
        base: u64,
        pc: u64,
    ) -> Result<RunningTop, String> {
        let func = self.lua_function_at(mem, th, base)?;
        if self.pc_position(mem, func, pc).is_none() {
            return Err(format!(
                "the interpreter's PC {pc:#x} is not in the function at its base"
            ));
        }
        Ok(RunningTop {
            th,
            base,
            pc: Some(pc),
            compiled: false,
            snapshot: false,
        })
    }

    /// The Lua code running now in this process, where the interpreter left it to call out
    /// from inside an instruction (an allocation: a table made, a string joined, a table
    /// grown): the running state's base, and the PC the interpreter saved in its C frame
    /// for that call (LuaJIT's `L->cframe`, LuaJIT 2.1 GC64 x86-64: the PC 24 bytes into it,
    /// the state 16 bytes into it, where a frame with no PC holds the state instead; the C
    /// frame 80 bytes into the state), each checked as [`Reader::running_top`] checks the
    /// interpreter's own registers. `None` when the interpreter does not run Lua code now (C
    /// code Lua called, a trace, the collector), or the saved PC does not check out.
    pub fn interpreter_top(
        &mut self,
        mem: &mut dyn Memory,
        root: u64,
    ) -> Result<Option<RunningTop>, String> {
        self.overlay = None;
        let Some(j) = self.jit else {
            return Ok(None);
        };
        let g = Self::u64(mem, root.wrapping_add(j.state_glref as u64))?;
        let vmstate = Self::u32(mem, g.wrapping_add(j.g_vmstate as u64))? as i32;
        // Compiled code runs (a trace, or the collector's step it called): not the
        // interpreter. In every other state the check below decides: the VM state is not
        // kept exact — it is "C" from the return of the VM's protected calls (the JIT
        // compiler's, a trace's exit) until the interpreter calls out of Lua again, while
        // the interpreter runs Lua code —; while the JIT compiler optimises and assembles a
        // trace, the interpreter waits at the instruction that ended its recording; while a
        // trace exits, its snapshot's PC is saved before the stack is restored from it (the
        // objects the trace did not make yet are made then), and the state's base is the
        // innermost frame's once the stack is restored: the PC checks out against the
        // function at the base when the snapshot has no inlined frame, or once restored.
        // In C code Lua called, the state's base is the C function's: no Lua function there.
        let jit_base = Self::u64(mem, g.wrapping_add(j.g_jit_base as u64))?;
        if vmstate > 0 || (vmstate == VMST_GC && jit_base != 0) {
            return Ok(None);
        }
        let cur = Self::u64(mem, g.wrapping_add(j.g_cur_l as u64))? & GCV_MASK;
        let base = Self::u64(mem, cur.wrapping_add(self.l.state_base as u64))?;
        // The innermost C frame that holds a PC: a protected call the VM made for itself
        // (the JIT compiler's, a trace's exit) holds none, and the interpreter's PC is in the
        // frame it was made from.
        let mut cf = Self::u64(mem, cur.wrapping_add(STATE_CFRAME))? & !3;
        let mut pc = 0;
        for _ in 0..4 {
            if cf == 0 {
                return Ok(None);
            }
            pc = Self::u64(mem, cf.wrapping_add(CFRAME_PC))?;
            if pc != 0 && pc != Self::u64(mem, cf.wrapping_add(CFRAME_L))? {
                break;
            }
            pc = 0;
            cf = Self::u64(mem, cf.wrapping_add(CFRAME_PREV))? & !3;
        }
        if pc == 0 {
            return Ok(None);
        }
        match self.interpreted_top(mem, cur, base, pc) {
            Ok(top) => Ok(Some(top)),
            Err(e) if interpreting(vmstate) => Err(e),
            // A trace's exit restoring inlined frames (the PC is the innermost one's, the
            // base still the trace's): the frames of the snapshot it restores — only while
            // the exit runs (its VM state, which the protected call it makes keeps): the
            // JIT state names the last exit long after, and its saved PC stays until the
            // interpreter saves another. Else C code Lua called (the base is the C
            // function's).
            Err(_) if vmstate != VMST_EXIT => Ok(None),
            Err(_) => Ok(self.exit_top(mem, g, base, pc).and_then(|top| {
                let mut seen = snapshot::Overlay {
                    inner: &mut *mem,
                    words: &top.words,
                };
                let func = self.lua_function_at(&mut seen, cur, top.base).ok()?;
                self.pc_position(&mut seen, func, top.pc)?;
                self.overlay = Some((cur, top.base, top.words));
                Some(RunningTop {
                    th: cur,
                    base: top.base,
                    pc: Some(top.pc),
                    compiled: false,
                    snapshot: true,
                })
            })),
        }
    }

    /// The frame record (saved frame pointer, then return address) of the native call that
    /// entered the VM for state `th`'s Lua code running now (`lua_pcall`'s call into
    /// `lj_vm_pcall`, a resume's, a C function's callback): 64 bytes into the
    /// state's innermost C frame (`L->cframe`, 80 bytes into the state, its low
    /// two bits flags). Compiled code (a trace) runs in that frame and keeps no record of
    /// its own: a native walk stopped in it goes on from there. `None`: the state has no C
    /// frame (it runs no Lua code from C).
    pub fn vm_entry_record(
        &mut self,
        mem: &mut dyn Memory,
        th: u64,
    ) -> Result<Option<u64>, String> {
        let cf = Self::u64(mem, th.wrapping_add(STATE_CFRAME))? & !3;
        Ok((cf != 0).then(|| cf.wrapping_add(VM_ENTRY_RECORD)))
    }

    /// The Lua function whose frame starts at `base` of state `th`, if `base` is inside its
    /// stack and a Lua function is there.
    fn lua_function_at(&self, mem: &mut dyn Memory, th: u64, base: u64) -> Result<u64, String> {
        let l = self.l;
        let j = self.jit.unwrap_or_default();
        let stack = Self::u64(mem, th.wrapping_add(l.state_stack as u64))?;
        let max = Self::u64(mem, th.wrapping_add(j.state_maxstack as u64))?;
        if !base.is_multiple_of(8) || base <= stack.wrapping_add(16) || base > max {
            return Err(format!(
                "the running frame's base {base:#x} is outside its state's stack"
            ));
        }
        let tv = Self::u64(mem, base.wrapping_sub(16))?;
        let func = tv & GCV_MASK;
        if itype(tv) != T_FUNC || Self::u8(mem, func.wrapping_add(l.func_ffid as u64))? != 0 {
            return Err(format!(
                "no Lua function below the running frame's base {base:#x}"
            ));
        }
        Ok(func)
    }

    /// The thread a top level resumes (see the module doc), if usable.
    fn resumed_by(
        &mut self,
        mem: &mut dyn Memory,
        top: Slot,
        chain: &std::collections::HashSet<u64>,
        running: Option<RunningTop>,
    ) -> Option<u64> {
        let l = self.l;
        let func = Self::u64(mem, top.frame.wrapping_sub(8)).ok()? & GCV_MASK;
        if Self::u8(mem, func.wrapping_add(l.func_ffid as u64)).ok()? == 0 {
            return None;
        }
        let usable = |co: u64, mem: &mut dyn Memory| -> bool {
            if co == 0 || chain.contains(&co) {
                return false;
            }
            let ok = (|| {
                let status = Self::u8(mem, co.wrapping_add(l.state_status as u64)).ok()?;
                // The state running Lua code now: its recorded base may be the one it
                // started with (it called nothing yet); its frames start at the running one.
                let base = match running.filter(|t| t.th == co) {
                    Some(t) => t.base,
                    None => Self::u64(mem, co.wrapping_add(l.state_base as u64)).ok()?,
                };
                let stack = Self::u64(mem, co.wrapping_add(l.state_stack as u64)).ok()?;
                Some(status == 0 && base.wrapping_sub(8) > stack.wrapping_add(8))
            })();
            ok == Some(true)
        };
        if Self::u8(mem, func.wrapping_add(l.func_nupvalues as u64)).ok()? >= 1 {
            let tv = Self::u64(mem, func.wrapping_add(l.func_c_upvalue as u64)).ok()?;
            if itype(tv) == T_THREAD && usable(tv & GCV_MASK, mem) {
                return Some(tv & GCV_MASK);
            }
        }
        let base = Self::u64(mem, top.th.wrapping_add(l.state_base as u64)).ok()?;
        let stop = Self::u64(mem, top.th.wrapping_add(l.state_top as u64)).ok()?;
        if base < stop {
            let tv = Self::u64(mem, base).ok()?;
            if itype(tv) == T_THREAD && usable(tv & GCV_MASK, mem) {
                return Some(tv & GCV_MASK);
            }
        }
        None
    }

    /// One level's description, interned.
    fn level(&mut self, mem: &mut dyn Memory, s: &Slot) -> Result<LuaLevel, String> {
        let l = self.l;
        let func = Self::u64(mem, s.frame.wrapping_sub(8))? & GCV_MASK;
        let ffid = Self::u8(mem, func.wrapping_add(l.func_ffid as u64))?;
        let name = self.funcname(mem, s.th, s.frame);
        let (kind, cfunc, id) = if ffid == 0 {
            let pt = self.proto(mem, func)?;
            let info = self.proto_info(mem, pt)?;
            let (firstline, numline) = (info.firstline, info.numline);
            let (source, short) = (&info.source, &info.short);
            let kind = if firstline != 0 || numline == 0 {
                LuaKind::Lua
            } else {
                LuaKind::Main
            };
            let line = match self.framepc(mem, func, s.next, s.pc) {
                Some(pos) => self.line(mem, pt, pos) as i32,
                None => -1,
            };
            let id = intern::intern(&RawInfo {
                kind,
                name: name.as_deref(),
                source,
                short_src: short.as_bytes(),
                current_line: line,
                line_defined: firstline as i32,
                cfunc: 0,
            });
            (kind, 0, id)
        } else {
            // As the live capture: the C function (a C function, or a library function
            // written in C such as `print` or `table.sort`), or for a fast function written
            // in assembler its C fallback (`lj_ffh_*`): the function object's C field.
            let cfunc = Self::u64(mem, func.wrapping_add(l.func_cfunc as u64))? as usize;
            let id = intern::intern(&RawInfo {
                kind: LuaKind::C,
                name: name.as_deref(),
                source: b"=[C]",
                short_src: b"[C]",
                current_line: -1,
                line_defined: -1,
                cfunc,
            });
            (LuaKind::C, cfunc, id)
        };
        Ok(LuaLevel {
            id,
            kind,
            cfunc,
            thread: s.thread,
        })
    }

    /// A prototype's description (cached).
    fn proto_info(
        &mut self,
        mem: &mut dyn Memory,
        pt: u64,
    ) -> Result<std::sync::Arc<ProtoInfo>, String> {
        if let Some(i) = self.protos.get(&pt) {
            return Ok(i.clone());
        }
        let l = self.l;
        let firstline = Self::u32(mem, pt.wrapping_add(l.proto_firstline as u64))?;
        let numline = Self::u32(mem, pt.wrapping_add(l.proto_numline as u64))?;
        let chunk = Self::u64(mem, pt.wrapping_add(l.proto_chunkname as u64))?;
        let source = self
            .string(mem, chunk)
            .unwrap_or_else(|| b"=?".to_vec().into());
        let mut short = short_src(&source, firstline);
        if source.first() == Some(&b'@') && source.len() == MAX_STR {
            // A file name longer than what was read: its printable form is its tail.
            let len = Self::u32(mem, chunk.wrapping_add(l.str_len as u64))? as u64;
            let mut tail = vec![0u8; IDSIZE - 4];
            let at = chunk
                .wrapping_add(l.str_size as u64)
                .wrapping_add(len.saturating_sub(tail.len() as u64));
            if len as usize >= IDSIZE && mem.read(at, &mut tail) {
                short = format!("...{}", String::from_utf8_lossy(&tail));
            }
        }
        let info = std::sync::Arc::new(ProtoInfo {
            firstline,
            numline,
            source,
            short,
        });
        if self.protos.len() < MAX_CACHED {
            self.protos.insert(pt, info.clone());
        }
        Ok(info)
    }

    /// A Lua function's prototype (its bytecode follows the prototype).
    fn proto(&self, mem: &mut dyn Memory, func: u64) -> Result<u64, String> {
        let pc = Self::u64(mem, func.wrapping_add(self.l.func_pc as u64))?;
        pc.checked_sub(self.l.proto_size as u64)
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("function {func:#x} has no prototype"))
    }

    /// The bytecode position a Lua function `func` is at, from the frame above it (LuaJIT's
    /// `debug_framepc`, without the C-frame cases: see the module doc).
    fn framepc(
        &self,
        mem: &mut dyn Memory,
        func: u64,
        next: Option<u64>,
        pc: Option<u64>,
    ) -> Option<u32> {
        let l = self.l;
        if Self::u8(mem, func.wrapping_add(l.func_ffid as u64)).ok()? != 0 {
            return None;
        }
        let Some(next) = next else {
            return pc.and_then(|ins| self.pc_position(mem, func, ins));
        };
        let ftsz = Self::u64(mem, next).ok()?;
        let ins = if ftsz & 3 == 0 {
            ftsz
        } else if ftsz & 7 == 2 {
            // A continuation frame: its PC two slots below.
            Self::u64(mem, next.wrapping_sub(16)).ok()?
        } else {
            return None;
        };
        self.pc_position(mem, func, ins)
    }

    /// The bytecode position of Lua function `func` whose next instruction is at `ins`.
    fn pc_position(&self, mem: &mut dyn Memory, func: u64, ins: u64) -> Option<u32> {
        let l = self.l;
        let pt = self.proto(mem, func).ok()?;
        let bc = pt.wrapping_add(l.proto_size as u64);
        let sizebc = Self::u32(mem, pt.wrapping_add(l.proto_sizebc as u64)).ok()?;
        let pos = (ins.wrapping_sub(bc) / 4) as u32;
        match pos.wrapping_sub(1) {
            u32::MAX => Some(1),
            p if p > sizebc => None,
            p => Some(p),
        }
    }

    /// The source line of bytecode position `pos` (LuaJIT's `lj_debug_line`).
    fn line(&self, mem: &mut dyn Memory, pt: u64, pos: u32) -> u32 {
        let l = self.l;
        let mut r = || -> Result<u32, String> {
            let sizebc = Self::u32(mem, pt.wrapping_add(l.proto_sizebc as u64))?;
            let lineinfo = Self::u64(mem, pt.wrapping_add(l.proto_lineinfo as u64))?;
            let first = Self::u32(mem, pt.wrapping_add(l.proto_firstline as u64))?;
            let numline = Self::u32(mem, pt.wrapping_add(l.proto_numline as u64))?;
            if pos > sizebc || lineinfo == 0 {
                return Ok(0);
            }
            if pos == sizebc {
                return Ok(first.wrapping_add(numline));
            }
            if pos == 0 {
                return Ok(first);
            }
            let i = (pos - 1) as u64;
            let d = if numline < 256 {
                Self::u8(mem, lineinfo.wrapping_add(i))? as u32
            } else if numline < 65536 {
                let mut b = [0u8; 2];
                if !mem.read(lineinfo.wrapping_add(2 * i), &mut b) {
                    return Err(String::new());
                }
                u16::from_le_bytes(b) as u32
            } else {
                Self::u32(mem, lineinfo.wrapping_add(4 * i))?
            };
            Ok(first.wrapping_add(d))
        };
        r().unwrap_or(0)
    }

    /// An instruction's mode; one that is not an instruction has none (no operand, no
    /// metamethod).
    fn mode(&self, op: u8) -> u16 {
        self.bc_mode
            .get(op as usize)
            .copied()
            .unwrap_or((self.l.mm_max as u16) << 11)
    }

    /// The name the caller of the level at `frame` knows it by (LuaJIT's
    /// `lj_debug_funcname`).
    fn funcname(&mut self, mem: &mut dyn Memory, th: u64, frame: u64) -> Option<Vec<u8>> {
        let l = self.l;
        let stack = Self::u64(mem, th.wrapping_add(l.state_stack as u64)).ok()?;
        if frame <= stack.wrapping_add(8) {
            return None;
        }
        let mut frame = frame;
        let mut ftsz = Self::u64(mem, frame).ok()?;
        if ftsz & 7 == 3 {
            frame = frame.wrapping_sub(ftsz & !7);
            ftsz = Self::u64(mem, frame).ok()?;
        }
        let pframe = if ftsz & 3 == 0 {
            let ins = Self::u32(mem, ftsz.wrapping_sub(4)).ok()?;
            frame.wrapping_sub(8 * (2 + ((ins >> 8) & 0xff) as u64))
        } else {
            frame.wrapping_sub(ftsz & !7)
        };
        if pframe >= frame || pframe <= stack {
            return None;
        }
        let pfunc = Self::u64(mem, pframe.wrapping_sub(8)).ok()? & GCV_MASK;
        let pos = self.framepc(mem, pfunc, Some(frame), None)?;
        let pt = self.proto(mem, pfunc).ok()?;
        if let Some(n) = self.names.get(&(pt, pos)) {
            return n.clone();
        }
        let n = self.callee_name(mem, pt, pos);
        let bytes = n.as_ref().map_or(0, Vec::len) + 32;
        if self.names.len() < MAX_CACHED && self.cached + bytes <= MAX_CACHED_BYTES {
            self.cached += bytes;
            self.names.insert((pt, pos), n.clone());
        }
        n
    }

    /// The name of the function called at position `pos` of prototype `pt`.
    fn callee_name(&mut self, mem: &mut dyn Memory, pt: u64, pos: u32) -> Option<Vec<u8>> {
        let l = self.l;
        let sizebc = Self::u32(mem, pt.wrapping_add(l.proto_sizebc as u64)).ok()?;
        if pos >= sizebc {
            return None;
        }
        let bc = pt.wrapping_add(l.proto_size as u64);
        let ip = bc.wrapping_add(4 * pos as u64);
        let ins = Self::u32(mem, ip).ok()?;
        let op = (ins & 0xff) as u8;
        let mm = (self.mode(op) >> 11) as u8;
        if mm == l.mm_call {
            let mut slot = (ins >> 8) & 0xff;
            if op == l.op_iterc {
                slot = slot.wrapping_sub(3);
            }
            self.slotname(mem, pt, ip, slot)
        } else if mm != l.mm_max {
            MM_NAMES.get(mm as usize).map(|n| n.as_bytes().to_vec())
        } else {
            None
        }
    }

    /// What slot `slot` holds at instruction `ip` of prototype `pt`, by name (LuaJIT's
    /// `lj_debug_slotname`).
    fn slotname(&mut self, mem: &mut dyn Memory, pt: u64, ip: u64, slot: u32) -> Option<Vec<u8>> {
        let l = self.l;
        let bc = pt.wrapping_add(l.proto_size as u64);
        let (mut ip, mut slot) = (ip, slot);
        let mut budget = NAME_BUDGET;
        // Each MOV restarts the search one instruction further up: bounded by the code.
        'restart: loop {
            let pos = (ip.wrapping_sub(bc) / 4) as u32;
            if let Some(n) = self.varname(mem, pt, pos, slot, &mut budget) {
                return Some(n);
            }
            while ip > bc.wrapping_add(4) {
                ip -= 4;
                let ins = Self::u32(mem, ip).ok()?;
                let op = (ins & 0xff) as u8;
                let ra = (ins >> 8) & 0xff;
                let mode_a = self.mode(op) & 7;
                if mode_a == 2 {
                    // BCMbase: the slot is overwritten by a call, loop or KNIL here.
                    if slot >= ra && (op != l.op_knil || slot <= ins >> 16) {
                        return None;
                    }
                } else if mode_a == 1 && ra == slot {
                    // BCMdst: where the slot got its value.
                    let d = ins >> 16;
                    if op == l.op_mov {
                        slot = d;
                        continue 'restart;
                    } else if op == l.op_gget {
                        return self.kstr(mem, pt, d);
                    } else if op == l.op_tgets {
                        return self.kstr(mem, pt, (ins >> 16) & 0xff);
                    } else if op == l.op_uget {
                        return self.uvname(mem, pt, d, &mut budget);
                    } else {
                        return None;
                    }
                }
            }
            return None;
        }
    }

    /// The string constant number `idx` of prototype `pt`.
    fn kstr(&mut self, mem: &mut dyn Memory, pt: u64, idx: u32) -> Option<Vec<u8>> {
        let k = Self::u64(mem, pt.wrapping_add(self.l.proto_k as u64)).ok()?;
        let s = Self::u64(mem, k.wrapping_sub(8 * (idx as u64 + 1))).ok()? & GCV_MASK;
        self.string(mem, s).map(|b| b.into_vec())
    }

    /// The name of upvalue `idx` of prototype `pt` (LuaJIT's `lj_debug_uvname`).
    fn uvname(
        &mut self,
        mem: &mut dyn Memory,
        pt: u64,
        idx: u32,
        budget: &mut usize,
    ) -> Option<Vec<u8>> {
        let p = Self::u64(mem, pt.wrapping_add(self.l.proto_uvinfo as u64)).ok()?;
        if p == 0 {
            return Some(Vec::new());
        }
        let mut c = Cursor::new(p, budget);
        for _ in 0..idx {
            c.skip_cstr(mem)?;
        }
        c.cstr(mem)
    }

    /// The name of the `slot`th live local at bytecode position `pc` (LuaJIT's
    /// `debug_varname`).
    fn varname(
        &mut self,
        mem: &mut dyn Memory,
        pt: u64,
        pc: u32,
        slot: u32,
        budget: &mut usize,
    ) -> Option<Vec<u8>> {
        let p = Self::u64(mem, pt.wrapping_add(self.l.proto_varinfo as u64)).ok()?;
        if p == 0 {
            return None;
        }
        let mut c = Cursor::new(p, budget);
        let mut slot = slot;
        let mut lastpc = 0u32;
        loop {
            let at = c.at;
            let vn = c.byte(mem)?;
            if vn as usize > HIDDEN_VARS.len() {
                c.skip_cstr(mem)?;
            } else if vn == 0 {
                return None;
            }
            let start = lastpc.wrapping_add(c.uleb(mem)?);
            lastpc = start;
            if start > pc {
                return None;
            }
            let end = start.wrapping_add(c.uleb(mem)?);
            if pc < end {
                if slot == 0 {
                    return if (vn as usize) <= HIDDEN_VARS.len() {
                        Some(HIDDEN_VARS[vn as usize - 1].as_bytes().to_vec())
                    } else {
                        Cursor::new(at, c.budget).cstr(mem)
                    };
                }
                slot -= 1;
            }
        }
    }
}

/// Reads bytes one by one from another process, 64 bytes at a time (an aligned block never
/// crosses a page), for at most [`MAX_VARINFO`] bytes, and at most its budget (shared by the
/// cursors of one name's search: a crafted prototype cannot make it read without end).
struct Cursor<'b> {
    start: u64,
    at: u64,
    block: u64,
    buf: [u8; 64],
    /// Bytes this cursor and the others of the same search may still read.
    budget: &'b mut usize,
}

impl Cursor<'_> {
    fn new(at: u64, budget: &mut usize) -> Cursor<'_> {
        Cursor {
            start: at,
            at,
            block: u64::MAX,
            buf: [0; 64],
            budget,
        }
    }

    fn byte(&mut self, mem: &mut dyn Memory) -> Option<u8> {
        if self.at.wrapping_sub(self.start) > MAX_VARINFO || *self.budget == 0 {
            return None;
        }
        *self.budget -= 1;
        let b = self.at & !63;
        if b != self.block {
            if !mem.read(b, &mut self.buf) {
                return None;
            }
            self.block = b;
        }
        let v = self.buf[(self.at - b) as usize];
        self.at = self.at.wrapping_add(1);
        Some(v)
    }

    /// Skips past the next NUL.
    fn skip_cstr(&mut self, mem: &mut dyn Memory) -> Option<()> {
        while self.byte(mem)? != 0 {}
        Some(())
    }

    /// The bytes up to the next NUL (at most [`MAX_STR`]).
    fn cstr(&mut self, mem: &mut dyn Memory) -> Option<Vec<u8>> {
        let mut v = Vec::new();
        loop {
            match self.byte(mem)? {
                0 => return Some(v),
                b if v.len() < MAX_STR => v.push(b),
                _ => {}
            }
        }
    }

    /// An unsigned LEB128 number (at most 32 bits).
    fn uleb(&mut self, mem: &mut dyn Memory) -> Option<u32> {
        let mut v = 0u32;
        let mut shift = 0;
        loop {
            let b = self.byte(mem)?;
            if shift < 32 {
                v |= ((b & 0x7f) as u32) << shift;
            }
            if b & 0x80 == 0 {
                return Some(v);
            }
            shift += 7;
            if shift > 35 {
                return None;
            }
        }
    }
}

/// The printable source of a chunk name, as LuaJIT's `lj_debug_shortname` makes it.
pub fn short_src(src: &[u8], firstline: u32) -> String {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match src.first() {
        Some(b'=') => text(&src[1..src.len().min(IDSIZE)]),
        Some(b'@') => {
            let rest = &src[1..];
            if rest.len() >= IDSIZE {
                format!("...{}", text(&rest[rest.len() - (IDSIZE - 4)..]))
            } else {
                text(rest)
            }
        }
        _ => {
            let builtin = firstline == u32::MAX;
            let mut len = 0;
            while len < IDSIZE - 12 && len < src.len() && src[len] >= b' ' {
                len += 1;
            }
            let mut out = String::from(if builtin { "[builtin:" } else { "[string \"" });
            if len < src.len() {
                out.push_str(&text(&src[..len.min(IDSIZE - 15)]));
                out.push_str("...");
            } else {
                out.push_str(&text(src));
            }
            out.push_str(if builtin { "]" } else { "\"]" });
            out
        }
    }
}

/// The blocks LuaJIT keeps for the whole state and resizes as the program goes — its string
/// table, its temporary string buffer, its JIT compiler's traces and their array — as
/// `(address, size)` (size 0: a trace, whose size is not kept), read from `l`'s global
/// state (LuaJIT 2.1, GC64: the string interning state just before the VM state, the
/// buffer two words after it), when the layout of the running code's state matched; empty
/// otherwise. Each is checked first: the table's size is a power of two (at least LuaJIT's
/// least, 256 entries) and interning a new string (the collector stopped meanwhile) counts
/// one more string in it; the buffer's pointers are in order. Everything is read as another
/// process's memory is ([`SelfMem`]): a wrong offset is a failed read, never
/// a fault.
///
/// # Safety
/// `l` is a state of this thread's host at a call boundary, with room for one value; the
/// collector is restarted after (for a caller at exit, which collected just before).
pub unsafe fn vm_tables_of(l: *mut mlua::ffi::lua_State) -> Vec<(usize, usize)> {
    // SAFETY: per the contract, `l` is a live state.
    let Some(st) = (unsafe { publish::vmstate_of(l) }) else {
        return Vec::new();
    };
    let st = st as usize;
    // Read as another process's memory is (a failed read, never a fault): the string
    // interning state's 32 bytes before the VM state and the buffer after it are where the
    // checked layout says; the JIT state's array of traces is found through offsets the
    // check does not cover.
    let rd = |a: usize| {
        let mut b = [0u8; 8];
        SelfMem
            .read(a as u64, &mut b)
            .then(|| u64::from_le_bytes(b) as usize)
    };
    let rd32 = |a: usize| {
        let mut b = [0u8; 4];
        SelfMem
            .read(a as u64, &mut b)
            .then(|| u32::from_le_bytes(b) as usize)
    };
    let (Some(tab), Some(mask), Some(num)) = (rd(st - 32), rd32(st - 24), rd32(st - 20)) else {
        return Vec::new();
    };
    if tab == 0 || !(mask + 1).is_power_of_two() || mask + 1 < 256 {
        return Vec::new();
    }
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let probe = format!(
        "fibertrace: probe of the string table {:x} {}",
        l as usize,
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    // SAFETY: per the contract: a string pushed and popped, the collector stopped around it
    // (so that no string is freed meanwhile).
    let counted = unsafe {
        mlua::ffi::lua_gc(l, mlua::ffi::LUA_GCSTOP, 0);
        mlua::ffi::lua_pushlstring(l, probe.as_ptr().cast(), probe.len());
        let after = rd32(st - 20);
        mlua::ffi::lua_settop(l, -2);
        mlua::ffi::lua_gc(l, mlua::ffi::LUA_GCRESTART, 0);
        after
    };
    if counted != Some(num + 1) {
        return Vec::new();
    }
    // The table may have grown with the probe: read again.
    let (Some(tab), Some(mask)) = (rd(st - 32), rd32(st - 24)) else {
        return Vec::new();
    };
    let mut out = vec![(tab, (mask + 1) * 8)];
    if let (Some(w), Some(e), Some(b)) = (rd(st + 16), rd(st + 24), rd(st + 32)) {
        if b != 0 && b <= w && w <= e {
            out.push((b, e - b));
        }
    }
    // The JIT compiler's array of traces and the traces in it (each one block, its size not
    // kept: 0 stands for any). A report leaves out only a live allocation at exactly one of
    // these addresses.
    let lay = &publish::HEADER.jit;
    let g = st - lay.g_vmstate as usize;
    if let (Some(traces), Some(size)) = (
        rd(g + lay.g_traces as usize),
        rd32(g + lay.g_sizetrace as usize),
    ) {
        if traces != 0 && traces.is_multiple_of(8) && size <= 1 << 16 {
            out.push((traces, size * 8));
            for i in 1..size {
                match rd(traces + 8 * i) {
                    Some(t) => {
                        let t = t & GCV_MASK as usize;
                        if t != 0 && t.is_multiple_of(8) {
                            out.push((t, 0));
                        }
                    }
                    None => break,
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory of `len` bytes at `base` (byte `i` is `i as u8`), with a hole of unreadable
    /// bytes; counts its reads.
    struct Fake {
        base: u64,
        len: u64,
        hole: std::ops::Range<u64>,
        reads: usize,
    }

    impl Memory for Fake {
        fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
            self.reads += 1;
            let end = addr + out.len() as u64;
            if addr < self.base || end > self.base + self.len {
                return false;
            }
            if addr < self.hole.end && self.hole.start < end {
                return false;
            }
            for (i, b) in out.iter_mut().enumerate() {
                *b = (addr - self.base + i as u64) as u8;
            }
            true
        }
    }

    #[test]
    fn blocks_read_what_the_memory_holds_in_fewer_reads() {
        let fake = Fake {
            base: 0x1000,
            len: 0x2000,
            hole: 0x2000..0x2100,
            reads: 0,
        };
        let mut m = Blocks::new(fake);
        let want = |addr: u64, n: usize| -> Vec<u8> {
            (0..n).map(|i| (addr - 0x1000 + i as u64) as u8).collect()
        };
        // Within a block, across blocks, and again: each block read once.
        for (addr, n) in [(0x1010, 8), (0x10f8, 16), (0x1008, 300), (0x1100, 8)] {
            let mut out = vec![0u8; n];
            assert!(m.read(addr, &mut out), "{addr:#x} {n}");
            assert_eq!(out, want(addr, n), "{addr:#x} {n}");
        }
        assert_eq!(m.inner.reads, 2);
        // The hole: a read touching it fails, the bytes around it read.
        let mut out = [0u8; 8];
        assert!(!m.read(0x20fc, &mut out));
        assert!(m.read(0x1ff8, &mut out));
        assert_eq!(out.to_vec(), want(0x1ff8, 8));
        assert!(m.read(0x2100, &mut out));
        // Outside the memory, at the end of the address space, and a large read (whole).
        assert!(!m.read(0x3000, &mut out));
        assert!(!m.read(u64::MAX - 3, &mut out));
        let mut big = vec![0u8; 4096];
        assert!(m.read(0x1000, &mut big));
        assert_eq!(big, want(0x1000, 4096));
        // More blocks than are kept: still right.
        for k in 0..3 * BLOCKS as u64 {
            let a = 0x1000 + k * BLOCK as u64 % 0x1000 + 4;
            assert!(m.read(a, &mut out));
            assert_eq!(out.to_vec(), want(a, 8));
        }
    }

    #[test]
    fn short_sources_as_luajit_makes_them() {
        assert_eq!(short_src(b"=stdin", 1), "stdin");
        assert_eq!(short_src(b"@app/main.lua", 1), "app/main.lua");
        let long = format!("@{}", "d/".repeat(40));
        let s = short_src(long.as_bytes(), 1);
        assert!(s.starts_with("...") && s.len() == 3 + 56, "{s}");
        assert_eq!(short_src(b"return 1", 1), "[string \"return 1\"]");
        assert_eq!(
            short_src(b"local x = 1\nreturn x", 1),
            "[string \"local x = 1...\"]"
        );
        assert_eq!(short_src(b"", 1), "[string \"\"]");
    }

    #[test]
    fn a_header_that_is_not_one_is_refused_with_why() {
        struct NoMem;
        impl Memory for NoMem {
            fn read(&mut self, _: u64, _: &mut [u8]) -> bool {
                false
            }
        }
        let e = Reader::open(&mut NoMem, b"").err().unwrap();
        assert!(e.contains("bad magic"), "{e}");
        let mut h = vec![0u8; std::mem::size_of::<Header>()];
        h[..16].copy_from_slice(&publish::MAGIC);
        h[16..20].copy_from_slice(&7u32.to_le_bytes());
        let e = Reader::open(&mut NoMem, &h).err().unwrap();
        assert_eq!(
            e,
            "its Lua layout is version 7; this fibertrace reads version 1"
        );
        h[16..20].copy_from_slice(&1u32.to_le_bytes());
        let e = Reader::open(&mut NoMem, &h).err().unwrap();
        assert!(e.contains("malformed"), "{e}");
    }

    /// This process's own header as a reader finds it in the section.
    fn own_header() -> Vec<u8> {
        use std::mem::{offset_of, size_of};
        let h = &publish::HEADER;
        let mut v = vec![0u8; size_of::<Header>()];
        v[..16].copy_from_slice(&h.magic);
        let put32 = |v: &mut Vec<u8>, off: usize, x: u32| {
            v[off..off + 4].copy_from_slice(&x.to_le_bytes());
        };
        put32(&mut v, offset_of!(Header, version), h.version);
        put32(&mut v, offset_of!(Header, header_size), h.header_size);
        put32(&mut v, offset_of!(Header, vm), h.vm);
        put32(&mut v, offset_of!(Header, pointer_size), h.pointer_size);
        // The two words' "addresses" in the fake memory below: 0x1000 and 0x2000.
        v[offset_of!(Header, checked)..][..8].copy_from_slice(&0x1000u64.to_le_bytes());
        v[offset_of!(Header, bc_mode)..][..8].copy_from_slice(&0x2000u64.to_le_bytes());
        let at = offset_of!(Header, layout);
        let l = &h.layout;
        // SAFETY: `Layout` is `repr(C)` of plain integers: its bytes are initialized
        // (padding aside, which the reader ignores) and readable for its size.
        let bytes = unsafe {
            std::slice::from_raw_parts((l as *const Layout).cast::<u8>(), size_of::<Layout>())
        };
        v[at..at + bytes.len()].copy_from_slice(bytes);
        // The running code's layout, whose check word is the same one.
        v[offset_of!(Header, jit_checked)..][..8].copy_from_slice(&0x1000u64.to_le_bytes());
        let at = offset_of!(Header, jit);
        let j = &h.jit;
        // SAFETY: as above (`u32`s only).
        let bytes = unsafe {
            std::slice::from_raw_parts((j as *const JitLayout).cast::<u8>(), size_of::<JitLayout>())
        };
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    }

    /// A memory with the check word at 0x1000 and a mode table at 0x2000.
    struct Words(u32);
    impl Memory for Words {
        fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
            match addr {
                0x1000 => {
                    out.fill(0);
                    out[..4].copy_from_slice(&self.0.to_le_bytes());
                    true
                }
                0x2000 => {
                    out.fill(0);
                    out[..8].copy_from_slice(&0x3000u64.to_le_bytes());
                    true
                }
                0x3000 => {
                    out.fill(7);
                    true
                }
                _ => false,
            }
        }
    }

    #[test]
    fn a_layout_is_read_only_once_the_process_checked_it_against_its_vm() {
        let h = own_header();
        let mut other = h.clone();
        other[std::mem::offset_of!(Header, vm)] = 9;
        let e = Reader::open(&mut Words(publish::MATCHES), &other)
            .err()
            .unwrap();
        assert_eq!(e, "it runs a Lua VM this fibertrace does not know (9)");
        if !cfg!(feature = "luajit") {
            // A Lua 5.4 build says so, whatever its check found.
            for w in [publish::UNCHECKED, publish::MISMATCH, publish::MATCHES] {
                let e = Reader::open(&mut Words(w), &h).err().unwrap();
                assert_eq!(
                    e,
                    "it runs Lua 5.4, whose frames are not read from another process (only \
                     LuaJIT's are)"
                );
            }
            return;
        }
        let e = Reader::open(&mut Words(publish::UNCHECKED), &h)
            .err()
            .unwrap();
        assert_eq!(
            e,
            "its Lua host was not set up yet (the layout is not checked)"
        );
        let e = Reader::open(&mut Words(publish::MISMATCH), &h)
            .err()
            .unwrap();
        assert!(e.starts_with("its LuaJIT's layout is not the one"), "{e}");
        let r = Reader::open(&mut Words(publish::MATCHES), &h).unwrap();
        assert_eq!(r.l, publish::Layout::LUAJIT_GC64);
        assert_eq!(r.jit, Some(JitLayout::LUAJIT_GC64));
        assert_eq!(r.mode(18), 0x0707);
        // A header of an older fibertrace ends where the running code's layout begins: its
        // stacks are read, a running fiber's Lua code is said not to be.
        let least = std::mem::offset_of!(Header, jit_checked);
        let mut old = h[..least].to_vec();
        let size = std::mem::offset_of!(Header, header_size);
        old[size..size + 4].copy_from_slice(&(least as u32).to_le_bytes());
        let mut r = Reader::open(&mut Words(publish::MATCHES), &old).unwrap();
        assert_eq!(r.jit, None);
        let e = r.running_top(&mut Same(0), 0x1000, None, &[]).unwrap_err();
        assert!(e.contains("an older fibertrace"), "{e}");
        // Cut shorter still, it is malformed.
        let e = Reader::open(&mut Words(publish::MATCHES), &old[..least - 8])
            .err()
            .unwrap();
        assert!(e.contains("malformed"), "{e}");
        let mut wild = h;
        let at = std::mem::offset_of!(Header, layout);
        wild[at..at + 4].copy_from_slice(&100_000u32.to_le_bytes());
        let e = Reader::open(&mut Words(publish::MATCHES), &wild)
            .err()
            .unwrap();
        assert!(e.contains("offsets out of range"), "{e}");
    }

    /// Memory where every address holds bytes drawn from a seed: whatever a target's
    /// garbage can be.
    struct Garbage(u64);
    impl Memory for Garbage {
        fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
            for (i, b) in out.iter_mut().enumerate() {
                let mut x = (addr.wrapping_add(i as u64) >> 3) ^ self.0;
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = (x >> ((addr.wrapping_add(i as u64) & 7) * 8)) as u8;
            }
            true
        }
    }

    /// Memory where every word holds the same value.
    struct Same(u64);
    impl Memory for Same {
        fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
            let w = self.0.to_le_bytes();
            for (i, b) in out.iter_mut().enumerate() {
                *b = w[(addr.wrapping_add(i as u64) & 7) as usize];
            }
            true
        }
    }

    #[test]
    fn garbage_memory_gives_an_error_or_levels_never_a_panic_or_a_hang() {
        let reader = || Reader {
            l: publish::Layout::LUAJIT_GC64,
            jit: Some(JitLayout::LUAJIT_GC64),
            trace: Some(TraceLayout::LUAJIT_GC64),
            overlay: None,
            bc_mode: (0..104u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16)
                .collect(),
            strings: HashMap::new(),
            protos: HashMap::new(),
            names: HashMap::new(),
            cached: 0,
            spent: std::time::Duration::ZERO,
            max_threads: MAX_THREADS,
            max_levels: (MAX_LEVELS, HEAD_LEVELS),
            called_states: None,
        };
        let t0 = std::time::Instant::now();
        for seed in 0..40u64 {
            let mut r = reader();
            for root in [
                0,
                8,
                0x1000,
                u64::MAX - 7,
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ] {
                let _ = r.stack(&mut Garbage(seed), root);
                // What runs now, read from garbage and garbage registers.
                let regs = Some((seed.wrapping_mul(0x51_7CC1), root ^ seed));
                for interp in [None, regs] {
                    if let Ok(Some(top)) = r.running_top(
                        &mut Garbage(seed),
                        root,
                        interp,
                        &[fibertrace_core::Frame::Pc(root ^ seed)],
                    ) {
                        let _ = r.stack_running(&mut Garbage(seed), root, Some(top));
                    }
                }
            }
        }
        for w in [
            0,
            1,
            8,
            0x10,
            u64::MAX,
            1 << 47,
            (0x7fff_u64 << 47) | 0x1000,
            0x1000,
        ] {
            let mut r = reader();
            for root in [0, 0x1000, u64::MAX] {
                let _ = r.stack(&mut Same(w), root);
                if let Ok(Some(top)) = r.running_top(
                    &mut Same(w),
                    root,
                    Some((w, w)),
                    &[fibertrace_core::Frame::Pc(w)],
                ) {
                    let _ = r.stack_running(&mut Same(w), root, Some(top));
                }
            }
        }
        // Bounded: the readers above did not run away (each stack is cut at 2^17 frames or
        // 2 s, a reader at 10 s).
        assert!(t0.elapsed() < std::time::Duration::from_secs(120));
        // All-zero memory: a chain of dummy frames down from the top of the address space.
        let e = reader().stack(&mut Same(0), 0).err().unwrap();
        assert_eq!(e, "more than 65536 frames");
        // One reader's total is bounded whatever its stacks are.
        let mut r = reader();
        r.spent = MAX_TOTAL_TIME + std::time::Duration::from_millis(1);
        let e = r.stack(&mut Garbage(1), 0x1000).err().unwrap();
        assert_eq!(e, "not read: reading Lua stacks took 10s already");
    }

    /// A trace's snapshot read from garbage (the trace's machine code made to hold the
    /// address, so the read goes on into the snapshot, its map and its IR) gives frames or
    /// nothing, never a panic or a wild walk (at most two or three words per level, 64
    /// levels).
    #[test]
    fn a_snapshot_read_from_garbage_gives_frames_or_nothing() {
        let mut r = Reader {
            l: publish::Layout::LUAJIT_GC64,
            jit: Some(JitLayout::LUAJIT_GC64),
            trace: Some(TraceLayout::LUAJIT_GC64),
            overlay: None,
            bc_mode: vec![0; 104],
            strings: HashMap::new(),
            protos: HashMap::new(),
            names: HashMap::new(),
            cached: 0,
            spent: std::time::Duration::ZERO,
            max_threads: MAX_THREADS,
            max_levels: (MAX_LEVELS, HEAD_LEVELS),
            called_states: None,
        };
        let tl = TraceLayout::LUAJIT_GC64;
        for seed in 0..20_000u64 {
            let mut mem = Garbage(seed);
            let t = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) & !7;
            let mcode = Reader::u64(&mut mem, t + tl.trace_mcode as u64).unwrap();
            let size = Reader::u32(&mut mem, t + tl.trace_szmcode as u64).unwrap() as u64;
            let at = mcode.wrapping_add(size / 2);
            let base = seed << 4;
            let code = [fibertrace_core::Frame::Pc(at)];
            if let Some(top) = r.snapshot_top(&mut mem, t, base, &code) {
                assert!(top.words.len() <= 3 * 64, "{}", top.words.len());
            }
            let _ = r.exit_top(&mut mem, t, base, at);
        }
        // Every word the same: a snapshot map of one value, a chain that does not end.
        for w in [
            0,
            1,
            8,
            u64::MAX,
            0x0101_0101_0101_0101,
            0x0200_0000_0000_0002,
        ] {
            let code = [fibertrace_core::Frame::Pc(w)];
            let _ = r.snapshot_top(&mut Same(w), 0x1000, 0x2000, &code);
            let _ = r.exit_top(&mut Same(w), 0x1000, 0x2000, w);
        }
    }

    /// The words a snapshot restores replace what memory holds, in any read that covers
    /// them whole or in part, and nothing else.
    #[test]
    fn an_overlay_shows_its_words_in_every_read_that_covers_them() {
        let words = [(0x10_1008, 0x1122_3344_5566_7788u64), (0x10_1020, u64::MAX)];
        let mut inner = Same(0);
        let mut m = snapshot::Overlay {
            inner: &mut inner,
            words: &words,
        };
        let mut b = [0u8; 48];
        assert!(m.read(0x10_1000, &mut b));
        assert_eq!(&b[..8], &[0; 8]);
        assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[16..32], &[0; 16]);
        assert_eq!(&b[32..40], &[0xff; 8]);
        assert_eq!(&b[40..], &[0; 8]);
        // Parts of a word, at either end of a read.
        let mut b = [0u8; 4];
        assert!(m.read(0x10_100c, &mut b));
        assert_eq!(b, [0x44, 0x33, 0x22, 0x11]);
        let mut b = [0u8; 6];
        assert!(m.read(0x10_1005, &mut b));
        assert_eq!(b, [0, 0, 0, 0x88, 0x77, 0x66]);
        // A read the memory below refuses stays refused.
        struct Refuse;
        impl Memory for Refuse {
            fn read(&mut self, _: u64, _: &mut [u8]) -> bool {
                false
            }
        }
        let mut m = snapshot::Overlay {
            inner: &mut Refuse,
            words: &words,
        };
        assert!(!m.read(0x10_1008, &mut [0u8; 8]));
        // A function object made up for the walk (where no memory is): zero but for its
        // words; past its room, refused.
        let fake = snapshot::FAKE_FUNCS;
        let words = [(fake + 32, 0x5555_6666_7777_8888u64)];
        let mut m = snapshot::Overlay {
            inner: &mut Refuse,
            words: &words,
        };
        let mut b = [0xaau8; 48];
        assert!(m.read(fake, &mut b));
        assert_eq!(&b[..32], &[0; 32]);
        assert_eq!(&b[32..40], &0x5555_6666_7777_8888u64.to_le_bytes());
        assert!(!m.read(fake.wrapping_sub(8), &mut [0u8; 16]));
        assert!(!m.read(0x10_0000, &mut [0u8; 8]));
    }
}
