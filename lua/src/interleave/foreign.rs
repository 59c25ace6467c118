//! The Lua host's frames in another process's dump: [`LuaLayer`] is the
//! [`ForeignLayer`] that `fibertrace dump PID` gives the fiber runtime's reader. For each
//! suspended Lua fiber it reads the fiber's Lua stack from the target's memory
//! ([`crate::frames::foreign`]) and merges it with the fiber's native frames as in-process
//! ([`super::merge_with_gap`]), over a VM map of the *target's* files
//! ([`VmMap::from_files`]).
//!
//! How a result can be wrong: as [`crate::frames::foreign`] and the merge (a C level whose
//! function no symbol table of the target names is not anchored: its Lua run moves down).

use fibertrace_core::arch::Registers;
use fibertrace_core::remote::Session;
use fibertrace_core::symbolize::{Resolved, Symbol};
use fibertrace_core::Frame;
use fibertrace_fiber::inspect::foreign::{join_notes, ForeignLayer};
use smallvec::SmallVec;

use super::classify::VmMap;
use crate::frames::foreign::Reader;

/// Why a running fiber has no Lua frames from outside.
const RUNS_LUA: &str = "it runs Lua code (LuaJIT's interpreter or a compiled trace), whose \
                        frames are read inside the process only (SIGQUIT, --stall-ms)";
/// What a fiber caught in compiled Lua code is shown without.
const COMPILED: &str = "it runs compiled Lua code (a trace): its innermost Lua level is the \
                        function the trace runs in, and the native frames below the trace are \
                        not walked (SIGQUIT or --stall-ms read them inside the process)";
/// What a fiber caught in compiled Lua code is shown without, when its levels are its trace's
/// snapshot's.
const COMPILED_SNAPSHOT: &str = "it runs compiled Lua code (a trace): the native frames below \
                                 the trace are not walked (SIGQUIT or --stall-ms read them \
                                 inside the process)";
/// What a fiber caught in compiled Lua code is shown without, when the native frames below
/// the trace are walked from where the VM entered it ([`LuaLayer::below_unwound`]).
const COMPILED_BELOW: &str = "it runs compiled Lua code (a trace): its innermost Lua level is \
                              the function the trace runs in (a function the trace inlined \
                              has no level)";
/// The note of a thread whose walk went on below a trace.
const BELOW_TRACE: &str = "compiled Lua code (a trace) has no unwind record: the frames below \
                           it are walked from where LuaJIT's VM was entered";
// The record of the VM's entry is where the interpreter's frame-pointer hop finds it.
const _: () =
    assert!(crate::frames::foreign::VM_ENTRY_RECORD == super::classify::LUAJIT_CFRAME_HOP);
/// What a fiber caught in compiled Lua code by a non-blocking dump is shown without.
const COMPILED_UNHELD: &str = "it runs compiled Lua code (a trace), read while it runs: its \
                               innermost Lua level is the function the trace runs in; its \
                               native frames are not read";

/// Appends `lua`'s levels to `out` as frames, with its gap where levels were left out.
fn push_levels(lua: &crate::frames::LuaStack, out: &mut Vec<Frame>) {
    let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
    for (j, l) in lua.levels.iter().enumerate() {
        if gap.is_some_and(|(at, _)| at == j) {
            out.push(Frame::Omitted(lua.omitted));
        }
        out.push(Frame::Lua(l.id));
    }
}

/// The DWARF numbers of the registers that hold LuaJIT's interpreter's frame base and PC
/// (`vm_x64.dasc`: `BASE` is `rdx`, `PC` is `rbx`).
#[cfg(target_arch = "x86_64")]
pub(super) const INTERP_BASE: u16 = 1;
#[cfg(target_arch = "x86_64")]
pub(super) const INTERP_PC: u16 = 3;

/// The Lua host's [`ForeignLayer`] (see the module doc).
#[derive(Default)]
pub struct LuaLayer {
    reader: Option<Reader>,
    vm: Option<VmMap>,
}

impl LuaLayer {
    /// A layer that has not looked at any process yet.
    pub fn new() -> LuaLayer {
        LuaLayer::default()
    }

