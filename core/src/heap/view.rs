//! Views of the live heap: the allocations, grouped by stack, as text and as lws `~m#` lines.
//!
//! Stacks are recorded from inside the allocation machinery; [`group`] resolves them and
//! drops the leading frames whose every function level is that machinery (`__rust_alloc`,
//! `alloc::`, `core::`, `std::`, `hashbrown::`, the tracker), so a group starts at the code
//! that asked for memory. A stack that is all machinery keeps its frames. In a fiber's stack
//! the frames outward of the runtime's trampoline (registered with [`add_fiber_trampoline`]:
//! the fiber body, the coroutine library's stack start) are dropped too, as a fiber's trace
//! ends at its entry.
//!
//! How a group can be wrong: frames the symbolizer could not name (no symbols, or too little
//! address space to read them) are never dropped, so two stacks that differ only there show
//! as two groups.

use super::{every, owner, sample, Tier};
use crate::codec::lws::{LwsTrace, M_LEAD};
use crate::frame::Frame;
use std::collections::HashMap;
use std::fmt::Write as _;

/// Decoded every-tier blobs, by their bytes: a program's allocations come from few distinct
/// stacks (and sizes), and a blob decodes bit by bit, so a listing of 200,000 allocations
/// made in one loop decodes a handful (a direct-mapped table: a slot holds the last blob that
/// hashed to it, a miss decodes and replaces it).
struct DecodeMemo {
    slots: Vec<Option<(Box<[u8]>, LwsTrace)>>,
}

impl Default for DecodeMemo {
    fn default() -> DecodeMemo {
        DecodeMemo {
            slots: vec![None; DecodeMemo::SLOTS],
        }
    }
}

impl DecodeMemo {
    const SLOTS: usize = 256;

    /// `blob` decoded (`None`: it does not decode).
    fn decode(&mut self, blob: &[u8]) -> Option<&LwsTrace> {
        use std::hash::Hasher as _;
        let mut h = crate::symbolize::AddrHasher::default();
        h.write(blob);
        let i = (h.finish() as usize) % Self::SLOTS;
        let hit = matches!(&self.slots[i], Some((b, _)) if **b == *blob);
        if !hit {
            let t = LwsTrace::decode(blob).ok()?;
            self.slots[i] = Some((blob.into(), t));
        }
        self.slots[i].as_ref().map(|(_, t)| t)
    }
}

/// One live allocation (every tier) or sample (sampled tier).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LiveAlloc {
    /// The pointer handed out.
    pub ptr: usize,
    /// Its size.
    pub size: usize,
    /// The fiber it is charged to (`None`: outside fibers).
    pub fiber: Option<u64>,
    /// Whether that fiber has ended.
    pub exited: bool,
    /// Return addresses of its allocation stack, innermost first (machinery included).
    pub addrs: Vec<u64>,
    /// Bytes it stands for (its size in the every tier; the estimate in the sampled one).
    pub bytes: i64,
    /// Allocations it stands for (1 in the every tier).
    pub objects: i64,
    /// The lws blob with its length (every tier: as stored in front of the allocation;
    /// sampled: encoded from the sample).
    #[serde(skip)]
    pub blob: Vec<u8>,
}

/// The live allocations (every tier) or samples (sampled tier), newest first in the every
/// tier. Empty when no tier is active.
pub fn live() -> Vec<LiveAlloc> {
    // Paused throughout: the list is walked under its lock, and a tracked block freed or
    // grown meanwhile (this very vector's) would take that lock again.
    let _busy = super::pause();
    let mut raw: Vec<(usize, Vec<u8>, u32)> = Vec::new();
    let mut out = Vec::new();
    match super::tier() {
        Tier::Every => {
            raw.reserve(every::count() + 64);
            every::for_each(|p, blob, slot| raw.push((p, blob.to_vec(), slot)));
            let mut memo = DecodeMemo::default();
            for (ptr, blob, slot) in raw {
                let Some(t) = memo.decode(&blob) else {
                    continue;
                };
                let (fiber, exited) = owner::fiber_of(slot);
                out.push(LiveAlloc {
                    ptr,
                    size: t.size as usize,
                    fiber,
                    exited,
                    addrs: t.addrs.clone(),
                    bytes: t.size as i64,
                    objects: 1,
                    blob,
                });
            }
        }
        Tier::Sampled => {
            for (ptr, s) in sample::samples() {
                let addrs = s.frames[..usize::from(s.depth)].to_vec();
                let blob = LwsTrace {
                    size: s.size as u64,
                    addrs: addrs.clone(),
                }
                .encode()
                .unwrap_or_default();
                let (fiber, exited) = owner::fiber_of(s.slot);
                out.push(LiveAlloc {
                    ptr,
                    size: s.size,
                    fiber,
                    exited,
                    addrs,
                    bytes: s.bytes,
                    objects: s.objects,
                    blob,
                });
            }
        }
        Tier::Off => {}
    }
    out
}

