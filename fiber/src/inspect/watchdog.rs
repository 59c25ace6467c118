//! The stall detector: a watchdog thread that finds the fiber that hogs its thread.
//!
//! A fiber that runs longer than a threshold without yielding stalls every other fiber of
//! its scheduler. The watchdog polls each scheduler's published state (which fiber runs and
//! how many resumes there have been — no clock is read on the switch path for this); when one
//! run lasts past the threshold it samples the running fiber with a signal (see
//! [`super::sample`]: capture inside the handler, on an alternate stack, no lock, no
//! allocation) and reports, outside the handler, `fiber 7 "worker" has run 250 ms without
//! yielding:` and the symbolized frames. While the stall lasts it reports again at 2×, 4×…
//! the threshold. Reports are rate-limited; the next one says how many were suppressed (or,
//! when no report follows within the second, a [`Report::Suppressed`] does). A count still
//! pending when the program ends is the program's to say: [`take_suppressed`] (or
//! [`stop`], which delivers it). A program about to end waits for a report still being made
//! with [`flush`] (its exit would cut it off).
//!
//! A run is measured in the CPU time of the scheduler's thread, so a thread the OS
//! preempted under load is not taken for a hogging fiber. A fiber blocked in the kernel (a
//! blocking system call inside a fiber also stalls its scheduler, but uses no CPU) is
//! reported when its run's wall time passes four thresholds (at least threshold + 200 ms),
//! less the time its thread waited on a run queue meanwhile (runnable but given no CPU: an
//! overloaded machine, a cgroup's spent CPU quota), as the kernel's scheduler statistics
//! count it, and only while the thread is not runnable (blocked or asleep in the kernel, not
//! waiting for a CPU): a preempted run is not a blocked one. Where those cannot be read (no
//! procfs) a run preempted that long is reported as blocked.
//! A run is timed from its start when its scheduler times runs (`SchedulerOptions::cpu_time`,
//! or `fiber.top` on: the start is published), otherwise from when the watchdog first saw it:
//! then it is reported up to a tick (a quarter of the threshold) later, its time that much
//! short.
//!
//! It never fires for a fiber that yields (each resume starts a new run) nor while the
//! scheduler is idle waiting for a timer (no fiber runs then).
//!
//! Where the stalled fiber runs Lua, its Lua frames cannot be read from another thread while
//! it runs: after the sample, the watchdog asks the scheduler's layer above the runtime (the
//! Lua host) to bring the fiber to a safe point and read its frames there, interleaved (see
//! [`super::serve_at_safe_point`]), and waits at most [`super::SOURCE_WAIT`] for them; a
//! fiber that does not get there (it runs C code that does not return to Lua) is reported
//! with its native frames and a note that says why (a host can word it: [`set_annotator`]).
//! A fiber reported by wall time (blocked in the kernel) is read with its thread held still
//! first, where the layer reads held threads ([`super::HeldSource`]): its next safe point
//! comes after the blocking call returned. How it can be wrong: a layer without a held reader
//! gives the frames of that later point (the report says so).
//!
//! A blocked fiber's report ([`Config::blocked_longer_than`]) is a view of the snapshot: for a
//! scheduler with a [`crate::FrameSource`] (a Lua host), it is built on that scheduler's thread
//! at its next turn, so it has the fiber's Lua frames; a scheduler that does not come back to
//! its run loop within [`super::SOURCE_WAIT`] gets a report with native frames and a note
//! saying why, and is not asked again in the same scan (the watchdog waits at most that long
//! per scheduler and scan).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use fibertrace_core::Backtrace;

use crate::registry::{self, SchedShared};
use crate::task::{FiberId, Status};
use crate::FrameInfo;

/// Watchdog settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// A run longer than this is a stall.
    pub threshold: Duration,
    /// At most this many reports per second; the others are counted and the next report says
    /// how many were suppressed.
    pub max_reports_per_sec: u32,
    /// Also report fibers blocked (waiting on a channel, condition, join or wake-up) longer
    /// than this, once per wait.
    pub blocked_longer_than: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threshold: Duration::from_millis(250),
            max_reports_per_sec: 10,
            blocked_longer_than: None,
        }
    }
}