    /// [`ForeignLayer::running_frames`]'s frames and note, and whether the note says why
    /// the walk of the thread's frames stopped (it stopped in a trace's code).
    fn running_frames_of(
        &mut self,
        s: &mut Session,
        word: u64,
        native: Vec<Frame>,
        thread: i32,
    ) -> (Vec<Frame>, Option<String>, bool) {
        // (Where the runtime's walk went on below a trace, if it did: see `below_unwound`.)
        let below = self.below_unwound(s, word).map(|(r, _)| r.ip);
        let (Some(reader), Some(vm)) = (self.reader.as_mut(), self.vm.as_ref()) else {
            return (native, Some("its Lua frames are not read".into()), false);
        };
        let interp = vm.interpreter;
        let in_interp = |a: u64| interp.is_some_and(|(s, e)| a >= s && a < e);
        let top_in_interp = native
            .first()
            .and_then(|f| f.lookup_address())
            .is_some_and(in_interp);
        let regs = top_in_interp
            .then(|| {
                Some((
                    s.thread_register(thread, INTERP_BASE)?,
                    s.thread_register(thread, INTERP_PC)?,
                ))
            })
            .flatten();
        match reader.running_top(s, word, regs, &native) {
            Ok(Some(top)) => {
                let lua = match reader.stack_running(s, word, Some(top)) {
                    Ok(lua) => lua,
                    Err(why) => {
                        return (
                            native,
                            Some(format!("its Lua frames could not be read: {why}")),
                            false,
                        )
                    }
                };
                let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
                if !top.compiled {
                    let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
                    super::merge_with_gap(&native, &lua.levels, gap, vm, false, &mut out);
                    return (out.into_vec(), None, false);
                }
                // Compiled code: the native frames down to the trace's (the first outside
                // every image), then the Lua levels; and where the walk went on below the
                // trace (from the VM's entry: the frame after the trace's is that return
                // address), the frames below too, merged as the interpreter's: the trace's
                // own frame is the innermost Lua level's (the code it runs), so the levels
                // stand in its place.
                let cut = native
                    .iter()
                    .position(|f| f.lookup_address().is_some_and(|a| !s.knows_code(a)))
                    .map_or(native.len(), |i| i + 1);
                if cut > 0 && below.is_some_and(|ra| native.get(cut) == Some(&Frame::Ra(ra))) {
                    let mut rest: SmallVec<[Frame; 64]> = SmallVec::new();
                    rest.extend_from_slice(&native[..cut - 1]);
                    rest.extend_from_slice(&native[cut..]);
                    let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
                    super::merge_with_gap(&rest, &lua.levels, gap, vm, false, &mut out);
                    // (From the trace's snapshot, its levels are the ones an exit would
                    // restore: nothing to say.)
                    let note = (!top.snapshot).then(|| COMPILED_BELOW.into());
                    return (out.into_vec(), note, false);
                }
                let mut out: Vec<Frame> = native[..cut].to_vec();
                push_levels(&lua, &mut out);
                let note = if top.snapshot {
                    COMPILED_SNAPSHOT
                } else {
                    COMPILED
                };
                (out, Some(note.into()), true)
            }
            // Not in Lua code as the VM tells (or it cannot tell: an older process, values
            // that do not check out): C code that Lua called has its state current.
            top => {
                let why = top.err();
                let runs_lua = || match &why {
                    Some(why) => format!("{RUNS_LUA}: {why}"),
                    None => RUNS_LUA.to_string(),
                };
                for f in &native {
                    let Some(a) = f.lookup_address() else {
                        continue;
                    };
                    if in_interp(a) {
                        // The interpreter's own frame: was it running Lua code (innermost),
                        // or did it call the C code above (the state is current then)?
                        if std::ptr::eq(f, &native[0]) {
                            return (native, Some(runs_lua()), false);
                        }
                        break;
                    }
                    if !s.knows_code(a) {
                        return (native, Some(runs_lua()), false);
                    }
                }
                let (frames, note) = self.frames(s, word, native);
                (frames, note, false)
            }
        }
    }
}

impl ForeignLayer for LuaLayer {
    fn open(&mut self, s: &mut Session) -> Result<(), String> {
        let Some((addr, size)) = s.section(".fibertrace.lua") else {
            return Err("the process publishes no Lua layout (its Lua host is not \
                        fibertrace's, or it is older)"
                .into());
        };
        let mut head = vec![0u8; (size as usize).clamp(24, 4096)];
        if !s.read(addr, &mut head) {
            return Err("its Lua layout could not be read".into());
        }
        self.reader = Some(Reader::open(s, &head)?);
        self.vm = Some(VmMap::from_files(&s.image_files()));
        Ok(())
    }

    fn frames(
        &mut self,
        s: &mut Session,
        word: u64,
        native: Vec<Frame>,
    ) -> (Vec<Frame>, Option<String>) {
        let (Some(reader), Some(vm)) = (self.reader.as_mut(), self.vm.as_ref()) else {
            return (native, Some("its Lua frames are not read".into()));
        };
        match reader.stack(s, word) {
            Ok(lua) => {
                let mut out: SmallVec<[Frame; 192]> = SmallVec::new();
                let gap = (lua.omitted > 0).then_some((lua.omitted_at, lua.omitted));
                super::merge_with_gap(&native, &lua.levels, gap, vm, false, &mut out);
                (out.into_vec(), None)
            }
            Err(why) => (
                native,
                Some(format!("its Lua frames could not be read: {why}")),
            ),
        }
    }

