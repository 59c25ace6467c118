//! Dumps of every fiber in the process: text that reads like Go's goroutine dump, and JSON.
//!
//! ```text
//! fiber 12 "worker" [channel receive, 3m12s]:
//! #0  0x55d4c3a01234 in fibertrace_fiber::sync::Channel<T>::recv+0x1f at fiber/src/sync.rs:88
//! #1  0x55d4c3a01300 in app::consume+0x40 at src/app.rs:31
//! created by fiber 1 "main" at:
//! #0  0x55d4c3a01400 in app::main::{closure#0}+0x22 at src/app.rs:12
//! ```
//!
//! A fiber's creators are listed nearest first, at most
//! [`crate::task::PARENT_DEPTH_SHOWN`] of them; a longer ancestry ends with
//! `... N more parent fibers` (N counts every ancestor left out, also those whose traces are
//! no longer kept: see [`crate::task::ParentTrace`]).
//!
//! [`install_signal`] makes a signal (SIGQUIT by default) print the dump to stderr while the
//! process goes on running: the handler only writes a byte to a pipe; a dumper thread builds
//! the dump (sampling running fibers, see [`super::sample`]) outside the handler.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use fibertrace_core::format::{self, TextOptions};
use fibertrace_core::Frame;

use super::info::{self, FiberInfo, InfoOptions};
use super::{FrameInfo, SchedulerSnapshot, Snapshot};
use crate::task::{ControlBlock, FiberId, PanicReport, Status, WaitOn};

/// A duration as Go prints wait times: `250ms`, `4.2s`, `3m12s`, `2h5m`; under a
/// millisecond in microseconds, `640us` (a stall threshold below a millisecond,
/// `fiber.set_max_slice(1e-4)`, had its reports say `has run 0ms`).
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else if d >= Duration::from_secs(1) {
        format!("{:.1}s", d.as_secs_f64())
    } else if d >= Duration::from_millis(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

#[cfg(test)]
mod human_tests {
    use super::human;
    use std::time::Duration;

    #[test]
    fn durations_read_as_go_prints_them_and_below_a_millisecond_in_microseconds() {
        let cases = [
            (Duration::ZERO, "0us"),
            (Duration::from_nanos(999), "0us"),
            (Duration::from_micros(640), "640us"),
            (Duration::from_micros(999), "999us"),
            (Duration::from_millis(1), "1ms"),
            (Duration::from_micros(250_400), "250ms"),
            (Duration::from_millis(4200), "4.2s"),
            (Duration::from_secs(192), "3m12s"),
            (Duration::from_secs(7500), "2h5m"),
        ];
        for (d, want) in cases {
            assert_eq!(human(d), want, "{d:?}");
        }
    }
}

/// Frames in the default text format, without a trailing runtime trampoline.
pub fn render_frames(frames: &[Frame]) -> String {
    format::text(info::user_frames(frames), &text_options())
}

/// The text options of every report: glue hidden unless [`super::glue::native_detail`].
fn text_options() -> TextOptions<'static> {
    TextOptions {
        hide: super::glue::filter(),
        ..TextOptions::default()
    }
}

/// Its status in words, with how long (when `times` are known: see
/// [`SchedulerSnapshot::times_unknown`]).
fn status_words(fi: &FiberInfo, times: bool) -> String {
    let d = Duration::from_secs_f64(fi.status_seconds.max(0.0));
    match (&fi.waiting, fi.status) {
        (Some(w), _) if !times => w.what.to_string(),
        (Some(w), _) => format!("{}, {}", w.what, human(d)),
        (None, Status::Running) => "running".to_string(),
        (None, Status::Ready) => "ready".to_string(),
        (None, Status::Dead) => "dead".to_string(),
        (None, st) => format!("{st:?}").to_lowercase(),
    }
}

/// One fiber as text: its frames (with a layer above's, labelled, when the snapshot carries
/// them: see [`super::FrameSource`]) and its creators.
pub fn render_fiber(fi: &FiberInfo, out: &mut String) {
    render_fiber_timed(fi, true, out);
}

/// [`render_fiber`], its status's duration left out unless `times` are known.
fn render_fiber_timed(fi: &FiberInfo, times: bool, out: &mut String) {
    let _ = writeln!(
        out,
        "fiber {} {} [{}]:",
        fi.id,
        crate::sched::quoted_name(&fi.name),
        status_words(fi, times)
    );
    if let Some(u) = &fi.heap {
        let _ = writeln!(out, "{}", heap_words(u));
    }
    let (own, parents) = trace_text(fi);
    out.push_str(&own);
    out.push_str(&parents);
}

/// The line that ends a parent list cut at [`crate::task::PARENT_DEPTH_SHOWN`] ancestors:
/// `... N more parent fibers` (`fiber` for one), without a line end.
pub fn more_parents_line(n: u64) -> String {
    format!(
        "... {n} more parent {}",
        if n == 1 { "fiber" } else { "fibers" }
    )
}

