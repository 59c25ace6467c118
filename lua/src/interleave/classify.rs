//! Which native code is the Lua VM: address ranges built once from the ELF symbol tables.
//!
//! Every loaded image with a `.symtab` is scanned once (about 10 ms for a test binary in a
//! release build). A local symbol belongs to the C file the preceding `STT_FILE` entry names;
//! global symbols (which the linker lists after all locals) are judged by name. *VM core* is:
//! * LuaJIT: functions of `lj_*.c`, the assembler interpreter (`buildvm_*.dasc`, taken as one
//!   range from its lowest to its highest symbol so that unnamed labels are covered), and
//!   global `lj_*` / `lua_*` / `luaJIT_*` functions — but not the library functions
//!   `lj_cf_*` / `lj_ffh_*` (from `lib_*.c`);
//! * Lua 5.4: functions of its core files (`lapi.c ldo.c lvm.c …`) and global `lua_*` and
//!   `luaV_*`-style internal functions — not `lauxlib.c`/`l*lib.c` (`luaL_*`, `luaopen_*`).
//!
//! The standard-library C functions are deliberately *not* VM: they are C levels of the Lua
//! stack and anchor the merge. The table also keeps every function symbol's extent, so that
//! "is this native frame inside the `lua_CFunction` at address `c`" is one binary search.
//!
//! How a result can be wrong: a binary stripped of `.symtab` (`strip = "symbols"`) yields no
//! VM ranges, so VM frames are shown as ordinary frames and Lua runs land after the anchor
//! frames only; a Lua built with link-time optimisation across files can fold VM code into a
//! library function (or the reverse), moving a Lua run by a frame or two.

use std::sync::OnceLock;

use object::{Object, ObjectSymbol, SymbolKind};

/// The VM map: sorted, merged VM ranges, function extents, and the asm interpreter's range.
#[derive(Debug, Default)]
pub struct VmMap {
    /// Sorted, disjoint `[start, end)` ranges of VM-core code (process addresses).
    vm: Vec<(u64, u64)>,
    /// Function symbols `(start, end)` sorted by start (process addresses).
    funcs: Vec<(u64, u64)>,
    /// LuaJIT's assembler interpreter, `[start, end)`, if found.
    pub interpreter: Option<(u64, u64)>,
    /// LuaJIT's `lj_vm_ffi_call` (inside the interpreter but with a frame record of its own).
    pub ffi_call: Option<(u64, u64)>,
    /// Whether the map is of another process's images (then a function that no symbol table
    /// gives an end is not looked up in this process's symbolizer).
    pub foreign: bool,
}

/// Lua 5.4 core (VM) source files.
const LUA54_CORE: &[&str] = &[
    "lapi.c",
    "ldo.c",
    "lvm.c",
    "ltm.c",
    "lgc.c",
    "lfunc.c",
    "ldebug.c",
    "lstate.c",
    "ltable.c",
    "lobject.c",
    "lstring.c",
    "lmem.c",
    "lzio.c",
    "lparser.c",
    "lcode.c",
    "llex.c",
    "lundump.c",
    "ldump.c",
    "lopcodes.c",
    "lctype.c",
];

/// Prefixes of Lua 5.4's internal global functions.
const LUA54_INTERNAL: &[&str] = &[
    "luaV_", "luaD_", "luaG_", "luaH_", "luaF_", "luaC_", "luaT_", "luaE_", "luaS_", "luaM_",
    "luaZ_", "luaO_", "luaK_", "luaX_", "luaY_", "luaU_", "luaP_", "luai_",
];

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Whether a local symbol from source file `file` is VM code.
fn file_is_vm(file: &str) -> bool {
    let f = base_name(file);
    (f.starts_with("lj_") && f.ends_with(".c")) || is_interpreter_file(f) || LUA54_CORE.contains(&f)
}

fn is_interpreter_file(f: &str) -> bool {
    f.starts_with("buildvm_") && f.ends_with(".dasc")
}

