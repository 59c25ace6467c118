//! The table of loaded images (the executable, shared libraries, the vDSO), shared by the
//! DWARF unwinder and the symbolizer.
//!
//! The table is read once from the dynamic loader and published as an immutable snapshot
//! through an atomic pointer, so that a signal handler can use it without locks. When a
//! library is loaded later, [`refresh`] builds a new snapshot and publishes it; the old one is
//! leaked on purpose (a handler may still be walking with it), which costs a few hundred bytes
//! per refresh. A library unloaded with `dlclose` stays in the snapshot until the next
//! refresh: its addresses then resolve to the old image — the only way a result can name the
//! wrong image. (A refresh that finds an image gone says so, [`images_gone`], [`gone_since`]:
//! the symbolizer then forgets what it cached of the addresses in it.)
//!
//! Each image keeps a copy of its `.eh_frame` / `.eh_frame_hdr` (read from memory, so it is
//! exactly what runs, also for the vDSO and for deleted binaries). Which code keeps frame
//! pointers is judged *per function* from that call-frame information: a function whose CFA
//! rule moves to `rbp` sets up a frame record; one that never does (glibc, a Rust crate built
//! without `force-frame-pointers`, hand-written assembly) does not, and a frame-pointer step
//! out of it would skip its caller or follow garbage. The table splits each image's code into
//! ranges of the one kind or the other ([`ImageTable::code_range`]), so that one image may mix
//! both — a Rust binary built without frame pointers still links the prebuilt standard
//! library, which keeps them. Code without call-frame information counts as keeping frame
//! pointers (a frame-pointer step is then the only one possible).

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use framehop::{ExplicitModuleSectionInfo, MustNotAllocateDuringUnwind, Unwinder as _};

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
use linux as platform;

/// One loaded object.
#[derive(Debug)]
pub struct Image {
    /// File path (the executable's real path for the main program; `[vdso]` for the vDSO).
    pub path: String,
    /// Load bias: what was added to the file's virtual addresses.
    pub base: u64,
    /// Lowest mapped address of its loaded segments.
    pub start: u64,
    /// End of its loaded segments.
    pub end: u64,
    /// Executable ranges.
    pub exec: Vec<(u64, u64)>,
    /// GNU build id, if the image has one.
    pub build_id: Option<Vec<u8>>,
    /// Whether most of this image's functions keep frame pointers (at least 70% of those
    /// with call-frame information). Walks do not go by this: they go by the function
    /// (see [`ImageTable::code_range`]).
    pub keeps_frame_pointers: bool,
    /// How many of its functions (with call-frame information) set up no frame record.
    pub functions_without_frame_pointers: usize,
    /// Whether the image has call-frame information for the DWARF unwinder.
    pub has_unwind_info: bool,
    /// Whether the image is the C library, home of the signal-return trampoline that a
    /// signal handler returns to (walks look for signal frames only in its code).
    pub is_libc: bool,
    /// Its functions without frame pointers, as merged address ranges.
    no_fp: NoFp,
}

/// An image's functions that keep no frame pointers: sorted, merged address ranges.
#[derive(Clone, Debug, Default)]
struct NoFp {
    ranges: Arc<[(u64, u64)]>,
    functions: usize,
}

impl Image {
    /// The build id as lowercase hex.
    pub fn build_id_hex(&self) -> Option<String> {
        self.build_id.as_ref().map(|b| hex(b))
    }

    /// Whether `addr` lies in this image's mapped segments.
    #[inline]
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.start && addr < self.end
    }

    /// The file name part of the path.
    pub fn name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// What the platform leaf reports for one object.
pub(crate) struct RawImage {
    pub path: String,
    pub bias: u64,
    pub start: u64,
    pub end: u64,
    pub exec: Vec<(u64, u64)>,
    pub build_id: Option<Vec<u8>>,
    pub eh_frame_hdr: Option<(u64, Vec<u8>)>,
    pub eh_frame: Option<(u64, Vec<u8>)>,
}

/// An image's `.eh_frame_hdr` and `.eh_frame`, as copied from memory, with the addresses
/// they were copied from (their pointer encodings are relative to those).
#[derive(Clone)]
pub(crate) struct Cfi {
    pub hdr_addr: u64,
    pub hdr: Arc<[u8]>,
    pub eh_addr: u64,
    pub eh: Arc<[u8]>,
    /// Start of the image's first executable range (base of text-relative pointers).
    pub text: u64,
}

