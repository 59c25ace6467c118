//! Fiber info: what every fiber is, does, waits on and where it is — as serializable values,
//! readable from any thread of the process.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fibertrace_core::{Backtrace, CaptureOptions, Frame, Unwinder};
use serde::{Deserialize, Serialize};

use crate::frames::frames_info_shared;
pub use crate::frames::{frames_info, user_frames, without_trampoline, FrameInfo};
use crate::registry::{self, SchedShared};
use crate::sched;
use crate::task::{ControlBlock, FiberId, RunState, Status, WaitOn};

/// What to include.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InfoOptions {
    /// Include each fiber's backtrace.
    pub backtrace: bool,
    /// Resolve frames to names and lines (otherwise raw frames only).
    pub resolve: bool,
    /// Include the parent traces.
    pub parent_backtrace: bool,
    /// Unwinder for suspended fibers.
    pub unwinder: Unwinder,
    /// Sample fibers running on other threads (a signal each); otherwise they show no trace.
    pub sample_running: bool,
}

impl Default for InfoOptions {
    fn default() -> Self {
        InfoOptions {
            backtrace: true,
            resolve: true,
            parent_backtrace: true,
            unwinder: Unwinder::Auto,
            sample_running: true,
        }
    }
}

/// One ancestor's trace.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParentInfo {
    /// The ancestor fiber (`None`: a thread outside any fiber).
    pub fiber: Option<FiberId>,
    /// Its name when it created the child.
    pub name: Arc<str>,
    /// Its frames at that moment (shared: resolved once per trace).
    pub frames: Arc<[FrameInfo]>,
}

/// What a blocked fiber waits on, and for how long.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Waiting {
    /// The object.
    pub on: WaitOn,
    /// In words (`channel receive`, `sleep`, `join fiber 12`).
    pub what: Cow<'static, str>,
    /// Seconds waited so far.
    pub seconds: f64,
}

/// Everything known about one fiber.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FiberInfo {
    /// Id.
    pub id: FiberId,
    /// Name.
    pub name: Arc<str>,
    /// Scheduler id.
    pub scheduler: u64,
    /// Status.
    pub status: Status,
    /// Seconds in the current status.
    pub status_seconds: f64,
    /// What it waits on (blocked fibers).
    pub waiting: Option<Waiting>,
    /// Context switches (resumes) so far.
    pub csw: u64,
    /// CPU time it ran, in seconds, counted while its scheduler timed runs (see
    /// [`crate::ControlBlock::cpu_time`]; 0 when it never did).
    pub cpu_time: f64,
    /// Whether `cpu_time` was counted at all: false when its scheduler never timed its runs
    /// (no `SchedulerOptions::cpu_time`, `fiber.top` never on) — its 0 is then not a
    /// measurement — and in a dump of another process.
    #[serde(default)]
    pub cpu_time_counted: bool,
    /// Stack size in bytes.
    pub stack_size: usize,
    /// Stack in use at the last suspension, in bytes.
    pub stack_used: usize,
    /// Deepest stack use seen at a suspension or sample (high-water mark), in bytes.
    pub stack_used_max: usize,
    /// Creation time, seconds since the Unix epoch.
    pub created: f64,
    /// Age in seconds.
    pub age: f64,
    /// The fiber that created it.
    pub parent: Option<FiberId>,
    /// What it runs: the type of its entry closure (or the Lua function a host names).
    pub entry: Cow<'static, str>,
    /// Its backtrace (innermost first). Shared: a fiber that has not run since an earlier
    /// call hands out the same list.
    pub backtrace: Option<Arc<[FrameInfo]>>,
    /// Its nearest ancestors' traces, direct parent first: at most
    /// [`crate::task::PARENT_DEPTH_SHOWN`].
    pub parent_backtrace: Vec<ParentInfo>,
    /// How many more ancestors it has past those in `parent_backtrace` (not shown: the cap).
    #[serde(default)]
    pub parent_backtrace_omitted: u64,
    /// The heap charged to it and still live (when a `fibertrace_core::heap::Tracked`
    /// allocator tracks the process; estimates in its sampled tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap: Option<fibertrace_core::heap::Usage>,
}

