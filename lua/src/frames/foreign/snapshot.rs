//! Compiled code's Lua frames, from the trace's snapshots: a trace keeps no PC and no frames
//! of the functions it inlined while it runs (they live in registers), but for each point
//! where it may exit it keeps a *snapshot* — the bytecode PC to go on at, and the stack
//! slots to write back, the frames of inlined calls among them — which LuaJIT's exit
//! handler uses to rebuild the interpreter's stack. Read here, the snapshot nearest before an
//! address of the trace's machine code (the thread's PC, or a return address into the trace
//! from a call it made: an allocation) gives that point's frames and line.
//!
//! How it is read (LuaJIT 2.1, GC64, two slots per frame): the snapshots are ordered by
//! their machine-code offset (`mcofs`: where the code after each begins), so the one for an
//! offset is the last whose `mcofs` is not past it (the search LuaJIT's `trace_exit_find`
//! does). Its map holds `nent` entries (`slot << 24 | flags | IR reference`) and then one
//! 64-bit word, `PC << 8 | (innermost frame's function slot)`. Slot `s` is the stack slot
//! `8 * (s - 2)` bytes above the base the trace runs with (`jit_base`, which a trace that
//! returns below its start moves too). An inlined frame's function slot holds an IR constant
//! of the function, its link slot the frame link as a 64-bit number constant (the caller's
//! return PC, or a delta for vararg, continuation and protected-call frames; a
//! continuation's PC is the slot below the function). A function the trace holds by its
//! prototype only (a closure made again and again, one of several closures of a function)
//! has no constant: its prototype is found from an instruction inside it (the snapshot's
//! PC, or the call its callee returns to), and a function object with that prototype is
//! made up for the walk, at an address no process maps.
//!
//! The frames are handed to the walk as *memory*: [`Overlay`] shows those slots with the
//! values an exit would write back (and the made-up objects), so the walk, the names callers
//! give and the lines are the interpreter's own code paths.
//!
//! Invariants: nothing is used unless it checks out — the trace's machine code holds the
//! address, the snapshot and its map are inside their arrays, every frame from the innermost
//! down to the trace's base has a function (a constant, or a prototype found and checked)
//! and a constant link in the snapshot, the chain lands on the base frame exactly, and (the
//! caller checks) a Lua function is at the innermost frame with the PC inside it; otherwise
//! the caller falls back to the trace's base function. How a result can be wrong: the
//! snapshot is the state *before* the guard that follows it, and the code after it runs on
//! to the next snapshot. With Lua safe points on, LuaJIT's profiler (line mode) makes the
//! trace take a snapshot at every line and every function it enters, so the function and
//! line are the code's; without, snapshots are at guards only, and a function entered (or a
//! line reached) after the last guard before the address is missing (its caller, its
//! earlier line shown); a function inlined and returned from before the address may show.

use fibertrace_core::Frame;
use smallvec::SmallVec;

use super::{Memory, Reader, T_FUNC};

/// A prototype's object type byte (`gct`), and its value for a prototype (`~LJ_TPROTO`).
const PROTO_GCT: u64 = 9;
const GCT_PROTO: u8 = 7;
/// The IR reference bias (`REF_BIAS`): references below it are constants.
const REF_BIAS: u32 = 0x8000;
/// An IR instruction's size, and where its type byte is (its opcode byte follows).
const IRINS: u64 = 8;
const IR_TYPE: u64 = 4;
/// The IR type of a function (`IRT_FUNC`), in the low five bits of the type byte.
const IRT_FUNC: u8 = 8;
/// A snapshot entry's frame-link and continuation flags (`SNAP_FRAME`, `SNAP_CONT`).
const SNAP_FRAME: u32 = 0x01_0000;
const SNAP_CONT: u32 = 0x02_0000;
/// Most entries a snapshot has (`nent` is a `u8`).
const MAX_ENTRIES: usize = 255;
/// Most inlined frames followed (LuaJIT's own bound on a trace's frame depth is lower).
const MAX_DEPTH: usize = 64;
/// Where function objects made up for the walk are ([`Overlay`]): addresses no process maps
/// (below Linux's lowest mappable address, 64 KiB), one [`FAKE_SIZE`] each.
pub(super) const FAKE_FUNCS: u64 = 0x1000;
const FAKE_SIZE: u64 = 64;
const FAKE_END: u64 = 0x2000;
/// Most instructions looked back from one to the start of its function's code.
const MAX_SCAN: u64 = 1 << 14;

