//! What each scheduler's thread is doing now, published for other threads and for signal
//! handlers on that thread: which fiber runs, its stack bounds, since when, how many resumes
//! so far, the thread's id and CPU clock ([`OnThread`], one per scheduler, in its registry
//! entry), and a slot where the inspection layer's sampling handler leaves a sample.
//!
//! The scheduler's thread is the only writer of the published fields (plain stores, read
//! with relaxed or acquire loads: a reader sees each field of one moment or a later one, not
//! a consistent set — the sampler checks the interrupted stack pointer against the bounds
//! before it trusts them). The thread-local pointer to the running scheduler's `OnThread` is
//! what a signal handler (sampling, the overflow handler) starts from: no lock, no
//! allocation.

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use fibertrace_core::unwind::DwarfCache;
use fibertrace_core::Backtrace;

use crate::task::{single_writer_add, ControlBlock, FiberId};

/// How the layer above brings a running fiber to a safe point (the inspection layer's
/// `SafePointArm`, which documents it).
pub(crate) type Arm = fn(tid: i32) -> Result<(), &'static str>;

/// Per-scheduler state of its thread (see the module doc).
pub(crate) struct OnThread {
    /// The thread's `pthread_t` (0 before the scheduler first ran).
    pub thread: AtomicU64,
    /// The thread's kernel id (0 before the scheduler first ran).
    pub tid: AtomicI32,
    /// The scheduler thread's CPU-time clock (for the watchdog).
    pub cpu_clock: AtomicI32,
    /// The fiber running now (0: none).
    pub running: AtomicU64,
    /// The running fiber's usable stack.
    pub lo: AtomicU64,
    pub hi: AtomicU64,
    /// The running fiber's control block (valid while it runs: its slot holds an Arc).
    pub fiber: AtomicPtr<ControlBlock>,
    /// Clock ticks when the running fiber was resumed (0: not known, the scheduler's runs
    /// are not timed; or they were not when it was resumed).
    pub run_since: AtomicU64,
    /// Resumes so far (changes whenever the running fiber changes).
    pub resumes: AtomicU64,
    /// The thread, to wake it from an idle wait (set when the scheduler first runs).
    pub handle: OnceLock<Thread>,
    /// Another thread asks the scheduler to do something on its own thread at its next
    /// turn (the inspection layer's `asked` hook says what; see `crate::inspect`).
    pub asked: AtomicBool,
    /// Set while the scheduler's thread builds what was asked (between fibers or at a safe
    /// point): an ask that waits is then not given up on at its deadline.
    pub serving: AtomicBool,
    /// Fibers cancelled from another thread, for the scheduler's thread to wake at its next
    /// turn (with `asked` set: a blocked fiber ends its wait and unwinds, as a cancellation
    /// on its own thread makes it).
    pub cancels: std::sync::Mutex<Vec<crate::task::FiberId>>,
    /// How the layer above brings the running fiber to a safe point (a
    /// `Arm` as an address; 0: none).
    arm: AtomicUsize,
    /// The sample slot, written by the inspection layer's handler on this thread and read
    /// by its requester (see `crate::inspect::sample` for the protocol).
    pub sample: SampleSlot,
}

/// Where a sample of the running fiber is left (see `crate::inspect::sample`).
pub(crate) struct SampleSlot {
    pub requested: AtomicBool,
    pub seq: AtomicU64,
    pub fid: AtomicU64,
    /// `resumes` when the sample was taken (which run of the fiber it belongs to).
    pub resumes: AtomicU64,
    pub handler_ns: AtomicU64,
    pub out: UnsafeCell<Backtrace>,
    pub cache: UnsafeCell<Option<Box<DwarfCache>>>,
    pub lock: Mutex<()>,
    /// The next sample holds the thread in the handler afterwards (see `sample::hold`).
    pub hold_wanted: AtomicBool,
    /// The handler holds the thread now (set before the sample is published, cleared when
    /// it lets the thread go: released, or its time was up).
    pub holding: AtomicBool,
    /// Set by the holder to let the thread go.
    pub release: AtomicBool,
    /// The general registers (DWARF numbers 0 to 16) where the held thread was stopped,
    /// written before `holding` is published.
    pub regs: [AtomicU64; 17],
}

// SAFETY: `sample.out` is written only by the handler while `sample.requested` is set, and
// read only by the requester holding `sample.lock` after the handler published `sample.seq`
// (release/acquire); `sample.cache` is used only on the scheduler's thread (set up by it
// before the handler can run there). Everything else is atomic.
unsafe impl Sync for OnThread {}

