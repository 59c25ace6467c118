//! Inspection: what every fiber is doing, read from outside the runtime's machinery, and
//! every report built from it.
//!
//! The layers of this crate, each using only the ones before it:
//!
//! ```text
//! clock, frames, task/          a fiber: control block, run state, parent trace
//! running, overflow, stack      what a scheduler's thread runs now; the stacks
//! registry                      every scheduler and fiber of the process
//! publish                       the registry's header for readers in other processes
//! sched/, sync                  the machinery: run loop, switching, spawning, channels
//! inspect/                      this: the snapshot and every report (info, dumps, samples,
//!                               the watchdog, panic reports)
//! runtime                       the constructors that wire the machinery to this layer
//! ```
//!
//! Nothing below `inspect` names it: the scheduler calls up through `sched::Hooks`,
//! which `runtime` fills with this module's functions (`HOOKS`).
//!
//! # The snapshot
//!
//! [`snapshot`] reads every scheduler and every fiber into one value ([`Snapshot`]: schedulers
//! with the thread they run on, each with its fibers' [`FiberInfo`]): ids, names, status, what
//! a fiber waits on and since when, its parent chain, switches, CPU time, stack use and
//! frames. It runs no user code, and stops no other thread longer than a fiber's inspection
//! (a walk of one parked stack, well under a microsecond; a fiber running on another thread
//! is sampled by a signal, see [`sample`]). The text and JSON dumps, the signal dump, the
//! deadlock report, the watchdog's reports and the Rust [`info`] calls are views of it.
//!
//! A layer above (the Lua host) adds its own frames through a [`FrameSource`] registered for
//! its scheduler: a snapshot carries each suspended fiber's frames with the layer's frames
//! interleaved and labelled ([`FrameInfo::label`]). The source may be read only on its
//! scheduler's thread, so a snapshot taken on another thread (the dump signal's, a user's)
//! asks that scheduler to build its own part at its next turn of the run loop, and waits for
//! it at most [`SOURCE_WAIT`]. When a fiber is running there, the layer is also asked to bring
//! it to a *safe point* ([`SafePointArm`]: the Lua host stops it at its next Lua line) where
//! the layer builds the part inside it, the running fiber's own frames included
//! ([`serve_at_safe_point`]). A scheduler that does neither by then (a fiber in native code
//! that does not return to the layer, or the thread waiting outside the runtime) gets its
//! part built from the asking thread: when the layer registered a [`HeldSource`], with the
//! scheduler's thread held still meanwhile (the sampling signal's handler waits until the
//! part is built, at most a few seconds: [`sample`]) and the layer's frames read from memory
//! by that source; otherwise (or when the thread cannot be held, or the hold ran out before
//! the read ended) with native frames only. Either way a note says so
//! ([`SchedulerSnapshot::note`]).
//!
//! How a snapshot can be wrong: it is not atomic across fibers — each fiber is read at its
//! own moment, so a fiber can appear waiting on a channel that another fiber, read later, has
//! just written to; a running fiber's sample may name where it was a few microseconds before
//! the sample was read. A scheduler's part built on its own thread at its next turn is of
//! that moment, up to [`SOURCE_WAIT`] after the other schedulers' parts.

pub mod dump;
pub mod export;
pub mod foreign;
pub mod glue;
pub mod http;
pub mod info;
pub mod sample;
mod source;
pub mod waitgraph;
pub mod watchdog;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fibertrace_core::{symbolize, Frame};
use serde::{Deserialize, Serialize};

pub use crate::frames::FrameInfo;
use crate::registry::{self, SchedShared};
pub use crate::running::signal_thread;
use crate::task::{FiberId, Status};
pub use info::{FiberInfo, InfoOptions, ParentInfo, Waiting};
pub use source::{AfterHold, FrameSource, HeldSource};

/// The version of the snapshot's serialized form ([`Snapshot::version`]): raised when a field
/// changes meaning or goes away (new fields may appear without a raise).
pub const SNAPSHOT_VERSION: u32 = 1;

/// What every fiber of the process was doing (see the module doc).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    /// [`SNAPSHOT_VERSION`].
    pub version: u32,
    /// When it was taken, seconds since the Unix epoch.
    pub taken_at: f64,
    /// Every scheduler alive, in the order they were made.
    pub schedulers: Vec<SchedulerSnapshot>,
    /// The heap outside the live fibers (when the process's allocator tracks it; each
    /// fiber's own is its [`FiberInfo::heap`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap: Option<HeapSummary>,
}

/// The heap not charged to a live fiber (see `fibertrace_core::heap`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeapSummary {
    /// The tracker's tier.
    pub tier: Option<fibertrace_core::heap::Tier>,
    /// Charged to code outside fibers (threads, schedulers between fibers).
    pub outside: fibertrace_core::heap::Usage,
    /// Still held by fibers that have ended, most bytes first.
    pub exited: Vec<(FiberId, fibertrace_core::heap::Usage)>,
}