pub(crate) type DwarfUnwinder = crate::arch::DwarfUnwinder<Arc<[u8]>, MustNotAllocateDuringUnwind>;

/// A snapshot of the loaded images, with the DWARF unwinder built over them.
pub struct ImageTable {
    images: Vec<Arc<Image>>,
    /// Executable ranges sorted by start: (start, end, index into `images`).
    code: Vec<(u64, u64, u32)>,
    /// The same code split by whether its functions keep frame pointers, sorted and
    /// covering `code` exactly: (start, end, keeps frame pointers).
    fp_ranges: Vec<(u64, u64, bool)>,
    /// Executable ranges of the C library (where the signal-return trampoline lives).
    pub(crate) libc_code: Vec<(u64, u64)>,
    /// The span of `libc_code` (lowest start, highest end): one test per frame rules out
    /// most return addresses.
    pub(crate) libc_span: (u64, u64),
    /// Each image's call-frame information (same index as `images`), for the compact rule
    /// cache of [`crate::unwind`]; shared with the framehop modules, not copied.
    pub(crate) cfi: Vec<Option<Cfi>>,
    pub(crate) unwinder: DwarfUnwinder,
    counters: (u64, u64),
}

impl std::fmt::Debug for ImageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageTable")
            .field("images", &self.images)
            .finish()
    }
}

impl ImageTable {
    /// Every image, in loader order (the executable first).
    pub fn images(&self) -> &[Arc<Image>] {
        &self.images
    }

    /// The image whose executable code contains `addr`.
    #[inline]
    pub fn code_image(&self, addr: u64) -> Option<&Arc<Image>> {
        let i = self.code.partition_point(|&(s, _, _)| s <= addr);
        if i == 0 {
            return None;
        }
        let (s, e, idx) = self.code[i - 1];
        (addr >= s && addr < e).then(|| &self.images[idx as usize])
    }

    /// The image whose mapped segments contain `addr` (code or data).
    pub fn image_of(&self, addr: u64) -> Option<&Arc<Image>> {
        self.code_image(addr)
            .or_else(|| self.images.iter().find(|i| i.contains(addr)))
    }

    /// The largest range of code around `addr` whose functions all keep frame pointers, or
    /// all do not: `(start, end, keeps)`. `None` outside every image's code.
    #[inline]
    pub fn code_range(&self, addr: u64) -> Option<(u64, u64, bool)> {
        let i = self.fp_ranges.partition_point(|&(s, _, _)| s <= addr);
        if i == 0 {
            return None;
        }
        let r = self.fp_ranges[i - 1];
        (addr >= r.0 && addr < r.1).then_some(r)
    }

    /// Whether a frame-pointer step out of the function at `addr` can be trusted: it keeps
    /// frame pointers, or it lies outside every known image (JIT code: frame pointers are
    /// then the only hope).
    #[inline]
    pub fn frame_pointer_code(&self, addr: u64) -> bool {
        self.code_range(addr).is_none_or(|r| r.2)
    }

    /// The call-frame information of the image whose code contains `addr`.
    pub(crate) fn cfi_for(&self, addr: u64) -> Option<&Cfi> {
        let i = self.code.partition_point(|&(s, _, _)| s <= addr);
        if i == 0 {
            return None;
        }
        let (s, e, idx) = self.code[i - 1];
        if addr >= s && addr < e {
            self.cfi.get(idx as usize)?.as_ref()
        } else {
            None
        }
    }
}

/// Whether a loaded file is the C library (glibc's `libc.so.6`, musl's `ld-musl-*.so.1`).
fn is_libc_path(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libc.so") || name.starts_with("libc-") || name.starts_with("ld-musl")
}

static TABLE: AtomicPtr<ImageTable> = AtomicPtr::new(std::ptr::null_mut());
static BUILD: Mutex<()> = Mutex::new(());
/// How many snapshots found an image of the one before gone (unloaded, or another loaded in
/// its place): see [`images_gone`].
static GONE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The address ranges of the images found gone, by the value [`GONE`] took then: the last
/// [`GONE_KEPT`] snapshots' that found some.
static GONE_LOG: Mutex<GoneLog> = Mutex::new(std::collections::VecDeque::new());

