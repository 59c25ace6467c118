//! One ELF file's symbols: DWARF (function names, inline frames, file:line) through
//! addr2line's loader, and its symbol table (or dynamic symbols) where there is no DWARF.
//!
//! Addresses given to [`ElfSymbols::lookup`] are the file's own virtual addresses (SVMA): an
//! address in the process minus the image's load bias. The file is opened and indexed once;
//! lookups never reopen it.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One function level at an address: the function itself, or one it inlined.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symbol {
    /// Demangled function name.
    pub name: Option<String>,
    /// Source file.
    pub file: Option<String>,
    /// Source line.
    pub line: Option<u32>,
    /// Source column.
    pub column: Option<u32>,
    /// Whether this level was inlined into the next one in the list.
    pub inlined: bool,
}

/// Whether a function name has a path (`a::b`), not counting paths inside its generic
/// arguments (`call_user<app::{closure_env#0}, u32>` has none).
fn has_path(name: &str) -> bool {
    let mut depth = 0i32;
    let b = name.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'<' => depth += 1,
            b'>' => depth -= 1,
            b':' if depth == 0 && b.get(i + 1) == Some(&b':') => return true,
            _ => {}
        }
    }
    false
}

/// Errors opening a file for symbolization.
#[derive(Debug)]
pub struct OpenError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub reason: String,
    /// Whether it may go right later: the process was out of file descriptors or memory
    /// for the moment (`EMFILE`, `ENFILE`, `ENOMEM`, `EAGAIN`, `EINTR`).
    pub transient: bool,
    /// The system's error number, when a system call failed.
    errno: Option<i32>,
}

impl OpenError {
    /// Whether the process (or the system) was out of file descriptors.
    pub fn out_of_descriptors(&self) -> bool {
        matches!(self.errno, Some(libc::EMFILE | libc::ENFILE))
    }
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot read symbols of {}: {}", self.path, self.reason)
    }
}

impl std::error::Error for OpenError {}

/// The symbols of one ELF file, loaded once.
pub struct ElfSymbols {
    path: String,
    build_id: Option<Vec<u8>>,
    /// File address ranges of executable segments: lookups outside them find nothing
    /// (DWARF ranges of code removed at link time start at 0 and would otherwise match).
    code: Vec<(u64, u64)>,
    loader: addr2line::Loader,
    /// The detached debug file of a stripped file (its DWARF, its full symbol table).
    debug: Option<addr2line::Loader>,
}

impl std::fmt::Debug for ElfSymbols {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElfSymbols")
            .field("path", &self.path)
            .field("build_id", &self.build_id.as_deref().map(crate::image::hex))
            .finish()
    }
}

/// What one lookup finds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Function levels, innermost (most inlined) first; empty when nothing is known.
    pub symbols: Vec<Symbol>,
    /// Start address (SVMA) of the symbol-table function containing the address.
    pub function_start: Option<u64>,
}