impl HeapSummary {
    /// The summary now, or `None` when the heap is not tracked.
    pub fn now() -> Option<HeapSummary> {
        let tier = fibertrace_core::heap::tier();
        if tier == fibertrace_core::heap::Tier::Off {
            return None;
        }
        let mut s = HeapSummary {
            tier: Some(tier),
            ..HeapSummary::default()
        };
        for r in fibertrace_core::heap::owners() {
            match r.fiber {
                None => s.outside = r.usage,
                Some(f) if r.exited && r.usage.live_objects > 0 => s.exited.push((f, r.usage)),
                _ => {}
            }
        }
        s.exited
            .sort_by(|a, b| b.1.live_bytes.cmp(&a.1.live_bytes).then(a.0.cmp(&b.0)));
        Some(s)
    }
}

/// One scheduler and its fibers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SchedulerSnapshot {
    /// Its id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// The kernel id of the thread it runs on (as `ps -L` and `/proc/PID/task` show it);
    /// `None` before it first ran.
    pub thread: Option<i32>,
    /// The fiber running at the moment it was read (`None`: between fibers, or idle).
    pub running: Option<FiberId>,
    /// Its fibers, in the registry's order.
    pub fibers: Vec<FiberInfo>,
    /// What the part could not show, and why (a scheduler whose frame source could not be
    /// read in time: see the module doc).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub note: Option<String>,
    /// How long each fiber has been in its status is not known (a core file records no
    /// clock): the fibers' `status_seconds` and `waiting.seconds` are 0 and mean nothing.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub times_unknown: bool,
}

/// Takes a snapshot of every scheduler of the process.
#[inline(never)]
pub fn snapshot(opts: &InfoOptions) -> Snapshot {
    report_entry!();
    Snapshot {
        version: SNAPSHOT_VERSION,
        taken_at: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64(),
        schedulers: registry::schedulers()
            .iter()
            .map(|s| part(s, opts))
            .collect(),
        heap: HeapSummary::now(),
    }
}

/// One scheduler's part of a snapshot. On that scheduler's own thread, a registered
/// [`FrameSource`] adds its frames to the fibers' traces.
#[inline(never)]
pub fn scheduler_snapshot(s: &SchedShared, opts: &InfoOptions) -> SchedulerSnapshot {
    report_entry!();
    build_part(s, opts, None)
}

/// Scheduler `s`'s part, of every fiber or `only` one, built on the calling thread.
fn build_part(s: &SchedShared, opts: &InfoOptions, only: Option<FiberId>) -> SchedulerSnapshot {
    build_part_with(s, opts, only, None)
}

/// [`build_part`], with the running fiber's frames given (`here`: read inside it at a safe
/// point, the layer's frames interleaved) rather than sampled.
fn build_part_with(
    s: &SchedShared,
    opts: &InfoOptions,
    only: Option<FiberId>,
    here: Option<sample::Sample>,
) -> SchedulerSnapshot {
    let here_id = here.as_ref().map(|h| h.fiber);
    let mut fibers = match only {
        None => info::scheduler_info_with(s, opts, here),
        Some(id) => s
            .fiber(id)
            .and_then(|f| info::info_of(s, &f, opts, here.as_ref()))
            .into_iter()
            .collect(),
    };
    if let Some(src) = source::source(s.id) {
        let mut shared = ParentLabels::default();
        for fi in &mut fibers {
            if Some(fi.id) == here_id {
                label_source_frames(&*src, fi);
            } else {
                add_source_frames(&*src, fi, opts.resolve);
            }
            label_parents(&|id| src.name(id), fi, &mut shared);
        }
    }
    let tid = s.on_thread.tid.load(Ordering::Relaxed);
    let running = s.on_thread.running();
    SchedulerSnapshot {
        id: s.id,
        name: s.name.clone(),
        thread: (tid != 0).then_some(tid),
        running: (running != 0).then_some(running),
        fibers,
        note: None,
        times_unknown: false,
    }
}

/// How long a snapshot taken on another thread waits for a scheduler with a frame source to
/// build its own part (see the module doc).
pub const SOURCE_WAIT: Duration = Duration::from_millis(200);

/// How long an ask waits past its own limit while the scheduler's thread builds other asks'
/// parts.
const SERVING_WAIT: Duration = Duration::from_secs(5);

/// How often an ask brings the running fiber to a safe point again while it waits.
const REARM: Duration = Duration::from_millis(20);

/// A part asked of a scheduler, built on its thread.
struct Asked {
    sched: u64,
    /// One fiber's part only (a watchdog report), or every fiber's.
    only: Option<FiberId>,
    opts: InfoOptions,
    part: Mutex<Option<SchedulerSnapshot>>,
    done: Condvar,
}

/// Parts asked and not yet taken by their schedulers.
static ASKED: Mutex<Vec<Arc<Asked>>> = Mutex::new(Vec::new());