/// Writes one lws `~m#` line per live allocation (the every tier's stored blobs, which lws's
/// decoder reads; in the sampled tier one per sample). Returns how many. See [`m_lines`].
pub fn write_m_lines(w: &mut dyn std::io::Write) -> std::io::Result<usize> {
    let (text, n) = m_lines()?;
    w.write_all(&text)?;
    Ok(n)
}

/// [`write_m_lines`]'s text, and how many lines it holds.
///
/// The lines are written straight from the live list into one buffer, sized by a first walk
/// that only adds up the blobs' lengths: no list of the allocations is made first (it took
/// several hundred bytes per allocation, a listing of 270,000 of them over 150 MB, which at
/// an address-space limit ran the process out of memory midway and aborted it). Under a
/// limit, when there is no room for twice the text (it and the caller's copy, a Lua string),
/// or when the buffer cannot grow as the list grows meanwhile, an error
/// ([`std::io::ErrorKind::OutOfMemory`]: "not enough memory to list N live allocations"),
/// never an abort.
pub fn m_lines() -> std::io::Result<(Vec<u8>, usize)> {
    use crate::codec::base64;
    let _busy = super::pause();
    let line_len = |blob: usize| M_LEAD.len() + base64::encoded_len(blob) + 1;
    let tier = super::tier();
    let samples = if tier == Tier::Sampled {
        sample::samples()
    } else {
        Vec::new()
    };
    let (n, total) = match tier {
        Tier::Every => {
            let (mut n, mut total) = (0usize, 0usize);
            every::for_each(|_, blob, _| {
                n += 1;
                total = total.saturating_add(line_len(blob.len()));
            });
            (n, total)
        }
        // (A sample's blob is at most lws's largest.)
        Tier::Sampled => (
            samples.len(),
            samples
                .len()
                .saturating_mul(line_len(crate::codec::lws::MAX_BLOB)),
        ),
        Tier::Off => (0, 0),
    };
    let refused = |n: usize| {
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("not enough memory to list {n} live allocations"),
        )
    };
    if !crate::symbolize::address_space_room(total.saturating_mul(2).saturating_add(1 << 20)) {
        return Err(refused(n));
    }
    let mut out: Vec<u8> = Vec::new();
    out.try_reserve_exact(total).map_err(|_| refused(n))?;
    let mut lines = 0usize;
    let mut short = false;
    let mut push = |blob: &[u8]| {
        if short || out.try_reserve(line_len(blob.len())).is_err() {
            short = true;
            return;
        }
        out.extend_from_slice(M_LEAD.as_bytes());
        base64::encode_into(blob, &mut out);
        out.push(b'\n');
        lines += 1;
    };
    match tier {
        Tier::Every => {
            // Only the blobs that decode, as [`live`] lists them.
            let mut memo = DecodeMemo::default();
            every::for_each(|_, blob, _| {
                if memo.decode(blob).is_some() {
                    push(blob);
                }
            });
        }
        Tier::Sampled => {
            for (_, s) in &samples {
                let trace = LwsTrace {
                    size: s.size as u64,
                    addrs: s.frames[..usize::from(s.depth)].to_vec(),
                };
                if let Ok(blob) = trace.encode() {
                    push(&blob);
                }
            }
        }
        Tier::Off => {}
    }
    if short {
        return Err(refused(lines.max(n)));
    }
    Ok((out, lines))
}

/// A fiber's share of a [`Group`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Share {
    /// The fiber (`None`: outside fibers).
    pub fiber: Option<u64>,
    /// Whether it has ended.
    pub exited: bool,
    /// Bytes.
    pub bytes: i64,
    /// Allocations.
    pub objects: i64,
}

/// Live allocations that share a stack.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Group {
    /// The stack from the code that asked for memory outward ([`super::frames_of`]: return
    /// addresses, a host's Lua frames, a last [`Frame::Truncated`] when it was cut short).
    pub frames: Vec<Frame>,
    /// Bytes.
    pub bytes: i64,
    /// Allocations.
    pub objects: i64,
    /// Per fiber, most bytes first.
    pub fibers: Vec<Share>,
}

