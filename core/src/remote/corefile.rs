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
    /// The file is shorter than its headers say (its writer stopped, a full disk): where its
    /// segments reach and where it ends. Memory past its end is missing: stacks and fibers
    /// read there are cut short or missing.
    pub truncated: Option<(u64, u64)>,
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
        if let Some(r) = root {
            if !r.is_dir() {
                return Err(format!(
                    "--root {}: not a directory (a copy of the machine's files is one)",
                    r.display()
                ));
            }
        }
        if let Some(e) = exe {
            if !e.is_file() {
                return Err(format!(
                    "{}: not a file (the executable the core names, where it is now)",
                    e.display()
                ));
            }
        }
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
        let data = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOMEM) {
                format!(
                    "{}: cannot map the core file ({} bytes) into memory: {e} (it is read \
                     mapped whole: an address-space limit, ulimit -v, must leave room for it)",
                    path.display(),
                    m.len()
                )
            } else {
                format!("{}: {e}", path.display())
            }
        })?;
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
        let phdrs = elf.program_headers(endian, &*data).map_err(|_| {
            let reach = elf.e_phoff(endian).saturating_add(
                u64::from(elf.e_phnum(endian)).saturating_mul(u64::from(elf.e_phentsize(endian))),
            );
            if reach > data.len() as u64 {
                format!(
                    "{}: the file is truncated: its program headers reach byte {reach}, it ends \
                     at {}",
                    path.display(),
                    data.len()
                )
            } else {
                format!("{}: bad program headers", path.display())
            }
        })?;
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
                    // (The notes the file holds: a core cut in its note segment keeps the
                    // first ones, the threads' among them.)
                    let (off, len) = (ph.p_offset(endian), ph.p_filesz(endian));
                    let Some(held) = usize::try_from(off)
                        .ok()
                        .and_then(|off| data.get(off..))
                        .map(|rest| {
                            &rest[..usize::try_from(len).unwrap_or(usize::MAX).min(rest.len())]
                        })
                    else {
                        continue;
                    };
                    let Ok(mut notes) = object::read::elf::NoteIterator::<
                        object::elf::FileHeader64<Endianness>,
                    >::new(endian, ph.p_align(endian), held) else {
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
        // A core cut short (its writer stopped, a full disk).
        let claimed = phdrs
            .iter()
            .map(|ph| ph.p_offset(endian).saturating_add(ph.p_filesz(endian)))
            .max()
            .unwrap_or(0);
        let truncated = (claimed > data.len() as u64).then_some((claimed, data.len() as u64));
        if threads.is_empty() {
            // (It loses its notes with it.)
            let cut = match truncated {
                Some((claimed, len)) => format!(
                    "; the file is truncated: its segments reach byte {claimed}, it ends at {len}"
                ),
                None => String::new(),
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
            truncated,
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// A little-endian x86_64 core: the ELF header, a note segment of `notes` `NT_PRSTATUS`
    /// notes (thread ids 100, 101, ...) and one loaded segment of 4096 bytes, the file then
    /// cut at `cut` bytes (`None`: whole).
    fn synthetic_core(notes: usize, cut: Option<usize>) -> Vec<u8> {
        let (eh, ph) = (64usize, 56usize);
        let note_len = 12 + 8 + 336;
        let note_off = eh + 2 * ph;
        let load_off = note_off + notes * note_len;
        let mut f = vec![0u8; load_off + 4096];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2; // 64-bit
        f[5] = 1; // little-endian
        f[6] = 1; // version
        f[16..18].copy_from_slice(&4u16.to_le_bytes()); // ET_CORE
        f[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        f[20..24].copy_from_slice(&1u32.to_le_bytes());
        f[32..40].copy_from_slice(&(eh as u64).to_le_bytes()); // e_phoff
        f[52..54].copy_from_slice(&(eh as u16).to_le_bytes());
        f[54..56].copy_from_slice(&(ph as u16).to_le_bytes());
        f[56..58].copy_from_slice(&2u16.to_le_bytes());
        let phdr = |f: &mut Vec<u8>, i: usize, ty: u32, off: usize, filesz: usize, vaddr: u64| {
            let p = eh + i * ph;
            f[p..p + 4].copy_from_slice(&ty.to_le_bytes());
            f[p + 4..p + 8].copy_from_slice(&6u32.to_le_bytes()); // PF_R | PF_W
            f[p + 8..p + 16].copy_from_slice(&(off as u64).to_le_bytes());
            f[p + 16..p + 24].copy_from_slice(&vaddr.to_le_bytes());
            f[p + 32..p + 40].copy_from_slice(&(filesz as u64).to_le_bytes());
            f[p + 40..p + 48].copy_from_slice(&(filesz as u64).to_le_bytes());
            f[p + 48..p + 56].copy_from_slice(&4u64.to_le_bytes());
        };
        phdr(
            &mut f,
            0,
            object::elf::PT_NOTE.0,
            note_off,
            notes * note_len,
            0,
        );
        phdr(&mut f, 1, object::elf::PT_LOAD.0, load_off, 4096, 0x10000);
        for i in 0..notes {
            let n = note_off + i * note_len;
            f[n..n + 4].copy_from_slice(&5u32.to_le_bytes());
            f[n + 4..n + 8].copy_from_slice(&336u32.to_le_bytes());
            f[n + 8..n + 12].copy_from_slice(&NT_PRSTATUS.to_le_bytes());
            f[n + 12..n + 17].copy_from_slice(b"CORE\0");
            let d = n + 20;
            f[d + 32..d + 36].copy_from_slice(&(100 + i as i32).to_le_bytes());
        }
        if let Some(c) = cut {
            f.truncate(c);
        }
        f
    }

    fn open(bytes: &[u8]) -> Result<Core, String> {
        let dir = std::env::temp_dir().join(format!("fibertrace-corefile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("core-{}", bytes.len()));
        std::fs::write(&p, bytes).unwrap();
        let r = Core::open(&p, None, None);
        let _ = std::fs::remove_file(&p);
        r
    }

    #[test]
    fn a_core_cut_short_keeps_the_threads_it_holds_and_says_it_is_cut() {
        let whole = synthetic_core(3, None);
        let c = open(&whole).unwrap();
        let tids: Vec<i32> = c.threads.iter().map(|t| t.tid).collect();
        assert_eq!(tids, [100, 101, 102]);
        assert_eq!(c.truncated, None);
        // Cut inside its memory: every thread, and the cut said.
        let n = whole.len() - 1000;
        let c = open(&whole[..n]).unwrap();
        assert_eq!(c.threads.len(), 3);
        assert_eq!(c.truncated, Some((whole.len() as u64, n as u64)));
        // Cut inside its third note: the first two threads (the segment was refused whole).
        let at = 64 + 2 * 56 + 2 * 356 + 100;
        let c = open(&whole[..at]).unwrap();
        let tids: Vec<i32> = c.threads.iter().map(|t| t.tid).collect();
        assert_eq!(tids, [100, 101]);
        assert_eq!(c.truncated, Some((whole.len() as u64, at as u64)));
        // Cut inside its first note: no thread, and why.
        let e = open(&whole[..64 + 2 * 56 + 40]).err().unwrap();
        assert!(
            e.ends_with(&format!(
                "the core holds no thread (no NT_PRSTATUS note); the file is truncated: its \
                 segments reach byte {}, it ends at {}",
                whole.len(),
                64 + 2 * 56 + 40
            )),
            "{e}"
        );
        // Cut inside its program headers.
        let e = open(&whole[..100]).err().unwrap();
        assert!(
            e.ends_with(
                "the file is truncated: its program headers reach byte 176, it ends at 100"
            ),
            "{e}"
        );
    }
}