/// A stall: which fiber, how long, where.
#[derive(Clone, Debug)]
pub struct StallReport {
    /// Scheduler id.
    pub scheduler: u64,
    /// The fiber.
    pub fiber: FiberId,
    /// Its name.
    pub name: String,
    /// How long it had run without yielding when sampled.
    pub running_for: Duration,
    /// Its stack at that moment (innermost first, cut at its entry): native frames.
    pub backtrace: Backtrace,
    /// Its frames with a layer's above the runtime interleaved (a Lua fiber's Lua frames),
    /// read inside it at the safe point the layer brought it to right after the sample (see
    /// [`super::serve_at_safe_point`]); the report shows these. `None`: the scheduler has
    /// no such layer, or the fiber did not reach a safe point in time (the note says why).
    pub frames: Option<Arc<[FrameInfo]>>,
    /// Signal-to-sample latency.
    pub latency: Duration,
    /// Time the walk took inside the signal handler.
    pub handler_time: Duration,
    /// Reports suppressed by rate limiting since the previous one.
    pub suppressed: u64,
    /// A host's note (e.g. about Lua frames).
    pub note: Option<String>,
}

impl StallReport {
    /// The report as text: a header line and the frames.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "fiber {} {} has run {} without yielding:\n",
            self.fiber,
            crate::sched::quoted_name(&self.name),
            super::dump::human(self.running_for)
        );
        match &self.frames {
            Some(f) => s.push_str(&super::dump::render_list(f)),
            None => s.push_str(&super::dump::render_frames(self.backtrace.frames())),
        }
        if let Some(n) = &self.note {
            s.push_str(&format!("    ({n})\n"));
        }
        if self.suppressed > 0 {
            s.push_str(&format!("    (suppressed {} reports)\n", self.suppressed));
        }
        s
    }
}

/// A fiber blocked longer than [`Config::blocked_longer_than`].
#[derive(Clone, Debug)]
pub struct BlockedReport {
    /// Scheduler id.
    pub scheduler: u64,
    /// The fiber, as a snapshot shows it: what it waits on and since when, its frames (with a
    /// frame source's, e.g. its Lua frames, interleaved).
    pub fiber: super::info::FiberInfo,
    /// What the report could not show, and why (a frame source whose scheduler did not come
    /// back to its run loop in time).
    pub note: Option<String>,
}

/// What the watchdog delivers.
#[derive(Clone, Debug)]
pub enum Report {
    /// A fiber hogs its thread.
    Stall(Box<StallReport>),
    /// A fiber has been blocked longer than the configured limit.
    Blocked(Box<BlockedReport>),
    /// Stall reports dropped by the rate limit in a window of a second with no report
    /// after them to carry the count (a burst that ended): nothing is dropped unsaid.
    Suppressed(u64),
    /// Blocked fibers found past the rate limit ([`Config::max_reports_per_sec`] blocked
    /// reports a second): counted, not reported one by one (thousands of fibers waiting on
    /// one channel made as many reports at once), and said once the second is over (or as
    /// the program ends, [`finish`]).
    BlockedSuppressed(u64),
}

impl Report {
    /// The report as text, as the default handler prints it.
    pub fn to_text(&self) -> String {
        match self {
            Report::Stall(s) => s.to_text(),
            Report::Blocked(b) => {
                let mut s = String::from("blocked: ");
                super::dump::render_fiber(&b.fiber, &mut s);
                if let Some(n) = &b.note {
                    s.push_str(&format!("    ({n})\n"));
                }
                // A blank line ends it, as it ends each fiber of a dump.
                s.push('\n');
                s
            }
            Report::Suppressed(n) => {
                format!("fibertrace: {n} more stall reports suppressed by the rate limit\n")
            }
            Report::BlockedSuppressed(n) => {
                let fibers = if *n == 1 { "fiber" } else { "fibers" };
                format!(
                    "fibertrace: {n} more {fibers} blocked past the limit, not reported (the \
                     rate limit)\n\n"
                )
            }
        }
    }
}

type Handler = Box<dyn Fn(&Report) + Send + Sync>;
type Annotator = fn(&Backtrace) -> Option<String>;

struct State {
    config: Mutex<Config>,
    handler: Mutex<Option<Handler>>,
    annotator: Mutex<Option<Annotator>>,
    stop: AtomicBool,
    running: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    reports: AtomicU64,
    /// Stall reports dropped by the rate limit and not yet counted in a delivered report.
    suppressed: AtomicU64,
    /// Reports being made now, from the sample (or the scan) that found them to their
    /// delivery: what [`flush`] waits for.
    in_flight: AtomicU64,
    /// The program is ending ([`finish`]): no new report is begun.
    closing: AtomicBool,
    /// Blocked fibers past the rate limit not yet counted in a delivered line.
    blocked_suppressed: AtomicU64,
}