/// Whether a function name belongs to the allocation machinery.
fn machinery(name: &str) -> bool {
    const PREFIXES: [&str; 17] = [
        "__rust_",
        "__rustc::",
        "__rg_",
        "__rdl_",
        "fibertrace_core::heap",
        "<fibertrace_core::heap",
        "alloc::",
        "<alloc::",
        "core::",
        "<core::",
        "std::",
        "<std::",
        "hashbrown::",
        "<hashbrown::",
        "malloc",
        "realloc",
        "calloc",
    ];
    // An impl of one of `alloc`'s own traits for any type (`<u8 as
    // alloc::vec::spec_from_elem::SpecFromElem>::from_elem`) is the library's too.
    PREFIXES.iter().any(|p| name.starts_with(p))
        || (name.starts_with('<')
            && (name.contains(" as alloc::") || name.contains(" as hashbrown::")))
}

/// How many leading frames of a recorded stack are the allocation machinery (every function
/// level of each named `__rust_alloc`, `alloc::…`, `core::…`, `std::…`, `hashbrown::…`, the
/// tracker's own). 0 when the whole stack is machinery. The views drop these and a fiber's
/// start-up frames: see [`own_frames`].
pub fn machinery_frames(addrs: &[u64]) -> usize {
    machinery_prefix(addrs)
}

/// The frames of a recorded stack the views show: without its leading allocation machinery
/// ([`machinery_frames`]) and, in a fiber's stack, without the runtime's start-up frames
/// outward of the fiber's trampoline ([`add_fiber_trampoline`]), as a fiber's trace ends
/// there. The trampoline's own frame goes too unless the fiber's code was inlined into it
/// (a level of it that is neither the trampoline nor a `call_once` shim). A stack cut short
/// before its trampoline keeps its outer frames.
pub fn own_frames(addrs: &[u64]) -> std::ops::Range<usize> {
    let start = machinery_prefix(addrs);
    let tramps = trampolines();
    if tramps.is_empty() {
        return start..addrs.len();
    }
    let is_tramp = |n: &str| tramps.iter().any(|p| n.starts_with(p));
    for (i, &a) in addrs.iter().enumerate().skip(start) {
        let Some(r) = native(a)
            .then(|| crate::symbolize::resolve(&Frame::Ra(a)))
            .flatten()
        else {
            continue;
        };
        let names = || r.symbols.iter().filter_map(|s| s.name.as_deref());
        if !names().any(is_tramp) {
            continue;
        }
        let only_runtime = names().all(|n| is_tramp(n) || n.ends_with("::call_once"));
        let end = if only_runtime { i } else { i + 1 };
        // Something of the fiber's own is left.
        return if end > start {
            start..end
        } else {
            start..addrs.len()
        };
    }
    start..addrs.len()
}

/// Function-name prefixes of the fiber runtimes' trampolines ([`add_fiber_trampoline`]).
static TRAMPOLINES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// Registers `prefix` as the function-name prefix of a fiber runtime's trampoline: the
/// outermost frame of every fiber's own code, whose callers are the runtime's start-up code
/// (its fiber body, a panic catch, the coroutine library's stack start). The heap views cut
/// a fiber's allocation stacks there ([`own_frames`]). Registering a prefix twice is
/// harmless.
pub fn add_fiber_trampoline(prefix: &'static str) {
    let mut v = TRAMPOLINES.lock().unwrap_or_else(|e| e.into_inner());
    if !v.contains(&prefix) {
        v.push(prefix);
    }
}

fn trampolines() -> Vec<&'static str> {
    TRAMPOLINES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// Whether the frame returning to `a` is named and every function level of it is one `is`
/// accepts.
fn all_named(a: u64, is: &dyn Fn(&str) -> bool) -> bool {
    if !native(a) {
        return false;
    }
    let r = crate::symbolize::resolve(&Frame::Ra(a));
    r.as_ref().is_some_and(|r| {
        !r.symbols.is_empty() && r.symbols.iter().all(|s| s.name.as_deref().is_some_and(is))
    })
}

/// Whether a recorded entry is a native return address (not a host's tagged Lua frame nor
/// the truncation mark: no user-space address has their high bits).
fn native(a: u64) -> bool {
    a >> 48 == 0
}

/// Leading frames of `addrs` that are all machinery.
fn machinery_prefix(addrs: &[u64]) -> usize {
    let n = addrs
        .iter()
        .take_while(|&&a| all_named(a, &machinery))
        .count();
    if n == addrs.len() {
        0
    } else {
        n
    }
}

