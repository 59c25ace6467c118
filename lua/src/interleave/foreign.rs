//! The Lua host's frames in another process's dump: [`LuaLayer`] is the
//! [`ForeignLayer`] that `fibertrace dump PID` gives the fiber runtime's reader. For each
//! suspended Lua fiber it reads the fiber's Lua stack from the target's memory
//! ([`crate::frames::foreign`]) and merges it with the fiber's native frames as in-process
//! ([`super::merge_with_gap`]), over a VM map of the *target's* files
//! ([`VmMap::from_files`]).
//!
//! How a result can be wrong: as [`crate::frames::foreign`] and the merge (a C level whose
//! function no symbol table of the target names is not anchored: its Lua run moves down).

use fibertrace_core::remote::Session;
use fibertrace_core::symbolize::{Resolved, Symbol};
use fibertrace_core::Frame;
use fibertrace_fiber::inspect::foreign::ForeignLayer;
use smallvec::SmallVec;

use super::classify::VmMap;
use crate::frames::foreign::Reader;

/// Why a running fiber has no Lua frames from outside.
const RUNS_LUA: &str = "it runs Lua code (LuaJIT's interpreter or a compiled trace), whose \
                        frames are read inside the process only (SIGQUIT, --stall-ms)";

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
    /// read and merged as a suspended fiber's. Inside LuaJIT's interpreter, or in code outside
    /// every image (compiled traces, and an FFI call made from one), the base is in a
    /// register, not in the state: no Lua frames then, and the note says why (the process's
    /// own dump, SIGQUIT, reads them at a safe point).
    fn running_frames(
        &mut self,
        s: &mut Session,
        word: u64,
        native: Vec<Frame>,
    ) -> (Vec<Frame>, Option<String>) {
        let Some(vm) = self.vm.as_ref() else {
            return (native, Some("its Lua frames are not read".into()));
        };
        let interp = vm.interpreter;
        let in_interp = |a: u64| interp.is_some_and(|(s, e)| a >= s && a < e);
        for f in &native {
            let Some(a) = f.lookup_address() else {
                continue;
            };
            if in_interp(a) {
                // The interpreter's own frame: was it running Lua code (innermost), or did
                // it call the C code above (the state is current then)?
                if std::ptr::eq(f, &native[0]) {
                    return (native, Some(RUNS_LUA.into()));
                }
                break;
            }
            if !s.knows_code(a) {
                return (native, Some(RUNS_LUA.into()));
            }
        }
        self.frames(s, word, native)
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
