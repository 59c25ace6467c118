//! Which native code is the Lua VM: address ranges built once from the ELF symbol tables.
//!
//! Every loaded image with a `.symtab` is scanned once (about 10 ms for a test binary in a
//! release build). A local symbol belongs to the C file the preceding `STT_FILE` entry names;
//! global symbols (which the linker lists after all locals) are judged by name. *VM core* is:
//! * LuaJIT: functions of `lj_*.c`, the assembler interpreter (`buildvm_*.dasc`, taken as one
//!   range from its lowest to its highest symbol so that unnamed labels are covered; a C
//!   file's functions never count, whatever their names: `lj_vmmath.c` defines `lj_vm_*`), and
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

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

/// The VM map: sorted, merged VM ranges, function extents, and the asm interpreter's range.
#[derive(Debug, Default)]
pub struct VmMap {
    /// Sorted, disjoint `[start, end)` ranges of VM-core code (process addresses).
    vm: Vec<(u64, u64)>,
    /// Function symbols `(start, end)` sorted by start (process addresses).
    funcs: Vec<(u64, u64)>,
    /// Tail-jump thunks `(start, target)` sorted by start (process addresses): functions
    /// that jump to another one without a frame of their own ([`super::thunk`]).
    thunks: Vec<(u64, u64)>,
    /// LuaJIT's assembler interpreter, `[start, end)`, if found.
    pub interpreter: Option<(u64, u64)>,
    /// LuaJIT's `lj_vm_ffi_call` (inside the interpreter but with a frame record of its own).
    pub ffi_call: Option<(u64, u64)>,
    /// Whether the map is of another process's images (then a function that no symbol table
    /// gives an end is not looked up in this process's symbolizer).
    pub foreign: bool,
    /// One byte per page from `pages_lo` to the page of the last VM range's end: whether
    /// the page holds no VM code ([`PAGE_NONE`]), only VM code ([`PAGE_ALL`]), or both
    /// ([`PAGE_MIXED`]: the ranges are searched). Empty when the ranges span more than
    /// [`MAX_PAGES`] pages (each lookup searches then). A frame's lookup was a binary search
    /// of thousands of ranges, most of an interleave's merge; it is now one load for nearly
    /// every frame.
    pages: Vec<u8>,
    /// Address of the first page of `pages`.
    pages_lo: u64,
    /// This map's number (unique in the process, 0 before [`VmMap::finish`]): what each
    /// thread's memos of [`VmMap::is_vm`] and [`VmMap::function_end`] are keyed by beside
    /// the address.
    id: u64,
}

/// Numbers of the maps finished so far.
static MAPS: AtomicU64 = AtomicU64::new(1);

/// The largest function that can be a tail-jump thunk, in bytes (three moves and a jump,
/// with room for padding in the symbol's size).
const MAX_THUNK: u64 = 32;

/// Slots of each thread's memo of [`VmMap::function_end`] (a power of two).
const END_MEMO: usize = 64;

/// Slots of each thread's memo of [`VmMap::is_vm`] for addresses on pages that hold VM code
/// and other code (a power of two).
const VM_MEMO: usize = 64;

thread_local! {
    /// `(map, address, VM?)` of the last searched lookups: the return addresses a Lua
    /// fiber's stack holds are few, the same in every fiber parked in the same code.
    static SEARCHED: Memo<bool, VM_MEMO> =
        const { [const { Cell::new((0, 0, false)) }; VM_MEMO] };
    /// `(map, start, end or 0)` of the last lookups: the C functions a Lua stack calls are a
    /// few, looked up for every fiber (a search of every function symbol, on cold lines).
    static ENDS: Memo<u64, END_MEMO> =
        const { [const { Cell::new((0, 0, 0)) }; END_MEMO] };
}

