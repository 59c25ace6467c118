//! One ELF file's symbols: its symbol table (or dynamic symbols), read when it is opened, and
//! its DWARF (function names, inline frames, file:line) through addr2line's loader, loaded at
//! the first lookup that needs it.
//!
//! Addresses given to [`ElfSymbols::lookup`] are the file's own virtual addresses (SVMA): an
//! address in the process minus the image's load bias. The file is opened and indexed once;
//! lookups never reopen it, except the first one that needs DWARF (the loader maps the file
//! itself).
//!
//! Two tiers: [`ElfSymbols::lookup`] gives every function level with its file and line (it
//! loads the DWARF: for a large program tens of milliseconds and tens of megabytes, once);
//! [`ElfSymbols::lookup_outer`] gives the symbol table's function and its start alone (a
//! binary search in a table read at open). The outermost name the two give is the same
//! symbol's, except where the DWARF names a function the symbol table names otherwise (two
//! identical functions folded into one symbol; a compiler's clone, `foo.isra.0` or
//! `foo.cold`, which the DWARF calls `foo`): how a name-only result can differ.
//!
//! The DWARF is read from the file opened, checked by its identity (device, inode, size,
//! modification time) before and after the load: a file replaced on disk since it was
//! opened (a deploy, a package upgrade) is named from the table read at open, never from the
//! other build's DWARF; one with the same build id (a reinstall of the same build) is read.
//! (A replacement between the check and the loader's open, within microseconds, and undone
//! before the second check, would go unseen.)
//!
//! A crafted file cannot make the table large: names that sum past the file's size (many
//! symbols naming one long string) share one copy of the bytes they point into.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

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
    /// The file's own symbol table (its dynamic symbols when it has none), until the DWARF
    /// is loaded: addr2line's loader reads the same table (`object`'s symbol map), which
    /// then answers instead, and this one is let go (at a memory limit, the two together
    /// were the room the first lookups needed).
    table: Mutex<SymbolTable>,
    /// The detached debug file of a stripped file (its DWARF, its full symbol table).
    detached: Option<PathBuf>,
    /// The file as it was opened (device, inode, size, modification time): the DWARF is
    /// loaded later, by path, and only from that same file (a binary replaced on disk since
    /// would give another build's names and lines).
    identity: FileIdentity,
    /// The DWARF, once loaded (or found unreadable).
    dwarf: OnceLock<Dwarf>,
    /// Held while the DWARF loads (callers that share an `ElfSymbols` between threads load
    /// it once).
    loading: Mutex<()>,
}

/// What tells one file from another at the same path: a file replaced by a rename has
/// another inode; one rewritten in place, another size or modification time.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct FileIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
}

impl FileIdentity {
    fn of(m: &std::fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }

    /// The identity of the file at `path` now.
    fn at(path: &str) -> std::io::Result<FileIdentity> {
        std::fs::metadata(path).map(|m| FileIdentity::of(&m))
    }

    /// Whether `self`, from the path, is the file `opened` describes (from its
    /// descriptor): the same size and modification time. (Not the device and inode: on
    /// some overlay filesystems the descriptor's are the layer's, the path's the overlay's.)
    fn looks_like(&self, opened: &FileIdentity) -> bool {
        self.len == opened.len && self.mtime == opened.mtime
    }
}

/// How many files' DWARF the process loaded (see [`crate::symbolize::dwarf_loads`]).
pub(crate) static DWARF_LOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The loaders of a file's DWARF.
struct Dwarf {
    /// The file's own; `None` when it could not be read, or the file at the path is no
    /// longer the one opened (names from the symbol table only).
    loader: Option<addr2line::Loader>,
    /// The detached debug file's, when there is one and it could be read.
    debug: Option<addr2line::Loader>,
    /// Why the file's own could not be read.
    error: Option<String>,
}

/// A file's function and data symbols by address, as `object`'s symbol map chooses them (one
/// per address: a known kind first, then the widest visibility), their names copied into one
/// buffer: the file is not kept mapped for them.
#[derive(Default)]
struct SymbolTable {
    /// (address, size, start of the name in `names`, its length), by address.
    syms: Box<[(u64, u64, u32, u32)]>,
    names: Box<str>,
}