/// Held by the one thread asking a scheduler's thread for a part (see [`ask`]): asks are made
/// one at a time. Made at once, a second one waited while the scheduler's thread was building
/// the first (seconds, for tens of thousands of fibers), ran out of its wait and was told
/// that thread had not come back to its run loop; and each built its whole snapshot in
/// memory at the same time.
static ASKING: Mutex<()> = Mutex::new(());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Scheduler `s`'s part of a snapshot: built here, or, when `s` has a frame source that only
/// its own thread may read and this is another thread, asked of that thread (see the module
/// doc).
fn part(s: &SchedShared, opts: &InfoOptions) -> SchedulerSnapshot {
    part_of(s, opts, None, SOURCE_WAIT)
}

/// One fiber of scheduler `s`, as [`part`] builds it (with the layer's frames: asked of the
/// scheduler's thread, waiting at most `wait`), with the note of what it could not show.
/// `None`: no such fiber (any more).
pub(crate) fn fiber_part(
    s: &SchedShared,
    id: FiberId,
    opts: &InfoOptions,
    wait: Duration,
) -> Option<(FiberInfo, Option<String>)> {
    let mut p = part_of(s, opts, Some(id), wait);
    let fi = p.fibers.pop()?;
    Some((fi, p.note))
}

fn part_of(
    s: &SchedShared,
    opts: &InfoOptions,
    only: Option<FiberId>,
    wait: Duration,
) -> SchedulerSnapshot {
    let refused = match ask(s, opts, only, wait) {
        Ask::Here => return build_part(s, opts, only),
        Ask::Built(p) => return p,
        Ask::Late(refused) => refused,
    };
    if let Some((mut p, notes)) = held_part(s, opts, only) {
        p.note = Some(held_note(wait, refused, &notes));
        return p;
    }
    let mut p = build_part(s, opts, only);
    p.note = Some(late_note(wait, refused));
    p
}

/// Cuts the held thread's frames `raw` after the first one in code outside every loaded
/// image (code made at run time: a Lua trace) and goes on from `below`, the registers of the
/// frame that entered that code ([`HeldSource::below_unwound`]), walked precisely (DWARF:
/// the thread is held, and a frame-pointer walk would miss a caller that keeps none; with
/// the image table as it is: see [`fibertrace_core::collect_from_held`]) within
/// the fiber's `stack`, down to its entry `stop` as the fiber's own walks. Whatever the first
/// walk found past that frame (it followed a frame pointer the code used for something else)
/// is dropped. Nothing changes when no frame is in such code or `below` is not in the stack.
fn continue_held(
    raw: &mut Vec<Frame>,
    below: fibertrace_core::arch::Registers,
    stack: fibertrace_core::arch::StackBounds,
    stop: u64,
) {
    let table = fibertrace_core::image::published();
    let known = |a: u64| table.is_some_and(|t| t.image_of(a).is_some());
    let Some(k) = raw
        .iter()
        .position(|f| f.lookup_address().is_some_and(|a| !known(a)))
    else {
        return;
    };
    if !stack.contains(below.sp) {
        return;
    }
    let ctx = fibertrace_core::arch::SavedContext {
        regs: below,
        stack,
        stop_sp: stop,
    };
    let mut bt = fibertrace_core::Backtrace::new();
    let opts = fibertrace_core::CaptureOptions::with_unwinder(fibertrace_core::Unwinder::Precise);
    fibertrace_core::collect_from_held(&ctx, &opts, &mut bt);
    let mut more = bt.frames().to_vec();
    // (Its first frame is a return address: named by the call before it.)
    match more.first().copied() {
        Some(Frame::Pc(a)) => more[0] = Frame::Ra(a),
        Some(_) => {}
        None => return,
    }
    raw.truncate(k + 1);
    raw.extend(more);
}

