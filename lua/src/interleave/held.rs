//! The Lua host's frames read from another thread while its scheduler's thread is held still
//! ([`HeldLua`], the runtime's [`HeldSource`]): what a dump asked from another thread (the
//! SIGQUIT dump's, the HTTP endpoint's) shows when that thread is away in native code for
//! good — `os.execute`, a blocking read, a C library call through the FFI — and can be asked
//! neither between fibers nor at a safe point. Each Lua fiber's stack is read from this
//! process's memory as `fibertrace dump PID` reads another's ([`crate::frames::foreign`]
//! over [`SelfMem`]: a read of an unmapped address fails, it never faults), and merged with
//! its native frames as in-process ([`super::merge_with_gap`], over this process's VM map).
//!
//! The fiber whose thread was stopped: its Lua state is current when the thread is in C
//! code that Lua called (LuaJIT records the frame base at every call out of Lua), which its
//! frames show (the interpreter's own frame below the C code, no code outside every image
//! above it) and the VM state confirms (not running Lua code). In compiled code its levels
//! come from the base the trace was entered with, in the interpreter from its base and PC
//! registers where the thread was stopped, as `dump PID` reads them (each checked against
//! the state's stack and the function's code first: held in the interpreter's glue — a
//! continuation's dispatch, a return from C code — they are not yet an instruction's, and the
//! fiber is shown with its native frames and the reason). A trace's code has no unwind record:
//! the runtime's walk goes on below it from the record of the call that entered the VM
//! ([`HeldLua`]'s `below_unwound`, `L->cframe`), and the levels take the trace's frame's place.
//!
//! Under the hold the symbolizer answers from its caches only
//! (`fibertrace_core::capture::holding_another_thread`: the thread may have been stopped
//! inside the symbolizer, holding the lock a lookup would wait for until the hold runs out,
//! and the read be lost), so the merges are done again once the thread is let go
//! ([`HeldSource::end`]), from what was read under the hold. The reader
//! still interns the levels it reads (the Lua frame descriptions' table, whose lock a held
//! thread capturing a Lua trace holds for a moment): a thread stopped just then makes the
//! read wait until the hold runs out, and the read is lost.
//!
//! How a result can be wrong: as the foreign reader's (a thread held inside a collector step
//! that moves a stack reads a torn stack; the reader checks every link and says where it
//! fails). LuaJIT only: the layout is published and checked for it.

use std::sync::Mutex;

use fibertrace_core::Frame;
use fibertrace_fiber::inspect::{AfterHold, HeldSource};
use smallvec::SmallVec;

use super::classify::VmMap;
use super::foreign::{INTERP_BASE, INTERP_PC};
use crate::frames::foreign::{Memory, Reader, SelfMem};
use crate::frames::LuaLevel;

/// What a fiber held in LuaJIT's interpreter, whose registers do not check out there or
/// are not read, is shown without.
const IN_INTERPRETER: &str = "its thread was stopped in LuaJIT's interpreter, whose state does \
                              not say which Lua code runs there: its Lua frames are not read";

/// The Lua host's [`HeldSource`] (see the module doc).
pub struct HeldLua {
    state: Mutex<State>,
    vm: &'static VmMap,
    /// The merges of the current hold, done again after it ([`HeldSource::end`]).
    redo: Mutex<Vec<Redo>>,
}

/// A merge to do again once the thread is let go: what it merged.
struct Redo {
    word: u64,
    native: Vec<Frame>,
    levels: Vec<LuaLevel>,
    gap: Option<(usize, u64)>,
}

/// The reader and the memory it reads, used together under the lock.
struct State {
    reader: Reader,
    mem: PageMem,
}

/// Bytes of a page of [`PageMem`]'s cache.
const PAGE: u64 = 4096;
/// Pages [`PageMem`] keeps at most (16 MiB): past it, it starts over.
const MAX_PAGES: usize = 4096;

/// This process's memory read as another's ([`SelfMem`]: a read of an unmapped address
/// fails), a page at a time while a read under one hold goes on (`on`): each Lua stack is
/// read in small pieces (a frame link, a slot, a prototype's field), a system call each;
/// kept pages make them one call per page. Outside a hold nothing is kept (memory changes).
struct PageMem {
    on: bool,
    pages: std::collections::HashMap<u64, Option<Box<[u8]>>>,
}