/// Whether a global symbol is VM code, by name.
fn name_is_vm(name: &str) -> bool {
    if name.starts_with("lj_cf_") || name.starts_with("lj_ffh_") {
        return false;
    }
    name.starts_with("lj_")
        || name.starts_with("lua_")
        || name.starts_with("luaJIT_")
        || LUA54_INTERNAL.iter().any(|p| name.starts_with(p))
}

impl VmMap {
    /// Builds the map from the symbol tables of every loaded image.
    pub fn build() -> VmMap {
        let mut map = VmMap::default();
        let table = fibertrace_core::image::table();
        for img in table.images() {
            if img.path.is_empty() || img.path.starts_with('[') || img.exec.is_empty() {
                continue;
            }
            map.add_file(&img.path, img.base);
        }
        map.finish();
        map
    }

    /// Builds the map of another process from its files and their load biases (see
    /// `fibertrace_core::remote::Session::image_files`).
    pub fn from_files(files: &[(std::path::PathBuf, u64)]) -> VmMap {
        let mut map = VmMap {
            foreign: true,
            ..VmMap::default()
        };
        for (path, bias) in files {
            if let Some(p) = path.to_str() {
                map.add_file(p, *bias);
            }
        }
        map.finish();
        map
    }

    fn add_file(&mut self, path: &str, bias: u64) {
        let Ok(file) = std::fs::File::open(path) else {
            return;
        };
        // SAFETY: a read-only private mapping of a file, dropped at the end of this function;
        // a file truncated meanwhile by another process would fault, the usual hazard of
        // ELF readers that map files.
        let Ok(data) = (unsafe { memmap2::Mmap::map(&file) }) else {
            return;
        };
        let Ok(obj) = object::File::parse(&*data) else {
            return;
        };
        let mut file_vm = false;
        let mut in_interp = false;
        let mut interp: Option<(u64, u64)> = None;
        for sym in obj.symbols() {
            if sym.kind() == SymbolKind::File {
                let name = sym.name().unwrap_or("");
                file_vm = file_is_vm(name);
                in_interp = is_interpreter_file(base_name(name));
                continue;
            }
            if sym.is_global() {
                // Globals follow every local: they belong to no STT_FILE.
                file_vm = false;
                in_interp = false;
            }
            if sym.kind() != SymbolKind::Text || sym.is_undefined() {
                continue;
            }
            let name = sym.name().unwrap_or("");
            let start = sym.address().wrapping_add(bias);
            let end = start.wrapping_add(sym.size().max(1));
            let is_interp_sym = in_interp
                || name.starts_with("lj_BC_")
                || name.starts_with("lj_vm_")
                || name.starts_with("lj_ff_")
                || name.starts_with("lj_cont_");
            if is_interp_sym {
                interp = Some(match interp {
                    Some((s, e)) => (s.min(start), e.max(end)),
                    None => (start, end),
                });
                if name == "lj_vm_ffi_call" {
                    self.ffi_call = Some((start, end));
                }
            }
            if sym.size() == 0 {
                continue;
            }
            self.funcs.push((start, end));
            let vm = if sym.is_global() {
                name_is_vm(name)
            } else {
                file_vm
            };
            if vm {
                self.vm.push((start, end));
            }
        }
        if let Some(r) = interp {
            self.vm.push(r);
            self.interpreter = Some(r);
        }
    }

    fn finish(&mut self) {
        self.funcs.sort_unstable();
        self.funcs.dedup();
        self.vm.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.vm.len());
        for &(s, e) in &self.vm {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.vm = merged;
    }

    /// Whether the lookup address `a` (`pc`, or `ra - 1`) is VM code.
    #[inline]
    pub fn is_vm(&self, a: u64) -> bool {
        let i = self.vm.partition_point(|&(s, _)| s <= a);
        i > 0 && a < self.vm[i - 1].1
    }

    /// The end of the function symbol starting exactly at `start`, if there is one.
    #[inline]
    pub fn function_end(&self, start: u64) -> Option<u64> {
        let i = self.funcs.partition_point(|&(s, _)| s < start);
        self.funcs
            .get(i)
            .filter(|&&(s, _)| s == start)
            .map(|&(_, e)| e)
    }

