//! Another process's fibers, read from the outside (`fibertrace dump PID`): its threads
//! through [`fibertrace_core::remote`], and, when it uses this runtime, every fiber of every
//! scheduler through the registry it publishes (`crate::publish`'s header, found in its
//! `.fibertrace.registry` section) — id, name, status, what it waits on and since when, its
//! creator, and each suspended fiber's stack walked from its saved registers.
//!
//! The registry's meanings are version 1's (see `crate::publish`); a process with another
//! version is read for its threads only, and the dump says why its fibers are not there.
//!
//! A running fiber's stack is its thread's: walked from the thread's registers (a held
//! thread's, or a core file's) down to the fiber's entry, its layer's frames merged in where
//! the layer can read them while its code runs ([`ForeignLayer::running_frames`]: the Lua
//! host's, when the fiber runs C code that Lua called — a blocking system call, a C
//! library — not while LuaJIT's interpreter or a trace runs). A walk that reaches the
//! layer's code that has no unwind record (a Lua host's compiled traces) goes on below it
//! from where the layer's runtime entered that code ([`ForeignLayer::below_unwound`]), for
//! the fiber and for its thread's section alike.
//!
//! How a result can be wrong: in the consistent mode (every thread stopped) a fiber caught
//! in the middle of a switch reads as running (its thread's stack shows it, as its
//! thread's stack pointer is not in the fiber's stack). Without
//! stopping (`Mode::NonBlocking`) a fiber that switches while it is read is dropped from the
//! walk (its switch count or state moved: the dump says so), and the others may be of
//! slightly different moments. A fiber that a layer above the runtime runs (the Lua host:
//! its control block carries the layer's word) gets the layer's frames merged in by a
//! [`ForeignLayer`] when the caller gives one ([`dump_with`]); without one, its native frames
//! are shown and a note says so.

use std::time::Duration;

use fibertrace_core::format::ResolvedFrame;
use fibertrace_core::remote::{DumpError, DumpOptions, Mode, ProcessDump, Session};
use fibertrace_core::symbolize::Resolved;
use fibertrace_core::{arch::Registers, Frame};
use serde::{Deserialize, Serialize};

use crate::publish::{Header, MAGIC, VERSION};
use crate::task::{FiberId, RunState, Status, WaitOn};

/// One fiber of another process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ForeignFiber {
    /// Its id.
    pub id: FiberId,
    /// Its name.
    pub name: String,
    /// Its status.
    pub status: Status,
    /// What it waits on, in words (`channel receive`, `join fiber 3`), when it waits.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub waiting: Option<String>,
    /// What it waits on (the object), when it waits.
    #[serde(skip)]
    pub wait_on: Option<WaitOn>,
    /// For how long it has been in its status, seconds (`None`: the clock was not known).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub status_seconds: Option<f64>,
    /// Its creator's fiber id.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub parent: Option<FiberId>,
    /// Switches so far.
    pub csw: u64,
    /// Its frames, innermost first, named from the target's files.
    pub frames: Vec<ResolvedFrame>,
    /// What the frames could not show, and why.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub note: Option<String>,
}

/// One scheduler of another process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ForeignScheduler {
    /// Its id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// The kernel id of the thread it runs on.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub thread: Option<i32>,
    /// The fiber it was running.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub running: Option<FiberId>,
    /// Its fibers, by id.
    pub fibers: Vec<ForeignFiber>,
    /// Fibers that could not be read, and why.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub note: Option<String>,
}

/// Every thread and every fiber of another process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ForeignDump {
    /// Its threads (and the process); in JSON, its fields are the dump's own.
    #[serde(flatten)]
    pub process: ProcessDump,
    /// Its schedulers and their fibers (empty when it has no registry).
    pub schedulers: Vec<ForeignScheduler>,
    /// Why its fibers are missing, or what of them is (no registry, another version, a
    /// table that was full).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub note: Option<String>,
}