impl OnThread {
    pub(crate) fn new() -> OnThread {
        OnThread {
            thread: AtomicU64::new(0),
            tid: AtomicI32::new(0),
            cpu_clock: AtomicI32::new(-1),
            running: AtomicU64::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
            fiber: AtomicPtr::new(std::ptr::null_mut()),
            run_since: AtomicU64::new(0),
            resumes: AtomicU64::new(0),
            handle: OnceLock::new(),
            asked: AtomicBool::new(false),
            cancels: std::sync::Mutex::new(Vec::new()),
            serving: AtomicBool::new(false),
            arm: AtomicUsize::new(0),
            sample: SampleSlot {
                requested: AtomicBool::new(false),
                seq: AtomicU64::new(0),
                fid: AtomicU64::new(0),
                resumes: AtomicU64::new(0),
                handler_ns: AtomicU64::new(0),
                out: UnsafeCell::new(Backtrace::new()),
                cache: UnsafeCell::new(None),
                lock: Mutex::new(()),
                hold_wanted: AtomicBool::new(false),
                holding: AtomicBool::new(false),
                release: AtomicBool::new(false),
                regs: [const { AtomicU64::new(0) }; 17],
            },
        }
    }

    /// Sets how the layer above brings the running fiber to a safe point.
    pub(crate) fn set_arm(&self, arm: Option<Arm>) {
        self.arm
            .store(arm.map_or(0, |f| f as usize), Ordering::Release);
    }

    /// How the layer above brings the running fiber to a safe point, if it said.
    pub(crate) fn arm(&self) -> Option<Arm> {
        let a = self.arm.load(Ordering::Acquire);
        // SAFETY: a non-zero value was stored by `set_arm` from a `SafePointArm`.
        (a != 0).then(|| unsafe { std::mem::transmute::<usize, Arm>(a) })
    }

    /// The fiber running now (0: none).
    pub(crate) fn running(&self) -> FiberId {
        self.running.load(Ordering::Relaxed)
    }

    /// CPU time the scheduler's thread has used so far (`None` before it ran).
    pub(crate) fn thread_cpu_time(&self) -> Option<Duration> {
        let clk = self.cpu_clock.load(Ordering::Relaxed);
        if clk == -1 {
            return None;
        }
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime with a clock id the scheduler thread obtained for itself
        // and an out-pointer to a local.
        if unsafe { libc::clock_gettime(clk, &mut ts) } != 0 {
            return None;
        }
        Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    /// How long the scheduler's thread has waited on a run queue so far: runnable, not
    /// running (the OS ran other threads, or its cgroup's CPU quota was spent). Read from the
    /// kernel's scheduler statistics (`/proc/self/task/TID/schedstat`, second field);
    /// `None` before the scheduler first ran, or where they cannot be read (no procfs, a
    /// kernel built without them).
    pub(crate) fn run_queue_wait(&self) -> Option<Duration> {
        // Three decimal numbers: well under 64 bytes.
        let mut buf = [0u8; 96];
        let text = std::str::from_utf8(self.task_file("schedstat", &mut buf)?).ok()?;
        let ns: u64 = text.split_ascii_whitespace().nth(1)?.parse().ok()?;
        Some(Duration::from_nanos(ns))
    }

    /// The start of the scheduler thread's `/proc/self/task/TID/NAME`, read into `buf` (one
    /// read: these files are made whole at open); `None` before the scheduler first ran, or
    /// where it cannot be read.
    fn task_file<'b>(&self, name: &str, buf: &'b mut [u8]) -> Option<&'b [u8]> {
        use std::io::Read;
        let tid = self.tid.load(Ordering::Relaxed);
        if tid <= 0 {
            return None;
        }
        let mut f = std::fs::File::open(format!("/proc/self/task/{tid}/{name}")).ok()?;
        let n = f.read(buf).ok()?;
        Some(&buf[..n])
    }

    /// Whether the scheduler's thread is runnable now (running, or waiting for a CPU: state
    /// `R` in `/proc/self/task/TID/stat`) rather than asleep or blocked in the kernel. (A
    /// wait on a run queue under way is not in [`OnThread::run_queue_wait`] yet: the kernel
    /// adds it when the thread gets a CPU.) `None` where it cannot be read.
    pub(crate) fn is_runnable(&self) -> Option<bool> {
        // "TID (name) S ...": the state follows the name's last ')' (a name may hold one),
        // within the first 64 bytes (a thread's name is at most 15).
        let mut buf = [0u8; 64];
        let head = self.task_file("stat", &mut buf)?;
        let close = head.iter().rposition(|&b| b == b')')?;
        let state = *head[close + 1..]
            .iter()
            .find(|b| !b.is_ascii_whitespace())?;
        Some(state == b'R')
    }
}

