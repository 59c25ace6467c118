//! Symbolize: frames to function names, offsets, file:line and inline frames — lazily, and
//! through a process-wide cache keyed by address.
//!
//! Per image, the ELF file is opened and indexed once ([`ElfSymbols`]), on the first lookup
//! that needs it, after checking that its build id matches the image in memory (a binary
//! replaced on disk is not used: its names would be wrong). Frames of images without a usable
//! file (the vDSO, a deleted or replaced binary) fall back to `dladdr`, which knows exported
//! names only. Results are cached by lookup address (`pc`, or `ra - 1` for return addresses):
//! a cache hit is one hash lookup and a reference-count increment. A file's DWARF is loaded
//! at its first full lookup ([`resolve`]); [`resolve_outer`] names the function from the
//! symbol table alone, read when the file is opened, and never loads it.
//!
//! How a result can be wrong: a library unloaded and another loaded at the same address
//! keeps the old names of addresses looked up before, until a lookup not cached notices the
//! change (each refreshes the image table, and what was cached of an image found gone is
//! forgotten) or
//! [`revalidate`] is called; code without debug info
//! gets the nearest preceding symbol, which for a stripped static function is a neighbour's.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, OnceLock};

use dashmap::DashMap;
use serde::{Deserialize, Serialize};

use crate::frame::Frame;
use crate::image::{self, Image};

pub mod elf;
mod linux;

pub use elf::{ElfSymbols, Lookup, OpenError, Symbol};

/// What an address resolves to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    /// The address looked up (`pc`, or `ra - 1`).
    pub lookup_address: u64,
    /// Function levels, innermost (most inlined) first. Empty when nothing is known.
    pub symbols: Vec<Symbol>,
    /// Start address of the containing function (in the process), when known.
    pub function_start: Option<u64>,
    /// The image the address belongs to.
    pub image: Option<ImageRef>,
}

/// An image as named in resolved output.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    /// File path.
    pub path: String,
    /// Load bias.
    pub base: u64,
    /// GNU build id, hex.
    pub build_id: Option<String>,
}

impl Resolved {
    /// The outermost (real, not inlined) function's name.
    pub fn function(&self) -> Option<&str> {
        self.symbols.last().and_then(|s| s.name.as_deref())
    }

    /// Offset of `address` from the start of its function.
    pub fn offset_of(&self, address: u64) -> Option<u64> {
        self.function_start.and_then(|s| address.checked_sub(s))
    }

    /// The innermost level (where the address is, after inlining).
    pub fn innermost(&self) -> Option<&Symbol> {
        self.symbols.first()
    }
}

/// A fast, non-cryptographic hasher: a multiply-rotate mix over 8-byte words, with the high
/// bits folded down at the end (dashmap picks its shard from the high bits, hashbrown its
/// bucket from the low ones, and aligned addresses have poor low bits). For keys that come
/// from the program itself (addresses, fiber ids, frame descriptions), where a collision
/// only costs a comparison.
#[derive(Default, Clone, Copy)]
pub struct AddrHasher(u64);

const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for AddrHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length tag keeps "abc" and "abc\0" apart.
            self.write_u64(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(MIX);
    }
}

type AddrMap<V> = DashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// Cached entries beyond which the cache is cleared (addresses of code are finite; this
/// bounds memory when garbage addresses are resolved).
const CACHE_LIMIT: usize = 1 << 20;

struct Resolver {
    cache: AddrMap<Arc<Resolved>>,
    /// [`resolve_outer`]'s results (the symbol table's names alone).
    outer: AddrMap<Arc<Resolved>>,
    /// Per image (keyed by its start address): its symbols, opened on first need.
    files: AddrMap<Arc<FileSlot>>,
}

/// An image's symbols, for the image it was made for: another image at the same address
/// (a library unloaded and another loaded in its place) gets a new slot.
struct FileSlot {
    path: String,
    build_id: Option<Vec<u8>>,
    end: u64,
    state: Mutex<FileState>,
}

impl FileSlot {
    fn new(img: &Image) -> Arc<FileSlot> {
        Arc::new(FileSlot {
            path: img.path.clone(),
            build_id: img.build_id.clone(),
            end: img.end,
            state: Mutex::new(FileState::Unopened),
        })
    }