/// A layer above the runtime (the Lua host) that reads its own frames of another process's
/// fibers: the fibers whose control block carries a layer word.
pub trait ForeignLayer {
    /// Finds what the layer published in the target, once, while the target is held and
    /// before any fiber is read. `Err`: why none of its frames can be read (each such fiber's
    /// note says it).
    fn open(&mut self, s: &mut Session) -> Result<(), String>;
    /// A suspended fiber's frames with the layer's merged in, from its native frames
    /// (innermost first, the runtime's suspend wrapper already left out) and its layer word;
    /// with a note of what could not be read.
    fn frames(
        &mut self,
        s: &mut Session,
        word: u64,
        native: Vec<Frame>,
    ) -> (Vec<Frame>, Option<String>);
    /// The running fiber's frames with the layer's merged in, from its native frames (its
    /// thread's, innermost first, down to its entry), when they can be read from outside:
    /// the layer says when its state is not current while its code runs (a Lua
    /// interpreter's, whose registers it may read from `thread`). `walk_note` is what the
    /// walk of the thread's frames said (why it stopped where it did): the note returned
    /// replaces it, so the layer keeps it, joins its own to it ([`join_notes`]), or leaves it
    /// out where its own says the same (the frames its code has no unwind record for). By
    /// default, its native frames with the walk's note and a note that the layer's frames
    /// are not read.
    fn running_frames(
        &mut self,
        _s: &mut Session,
        _word: u64,
        native: Vec<Frame>,
        _thread: i32,
        walk_note: Option<String>,
    ) -> (Vec<Frame>, Option<String>) {
        (
            native,
            join_notes(
                walk_note,
                Some("it runs: its layer's frames (Lua) are not read from outside".into()),
            ),
        )
    }
    /// Where the walk of a running fiber's thread goes on below the layer's own code that has
    /// no unwind record (a Lua host's compiled traces, which the walk cannot step out of: it
    /// stopped there, or went on from a frame pointer the code used for something else):
    /// the registers of the frame that entered that code (its return address as the
    /// instruction pointer, the stack pointer after the return, the frame pointer it saved),
    /// read from what the layer's runtime keeps of the code running now, and a note for the
    /// thread's frames saying so. `None` (the default): that code does not run there, or the
    /// entry cannot be read; the walk ends where it stopped.
    fn below_unwound(&mut self, _s: &mut Session, _word: u64) -> Option<(Registers, String)> {
        None
    }
    /// The frames of a running fiber whose thread is not held (a non-blocking dump), when
    /// the layer can read them from memory alone while its code runs and can tell they held
    /// still meanwhile; `None` (the default): it cannot.
    fn running_unheld(
        &mut self,
        _s: &mut Session,
        _word: u64,
    ) -> Option<(Vec<Frame>, Option<String>)> {
        None
    }
    /// What one of the layer's own frames (a [`Frame::Lua`]) stands for, for the views.
    fn resolve(&self, f: &Frame) -> Option<Resolved>;
    /// Reads ahead ([`Session::prefetch`]) what [`Self::frames`] will read for the fibers
    /// with these layer words (optional: a speed-up of the read while the target is held).
    fn prefetch(&mut self, _s: &mut Session, _words: &[u64]) {}
}

/// Reads every thread and fiber of process `pid` (see the module doc).
pub fn dump(pid: i32, opts: &DumpOptions) -> Result<ForeignDump, DumpError> {
    dump_with(pid, opts, None)
}

/// [`dump`], with a layer's frames merged into the fibers it runs.
pub fn dump_with(
    pid: i32,
    opts: &DumpOptions,
    layer: Option<&mut dyn ForeignLayer>,
) -> Result<ForeignDump, DumpError> {
    // This process's counter rate (the machine's), measured before the target is stopped
    // (the first measurement waits 2 ms).
    let own_ps = own_rate();
    from_session(Session::open(pid, opts)?, own_ps, true, layer)
}

/// Reads every thread and fiber of the process a core file holds (see
/// [`Session::open_core`]: `exe` stands for the executable it names, `root` is prefixed to
/// the other files' paths). Fibers have no status time (`status_seconds` is `None`): a core
/// file records no clock, so how long a fiber had been waiting when it was written is not
/// known (measured against the reader's clock, the time grew with every reading).
pub fn dump_core(
    core: &std::path::Path,
    exe: Option<&std::path::Path>,
    root: Option<&std::path::Path>,
    opts: &DumpOptions,
) -> Result<ForeignDump, DumpError> {
    dump_core_with(core, exe, root, opts, None)
}

/// [`dump_core`], with a layer's frames merged into the fibers it runs.
pub fn dump_core_with(
    core: &std::path::Path,
    exe: Option<&std::path::Path>,
    root: Option<&std::path::Path>,
    opts: &DumpOptions,
    layer: Option<&mut dyn ForeignLayer>,
) -> Result<ForeignDump, DumpError> {
    let own_ps = own_rate();
    from_session(
        Session::open_core(core, exe, root, opts)?,
        own_ps,
        false,
        layer,
    )
}

/// Picoseconds per counter tick, measured in this process.
fn own_rate() -> u64 {
    crate::clock::Rate::now().duration(1_000_000).as_nanos() as u64 / 1000
}

