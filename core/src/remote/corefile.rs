//! A core file as a process to read: its threads' registers (`NT_PRSTATUS` notes), its map
//! (`NT_FILE`, with each mapping's permissions from the core's own segments), the vDSO's
//! address (`NT_AUXV`), and its memory — the bytes the core holds, and for file-backed
//! mappings it left out (the kernel's default dump filter skips unwritten file pages: code,
//! read-only data) the mapped files themselves.
//!
//! How a result can be wrong: a mapped file that changed since the core was written gives
//! wrong bytes for what the core left out (its build id is checked against the one in the
//! core's memory, as for a live process, when the core holds that page).

use std::io;
use std::path::{Path, PathBuf};

use object::read::elf::{FileHeader as _, ProgramHeader as _};
use object::Endianness;

use super::linux::Mapping;
use crate::arch::Registers;

/// One thread of a core file.
#[derive(Clone, Debug)]
pub(super) struct CoreThread {
    pub tid: i32,
    pub regs: Registers,
    /// Its general registers (see [`crate::arch::general_register`]).
    pub general: crate::arch::GeneralRegs,
}

/// A core file, read.
pub(super) struct Core {
    /// Its bytes (mapped).
    data: memmap2::Mmap,
    /// Its loaded segments: (vaddr, memsz, file offset, filesz).
    segments: Vec<(u64, u64, u64, u64)>,
    /// File-backed mappings, for what the segments do not hold: (start, end, file offset,
    /// file path as readable here).
    files: Vec<(u64, u64, u64, PathBuf)>,
    pub threads: Vec<CoreThread>,
    pub maps: Vec<Mapping>,
    /// The process name (`NT_PRPSINFO`'s `pr_fname`).
    pub name: String,
}

const NT_PRSTATUS: u32 = 1;
const NT_PRPSINFO: u32 = 3;
const NT_AUXV: u32 = 6;
const NT_FILE: u32 = 0x4649_4c45;
const AT_SYSINFO_EHDR: u64 = 33;

