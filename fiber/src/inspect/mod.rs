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
//! Nothing below `inspect` names it: the scheduler calls up through [`crate::sched`]'s hooks,
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
//! its scheduler: a snapshot taken on that scheduler's thread carries each suspended fiber's
//! frames with the layer's frames interleaved and labelled ([`FrameInfo::label`]).
//!
//! How a snapshot can be wrong: it is not atomic across fibers — each fiber is read at its
//! own moment, so a fiber can appear waiting on a channel that another fiber, read later, has
//! just written to; a running fiber's sample may name where it was a few microseconds before
//! the sample was read. A snapshot taken on another thread than a Lua scheduler's shows that
//! scheduler's fibers with native frames only (their Lua state may be read only on its own
//! thread).

pub mod dump;
pub mod info;
pub mod sample;
mod source;
pub mod watchdog;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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
            .map(|s| scheduler_snapshot(s, opts))
            .collect(),
    }
}

/// One scheduler's part of a snapshot. On that scheduler's own thread, a registered
/// [`FrameSource`] adds its frames to the fibers' traces.
#[inline(never)]
pub fn scheduler_snapshot(s: &SchedShared, opts: &InfoOptions) -> SchedulerSnapshot {
    report_entry!();
    let mut fibers = info::scheduler_info(s, opts);
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
    /// asleep — deadlock!` and the dump of this scheduler's fibers (what each waits on, and
    /// where).
    #[inline(never)]
    pub fn deadlock_report(&self) -> String {
        report_entry!();
        let mut out = String::from("all fibers are asleep — deadlock!\n\n");
        dump::scheduler_text(self.shared(), &mut out);
        out
    }
}