    /// Number of VM ranges (for diagnostics).
    pub fn vm_ranges(&self) -> usize {
        self.vm.len()
    }

    /// A map from explicit ranges (tests of the merge).
    pub fn from_ranges(vm: &[(u64, u64)], funcs: &[(u64, u64)]) -> VmMap {
        let mut m = VmMap {
            vm: vm.to_vec(),
            funcs: funcs.to_vec(),
            ..VmMap::default()
        };
        m.finish();
        m
    }
}

/// The process's VM map, built on first use; registers LuaJIT's frame-record hop with core's
/// unwinder the first time (see [`register_luajit_hop`]).
pub fn vm_map() -> &'static VmMap {
    static MAP: OnceLock<VmMap> = OnceLock::new();
    MAP.get_or_init(|| {
        // This library's own table: not tracked by the heap tracker.
        let m = fibertrace_core::heap::untracked(VmMap::build);
        register_luajit_hop(&m);
        m
    })
}

/// LuaJIT's C frame on x64 (GC64, external unwinding): the interpreter keeps `rsp` fixed
/// at its C frame and calls out from there, so above a callee's frame record lie 64 bytes
/// of that frame, then the record (saved `rbp`, return address) of the interpreter's caller.
pub const LUAJIT_CFRAME_HOP: u64 = 64;

/// Registers the CFRAME hop for LuaJIT's interpreter (minus `lj_vm_ffi_call`, which keeps a
/// frame record of its own) with core's frame-pointer walk. Does nothing for Lua 5.4.
pub fn register_luajit_hop(m: &VmMap) {
    if !cfg!(feature = "luajit") {
        return;
    }
    let Some((s, e)) = m.interpreter else {
        return;
    };
    let reg = |a: u64, b: u64| {
        if a < b {
            fibertrace_core::unwind::register_fp_hop(a, b, LUAJIT_CFRAME_HOP);
        }
    };
    match m.ffi_call {
        Some((fs, fe)) if fs >= s && fe <= e => {
            reg(s, fs);
            reg(fe, e);
        }
        _ => reg(s, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_files() {
        assert!(file_is_vm("lj_gc.c"));
        assert!(file_is_vm("/build/src/lvm.c"));
        assert!(file_is_vm("buildvm_x86.dasc"));
        assert!(!file_is_vm("lib_base.c"));
        assert!(!file_is_vm("lbaselib.c"));
        assert!(!file_is_vm("lauxlib.c"));
        assert!(name_is_vm("lua_pcall"));
        assert!(name_is_vm("luaV_execute"));
        assert!(name_is_vm("lj_vm_pcall"));
        assert!(!name_is_vm("lj_cf_print"));
        assert!(!name_is_vm("luaL_traceback"));
        assert!(!name_is_vm("luaopen_base"));
    }

    #[test]
    fn ranges_merge_and_lookup() {
        let m = VmMap::from_ranges(&[(10, 20), (15, 30), (40, 50)], &[(10, 20), (40, 50)]);
        assert_eq!(m.vm_ranges(), 2);
        assert!(!m.is_vm(9));
        assert!(m.is_vm(10) && m.is_vm(29));
        assert!(!m.is_vm(30));
        assert!(m.is_vm(45));
        assert_eq!(m.function_end(40), Some(50));
        assert_eq!(m.function_end(41), None);
    }

    #[test]
    fn the_linked_vm_is_found() {
        let m = vm_map();
        assert!(m.vm_ranges() > 0, "{m:?}");
        let gettop = crate::ffi::lua_gettop as *const () as u64;
        assert!(m.is_vm(gettop));
        let traceback = crate::ffi::luaL_traceback as *const () as u64;
        assert!(!m.is_vm(traceback));
        if cfg!(feature = "luajit") {
            assert!(m.interpreter.is_some());
        }
    }
}
