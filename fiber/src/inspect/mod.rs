//! Inspection: what every fiber is doing, read from outside the runtime's machinery, and
//! every report built from it.
//!
//! The layers of this crate, each using only the ones before it:
//!
//! ```text
//! clock, frames, task/          a fiber: control block, run state, parent trace
//! running, overflow, stack      what a scheduler's thread runs now; the stacks
//! registry                      every scheduler and fiber of the process
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
//! it at most [`SOURCE_WAIT`]; a scheduler that does not come back to its loop by then (a
//! fiber runs without yielding, or the thread waits outside the runtime) gets its part built
//! from the asking thread, with native frames only, and a note that says so
//! ([`SchedulerSnapshot::note`]).
//!
//! How a snapshot can be wrong: it is not atomic across fibers — each fiber is read at its
//! own moment, so a fiber can appear waiting on a channel that another fiber, read later, has
//! just written to; a running fiber's sample may name where it was a few microseconds before
//! the sample was read. A scheduler's part built on its own thread at its next turn is of
//! that moment, up to [`SOURCE_WAIT`] after the other schedulers' parts.

pub mod dump;
pub mod export;
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
use crate::task::{FiberId, Status};
pub use info::{FiberInfo, InfoOptions, ParentInfo, Waiting};
pub use source::FrameSource;

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
    let mut fibers = match only {
        None => info::scheduler_info(s, opts),
        Some(id) => s
            .fiber(id)
            .and_then(|f| info::info_of(&f, opts))
            .into_iter()
            .collect(),
    };
    if let Some(src) = source::source(s.id) {
        for fi in &mut fibers {
            add_source_frames(&*src, fi, opts.resolve);
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
    }
}

/// How long a snapshot taken on another thread waits for a scheduler with a frame source to
/// build its own part (see the module doc).
pub const SOURCE_WAIT: Duration = Duration::from_millis(200);

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
    let elsewhere = source::registered(s.id) && source::source(s.id).is_none();
    let handle = s.on_thread.handle.get();
    let (true, Some(thread)) = (elsewhere, handle) else {
        return build_part(s, opts, only);
    };
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
    if let Some(p) = wait_for(&asked, wait) {
        return p;
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
            return p;
        }
    }
    let mut p = build_part(s, opts, only);
    p.note = Some(format!(
        "frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
         not come back to its run loop within {} ms (a fiber runs without yielding, or the \
         thread waits outside the runtime)",
        wait.as_millis()
    ));
    p
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

/// The scheduler's `asked` hook: builds the parts asked of it, on its own thread, between
/// fibers.
fn serve(s: &SchedShared) {
    let mine: Vec<Arc<Asked>> = {
        let mut v = lock(&ASKED);
        let (mine, rest) = v.drain(..).partition(|a| a.sched == s.id);
        *v = rest;
        mine
    };
    for a in mine {
        let p = build_part(s, &a.opts, a.only);
        *lock(&a.part) = Some(p);
        a.done.notify_all();
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
    let list: Arc<[FrameInfo]> = frames
        .iter()
        .map(|f| match f {
            Frame::Lua(id) => FrameInfo {
                frame: *f,
                resolved: None,
                label: src.name(*id).map(Arc::from),
            },
            _ => FrameInfo {
                frame: *f,
                resolved: if resolve { symbolize::resolve(f) } else { None },
                label: None,
            },
        })
        .collect();
    fi.backtrace = Some(list);
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

    /// Sets (or with `None` removes) the source of frames that a layer above the runtime
    /// adds to this scheduler's fibers (a Lua host: their Lua frames), used by the reports
    /// built on this scheduler's thread, the deadlock report among them. See
    /// [`FrameSource`].
    pub fn set_frame_source(&self, source: Option<std::rc::Rc<dyn FrameSource>>) {
        source::set(self.id(), source);
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