/// A list of frames in the default text format: a frame a layer above labelled (a Lua
/// frame) by its label, the others resolved; no trailing runtime trampoline.
pub(crate) fn render_list(frames: &[FrameInfo]) -> String {
    let raw: Vec<Frame> = frames.iter().map(|f| f.frame).collect();
    let labelled = |id| {
        frames
            .iter()
            .find(|f| f.frame == Frame::Lua(id))
            .and_then(|f| f.label.as_deref().map(str::to_string))
    };
    let opts = TextOptions {
        lua: Some(&labelled),
        ..text_options()
    };
    let named = |f: &FrameInfo| f.frame.address().is_none() || f.resolved.is_some();
    if !frames.is_empty() && frames.iter().all(named) {
        // Every native frame named already (another process's, which this process's
        // symbolizer cannot name): as named.
        let mut list: Vec<format::ResolvedFrame> = frames
            .iter()
            .map(|f| format::ResolvedFrame {
                frame: f.frame,
                resolved: f.resolved.as_deref().cloned(),
            })
            .collect();
        let last_is_trampoline = list.last().is_some_and(|rf| {
            matches!(rf.frame, Frame::Ra(_))
                && rf
                    .resolved
                    .as_ref()
                    .is_some_and(crate::frames::is_trampoline)
        });
        if last_is_trampoline {
            list.pop();
        }
        return format::text_resolved(&list, &opts);
    }
    format::text(info::user_frames(&raw), &opts)
}

/// The whole process's fibers as text, scheduler by scheduler.
#[inline(never)]
pub fn dump_text() -> String {
    report_entry!();
    snapshot_text(&super::snapshot(&InfoOptions::default()))
}

/// A snapshot as text, scheduler by scheduler.
pub fn snapshot_text(snap: &Snapshot) -> String {
    let mut out = String::new();
    for s in &snap.schedulers {
        render_scheduler(s, &mut out);
    }
    if let Some(h) = &snap.heap {
        render_heap_summary(h, &mut out);
    }
    out
}

/// `heap: 1.2 MiB in 30 allocations` (`, estimated` in the sampled tier).
pub fn heap_words(u: &fibertrace_core::heap::Usage) -> String {
    let est = if fibertrace_core::heap::tier() == fibertrace_core::heap::Tier::Sampled {
        ", estimated"
    } else {
        ""
    };
    format!(
        "heap: {} in {} {}{est}",
        fibertrace_core::heap::human_bytes(u.live_bytes),
        u.live_objects,
        if u.live_objects == 1 {
            "allocation"
        } else {
            "allocations"
        }
    )
}

/// The heap outside live fibers: code outside fibers, then each exited fiber still holding
/// bytes.
pub fn render_heap_summary(h: &super::HeapSummary, out: &mut String) {
    let _ = writeln!(out, "outside fibers: {}", heap_words(&h.outside));
    for (f, u) in &h.exited {
        let _ = writeln!(out, "held by exited fiber {f}: {}", heap_words(u));
    }
}

/// `1 fiber`, `N fibers`.
pub(crate) fn fibers_count(n: usize) -> String {
    if n == 1 {
        "1 fiber".to_string()
    } else {
        format!("{n} fibers")
    }
}

/// One scheduler of a snapshot as text.
pub fn render_scheduler(s: &SchedulerSnapshot, out: &mut String) {
    let _ = writeln!(
        out,
        "scheduler {} {}: {}\n",
        s.id,
        crate::sched::quoted_name(&s.name),
        fibers_count(s.fibers.len())
    );
    if let Some(note) = &s.note {
        let _ = writeln!(out, "({note})\n");
    }
    for fi in &s.fibers {
        render_fiber_timed(fi, !s.times_unknown, out);
        out.push('\n');
    }
}

/// How the signal dump and the deadlock report show a scheduler's fibers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// Every fiber with its trace, as Go's `debug=2` goroutine dump (the default).
    Full,
    /// Fibers in the same state with the same trace and the same creator folded into one
    /// group, with their count, ids and names, the biggest group first (Go's `debug=1`):
    /// the view that finds 9,000 fibers stuck in the same place.
    Grouped,
}

static VIEW: AtomicU8 = AtomicU8::new(0);

/// Sets the view of the signal dump ([`install_signal`]) and of the deadlock report.
pub fn set_view(v: View) {
    VIEW.store((v == View::Grouped) as u8, Ordering::Relaxed);
}

/// The view set by [`set_view`].
pub fn view() -> View {
    if VIEW.load(Ordering::Relaxed) == 1 {
        View::Grouped
    } else {
        View::Full
    }
}

/// A scheduler part in the view set by [`set_view`].
pub(crate) fn render_scheduler_in_view(s: &SchedulerSnapshot, out: &mut String) {
    match view() {
        View::Full => render_scheduler(s, out),
        View::Grouped => render_scheduler_grouped(s, out),
    }
}

/// A snapshot as text in the grouped view (see [`View::Grouped`]), scheduler by scheduler.
pub fn snapshot_grouped(snap: &Snapshot) -> String {
    let mut out = String::new();
    for s in &snap.schedulers {
        render_scheduler_grouped(s, &mut out);
    }
    if let Some(h) = &snap.heap {
        render_heap_summary(h, &mut out);
    }
    out
}

/// The whole process's fibers in the grouped view (see [`View::Grouped`]).
#[inline(never)]
pub fn dump_grouped() -> String {
    report_entry!();
    snapshot_grouped(&super::snapshot(&InfoOptions::default()))
}

