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