/// Stack words an exit would restore: (address, value).
pub(in crate::frames) type Words = SmallVec<[(u64, u64); 16]>;

/// The innermost frame of compiled code at a point, from the trace's snapshot: its base,
/// its PC (as a frame link holds it: the instruction after the current one) and the stack
/// words the walk needs to see the inlined frames above the trace's base.
pub(in crate::frames) struct SnapTop {
    pub base: u64,
    pub pc: u64,
    pub words: Words,
}

/// Memory with some 8-byte words shown with other values (the slots a trace's snapshot
/// restores).
pub(in crate::frames) struct Overlay<'a> {
    pub inner: &'a mut dyn Memory,
    pub words: &'a [(u64, u64)],
}

impl Memory for Overlay<'_> {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        if !self.inner.read(addr, out) {
            // A function object made up for the walk: its bytes are zero but for its words
            // (a read anywhere else of that room fails, as the memory's own).
            let block = |a: u64| (a.wrapping_sub(FAKE_FUNCS)) / FAKE_SIZE;
            let made = addr >= FAKE_FUNCS
                && addr
                    .checked_add(out.len() as u64)
                    .is_some_and(|e| e <= FAKE_END && block(e - 1) == block(addr))
                && self
                    .words
                    .iter()
                    .any(|&(w, _)| (FAKE_FUNCS..FAKE_END).contains(&w) && block(w) == block(addr));
            if !made {
                return false;
            }
            out.fill(0);
        }
        let end = addr.saturating_add(out.len() as u64);
        for &(at, v) in self.words {
            let (from, to) = (at.max(addr), at.saturating_add(8).min(end));
            if from < to {
                let bytes = v.to_le_bytes();
                out[(from - addr) as usize..(to - addr) as usize]
                    .copy_from_slice(&bytes[(from - at) as usize..(to - at) as usize]);
            }
        }
        true
    }
}

impl Reader {
    /// The start of the code (the first instruction, just after its prototype) of the Lua
    /// function whose instruction is at `ins`: looked back for the function-header
    /// instruction every prototype's code starts with (and only it), checked against the
    /// prototype before it (its object type, its code's length holding `ins`). At most
    /// [`MAX_SCAN`] instructions back.
    fn code_of(&mut self, mem: &mut dyn Memory, ins: u64) -> Option<u64> {
        let l = self.l;
        if ins & 3 != 0 {
            return None;
        }
        // The function headers: FUNCF, IFUNCF, JFUNCF, FUNCV, IFUNCV, JFUNCV, just before
        // FUNCC.
        let first = l.op_funcc.checked_sub(6)?..l.op_funcc;
        for k in 0..MAX_SCAN {
            let at = ins.checked_sub(4 * k)?;
            if !first.contains(&Self::u8(mem, at).ok()?) {
                continue;
            }
            let pt = at.wrapping_sub(l.proto_size as u64);
            let sizebc = Self::u32(mem, pt.wrapping_add(l.proto_sizebc as u64)).ok()? as u64;
            let ok = Self::u8(mem, pt.wrapping_add(PROTO_GCT)).ok()? == GCT_PROTO
                && ins < at.wrapping_add(4 * sizebc);
            return ok.then_some(at);
        }
        None
    }

    /// A function object made up for the walk (at the next free place of the [`FAKE_FUNCS`]
    /// room, its words added to `words`), a Lua function whose code holds the instruction at
    /// `inside`: its value as a stack slot holds it.
    fn made_up_function(
        &mut self,
        mem: &mut dyn Memory,
        inside: u64,
        made: &mut u64,
        words: &mut Words,
    ) -> Option<u64> {
        let code = self.code_of(mem, inside)?;
        let fake = FAKE_FUNCS + FAKE_SIZE * *made;
        if fake + FAKE_SIZE > FAKE_END {
            return None;
        }
        *made += 1;
        let l = self.l;
        // (The kind and upvalue-count bytes are in the word at 8: zero, a Lua function.)
        words.push((fake + (l.func_ffid as u64 & !7), 0));
        words.push((fake + l.func_pc as u64, code));
        Some(((T_FUNC as u64) << 47) | fake)
    }