/// The state of a fiber without its object or duration: the grouping key's first part.
fn state_kind(fi: &FiberInfo) -> String {
    match &fi.waiting {
        Some(w) => match &w.on {
            WaitOn::Join(_) => "join".to_string(),
            on => on.words().into_owned(),
        },
        None => status_words(fi, false),
    }
}

/// One fiber's trace and creators as text (the part of [`render_fiber`] under its header).
fn trace_text(fi: &FiberInfo) -> (String, String) {
    let mut own = String::new();
    if fi.csw == 0 {
        let _ = writeln!(own, "    (not started yet) entry: {}", fi.entry);
    }
    match &fi.backtrace {
        Some(frames) => own.push_str(&render_list(frames)),
        None => own.push_str("    (no backtrace)\n"),
    }
    let mut parents = String::new();
    for p in &fi.parent_backtrace {
        match p.fiber {
            Some(id) => {
                let _ = writeln!(
                    parents,
                    "created by fiber {id} {} at:",
                    crate::sched::quoted_name(&p.name)
                );
            }
            None => {
                let _ = writeln!(
                    parents,
                    "created by thread {} at:",
                    crate::sched::quoted_name(&p.name)
                );
            }
        }
        // (The layer's frames labelled, as the fiber's own: see `label_parents`.)
        parents.push_str(&render_list(&p.frames));
    }
    if fi.parent_backtrace_omitted > 0 {
        parents.push_str(&more_parents_line(fi.parent_backtrace_omitted));
        parents.push('\n');
    }
    (own, parents)
}

/// Ids as sorted ranges: `3, 7, 9-12`; past `max` ranges, `... (N more)`.
fn id_ranges(ids: &[FiberId], max: usize) -> String {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut ranges: Vec<(FiberId, FiberId)> = Vec::new();
    for id in v {
        match ranges.last_mut() {
            Some((_, hi)) if hi.checked_add(1) == Some(id) => *hi = id,
            _ => ranges.push((id, id)),
        }
    }
    let mut out = String::new();
    for (i, (lo, hi)) in ranges.iter().enumerate() {
        if i == max {
            let left: u64 = ranges[i..].iter().map(|(l, h)| h - l + 1).sum();
            let _ = write!(out, ", ... ({left} more)");
            break;
        }
        if i > 0 {
            out.push_str(", ");
        }
        if lo == hi {
            let _ = write!(out, "{lo}");
        } else {
            let _ = write!(out, "{lo}-{hi}");
        }
    }
    out
}

/// Names with their counts, most common first: `"worker" ×9000, "x" ×2`; one name alone as
/// it is; past three names, `... (N more names)`.
fn name_counts(members: &[&FiberInfo]) -> String {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for fi in members {
        *counts.entry(&fi.name).or_default() += 1;
    }
    let mut v: Vec<(&str, usize)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    if v.len() == 1 {
        return crate::sched::quoted_name(v[0].0).to_string();
    }
    let mut out = String::new();
    for (i, (name, n)) in v.iter().enumerate() {
        if i == 3 {
            let _ = write!(out, ", ... ({} more names)", v.len() - 3);
            break;
        }
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{} \u{d7}{n}", crate::sched::quoted_name(name));
    }
    out
}

/// One scheduler of a snapshot in the grouped view: a header with the fiber and group
/// counts, then each group — `N fibers [state, shortest..longest]: ids ..., names ...:`, the
/// shared trace and creators — the biggest first (equal sizes: the lowest id first).
pub fn render_scheduler_grouped(s: &SchedulerSnapshot, out: &mut String) {
    // The key: the state's kind, the trace's text, the creators' text.
    type Key = (String, String, String);
    let mut order: Vec<Key> = Vec::new();
    let mut groups: HashMap<Key, Vec<&FiberInfo>> = HashMap::new();
    for fi in &s.fibers {
        let (own, parents) = trace_text(fi);
        let key = (state_kind(fi), own, parents);
        let g = groups.entry(key.clone()).or_default();
        if g.is_empty() {
            order.push(key);
        }
        g.push(fi);
    }
    let mut list: Vec<(&Key, &Vec<&FiberInfo>)> = order.iter().map(|k| (k, &groups[k])).collect();
    list.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.1[0].id.cmp(&b.1[0].id)));
    let _ = writeln!(
        out,
        "scheduler {} {}: {} in {} {}\n",
        s.id,
        crate::sched::quoted_name(&s.name),
        fibers_count(s.fibers.len()),
        list.len(),
        if list.len() == 1 { "group" } else { "groups" }
    );
    if let Some(note) = &s.note {
        let _ = writeln!(out, "({note})\n");
    }
    for ((kind, own, parents), members) in list {
        let secs = |fi: &&FiberInfo| fi.status_seconds.max(0.0);
        let lo = members.iter().map(secs).fold(f64::INFINITY, f64::min);
        let hi = members.iter().map(secs).fold(0.0, f64::max);
        let span = if members[0].waiting.is_none() || s.times_unknown {
            String::new()
        } else if human(Duration::from_secs_f64(lo)) == human(Duration::from_secs_f64(hi)) {
            format!(", {}", human(Duration::from_secs_f64(hi)))
        } else {
            format!(
                ", {}..{}",
                human(Duration::from_secs_f64(lo)),
                human(Duration::from_secs_f64(hi))
            )
        };
        let ids: Vec<FiberId> = members.iter().map(|f| f.id).collect();
        if members.len() == 1 {
            let _ = writeln!(
                out,
                "1 fiber [{kind}{span}]: id {}, name {}:",
                ids[0],
                name_counts(members)
            );
        } else {
            let _ = writeln!(
                out,
                "{} fibers [{kind}{span}]: ids {}, names {}:",
                members.len(),
                id_ranges(&ids, 20),
                name_counts(members)
            );
        }
        if members.iter().any(|f| f.heap.is_some()) {
            let mut sum = fibertrace_core::heap::Usage::default();
            for u in members.iter().filter_map(|f| f.heap.as_ref()) {
                sum.live_bytes += u.live_bytes;
                sum.live_objects += u.live_objects;
            }
            let _ = writeln!(out, "{}", heap_words(&sum));
        }
        out.push_str(own);
        out.push_str(parents);
        out.push('\n');
    }
}