thread_local! {
    /// Registers of the outermost report entry point running on this thread (sp 0: none).
    static ORIGIN: std::cell::Cell<fibertrace_core::Registers> =
        const { std::cell::Cell::new(fibertrace_core::Registers { ip: 0, sp: 0, fp: 0 }) };
}

/// The report entry point running on this thread (see `report_entry!`): set by the
/// outermost one, cleared when it returns.
pub(crate) struct ReportOrigin {
    set: bool,
}

impl ReportOrigin {
    #[inline(always)]
    pub(crate) fn enter(regs: fibertrace_core::Registers) -> ReportOrigin {
        let set = ORIGIN.with(|o| {
            if o.get().sp == 0 {
                o.set(regs);
                true
            } else {
                false
            }
        });
        ReportOrigin { set }
    }

    /// The registers of the outermost report entry point running now, if any.
    pub(crate) fn current() -> Option<fibertrace_core::Registers> {
        let r = ORIGIN.with(|o| o.get());
        (r.sp != 0).then_some(r)
    }
}

impl Drop for ReportOrigin {
    fn drop(&mut self) {
        if self.set {
            ORIGIN.with(|o| o.set(fibertrace_core::Registers::default()));
        }
    }
}

/// Info about every fiber of every scheduler in the process.
#[inline(never)]
pub fn info(opts: &InfoOptions) -> Vec<FiberInfo> {
    report_entry!();
    let mut out = Vec::new();
    for s in registry::schedulers() {
        out.extend(scheduler_info(&s, opts));
    }
    out
}

/// Info about one fiber (any scheduler).
#[inline(never)]
pub fn fiber_info(id: FiberId, opts: &InfoOptions) -> Option<FiberInfo> {
    report_entry!();
    let (s, f) = registry::find(id)?;
    Some(one(&f, opts, None, &Now::new(), cpu_counted(&s)))
}

/// Info about the fiber whose control block is `f`, of scheduler `s` (no registry lookup);
/// `here`, when it is of this fiber, gives its frames (the running fiber's, taken at a safe
/// point).
pub(crate) fn info_of(
    s: &SchedShared,
    f: &Arc<ControlBlock>,
    opts: &InfoOptions,
    here: Option<&super::sample::Sample>,
) -> Option<FiberInfo> {
    Some(one(f, opts, here, &Now::new(), cpu_counted(s)))
}

/// The clocks (and the tick rate) read once per call, not once per fiber.
struct Now {
    ticks: u64,
    rate: crate::clock::Rate,
    unix: f64,
}

impl Now {
    fn new() -> Now {
        Now {
            ticks: crate::clock::ticks(),
            rate: crate::clock::Rate::now(),
            unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
        }
    }

    fn since(&self, t: u64) -> f64 {
        self.rate
            .duration(self.ticks.saturating_sub(t))
            .as_secs_f64()
    }
}

/// How many fibers ahead a pass over fibers prefetches control blocks.
const PREFETCH_AHEAD: usize = 4;

/// Info about one scheduler's fibers.
#[inline(never)]
pub fn scheduler_info(s: &SchedShared, opts: &InfoOptions) -> Vec<FiberInfo> {
    report_entry!();
    scheduler_info_with(s, opts, None)
}

/// [`scheduler_info`], with the running fiber's frames given (`here`: taken inside it at a
/// safe point, see [`super::serve_at_safe_point`]) instead of sampled or captured.
pub(crate) fn scheduler_info_with(
    s: &SchedShared,
    opts: &InfoOptions,
    here: Option<super::sample::Sample>,
) -> Vec<FiberInfo> {
    let fibers = s.fibers();
    // A running fiber on another thread: one sample for the whole scheduler.
    let running = s.on_thread.running();
    let sampled = if here.is_some() {
        here
    } else if opts.backtrace
        && opts.sample_running
        && running != 0
        && running != sched::current_id()
    {
        super::sample::sample(s, Duration::from_millis(200))
    } else {
        None
    };
    let now = Now::new();
    let counted = cpu_counted(s);
    let mut out = Vec::with_capacity(fibers.len());
    for (i, f) in fibers.iter().enumerate() {
        // Memory, not work, bounds a pass over thousands of cold control blocks and stacks:
        // start the loads of the next fibers' lines early so that they overlap.
        if let Some(n) = fibers.get(i + PREFETCH_AHEAD) {
            n.prefetch_block();
        }
        if opts.backtrace {
            if let Some(n) = fibers.get(i + 1) {
                n.prefetch_stack();
            }
        }
        out.push(one(f, opts, sampled.as_ref(), &now, counted));
    }
    out
}