/// Groups allocations by stack (machinery frames dropped), most bytes first.
pub fn group(allocs: &[LiveAlloc]) -> Vec<Group> {
    let mut g = Grouper::default();
    for a in allocs {
        g.add(&a.addrs, a.fiber, a.exited, a.bytes, a.objects);
    }
    g.finish()
}

/// One live allocation (every tier) or sample (sampled tier) as [`for_each_live`] shows it.
#[derive(Clone, Copy, Debug)]
pub struct LiveRef<'a> {
    /// The pointer handed out.
    pub ptr: usize,
    /// Its size.
    pub size: usize,
    /// The fiber it is charged to (`None`: outside fibers).
    pub fiber: Option<u64>,
    /// Whether that fiber has ended.
    pub exited: bool,
    /// Return addresses of its allocation stack, innermost first (machinery included).
    pub addrs: &'a [u64],
    /// Bytes it stands for (see [`LiveAlloc::bytes`]).
    pub bytes: i64,
    /// Allocations it stands for (1 in the every tier).
    pub objects: i64,
}

/// Calls `f` for each live allocation (each sample, in the sampled tier), read one at a time
/// from the every tier's list: what [`live`] lists, without a list of every allocation (a
/// report of hundreds of thousands of them at exit under a memory limit has room for what
/// it sums alone; the sampled tier's table, small, is copied first). Nothing when no tier
/// is active. `f` runs with tracking paused and, in the every tier, the list's lock held
/// (every other thread's tracked allocation waits): it should only sum, and it may allocate
/// (untracked) but must not free a block allocated tracked before the call — a collection
/// made before it must not grow inside it (the free would take the lock again): start with
/// an empty one, which allocates inside.
pub fn for_each_live(mut f: impl FnMut(&LiveRef)) {
    // Paused throughout, as `live`: the walk holds the list's lock.
    let _busy = super::pause();
    match super::tier() {
        Tier::Every => {
            let mut memo = DecodeMemo::default();
            every::for_each(|ptr, blob, slot| {
                let Some(t) = memo.decode(blob) else {
                    return;
                };
                let (fiber, exited) = owner::fiber_of(slot);
                f(&LiveRef {
                    ptr,
                    size: t.size as usize,
                    fiber,
                    exited,
                    addrs: &t.addrs,
                    bytes: t.size as i64,
                    objects: 1,
                });
            })
        }
        Tier::Sampled => {
            for (ptr, s) in sample::samples() {
                let (fiber, exited) = owner::fiber_of(s.slot);
                f(&LiveRef {
                    ptr,
                    size: s.size,
                    fiber,
                    exited,
                    addrs: &s.frames[..usize::from(s.depth)],
                    bytes: s.bytes,
                    objects: s.objects,
                });
            }
        }
        Tier::Off => {}
    }
}

/// What [`group_live`] gives: the groups, and what its filter left out.
#[derive(Debug, Default)]
pub struct Grouped {
    /// The allocations kept, grouped as [`group`] groups them.
    pub groups: Vec<Group>,
    /// Allocations the filter left out.
    pub left_out: i64,
    /// Their bytes.
    pub left_out_bytes: i64,
}

/// [`group`] of the live allocations (samples, in the sampled tier) that `keep` accepts, read
/// one at a time ([`for_each_live`]; summed per recorded stack under the lock, resolved and
/// trimmed after it): memory for the distinct stacks only. `left_out` counts allocations (in
/// the sampled tier, the estimated allocations the samples stand for).
pub fn group_live(mut keep: impl FnMut(&LiveRef) -> bool) -> Grouped {
    let mut g = Grouper::default();
    let mut out = Grouped::default();
    for_each_live(|r| {
        if keep(r) {
            g.add(r.addrs, r.fiber, r.exited, r.bytes, r.objects);
        } else {
            out.left_out += r.objects;
            out.left_out_bytes += r.bytes;
        }
    });
    out.groups = g.finish();
    out
}

/// Bytes and allocations per (fiber, exited).
type PerFiber = HashMap<(Option<u64>, bool), (i64, i64)>;

/// Allocations summed per recorded stack as they come (nothing resolved: the sums may be
/// made under the tracker's lock), then per stack with the machinery and a fiber's start-up
/// frames dropped ([`own_frames`]).
#[derive(Default)]
struct Grouper {
    by: HashMap<Vec<u64>, (i64, i64, PerFiber)>,
}