/// One scheduler's fibers as text in the view set by [`set_view`] (a snapshot of it, taken
/// now).
#[inline(never)]
pub fn scheduler_text(s: &crate::registry::SchedShared, out: &mut String) {
    report_entry!();
    render_scheduler_in_view(&super::scheduler_snapshot(s, &InfoOptions::default()), out);
}

/// Fibers blocked (waiting on a channel, condition, join or wake-up, or sleeping) for at
/// least `min`, with their traces, as text.
#[inline(never)]
pub fn blocked_text(min: Duration) -> String {
    report_entry!();
    let mut out = String::new();
    let snap = super::snapshot(&InfoOptions::default());
    for fi in snap.schedulers.iter().flat_map(|s| &s.fibers) {
        if fi
            .waiting
            .as_ref()
            .is_some_and(|w| w.seconds >= min.as_secs_f64())
        {
            render_fiber(fi, &mut out);
            out.push('\n');
        }
    }
    out
}

/// The whole process's fibers as JSON: a [`Snapshot`] (its `version`, `taken_at`, and
/// `schedulers`, each with its `fibers`, each a [`FiberInfo`]).
#[inline(never)]
pub fn dump_json() -> String {
    report_entry!();
    serde_json::to_string_pretty(&super::snapshot(&InfoOptions::default()))
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);
static INSTALLED: OnceLock<i32> = OnceLock::new();
/// Dump-signal handlers under way. The signal may land on a thread that runs a fiber; the
/// dump samples that fiber, and a sample taken while the handler still runs would show the
/// handler's frames instead of the fiber's. The dumper waits for this to drop to zero.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);

/// Dump signals whose request reached the dump thread's pipe, and those it has answered
/// (each dump answers every request read before it): [`wait_for_signal_dumps`].
static REQUESTED: AtomicU64 = AtomicU64::new(0);
static ANSWERED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_dump_signal(_sig: libc::c_int) {
    IN_HANDLER.fetch_add(1, Ordering::SeqCst);
    let fd = PIPE_WRITE.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = [1u8];
        // (Counted before the write: the dump thread may answer it at once.)
        REQUESTED.fetch_add(1, Ordering::SeqCst);
        // SAFETY: write(2) is async-signal-safe; the fd is a pipe we own; errors (a full pipe
        // when dumps are already pending) are ignored on purpose: a pending dump answers it.
        if unsafe { libc::write(fd, b.as_ptr() as *const libc::c_void, 1) } != 1 {
            REQUESTED.fetch_sub(1, Ordering::SeqCst);
        }
    }
    IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
}

/// Set by the dump thread from before it takes a signal's dump until it has written it, when
/// standard output and error are one file ([`output_shared`]).
static HOLD_FOR_DUMP: AtomicBool = AtomicBool::new(false);

/// Whether the dump signal's dump is being taken or written now: a layer that brings its
/// running fiber to a safe point for it (the Lua host, where no `print` is half done) may
/// flush C's standard output there and keep the fiber at that point until this is false
/// (for a bounded time). The dump then comes between two whole lines of the program's
/// output where both streams go to one file: the program, printing on, filled its buffer
/// and had it written at any byte meanwhile, and the dump cut a line in two. Never true
/// where the two streams go to different files.
pub fn dump_wants_hold() -> bool {
    HOLD_FOR_DUMP.load(Ordering::SeqCst)
}

/// Whether standard output and standard error are one file (`> out 2>&1`, one terminal, one
/// pipe): only there can a dump cut a line of the program's output in two, so only there is
/// the program's fiber held while the dump is written. (Held always, a program whose stderr
/// went to a reader that did not keep up stood still for up to the hold's bound per dump,
/// though its own output went elsewhere.) Either stream closed: not shared.
fn output_shared() -> bool {
    let id = |fd| {
        // SAFETY: fstat(2) fills a local struct; a closed descriptor fails (EBADF).
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            (libc::fstat(fd, &mut st) == 0).then_some((st.st_dev, st.st_ino))
        }
    };
    matches!((id(1), id(2)), (Some(a), Some(b)) if a == b)
}