    /// Whether the slot was made for image `img` (the one at its address): the same path,
    /// build id and extent. (A library rebuilt without a build id, of the same extent, at
    /// the same path and address is taken for the old one: its file was checked at open.)
    fn is_for(&self, img: &Image) -> bool {
        self.path == img.path && self.build_id == img.build_id && self.end == img.end
    }
}

enum FileState {
    Unopened,
    Open(Box<ElfSymbols>),
    Unusable,
}

static RESOLVER: OnceLock<Resolver> = OnceLock::new();

fn resolver() -> &'static Resolver {
    RESOLVER.get_or_init(|| {
        // The library's own table: untracked (see `crate::untracked`).
        let _untracked = crate::untracked::pause();
        Resolver {
            cache: AddrMap::default(),
            outer: AddrMap::default(),
            files: AddrMap::default(),
        }
    })
}

/// Resolves a frame. Markers and Lua frames resolve to `None` (the Lua side names Lua
/// frames).
pub fn resolve(frame: &Frame) -> Option<Arc<Resolved>> {
    frame.lookup_address().map(resolve_address)
}

/// Resolves a lookup address (`pc`, or `ra - 1`), through the cache.
pub fn resolve_address(addr: u64) -> Arc<Resolved> {
    resolve_in(Tier::Full, addr)
}

/// Resolves a frame to its function alone, as the symbol table names it: the outermost
/// level's name (no file, line or inlined levels) and the function's start. For what needs no
/// more (a name and an offset, as Tarantool's traces print them; which function a frame is
/// in), without loading the program's DWARF — for a large program the first full
/// [`resolve`] loads it, tens of milliseconds and tens of megabytes. An address the symbol
/// table has no function for is named by `dladdr`, or, in a stripped library with a detached
/// debug file installed, by that file's table ([`ElfSymbols::lookup_outer`]). The name is
/// the full resolution's outermost one, except where the DWARF names a function that the
/// symbol table names otherwise (identical functions folded into one symbol, a compiler's
/// clone such as `foo.isra.0`, which Tarantool's traces show as such too).
pub fn resolve_outer(frame: &Frame) -> Option<Arc<Resolved>> {
    frame.lookup_address().map(resolve_outer_address)
}

/// [`resolve_outer`] of a lookup address, through its own cache.
pub fn resolve_outer_address(addr: u64) -> Arc<Resolved> {
    resolve_in(Tier::Outer, addr)
}

/// How much a lookup asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    /// Every level, file and line ([`ElfSymbols::lookup`]).
    Full,
    /// The symbol table's function ([`ElfSymbols::lookup_outer`]).
    Outer,
}

fn resolve_in(tier: Tier, addr: u64) -> Arc<Resolved> {
    if crate::holding::active() {
        return resolve_holding(tier, addr);
    }
    let r = resolver();
    let cache = match tier {
        Tier::Full => &r.cache,
        Tier::Outer => &r.outer,
    };
    if let Some(hit) = cache.get(&addr) {
        return Arc::clone(hit.value());
    }
    // The symbolizer's tables are this library's, not the program's: not tracked by the heap
    // tracker (nor listed in its views).
    let _untracked = crate::untracked::pause();
    // (Parsing debug information takes far more stack than a fiber may have.)
    let (resolved, lasting, generation) = on_large_stack(|| resolve_uncached(r, addr, tier));
    let resolved = Arc::new(resolved);
    // (A resolution cut short by a passing shortage — no file descriptor free — is not kept:
    // the next lookup tries again. Nor one made while another thread cleared the cache — an
    // image found gone: it may be of the image that was there.)
    if lasting && cache_generation() == generation {
        if cache.len() >= CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(addr, Arc::clone(&resolved));
    }
    resolved
}

/// [`resolve_in`] on a thread that holds another still (see [`crate::holding`]), which may
/// have been stopped inside the symbolizer holding its locks: the cache's answer without
/// waiting for any lock or doing any of a lookup's work, else the address alone (not kept).
fn resolve_holding(tier: Tier, addr: u64) -> Arc<Resolved> {
    // (The resolver is not made here: a thread held while it made it would hold this one.)
    let hit = RESOLVER.get().and_then(|r| {
        let cache = match tier {
            Tier::Full => &r.cache,
            Tier::Outer => &r.outer,
        };
        match cache.try_get(&addr) {
            dashmap::try_result::TryResult::Present(hit) => Some(Arc::clone(hit.value())),
            _ => None,
        }
    });
    hit.unwrap_or_else(|| {
        Arc::new(Resolved {
            lookup_address: addr,
            ..Resolved::default()
        })
    })
}