/// Scheduler `s`'s part built here with its layer's frames read from memory while its
/// thread is held still (see [`HeldSource`]), when the layer has a held source and the
/// thread can be held (asked when the thread did not come back to its run loop, nor its
/// fiber to a safe point: a blocking call in native code), with the layer's notes on the
/// fibers (why their frames could not be read, or what they are read without: `true` when
/// they were read). `None`: not so, or the hold ran out before the read ended (the read is
/// void then).
fn held_part(
    s: &SchedShared,
    opts: &InfoOptions,
    only: Option<FiberId>,
) -> Option<(SchedulerSnapshot, Vec<LayerNote>)> {
    let src = source::held(s.id)?;
    // While the thread is held, this one waits for none of the locks it may hold: the
    // symbolizer answers from its caches, walks do not reread the loader's list.
    let holding = fibertrace_core::capture::holding_another_thread();
    let hold = sample::hold(s, SOURCE_WAIT)?;
    let here = hold.sample.fiber;
    // Names and lines after the hold: a symbolizer's first use reads debug info for
    // seconds, and the thread would be held meanwhile (or the hold run out).
    let held_opts = InfoOptions {
        resolve: false,
        ..*opts
    };
    let mut p = build_part_with(s, &held_opts, only, Some(hold.sample.clone()));
    let mut notes: Vec<LayerNote> = Vec::new();
    // The layer words, in one scan of the registry (a lookup per fiber is a scan each).
    let mut words = std::collections::HashMap::with_capacity(p.fibers.len());
    // The running fiber's stack and entry, where its walk may go on (see `continue_held`).
    let mut here_stack = None;
    for cb in s.fibers() {
        words.insert(cb.id, cb.layer_word.load(Ordering::Acquire));
        if cb.id == here {
            here_stack = Some((cb.stack, cb.entry_sp.load(Ordering::Relaxed)));
        }
    }
    src.begin();
    let mut shared = ParentLabels::default();
    for fi in &mut p.fibers {
        label_parents(&|id| src.name(id), fi, &mut shared);
        let word = words.get(&fi.id).copied().unwrap_or(0);
        let Some(native) = fi.backtrace.as_ref().filter(|_| word != 0) else {
            continue;
        };
        let mut raw: Vec<Frame> = native.iter().map(|f| f.frame).collect();
        let (frames, why) = if fi.status == Status::Running {
            if fi.id != here {
                continue;
            }
            if let (Some(below), Some((stack, stop))) = (src.below_unwound(word), here_stack) {
                continue_held(&mut raw, below, stack, stop);
            }
            src.running_frames(word, &raw, &|n| hold.register(n))
        } else {
            src.frames(word, &raw)
        };
        if let Some(why) = why {
            notes.push(LayerNote {
                fiber: fi.id,
                why,
                read: frames.is_some(),
            });
        }
        if let Some(frames) = frames {
            fi.backtrace = Some(labelled(&frames, |id| src.name(id), false));
        }
    }
    let after = src.end();
    if !hold.still_held() {
        return None;
    }
    drop(hold);
    drop(holding);
    if !after.is_empty() {
        let at: std::collections::HashMap<u64, usize> = p
            .fibers
            .iter()
            .enumerate()
            .filter_map(|(i, fi)| Some((*words.get(&fi.id)?, i)))
            .collect();
        for redo in after {
            let (word, frames) = redo();
            if let Some(fi) = at.get(&word).map(|&i| &mut p.fibers[i]) {
                if fi.backtrace.is_some() {
                    fi.backtrace = Some(labelled(&frames, |id| src.name(id), false));
                }
            }
        }
    }
    // Under the hold the runtime's trampoline frame was left at the end of a trace whose
    // last frame the symbolizer's cache did not name: left out now.
    for fi in &mut p.fibers {
        if let Some(b) = &fi.backtrace {
            if let Some(t) = without_trampoline_info(b) {
                fi.backtrace = Some(t);
            }
        }
        for pi in &mut fi.parent_backtrace {
            if let Some(t) = without_trampoline_info(&pi.frames) {
                pi.frames = t;
            }
        }
    }
    if opts.resolve {
        for fi in &mut p.fibers {
            if let Some(b) = &fi.backtrace {
                fi.backtrace = Some(resolved(b));
            }
            for pi in &mut fi.parent_backtrace {
                pi.frames = resolved(&pi.frames);
            }
        }
    }
    Some((p, notes))
}

/// `frames` without a trailing runtime trampoline frame (as [`crate::frames::user_frames`]
/// leaves it out), if it ends with one.
fn without_trampoline_info(frames: &[FrameInfo]) -> Option<Arc<[FrameInfo]>> {
    let raw: Vec<Frame> = frames.iter().map(|f| f.frame).collect();
    let kept = crate::frames::user_frames(&raw).len();
    (kept < frames.len()).then(|| frames[..kept].iter().cloned().collect())
}

/// `frames` with their native frames resolved (names, lines), the layer's as they are.
fn resolved(frames: &[FrameInfo]) -> Arc<[FrameInfo]> {
    frames
        .iter()
        .map(|f| match f.frame {
            Frame::Lua(_) => f.clone(),
            _ => FrameInfo {
                resolved: f.resolved.clone().or_else(|| symbolize::resolve(&f.frame)),
                ..f.clone()
            },
        })
        .collect()
}

/// A layer's note on one fiber of a held read ([`held_part`]).
struct LayerNote {
    fiber: FiberId,
    /// Why its frames could not be read, or what they were read without.
    why: String,
    /// Whether its frames were read.
    read: bool,
}

/// What [`running_part`] gives: the fiber with a note, or why not and whether the layer said
/// so.
pub(crate) type RunningPart = Result<Option<(FiberInfo, Option<String>)>, (String, bool)>;