impl Memory for PageMem {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        if !self.on {
            return SelfMem.read(addr, out);
        }
        let Some(end) = addr.checked_add(out.len() as u64) else {
            return false;
        };
        let mut at = addr;
        while at < end {
            let page = at & !(PAGE - 1);
            if self.pages.len() >= MAX_PAGES && !self.pages.contains_key(&page) {
                self.pages.clear();
            }
            let bytes = self.pages.entry(page).or_insert_with(|| {
                let mut b = vec![0u8; PAGE as usize].into_boxed_slice();
                SelfMem.read(page, &mut b).then_some(b)
            });
            let Some(bytes) = bytes else {
                return false;
            };
            let from = (at - page) as usize;
            let n = ((PAGE - (at - page)) as usize).min((end - at) as usize);
            let o = (at - addr) as usize;
            out[o..o + n].copy_from_slice(&bytes[from..from + n]);
            at += n as u64;
        }
        true
    }
}

impl HeldLua {
    /// The source for this process's Lua host, when its layout was checked at start-up
    /// (`Err`: why not).
    pub fn new() -> Result<HeldLua, String> {
        Ok(HeldLua {
            state: Mutex::new(State {
                reader: Reader::own()?,
                mem: PageMem {
                    on: false,
                    pages: std::collections::HashMap::new(),
                },
            }),
            vm: super::classify::vm_map(),
            redo: Mutex::new(Vec::new()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `native` with the Lua levels `levels` of state `word` merged in, under the hold, where
    /// the symbolizer answers from its caches only (see
    /// `fibertrace_core::capture::holding_another_thread`): a C function's extent or the
    /// runtime's trampoline frame it has no answer for yet is not known here. So the merge is
    /// done again after the hold ([`HeldSource::end`]), from the same frames and levels, the
    /// trampoline frame left out first as the runtime leaves it out of a fiber's frames; this
    /// one stands for it until then.
    fn merge_held(
        &self,
        word: u64,
        native: &[Frame],
        levels: &[LuaLevel],
        gap: Option<(usize, u64)>,
    ) -> Vec<Frame> {
        let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
        super::merge_with_gap(native, levels, gap, self.vm, false, &mut out);
        self.redo
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Redo {
                word,
                native: native.to_vec(),
                levels: levels.to_vec(),
                gap,
            });
        out.into_vec()
    }

    /// `native` with the Lua stack of state `word` merged in (its recorded base, or `top`).
    fn merged(
        &self,
        st: &mut State,
        word: u64,
        native: &[Frame],
        top: Option<crate::frames::foreign::RunningTop>,
    ) -> (Option<Vec<Frame>>, Option<String>) {
        match st.reader.stack_running(&mut st.mem, word, top) {
            Ok(lua) => {
                let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
                (Some(self.merge_held(word, native, &lua.levels, gap)), None)
            }
            Err(why) => (
                None,
                Some(format!("its Lua frames could not be read: {why}")),
            ),
        }
    }
}

impl HeldSource for HeldLua {
    fn frames(&self, word: u64, native: &[Frame]) -> (Option<Vec<Frame>>, Option<String>) {
        self.merged(&mut self.state(), word, native, None)
    }

    fn running_frames(
        &self,
        word: u64,
        native: &[Frame],
        register: &dyn Fn(u16) -> Option<u64>,
    ) -> (Option<Vec<Frame>>, Option<String>) {
        // (Where the runtime's walk went on below a trace, if it did: see `below_unwound`.)
        let below = self.below_unwound(word).map(|r| r.ip);
        let mut guard = self.state();
        let st = &mut *guard;
        let interp = self.vm.interpreter;
        let in_interp = |a: u64| interp.is_some_and(|(s, e)| a >= s && a < e);
        // Stopped in the interpreter: its frame base and PC are its registers.
        let regs = native
            .first()
            .and_then(|f| f.lookup_address())
            .is_some_and(in_interp)
            .then(|| Some((register(INTERP_BASE)?, register(INTERP_PC)?)))
            .flatten();
        let top = match st.reader.running_top(&mut st.mem, word, regs, native) {
            Ok(Some(top)) if !top.compiled => return self.merged(st, word, native, Some(top)),
            Ok(top) => top,
            // Held in the interpreter's glue (a continuation's dispatch, a return from C
            // code), whose registers are not yet the ones its instructions keep there: as
            // where they are not read.
            Err(why) if regs.is_some() => {
                return (None, Some(format!("{IN_INTERPRETER} ({why})")));
            }
            Err(why) => {
                return (
                    None,
                    Some(format!("its Lua frames could not be read: {why}")),
                )
            }
        };
        let known =
            |a: u64| fibertrace_core::image::published().is_some_and(|t| t.image_of(a).is_some());
        if let Some(top) = top.filter(|t| t.compiled) {
            // A trace: the native frames down to its code (the first outside every image),
            // then the Lua levels from the base it was entered with.
            let lua = match st.reader.stack_running(&mut st.mem, word, Some(top)) {
                Ok(lua) => lua,
                Err(why) => {
                    return (
                        None,
                        Some(format!("its Lua frames could not be read: {why}")),
                    )
                }
            };
            let cut = native
                .iter()
                .position(|f| f.lookup_address().is_some_and(|a| !known(a)))
                .map_or(native.len(), |i| i + 1);
            let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
            // The walk went on below the trace (the frame after the trace's is the VM entry's
            // return address): the frames below too, merged as the interpreter's, the
            // levels in the trace's own frame's place (it runs the innermost one's code).
            if cut > 0 && below.is_some_and(|ra| native.get(cut) == Some(&Frame::Ra(ra))) {
                let mut rest: SmallVec<[Frame; 64]> = SmallVec::new();
                rest.extend_from_slice(&native[..cut - 1]);
                rest.extend_from_slice(&native[cut..]);
                let out = self.merge_held(word, &rest, &lua.levels, gap);
                // (From the trace's snapshot, its levels are the ones an exit would restore:
                // nothing to say.)
                let note = (!top.snapshot).then(|| {
                    "it runs compiled Lua code (a trace): its innermost Lua level is the \
                     function the trace runs in (a function the trace inlined has no level)"
                        .into()
                });
                return (Some(out), note);
            }
            let mut out = native[..cut].to_vec();
            for (j, l) in lua.levels.iter().enumerate() {
                if gap.is_some_and(|(at, _)| at == j) {
                    out.push(Frame::Omitted(lua.omitted));
                }
                out.push(Frame::Lua(l.id));
            }
            let note = if top.snapshot {
                "it runs compiled Lua code (a trace): the native frames below the trace are \
                 not walked"
            } else {
                "it runs compiled Lua code (a trace): its innermost Lua level is the \
                 function the trace runs in, and the native frames below the trace are not \
                 walked"
            };
            return (Some(out), Some(note.into()));
        }
        // C code that Lua called: the interpreter's frame is below it, and no code outside
        // every image is above it.
        for (i, f) in native.iter().enumerate() {
            let Some(a) = f.lookup_address() else {
                continue;
            };
            if in_interp(a) {
                if i == 0 {
                    return (None, Some(IN_INTERPRETER.into()));
                }
                return self.merged(st, word, native, None);
            }
            if !known(a) {
                return (
                    None,
                    Some(format!(
                        "its thread runs code outside every loaded image ({a:#x}): its Lua \
                         frames are not read"
                    )),
                );
            }
        }
        // No interpreter frame: not called from Lua code (the fiber's body in native code).
        self.merged(st, word, native, None)
    }

    /// In compiled code, the record of the call that entered the VM for the running state
    /// ([`Reader::vm_entry_record`]), when its return address is in a loaded image.
    fn below_unwound(&self, word: u64) -> Option<fibertrace_core::arch::Registers> {
        let mut guard = self.state();
        let st = &mut *guard;
        let top = st.reader.running_top(&mut st.mem, word, None, &[]).ok()??;
        if !top.compiled {
            return None;
        }
        let rec = st.reader.vm_entry_record(&mut st.mem, top.th).ok()??;
        let mut b = [0u8; 16];
        if !st.mem.read(rec, &mut b) {
            return None;
        }
        let fp = u64::from_le_bytes(b[..8].try_into().ok()?);
        let ra = u64::from_le_bytes(b[8..].try_into().ok()?);
        let known = fibertrace_core::image::published().is_some_and(|t| t.image_of(ra).is_some());
        known.then_some(fibertrace_core::arch::Registers {
            ip: ra,
            sp: rec.wrapping_add(16),
            fp,
        })
    }

    fn name(&self, id: fibertrace_core::LuaFrameId) -> Option<String> {
        crate::render::lua_line(id)
    }

    fn begin(&self) {
        let mut st = self.state();
        // A fresh reader: its caches (strings, prototypes, names by address) are of the
        // last hold's memory, where another object may live now.
        if let Ok(r) = Reader::own() {
            st.reader = r;
        }
        st.mem.pages.clear();
        st.mem.on = true;
        self.redo.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn end(&self) -> Vec<AfterHold> {
        let mut st = self.state();
        st.mem.on = false;
        st.mem.pages = std::collections::HashMap::new();
        drop(st);
        let vm = self.vm;
        let redo = std::mem::take(&mut *self.redo.lock().unwrap_or_else(|e| e.into_inner()));
        redo.into_iter()
            .map(|r| -> AfterHold {
                Box::new(move || {
                    let native = fibertrace_fiber::info::user_frames(&r.native);
                    let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
                    super::merge_with_gap(native, &r.levels, r.gap, vm, false, &mut out);
                    (r.word, out.into_vec())
                })
            })
            .collect()
    }
}