/// How many files' DWARF the process has loaded so far: the first full lookup ([`resolve`])
/// in a file loads it (for a large program tens of milliseconds and megabytes, once);
/// [`resolve_outer`] does only for a stripped library's internal function when its detached
/// debug file is installed. For tests and benchmarks of what a path costs.
pub fn dwarf_loads() -> u64 {
    elf::DWARF_LOADS.load(std::sync::atomic::Ordering::Relaxed)
}

/// How a runtime runs work on a larger stack than the current one (see
/// [`set_large_stack_runner`]).
pub type LargeStackRunner = fn(&mut dyn FnMut());

static LARGE_STACK: OnceLock<LargeStackRunner> = OnceLock::new();

/// Sets, once per process, how the symbolizer runs its parsing of debug information (the
/// first lookup in an image's unit reads its line table and names: about 100 KiB of stack
/// in a debug build), and a walk makes its thread's DWARF cache (built on the stack before
/// it is boxed, in a debug build), when called on a small stack: a fiber runtime passes a function that
/// runs its argument on the stack of the code that resumed the running fiber, and runs it
/// in place elsewhere. Later calls are ignored. Without it, lookups parse where they are.
pub fn set_large_stack_runner(run: LargeStackRunner) {
    let _ = LARGE_STACK.set(run);
}

/// `f`, run through the [`set_large_stack_runner`] runner if there is one (never from a
/// signal handler: the runner may switch stacks).
pub(crate) fn on_large_stack<R>(f: impl FnOnce() -> R) -> R {
    let Some(run) = LARGE_STACK.get() else {
        return f();
    };
    let mut f = Some(f);
    let mut out = None;
    run(&mut || {
        if let Some(f) = f.take() {
            out = Some(f());
        }
    });
    match out {
        Some(r) => r,
        // (A runner that did not run it: here, then.)
        None => f.take().map(|f| f()).expect("the work was run once"),
    }
}

/// Calls `f` for every frame of `frames` with its index and resolution (`None` for markers
/// and Lua frames). Resolution happens here, not at capture.
pub fn foreach(frames: &[Frame], mut f: impl FnMut(usize, &Frame, Option<&Resolved>)) {
    for (i, fr) in frames.iter().enumerate() {
        let r = resolve(fr);
        f(i, fr, r.as_deref());
    }
}

/// Learns whether libraries were loaded or unloaded since the image table was read (one
/// call into the loader when nothing changed), and if one was unloaded (or another loaded
/// in its place), forgets what was cached of the addresses in it (what was cached of other
/// images is kept). Lookups do it themselves at every one not cached; a program that
/// unloads libraries with `dlclose` and loads others may be given the old names of
/// addresses already looked up until then, and calls this after it loads them to have
/// none. Not from a signal handler (it takes the loader's lock and may read the loader's
/// list).
pub fn revalidate() {
    image::refresh();
    forget_if_images_gone();
}

/// Forgets what was cached of the addresses in images a snapshot of the image table found
/// gone since the last time this looked ([`image::images_gone`]): their resolutions and
/// opened files, with a new [`cache_generation`] (or everything, [`clear_cache`], when the
/// table no longer knows which images went).
fn forget_if_images_gone() {
    static SEEN: Mutex<u64> = Mutex::new(0);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let gone = image::images_gone();
    if *seen == gone {
        return;
    }
    match image::gone_since(*seen) {
        Some(ranges) => {
            let out = |a: &u64| !ranges.iter().any(|&(s, e)| *a >= s && *a < e);
            let r = resolver();
            r.cache.retain(|a, _| out(a));
            r.outer.retain(|a, _| out(a));
            r.files.retain(|a, _| out(a));
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Release);
        }
        None => clear_cache(),
    }
    *seen = gone;
}

/// Forgets every cached resolution (after libraries were unloaded); caches of results made
/// from resolutions see it in [`cache_generation`].
pub fn clear_cache() {
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Release);
    resolver().cache.clear();
    resolver().outer.clear();
}