    /// The frames of trace `t` (running with base `jit_base`) at the first of `code`'s
    /// frames in its machine code (innermost first: the thread's PC, return addresses),
    /// from the snapshot nearest before it (see the module doc); `None` when the process
    /// published no trace layout, no frame is in the trace's code, or what the snapshot
    /// holds does not check out.
    pub(super) fn snapshot_top(
        &mut self,
        mem: &mut dyn Memory,
        t: u64,
        jit_base: u64,
        code: &[Frame],
    ) -> Option<SnapTop> {
        let tl = self.trace?;
        let field = |off: u32| t.wrapping_add(off as u64);
        let mcode = Self::u64(mem, field(tl.trace_mcode)).ok()?;
        let size = Self::u32(mem, field(tl.trace_szmcode)).ok()? as u64;
        let ofs = code
            .iter()
            .filter_map(Frame::lookup_address)
            .find_map(|a| a.checked_sub(mcode).filter(|&o| o < size))?;
        let nsnap = u16::from_le_bytes(Self::bytes(mem, field(tl.trace_nsnap)).ok()?) as u64;
        let snaps = Self::u64(mem, field(tl.trace_snap)).ok()?;
        let snap = |i: u64| snaps.wrapping_add(i.wrapping_mul(tl.snap_size as u64));
        // The last snapshot whose code begins at or before the offset.
        let (mut lo, mut hi) = (0u64, nsnap);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let mcofs = u16::from_le_bytes(
                Self::bytes(mem, snap(mid).wrapping_add(tl.snap_mcofs as u64)).ok()?,
            ) as u64;
            if ofs < mcofs {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let k = lo.checked_sub(1)?;
        self.snapshot_frames(mem, t, k, jit_base)
    }

    /// The frames a trace's exit is restoring now, when state `th`'s saved PC (`pc`, as a
    /// frame link holds it) is the one the exit's snapshot saved — the exit handler saves it
    /// first, before it writes the snapshot's slots onto the stack from the trace's base
    /// (`base`, the state's base until the restore ends) and makes the objects the trace did
    /// not make yet. The trace and snapshot are the ones the JIT state names for the exit
    /// in progress (`J->parent`, `J->exitno`; `g`: the global state).
    pub(super) fn exit_top(
        &mut self,
        mem: &mut dyn Memory,
        g: u64,
        base: u64,
        pc: u64,
    ) -> Option<SnapTop> {
        let tl = self.trace?;
        let no = Self::u32(mem, g.wrapping_add(tl.g_exit_trace as u64)).ok()?;
        let k = Self::u32(mem, g.wrapping_add(tl.g_exit_snap as u64)).ok()? as u64;
        let t = self.trace_numbered(mem, g, no as i32)?;
        let nsnap =
            u16::from_le_bytes(Self::bytes(mem, t.wrapping_add(tl.trace_nsnap as u64)).ok()?)
                as u64;
        if k >= nsnap {
            return None;
        }
        // (Saved as the instruction after the snapshot's, or the snapshot's own — as the
        // interpreter's frame keeps it — once the restore is done.)
        self.snapshot_frames(mem, t, k, base)
            .filter(|top| top.pc == pc || top.pc == pc.wrapping_add(4))
    }

    /// The frames of snapshot `k` of trace `t` running with base `jit_base` (see the module
    /// doc).
    fn snapshot_frames(
        &mut self,
        mem: &mut dyn Memory,
        t: u64,
        k: u64,
        jit_base: u64,
    ) -> Option<SnapTop> {
        let tl = self.trace?;
        let field = |off: u32| t.wrapping_add(off as u64);
        let snap_k = Self::u64(mem, field(tl.trace_snap))
            .ok()?
            .wrapping_add(k.wrapping_mul(tl.snap_size as u64));
        let mapofs = Self::u32(mem, snap_k).ok()? as u64;
        let nent = Self::u8(mem, snap_k.wrapping_add(tl.snap_nent as u64)).ok()? as usize;
        let nsnapmap = Self::u32(mem, field(tl.trace_nsnapmap)).ok()? as u64;
        if mapofs + nent as u64 + 2 > nsnapmap {
            return None;
        }
        let map = Self::u64(mem, field(tl.trace_snapmap)).ok()?;
        let mut raw = [0u8; 4 * (MAX_ENTRIES + 2)];
        let raw = &mut raw[..4 * (nent + 2)];
        if !mem.read(map.wrapping_add(4 * mapofs), raw) {
            return None;
        }
        let pcbase = u64::from_le_bytes(raw[4 * nent..].try_into().ok()?);
        let (pc, top) = (pcbase >> 8, (pcbase & 0xff) as u32);
        let ir = Self::u64(mem, field(tl.trace_ir)).ok()?;
        let nk = Self::u32(mem, field(tl.trace_nk)).ok()?;
        // The constant slots: (slot, flags, value as the stack holds it).
        let mut consts: SmallVec<[(u32, u32, u64); 32]> = SmallVec::new();
        // Whether the snapshot holds the base frame's function slot at all.
        let mut has_base = false;
        for e in raw[..4 * nent].chunks_exact(4) {
            let sn = u32::from_le_bytes(e.try_into().ok()?);
            let (slot, flags, r) = (sn >> 24, sn & 0x00ff_0000, sn & 0xffff);
            has_base |= slot == 0;
            if r >= REF_BIAS || r < nk {
                continue;
            }
            let ins = ir.wrapping_add(IRINS * r as u64);
            let [ty, op] = Self::bytes::<2>(mem, ins.wrapping_add(IR_TYPE)).ok()?;
            let v = Self::u64(mem, ins.wrapping_add(IRINS)).ok()?;
            let value = if op as u32 == tl.ir_kgc && ty & 0x1f == IRT_FUNC {
                ((T_FUNC as u64) << 47) | (v & super::GCV_MASK)
            } else if op as u32 == tl.ir_knum {
                v
            } else {
                continue;
            };
            consts.push((slot, flags, value));
        }
        let get = |s: u32, flag: u32| {
            consts
                .iter()
                .find(|c| c.0 == s && (flag == 0 || c.1 & flag != 0))
                .map(|c| c.2)
        };
        let addr = |s: u32| jit_base.wrapping_add(8 * s as u64).wrapping_sub(16);
        // From the innermost frame down to the trace's base (slot 0), each frame's function
        // and link constants.
        let mut words = Words::new();
        let mut s = top;
        let mut depth = 0;
        // An instruction of the function at `s` (the snapshot's own; then each caller's call
        // or metamethod instruction): a function the trace does not hold as a constant is
        // found from it.
        let mut inside = Some(pc);
        let mut made = 0;
        while s > 0 {
            depth += 1;
            if depth > MAX_DEPTH {
                return None;
            }
            let func = match get(s, 0).filter(|&v| super::itype(v) == T_FUNC) {
                Some(f) => f,
                // A closure the trace checks by its prototype only (one made again and
                // again, or many of one function).
                None => self.made_up_function(mem, inside?, &mut made, &mut words)?,
            };
            let link = get(s + 1, SNAP_FRAME | SNAP_CONT)?;
            words.push((addr(s), func));
            words.push((addr(s + 1), link));
            let down = if link & 3 == 0 {
                // A Lua frame: the call instruction before the return PC sizes the caller.
                let ins = Self::u32(mem, link.wrapping_sub(4)).ok()?;
                inside = Some(link.wrapping_sub(4));
                2 + ((ins >> 8) & 0xff)
            } else {
                match link & 7 {
                    // A continuation: its PC (of the instruction after the one that called
                    // the metamethod) is the slot below the function.
                    2 => {
                        let pc = get(s.checked_sub(1)?, 0)?;
                        words.push((addr(s - 1), pc));
                        inside = Some(pc.wrapping_sub(4));
                    }
                    // A vararg frame's upper half (the lower half is the same function's).
                    3 => {}
                    // A protected call's callee (`pcall`, `xpcall`): below it, the call's
                    // own frame.
                    6 | 7 => inside = None,
                    _ => return None,
                }
                u32::try_from((link & !7) / 8).ok()?
            };
            s = s.checked_sub(down)?;
        }
        // The trace's base frame: its function is the one on the stack, unless the trace
        // tail-called another in its place (the snapshot holds the callee there, the stack
        // the caller until the trace exits).
        if has_base {
            let func = match get(0, 0) {
                Some(f) if super::itype(f) == T_FUNC => Some(f),
                Some(_) => return None,
                None => {
                    // Not a constant (a side trace's slot it took from its parent, say):
                    // the stack's own function when its code holds the instruction.
                    let at = inside?;
                    let own = Self::u64(mem, addr(0)).ok().filter(|&tv| {
                        super::itype(tv) == T_FUNC
                            && self
                                .pc_position(mem, tv & super::GCV_MASK, at.wrapping_add(4))
                                .is_some()
                    });
                    match own {
                        Some(_) => None,
                        None => Some(self.made_up_function(mem, at, &mut made, &mut words)?),
                    }
                }
            };
            if let Some(func) = func {
                words.push((addr(0), func));
            }
        }
        Some(SnapTop {
            base: addr(top).wrapping_add(16),
            pc: pc.wrapping_add(4),
            words,
        })
    }
}