/// Waits, at most 200 ms, while a dump signal sent to the process is pending or its handler
/// runs: a signal sent to the process goes to a thread the kernel picks, which may run after
/// the caller (a program about to end on an exit signal sent right after the dump signal:
/// under load, the exit signal's thread came first, took no dump to be pending, and the
/// dump was lost). After it, [`signal_dumps_pending`] counts that dump.
pub fn settle_dump_signal() {
    let Some(&sig) = INSTALLED.get() else {
        return;
    };
    let t0 = std::time::Instant::now();
    while (signal_pending(sig) || IN_HANDLER.load(Ordering::SeqCst) != 0)
        && t0.elapsed() < Duration::from_millis(200)
    {
        std::thread::sleep(Duration::from_micros(100));
    }
    // A signal its thread took from the pending set, but whose handler has not begun (the
    // thread was preempted in between, on a loaded machine), shows nowhere: none asked yet,
    // a moment more is given for it to (it was lost that way, 1 time in 2 with two busy
    // loops beside the test).
    let asked = REQUESTED.load(Ordering::SeqCst);
    if asked == ANSWERED.load(Ordering::SeqCst) {
        while REQUESTED.load(Ordering::SeqCst) == asked && t0.elapsed() < Duration::from_millis(100)
        {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Whether a dump asked by the dump signal is still being taken or written.
pub fn signal_dumps_pending() -> bool {
    ANSWERED.load(Ordering::SeqCst) < REQUESTED.load(Ordering::SeqCst)
}

/// Waits until every dump the dump signal asked for so far is written (at most `timeout`,
/// none: as long as it takes); whether they are. For a program about to end (an exit
/// signal right after the dump signal): the dump asked first is not lost.
pub fn wait_for_signal_dumps(timeout: Option<Duration>) -> bool {
    settle_dump_signal();
    let asked = REQUESTED.load(Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    while ANSWERED.load(Ordering::SeqCst) < asked {
        if timeout.is_some_and(|t| t0.elapsed() >= t) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// For a program about to end on its own (the script's end, `os.exit`, a deadlock): a dump
/// the dump signal asked for is written before the exit, at most `timeout` (the exit cut a
/// dump being written mid-line, or dropped one asked just before the end). Unlike
/// [`wait_for_signal_dumps`], no time is given to a signal that has not reached its
/// handler yet when none is pending: an exit with no dump asked is not held up. Whether
/// none is left.
pub fn finish_signal_dumps(timeout: Duration) -> bool {
    let Some(&sig) = INSTALLED.get() else {
        return true;
    };
    let t0 = std::time::Instant::now();
    while (signal_pending(sig) || IN_HANDLER.load(Ordering::SeqCst) != 0)
        && t0.elapsed() < Duration::from_millis(200)
    {
        std::thread::sleep(Duration::from_micros(100));
    }
    let asked = REQUESTED.load(Ordering::SeqCst);
    while ANSWERED.load(Ordering::SeqCst) < asked {
        if t0.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Whether signal `sig` is pending for the process (or the calling thread): sent, its
/// handler not begun yet.
fn signal_pending(sig: i32) -> bool {
    // SAFETY: sigset_t is plain data, filled by sigpending before it is read; sigismember
    // reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut set) == 0 && libc::sigismember(&set, sig) == 1
    }
}

/// Waits (at most 100 ms) until no dump-signal handler runs, and a little more for the
/// last one to return through the kernel's signal trampoline.
fn wait_for_handlers() {
    let t0 = std::time::Instant::now();
    while IN_HANDLER.load(Ordering::SeqCst) != 0 && t0.elapsed() < Duration::from_millis(100) {
        std::thread::sleep(Duration::from_micros(100));
    }
    std::thread::sleep(Duration::from_millis(1));
}

/// Errors of [`install_signal`].
#[derive(Debug)]
pub struct InstallError(pub String);

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InstallError {}

/// Makes `sig` (e.g. `libc::SIGQUIT`) print [`dump_text`] (or [`dump_grouped`], see
/// [`set_view`]) to stderr; the process goes on.
/// Installing twice with the same signal is a no-op; with another, an error.
pub fn install_signal(sig: i32) -> Result<(), InstallError> {
    if let Some(&s) = INSTALLED.get() {
        return if s == sig {
            Ok(())
        } else {
            Err(InstallError(format!("the dump signal is already {s}")))
        };
    }
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(InstallError(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    let (rd, wr) = (fds[0], fds[1]);
    // The reader blocks: clear O_NONBLOCK on the read end.
    // SAFETY: fcntl on our own fd.
    unsafe {
        let fl = libc::fcntl(rd, libc::F_GETFL);
        libc::fcntl(rd, libc::F_SETFL, fl & !libc::O_NONBLOCK);
    }
    PIPE_WRITE.store(wr, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("fibertrace-dump".into())
        .spawn(move || {
            // SAFETY: gettid(2) has no preconditions.
            DUMP_TID.store(unsafe { libc::gettid() }, Ordering::SeqCst);
            let mut b = [0u8; 64];
            loop {
                // SAFETY: reading into our buffer from our pipe.
                let n = unsafe { libc::read(rd, b.as_mut_ptr() as *mut libc::c_void, b.len()) };
                if n <= 0 {
                    if n < 0
                        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                    {
                        continue;
                    }
                    return;
                }
                wait_for_handlers();
                // (Every dump after what was printed before the signal, or the crash.)
                flush_c_stdout();
                // A crash's header, after that output and before its dump.
                crash_header_write();
                // A running fiber brought to a safe point for the dump may stay there until
                // the dump is written (see `dump_wants_hold`), where the two can mix.
                HOLD_FOR_DUMP.store(output_shared(), Ordering::SeqCst);
                let text = match view() {
                    View::Full => dump_text(),
                    View::Grouped => dump_grouped(),
                };
                // What was printed while the dump was taken (a fiber held at its safe point
                // flushed its own output there, at a line's end).
                flush_c_stdout();
                write_stderr(&text);
                HOLD_FOR_DUMP.store(false, Ordering::SeqCst);
                ANSWERED.fetch_add(n as u64, Ordering::SeqCst);
            }
        })
        .map_err(|e| InstallError(format!("dump thread: {e}")))?;
    // SAFETY: installs a handler that only calls write(2).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_dump_signal as *const () as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
            return Err(InstallError(format!(
                "sigaction: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    let _ = INSTALLED.set(sig);
    Ok(())
}

// ---- crash reports ----

/// Set by [`install_crash_report`].
static CRASH_REPORT: AtomicBool = AtomicBool::new(false);
/// Set by the first crash: a crash on another thread meanwhile waits for that report (one
/// in the report's own dump ends the process at once).
static CRASHED: AtomicBool = AtomicBool::new(false);

/// The dump thread's id (a crash of its own cannot wait for its dump).
static DUMP_TID: AtomicI32 = AtomicI32::new(0);
/// Longest a crashed thread waits for its report's dump before the process stops.
const CRASH_WAIT: Duration = Duration::from_secs(15);

/// Makes a crash — SIGSEGV, SIGBUS, SIGILL, SIGFPE (faults, in native code: an FFI call, a
/// library) or SIGABRT (`abort`, a failed assertion) — report itself on stderr before the
/// process stops as it would have (by that signal, a core dump where enabled): which signal,
/// where it faulted, in which fiber, then the dump of every fiber ([`dump_text`], as the
/// dump signal prints it), the crashed fiber's stack read from the fault's context while its
/// thread waits in the handler, with the layer's frames (Lua) when the layer reads held
/// threads. What the program printed to C's standard output is flushed first, unless the
/// crash holds that stream. Without this, a crash ended the process with no word.
///
/// The report comes before a handler the program had for these signals, which is called after
/// it: a program whose own handler recovers from faults (a runtime that turns them into
/// errors) would get a report, and a wait, for each; it should not install this.
///
/// Needs [`install_signal`] (the report is that signal's dump). How it can be wrong: a crash
/// that broke what the dump reads (the allocator's state, a scheduler's lists) can crash the
/// dump too, or hold it: the process then stops at once, or after 15 s, with the report cut
/// short; a fault in the handler's own thread while it reports stops the process.
pub fn install_crash_report() -> Result<(), InstallError> {
    if INSTALLED.get().is_none() {
        return Err(InstallError(
            "the crash report is a dump: install_signal first".into(),
        ));
    }
    CRASH_REPORT.store(true, Ordering::SeqCst);
    // SIGSEGV and SIGBUS: the stack-overflow handler's, which reports what is not an
    // overflow of a fiber's stack.
    // SAFETY: `crash_report` is async-signal-safe (see it).
    unsafe { crate::overflow::set_crash_hook(crash_report) };
    CRASH_INSTALL.call_once(|| {
        for (i, sig) in CRASH_SIGNALS.into_iter().enumerate() {
            // SAFETY: installs an SA_SIGINFO handler that calls only async-signal-safe
            // functions (see `crash_report`), the sampling signal blocked while it runs;
            // the previous disposition is kept first, before the handler can read it, and
            // never written again.
            unsafe {
                let prev = std::ptr::addr_of_mut!(CRASH_PREVIOUS[i]).cast::<libc::sigaction>();
                libc::sigaction(sig, std::ptr::null(), prev);
                if (*prev).sa_sigaction == libc::SIG_IGN {
                    // Inherited ignored: kept so (a report would say the process stops).
                    continue;
                }
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_crash_signal as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaddset(&mut sa.sa_mask, super::sample::signal());
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    });
    Ok(())
}

static CRASH_INSTALL: std::sync::Once = std::sync::Once::new();

/// The signals [`install_crash_report`] takes itself (SIGSEGV and SIGBUS go through the
/// stack-overflow handler).
const CRASH_SIGNALS: [libc::c_int; 3] = [libc::SIGABRT, libc::SIGILL, libc::SIGFPE];

/// Their dispositions before, called after the report (written once, before the handlers).
static mut CRASH_PREVIOUS: [std::mem::MaybeUninit<libc::sigaction>; 3] = [
    std::mem::MaybeUninit::uninit(),
    std::mem::MaybeUninit::uninit(),
    std::mem::MaybeUninit::uninit(),
];

extern "C" fn on_crash_signal(sig: libc::c_int, info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    // SAFETY: `info` and `uc` are the kernel's for this handler.
    unsafe { crash_report(sig, info, uc) };
    let i = CRASH_SIGNALS.iter().position(|&s| s == sig).unwrap_or(0);
    // SAFETY: written by `install_crash_report` before this handler was installed, and
    // never again.
    let prev = unsafe { *std::ptr::addr_of!(CRASH_PREVIOUS[i]).cast::<libc::sigaction>() };
    // SAFETY: the kernel's `info` and `uc` for this handler.
    unsafe { crate::overflow::call_previous(&prev, sig, info, uc) };
}

/// In the handler of a crash on this thread: the report (see [`install_crash_report`]),
/// once, when installed. Returns when the report's dump is written (or could not be), the
/// caller then stopping the process. Async-signal-safe: it writes its header with
/// `write(2)`, asks the dump thread through its pipe, and waits, answering the dump's
/// sample and hold requests for this thread itself, with the fault's context.
///
/// # Safety
/// In a signal handler: `info` and `uc` are the kernel's for it.
pub(crate) unsafe fn crash_report(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    uc: *mut libc::c_void,
) {
    if !CRASH_REPORT.load(Ordering::SeqCst) {
        return;
    }
    // SAFETY: gettid(2) has no preconditions.
    let tid = unsafe { libc::gettid() };
    // (Resolving on a crashed fiber's parent stack: not with its state perhaps broken.)
    crate::sched::forbid_stack_switch();
    if CRASHED.swap(true, Ordering::SeqCst) {
        // Another thread's report is under way (a broken heap faults on several threads):
        // it ends the process when done; this one waits for that, unless it is the report's
        // own dump that crashed.
        if tid != DUMP_TID.load(Ordering::SeqCst) {
            nap_until(|| false);
        } else {
            // The dump crashed before it wrote the first crash's header: written here.
            crash_header_write();
        }
        return;
    }
    // This handler answers the sampling requests of this thread's scheduler (the dump's)
    // itself: the sampling handler would take the handler's context instead of the fault's.
    // (The mask is put back on return, for a handler called after this one.)
    // SAFETY: sigsets on the stack, filled by sigemptyset/sigaddset and pthread_sigmask,
    // which changes this thread's mask (a system call).
    let old_mask = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, super::sample::signal());
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        old
    };
    // SAFETY: as above.
    unsafe { report_and_wait(sig, info, uc, tid) };
    // SAFETY: puts back the mask read above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut()) };
}

/// Naps (async-signal-safe) until `done` or [`CRASH_WAIT`] passed.
fn nap_until(done: impl Fn() -> bool) {
    let now = super::sample::monotonic;
    let t0 = now();
    while !done() && now().saturating_sub(t0) < CRASH_WAIT {
        let nap = libc::timespec {
            tv_sec: 0,
            tv_nsec: 100_000,
        };
        // SAFETY: sleeps 100 us (async-signal-safe).
        unsafe { libc::nanosleep(&nap, std::ptr::null_mut()) };
    }
}

/// The body of [`crash_report`]: the header, the dump asked for and waited for.
///
/// # Safety
/// As [`crash_report`]'s.
unsafe fn report_and_wait(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    uc: *mut libc::c_void,
    tid: libc::pid_t,
) {
    let mut buf = [0u8; 256];
    let mut w = crate::overflow::Writer {
        buf: &mut buf,
        len: 0,
    };
    w.put(b"\nfibertrace: ");
    w.put(match sig {
        libc::SIGSEGV => b"SIGSEGV (invalid memory access)".as_slice(),
        libc::SIGBUS => b"SIGBUS (bus error)",
        libc::SIGILL => b"SIGILL (illegal instruction)",
        libc::SIGFPE => b"SIGFPE (arithmetic fault)",
        libc::SIGABRT => b"SIGABRT (abort)",
        _ => b"a fatal signal",
    });
    // SAFETY: the kernel's siginfo; si_addr is the faulting address for these signals.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as u64) };
    if code > 0 && sig != libc::SIGABRT {
        w.put(b" at address 0x");
        w.hex(addr);
    } else if code <= 0 {
        // Sent by another process (`kill -SEGV`): which one. (Sent by this one, `abort`
        // or `raise`, it is said by the trace.)
        // SAFETY: the kernel's siginfo (a signal sent by a process carries its pid);
        // getpid(2) has no preconditions.
        let (from, me) = unsafe { ((*info).si_pid(), libc::getpid()) };
        if from != me {
            w.put(b" sent by process ");
            w.num(u64::try_from(from).unwrap_or(0));
        }
    }
    match crate::running::running_stack() {
        Some((fid, ..)) => {
            w.put(b" in fiber ");
            w.num(fid);
        }
        None => w.put(b" outside any fiber"),
    }
    w.put(b" (thread ");
    w.num(tid as u64);
    w.put(b"); the process stops. Every fiber as it stopped:\n");
    let n = w.len;
    let fd = PIPE_WRITE.load(Ordering::Relaxed);
    if fd < 0 || tid == DUMP_TID.load(Ordering::SeqCst) {
        // SAFETY: write(2) of a local buffer to stderr.
        unsafe { libc::write(2, buf.as_ptr().cast(), n) };
        return;
    }
    // The dump thread writes the header, after what the program printed (it flushes C's
    // standard output first, which this handler cannot do): written from here, the header
    // came before the script's last lines where both streams go to one file.
    crash_header_keep(&buf[..n]);
    let mut want = REQUESTED.fetch_add(1, Ordering::SeqCst) + 1;
    let b = [1u8];
    // SAFETY: write(2) of one byte to our own (non-blocking) pipe.
    if unsafe { libc::write(fd, b.as_ptr().cast(), 1) } != 1 {
        // A full pipe: dumps are pending, each answering every request read before it;
        // the last of them is waited for.
        want = REQUESTED.fetch_sub(1, Ordering::SeqCst) - 1;
    }
    nap_until(|| {
        // SAFETY: `uc` is the kernel's ucontext of the fault this handler runs for.
        unsafe { super::sample::serve(uc) };
        ANSWERED.load(Ordering::SeqCst) >= want
    });
    // The dump thread never got to it (stuck, or too slow): the header is not lost.
    crash_header_write();
}

/// The crash report's header, kept by the crashing thread's handler for the dump thread to
/// write ([`crash_header_write`]): its bytes, its length, and whether it is waiting.
/// Atomics, so that the handler stores it async-signal-safely.
static CRASH_HEADER: [AtomicU8; 256] = [const { AtomicU8::new(0) }; 256];
static CRASH_HEADER_LEN: AtomicUsize = AtomicUsize::new(0);
static CRASH_HEADER_WAITING: AtomicBool = AtomicBool::new(false);

/// Keeps `header` for [`crash_header_write`] (async-signal-safe).
fn crash_header_keep(header: &[u8]) {
    let n = header.len().min(CRASH_HEADER.len());
    for (slot, &b) in CRASH_HEADER.iter().zip(&header[..n]) {
        slot.store(b, Ordering::Relaxed);
    }
    CRASH_HEADER_LEN.store(n, Ordering::Relaxed);
    CRASH_HEADER_WAITING.store(true, Ordering::Release);
}

/// Writes the kept crash header to stderr, if one waits (once: the dump thread, before the
/// crash's dump, or the crashing thread's handler when the dump did not come in time).
/// Async-signal-safe.
fn crash_header_write() {
    if !CRASH_HEADER_WAITING.swap(false, Ordering::AcqRel) {
        return;
    }
    let mut buf = [0u8; 256];
    let n = CRASH_HEADER_LEN.load(Ordering::Relaxed).min(buf.len());
    for (b, slot) in buf.iter_mut().zip(&CRASH_HEADER).take(n) {
        *b = slot.load(Ordering::Relaxed);
    }
    // SAFETY: write(2) of a local buffer to stderr.
    unsafe { libc::write(2, buf.as_ptr().cast(), n) };
}

unsafe extern "C" {
    /// The C library's standard output stream (where a Lua host's `print` goes).
    #[link_name = "stdout"]
    static C_STDOUT: *mut libc::FILE;
    /// POSIX `ftrylockfile(3)` and `funlockfile(3)` (not in the `libc` crate).
    fn ftrylockfile(f: *mut libc::FILE) -> libc::c_int;
    fn funlockfile(f: *mut libc::FILE);
}

/// Flushes C's standard output unless some thread holds it (the crashed one may, stopped in
/// the middle of a write: waiting for it would hold the report for ever): before a report
/// on standard error, so that it comes after what the program printed before it where both
/// go to one file (`> out 2>&1`: standard output is buffered there, and the report came
/// first). A program printing meanwhile from another thread may have a line cut there.
pub fn flush_c_stdout() {
    // Nor into a pipe without a reader (SIGPIPE would end the process before the report),
    // nor into one that is full (the flush would wait for its reader).
    let mut p = libc::pollfd {
        fd: 1,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: poll(2) of one descriptor, without waiting.
    let ready = unsafe { libc::poll(&mut p, 1, 0) };
    if ready != 1 || p.revents != libc::POLLOUT {
        return;
    }
    // SAFETY: `stdout` is the C library's stream, open for the life of the process;
    // ftrylockfile/fflush/funlockfile on it are plain calls (the lock taken only if free).
    unsafe {
        if ftrylockfile(C_STDOUT) == 0 {
            libc::fflush(C_STDOUT);
            funlockfile(C_STDOUT);
        }
    }
}

/// Writes `fiber N "name" panicked at LOCATION: MESSAGE` and the trace to stderr (the
/// scheduler's `panicked` hook).
pub(crate) fn write_panic_report(f: &ControlBlock, r: &PanicReport) {
    let mut s = format!(
        "fiber {} {} panicked",
        f.id(),
        crate::sched::quoted_name(&f.name())
    );
    if let Some(loc) = &r.location {
        s.push_str(&format!(" at {loc}"));
    }
    s.push_str(&format!(": {}\n", r.message));
    s.push_str(&render_frames(r.backtrace.frames()));
    write_stderr(&s);
}

/// Writes to standard error; one that cannot be written (closed, full) loses the text, never
/// the program.
pub(crate) fn write_stderr(text: &str) {
    use std::io::Write as _;
    if CRASHED.load(Ordering::SeqCst) {
        // A crash report: the crashed thread may hold the standard library's stderr lock
        // (a crash in the middle of a message), so the report goes around it.
        let mut b = text.as_bytes();
        while !b.is_empty() {
            // SAFETY: write(2) from a live buffer to the standard error's descriptor.
            let n = unsafe { libc::write(2, b.as_ptr().cast(), b.len()) };
            if n <= 0 {
                if n < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {
                    continue;
                }
                return;
            }
            b = &b[n as usize..];
        }
        return;
    }
    let _ = std::io::stderr().write_all(text.as_bytes());
}