/// A dump from session `s`; `live`: the target runs now (its status times are measured
/// against this machine's counter now), else a core file (no status times).
fn from_session(
    mut s: Session,
    own_ps: u64,
    live: bool,
    mut layer: Option<&mut dyn ForeignLayer>,
) -> Result<ForeignDump, DumpError> {
    let threads = s.threads();
    let mut reader = match layer.as_deref_mut() {
        Some(l) => match l.open(&mut s) {
            Ok(()) => LayerState::Open(l),
            Err(why) => LayerState::Failed(why),
        },
        None => LayerState::Absent,
    };
    let registry = read_registry(&mut s, own_ps, live, &mut reader);
    // A thread whose running fiber's walk went on below the layer's code (see
    // `continue_below`) gets the same frames, walked to its own end (the threads are still
    // held).
    let mut threads = threads;
    if let Ok((raw, _)) = &registry {
        for (tid, below, why) in raw.iter().filter_map(|r| r.thread_below.clone()) {
            if let Some(t) = threads.iter_mut().find(|t| t.tid == tid) {
                let mut note = t.note.take();
                t.note = if continue_below(&mut s, &mut t.frames, &mut note, below, None) {
                    join_notes(Some(why), note)
                } else {
                    note
                };
            }
        }
    }
    s.resume();
    let process = s.finish(threads);
    let (schedulers, note) = match registry {
        Ok((raw, note)) => (
            raw.into_iter()
                .map(|r| ForeignScheduler {
                    note: missing_note(r.unreadable, r.lost_slots),
                    id: r.id,
                    name: r.name,
                    thread: r.thread,
                    running: r.running,
                    fibers: r
                        .fibers
                        .into_iter()
                        .map(|f| ForeignFiber {
                            frames: resolve_with(&s, &f.frames, layer.as_deref()),
                            id: f.id,
                            name: f.name,
                            status: f.status,
                            waiting: f.waiting,
                            wait_on: f.wait_on,
                            status_seconds: f.status_seconds,
                            parent: f.parent,
                            csw: f.csw,
                            note: f.note,
                        })
                        .collect(),
                })
                .collect(),
            note,
        ),
        Err(why) => (Vec::new(), Some(why)),
    };
    Ok(ForeignDump {
        process,
        schedulers,
        note,
    })
}

/// What a scheduler's fibers lack: control blocks or slab chunks that could not be read.
fn missing_note(unreadable: usize, lost_slots: usize) -> Option<String> {
    match (unreadable, lost_slots) {
        (0, 0) => None,
        (n, 0) => Some(format!(
            "{n} fibers could not be read (their control blocks)"
        )),
        (0, k) => Some(format!(
            "up to {k} fibers could not be read (a part of the fiber table)"
        )),
        (n, k) => Some(format!(
            "{n} fibers could not be read (their control blocks), and up to {k} more (a part \
             of the fiber table)"
        )),
    }
}

/// The layer as the fibers are read.
enum LayerState<'a> {
    /// None was given.
    Absent,
    /// It found what it needs.
    Open(&'a mut dyn ForeignLayer),
    /// It could not (why).
    Failed(String),
}

/// Names every frame: native ones from the target's files, the layer's through the layer.
fn resolve_with(
    s: &Session,
    frames: &[Frame],
    layer: Option<&dyn ForeignLayer>,
) -> Vec<ResolvedFrame> {
    let mut out = s.resolve_all(frames);
    if let Some(l) = layer {
        for rf in &mut out {
            if matches!(rf.frame, Frame::Lua(_)) {
                rf.resolved = l.resolve(&rf.frame);
            }
        }
    }
    out
}

struct RawScheduler {
    id: u64,
    name: String,
    thread: Option<i32>,
    running: Option<FiberId>,
    fibers: Vec<RawFiber>,
    /// Control blocks that could not be read.
    unreadable: usize,
    /// Slab chunks that could not be read (slots of fibers that may be missing).
    lost_slots: usize,
    /// Its thread, the registers its walk goes on from below the layer's code that has no
    /// unwind record, and the note saying so (its running fiber's: see `continue_below`).
    thread_below: Option<(i32, Registers, String)>,
}

/// Cuts `frames` after the first frame in code no image of the target has (code made at run
/// time: a Lua trace) and goes on from `below`, the registers of the frame that entered that
/// code ([`ForeignLayer::below_unwound`]), down to `stop` as the first walk; that walk's
/// note replaces `note`. Whatever the first walk found past that frame (if it went on at all,
/// it followed a frame pointer the code used for something else: a made-up caller) is
/// dropped. False, with nothing changed, when no frame is in such code.
fn continue_below(
    s: &mut Session,
    frames: &mut Vec<Frame>,
    note: &mut Option<String>,
    below: Registers,
    stop: Option<u64>,
) -> bool {
    let Some(k) = frames
        .iter()
        .position(|f| f.lookup_address().is_some_and(|a| !s.knows_code(a)))
    else {
        return false;
    };
    let (mut more, more_note) = s.walk(below, stop);
    // (Its first frame is a return address: named by the call before it.)
    match more.first().copied() {
        Some(Frame::Pc(a)) => more[0] = Frame::Ra(a),
        Some(_) => {}
        // Nothing walked: the frames stay as they were, the walk's note with them.
        None => return false,
    }
    frames.truncate(k + 1);
    frames.extend(more);
    *note = more_note;
    true
}

struct RawFiber {
    id: FiberId,
    name: String,
    status: Status,
    waiting: Option<String>,
    wait_on: Option<WaitOn>,
    status_seconds: Option<f64>,
    parent: Option<FiberId>,
    csw: u64,
    frames: Vec<Frame>,
    note: Option<String>,
    /// A running fiber whose walk went on below its layer's code: its thread's continuation
    /// (see `RawScheduler::thread_below`).
    below: Option<(i32, Registers, String)>,
}