impl SymbolTable {
    /// The symbol map of the object file in `data` (empty when it has none).
    fn read(data: &[u8]) -> SymbolTable {
        use object::Object;
        let Ok(file) = object::File::parse(data) else {
            return SymbolTable::default();
        };
        let map = file.symbol_map();
        SymbolTable::of(
            map.symbols()
                .iter()
                .map(|s| (s.address(), s.size(), s.name())),
            data.len(),
        )
    }

    /// The table of `syms` (address, size, name; by address), whose names lie in a file of
    /// `file_len` bytes. Each name is copied as it is while they sum to no more than the
    /// file; past that (many symbols naming one long string: only a crafted file's do), each
    /// byte of the strings they point into is copied once and the names share them, so that
    /// what is kept never passes the file's size. Empty when the names pass 4 GiB.
    fn of<'a>(
        syms: impl ExactSizeIterator<Item = (u64, u64, &'a str)> + Clone,
        file_len: usize,
    ) -> SymbolTable {
        let total = syms
            .clone()
            .try_fold(0usize, |t, (_, _, n)| t.checked_add(n.len()));
        if total.is_some_and(|t| t <= file_len) {
            let mut names = String::with_capacity(total.unwrap_or(0));
            let mut out = Vec::with_capacity(syms.len());
            for (at, size, name) in syms {
                let (Ok(off), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len()))
                else {
                    return SymbolTable::default();
                };
                names.push_str(name);
                out.push((at, size, off, len));
            }
            return SymbolTable {
                syms: out.into(),
                names: names.into(),
            };
        }
        // The names by where they start, their spans merged where they meet: (start, end,
        // where the span starts in `bytes`).
        let mut strs: Vec<&str> = syms.clone().map(|(_, _, n)| n).collect();
        strs.sort_unstable_by_key(|n| (n.as_ptr() as usize, n.len()));
        let mut merged: Vec<(usize, usize, usize)> = Vec::new();
        let mut bytes: Vec<u8> = Vec::new();
        for n in strs {
            let (a, b) = (n.as_ptr() as usize, n.as_ptr() as usize + n.len());
            match merged.last_mut() {
                Some(last) if a <= last.1 => {
                    if b > last.1 {
                        bytes.extend_from_slice(&n.as_bytes()[last.1 - a..]);
                        last.1 = b;
                    }
                }
                _ => {
                    merged.push((a, b, bytes.len()));
                    bytes.extend_from_slice(n.as_bytes());
                }
            }
        }
        // (Spans of valid UTF-8 that overlap join into valid UTF-8: where a character starts
        // is told by its bytes alone.)
        let Ok(names) = String::from_utf8(bytes) else {
            return SymbolTable::default();
        };
        let mut out = Vec::with_capacity(syms.len());
        for (at, size, name) in syms {
            let p = name.as_ptr() as usize;
            let Some(i) = merged.partition_point(|m| m.0 <= p).checked_sub(1) else {
                return SymbolTable::default();
            };
            let off = merged[i].2 + (p - merged[i].0);
            let (Ok(off), Ok(len)) = (u32::try_from(off), u32::try_from(name.len())) else {
                return SymbolTable::default();
            };
            out.push((at, size, off, len));
        }
        SymbolTable {
            syms: out.into(),
            names: names.into(),
        }
    }

    /// The symbol containing `svma` (its address and name), as `object`'s
    /// `SymbolMap::containing` finds it: the last at or below it, if its size reaches it (or
    /// it has none).
    fn containing(&self, svma: u64) -> Option<(u64, &str)> {
        let i = self.syms.partition_point(|s| s.0 <= svma).checked_sub(1)?;
        let (at, size, off, len) = self.syms[i];
        if size != 0 && svma.wrapping_sub(at) >= size {
            return None;
        }
        let name = self
            .names
            .get(off as usize..(off as usize + len as usize))?;
        Some((at, name))
    }
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
    /// The DWARF could not be loaded for the moment (out of descriptors or memory): only the
    /// symbol table's name; a later lookup may give more.
    pub partial: bool,
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
            transient: is_transient(e),
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
        let opened = FileIdentity::of(&file.metadata().map_err(|e| io_err(&e))?);
        // Later checks stat the path: the identity they compare with is taken so, once it is
        // seen to be the file opened (else the file was replaced since, and the descriptor's
        // identity never matches: the DWARF is not read).
        let identity = FileIdentity::at(&path.display().to_string())
            .ok()
            .filter(|now| now.looks_like(&opened))
            .unwrap_or(opened);
        // If another process truncates the file while it is mapped, reading it faults — the
        // same hazard every ELF reader that maps files accepts.
        // SAFETY: a read-only private mapping of a file, dropped before this function returns.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(&e))?;
        // (Its descriptor is not needed past the mapping: the DWARF's loader opens the file
        // again, with one descriptor free.)
        drop(file);
        let build_id = read_build_id(&map).map_err(err)?;
        let code = code_ranges(&map);
        let stripped = is_stripped(&map);
        let table = SymbolTable::read(&map);
        drop(map);
        // A file stripped of its symbol table (a distribution's libc) reads its names from
        // the detached debug file of the same build, when installed (`libc6-dbg`).
        let detached = build_id
            .as_deref()
            .filter(|_| stripped)
            .and_then(detached_debug_file);
        Ok(ElfSymbols {
            path: path.display().to_string(),
            build_id,
            code,
            table: Mutex::new(table),
            detached,
            identity,
            dwarf: OnceLock::new(),
            loading: Mutex::new(()),
        })
    }

    /// Loads the file's DWARF (and its detached debug file's) if it is not loaded yet.
    /// An error only when it may go right later (out of descriptors or memory for the
    /// moment: see [`OpenError::transient`]); the next call tries again. A file whose DWARF
    /// cannot be read is then named from its symbol table alone, without an error.
    pub fn load_dwarf(&self) -> Result<(), OpenError> {
        if self.dwarf.get().is_some() {
            return Ok(());
        }
        let _one = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        if self.dwarf.get().is_some() {
            return Ok(());
        }
        let transient = |io: &std::io::Error| OpenError {
            path: self.path.clone(),
            reason: io.to_string(),
            transient: true,
            errno: io.raw_os_error(),
        };
        // The loader opens the file by its path: only the file opened, or one of the same
        // build put in its place (a reinstall), is read (its identity the same before and
        // after the load; another file keeps the table's names).
        let expected = self.same_build_at_path().map_err(|io| transient(&io))?;
        let same = |e: FileIdentity| FileIdentity::at(&self.path).is_ok_and(|now| now == e);
        let (mut loader, mut error) = (None, None);
        if expected.is_some() {
            match addr2line::Loader::new(&self.path) {
                Ok(l) => loader = Some(l),
                Err(e) => match e.downcast_ref::<std::io::Error>() {
                    Some(io) if is_transient(io) => return Err(transient(io)),
                    _ => error = Some(e.to_string()),
                },
            }
        }
        if loader.is_some() && !expected.is_some_and(same) {
            loader = None;
        }
        if loader.is_none() && error.is_none() {
            let removed = FileIdentity::at(&self.path)
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound);
            error = Some(if removed {
                "the file was removed since it was opened".to_string()
            } else {
                "the file was replaced since it was opened".to_string()
            });
        }
        let debug = match self.detached.as_ref().map(addr2line::Loader::new) {
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => match e.downcast_ref::<std::io::Error>() {
                Some(io) if is_transient(io) => return Err(transient(io)),
                _ => None,
            },
            None => None,
        };
        if loader.is_some() || debug.is_some() {
            DWARF_LOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let _ = self.dwarf.set(Dwarf {
            loader,
            debug,
            error,
        });
        if self.dwarf.get().is_some_and(|d| d.loader.is_some()) {
            drop(std::mem::take(&mut *self.table()));
        }
        Ok(())
    }

    /// The identity of the file at the path when it holds the build opened: the file
    /// opened, or another with the same build id (a reinstall of the same build). `None` for
    /// another build, a file without a build id, or no file there; an error only when that
    /// may go right later (see [`is_transient`]).
    fn same_build_at_path(&self) -> std::io::Result<Option<FileIdentity>> {
        let kept = |e: std::io::Error| if is_transient(&e) { Err(e) } else { Ok(None) };
        let now = match FileIdentity::at(&self.path) {
            Ok(now) => now,
            Err(e) => return kept(e),
        };
        if now == self.identity {
            return Ok(Some(now));
        }
        let Some(id) = self.build_id.as_deref() else {
            return Ok(None);
        };
        let file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) => return kept(e),
        };
        let opened = match file.metadata() {
            Ok(m) => FileIdentity::of(&m),
            Err(e) => return kept(e),
        };
        if !now.looks_like(&opened) {
            return Ok(None);
        }
        // SAFETY: a read-only private mapping of a file, dropped before this returns (the
        // hazard of a truncation by another process as in `open`).
        let map = match unsafe { memmap2::Mmap::map(&file) } {
            Ok(m) => m,
            Err(e) => return kept(e),
        };
        Ok((read_build_id(&map).ok().flatten().as_deref() == Some(id)).then_some(now))
    }

    /// Why the file's DWARF could not be read, once [`ElfSymbols::load_dwarf`] tried (its
    /// lookups then name functions from the symbol table alone).
    pub fn dwarf_error(&self) -> Option<&str> {
        self.dwarf.get()?.error.as_deref()
    }

    /// Why lookups in the file give no file:line, once [`ElfSymbols::load_dwarf`] tried: its
    /// own DWARF could not be read (why), and there is no detached debug file's either.
    pub fn lines_unavailable(&self) -> Option<&str> {
        let d = self.dwarf.get()?;
        if d.debug.is_some() {
            return None;
        }
        d.error.as_deref()
    }

    /// The bytes of the files a DWARF load maps: the file's and its detached debug file's.
    pub fn dwarf_file_bytes(&self) -> u64 {
        let debug = self
            .detached
            .as_ref()
            .and_then(|d| std::fs::metadata(d).ok());
        self.identity
            .len
            .saturating_add(debug.map_or(0, |m| m.len()))
    }

    /// Whether the DWARF is loaded (or was found unreadable).
    pub fn dwarf_loaded(&self) -> bool {
        self.dwarf.get().is_some()
    }

    /// The file's path.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file's GNU build id.
    pub fn build_id(&self) -> Option<&[u8]> {
        self.build_id.as_deref()
    }

    /// Looks up a file address (SVMA): every function level, with files and lines. Loads the
    /// DWARF first if it is not loaded (see [`ElfSymbols::load_dwarf`]); when that fails for
    /// the moment, the symbol table's name alone, and [`Lookup::partial`] says so.
    pub fn lookup(&self, svma: u64) -> Lookup {
        let mut out = Lookup::default();
        if !self.in_code(svma) {
            return out;
        }
        out.partial = self.load_dwarf().is_err();
        let dwarf = self.dwarf.get();
        // Lines and inline levels from the detached debug file when there is one.
        let loader = dwarf.and_then(|d| d.debug.as_ref().or(d.loader.as_ref()));
        if let Some(Ok(mut frames)) = loader.map(|l| l.find_frames(svma)) {
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
        let debug = dwarf.and_then(|d| d.debug.as_ref());
        let exported = self.symbol(svma);
        let from_debug = exported.is_none();
        let sym = exported.or_else(|| {
            debug?
                .find_symbol_info(svma)
                .map(|s| (s.address(), addr2line::demangle_auto(s.name().into(), None)))
                .map(|(a, n)| (a, n.into_owned()))
        });
        if let Some((start, demangled)) = sym {
            out.function_start = Some(start);
            match out.symbols.last_mut() {
                // A stripped file's export names its function as its users call it.
                Some(outer) if debug.is_some() && !from_debug => outer.name = Some(demangled),
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

    /// Looks up a file address (SVMA) in the symbol table alone: its function's name (the
    /// outermost level, no file or line, no inlined levels) and start, without loading the
    /// DWARF. Only for a stripped file's internal function (no symbol in its table, a
    /// detached debug file installed) is the debug file loaded, whose table names it. Where
    /// a compiler made a clone of a function (`foo.isra.0`, `foo.cold`), this is the clone's
    /// symbol, where the DWARF names `foo`.
    pub fn lookup_outer(&self, svma: u64) -> Lookup {
        if !self.outer_falls_back(svma) {
            return self.lookup_table(svma);
        }
        let mut full = self.lookup(svma);
        // The outermost level alone, as the table would give it.
        if let Some(outer) = full.symbols.pop() {
            full.symbols = vec![Symbol {
                name: outer.name,
                ..Symbol::default()
            }];
        }
        full
    }

    /// Whether [`ElfSymbols::lookup_outer`] of `svma` is the full lookup's: a stripped
    /// file's function its own table does not have, which its detached debug file may name.
    pub(crate) fn outer_falls_back(&self, svma: u64) -> bool {
        self.detached.is_some() && self.in_code(svma) && self.symbol(svma).is_none()
    }

    /// [`ElfSymbols::lookup_outer`] without the fallback: nothing where the symbol table
    /// has no function (for a lookup whose DWARF cannot be loaded for the moment).
    pub fn lookup_table(&self, svma: u64) -> Lookup {
        match self.symbol(svma).filter(|_| self.in_code(svma)) {
            Some((start, name)) => Lookup {
                symbols: vec![Symbol {
                    name: Some(name),
                    ..Symbol::default()
                }],
                function_start: Some(start),
                partial: false,
            },
            None => Lookup::default(),
        }
    }

    /// The file's own symbol containing `svma`: its start and demangled name (from the
    /// table read at open, or from the loader's once the DWARF is loaded).
    fn symbol(&self, svma: u64) -> Option<(u64, String)> {
        let demangle = |n: &str| addr2line::demangle_auto(n.into(), None).into_owned();
        // (The table first: the loader is set before the table is let go, so a table found
        // empty has its loader to ask.)
        let table = self.table();
        match self.dwarf.get().and_then(|d| d.loader.as_ref()) {
            Some(l) => {
                drop(table);
                l.find_symbol_info(svma)
                    .map(|s| (s.address(), demangle(s.name())))
            }
            None => table.containing(svma).map(|(a, n)| (a, demangle(n))),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, SymbolTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `svma` lies in an executable segment (always, for a file without segments).
    fn in_code(&self, svma: u64) -> bool {
        self.code.is_empty() || self.code.iter().any(|&(s, e)| svma >= s && svma < e)
    }
}

/// Whether a failed system call may succeed later: the process (or the system) was out of
/// file descriptors or memory for the moment, or the call was interrupted.
fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EINTR)
    )
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
    use super::{has_path, SymbolTable};

    /// Many symbols naming one long string, as a crafted file can make them (each symbol's
    /// name an offset into the string table): the table keeps the string once, not once a
    /// symbol (100,000 symbols x 1 MB would be 100 GB), and every name is the one pointed
    /// at, overlapping ones too.
    #[test]
    fn names_that_sum_past_the_file_are_kept_once() {
        let long = "é".repeat(512 * 1024);
        let n = 100_000u64;
        let syms: Vec<(u64, u64, &str)> = (0..n)
            .map(|i| {
                // Every other name starts further in (on a character's start).
                let from = if i % 2 == 0 {
                    0
                } else {
                    2 * (i as usize % 1000)
                };
                (0x1000 + 16 * i, 16, &long[from..])
            })
            .collect();
        let t = SymbolTable::of(syms.iter().copied(), long.len() + 4096);
        assert_eq!(t.names.len(), long.len());
        assert_eq!(t.syms.len(), n as usize);
        for (i, &(at, _, name)) in syms.iter().enumerate().step_by(997) {
            assert_eq!(t.containing(at + 3), Some((at, name)), "symbol {i}");
        }
        // Two strings apart, and a name inside another: each kept once.
        let text = "alpha\0beta\0alphabet";
        let syms = [
            (0x10, 4, &text[0..5]),
            (0x20, 4, &text[6..10]),
            (0x30, 4, &text[11..19]),
            (0x40, 4, &text[16..19]),
            (0x50, 4, &text[11..19]),
        ];
        let t = SymbolTable::of(syms.iter().copied(), 10);
        assert_eq!(&*t.names, "alphabetaalphabet");
        for &(at, _, name) in &syms {
            assert_eq!(t.containing(at), Some((at, name)));
        }
        // Under the file's size, each name copied in the order of the symbols.
        let t = SymbolTable::of(syms.iter().copied(), 100);
        assert_eq!(&*t.names, "alphabetaalphabetbetalphabet");
        assert_eq!(t.containing(0x44), None);
        assert_eq!(t.containing(0x43), Some((0x40, "bet")));
    }

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