/// Per snapshot that found images gone: its count and their ranges.
type GoneLog = std::collections::VecDeque<(u64, Vec<(u64, u64)>)>;
const GONE_KEPT: usize = 64;

/// How many times a new snapshot found that an image of the previous one is no longer
/// there as it was (unloaded with `dlclose`, or another file, or another build, loaded at
/// its address): what was learned of the addresses in it (names cached by the symbolizer)
/// may be wrong since.
pub fn images_gone() -> u64 {
    GONE.load(Ordering::Acquire)
}

/// The address ranges `[start, end)` of the images found gone after [`images_gone`] was
/// `since` (up to now), or `None` when they are no longer all known (too many snapshots
/// since): then any address may have changed.
pub fn gone_since(since: u64) -> Option<Vec<(u64, u64)>> {
    let log = GONE_LOG.lock().unwrap_or_else(|e| e.into_inner());
    ranges_since(&log, GONE.load(Ordering::Acquire), since)
}

/// [`gone_since`] over a log of consecutive counts ending at `now`.
fn ranges_since(log: &GoneLog, now: u64, since: u64) -> Option<Vec<(u64, u64)>> {
    // Every count after `since` must be in the log.
    let first = log.front().map_or(now + 1, |&(n, _)| n);
    if since < now && first > since + 1 {
        return None;
    }
    Some(
        log.iter()
            .filter(|&&(n, _)| n > since)
            .flat_map(|(_, r)| r.iter().copied())
            .collect(),
    )
}

/// The current snapshot, building it on first use. Not for signal handlers (it may build);
/// they use [`published`].
pub fn table() -> &'static ImageTable {
    match published() {
        Some(t) => t,
        None => build(None),
    }
}

/// The current snapshot if one was built, without building: usable in a signal handler.
#[inline]
pub fn published() -> Option<&'static ImageTable> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: a non-null pointer here came from Box::leak in `build` and is never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// Re-reads the loader's list if libraries were loaded or unloaded since the snapshot, and
/// returns the (possibly new) snapshot. Cheap when nothing changed.
pub fn refresh() -> &'static ImageTable {
    let old = table();
    if platform::loader_counters() == old.counters {
        return old;
    }
    build(Some(old))
}