impl ElfSymbols {
    /// Opens and indexes an ELF file (executable, shared library, or separate debug file).
    pub fn open(path: impl AsRef<Path>) -> Result<ElfSymbols, OpenError> {
        let path = path.as_ref();
        let err = |reason: String| OpenError {
            path: path.display().to_string(),
            reason,
            transient: false,
            errno: None,
        };
        let io_err = |e: &std::io::Error| OpenError {
            transient: matches!(
                e.raw_os_error(),
                Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EINTR)
            ),
            errno: e.raw_os_error(),
            ..err(e.to_string())
        };
        // (Before opening it: opening a FIFO waits for a writer.)
        let meta = std::fs::metadata(path).map_err(|e| io_err(&e))?;
        if !meta.is_file() {
            return Err(err(
                "not a regular file (an ELF executable, library or debug file is needed)".into(),
            ));
        }
        if meta.len() == 0 {
            return Err(err("an empty file, not an ELF file".into()));
        }
        let file = std::fs::File::open(path).map_err(|e| io_err(&e))?;
        // If another process truncates the file while it is mapped, reading it faults — the
        // same hazard every ELF reader that maps files accepts.
        // SAFETY: a read-only private mapping of a file, dropped before this function returns.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(&e))?;
        // (Its descriptor is not needed past the mapping: the loader below opens the file
        // again, with one descriptor free.)
        drop(file);
        let build_id = read_build_id(&map).map_err(err)?;
        let code = code_ranges(&map);
        let stripped = is_stripped(&map);
        drop(map);
        // A file stripped of its symbol table (a distribution's libc) reads its names from
        // the detached debug file of the same build, when installed (`libc6-dbg`).
        let detached = build_id
            .as_deref()
            .filter(|_| stripped)
            .and_then(detached_debug_file);
        // (Its error is the opening's when that failed: out of descriptors, it is transient.)
        let loader = addr2line::Loader::new(path).map_err(|e| match e.downcast_ref() {
            Some(io) => io_err(io),
            None => err(e.to_string()),
        })?;
        let debug = detached.and_then(|d| addr2line::Loader::new(d).ok());
        Ok(ElfSymbols {
            path: path.display().to_string(),
            build_id,
            code,
            loader,
            debug,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file's GNU build id.
    pub fn build_id(&self) -> Option<&[u8]> {
        self.build_id.as_deref()
    }

    /// Looks up a file address (SVMA).
    pub fn lookup(&self, svma: u64) -> Lookup {
        let mut out = Lookup::default();
        if !self.code.is_empty() && !self.code.iter().any(|&(s, e)| svma >= s && svma < e) {
            return out;
        }
        // Lines and inline levels from the detached debug file when there is one.
        let dwarf = self.debug.as_ref().unwrap_or(&self.loader);
        if let Ok(mut frames) = dwarf.find_frames(svma) {
            while let Ok(Some(f)) = frames.next() {
                let name = f
                    .function
                    .as_ref()
                    .and_then(|n| n.demangle().ok())
                    .map(|n| n.into_owned());
                let (file, line, column) = match f.location {
                    Some(l) => (l.file.map(str::to_string), l.line, l.column),
                    None => (None, None, None),
                };
                out.symbols.push(Symbol {
                    name,
                    file,
                    line,
                    column,
                    inlined: true,
                });
            }
        }
        if let Some(last) = out.symbols.last_mut() {
            last.inlined = false;
        }
        // The file's own (exported) name first — `qsort`, not the debug file's internal
        // alias `__GI_qsort` — then the debug file's symbol table for internal functions.
        let exported = self.loader.find_symbol_info(svma);
        let from_debug = exported.is_none();
        let sym = exported.or_else(|| self.debug.as_ref()?.find_symbol_info(svma));
        if let Some(sym) = sym {
            out.function_start = Some(sym.address());
            let demangled = addr2line::demangle_auto(sym.name().into(), None).into_owned();
            match out.symbols.last_mut() {
                // A stripped file's export names its function as its users call it.
                Some(outer) if self.debug.is_some() && !from_debug => outer.name = Some(demangled),
                // Debug info with line tables only names functions without their path
                // (`main`, `recv_until<u32>`); the symbol table has the whole name of the
                // outermost one.
                Some(outer)
                    if outer
                        .name
                        .as_deref()
                        .is_some_and(|n| !has_path(n) && has_path(&demangled)) =>
                {
                    outer.name = Some(demangled)
                }
                Some(outer) if outer.name.is_some() => {}
                Some(outer) => outer.name = Some(demangled),
                None => out.symbols.push(Symbol {
                    name: Some(demangled),
                    ..Symbol::default()
                }),
            }
        }
        out
    }
}

/// Whether an object file has neither a symbol table nor DWARF (only dynamic symbols).
fn is_stripped(data: &[u8]) -> bool {
    use object::Object;
    let Ok(file) = object::File::parse(data) else {
        return false;
    };
    file.section_by_name(".symtab").is_none() && file.section_by_name(".debug_info").is_none()
}

/// Where the detached debug file of build `id` is installed, if it is: the debuggers'
/// convention, `/usr/lib/debug/.build-id/ab/cdef….debug`.
fn detached_debug_file(id: &[u8]) -> Option<std::path::PathBuf> {
    let (first, rest) = id.split_first()?;
    let p = std::path::PathBuf::from(format!(
        "/usr/lib/debug/.build-id/{first:02x}/{}.debug",
        crate::image::hex(rest)
    ));
    p.is_file().then_some(p)
}

/// Executable segment ranges (file virtual addresses) of an object file; empty if it has no
/// segments (a separate debug file), in which case lookups are not filtered.
fn code_ranges(data: &[u8]) -> Vec<(u64, u64)> {
    use object::{Object, ObjectSegment, SegmentFlags};
    let Ok(file) = object::File::parse(data) else {
        return Vec::new();
    };
    file.segments()
        .filter(|s| match s.flags() {
            SegmentFlags::Elf { p_flags, .. } => p_flags.contains(object::elf::PF_X),
            _ => true,
        })
        .map(|s| (s.address(), s.address() + s.size()))
        .filter(|(s, e)| s < e)
        .collect()
}

/// Reads the GNU build id from an ELF file's bytes.
pub(crate) fn read_build_id(data: &[u8]) -> Result<Option<Vec<u8>>, String> {
    use object::{Object, ObjectSection};
    let file = object::File::parse(data).map_err(|e| format!("not an object file: {e}"))?;
    if let Ok(Some(id)) = file.build_id() {
        return Ok(Some(id.to_vec()));
    }
    // Fall back to scanning note sections ourselves.
    for s in file.sections() {
        if s.name().is_ok_and(|n| n.starts_with(".note")) {
            if let Ok(d) = s.data() {
                if let Some(id) = crate::image::parse_build_id_notes(d) {
                    return Ok(Some(id));
                }
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::has_path;

    #[test]
    fn a_path_inside_generic_arguments_is_not_the_names_path() {
        assert!(has_path("fibertrace_fiber::sched::call_user"));
        assert!(has_path(
            "<&dyn core::ops::Fn<()> as core::ops::FnOnce<()>>::call_once"
        ));
        assert!(!has_path("call_user<app::{closure_env#0}, u32>"));
        assert!(!has_path("main"));
        assert!(!has_path("{closure#0}<()>"));
    }
}
