//! `fibertrace decode -e`: offline symbolization of decoded frames, printed like
//! `addr2line -a -f -p -i`.
//!
//! Each `-e` argument is an ELF file or a build-id directory (`DIR/ab/cdef….debug` or
//! `DIR/ab/cdef…`, as `/usr/lib/debug/.build-id`). An address inside an image of the current
//! `~i#` table is looked up in the file with that image's build id at `address − base`;
//! any other address is looked up as is in the first `-e` file (right for non-PIE programs, the
//! lws convention). Frames with a return address are looked up at `address − 1` (the call).
//! A wrong or missing file gives `?? ??:0`, never a wrong name from another file — unless a
//! plain address is looked up in a first `-e` file that is not the binary it came from.

use fibertrace_core::codec::native::ImageTable;
use fibertrace_core::symbolize::elf::ElfSymbols;
use fibertrace_core::Frame;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;

/// The symbol files given with `-e`.
#[derive(Debug, Default)]
pub struct Symbolizer {
    files: Vec<ElfSymbols>,
    dirs: Vec<PathBuf>,
    from_dirs: HashMap<Vec<u8>, Option<ElfSymbols>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

impl Symbolizer {
    /// Opens the files (directories are searched later, by build id).
    pub fn new<P: AsRef<std::path::Path>>(paths: &[P]) -> Result<Self, String> {
        let mut s = Self::default();
        for p in paths {
            let pb = p.as_ref().to_path_buf();
            if pb.is_dir() {
                s.dirs.push(pb);
            } else {
                let elf = ElfSymbols::open(&pb).map_err(|e| e.to_string())?;
                // Its DWARF now (decode prints lines): a file whose DWARF cannot be read is an
                // error, as one that cannot be opened.
                elf.load_dwarf().map_err(|e| e.to_string())?;
                if let Some(why) = elf.dwarf_error() {
                    return Err(format!("cannot read symbols of {}: {why}", pb.display()));
                }
                s.files.push(elf);
            }
        }
        Ok(s)
    }

    fn by_build_id(&mut self, id: &[u8]) -> Option<&ElfSymbols> {
        if id.is_empty() {
            return None;
        }
        if let Some(i) = self.files.iter().position(|f| f.build_id() == Some(id)) {
            return Some(&self.files[i]);
        }
        if !self.from_dirs.contains_key(id) {
            let h = hex(id);
            let found = (h.len() > 2)
                .then(|| {
                    self.dirs.iter().find_map(|d| {
                        [format!("{}.debug", &h[2..]), h[2..].to_string()]
                            .iter()
                            .map(|n| d.join(&h[..2]).join(n))
                            .filter(|p| p.is_file())
                            .find_map(|p| ElfSymbols::open(p).ok())
                    })
                })
                .flatten();
            self.from_dirs.insert(id.to_vec(), found);
        }
        self.from_dirs.get(id).and_then(Option::as_ref)
    }

    /// The addr2line-style lines for the native frames of a trace.
    pub fn lines(&mut self, frames: &[Frame], table: Option<&ImageTable>) -> Vec<String> {
        let mut out = Vec::new();
        for f in frames {
            let (Some(addr), Some(look)) = (f.address(), f.lookup_address()) else {
                continue;
            };
            let image = table.and_then(|t| t.find(addr).map(|i| &t.images()[i]));
            let (elf, svma) = match image {
                Some(im) => {
                    let (base, id) = (im.base, im.build_id.clone());
                    (self.by_build_id(&id), look - base)
                }
                None => (self.files.first(), look),
            };
            let symbols = elf.map(|e| e.lookup(svma).symbols).unwrap_or_default();
            let mut line = format!("0x{addr:016x}: ");
            if symbols.is_empty() {
                line.push_str("?? ??:0");
            }
            for (i, s) in symbols.iter().enumerate() {
                if i > 0 {
                    out.push(std::mem::take(&mut line));
                    line.push_str(" (inlined by) ");
                }
                let loc = match (&s.file, s.line) {
                    (Some(f), Some(l)) => format!("{f}:{l}"),
                    (Some(f), None) => format!("{f}:?"),
                    _ => "??:0".to_string(),
                };
                let _ = write!(line, "{} at {loc}", s.name.as_deref().unwrap_or("??"));
            }
            out.push(line);
        }
        out
    }
}