    /// A running fiber's Lua stack is current when its thread runs C code that Lua called
    /// (LuaJIT stores the state's frame base at every call out of Lua): then its levels are
    /// read and merged as a suspended fiber's. Inside LuaJIT's interpreter the base and PC
    /// are the thread's registers (`rdx`, `rbx` on x86-64): the levels are read from them,
    /// checked against the state's stack and the function's code first. In compiled code
    /// (the VM state holds a trace's number) they are the trace's snapshot's nearest before
    /// the thread's PC (or the return address into the trace of the call it made): the
    /// functions the trace inlined are levels, the line is the snapshot's; where no
    /// snapshot checks out, they are read from the base the trace was entered with (the
    /// innermost level is the function the trace runs in, at the trace's start, a function
    /// the trace inlined has no level, and the note says so); the trace's code has no unwind
    /// record, and the runtime's walk goes on below it from where the VM was entered
    /// ([`LuaLayer::below_unwound`]): those frames are merged in as the interpreter's, the
    /// levels taking the trace's own frame's place (where that entry cannot be read, the
    /// frames end at the trace's and the note says so). When
    /// neither can be read (a process that does not publish where its running code's state
    /// is, or values that do not check out): no Lua frames, and the note says why (the
    /// process's own dump, SIGQUIT, reads them at a safe point). The walk's note stays,
    /// except in compiled code whose walk did not go on below the trace: it stopped in the
    /// trace's code, which the trace's note says.
    fn running_frames(
        &mut self,
        s: &mut Session,
        word: u64,
        native: Vec<Frame>,
        thread: i32,
        walk_note: Option<String>,
    ) -> (Vec<Frame>, Option<String>) {
        let (frames, note, walk_explained) = self.running_frames_of(s, word, native, thread);
        let walk_note = if walk_explained { None } else { walk_note };
        (frames, join_notes(walk_note, note))
    }

    /// A fiber whose thread is not held (a non-blocking dump) is read only while it runs a
    /// compiled trace: the trace's entry base and the frames below it stay put while the
    /// trace runs, and they are read again after its levels to check it is still the same
    /// trace at the same base (three tries). In the interpreter, or in C code, its base and
    /// frames change as it runs: not read.
    /// In compiled code (the VM state is a trace's number, or the collector's step a trace
    /// called), the record of the call that entered the VM for the running state
    /// ([`Reader::vm_entry_record`]), when its return address is in the target's code.
    fn below_unwound(&mut self, s: &mut Session, word: u64) -> Option<(Registers, String)> {
        let reader = self.reader.as_mut()?;
        let top = reader.running_top(s, word, None, &[]).ok()??;
        if !top.compiled {
            return None;
        }
        let rec = reader.vm_entry_record(s, top.th).ok()??;
        let (fp, ra) = (s.read_u64(rec)?, s.read_u64(rec.wrapping_add(8))?);
        if !s.knows_code(ra) {
            return None;
        }
        let regs = Registers {
            ip: ra,
            sp: rec.wrapping_add(16),
            fp,
        };
        Some((regs, BELOW_TRACE.into()))
    }

    fn running_unheld(
        &mut self,
        s: &mut Session,
        word: u64,
    ) -> Option<(Vec<Frame>, Option<String>)> {
        let reader = self.reader.as_mut()?;
        for _ in 0..3 {
            let top = reader.running_top(s, word, None, &[]).ok()??;
            if !top.compiled {
                return None;
            }
            let Ok(lua) = reader.stack_running(s, word, Some(top)) else {
                continue;
            };
            if reader.running_top(s, word, None, &[]).ok()? != Some(top) {
                continue;
            }
            let mut out = Vec::new();
            push_levels(&lua, &mut out);
            return Some((out, Some(COMPILED_UNHELD.into())));
        }
        None
    }

    fn prefetch(&mut self, s: &mut Session, words: &[u64]) {
        if let Some(r) = self.reader.as_ref() {
            r.prefetch(s, words);
        }
    }

    fn resolve(&self, f: &Frame) -> Option<Resolved> {
        let Frame::Lua(id) = f else {
            return None;
        };
        let info = crate::frames::intern::describe(*id)?;
        Some(Resolved {
            symbols: vec![Symbol {
                name: Some(info.display_name().into_owned()),
                file: Some(info.source.to_string()),
                line: u32::try_from(info.current_line).ok(),
                ..Symbol::default()
            }],
            ..Resolved::default()
        })
    }
}