/// Fibers read at most (a registry that claims more is read up to this).
const MAX_FIBERS: usize = 4 << 20;
/// Registry slots looked at most (a slot is empty once its fiber ended, so more slots than
/// fibers; a length past this is garbage or far past what a listing could show).
const MAX_SLOTS: usize = 4 * MAX_FIBERS;
/// Bytes of a name read at most.
const MAX_NAME: usize = 256;

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// The layout a version-1 header gives (offsets of its fields are this build's: the header
/// is `repr(C)` with a fixed field list, so every version-1 writer has the same).
struct Layout {
    sched_slots: usize,
    chunk_slots: usize,
    schedulers: u64,
    unpublished: u64,
    ps_per_tick: u64,
    s: [u32; 9],
    f: [u32; 18],
}

/// The fibers of every scheduler in the target's registry, with a note of what is missing;
/// `Err`: why no fiber could be read.
fn read_registry(
    s: &mut Session,
    own_ps: u64,
    live: bool,
    layer: &mut LayerState<'_>,
) -> Result<(Vec<RawScheduler>, Option<String>), String> {
    let Some((addr, size)) = s.section(".fibertrace.registry") else {
        // (It is looked for in the program's files: one that could not be used may hold it.)
        let unusable = s.unusable_images();
        if !unusable.is_empty() {
            return Err(format!(
                "no fiber registry found, but not every file of the process could be read \
                 for it: {}",
                unusable.join("; ")
            ));
        }
        return Err(
            "no fiber registry: the process does not use the fibertrace runtime \
                    (or was built without it)"
                .into(),
        );
    };
    let mut head = vec![0u8; (size as usize).clamp(24, 4096)];
    if !s.read(addr, &mut head) {
        return Err("the fiber registry's header could not be read".into());
    }
    let l = parse_header(&head)?;
    // The counter is the machine's: when the target has not measured its rate yet, ours is
    // its.
    let ps = match s.read_u64(l.ps_per_tick).unwrap_or(0) {
        0 => own_ps,
        ps => ps,
    };
    let unpublished = s.read_u64(l.unpublished).unwrap_or(0);
    let mut table = vec![0u8; l.sched_slots * 8];
    if !s.read(l.schedulers, &mut table) {
        return Err("the fiber registry's scheduler table could not be read".into());
    }
    // (0: no clock to measure status times against, see `read_fiber`.)
    let now = if live {
        fibertrace_core::arch::timestamp_counter()
    } else {
        0
    };
    let mut out = Vec::new();
    let mut total = 0usize;
    for i in 0..l.sched_slots {
        let p = u64_at(&table, i * 8).unwrap_or(0);
        if p == 0 {
            continue;
        }
        if let Some(sched) = read_scheduler(s, &l, p, ps, now, &mut total, layer) {
            out.push(sched);
        }
    }
    out.sort_by_key(|s| s.id);
    let note = (unpublished > 0).then(|| {
        format!("{unpublished} schedulers were not published (the registry's table was full)")
    });
    Ok((out, note))
}

/// A version-1 header's layout, from its bytes; `Err`: why it cannot be read.
fn parse_header(head: &[u8]) -> Result<Layout, String> {
    use std::mem::offset_of;
    let want = std::mem::size_of::<Header>();
    if head.len() < 24 || head[..16] != MAGIC {
        return Err("the .fibertrace.registry section holds no fiber registry (bad magic)".into());
    }
    let version = u32_at(head, offset_of!(Header, version)).unwrap_or(0);
    if version != VERSION {
        return Err(format!(
            "the process's fiber registry is version {version}; this fibertrace reads version \
             {VERSION}"
        ));
    }
    let header_size = u32_at(head, offset_of!(Header, header_size)).unwrap_or(0) as usize;
    let pointer_size = u32_at(head, offset_of!(Header, pointer_size)).unwrap_or(0);
    if header_size < want || head.len() < want || pointer_size != 8 {
        return Err(format!(
            "the fiber registry's header is malformed (size {header_size}, pointers of \
             {pointer_size} bytes)"
        ));
    }
    let so = offset_of!(Header, sched);
    let fo = offset_of!(Header, fiber);
    let mut l = Layout {
        sched_slots: u32_at(head, offset_of!(Header, sched_slots)).unwrap_or(0) as usize,
        chunk_slots: u32_at(head, offset_of!(Header, chunk_slots)).unwrap_or(0) as usize,
        schedulers: u64_at(head, offset_of!(Header, schedulers)).unwrap_or(0),
        unpublished: u64_at(head, offset_of!(Header, unpublished)).unwrap_or(0),
        ps_per_tick: u64_at(head, offset_of!(Header, ps_per_tick)).unwrap_or(0),
        s: [0; 9],
        f: [0; 18],
    };
    for (i, v) in l.s.iter_mut().enumerate() {
        *v = u32_at(head, so + 4 * i).unwrap_or(0);
    }
    for (i, v) in l.f.iter_mut().enumerate() {
        *v = u32_at(head, fo + 4 * i).unwrap_or(0);
    }
    if l.sched_slots == 0
        || l.sched_slots > 1 << 16
        || l.chunk_slots == 0
        || l.chunk_slots > 1 << 20
    {
        return Err("the fiber registry's header is malformed (table sizes)".into());
    }
    Ok(l)
}