thread_local! {
    /// Set on the watchdog's own thread (a report handler that ends the program runs there:
    /// its `flush` would wait for its own report).
    static ON_WATCHDOG: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts a report as being made while it lives (see [`flush`]).
struct InFlight;

impl InFlight {
    fn new() -> InFlight {
        state().in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        state().in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| State {
        config: Mutex::new(Config::default()),
        handler: Mutex::new(None),
        annotator: Mutex::new(None),
        stop: AtomicBool::new(false),
        running: AtomicBool::new(false),
        thread: Mutex::new(None),
        reports: AtomicU64::new(0),
        suppressed: AtomicU64::new(0),
        in_flight: AtomicU64::new(0),
        closing: AtomicBool::new(false),
        blocked_suppressed: AtomicU64::new(0),
    })
}

/// Starts the watchdog (or updates its settings if it runs). Reports go to stderr unless a
/// handler is set ([`set_handler`]).
pub fn start(config: Config) {
    let st = state();
    *st.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
    let mut t = st.thread.lock().unwrap_or_else(|e| e.into_inner());
    if t.is_some() {
        return; // running: it reads the new settings at its next tick
    }
    st.stop.store(false, Ordering::Relaxed);
    st.running.store(true, Ordering::Release);
    *t = Some(
        std::thread::Builder::new()
            .name("fibertrace-watchdog".into())
            .spawn(run)
            .expect("spawn the watchdog thread"),
    );
}

/// Stops the watchdog and waits for its thread to end (at most one tick); a count of
/// suppressed reports still pending is delivered ([`Report::Suppressed`]).
pub fn stop() {
    let st = state();
    let mut t = st.thread.lock().unwrap_or_else(|e| e.into_inner());
    st.stop.store(true, Ordering::Relaxed);
    if let Some(h) = t.take() {
        let _ = h.join();
    }
    let n = take_suppressed();
    if n > 0 {
        deliver(&Report::Suppressed(n));
    }
    let n = st.blocked_suppressed.swap(0, Ordering::AcqRel);
    if n > 0 {
        deliver(&Report::BlockedSuppressed(n));
    }
}

/// Waits, at most `max`, until no report is being made: one the watchdog found (it sampled
/// the fiber, or its scan found a blocked one) is delivered by then — for a program about to
/// end, whose exit would otherwise cut off a report still being built (symbolizing a large
/// binary's frames the first time takes a while). Returns whether none is left; a stall the
/// watchdog has not noticed yet (it looks once per tick) is not waited for. On the
/// watchdog's own thread (a report handler that ends the program) it does not wait: the
/// report being made is the caller's own.
pub fn flush(max: Duration) -> bool {
    let st = state();
    if ON_WATCHDOG.with(|w| w.get()) {
        return st.in_flight.load(Ordering::Acquire) == 0;
    }
    let t0 = Instant::now();
    while st.in_flight.load(Ordering::Acquire) > 0 {
        if t0.elapsed() >= max {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// For a program ending on a signal while its fibers are held where they are (the Lua
/// host's halt): no new report is begun from now on — fibers whose sleep ran out meanwhile
/// are not "blocked" — and nothing is waited for or written (the reports under way go on).
/// Safe to call from any thread at any time.
pub fn close() {
    state().closing.store(true, Ordering::SeqCst);
}

/// For a program about to end: no new report is begun from now on (fibers left waiting as
/// the program ends are not "blocked", and their reports, each waiting for a scheduler that
/// will not come back, held the exit up: 5 s with 25,000 waiting fibers), and the reports
/// being made are waited for, at most `max` (see [`flush`]).
pub fn finish(max: Duration) -> bool {
    let st = state();
    st.closing.store(true, Ordering::SeqCst);
    let done = flush(max);
    let n = st.blocked_suppressed.swap(0, Ordering::AcqRel);
    if n > 0 {
        deliver(&Report::BlockedSuppressed(n));
    }
    done
}

/// Takes the count of stall reports suppressed by the rate limit that no delivered report
/// has counted yet (0 if none), for a program that ends to say it: the watchdog will not
/// count them again. Safe to call from any thread at any time.
pub fn take_suppressed() -> u64 {
    state().suppressed.swap(0, Ordering::AcqRel)
}

/// Whether the watchdog runs.
pub fn is_running() -> bool {
    state().running.load(Ordering::Acquire)
}

/// Changes the stall threshold (Tarantool's `fiber.set_max_slice`).
pub fn set_threshold(d: Duration) {
    state()
        .config
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .threshold = d;
}

/// Sends reports to `f` instead of stderr.
pub fn set_handler(f: impl Fn(&Report) + Send + Sync + 'static) {
    *state().handler.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(f));
}

/// Lets a host say why a stall report has no frames of its own (called outside the signal
/// handler, when the report's frames are native only: the scheduler has no layer above the
/// runtime, or its running fiber did not reach a safe point in time); its note replaces the
/// runtime's.
pub fn set_annotator(f: Annotator) {
    *state().annotator.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
}

/// Reports delivered so far.
pub fn reports() -> u64 {
    state().reports.load(Ordering::Relaxed)
}

struct Watch {
    sched: std::sync::Weak<SchedShared>,
    id: u64,
    resumes: u64,
    /// When the watchdog first saw the current run.
    seen_at: Instant,
    /// Ticks at the run's start as the scheduler published it (0: not known).
    run_since: u64,
    /// The thread's CPU time when the watchdog first saw the run, and the part of the run
    /// before that (at most a tick, taken as CPU; none when the run's start is not known —
    /// its scheduler does not time runs — so such a run is reported up to a tick later, its
    /// time up to a tick short).
    cpu_seen: Option<Duration>,
    cpu_credit: Duration,
    /// The thread's wait on a run queue so far when the run was first seen again a tick
    /// later (read only for runs that last: see [`OnThread::run_queue_wait`]); `None` until
    /// then, or where it cannot be read.
    ///
    /// [`OnThread::run_queue_wait`]: crate::running::OnThread::run_queue_wait
    queue_seen: Option<Duration>,
    next_report: Duration,
    next_wall_report: Duration,
    /// The threshold the marks were set from: a new one (`set_threshold`, Tarantool's
    /// `fiber.set_max_slice`) applies to the run under way at once (it waited for the next
    /// run: a script's spinning main chunk that set its slice went unreported).
    threshold: Duration,
}

/// Wall time after which a run is reported even if it used no CPU (blocked in the kernel).
/// How long a blocked report waits for its scheduler's thread to add a frame source's frames
/// (see [`super::SOURCE_WAIT`]).
const BLOCKED_SOURCE_WAIT: Duration = super::SOURCE_WAIT;

fn wall_limit(threshold: Duration) -> Duration {
    // (Saturating: a watchdog for blocked fibers only has a threshold of `Duration::MAX`.)
    threshold
        .saturating_mul(4)
        .max(threshold.saturating_add(Duration::from_millis(200)))
}

/// Doubles a report mark until it is past `t` (a zero mark, a zero threshold's, stays).
fn double_past(mark: &mut Duration, t: Duration) {
    while !mark.is_zero() && *mark <= t && *mark < Duration::MAX {
        *mark = mark.saturating_mul(2);
    }
}

/// The note of a fiber blocked in the kernel whose frames were read at its next safe point.
const RETURNED: &str = "its frames are of its next safe point (for Lua, its next line), after \
                        the call it was blocked in returned";

/// The note of a stall whose fiber yielded before it could be sampled.
const NOT_SAMPLED: &str = "its stack was not sampled: the fiber yielded before the sampling \
                           signal reached its thread";
/// The note of a stall whose thread took no sampling signal in time (it may still run).
const NO_SAMPLE: &str = "its stack was not sampled: its thread took no sampling signal within \
                         500 ms";

fn deliver(r: &Report) {
    let st = state();
    st.reports.fetch_add(1, Ordering::Relaxed);
    let h = st.handler.lock().unwrap_or_else(|e| e.into_inner());
    match &*h {
        Some(f) => f(r),
        None => super::dump::write_stderr(&r.to_text()),
    }
}

/// The stalled fiber's frames with its layer's (Lua) interleaved, read at a safe point inside
/// it, or with its thread held still when it reaches none (see [`super::HeldSource`]), when
/// its scheduler has such a layer, with a note of what they were read without; otherwise
/// the note that says why not (the host's annotation, see [`set_annotator`], or the
/// runtime's).
///
/// A fiber `blocked` in the kernel (a report by wall time) is read with its thread held
/// first: its next safe point comes only once the blocking call returned, and frames read
/// there had the line after the call, the call gone (`os.execute('sleep 0.6')` reported at
/// 400 ms, its safe point at 600 ms). Where its layer reads no held thread (Lua 5.4), the
/// frames of a safe point are said to be of the moment the call returned.
fn layer_frames(
    s: &SchedShared,
    sample: &super::sample::Sample,
    blocked: bool,
) -> (Option<Arc<[FrameInfo]>>, Option<String>) {
    let annotate = || {
        let annot = *state().annotator.lock().unwrap_or_else(|e| e.into_inner());
        annot.and_then(|a| a(&sample.backtrace))
    };
    let opts = crate::InfoOptions {
        parent_backtrace: false,
        ..crate::InfoOptions::default()
    };
    let held = blocked
        .then(|| super::held_running_part(s, sample.fiber, &opts))
        .flatten();
    let at_safe_point = held.is_none();
    match held.unwrap_or_else(|| super::running_part(s, sample.fiber, &opts, super::SOURCE_WAIT)) {
        // No layer above the runtime: its frames are all there is.
        Ok(None) => (None, None),
        Ok(Some((fi, note))) => {
            let same_run = fi.status == Status::Running
                && s.on_thread.resumes.load(Ordering::Acquire) == sample.resumes;
            // (A safe point of a blocked fiber's is after the call it was blocked in.)
            let note = match note {
                None if blocked && at_safe_point => Some(RETURNED.to_string()),
                note => note,
            };
            match fi.backtrace {
                Some(frames) if same_run => (Some(frames), note),
                _ => (
                    None,
                    Some(
                        "frames of the layer above the runtime (Lua) not shown: the fiber \
                         yielded before they could be read"
                            .to_string(),
                    ),
                ),
            }
        }
        // The host words why a fiber did not reach a safe point (the C code it is in);
        // a refusal's reason is the layer's own.
        Err((late, false)) => (None, annotate().or(Some(late))),
        Err((late, true)) => (None, Some(late)),
    }
}

fn run() {
    ON_WATCHDOG.with(|w| w.set(true));
    let st = state();
    // Open the program's symbols now, on the side, not when the first report is printed: a
    // large binary's debug info takes a while to index (the stalled process may not live
    // that long), and the watchdog itself must not wait for it.
    let _ = std::thread::Builder::new()
        .name("fibertrace-symbols".into())
        .spawn(|| fibertrace_core::symbolize::resolve_address(run as *const () as u64));
    let mut watches: Vec<Watch> = Vec::new();
    let mut window_start = Instant::now();
    let mut in_window = 0u32;
    // (The count of suppressed reports is `st.suppressed`: a program that ends takes what
    // is pending, see `take_suppressed`.)
    let mut blocked_seen: std::collections::HashMap<(FiberId, u64), ()> =
        std::collections::HashMap::new();
    let mut last_blocked_scan = Instant::now();
    // The blocked reports' own rate limit: (window start, reports in it).
    let mut blocked_window = (Instant::now(), 0u32);
    while !st.stop.load(Ordering::Relaxed) {
        let cfg = st.config.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // Whether some run is over the threshold now (its next report will carry the count
        // of suppressed ones).
        let mut ongoing = false;
        let tick = (cfg.threshold / 4).clamp(Duration::from_micros(500), Duration::from_millis(50));
        std::thread::sleep(tick);
        if st.closing.load(Ordering::SeqCst) {
            continue;
        }
        let scheds = registry::schedulers();
        watches.retain(|w| w.sched.strong_count() > 0);
        for s in &scheds {
            let sm = &s.on_thread;
            let fid = sm.running();
            let resumes = sm.resumes.load(Ordering::Relaxed);
            let run_since = sm.run_since.load(Ordering::Relaxed);
            let w = match watches.iter_mut().position(|w| w.id == s.id) {
                Some(i) => &mut watches[i],
                None => {
                    watches.push(Watch {
                        sched: Arc::downgrade(s),
                        id: s.id,
                        resumes,
                        seen_at: Instant::now(),
                        run_since,
                        cpu_seen: sm.thread_cpu_time(),
                        cpu_credit: Duration::ZERO,
                        queue_seen: None,
                        next_report: cfg.threshold,
                        next_wall_report: wall_limit(cfg.threshold),
                        threshold: cfg.threshold,
                    });
                    continue;
                }
            };
            if fid == 0 || resumes != w.resumes || s.idle.load(Ordering::Relaxed) {
                // A new run (or none): start over.
                w.resumes = resumes;
                w.seen_at = Instant::now();
                w.run_since = run_since;
                w.cpu_seen = sm.thread_cpu_time();
                // (The part of the run before we saw it, when the scheduler times runs.)
                w.cpu_credit = if run_since == 0 {
                    Duration::ZERO
                } else {
                    crate::clock::since(run_since).min(tick)
                };
                w.queue_seen = None;
                w.next_report = cfg.threshold;
                w.next_wall_report = wall_limit(cfg.threshold);
                w.threshold = cfg.threshold;
                continue;
            }
            if w.threshold != cfg.threshold {
                // A new threshold: the run under way is measured against it from now (its
                // marks doubled past what it has run already, below, once reported).
                w.threshold = cfg.threshold;
                w.next_report = cfg.threshold;
                w.next_wall_report = wall_limit(cfg.threshold);
            }
            if w.queue_seen.is_none() {
                // A run that lasts: from here, time its thread waited on a run queue is
                // told apart from time it was blocked (only such runs pay the read).
                w.queue_seen = sm.run_queue_wait();
            }
            // The same run goes on. How long it has used the CPU (and how long in wall time,
            // for a fiber blocked in the kernel).
            let wall = if w.run_since == 0 {
                w.seen_at.elapsed()
            } else {
                crate::clock::since(w.run_since).max(w.seen_at.elapsed())
            };
            let cpu_now = sm.thread_cpu_time();
            if sm.resumes.load(Ordering::Relaxed) != resumes {
                // It switched between our two reads (this thread may have been descheduled
                // in between, for longer than the threshold): the CPU time read belongs to
                // several runs. Start over at the next tick.
                continue;
            }
            let cpu = match (w.cpu_seen, cpu_now) {
                (Some(a), Some(b)) => b.saturating_sub(a) + w.cpu_credit,
                _ => wall,
            };
            // Off the CPU is not blocked when the thread was runnable and waited for a CPU
            // (an overloaded machine, a cgroup's spent quota): that part of the wall time is
            // not the fiber's doing, and would have a preempted run reported as blocked.
            // (Read only past the first wall mark; the wait before `queue_seen`, at most a
            // tick, still counts as blocked.)
            let wall = if wall >= wall_limit(cfg.threshold) {
                let waited = match (w.queue_seen, sm.run_queue_wait()) {
                    (Some(a), Some(b)) => b.saturating_sub(a),
                    _ => Duration::ZERO,
                };
                wall.saturating_sub(waited).max(cpu)
            } else {
                wall
            };
            ongoing |= cpu >= cfg.threshold || wall >= wall_limit(cfg.threshold);
            let mut blocked = false;
            let running_for = if cpu >= w.next_report {
                w.next_report = w.next_report.saturating_mul(2);
                cpu
            } else if wall >= w.next_wall_report && cpu < wall / 2 && sm.is_runnable() != Some(true)
            {
                // (Wall time reports a run that waits off the CPU, a fiber blocked in the
                // kernel: a spinning one's CPU time keeps up with its wall time and has its
                // own marks — its wall marks made a second, interleaved series of reports.
                // A thread runnable now is not blocked: it runs, or waits for a CPU, a wait
                // the run queue's count above does not have yet; the mark waits for a tick
                // where it is blocked.)
                w.next_wall_report = w.next_wall_report.saturating_mul(2);
                blocked = true;
                wall
            } else {
                continue;
            };
            // One report per moment: a spinning fiber's wall time passes its mark with its
            // CPU time (and a wall report's moment is not reported again by CPU time).
            double_past(&mut w.next_wall_report, wall);
            double_past(&mut w.next_report, cpu);
            // Rate limit.
            if window_start.elapsed() >= Duration::from_secs(1) {
                window_start = Instant::now();
                in_window = 0;
            }
            if in_window >= cfg.max_reports_per_sec {
                st.suppressed.fetch_add(1, Ordering::AcqRel);
                continue;
            }
            let _in_flight = InFlight::new();
            let sample = super::sample::sample(s, Duration::from_millis(500));
            let name = s.fiber(fid).map(|f| f.name()).unwrap_or_default();
            if in_window == 0 {
                // (The second starts at its first report.)
                window_start = Instant::now();
            }
            in_window += 1;
            let came = sample.is_some();
            let Some(sample) = sample.filter(|x| x.fiber == fid && x.resumes == resumes) else {
                // It yielded before the sampling signal reached its thread (the sample is of
                // another run), or no sample came in time (a thread that signals reach late:
                // under a script's own profiler, on a loaded machine; it may still run). The run was seen over its
                // mark all the same: reported, without its stack, and said why (it was
                // dropped without a word: a 700 ms stall went unreported).
                deliver(&Report::Stall(Box::new(StallReport {
                    scheduler: s.id,
                    fiber: fid,
                    name,
                    running_for,
                    backtrace: Backtrace::new(),
                    frames: None,
                    latency: Duration::ZERO,
                    handler_time: Duration::ZERO,
                    suppressed: take_suppressed(),
                    note: Some(if came { NOT_SAMPLED } else { NO_SAMPLE }.into()),
                })));
                continue;
            };
            let (frames, note) = layer_frames(s, &sample, blocked);
            let report = StallReport {
                scheduler: s.id,
                fiber: fid,
                name,
                running_for,
                backtrace: sample.backtrace,
                frames,
                latency: sample.latency,
                handler_time: sample.handler_time,
                suppressed: take_suppressed(),
                note,
            };
            deliver(&Report::Stall(Box::new(report)));
        }
        // The burst is over (no run over the threshold) in a window that closed with reports
        // suppressed: no later report will carry their count, so say it now.
        if !ongoing
            && window_start.elapsed() >= Duration::from_secs(1)
            && st.suppressed.load(Ordering::Acquire) > 0
        {
            let _in_flight = InFlight::new();
            let n = take_suppressed();
            if n > 0 {
                deliver(&Report::Suppressed(n));
            }
            window_start = Instant::now();
            in_window = 0;
        }
        if let Some(limit) = cfg.blocked_longer_than {
            if last_blocked_scan.elapsed() >= tick.max(Duration::from_millis(10)) {
                last_blocked_scan = Instant::now();
                let mut live = std::collections::HashSet::new();
                if blocked_window.0.elapsed() >= Duration::from_secs(1) {
                    blocked_window = (Instant::now(), 0);
                    // The second is over: what it counted is said.
                    let n = st.blocked_suppressed.swap(0, Ordering::AcqRel);
                    if n > 0 {
                        let _in_flight = InFlight::new();
                        deliver(&Report::BlockedSuppressed(n));
                    }
                }
                for s in &scheds {
                    // A scheduler with a frame source builds the report on its thread (its
                    // fibers' Lua frames are readable there only); one that did not come
                    // back to its run loop in time is not asked again in this scan.
                    let mut wait = BLOCKED_SOURCE_WAIT;
                    for f in s.fibers() {
                        live.insert(f.id);
                        let (status, on, since) = f.status();
                        if on.is_none() || !super::info::is_blocked(status) || since < limit {
                            continue;
                        }
                        // Once per wait: a wait is identified by the fiber and its switch count.
                        let key = (f.id, f.csw.load(Ordering::Relaxed));
                        if blocked_seen.insert(key, ()).is_some() {
                            continue;
                        }
                        if st.closing.load(Ordering::SeqCst) {
                            break;
                        }
                        if blocked_window.1 >= cfg.max_reports_per_sec {
                            st.blocked_suppressed.fetch_add(1, Ordering::AcqRel);
                            continue;
                        }
                        if blocked_window.1 == 0 {
                            // The second starts at its first report (from the watchdog's
                            // start, a burst late in a second was split over two).
                            blocked_window.0 = Instant::now();
                        }
                        blocked_window.1 += 1;
                        let opts = crate::InfoOptions::default();
                        let _in_flight = InFlight::new();
                        if let Some((fiber, note)) = super::fiber_part(s, f.id, &opts, wait) {
                            if note.is_some() {
                                wait = Duration::ZERO;
                            }
                            deliver(&Report::Blocked(Box::new(BlockedReport {
                                scheduler: s.id,
                                fiber,
                                note,
                            })));
                        }
                    }
                }
                blocked_seen.retain(|(id, _), _| live.contains(id));
            }
        }
    }
    st.running.store(false, Ordering::Release);
}