fn build(prev: Option<&'static ImageTable>) -> &'static ImageTable {
    // Untracked by the heap tracker: its stack walks read this table, and would wait for
    // this lock on this very thread if an allocation made while it is held were recorded.
    let _untracked = crate::untracked::pause();
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    // Someone else may have built while we waited.
    if let Some(cur) = published() {
        if prev.is_none_or(|p| !std::ptr::eq(p, cur)) {
            return cur;
        }
    }
    let (raw, counters) = platform::list_images();
    let exe = platform::exe_path();
    let mut images = Vec::with_capacity(raw.len());
    let mut unwinder = DwarfUnwinder::new();
    let mut cfi = Vec::with_capacity(raw.len());
    for (n, r) in raw.into_iter().enumerate() {
        if r.start >= r.end {
            continue;
        }
        let path = if n == 0 && r.path.is_empty() {
            exe.clone().unwrap_or_default()
        } else if r.path.is_empty() || r.path.starts_with("linux-vdso") {
            "[vdso]".to_string()
        } else {
            r.path.clone()
        };
        // Reuse the previous snapshot's judgement for an image already known.
        let known = prev.and_then(|p| {
            p.images
                .iter()
                .find(|i| i.start == r.start && i.path == path && i.build_id == r.build_id)
                .cloned()
        });
        let judged = match &known {
            Some(k) => (k.keeps_frame_pointers, k.no_fp.clone()),
            None => r
                .eh_frame
                .as_ref()
                .map(|(addr, data)| judge_frame_pointers(*addr, data))
                .unwrap_or_default(),
        };
        let (keeps_fp, no_fp) = judged;
        let has_unwind_info = r.eh_frame.is_some() && r.eh_frame_hdr.is_some();
        let mut image_cfi = None;
        if let (Some((hdr_addr, hdr)), Some((eh_addr, eh))) = (r.eh_frame_hdr, r.eh_frame) {
            let svma = |a: u64| a.wrapping_sub(r.bias);
            let text = r.exec.first().map(|&(s, e)| svma(s)..svma(e));
            let (hdr, eh): (Arc<[u8]>, Arc<[u8]>) = (Arc::from(hdr), Arc::from(eh));
            image_cfi = Some(Cfi {
                hdr_addr,
                hdr: hdr.clone(),
                eh_addr,
                eh: eh.clone(),
                text: r.exec.first().map_or(0, |&(s, _)| s),
            });
            let info = ExplicitModuleSectionInfo::<Arc<[u8]>> {
                base_svma: 0,
                text_svma: text,
                eh_frame_hdr_svma: Some(svma(hdr_addr)..svma(hdr_addr) + hdr.len() as u64),
                eh_frame_svma: Some(svma(eh_addr)..svma(eh_addr) + eh.len() as u64),
                eh_frame_hdr: Some(hdr),
                eh_frame: Some(eh),
                ..Default::default()
            };
            unwinder.add_module(framehop::Module::new(
                path.clone(),
                r.start..r.end,
                r.bias,
                info,
            ));
        }
        let is_libc = is_libc_path(&path);
        cfi.push(image_cfi);
        images.push(Arc::new(Image {
            path,
            base: r.bias,
            start: r.start,
            end: r.end,
            exec: r.exec,
            build_id: r.build_id,
            keeps_frame_pointers: keeps_fp,
            functions_without_frame_pointers: no_fp.functions,
            no_fp,
            has_unwind_info,
            is_libc,
        }));
    }
    let same = |a: &Image, b: &Image| {
        a.start == b.start && a.end == b.end && a.path == b.path && a.build_id == b.build_id
    };
    let gone: Vec<(u64, u64)> = prev
        .map(|p| {
            p.images
                .iter()
                .filter(|old| !images.iter().any(|new| same(old, new)))
                .map(|old| (old.start, old.end))
                .collect()
        })
        .unwrap_or_default();
    if !gone.is_empty() {
        let mut log = GONE_LOG.lock().unwrap_or_else(|e| e.into_inner());
        // (Counted under the log's lock: a reader sees a count only with its ranges.)
        let n = GONE.fetch_add(1, Ordering::AcqRel) + 1;
        if log.len() == GONE_KEPT {
            log.pop_front();
        }
        log.push_back((n, gone));
    }
    let mut code: Vec<(u64, u64, u32)> = images
        .iter()
        .enumerate()
        .flat_map(|(i, img)| img.exec.iter().map(move |&(s, e)| (s, e, i as u32)))
        .collect();
    code.sort_unstable();
    let fp_ranges = split_by_frame_pointers(&code, &images);
    let libc_code: Vec<(u64, u64)> = images
        .iter()
        .filter(|i| i.is_libc)
        .flat_map(|i| i.exec.iter().copied())
        .collect();
    let table: &'static ImageTable = Box::leak(Box::new(ImageTable {
        images,
        code,
        fp_ranges,
        libc_span: libc_code
            .iter()
            .fold((u64::MAX, 0), |(lo, hi), &(s, e)| (lo.min(s), hi.max(e))),
        libc_code,
        cfi,
        unwinder,
        counters,
    }));
    TABLE.store(table as *const _ as *mut _, Ordering::Release);
    table
}

/// Splits each executable range into runs of code that keeps frame pointers and code that
/// does not (the image's functions without them, clipped to the range).
fn split_by_frame_pointers(
    code: &[(u64, u64, u32)],
    images: &[Arc<Image>],
) -> Vec<(u64, u64, bool)> {
    let mut out = Vec::with_capacity(code.len());
    for &(s, e, idx) in code {
        let no_fp = &images[idx as usize].no_fp.ranges;
        let mut at = s;
        let first = no_fp.partition_point(|&(_, ne)| ne <= s);
        for &(ns, ne) in &no_fp[first..] {
            if ns >= e {
                break;
            }
            let (ns, ne) = (ns.max(at), ne.min(e));
            if ns > at {
                out.push((at, ns, true));
            }
            if ne > ns {
                out.push((ns, ne, false));
                at = ne;
            }
        }
        if at < e {
            out.push((at, e, true));
        }
    }
    out
}