fn read_string(s: &mut Session, ptr: u64, len: u64) -> String {
    let n = (len as usize).min(MAX_NAME);
    let mut b = vec![0u8; n];
    if ptr == 0 || !s.read(ptr, &mut b) {
        return String::new();
    }
    crate::sched::name_from_bytes(&b).to_string()
}

fn read_scheduler(
    s: &mut Session,
    l: &Layout,
    p: u64,
    ps: u64,
    now: u64,
    total: &mut usize,
    layer: &mut LayerState<'_>,
) -> Option<RawScheduler> {
    let [size, id, name_ptr, name_len, tid, running, chunk_dir, chunk_count, len] = l.s;
    let mut b = vec![0u8; (size as usize).min(1 << 16)];
    if !s.read(p, &mut b) {
        return None;
    }
    let w = |off: u32| u64_at(&b, off as usize).unwrap_or(0);
    let tid_v = u32_at(&b, tid as usize).unwrap_or(0) as i32;
    let running_v = w(running);
    let (dir, count, len_v) = (w(chunk_dir), w(chunk_count) as usize, w(len) as usize);
    let mut sched = RawScheduler {
        id: w(id),
        name: read_string(s, w(name_ptr), w(name_len)),
        thread: (tid_v != 0).then_some(tid_v),
        running: (running_v != 0).then_some(running_v),
        fibers: Vec::new(),
        unreadable: 0,
        lost_slots: 0,
        thread_below: None,
    };
    // At most MAX_SLOTS slots are looked at: a registry whose length is garbage (a damaged
    // core, a corrupted target) is not scanned for ever; the slots past it are counted lost.
    let len_v = len_v.min(count.saturating_mul(l.chunk_slots));
    if len_v > MAX_SLOTS {
        sched.lost_slots += len_v - MAX_SLOTS;
    }
    let len_v = len_v.min(MAX_SLOTS);
    let mut chunk = vec![0u8; l.chunk_slots * 8];
    let mut chunk_at = usize::MAX;
    let mut group: Vec<u64> = Vec::with_capacity(GROUP);
    let mut i = 0;
    while i < len_v && *total < MAX_FIBERS {
        // A group of control blocks, read ahead together with the stacks and states their
        // fibers are walked from (a few system calls for the group, not a few per fiber).
        group.clear();
        while i < len_v && group.len() < GROUP {
            let c = i / l.chunk_slots;
            if c != chunk_at {
                chunk_at = c;
                let cp = s.read_u64(dir.wrapping_add(8 * c as u64)).unwrap_or(0);
                if cp == 0 || !s.read(cp, &mut chunk) {
                    // The whole chunk is lost: skipped at once, not slot by slot.
                    sched.lost_slots += l.chunk_slots.min(len_v - i);
                    i = (c + 1).saturating_mul(l.chunk_slots);
                    continue;
                }
            }
            let cb = u64_at(&chunk, (i % l.chunk_slots) * 8).unwrap_or(0);
            if cb != 0 {
                group.push(cb);
            }
            i += 1;
        }
        prefetch_group(s, l, &group, layer);
        for &cb in &group {
            if *total >= MAX_FIBERS {
                break;
            }
            match read_fiber(s, l, (cb, sched.thread), ps, now, layer) {
                Ok(Some(mut f)) => {
                    if let Some(b) = f.below.take() {
                        sched.thread_below = Some(b);
                    }
                    *total += 1;
                    sched.fibers.push(f);
                }
                Ok(None) => {}
                Err(()) => sched.unreadable += 1,
            }
        }
    }
    sched.fibers.sort_by_key(|f| f.id);
    Some(sched)
}

/// Merges the frames of the layer above the runtime (a Lua host) into fiber `f`'s native
/// frames, when its layer word says one runs it (0: none), and adds to its note what could
/// not be read. `running`: the fiber runs (its thread's frames; see
/// [`ForeignLayer::running_frames`]).
fn merge_layer(
    s: &mut Session,
    layer: &mut LayerState<'_>,
    word: u64,
    f: &mut RawFiber,
    running: Option<i32>,
) {
    if word == 0 {
        return;
    }
    let why = match layer {
        LayerState::Open(lr) => {
            let native = std::mem::take(&mut f.frames);
            let (merged, why) = match running {
                Some(thread) => {
                    // The layer's note replaces the walk's (see `running_frames`).
                    let walk_note = f.note.take();
                    lr.running_frames(s, word, native, thread, walk_note)
                }
                None => lr.frames(s, word, native),
            };
            f.frames = merged;
            why
        }
        LayerState::Failed(why) => Some(format!("its Lua frames are not shown: {why}")),
        LayerState::Absent => Some(
            "a layer above the runtime (a Lua host) runs it: its frames are not read here, \
             native frames only"
                .into(),
        ),
    };
    f.note = join_notes(f.note.take(), why);
}

/// Two notes about one fiber as one (`a; b`), or the one there is.
pub fn join_notes(a: Option<String>, b: Option<String>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    }
}

/// Control blocks read ahead at once.
const GROUP: usize = 256;