/// Whether scheduler `s` ever counted its fibers' CPU time (read once per listing).
fn cpu_counted(s: &SchedShared) -> bool {
    s.cpu_counted.load(Ordering::Relaxed)
}

fn one(
    f: &Arc<ControlBlock>,
    opts: &InfoOptions,
    sample: Option<&super::sample::Sample>,
    now: &Now,
    cpu_time_counted: bool,
) -> FiberInfo {
    let (status, on, since) = f.status_raw();
    let in_status = now.since(since);
    let backtrace = if opts.backtrace {
        match sample {
            Some(smp) if smp.fiber == f.id => {
                Some(frames_info_shared(smp.backtrace.frames(), opts.resolve))
            }
            _ => info_backtrace(f, opts, opts.sample_running && sample.is_none()),
        }
    } else {
        None
    };
    // The nearest ancestors only (each one's frames a list shared by all its descendants):
    // over a chain of D fibers the whole call is O(D), not O(D²).
    let (parent_backtrace, parent_backtrace_omitted) = match &f.parent_trace {
        Some(t) if opts.backtrace && opts.parent_backtrace => (
            t.shown()
                .map(|p| ParentInfo {
                    fiber: p.fiber,
                    name: p.name(),
                    frames: p.frames_info(opts.resolve),
                })
                .collect(),
            t.omitted(),
        ),
        _ => (Vec::new(), 0),
    };
    let hi = f.stack.hi;
    let waiting = on.map(|on| Waiting {
        what: on.words(),
        on,
        seconds: in_status,
    });
    let age = now.since(f.created.load(Ordering::Relaxed));
    FiberInfo {
        id: f.id,
        name: f.name_arc(),
        scheduler: f.sched,
        status,
        status_seconds: in_status,
        waiting,
        csw: f.csw.load(Ordering::Relaxed),
        cpu_time: now
            .rate
            .duration(f.cpu_ticks.load(Ordering::Relaxed))
            .as_secs_f64(),
        cpu_time_counted,
        stack_size: f.stack_size,
        stack_used: hi.saturating_sub(f.last_sp.load(Ordering::Relaxed)) as usize,
        stack_used_max: hi.saturating_sub(f.min_sp.load(Ordering::Relaxed)) as usize,
        created: (now.unix - age).max(0.0),
        age,
        parent: f.parent,
        entry: Cow::Borrowed(f.entry_name),
        backtrace,
        parent_backtrace,
        parent_backtrace_omitted,
        heap: (fibertrace_core::heap::tier() != fibertrace_core::heap::Tier::Off)
            .then(|| f.heap.usage()),
    }
}

/// A fiber's frames for info: a suspended fiber's from its walk kept since it last ran (or a
/// new walk), others captured now.
fn info_backtrace(
    f: &Arc<ControlBlock>,
    opts: &InfoOptions,
    sample_running: bool,
) -> Option<Arc<[FrameInfo]>> {
    let copts = CaptureOptions {
        unwinder: opts.unwinder,
        offset: 1, // the suspend wrapper
        ..CaptureOptions::default()
    };
    if sched::current_id() != f.id && f.run.get(Ordering::Acquire) == RunState::Suspended {
        let resolve = opts.resolve;
        if let Some(v) = f.suspended_info(&copts, resolve, |frames| {
            frames_info_shared(frames, resolve)
        }) {
            return Some(v);
        }
    }
    // Running, new, dead, or it moved in the meantime.
    backtrace_of(f, opts.unwinder, sample_running, true)
        .map(|bt| frames_info_shared(bt.frames(), opts.resolve))
}