impl Grouper {
    fn add(&mut self, addrs: &[u64], fiber: Option<u64>, exited: bool, bytes: i64, objects: i64) {
        let e = match self.by.get_mut(addrs) {
            Some(e) => e,
            None => self.by.entry(addrs.to_vec()).or_default(),
        };
        e.0 += bytes;
        e.1 += objects;
        let f = e.2.entry((fiber, exited)).or_default();
        f.0 += bytes;
        f.1 += objects;
    }

    /// The groups, machinery frames dropped (each distinct stack resolved once), most bytes
    /// first.
    fn finish(self) -> Vec<Group> {
        let mut trimmed: HashMap<Vec<u64>, (i64, i64, PerFiber)> = HashMap::new();
        for (addrs, (bytes, objects, fibers)) in self.by {
            let own = addrs[own_frames(&addrs)].to_vec();
            let e = trimmed.entry(own).or_default();
            e.0 += bytes;
            e.1 += objects;
            for (who, (b, o)) in fibers {
                let f = e.2.entry(who).or_default();
                f.0 += b;
                f.1 += o;
            }
        }
        let mut out: Vec<Group> = trimmed
            .into_iter()
            .map(|(addrs, (bytes, objects, fibers))| {
                let mut fibers: Vec<Share> = fibers
                    .into_iter()
                    .map(|((fiber, exited), (bytes, objects))| Share {
                        fiber,
                        exited,
                        bytes,
                        objects,
                    })
                    .collect();
                fibers.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.fiber.cmp(&b.fiber)));
                Group {
                    frames: super::frames_of(&addrs),
                    bytes,
                    objects,
                    fibers,
                }
            })
            .collect();
        out.sort_by(|a, b| {
            b.bytes.cmp(&a.bytes).then_with(|| {
                a.frames
                    .iter()
                    .map(Frame::address)
                    .cmp(b.frames.iter().map(Frame::address))
            })
        });
        out
    }
}

/// Bytes for people: `512 B`, `1.5 KiB`, `12.0 MiB`.
pub fn human_bytes(b: i64) -> String {
    let a = b.unsigned_abs() as f64;
    let sign = if b < 0 { "-" } else { "" };
    if a < 1024.0 {
        format!("{b} B")
    } else if a < 1024.0 * 1024.0 {
        format!("{sign}{:.1} KiB", a / 1024.0)
    } else if a < 1024.0 * 1024.0 * 1024.0 {
        format!("{sign}{:.1} MiB", a / (1024.0 * 1024.0))
    } else {
        format!("{sign}{:.1} GiB", a / (1024.0 * 1024.0 * 1024.0))
    }
}

/// Who a share belongs to, in words: `fiber 3 "worker"` (the name as `name` gives it),
/// `exited fiber 7`, `threads`.
pub fn share_name(
    fiber: Option<u64>,
    exited: bool,
    name: &dyn Fn(u64) -> Option<String>,
) -> String {
    match fiber {
        None => "outside fibers".to_string(),
        Some(f) if exited => format!("held by exited fiber {f}"),
        Some(f) => match name(f) {
            Some(n) => format!("fiber {f} {n}"),
            None => format!("fiber {f}"),
        },
    }
}

/// The `top` groups with most bytes as text: a header line, then per group its figures, its
/// fibers and its frames (resolved). `name` gives a live fiber's name as the text shows it
/// (quoted, with escapes: the runtime's own form). `opts` formats frames
/// (Lua namer, glue filter).
pub fn render_groups(
    groups: &[Group],
    top: usize,
    name: &dyn Fn(u64) -> Option<String>,
    opts: &crate::format::TextOptions<'_>,
) -> String {
    let (bytes, objects) = groups
        .iter()
        .fold((0i64, 0i64), |(b, o), g| (b + g.bytes, o + g.objects));
    let estimate = if super::tier() == Tier::Sampled {
        " (estimated from samples)"
    } else {
        ""
    };
    let mut out = format!(
        "heap: {} live in {objects} allocations{estimate}, {} stacks; top {} by bytes:\n",
        human_bytes(bytes),
        groups.len(),
        top.min(groups.len())
    );
    for (i, g) in groups.iter().take(top).enumerate() {
        let who: Vec<String> = g
            .fibers
            .iter()
            .map(|s| {
                format!(
                    "{}: {} in {}",
                    share_name(s.fiber, s.exited, name),
                    human_bytes(s.bytes),
                    s.objects
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "\n[{}] {} in {} allocations — {}",
            i + 1,
            human_bytes(g.bytes),
            g.objects,
            who.join(", ")
        );
        out.push_str(&crate::format::text(&g.frames, opts));
    }
    out
}