/// Reads ahead what reading the fibers of `group` (their control blocks) needs: the blocks,
/// then each suspended fiber's used stack and its layer's state.
fn prefetch_group(s: &mut Session, l: &Layout, group: &[u64], layer: &mut LayerState<'_>) {
    let size = l.f[0] as u64;
    let ranges: Vec<(u64, u64)> = group
        .iter()
        .map(|&cb| (cb, cb.saturating_add(size)))
        .collect();
    s.prefetch(&ranges);
    let [_, _, _, _, _, run, _, _, _, _, _, sp, _, _, hi, entry_sp, layer_word, _] = l.f;
    let mut stacks = Vec::with_capacity(group.len());
    let mut words = Vec::new();
    let mut b = vec![0u8; (size as usize).min(1 << 16)];
    for &cb in group {
        if !s.read(cb, &mut b) {
            continue;
        }
        let w = |off: u32| u64_at(&b, off as usize).unwrap_or(0);
        let state = RunState::from_u8(b.get(run as usize).copied().unwrap_or(0));
        if !matches!(state, RunState::Suspended | RunState::Inspecting) {
            continue;
        }
        let (from, stop) = (w(sp), w(entry_sp));
        stacks.push((from, if stop > from { stop } else { w(hi) }));
        if w(layer_word) != 0 {
            words.push(w(layer_word));
        }
    }
    s.prefetch(&stacks);
    if let LayerState::Open(lr) = layer {
        lr.prefetch(s, &words);
    }
}

fn read_fiber(
    s: &mut Session,
    l: &Layout,
    (p, thread): (u64, Option<i32>),
    ps: u64,
    now: u64,
    layer: &mut LayerState<'_>,
) -> Result<Option<RawFiber>, ()> {
    let [size, id, name_ptr, name_len, parent, run, status, wait_on, since, csw, ip, sp, fp, stack_lo, stack_hi, entry_sp, layer_word, _created] =
        l.f;
    let mut b = vec![0u8; (size as usize).min(1 << 16)];
    if !s.read(p, &mut b) {
        return Err(());
    }
    let w = |off: u32| u64_at(&b, off as usize).unwrap_or(0);
    let byte = |off: u32| b.get(off as usize).copied().unwrap_or(0);
    let state = RunState::from_u8(byte(run));
    if state == RunState::Dead {
        return Ok(None);
    }
    // (A fiber caught between the two stores of a resume has its run state set, not yet its
    // status: the run state says it runs.)
    let st = match state {
        RunState::Running => Status::Running,
        _ => Status::from_u8(byte(status)),
    };
    // (What it waited on stays recorded until it runs again: a woken fiber waits no more.)
    let wait_on_v = WaitOn::unpack(w(wait_on)).filter(|_| st.waits());
    let waiting = wait_on_v.as_ref().map(|on| on.words().into_owned());
    // How long it has waited, for a fiber that waits (as in-process): the time since a ready
    // or running fiber last blocked says nothing of what it does now (one that only yields
    // was shown "ready, 3.0s" after millions of switches).
    let status_seconds = (ps > 0 && now != 0 && waiting.is_some()).then(|| {
        let ticks = now.saturating_sub(w(since));
        Duration::from_nanos((ticks as u128 * ps as u128 / 1000) as u64).as_secs_f64()
    });
    let parent_v = w(parent);
    let mut f = RawFiber {
        id: w(id),
        name: read_string(s, w(name_ptr), w(name_len)),
        status: st,
        waiting,
        wait_on: wait_on_v,
        status_seconds,
        parent: (parent_v != 0).then_some(parent_v),
        csw: w(csw),
        frames: Vec::new(),
        note: None,
        below: None,
    };
    match state {
        RunState::New => f.note = Some("not started yet".into()),
        RunState::Running => {
            // Its thread's stack is its own now: walked from the thread's registers down to
            // its entry (where they can be read: a held thread, or a core file's), when the
            // thread's stack pointer is in the fiber's stack (not so in the middle of a
            // switch, on the scheduler's stack).
            let (lo, hi) = (w(stack_lo), w(stack_hi));
            let regs = thread
                .and_then(|t| Some((t, s.thread_registers(t)?)))
                .filter(|(_, r)| r.sp >= lo && r.sp < hi);
            match regs {
                Some((t, regs)) => {
                    let stop = Some(w(entry_sp)).filter(|&a| a != 0);
                    let (mut frames, mut note) = s.walk(regs, stop);
                    // Code of the layer's without unwind records (a trace): the walk goes on
                    // from where the layer's runtime entered it.
                    if let (LayerState::Open(lr), word) = (&mut *layer, w(layer_word)) {
                        if word != 0 {
                            if let Some((below, why)) = lr.below_unwound(s, word) {
                                if continue_below(s, &mut frames, &mut note, below, stop) {
                                    f.below = Some((t, below, why));
                                }
                            }
                        }
                    }
                    f.frames = frames;
                    f.note = note;
                    merge_layer(s, layer, w(layer_word), &mut f, Some(t));
                }
                None => {
                    // Not held (a non-blocking dump): what the layer reads from memory alone.
                    let unheld = match layer {
                        LayerState::Open(lr)
                            if s.mode() == Mode::NonBlocking && w(layer_word) != 0 =>
                        {
                            lr.running_unheld(s, w(layer_word))
                        }
                        _ => None,
                    };
                    match unheld {
                        Some((frames, note)) => {
                            f.frames = frames;
                            f.note = note;
                        }
                        None => {
                            f.note = Some("running: its thread's stack above shows where".into());
                        }
                    }
                }
            }
        }
        RunState::Suspended | RunState::Inspecting => {
            let regs = Registers {
                ip: w(ip),
                sp: w(sp),
                fp: w(fp),
            };
            let stop = w(entry_sp);
            let (mut frames, note) = s.walk(regs, (stop != 0).then_some(stop));
            // The first frame is the runtime's suspend wrapper, as in this process's dumps.
            if !frames.is_empty() {
                frames.remove(0);
            }
            f.frames = frames;
            f.note = note;
            merge_layer(s, layer, w(layer_word), &mut f, None);
            if s.mode() == Mode::NonBlocking {
                // Torn? Its switch count or state moved while it was read.
                let mut again = vec![0u8; b.len()];
                let moved = !s.read(p, &mut again)
                    || u64_at(&again, csw as usize) != Some(f.csw)
                    || again.get(run as usize) != b.get(run as usize);
                if moved {
                    f.frames.clear();
                    f.note = Some("it switched while it was read: frames left out".into());
                }
            }
        }
        RunState::Dead => {}
    }
    Ok(Some(f))
}