/// A fiber's backtrace now (see [`crate::Fiber::backtrace`]).
pub(crate) fn fiber_backtrace(f: &Arc<ControlBlock>, unwinder: Unwinder) -> Option<Backtrace> {
    backtrace_of(f, unwinder, true, true)
}

#[inline(never)]
fn backtrace_of(
    f: &Arc<ControlBlock>,
    unwinder: Unwinder,
    sample_running: bool,
    keep: bool,
) -> Option<Backtrace> {
    let mut bt = Backtrace::new();
    backtrace_into(f, unwinder, sample_running, keep, &mut bt).then_some(bt)
}

/// [`backtrace_of`] into `out` (a backtrace is a kilobyte: a listing that walks every fiber
/// copied each one twice on its way out); `false` (and `out` empty) when there is none.
/// Inlined into its two callers, so that the current fiber's own trace is taken as many
/// frames below the public entry as before (`current_backtrace`'s offset).
#[inline(always)]
fn backtrace_into(
    f: &Arc<ControlBlock>,
    unwinder: Unwinder,
    sample_running: bool,
    keep: bool,
    out: &mut Backtrace,
) -> bool {
    out.clear();
    if sched::current_id() == f.id {
        *out = current_backtrace(f, unwinder);
        return true;
    }
    let opts = CaptureOptions {
        unwinder,
        offset: 1, // the suspend wrapper
        ..CaptureOptions::default()
    };
    for _ in 0..1000 {
        match f.run.get(Ordering::Acquire) {
            RunState::New => {
                out.set_frames(&[entry_frame(f)]);
                return true;
            }
            RunState::Dead => return false,
            RunState::Running => {
                if !sample_running {
                    return false;
                }
                let sampled = registry::scheduler(f.sched)
                    .and_then(|s| super::sample::sample(&s, Duration::from_millis(200)))
                    .filter(|smp| smp.fiber == f.id);
                return match sampled {
                    Some(smp) => {
                        *out = smp.backtrace;
                        true
                    }
                    None => false,
                };
            }
            RunState::Inspecting => {
                std::thread::yield_now();
                continue;
            }
            RunState::Suspended => {}
        }
        if f.inspect_suspended(&opts, out, keep) {
            return true;
        }
        out.clear();
        if !f.traced {
            return false;
        }
    }
    false
}

/// The trace of a fiber only if it is suspended right now (no sampling, no own-stack
/// capture): one walk under the inspection handshake.
pub fn suspended_backtrace(f: &crate::Fiber, unwinder: Unwinder) -> Option<Backtrace> {
    let opts = CaptureOptions {
        unwinder,
        offset: 1,
        ..CaptureOptions::default()
    };
    let mut bt = Backtrace::new();
    f.control_block()
        .inspect_suspended(&opts, &mut bt, true)
        .then_some(bt)
}

/// Whether a status means the fiber is blocked waiting (for reports of long waits).
pub fn is_blocked(status: Status) -> bool {
    matches!(
        status,
        Status::Waiting | Status::Sleeping | Status::Suspended
    )
}

/// The frame shown for a fiber that never ran: its entry function.
fn entry_frame(shared: &ControlBlock) -> Frame {
    Frame::Pc(shared.entry_fn)
}

/// The current fiber's trace (from inside it), cut at its entry. Inside a report (see
/// `report_entry!`) it starts at the caller of the report's entry point.
#[inline(never)]
fn current_backtrace(shared: &ControlBlock, unwinder: Unwinder) -> Backtrace {
    let mut bt = Backtrace::new();
    let stop = shared.entry_sp.load(Ordering::Relaxed);
    match ReportOrigin::current() {
        Some(origin) => {
            let opts = CaptureOptions::with_unwinder(unwinder);
            fibertrace_core::collect_from_origin(origin, &opts, stop, &mut bt);
        }
        None => {
            let opts = CaptureOptions {
                unwinder,
                offset: 2, // this function and info's caller
                ..CaptureOptions::default()
            };
            fibertrace_core::collect_until(&opts, stop, &mut bt);
        }
    }
    bt
}