/// What a part built by [`held_part`] says of how it was read: the thread did not come back
/// within `wait` (and `refused`: why its fiber cannot be brought to a safe point), and the
/// layer's notes on its fibers.
fn held_note(wait: Duration, refused: Option<&str>, notes: &[LayerNote]) -> String {
    let why = match refused {
        Some(why) => format!(", and its running fiber cannot be stopped at a safe point: {why}"),
        None => ", nor its running fiber to a safe point".to_string(),
    };
    let mut note = format!(
        "the scheduler's thread did not come back to its run loop within {} ms{why}: the \
         layer's (Lua) frames were read from memory, the thread held still",
        wait.as_millis()
    );
    for n in notes {
        note.push_str(&format!("; fiber {}: {}", n.fiber, n.why));
    }
    note
}

/// What the report says of a part its scheduler did not build in time.
fn late_note(wait: Duration, refused: Option<&str>) -> String {
    match refused {
        Some(why) => format!(
            "frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
             not come back to its run loop within {} ms, and its running fiber cannot be \
             stopped at a safe point: {why}",
            wait.as_millis()
        ),
        None => format!(
            "frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
             not come back to its run loop within {} ms, nor its running fiber to a safe point \
             (it runs native code that does not return to the layer, or the thread waits \
             outside the runtime)",
            wait.as_millis()
        ),
    }
}