impl ForeignDump {
    /// The fibers as a [`Snapshot`](super::Snapshot) of this runtime's, which the grouped view and the
    /// exports (pprof, folded stacks, flame graph, speedscope) read; with `threads`, the
    /// process's threads first, as one more scheduler named `threads` whose "fibers" are
    /// the threads (id: the thread's kernel id). What another process's registry does not
    /// publish is zero or empty: CPU time, stack use, creation time, the creators' traces.
    pub fn snapshot(&self, threads: bool) -> super::Snapshot {
        use std::sync::Arc;
        let frames = |list: &[ResolvedFrame]| -> Arc<[super::FrameInfo]> {
            list.iter()
                .map(|rf| {
                    let (resolved, label) = match (rf.frame, &rf.resolved) {
                        (Frame::Lua(_), Some(r)) => {
                            let sym = r.symbols.first();
                            let label = sym.map(|s| {
                                format!(
                                    "{} in {}:{}",
                                    s.name.as_deref().unwrap_or("?"),
                                    s.file.as_deref().unwrap_or("?"),
                                    s.line.map_or(-1, i64::from)
                                )
                            });
                            (None, label.map(Arc::from))
                        }
                        (f, r) => {
                            // A native frame this process cannot name: named as read (or
                            // not at all), never by this process's own symbols.
                            let r = match (f.lookup_address(), r) {
                                (_, Some(r)) => Some(Arc::new(r.clone())),
                                (Some(a), None) => Some(Arc::new(Resolved {
                                    lookup_address: a,
                                    ..Resolved::default()
                                })),
                                (None, None) => None,
                            };
                            (r, None)
                        }
                    };
                    super::FrameInfo {
                        frame: rf.frame,
                        resolved,
                        label,
                    }
                })
                .collect()
        };
        let info = |id: u64,
                    name: &str,
                    sched: u64,
                    status: Status,
                    f: Option<&ForeignFiber>,
                    list: &[ResolvedFrame]| {
            super::FiberInfo {
                id,
                name: Arc::from(name),
                scheduler: sched,
                status,
                status_seconds: f.and_then(|f| f.status_seconds).unwrap_or(0.0),
                waiting: f.and_then(|f| {
                    Some(super::Waiting {
                        on: f.wait_on.clone()?,
                        what: std::borrow::Cow::Owned(f.waiting.clone()?),
                        seconds: f.status_seconds.unwrap_or(0.0),
                    })
                }),
                csw: f.map_or(0, |f| f.csw),
                cpu_time: 0.0,
                cpu_time_counted: false,
                stack_size: 0,
                stack_used: 0,
                stack_used_max: 0,
                created: 0.0,
                age: 0.0,
                parent: f.and_then(|f| f.parent),
                entry: std::borrow::Cow::Borrowed(""),
                backtrace: Some(frames(list)),
                parent_backtrace: Vec::new(),
                parent_backtrace_omitted: 0,
                heap: None,
            }
        };
        let mut schedulers = Vec::new();
        if threads {
            schedulers.push(super::SchedulerSnapshot {
                id: 0,
                name: "threads".into(),
                thread: None,
                running: None,
                fibers: self
                    .process
                    .threads
                    .iter()
                    .map(|t| info(t.tid as u64, &t.name, 0, Status::Running, None, &t.frames))
                    .collect(),
                note: None,
                times_unknown: false,
            });
        }
        for s in &self.schedulers {
            schedulers.push(super::SchedulerSnapshot {
                id: s.id,
                name: s.name.clone(),
                thread: s.thread,
                running: s.running,
                fibers: s
                    .fibers
                    .iter()
                    .map(|f| info(f.id, &f.name, s.id, f.status, Some(f), &f.frames))
                    .collect(),
                note: s.note.clone(),
                // (A waiting fiber's time is read from the process's clock: a core has none.)
                times_unknown: s
                    .fibers
                    .iter()
                    .any(|f| f.waiting.is_some() && f.status_seconds.is_none()),
            });
        }
        super::Snapshot {
            version: super::SNAPSHOT_VERSION,
            taken_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
            schedulers,
            heap: None,
        }
    }