impl crate::Fiber {
    /// Its backtrace now: the current fiber's own stack, a suspended fiber's saved context,
    /// the entry function of one that never ran, a sample of one running on another thread;
    /// `None` for a dead fiber.
    #[inline(never)]
    pub fn backtrace(&self, unwinder: Unwinder) -> Option<Backtrace> {
        report_entry!();
        fiber_backtrace(self.control_block(), unwinder)
    }

    /// [`crate::Fiber::backtrace`] for a caller that keeps traces of its own (the Lua host's
    /// `fiber.info()` keeps each fiber's interleaved trace): a suspended fiber's stack is
    /// walked afresh and the walk is not kept in the fiber (no copy made, none freed; the
    /// next [`crate::Fiber::backtrace`] walks again). The same frames otherwise.
    #[inline(never)]
    pub fn backtrace_unkept(&self, unwinder: Unwinder) -> Option<Backtrace> {
        report_entry!();
        backtrace_of(self.control_block(), unwinder, true, false)
    }

    /// [`crate::Fiber::backtrace_unkept`] into `out` (no copy of the backtrace on its way
    /// out): `false`, and `out` empty, exactly when `backtrace_unkept` gives `None` (the
    /// fiber ended; or it runs on another thread and no sample of it came).
    #[inline(never)]
    pub fn backtrace_unkept_into(&self, unwinder: Unwinder, out: &mut Backtrace) -> bool {
        report_entry!();
        backtrace_into(self.control_block(), unwinder, true, false, out)
    }
}

#[cfg(test)]
mod tests {
    use crate::Scheduler;
    use fibertrace_core::Unwinder;

    /// A walk for a caller that keeps traces itself is not kept in the fiber (and does not
    /// take the fiber's kept walk for one of its own); a plain walk is kept.
    #[test]
    fn an_unkept_walk_leaves_the_fiber_without_a_kept_walk() {
        Scheduler::new()
            .block_on(|| {
                let h = crate::spawn(crate::suspend);
                crate::yield_now();
                let f = h.fiber().clone();
                let cb = f.control_block();
                assert!(!cb.has_kept_walk());
                let a = f.backtrace_unkept(Unwinder::Fast).unwrap();
                assert!(!a.is_empty());
                assert!(!cb.has_kept_walk());
                let b = f.backtrace(Unwinder::Fast).unwrap();
                assert!(cb.has_kept_walk());
                assert_eq!(a, b);
                assert_eq!(f.backtrace_unkept(Unwinder::Fast).unwrap(), b);
                // Into a buffer that held another trace: the same frames, nothing of the old.
                let mut into =
                    fibertrace_core::Backtrace::from_frames(&[fibertrace_core::Frame::Pc(1); 50]);
                assert!(f.backtrace_unkept_into(Unwinder::Fast, &mut into));
                assert_eq!(into, b);
                f.wakeup();
                h.join().unwrap();
                // Ended: nothing, and the buffer left empty.
                assert!(!f.backtrace_unkept_into(Unwinder::Fast, &mut into));
                assert!(into.is_empty());
                // The current fiber: its own stack, as deep as `backtrace_unkept` gives it.
                let me = crate::current().unwrap();
                let mut own = fibertrace_core::Backtrace::new();
                assert!(me.backtrace_unkept_into(Unwinder::Fast, &mut own));
                let plain = me.backtrace_unkept(Unwinder::Fast).unwrap();
                assert!(!own.is_empty());
                assert_eq!(own.frames().len(), plain.frames().len());
                // Never ran: its entry function, as `backtrace` gives.
                let n = crate::spawn(|| {});
                let mut fresh = fibertrace_core::Backtrace::new();
                assert!(n.fiber().backtrace_unkept_into(Unwinder::Fast, &mut fresh));
                assert_eq!(Some(fresh), n.fiber().backtrace(Unwinder::Fast));
                n.join().unwrap();
            })
            .unwrap();
    }
}