impl Core {
    /// Reads `path`; `exe` stands for the executable the core names (when the program is
    /// not where it was when the core was written); `root` is prefixed to every other file's
    /// path (a copy of the machine's files).
    pub(super) fn open(
        path: &Path,
        exe: Option<&Path>,
        root: Option<&Path>,
    ) -> Result<Core, String> {
        // (Mapping a directory or a device fails with ENODEV: said plainly. Looked at before
        // opening: opening a FIFO waits for a writer.)
        let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if m.is_dir() {
            return Err(format!("{}: is a directory", path.display()));
        }
        if !m.is_file() {
            return Err(format!(
                "{}: not a regular file (a core file is one)",
                path.display()
            ));
        }
        if m.len() == 0 {
            return Err(format!(
                "{}: an empty file, not a core file",
                path.display()
            ));
        }
        let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: a read-only private mapping of a file; if another process truncates it
        // while mapped, reading faults — the hazard every ELF reader that maps files accepts.
        let data =
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("{}: {e}", path.display()))?;
        let elf = object::elf::FileHeader64::<Endianness>::parse(&*data)
            .map_err(|_| format!("{}: not a 64-bit ELF file", path.display()))?;
        let endian = elf
            .endian()
            .map_err(|_| format!("{}: bad ELF header", path.display()))?;
        if elf.e_type(endian) != object::elf::ET_CORE {
            return Err(format!("{}: not a core file", path.display()));
        }
        if elf.e_machine(endian).0 != crate::arch::ELF_MACHINE.0 {
            return Err(format!(
                "{}: a core of another architecture (ELF machine {}); this fibertrace reads {}",
                path.display(),
                elf.e_machine(endian).0,
                crate::arch::ELF_MACHINE.1
            ));
        }
        let phdrs = elf
            .program_headers(endian, &*data)
            .map_err(|_| format!("{}: bad program headers", path.display()))?;
        let mut segments = Vec::new();
        let mut loads = Vec::new();
        let mut threads = Vec::new();
        let mut file_notes: Option<Vec<(u64, u64, u64, String)>> = None;
        let mut vdso = None;
        let mut name = String::new();
        for ph in phdrs {
            match ph.p_type(endian) {
                object::elf::PT_LOAD => {
                    let v = ph.p_vaddr(endian);
                    let m = ph.p_memsz(endian);
                    segments.push((v, m, ph.p_offset(endian), ph.p_filesz(endian)));
                    loads.push((
                        v,
                        v.saturating_add(m),
                        ph.p_flags(endian).contains(object::elf::PF_X),
                    ));
                }
                object::elf::PT_NOTE => {
                    let Ok(Some(mut notes)) = ph.notes(endian, &*data) else {
                        continue;
                    };
                    while let Ok(Some(n)) = notes.next() {
                        let desc = n.desc();
                        match n.n_type(endian).0 {
                            NT_PRSTATUS => {
                                if let (Some((tid, regs)), Some(general)) = (
                                    crate::arch::registers_from_prstatus(desc),
                                    crate::arch::general_from_prstatus(desc),
                                ) {
                                    threads.push(CoreThread { tid, regs, general });
                                }
                            }
                            NT_PRPSINFO => {
                                // pr_fname: 16 bytes at offset 40 (x86_64's elf_prpsinfo).
                                if let Some(b) = desc.get(40..56) {
                                    let end = b.iter().position(|&c| c == 0).unwrap_or(16);
                                    name = String::from_utf8_lossy(&b[..end]).into_owned();
                                }
                            }
                            NT_AUXV => {
                                for pair in desc.chunks_exact(16) {
                                    let k = u64::from_le_bytes(
                                        pair[..8].try_into().unwrap_or_default(),
                                    );
                                    let v = u64::from_le_bytes(
                                        pair[8..].try_into().unwrap_or_default(),
                                    );
                                    if k == AT_SYSINFO_EHDR {
                                        vdso = Some(v);
                                    }
                                }
                            }
                            NT_FILE => file_notes = parse_nt_file(desc),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if threads.is_empty() {
            // A core cut short (its writer stopped, a full disk) loses its notes with it.
            let claimed = phdrs
                .iter()
                .map(|ph| ph.p_offset(endian).saturating_add(ph.p_filesz(endian)))
                .max()
                .unwrap_or(0);
            let cut = if claimed > data.len() as u64 {
                format!(
                    "; the file is truncated: its segments reach byte {claimed}, it ends at {}",
                    data.len()
                )
            } else {
                String::new()
            };
            return Err(format!(
                "{}: the core holds no thread (no NT_PRSTATUS note){cut}",
                path.display()
            ));
        }
        let file_notes = file_notes.unwrap_or_default();
        let exe_path = file_notes.first().map(|f| f.3.clone());
        let mut maps = Vec::new();
        let mut files = Vec::new();
        for (start, end, ofs, p) in &file_notes {
            // The permissions are the core's segment's; a mapping the core left out whole
            // (read-only code, by gdb) counts as code: the image's bias is the same from any
            // of its mappings, and its unwind tables come from the file.
            let exec = loads
                .iter()
                .find(|&&(s, e, _)| *start >= s && *start < e)
                .is_none_or(|&(_, _, x)| x);
            maps.push(Mapping {
                start: *start,
                end: *end,
                exec,
                offset: *ofs,
                path: p.clone(),
            });
            let here = match (exe, &exe_path) {
                (Some(e), Some(first)) if p == first => e.to_path_buf(),
                _ => match root {
                    Some(r) => r.join(p.trim_start_matches('/')),
                    None => PathBuf::from(p),
                },
            };
            files.push((*start, *end, *ofs, here));
        }
        if let Some(v) = vdso {
            if let Some(&(s, e, _)) = loads.iter().find(|&&(s, e, _)| v >= s && v < e) {
                maps.push(Mapping {
                    start: s,
                    end: e,
                    exec: true,
                    offset: 0,
                    path: "[vdso]".into(),
                });
            }
        }
        Ok(Core {
            data,
            segments,
            files,
            threads,
            maps,
            name,
        })
    }

    /// Where a file of the core's map is readable here.
    pub(super) fn file_for(&self, mapped: &str) -> Option<PathBuf> {
        let i = self.maps.iter().position(|m| m.path == mapped)?;
        let m = &self.maps[i];
        self.files
            .iter()
            .find(|f| f.0 == m.start)
            .map(|f| f.3.clone())
    }

    /// Reads memory of the dumped process: from the core, else from the mapped file.
    pub(super) fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        for &(v, memsz, off, filesz) in &self.segments {
            // (Checked arithmetic: the headers may be garbage.)
            if addr >= v && addr < v.saturating_add(memsz) {
                let at = addr - v;
                if at < filesz {
                    let n = ((filesz - at) as usize).min(buf.len());
                    let src = off.checked_add(at).and_then(|x| usize::try_from(x).ok());
                    let Some(bytes) = src.and_then(|src| self.data.get(src..src.checked_add(n)?))
                    else {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    };
                    buf[..n].copy_from_slice(bytes);
                    return Ok(n);
                }
                break;
            }
        }
        // Not in the core: a file-backed page the core left out.
        for (s, e, ofs, path) in &self.files {
            if addr >= *s && addr < *e {
                use std::os::unix::fs::FileExt as _;
                let n = ((*e - addr) as usize).min(buf.len());
                let f = std::fs::File::open(path)?;
                return f.read_at(&mut buf[..n], ofs.saturating_add(addr - s));
            }
        }
        Err(io::ErrorKind::NotFound.into())
    }
}

/// `NT_FILE`: count, page size, `count` × (start, end, offset in pages), then the paths;
/// returned with byte offsets.
fn parse_nt_file(d: &[u8]) -> Option<Vec<(u64, u64, u64, String)>> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            d.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    let count = word(0)? as usize;
    let page = word(1)?;
    if count > 1 << 20 {
        return None;
    }
    let mut names = d.get((2 + 3 * count) * 8..)?.split(|&b| b == 0);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let (s, e, o) = (word(2 + 3 * i)?, word(3 + 3 * i)?, word(4 + 3 * i)?);
        let name = String::from_utf8_lossy(names.next()?).into_owned();
        out.push((s, e, o.saturating_mul(page), name));
    }
    Some(out)
}