thread_local! {
    static ON_THREAD: Cell<*const OnThread> = const { Cell::new(std::ptr::null()) };
}

/// The running scheduler's `OnThread` on this thread (null: none), for a signal handler.
#[inline]
pub(crate) fn on_this_thread() -> *const OnThread {
    ON_THREAD.with(|p| p.get())
}

/// Called on the scheduler's thread when it starts running: publishes the thread and its
/// CPU clock, and makes this scheduler's state the one the
/// handlers of this thread read (last: what they read is set up by then).
pub(crate) fn enter_thread(on: &OnThread) {
    // SAFETY: pthread_self is always valid.
    on.thread
        .store(unsafe { libc::pthread_self() } as u64, Ordering::Relaxed);
    // SAFETY: gettid has no preconditions.
    on.tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
    let mut clk: libc::clockid_t = -1;
    // SAFETY: asks for this thread's CPU-time clock into a local.
    if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clk) } == 0 {
        on.cpu_clock.store(clk, Ordering::Relaxed);
    }
    let _ = on.handle.get_or_init(std::thread::current);
    ON_THREAD.with(|p| p.set(on as *const OnThread));
}

/// The fiber running on this thread and its usable stack `(id, lo, hi)`, for a signal
/// handler (no lock, no allocation).
pub(crate) fn running_stack() -> Option<(u64, u64, u64)> {
    let p = on_this_thread();
    if p.is_null() {
        return None;
    }
    // SAFETY: the pointer names the state of the scheduler running on this thread (cleared
    // by `leave_thread` before it stops); only atomics are read.
    let on = unsafe { &*p };
    let fid = on.running.load(Ordering::Acquire);
    (fid != 0).then(|| {
        (
            fid,
            on.lo.load(Ordering::Relaxed),
            on.hi.load(Ordering::Relaxed),
        )
    })
}

/// Called when a scheduler entered inside another one's fiber stops: the handlers go back to
/// the outer scheduler's state (the inner one's is about to be freed).
pub(crate) fn restore_thread(outer: &OnThread, inner: &OnThread) {
    forget_thread(inner);
    ON_THREAD.with(|p| p.set(outer as *const OnThread));
}

/// Called when the scheduler stops running on this thread: the handlers forget it.
pub(crate) fn leave_thread(on: &OnThread) {
    forget_thread(on);
    ON_THREAD.with(|p| p.set(std::ptr::null()));
}

/// The scheduler's thread is no longer published: a scheduler's shared state outlives its
/// thread (an inspector holds it), and a signal sent to a thread that exited (its
/// `pthread_t` is freed with it) crashed the inspecting process. Signals go by kernel id
/// ([`signal_thread`]), which names no thread once it exited.
fn forget_thread(on: &OnThread) {
    on.tid.store(0, Ordering::Relaxed);
    on.thread.store(0, Ordering::Relaxed);
}

/// Sends `sig` to thread `tid` of this process (`tgkill`): an error, not undefined
/// behaviour, for a thread that exited (`pthread_kill` of a freed `pthread_t` crashed);
/// whether it was sent.
pub fn signal_thread(tid: i32, sig: i32) -> bool {
    if tid <= 0 {
        return false;
    }
    // SAFETY: tgkill(2) takes plain integers; it signals only a thread of this process.
    unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, sig) == 0 }
}

/// Publishes the fiber about to run (scheduler thread, before the switch).
#[inline]
pub(crate) fn set_running(on: &OnThread, f: &ControlBlock, now_ticks: u64) {
    on.lo.store(f.stack.lo, Ordering::Relaxed);
    on.hi.store(f.stack.hi, Ordering::Relaxed);
    on.fiber.store(
        f as *const ControlBlock as *mut ControlBlock,
        Ordering::Relaxed,
    );
    on.run_since.store(now_ticks, Ordering::Relaxed);
    single_writer_add(&on.resumes, 1);
    on.running.store(f.id, Ordering::Release);
}

/// The run under way counts from `now_ticks` (scheduler thread, when it starts timing runs
/// in the middle of one).
pub(crate) fn restamp_run(on: &OnThread, now_ticks: u64) {
    on.run_since.store(now_ticks, Ordering::Relaxed);
}

/// Publishes that no fiber runs (scheduler thread, after the switch back).
#[inline]
pub(crate) fn set_idle(on: &OnThread) {
    on.running.store(0, Ordering::Release);
}