/// Judges from call-frame information which functions of an image keep frame pointers: those
/// whose CFA rule moves to `rbp` at some point. Returns whether most do (70%), and the
/// ranges of those that do not.
fn judge_frame_pointers(eh_addr: u64, data: &[u8]) -> (bool, NoFp) {
    use addr2line::gimli::{
        BaseAddresses, CallFrameInstruction, CieOrFde, EhFrame, LittleEndian, UnwindSection,
    };
    const RBP: u16 = 6;
    let eh = EhFrame::new(data, LittleEndian);
    let bases = BaseAddresses::default().set_eh_frame(eh_addr);
    let mut entries = eh.entries(&bases);
    let (mut fdes, mut with_fp) = (0usize, 0usize);
    let mut without: Vec<(u64, u64)> = Vec::new();
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        if fde.len() == 0 {
            continue;
        }
        fdes += 1;
        let mut uses_rbp = false;
        let mut ins = fde.instructions(&eh, &bases);
        while let Ok(Some(i)) = ins.next() {
            uses_rbp = match i {
                CallFrameInstruction::DefCfaRegister { register } => register.0 == RBP,
                CallFrameInstruction::DefCfa { register, .. } => register.0 == RBP,
                _ => false,
            };
            if uses_rbp {
                break;
            }
        }
        if uses_rbp {
            with_fp += 1;
        } else {
            let start = fde.initial_address();
            without.push((start, start.saturating_add(fde.len())));
        }
    }
    let functions = without.len();
    without.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(without.len());
    for (s, e) in without {
        match merged.last_mut() {
            // Functions separated by alignment padding only form one range.
            Some(last) if s <= last.1.saturating_add(16) => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    (
        fdes > 0 && with_fp * 10 >= fdes * 7,
        NoFp {
            ranges: merged.into(),
            functions,
        },
    )
}

/// Parses ELF note bytes and returns the GNU build id (note type 3, owner "GNU").
pub(crate) fn parse_build_id_notes(mut notes: &[u8]) -> Option<Vec<u8>> {
    fn u32_at(b: &[u8], o: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(b.get(o..o + 4)?.try_into().ok()?))
    }
    let align = |n: usize| n.div_ceil(4) * 4;
    while notes.len() >= 12 {
        let namesz = u32_at(notes, 0)? as usize;
        let descsz = u32_at(notes, 4)? as usize;
        let ty = u32_at(notes, 8)?;
        let name_end = 12usize.checked_add(align(namesz))?;
        let desc_end = name_end.checked_add(align(descsz))?;
        if desc_end > notes.len() {
            return None;
        }
        if ty == 3 && namesz == 4 && &notes[12..16] == b"GNU\0" {
            return Some(notes[name_end..name_end + descsz].to_vec());
        }
        notes = &notes[desc_end..];
    }
    None
}

/// Decodes the `.eh_frame` start address from an `.eh_frame_hdr` found at `hdr_addr`.
pub(crate) fn eh_frame_start(hdr_addr: u64, hdr: &[u8]) -> Option<u64> {
    use addr2line::gimli::{BaseAddresses, EhFrameHdr, LittleEndian, Pointer};
    let bases = BaseAddresses::default().set_eh_frame_hdr(hdr_addr);
    let parsed = EhFrameHdr::new(hdr, LittleEndian).parse(&bases, 8).ok()?;
    match parsed.eh_frame_ptr() {
        Pointer::Direct(a) => Some(a),
        Pointer::Indirect(_) => None,
    }
}