static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times [`clear_cache`] ran: a cache of results computed from resolutions (a
/// merged trace, a rendered frame) keeps the generation it was made in and is stale when
/// this differs.
pub fn cache_generation() -> u64 {
    GENERATION.load(std::sync::atomic::Ordering::Acquire)
}

/// Address space a lookup wants free before it parses an image's debug information (a
/// unit's line table and names take up to megabytes, allocated where a failure aborts the
/// process: at a memory limit the Lua heap filled, a report's first lookups did); opening
/// an image's file wants its size besides (it is mapped, and its index built).
const PARSE_ROOM: usize = 8 << 20;

std::thread_local! {
    /// Lookups this thread left unresolved for want of address space (see [`PARSE_ROOM`]).
    static SKIPPED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A lookup was left unresolved for want of address space since the last one that parsed:
/// the next that parses starts a new [`cache_generation`] (caches of results made from the
/// unresolved frame are remade).
static SKIPPED_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How many lookups this thread made so far found too little address space left (an
/// address-space limit, `ulimit -v`: only it is checked) to parse debug information, or to
/// open an image's file, and left their frame unresolved (`0x… in ??`, or the exported name
/// only) rather than risk aborting the process mid-parse; a report that sees it move while
/// it renders can say so. Each is tried again at its next lookup.
pub fn skipped_for_memory() -> u64 {
    SKIPPED_HERE.with(|c| c.get())
}

/// Whether the code address `addr` lies in an object the dynamic loader knows (the program,
/// a library, the vDSO), not in code generated at run time (a JIT's traces). A lookup of
/// the loader's list (it takes the loader's lock; it does not allocate).
pub fn in_loaded_object(addr: u64) -> bool {
    linux::in_loaded_object(addr)
}

/// Whether `bytes` more of address space can be had now (always, under no address-space
/// limit): for work that allocates a lot where a failure would abort.
pub(crate) fn address_space_room(bytes: usize) -> bool {
    linux::address_space_room(bytes)
}

/// Address space taken now, under an address-space limit (`ulimit -v`), to be given back
/// when the code it was taken for finds too little left: room kept for a report at the
/// limit (a program whose heap took everything), which the heap would otherwise have eaten
/// too. Never taken without a limit. Taken and given back whole.
pub struct RoomAside(std::sync::Mutex<(usize, usize)>);

impl RoomAside {
    /// Holding nothing.
    pub const fn new() -> RoomAside {
        RoomAside(std::sync::Mutex::new((0, 0)))
    }

    /// Under an address-space limit, takes `bytes` of address space (no memory: a mapping
    /// nothing may touch), unless it holds some already. Whether it took it (never without
    /// a limit, or when there is no room now, or when it holds some already).
    pub fn take(&self, bytes: usize) -> bool {
        let mut a = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if a.0 != 0 {
            return false;
        }
        match linux::take_room(bytes) {
            Some(p) => {
                *a = (p, bytes);
                true
            }
            None => false,
        }
    }

    /// Gives back what it holds; whether it held any.
    pub fn give_back(&self) -> bool {
        let mut a = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Self::release(&mut a)
    }

    /// [`RoomAside::give_back`] without waiting: nothing when another thread is taking or
    /// giving back the room just now. For an allocator's refusal, which must not block on
    /// a lock a thread could hold while it allocates.
    pub(crate) fn try_give_back(&self) -> bool {
        let mut a = match self.0.try_lock() {
            Ok(a) => a,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        Self::release(&mut a)
    }

    /// Unmaps the room `held` (start, length) describes and empties it; whether it held any.
    fn release(held: &mut (usize, usize)) -> bool {
        let (p, n) = std::mem::take(held);
        if p == 0 {
            return false;
        }
        linux::give_back(p, n);
        true
    }
}

/// The process's allocator's last resort, when its emergency reserve is spent and a small
/// allocation would abort the process: gives back the symbolizer's room (see
/// [`set_aside_room`]) — room kept so that a report can name its frames is no use to a
/// process that aborts. Whether it gave back any.
pub(crate) fn give_back_room_to_the_allocator() -> bool {
    ASIDE.try_give_back()
}

impl Default for RoomAside {
    fn default() -> RoomAside {
        RoomAside::new()
    }
}

/// Address space taken for the symbolizer by [`set_aside_room`].
static ASIDE: RoomAside = RoomAside::new();

/// Under an address-space limit (`ulimit -v`), takes `image_bytes` (the size of the image
/// files a report will read, the program's own at least) and what a parse wants besides of
/// address space now, and gives it back the first time a lookup finds too little left: the
/// first report at the limit (a program whose heap took everything: a `SIGQUIT` dump, a
/// crash report) can then open the program's file and parse its debug information, where
/// it left every native frame unnamed. Whether it was taken (never without a limit, or
/// when there is no room now, or when taken already).
pub fn set_aside_room(image_bytes: u64) -> bool {
    // (Room to open the file, then to parse with what opening it took besides.)
    let want = (4 * PARSE_ROOM as u64).saturating_add(image_bytes);
    usize::try_from(want).is_ok_and(|want| ASIDE.take(want))
}

/// File descriptors held for the symbolizer by [`set_aside_descriptors`] (of `/dev/null`).
static SPARE_FDS: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// How many descriptors [`set_aside_descriptors`] asked to hold (0: none).
static SPARE_WANTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Holds `n` file descriptors (of `/dev/null`) for the symbolizer: when a report finds the
/// process out of descriptors (`ulimit -n` reached — a descriptor leak, the moment a dump
/// is asked for), opening an image's file fails and every native frame of the report is
/// unnamed (`?? (program+0x…)`); the symbolizer then closes the ones it holds, opens the
/// file (and its debug information: each is mapped, its descriptor closed at once), and
/// takes them again. Three are enough (the file, its debug information, a detached debug
/// file, opened one after the other). None are taken under a limit below 64 open files (they
/// would be a share of it the program may miss). Returns how many are held.
pub fn set_aside_descriptors(n: usize) -> usize {
    let n = if linux::open_files_limit().is_some_and(|l| l < 64) {
        0
    } else {
        n
    };
    SPARE_WANTED.store(n, std::sync::atomic::Ordering::Relaxed);
    retake_descriptors()
}

/// Takes again the descriptors [`set_aside_descriptors`] asked for (those it can); how many
/// are held.
fn retake_descriptors() -> usize {
    let want = SPARE_WANTED.load(std::sync::atomic::Ordering::Relaxed);
    let mut held = SPARE_FDS.lock().unwrap_or_else(|e| e.into_inner());
    while held.len() < want {
        if held.try_reserve(1).is_err() {
            break;
        }
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(_) => break,
        }
    }
    held.len()
}

/// Closes the descriptors held for the symbolizer; whether there were any.
fn give_back_descriptors() -> bool {
    let mut held = SPARE_FDS.lock().unwrap_or_else(|e| e.into_inner());
    let had = !held.is_empty();
    held.clear();
    had
}

/// Gives back what [`set_aside_room`] took, if it still holds it.
fn give_back_room() -> bool {
    ASIDE.give_back()
}

/// Whether there is room to parse (or open, `extra` being the file's size) now (giving back
/// the room set aside for it, when it needs it); counts a lookup that is left unresolved
/// when not.
fn room_to_parse(extra: u64) -> bool {
    let want = (PARSE_ROOM as u64).saturating_add(extra);
    let want = usize::try_from(want).unwrap_or(usize::MAX);
    if linux::address_space_room(want) || (give_back_room() && linux::address_space_room(want)) {
        if SKIPPED_PENDING.swap(false, std::sync::atomic::Ordering::AcqRel) {
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Release);
        }
        return true;
    }
    SKIPPED_HERE.with(|c| c.set(c.get() + 1));
    SKIPPED_PENDING.store(true, std::sync::atomic::Ordering::Release);
    false
}

/// The resolution of `addr` to `tier`, and whether it lasts (false: its image's file, or
/// its DWARF, could not be read for the moment, see `open_for` and `load_dwarf`, or there
/// was no room to parse).
/// The resolution of `addr`, whether it lasts (may be cached), and the cache generation it
/// was made in.
fn resolve_uncached(r: &Resolver, addr: u64, tier: Tier) -> (Resolved, bool, u64) {
    // Libraries loaded or unloaded since the snapshot: a new one (one call into the loader
    // when nothing changed), and if an image of the last one is gone, the names cached for
    // addresses in it are forgotten (another library may be there now).
    let table = image::refresh();
    forget_if_images_gone();
    let generation = cache_generation();
    let img = table.image_of(addr).cloned();
    let mut out = Resolved {
        lookup_address: addr,
        ..Resolved::default()
    };
    let mut lasting = true;
    if let Some(img) = &img {
        out.image = Some(ImageRef {
            path: img.path.clone(),
            base: img.base,
            build_id: img.build_id_hex(),
        });
        let slot = {
            let mut e = r
                .files
                .entry(img.start)
                .or_insert_with(|| FileSlot::new(img));
            if !e.is_for(img) {
                *e = FileSlot::new(img);
            }
            Arc::clone(&e)
        };
        let mut st = slot.state.lock().unwrap_or_else(|e| e.into_inner());
        let size = || std::fs::metadata(&img.path).map_or(0, |m| m.len());
        if matches!(*st, FileState::Unopened) && room_to_parse(size()) {
            *st = open_for(img);
        }
        lasting = !matches!(*st, FileState::Unopened);
        if let FileState::Open(elf) = &*st {
            let svma = addr.wrapping_sub(img.base);
            // The DWARF, when this lookup needs it and it is not loaded: the loader maps the
            // file again and parses, as opening it did.
            let l = match tier {
                // (No parse: the table read at open, a binary search.)
                Tier::Outer if !elf.outer_falls_back(svma) => Some(elf.lookup_table(svma)),
                _ => None,
            };
            let l = l.or_else(|| {
                let dwarf = elf.dwarf_loaded()
                    || (room_to_parse(elf.dwarf_file_bytes()) && load_dwarf(elf));
                (dwarf && room_to_parse(0)).then(|| match tier {
                    Tier::Full => elf.lookup(svma),
                    Tier::Outer => elf.lookup_outer(svma),
                })
            });
            let l = l.unwrap_or_else(|| {
                // Not now (not cached: the next lookup tries again): the symbol table's
                // name at least.
                Lookup {
                    partial: true,
                    ..elf.lookup_table(svma)
                }
            });
            lasting = !l.partial;
            out.symbols = l.symbols;
            out.function_start = l.function_start.map(|s| s.wrapping_add(img.base));
        }
    }
    if out.function().is_none() {
        if let Some((name, start)) = linux::dladdr_name(addr) {
            let name = addr2line::demangle_auto(name.into(), None).into_owned();
            match out.symbols.last_mut() {
                Some(s) => s.name = Some(name),
                None => out.symbols.push(Symbol {
                    name: Some(name),
                    ..Symbol::default()
                }),
            }
            out.function_start = Some(start);
        }
    }
    (out, lasting, generation)
}

/// Loads `elf`'s DWARF (see [`with_spare_descriptors`]); whether it is loaded (false: not
/// for the moment).
fn load_dwarf(elf: &ElfSymbols) -> bool {
    with_spare_descriptors(|| elf.load_dwarf()).is_ok()
}

/// `open` (an opening of files), tried again with the descriptors held for the symbolizer
/// when the process was out of them (see [`set_aside_descriptors`]), which are taken again
/// after.
fn with_spare_descriptors<T>(open: impl Fn() -> Result<T, OpenError>) -> Result<T, OpenError> {
    match open() {
        Err(e) if e.out_of_descriptors() && give_back_descriptors() => {
            let r = open();
            retake_descriptors();
            r
        }
        r => r,
    }
}

fn open_for(img: &Image) -> FileState {
    if img.path.is_empty() || img.path.starts_with('[') {
        return FileState::Unusable;
    }
    match with_spare_descriptors(|| ElfSymbols::open(&img.path)) {
        Ok(elf) => {
            if img.build_id.is_some() && elf.build_id() != img.build_id.as_deref() {
                // The file on disk is not what is mapped.
                FileState::Unusable
            } else {
                FileState::Open(Box::new(elf))
            }
        }
        // Out of descriptors or memory for now: tried again at the next lookup (kept as
        // unusable, every later trace of the process lost its names).
        Err(e) if e.transient => FileState::Unopened,
        Err(_) => FileState::Unusable,
    }
}

/// The loaded images, for printing module-relative addresses or symbolizing offline.
pub fn images() -> Vec<Arc<Image>> {
    image::refresh().images().to_vec()
}