/// Page size of [`VmMap`]'s page table (any power of two works: only speed depends on it).
/// Small: VM functions and library functions alternate in LuaJIT's code, and a page holding
/// both is searched.
const PAGE_SHIFT: u32 = 8;
/// At most this many pages (bytes) in [`VmMap`]'s page table (a span of 256 MiB).
const MAX_PAGES: u64 = 1 << 20;
const PAGE_NONE: u8 = 0;
const PAGE_ALL: u8 = 1;
const PAGE_MIXED: u8 = 2;

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

/// A thread's memo of answers: `(map number, key, answer)` per slot.
type Memo<T, const N: usize> = [Cell<(u64, u64, T)>; N];

/// `f()`, the answer for `key` of map number `map`, from this thread's memo `memo` when it
/// holds it (one slot per key, the last key there wins), remembered there otherwise. A
/// thread being torn down computes it.
fn memoized<T: Copy, const N: usize>(
    memo: &'static std::thread::LocalKey<Memo<T, N>>,
    map: u64,
    key: u64,
    f: impl FnOnce() -> T,
) -> T {
    let slot = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize % N;
    let known = memo
        .try_with(|m| {
            let (id, k, v) = m[slot].get();
            (id == map && k == key).then_some(v)
        })
        .ok()
        .flatten();
    known.unwrap_or_else(|| {
        let v = f();
        let _ = memo.try_with(|m| m[slot].set((map, key, v)));
        v
    })
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
        // In a C file: its functions are never the interpreter, whatever their names
        // (`lj_vmmath.c` defines `lj_vm_foldarith`, `lj_vm_modi`...).
        let mut in_c_file = false;
        let mut interp: Option<(u64, u64)> = None;
        for sym in obj.symbols() {
            if sym.kind() == SymbolKind::File {
                let name = sym.name().unwrap_or("");
                file_vm = file_is_vm(name);
                in_interp = is_interpreter_file(base_name(name));
                in_c_file = base_name(name).ends_with(".c");
                continue;
            }
            if sym.is_global() {
                // Globals follow every local: they belong to no STT_FILE.
                file_vm = false;
                in_interp = false;
                in_c_file = false;
            }
            if sym.kind() != SymbolKind::Text || sym.is_undefined() {
                continue;
            }
            let name = sym.name().unwrap_or("");
            let start = sym.address().wrapping_add(bias);
            let end = start.wrapping_add(sym.size().max(1));
            // (By name only where the file is not known to be C: the interpreter's range is
            // the envelope of these symbols, and one C function among them made it cover the
            // C code linked in between — `lj_meta_arith`, taken for the interpreter, had its
            // frame record skipped and a bogus frame read in its place.)
            let is_interp_sym = in_interp
                || (!in_c_file
                    && (name.starts_with("lj_BC_")
                        || name.starts_with("lj_vm_")
                        || name.starts_with("lj_ff_")
                        || name.starts_with("lj_cont_")));
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
            if sym.size() <= MAX_THUNK {
                let code = sym
                    .section_index()
                    .and_then(|i| obj.section_by_index(i).ok())
                    .and_then(|sec| sec.data_range(sym.address(), sym.size()).ok().flatten());
                if let Some(to) = code.and_then(|c| super::thunk::tail_jump(obj.architecture(), c))
                {
                    self.thunks.push((start, start.wrapping_add_signed(to)));
                }
            }
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
        self.thunks.sort_unstable();
        self.thunks.dedup();
        self.vm.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.vm.len());
        for &(s, e) in &self.vm {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.vm = merged;
        self.build_pages();
        self.id = MAPS.fetch_add(1, Ordering::Relaxed);
    }

    /// Builds the page table of [`VmMap::is_vm`] from the sorted, disjoint ranges.
    fn build_pages(&mut self) {
        self.pages = Vec::new();
        self.pages_lo = 0;
        let ranges: Vec<(u64, u64)> = self.vm.iter().copied().filter(|&(s, e)| s < e).collect();
        let (Some(&(first, _)), Some(&(_, last_end))) = (ranges.first(), ranges.last()) else {
            return;
        };
        let lo = first >> PAGE_SHIFT;
        let hi = (last_end - 1) >> PAGE_SHIFT;
        if hi - lo >= MAX_PAGES {
            return;
        }
        let mut pages = vec![PAGE_NONE; (hi - lo + 1) as usize];
        for (s, e) in ranges {
            for p in (s >> PAGE_SHIFT)..=((e - 1) >> PAGE_SHIFT) {
                let first = p << PAGE_SHIFT;
                let last = first | ((1 << PAGE_SHIFT) - 1);
                // Merged ranges neither overlap nor touch: a page all VM is one range's.
                pages[(p - lo) as usize] = if s <= first && e > last {
                    PAGE_ALL
                } else {
                    PAGE_MIXED
                };
            }
        }
        self.pages = pages;
        self.pages_lo = lo << PAGE_SHIFT;
    }

    /// Whether the lookup address `a` (`pc`, or `ra - 1`) is VM code.
    #[inline]
    pub fn is_vm(&self, a: u64) -> bool {
        if !self.pages.is_empty() {
            let page = a.wrapping_sub(self.pages_lo) >> PAGE_SHIFT;
            match self.pages.get(page as usize) {
                // Below or past every range.
                None => return false,
                Some(&PAGE_NONE) => return false,
                Some(&PAGE_ALL) => return true,
                Some(_) => {}
            }
        }
        memoized(&SEARCHED, self.id, a, || self.search_vm(a))
    }

    /// [`VmMap::is_vm`] by a binary search of the ranges.
    fn search_vm(&self, a: u64) -> bool {
        let i = self.vm.partition_point(|&(s, _)| s <= a);
        i > 0 && a < self.vm[i - 1].1
    }

    /// The end of the function symbol starting exactly at `start`, if there is one.
    #[inline]
    pub fn function_end(&self, start: u64) -> Option<u64> {
        let end = memoized(&ENDS, self.id, start, || {
            self.search_end(start).unwrap_or(0)
        });
        (end != 0).then_some(end)
    }

    /// The extent `[start, end)` of the function that the function at `start` tail-jumps
    /// to, when it is a thunk ([`super::thunk`]) whose target a symbol table gives.
    pub fn tail_target(&self, start: u64) -> Option<(u64, u64)> {
        if self.thunks.is_empty() {
            return None;
        }
        let i = self.thunks.partition_point(|&(s, _)| s < start);
        let &(s, to) = self.thunks.get(i)?;
        if s != start {
            return None;
        }
        self.function_end(to).map(|e| (to, e))
    }

    /// [`VmMap::function_end`] by a binary search of the functions.
    fn search_end(&self, start: u64) -> Option<u64> {
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

    /// The memo of `function_end` answers as the search, again and again, for each map
    /// apart: two maps with functions at the same addresses but other ends (another
    /// process's images, a map built again) never get each other's answers.
    #[test]
    fn function_ends_are_remembered_per_map() {
        let a = VmMap::from_ranges(&[], &[(0x1000, 0x1100), (0x2000, 0x2400)]);
        let b = VmMap::from_ranges(&[], &[(0x1000, 0x1800)]);
        for _ in 0..3 {
            assert_eq!(a.function_end(0x1000), Some(0x1100));
            assert_eq!(b.function_end(0x1000), Some(0x1800));
            assert_eq!(a.function_end(0x2000), Some(0x2400));
            assert_eq!(b.function_end(0x2000), None);
            assert_eq!(a.function_end(0x1001), None);
        }
        // Many starts sharing slots: each still right.
        let funcs: Vec<(u64, u64)> = (1..500u64).map(|i| (i << 12, (i << 12) + i)).collect();
        let c = VmMap::from_ranges(&[], &funcs);
        for _ in 0..2 {
            for i in 1..500u64 {
                assert_eq!(c.function_end(i << 12), Some((i << 12) + i));
                assert_eq!(c.function_end((i << 12) + 1), None);
            }
        }
    }

    /// The page table answers as the binary search does, for addresses at and around every
    /// range's and page's edges and at random, with ranges within a page, across pages,
    /// touching (merged) and at the ends of the address space.
    #[test]
    fn the_page_table_answers_as_the_search() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut cases: Vec<Vec<(u64, u64)>> = vec![
            vec![],
            vec![(0x1000, 0x2000)],
            vec![(0x1000, 0x1001), (0x1fff, 0x3001)],
            vec![(0x10, 0x20), (0x20, 0x30), (0x5000, 0x9000)],
            vec![(u64::MAX - 0x1800, u64::MAX)],
            vec![(0, 0x10), (u64::MAX - 0x10, u64::MAX)],
        ];
        for _ in 0..200 {
            let base = rnd() % (1 << 40);
            let n = (rnd() % 20) as usize;
            let mut v = Vec::new();
            let mut at = base;
            for _ in 0..n {
                at += rnd() % 0x3000;
                let len = 1 + rnd() % 0x2800;
                v.push((at, at + len));
                at += len;
            }
            cases.push(v);
        }
        for ranges in cases {
            let m = VmMap::from_ranges(&ranges, &[]);
            let mut probes: Vec<u64> = Vec::new();
            for &(s, e) in &ranges {
                let pm = (1u64 << PAGE_SHIFT) - 1;
                for x in [s, e, s & !pm, (e - 1) | pm] {
                    for d in [0u64, 1, 2, pm + 1] {
                        probes.push(x.wrapping_add(d));
                        probes.push(x.wrapping_sub(d));
                    }
                }
            }
            probes.extend((0..200).map(|_| {
                let r = rnd();
                ranges
                    .first()
                    .map_or(r, |f| f.0.wrapping_add(r % 0x40000).wrapping_sub(0x1000))
            }));
            probes.extend([0, 1, u64::MAX, u64::MAX - 1]);
            for a in probes {
                // Twice: the second answer may come from the memo.
                assert_eq!(m.is_vm(a), m.search_vm(a), "{a:#x} in {ranges:x?}");
                assert_eq!(m.is_vm(a), m.search_vm(a), "{a:#x} in {ranges:x?} (again)");
            }
            // Another map at the same addresses with other ranges: never the first's memo.
            let other: Vec<(u64, u64)> = ranges
                .iter()
                .map(|&(s, e)| (s, s + (e - s) / 2 + 1))
                .collect();
            let o = VmMap::from_ranges(&other, &[]);
            for &(s, e) in &ranges {
                for a in [s, e - 1, s + (e - s) / 2 + 1] {
                    assert_eq!(m.is_vm(a), m.search_vm(a));
                    assert_eq!(o.is_vm(a), o.search_vm(a), "{a:#x} in {other:x?}");
                }
            }
            if !ranges.is_empty() && ranges.last().unwrap().1 - ranges[0].0 < 1 << 28 {
                assert!(!m.pages.is_empty(), "a page table for {ranges:x?}");
            }
        }
        // Ranges too far apart for a table: the search alone, with the same answers.
        let far = VmMap::from_ranges(&[(0x1000, 0x2000), (1 << 50, (1 << 50) + 8)], &[]);
        assert!(far.pages.is_empty());
        assert!(far.is_vm(0x1000) && far.is_vm(1 << 50) && !far.is_vm(0x2000));
    }

    #[test]
    fn the_linked_vm_is_found() {
        let m = vm_map();
        assert!(m.vm_ranges() > 0, "{m:?}");
        // The linked VM is in this binary: its lookups take the page table.
        assert!(!m.pages.is_empty(), "{} pages", m.pages.len());
        let gettop = crate::ffi::lua_gettop as *const () as u64;
        assert!(m.is_vm(gettop));
        let traceback = crate::ffi::luaL_traceback as *const () as u64;
        assert!(!m.is_vm(traceback));
        if cfg!(feature = "luajit") {
            assert!(m.interpreter.is_some());
        }
    }
}