    /// The process and its threads as text (glue left out unless
    /// [`crate::glue::native_detail`]), and why fibers are missing, if they are.
    fn process_text(&self) -> String {
        let opts = fibertrace_core::format::TextOptions {
            hide: crate::inspect::glue::filter(),
            ..Default::default()
        };
        let mut out = self.process.to_text_with(&opts);
        if let Some(n) = &self.note {
            out.push_str(&format!("(fibers: {n})\n"));
        }
        out
    }

    /// The dump as text with the fibers grouped (Go's `debug=1`, as
    /// [`super::dump::snapshot_grouped`]): the process and its threads as [`Self::to_text`]
    /// shows them, then each scheduler's fibers folded by state and trace.
    pub fn to_grouped_text(&self) -> String {
        let mut out = self.process_text();
        out.push('\n');
        out.push_str(&super::dump::snapshot_grouped(&self.snapshot(false)));
        out
    }

    /// The dump as text: the process and its threads, then each scheduler's fibers as this
    /// process's own dumps show them (`fiber 7 "worker" [channel receive, 3.2s]:`), glue left
    /// out unless [`crate::glue::native_detail`].
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let opts = fibertrace_core::format::TextOptions {
            hide: crate::inspect::glue::filter(),
            ..Default::default()
        };
        let mut out = self.process_text();
        for sched in &self.schedulers {
            let _ = write!(
                out,
                "\nscheduler {} {}: {}",
                sched.id,
                crate::sched::quoted_name(&sched.name),
                super::dump::fibers_count(sched.fibers.len())
            );
            if let Some(t) = sched.thread {
                let _ = write!(out, " (thread {t})");
            }
            out.push_str("\n\n");
            if let Some(n) = &sched.note {
                let _ = writeln!(out, "({n})\n");
            }
            for f in &sched.fibers {
                let words = match (&f.waiting, f.status) {
                    (Some(w), _) => w.clone(),
                    (None, st) => format!("{st:?}").to_lowercase(),
                };
                let since = f
                    .status_seconds
                    .map(|s| format!(", {}", super::dump::human(Duration::from_secs_f64(s))))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "fiber {} {} [{words}{since}]:",
                    f.id,
                    crate::sched::quoted_name(&f.name)
                );
                out.push_str(&fibertrace_core::format::text_resolved(&f.frames, &opts));
                if let Some(n) = &f.note {
                    let _ = writeln!(out, "    ({n})");
                }
                if let Some(p) = f.parent {
                    let _ = writeln!(out, "created by fiber {p}");
                }
                out.push('\n');
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's own header, as bytes (what a reader finds in the section).
    fn own_header() -> Vec<u8> {
        let h = &crate::publish::HEADER;
        // Up to the end of its last field (the padding after it is not read), then zeroes
        // to the whole size, as a reader's copy of the section would have them.
        let fields = std::mem::offset_of!(Header, fiber)
            + std::mem::size_of::<crate::publish::FiberOffsets>();
        // (`repr(C)` puts padding only between fields of different alignment: here none —
        // a u8 array, u32s, 8-byte pointers at 8-aligned offsets, u32s.)
        let start = (h as *const Header).cast::<u8>();
        // SAFETY: the first `fields` bytes of a static `repr(C)` value, all fields, no padding.
        let bytes = unsafe { std::slice::from_raw_parts(start, fields) };
        let mut v = bytes.to_vec();
        v.resize(std::mem::size_of::<Header>(), 0);
        v
    }

    #[test]
    fn a_header_of_another_version_or_a_broken_one_is_refused_with_why() {
        let good = own_header();
        let l = parse_header(&good).unwrap();
        assert_eq!(l.sched_slots, crate::publish::SCHED_SLOTS);
        assert_eq!(l.chunk_slots, crate::registry::CHUNK);
        assert_eq!(
            l.f[0] as usize,
            std::mem::size_of::<crate::task::ControlBlock>()
        );
        let mut v2 = good.clone();
        v2[16..20].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            parse_header(&v2).err().unwrap(),
            "the process's fiber registry is version 2; this fibertrace reads version 1"
        );
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(parse_header(&bad).err().unwrap().contains("bad magic"));
        assert!(parse_header(&good[..40])
            .err()
            .unwrap()
            .contains("malformed"));
        assert!(parse_header(&[]).is_err());
        let mut ptr4 = good.clone();
        ptr4[24..28].copy_from_slice(&4u32.to_le_bytes());
        assert!(parse_header(&ptr4)
            .err()
            .unwrap()
            .contains("pointers of 4 bytes"));
        let mut slots = good;
        slots[28..32].copy_from_slice(&0u32.to_le_bytes());
        assert!(parse_header(&slots).err().unwrap().contains("table sizes"));
    }
}