/// How an ask went.
enum Ask {
    /// Nothing to ask: the part can be built on this thread.
    Here,
    /// Built by the scheduler's thread.
    Built(SchedulerSnapshot),
    /// Not built in time (withdrawn); with the layer's reason if it could not bring the
    /// running fiber to a safe point.
    Late(Option<&'static str>),
}

/// Asks scheduler `s`'s thread for its part when a frame source only that thread may read
/// is registered and this is another thread; waits at most `wait`.
fn ask(s: &SchedShared, opts: &InfoOptions, only: Option<FiberId>, wait: Duration) -> Ask {
    let elsewhere = source::registered(s.id) && source::source(s.id).is_none();
    let handle = s.on_thread.handle.get();
    let (true, Some(thread)) = (elsewhere, handle) else {
        return Ask::Here;
    };
    // (Its wait starts once the asks before it are done.)
    let _one_at_a_time = lock(&ASKING);
    let asked = Arc::new(Asked {
        sched: s.id,
        only,
        opts: *opts,
        part: Mutex::new(None),
        done: Condvar::new(),
    });
    lock(&ASKED).push(asked.clone());
    s.on_thread.asked.store(true, Ordering::Release);
    thread.unpark();
    // A fiber runs: the layer may bring it to a safe point where the part is built inside
    // it. Asked again every few milliseconds while the part is not there: a request that
    // came while the layer was serving others at a safe point may have found it deaf.
    let arm = || match s.on_thread.arm() {
        Some(arm) if s.on_thread.running() != 0 => {
            arm(s.on_thread.tid.load(Ordering::Relaxed)).err()
        }
        _ => None,
    };
    let mut refused = arm();
    let t0 = Instant::now();
    loop {
        let left = wait.saturating_sub(t0.elapsed());
        if let Some(p) = wait_for(&asked, left.min(REARM)) {
            return Ask::Built(p);
        }
        // The thread is building other asks' parts: it has come back, and takes this one
        // next (up to a bound).
        let busy = s.on_thread.serving.load(Ordering::Acquire) && t0.elapsed() < SERVING_WAIT;
        if left <= REARM && !busy {
            break;
        }
        if refused.is_none() {
            refused = arm();
        }
    }
    // Not taken in time: withdraw it, unless the scheduler took it meanwhile (then it is
    // being built: a short wait).
    let withdrawn = {
        let mut v = lock(&ASKED);
        let at = v.iter().position(|a| Arc::ptr_eq(a, &asked));
        at.map(|i| v.remove(i)).is_some()
    };
    if !withdrawn {
        if let Some(p) = wait_for(&asked, Duration::from_secs(5)) {
            return Ask::Built(p);
        }
    }
    Ask::Late(refused)
}

/// The running fiber `id` of scheduler `s` as read at a safe point inside it (with the
/// layer's frames), asked from another thread (the watchdog's), or, when it does not reach
/// one within `wait`, with its thread held still (a layer with a [`HeldSource`]: a fiber in
/// C code that Lua called); `Err` when neither could read it: the note that says why, and
/// whether it is the layer's own reason (its refusal to bring the fiber to a safe point, or
/// why the held read found no frames of its) rather than the fiber not reaching one.
/// `Ok(None)`: the scheduler has no layer to ask, or the fiber is gone. With the fiber, what
/// its frames were read without, or how (a held read when the layer refused a safe point).
pub(crate) fn running_part(
    s: &SchedShared,
    id: FiberId,
    opts: &InfoOptions,
    wait: Duration,
) -> RunningPart {
    match ask(s, opts, Some(id), wait) {
        Ask::Here => Ok(None),
        Ask::Built(mut p) => Ok(p.fibers.pop().map(|f| (f, None))),
        Ask::Late(refused) => match held_part(s, opts, Some(id)) {
            Some((p, notes)) => held_running(p, notes, id, refused),
            None => Err((late_note(wait, refused), refused.is_some())),
        },
    }
}

/// The running fiber `id` of scheduler `s` read with its thread held still first (see
/// [`HeldSource`]), for a fiber blocked in the kernel: its next safe point comes only once
/// the blocking call returned, so frames read there have the line after the call, and the
/// call is gone from them. `None` when the scheduler's layer reads no held thread, or the
/// hold failed (the caller then asks for a safe point: [`running_part`]); `Some(Ok(None))`
/// when the part can be built on this thread (nothing to hold).
pub(crate) fn held_running_part(
    s: &SchedShared,
    id: FiberId,
    opts: &InfoOptions,
) -> Option<RunningPart> {
    let elsewhere = source::registered(s.id) && source::source(s.id).is_none();
    if !elsewhere {
        return Some(Ok(None));
    }
    let (p, notes) = held_part(s, opts, Some(id))?;
    Some(held_running(p, notes, id, None))
}

/// Fiber `id` of a part read with its thread held ([`held_part`]), with the layer's note on
/// it (and `refused`: why it could not be brought to a safe point), or the note that says
/// why its layer's frames could not be read.
fn held_running(
    mut p: SchedulerSnapshot,
    notes: Vec<LayerNote>,
    id: FiberId,
    refused: Option<&str>,
) -> RunningPart {
    let mine = notes.into_iter().find(|n| n.fiber == id);
    if let Some(n) = mine.as_ref().filter(|n| !n.read) {
        // (With why it was not read at a safe point, when the layer refused one.)
        let refused = refused
            .map(|r| {
                format!(
                    "its running fiber cannot be stopped at a safe point: {r}; read with its \
                     thread held still: "
                )
            })
            .unwrap_or_default();
        return Err((
            format!(
                "frames of the layer above the runtime (Lua) not shown: {refused}{}",
                n.why
            ),
            true,
        ));
    }
    let why = mine.map(|n| n.why);
    let note = match (refused, why) {
        (Some(r), why) => Some(format!(
            "its running fiber cannot be stopped at a safe point: {r}: its Lua frames were \
             read from memory, its thread held still{}",
            why.map(|w| format!("; {w}")).unwrap_or_default()
        )),
        (None, why) => why,
    };
    Ok(p.fibers.pop().map(|f| (f, note)))
}

fn wait_for(asked: &Asked, d: Duration) -> Option<SchedulerSnapshot> {
    let deadline = Instant::now() + d;
    let mut g = lock(&asked.part);
    loop {
        if let Some(p) = g.take() {
            return Some(p);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        g = asked
            .done
            .wait_timeout(g, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// The asks waiting for scheduler `sched`, taken.
fn take_asked(sched: u64) -> Vec<Arc<Asked>> {
    let mut v = lock(&ASKED);
    let (mine, rest) = v.drain(..).partition(|a| a.sched == sched);
    *v = rest;
    mine
}

/// The scheduler's `asked` hook: builds the parts asked of it, on its own thread, between
/// fibers.
fn serve(s: &SchedShared) {
    s.on_thread.serving.store(true, Ordering::Release);
    answer(take_asked(s.id), |opts, only| build_part(s, opts, only));
    s.on_thread.serving.store(false, Ordering::Release);
}

/// Answers asks with parts `build` makes: once for all the asks that want the same part
/// (dumps asked at once from several threads, an HTTP endpoint's connections).
fn answer(
    mut asks: Vec<Arc<Asked>>,
    mut build: impl FnMut(&InfoOptions, Option<FiberId>) -> SchedulerSnapshot,
) {
    while let Some(first) = asks.pop() {
        let p = build(&first.opts, first.only);
        let (same, rest): (Vec<_>, Vec<_>) = asks
            .into_iter()
            .partition(|a| a.opts == first.opts && a.only == first.only);
        asks = rest;
        for a in same.into_iter().chain(std::iter::once(first)) {
            *lock(&a.part) = Some(p.clone());
            a.done.notify_all();
        }
    }
}

/// Brings the fiber a scheduler's thread runs to a *safe point*, from any thread: a point
/// inside that fiber where a layer above the runtime can read every fiber's frames, the
/// running one's included (for the Lua host: the next Lua instruction the fiber executes,
/// reached through LuaJIT's profiler hook, which also reaches JIT-compiled code). There the
/// layer calls [`serve_at_safe_point`]. Called with the scheduler thread's kernel id (send
/// it a signal with [`signal_thread`]: the thread may have exited since, which a
/// `pthread_t` cannot tell); it must not block. `Err` says why the fiber cannot be brought
/// there (it goes into the report's note).
pub type SafePointArm = fn(tid: i32) -> Result<(), &'static str>;

/// How large the stack is on which [`serve_at_safe_point`] builds the parts (a fiber's own
/// stack can be small, and a part of thousands of fibers, symbolized, needs room).
const SAFE_POINT_STACK: usize = 8 << 20;

/// Builds the parts other threads asked of the scheduler running on this thread (a dump
/// taken by a signal or over HTTP, a stall report), from a *safe point* inside its running
/// fiber (see [`SafePointArm`]): as the run loop would between fibers, but with the running
/// fiber's frames — `running` gives them (its native frames with the layer's interleaved,
/// innermost first, as [`FrameSource::frames`] gives a suspended fiber's), called once for
/// each round of asks it serves (asks that come while a round is built make the next), and
/// only when something was asked. Returns whether something was asked.
///
/// Call it on the scheduler's thread, from the running fiber, where the registered
/// [`FrameSource`] may read every fiber (a Lua hook). The parts are built on a stack of
/// their own (8 MiB, mapped lazily), not on the fiber's.
///
/// How a result can be wrong: the running fiber's frames are of the safe point, which comes
/// after the request (for a Lua fiber, at its next Lua instruction — after the native code it
/// was in returns); the other fibers are read at the same moment.
#[inline(never)]
pub fn serve_at_safe_point(running: &mut dyn FnMut() -> Option<Vec<Frame>>) -> bool {
    let Some(s) = crate::sched::with_sched(|i| i.shared.clone()) else {
        return false;
    };
    let mut served = false;
    // Asks that come while these are built are served in the next round.
    while s.on_thread.asked.swap(false, Ordering::AcqRel) {
        s.on_thread.serving.store(true, Ordering::Release);
        let mine = take_asked(s.id);
        if mine.is_empty() {
            break;
        }
        serve_here(&s, mine, running);
        served = true;
    }
    s.on_thread.serving.store(false, Ordering::Release);
    served
}

/// Builds the parts `mine` inside the running fiber (see [`serve_at_safe_point`]).
fn serve_here(
    s: &Arc<SchedShared>,
    mine: Vec<Arc<Asked>>,
    running: &mut dyn FnMut() -> Option<Vec<Frame>>,
) {
    let s = s.clone();
    let fid = crate::sched::current_id();
    let frames = if fid != 0 { running() } else { None };
    let here = frames.map(|frames| sample::Sample {
        fiber: fid,
        resumes: s.on_thread.resumes.load(Ordering::Relaxed),
        backtrace: fibertrace_core::Backtrace::from_frames(&frames),
        latency: Duration::ZERO,
        handler_time: Duration::ZERO,
    });
    let build = move || {
        answer(mine, |opts, only| {
            build_part_with(&s, opts, only, here.clone())
        });
    };
    match corosensei::stack::DefaultStack::new(SAFE_POINT_STACK) {
        Ok(stack) => corosensei::on_stack(stack, build),
        // No memory for a stack of its own: the fiber's.
        Err(_) => build(),
    }
}

/// Labels the layer's frames in the running fiber's frames given at a safe point (the native
/// ones are resolved already).
fn label_source_frames(src: &dyn FrameSource, fi: &mut FiberInfo) {
    let Some(frames) = &fi.backtrace else {
        return;
    };
    let list: Arc<[FrameInfo]> = frames
        .iter()
        .map(|f| match f.frame {
            Frame::Lua(id) => FrameInfo {
                label: src.name(id).map(Arc::from),
                ..f.clone()
            },
            _ => f.clone(),
        })
        .collect();
    fi.backtrace = Some(list);
}

/// The labelled copy of each creator's trace made for one scheduler's part of a snapshot, by
/// the trace it was made from (kept alive here, so that its address names it): that part's
/// fibers that share a trace share its labelled copy.
type ParentLabels =
    std::collections::HashMap<*const FrameInfo, (Arc<[FrameInfo]>, Arc<[FrameInfo]>)>;

/// Labels the layer's frames in the traces of fiber `fi`'s creators, as its own frames are
/// (they were captured with the layer's frames merged in, but the runtime cannot name them):
/// unlabelled, they printed as `[lua frame N]`.
fn label_parents(
    name: &dyn Fn(fibertrace_core::LuaFrameId) -> Option<String>,
    fi: &mut FiberInfo,
    shared: &mut ParentLabels,
) {
    for pi in &mut fi.parent_backtrace {
        let unlabelled = |f: &FrameInfo| matches!(f.frame, Frame::Lua(_)) && f.label.is_none();
        if !pi.frames.iter().any(unlabelled) {
            continue;
        }
        let key = pi.frames.as_ptr();
        if let Some((_, done)) = shared.get(&key) {
            pi.frames = done.clone();
            continue;
        }
        let done: Arc<[FrameInfo]> = pi
            .frames
            .iter()
            .map(|f| match f.frame {
                Frame::Lua(id) if f.label.is_none() => FrameInfo {
                    label: name(id).map(Arc::from),
                    ..f.clone()
                },
                _ => f.clone(),
            })
            .collect();
        shared.insert(key, (pi.frames.clone(), done.clone()));
        pi.frames = done;
    }
}

/// Replaces a suspended (or never started) fiber's frames with the source's, when it has
/// some: its own frames labelled, the native ones resolved as before.
fn add_source_frames(src: &dyn FrameSource, fi: &mut FiberInfo, resolve: bool) {
    if fi.status == Status::Running {
        return;
    }
    let Some(native) = &fi.backtrace else {
        return;
    };
    let raw: Vec<Frame> = native.iter().map(|f| f.frame).collect();
    let Some(frames) = src.frames(fi.id, &raw) else {
        return;
    };
    fi.backtrace = Some(labelled(&frames, |id| src.name(id), resolve));
}

/// A layer's frames for a report: its own labelled by `name`, the native ones resolved
/// (when `resolve`).
fn labelled(
    frames: &[Frame],
    name: impl Fn(fibertrace_core::LuaFrameId) -> Option<String>,
    resolve: bool,
) -> Arc<[FrameInfo]> {
    frames
        .iter()
        .map(|f| match f {
            Frame::Lua(id) => FrameInfo {
                frame: *f,
                resolved: None,
                label: name(*id).map(Arc::from),
            },
            _ => FrameInfo {
                frame: *f,
                resolved: if resolve { symbolize::resolve(f) } else { None },
                label: None,
            },
        })
        .collect()
}

/// The hooks the scheduler calls (see [`crate::sched`]), filled with this layer's functions.
pub(crate) static HOOKS: crate::sched::Hooks = crate::sched::Hooks {
    enter_thread: sample::prepare_thread,
    panicked: dump::write_panic_report,
    dropped: source::forget,
    asked: serve,
};

impl crate::Scheduler {
    /// Info about this scheduler's fibers (with a registered [`FrameSource`]'s frames, when
    /// called on this scheduler's thread).
    #[inline(never)]
    pub fn info(&self, opts: &InfoOptions) -> Vec<FiberInfo> {
        report_entry!();
        scheduler_snapshot(self.shared(), opts).fibers
    }

    /// Sets (or with `None` removes) how a dump or report asked from another thread brings
    /// this scheduler's running fiber to a safe point where the layer above (a Lua host) reads
    /// its frames: see [`SafePointArm`] and [`serve_at_safe_point`].
    pub fn set_safe_point_arm(&self, arm: Option<SafePointArm>) {
        self.shared().on_thread.set_arm(arm);
    }

    /// Sets (or with `None` removes) the source of frames that a layer above the runtime
    /// adds to this scheduler's fibers (a Lua host: their Lua frames), used by the reports
    /// built on this scheduler's thread, the deadlock report among them. See
    /// [`FrameSource`].
    pub fn set_frame_source(&self, source: Option<std::rc::Rc<dyn FrameSource>>) {
        source::set(self.id(), source);
    }

    /// Registers (or with `None` removes) the [`HeldSource`] of this scheduler's layer: a
    /// report taken on another thread while this scheduler's thread is away in native code
    /// (past [`SOURCE_WAIT`]) holds that thread still and reads the layer's frames with it.
    pub fn set_held_source(&self, source: Option<Arc<dyn HeldSource>>) {
        source::set_held(self.id(), source);
    }

    /// The report for a deadlock returned by [`crate::Scheduler::run`]: `all fibers are
    /// asleep — deadlock!`, the wait-for graph (what each fiber waits on, who else could end
    /// the wait, and the cycles: [`waitgraph`]) and the dump of this scheduler's fibers
    /// (where each waits). Call it on the scheduler's thread.
    #[inline(never)]
    pub fn deadlock_report(&self) -> String {
        report_entry!();
        let part = scheduler_snapshot(self.shared(), &InfoOptions::default());
        let mut out = String::from("all fibers are asleep — deadlock!\n\n");
        let graph = wait_graph_of(self.id(), &part.fibers);
        if !graph.nodes.is_empty() {
            graph.render(&mut out);
            out.push('\n');
        }
        dump::render_scheduler_in_view(&part, &mut out);
        out
    }

    /// The wait-for graph of this scheduler's blocked fibers (see [`waitgraph`]). Call it on
    /// the scheduler's thread: elsewhere the objects' users are not known, and the graph has
    /// only the joins.
    pub fn wait_graph(&self) -> waitgraph::WaitGraph {
        let opts = InfoOptions {
            backtrace: false,
            resolve: false,
            parent_backtrace: false,
            ..InfoOptions::default()
        };
        let fibers = info::scheduler_info(self.shared(), &opts);
        wait_graph_of(self.id(), &fibers)
    }
}

/// The wait-for graph of scheduler `sched`'s `fibers`, with the objects its frame source sees
/// held (on its thread).
fn wait_graph_of(sched: u64, fibers: &[FiberInfo]) -> waitgraph::WaitGraph {
    let src = source::source(sched);
    let holds = |f: FiberId| src.as_ref().map(|s| s.holds(f)).unwrap_or_default();
    waitgraph::build(fibers, &holds, &crate::sync::users_of)
}