/// Length of an `.eh_frame` section in memory: entries up to the zero terminator (or the end
/// of the bytes given).
pub(crate) fn eh_frame_len(mem: &[u8]) -> usize {
    let mut off = 0usize;
    loop {
        let Some(len) = mem.get(off..off + 4) else {
            return off.min(mem.len());
        };
        let len = u32::from_le_bytes(len.try_into().unwrap_or([0; 4])) as u64;
        if len == 0 {
            return off + 4;
        }
        let (hdr, body) = if len == 0xffff_ffff {
            match mem.get(off + 4..off + 12) {
                Some(b) => (12u64, u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))),
                None => return off,
            }
        } else {
            (4u64, len)
        };
        let next = (off as u64).saturating_add(hdr).saturating_add(body);
        if next > mem.len() as u64 {
            return off;
        }
        off = next as usize;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranges_gone_since_a_count_are_those_logged_after_it_or_none_if_some_fell_off() {
        let log: GoneLog = [
            (3, vec![(30, 31)]),
            (4, vec![(40, 41), (42, 43)]),
            (5, vec![(50, 51)]),
        ]
        .into();
        assert_eq!(ranges_since(&log, 5, 5), Some(vec![]));
        assert_eq!(ranges_since(&log, 5, 4), Some(vec![(50, 51)]));
        assert_eq!(
            ranges_since(&log, 5, 2),
            Some(vec![(30, 31), (40, 41), (42, 43), (50, 51)])
        );
        // Count 2's ranges fell off the log: not known.
        assert_eq!(ranges_since(&log, 5, 1), None);
        assert_eq!(ranges_since(&Default::default(), 0, 0), Some(vec![]));
        assert_eq!(ranges_since(&Default::default(), 3, 1), None);
    }

    #[test]
    fn executable_and_libc_are_listed_with_build_ids() {
        let t = table();
        let exe = &t.images()[0];
        assert!(exe.path.contains("fibertrace_core"), "{}", exe.path);
        assert!(exe.build_id.is_some());
        assert!(exe.has_unwind_info);
        // Our own code is built with frame pointers (.cargo/config.toml).
        assert!(exe.keeps_frame_pointers);
        let f = executable_and_libc_are_listed_with_build_ids as *const () as usize as u64;
        assert!(std::ptr::eq(&**t.code_image(f).unwrap(), &**exe));
        let libc_img = t
            .images()
            .iter()
            .find(|i| i.name().starts_with("libc.so"))
            .expect("libc listed");
        assert!(libc_img.has_unwind_info);
        // Debian's glibc is built without frame pointers: judged per function too.
        assert!(!libc_img.keeps_frame_pointers);
        assert!(libc_img.functions_without_frame_pointers > 100);
        let qsort = libc::qsort as *const () as usize as u64;
        assert_eq!(t.code_range(qsort).map(|r| r.2), Some(false));
        assert!(!t.frame_pointer_code(qsort));
        let ours = executable_and_libc_are_listed_with_build_ids as *const () as usize as u64;
        assert_eq!(t.code_range(ours).map(|r| r.2), Some(true));
        // Outside every image: frame pointers are the only hope.
        assert!(t.code_range(8).is_none() && t.frame_pointer_code(8));
        let q = libc::qsort as *const () as usize as u64;
        assert!(std::ptr::eq(&**t.code_image(q).unwrap(), &**libc_img));
        // Only libc's code is searched for the signal-return trampoline.
        assert!(libc_img.is_libc && !exe.is_libc);
        assert!(t.libc_code.iter().any(|&(s, e)| q >= s && q < e));
    }

    fn image(exec: Vec<(u64, u64)>, no_fp: &[(u64, u64)]) -> Arc<Image> {
        Arc::new(Image {
            path: String::new(),
            base: 0,
            start: exec.first().map_or(0, |r| r.0),
            end: exec.last().map_or(0, |r| r.1),
            exec,
            build_id: None,
            keeps_frame_pointers: true,
            functions_without_frame_pointers: no_fp.len(),
            has_unwind_info: true,
            is_libc: false,
            no_fp: NoFp {
                ranges: no_fp.into(),
                functions: no_fp.len(),
            },
        })
    }

    #[test]
    fn code_is_split_exactly_by_functions_without_frame_pointers() {
        let a = image(
            vec![(100, 200), (300, 400)],
            &[(90, 110), (150, 160), (190, 310)],
        );
        let b = image(vec![(500, 600)], &[]);
        let code = vec![(100, 200, 0), (300, 400, 0), (500, 600, 1)];
        let got = split_by_frame_pointers(&code, &[a, b]);
        assert_eq!(
            got,
            [
                (100, 110, false),
                (110, 150, true),
                (150, 160, false),
                (160, 190, true),
                (190, 200, false),
                (300, 310, false),
                (310, 400, true),
                (500, 600, true),
            ]
        );
    }

    #[test]
    fn build_id_notes_parse_and_reject_garbage() {
        let mut n = Vec::new();
        n.extend_from_slice(&4u32.to_ne_bytes());
        n.extend_from_slice(&3u32.to_ne_bytes());
        n.extend_from_slice(&3u32.to_ne_bytes());
        n.extend_from_slice(b"GNU\0");
        n.extend_from_slice(&[1, 2, 3, 0]);
        assert_eq!(parse_build_id_notes(&n), Some(vec![1, 2, 3]));
        assert_eq!(parse_build_id_notes(&n[..14]), None);
        let mut bad = n.clone();
        bad[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(parse_build_id_notes(&bad), None);
    }
}
