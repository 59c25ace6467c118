//! Making fibers: the builders, the stacks and the limits on them, the parent-trace capture
//! at the spawn, and the body every fiber runs on its own stack (the trampoline into the
//! user's code is [`crate::frames::call_user`]).

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use corosensei::Yielder;
use fibertrace_core::{Backtrace, CaptureOptions, Frame, Unwinder};

use super::handle::{needs_slot, Fiber, JoinError, JoinHandle, ResultSlot};
use super::names::{cut_name, name_from_bytes};
use super::panic;
use super::{
    current_ctx, with_sched, Cancelled, Co, FiberCore, Inner, Ready, Scheduler, Slot, TopStat,
    Yield, SCHED,
};
use crate::frames::call_user;
use crate::registry::SlabIndex;
use crate::stack;
use crate::task::{
    next_fiber_id, ControlBlock, NewFiber, ParentInit, ParentTrace, OUTCOME_CANCELLED, OUTCOME_OK,
    OUTCOME_PANICKED,
};

/// Spawns a fiber on the current thread's scheduler.
///
/// # Panics
/// Outside a running scheduler, and when the fiber cannot be made (see [`try_spawn`]).
#[inline(never)]
pub fn spawn<F, T>(f: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + 'static,
    T: 'static,
{
    no_tail_call(Builder::new().spawn_inner(f, 3)).unwrap_or_else(|e| spawn_failed(e))
}

/// Spawns a fiber on the current thread's scheduler, or says why it cannot (see
/// [`SpawnError`]).
///
/// # Panics
/// Outside a running scheduler.
#[inline(never)]
pub fn try_spawn<F, T>(f: F) -> Result<JoinHandle<T>, SpawnError>
where
    F: FnOnce() -> T + 'static,
    T: 'static,
{
    no_tail_call(Builder::new().spawn_inner(f, 3))
}

/// The panic of the spawn functions that cannot fail: the reason, said plainly.
#[cold]
#[inline(never)]
pub(super) fn spawn_failed(e: SpawnError) -> ! {
    panic!("{e}")
}

/// Builds a fiber: name, stack size, parent-trace override.
#[derive(Default)]
pub struct Builder {
    name: Option<Arc<str>>,
    stack_size: Option<usize>,
    /// A trace given by hand (boxed: a builder is moved through several calls, and a
    /// trace is a few hundred bytes).
    parent_trace: Option<Option<Box<ParentTrace>>>,
    created_at_start: bool,
}

/// A [`Builder`] bound to a scheduler (from [`Scheduler::builder`]).
pub struct SchedBuilder<'a> {
    pub(super) sched: &'a Scheduler,
    pub(super) b: Builder,
}

impl SchedBuilder<'_> {
    /// Names the fiber (cut to [`NAME_MAX`](crate::NAME_MAX) bytes).
    pub fn name(mut self, name: &str) -> Self {
        self.b = self.b.name(name);
        self
    }

    /// Sets its stack size (at least [`MIN_STACK_SIZE`]).
    pub fn stack_size(mut self, size: usize) -> Self {
        self.b = self.b.stack_size(size);
        self
    }

    /// Spawns it.
    ///
    /// # Panics
    /// When the fiber cannot be made (see [`SchedBuilder::try_spawn`]).
    #[inline(never)]
    pub fn spawn<F, T>(self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.b.spawn_on(&self.sched.inner, f, 3)).unwrap_or_else(|e| spawn_failed(e))
    }

    /// Spawns it, or says why it cannot (see [`SpawnError`]).
    #[inline(never)]
    pub fn try_spawn<F, T>(self, f: F) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.b.spawn_on(&self.sched.inner, f, 3))
    }
}

impl Builder {
    /// A builder with default settings.
    #[inline]
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Names the fiber (cut to [`NAME_MAX`](crate::NAME_MAX) bytes).
    #[inline]
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(Arc::from(cut_name(name)));
        self
    }

    /// Names the fiber with any bytes, kept exactly up to [`NAME_MAX`](crate::NAME_MAX) (see
    /// [`name_from_bytes`]).
    #[inline]
    pub fn name_bytes(mut self, name: &[u8]) -> Self {
        self.name = Some(Arc::from(cut_name(&name_from_bytes(name))));
        self
    }

    /// Names the fiber with a shared name (no copy: a host that spawns many fibers under
    /// one name hands out the same string; one longer than [`NAME_MAX`](crate::NAME_MAX) is cut, in a copy).
    #[inline]
    pub fn shared_name(mut self, name: Arc<str>) -> Self {
        let cut = cut_name(&name);
        self.name = Some(if cut.len() == name.len() {
            name
        } else {
            Arc::from(cut)
        });
        self
    }

    /// Sets its stack size: at least [`MIN_STACK_SIZE`] (a smaller size is raised to it).
    #[inline]
    pub fn stack_size(mut self, size: usize) -> Self {
        self.stack_size = Some(size);
        self
    }

    /// Uses this parent trace instead of capturing the creator's native stack (a Lua host
    /// passes a trace with the creator's Lua frames interleaved); `None` keeps none.
    #[inline]
    pub fn parent_trace(mut self, t: Option<ParentTrace>) -> Self {
        self.parent_trace = Some(t.map(Box::new));
        self
    }

    /// Takes the fiber's creation time when it first runs, not when it is spawned: for a
    /// fiber started at once ([`crate::yield_to`] or [`crate::yield_to_id`] right after the spawn, as
    /// `fiber.create` does), where the clock reading that starts it also dates it — one
    /// reading of the clock less per fiber (a `rdtsc` costs about 10 ns here, as much as a
    /// tenth of a whole create and run). Until it runs, its creation time shows as the
    /// scheduler's last accounting point, some moment before the spawn: when the current
    /// run began, or the last one ended, while the scheduler times runs; otherwise the
    /// last idle wait's end or loop turn it read the clock at (possibly long before). Use it
    /// only for a fiber that is started right away:
    /// otherwise its creation time is when it first ran. Outside a running fiber of the
    /// scheduler it is spawned on, it has no effect.
    #[inline]
    pub fn created_at_start(mut self) -> Self {
        self.created_at_start = true;
        self
    }

    /// Spawns on the current thread's scheduler.
    ///
    /// # Panics
    /// Outside a running scheduler, and when the fiber cannot be made (see
    /// [`Builder::try_spawn`]).
    #[inline(never)]
    pub fn spawn<F, T>(self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_inner(f, 3)).unwrap_or_else(|e| spawn_failed(e))
    }

    /// Spawns on the current thread's scheduler, or says why it cannot (see
    /// [`SpawnError`]); a failure leaves nothing behind, and `f` is dropped.
    ///
    /// # Panics
    /// Outside a running scheduler.
    #[inline(never)]
    pub fn try_spawn<F, T>(self, f: F) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_inner(f, 3))
    }

    #[inline(never)]
    fn spawn_inner<F, T>(self, f: F, skip: usize) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        let p = SCHED.with(|s| s.get());
        assert!(!p.is_null(), "spawn outside a running scheduler");
        // SAFETY: see with_sched.
        let inner = unsafe { &*p };
        no_tail_call(self.spawn_with(inner, f, skip + 1))
    }

    #[inline(never)]
    pub(super) fn spawn_on<F, T>(
        self,
        inner: &Rc<Inner>,
        f: F,
        skip: usize,
    ) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        no_tail_call(self.spawn_with(inner, f, skip + 1))
    }

    #[inline(never)]
    fn spawn_with<F, T>(self, inner: &Inner, f: F, skip: usize) -> Result<JoinHandle<T>, SpawnError>
    where
        F: FnOnce() -> T + 'static,
        T: 'static,
    {
        let (traced, parent_traces, default_size) = {
            let o = inner.opts.borrow();
            (o.traced, o.parent_traces, o.stack_size)
        };
        let size = self.stack_size.unwrap_or(default_size).max(MIN_STACK_SIZE);
        let stack = take_stack(inner, size)?;
        // What the runtime makes for the fiber (its control block, slot, coroutine, its
        // creator's trace) and the growth of the scheduler's registry, map and queue are the
        // runtime's heap, not the spawning fiber's (whose own data the fiber's code holds).
        let _owner = fibertrace_core::heap::OutsideFibers::enter();
        let bounds = stack::bounds(&stack);
        let stack = HeldStack::new(stack);
        // Borrowed: the creator's control block is cloned only into a parent trace (each
        // clone and drop is an atomic operation on a shared count).
        let creator = current_ctx().map(|c| &c.shared);
        let mut ras = [0u64; crate::task::PARENT_FRAMES];
        let parent_trace = match self.parent_trace {
            Some(Some(t)) => ParentInit::Given(t),
            Some(None) => ParentInit::None,
            None if parent_traces => {
                let n = capture_parent_trace(creator, skip, &mut ras);
                ParentInit::Captured {
                    creator: creator.cloned(),
                    thread_name: creator
                        .is_none()
                        .then(|| Arc::from(std::thread::current().name().unwrap_or("thread"))),
                    ras: &ras[..n],
                }
            }
            None => ParentInit::None,
        };
        let id = next_fiber_id();
        let name = self.name.unwrap_or_else(|| Arc::from(format!("fiber{id}")));
        // Deferred only when spawned by a running fiber of this scheduler; until the first
        // run, the date shown is the last accounting point (before the spawn).
        let deferred = self.created_at_start
            && creator.is_some()
            && std::ptr::eq(SCHED.with(|s| s.get()), inner);
        let now = if deferred {
            inner.last_tick.get()
        } else {
            crate::clock::ticks()
        };
        let mut n = NewFiber {
            id,
            now,
            created_at_start: deferred,
            sched: inner.shared.id,
            name,
            parent: creator.map_or(0, |c| c.id),
            parent_trace,
            stack: bounds,
            stack_size: size,
            entry_fn: call_user::<F, T> as *const () as u64,
            entry_name: std::any::type_name::<F>(),
            traced,
        };
        // A finished fiber's slot box, with its control block when nothing else holds it.
        let recycled = inner.free_slots.borrow_mut().pop();
        let mut slot = match recycled {
            Some(mut b) => {
                ControlBlock::renew(&mut b.ctx.shared, &mut n);
                b.ctx.yielder.set(std::ptr::null());
                b.ctx.unwinding.set(false);
                b.ctx.dropping.set(false);
                b.ctx.queued.set(true);
                b.ctx.woken.set(false);
                b.timer_seq = 0;
                b.top = TopStat::default();
                b
            }
            None => Box::new(Slot {
                ctx: FiberCore {
                    shared: ControlBlock::new_shared(&mut n),
                    yielder: Cell::new(std::ptr::null()),
                    unwinding: Cell::new(false),
                    dropping: Cell::new(false),
                    queued: Cell::new(true),
                    woken: Cell::new(false),
                },
                co: None,
                spare: None,
                timer_seq: 0,
                joiners: Vec::new(),
                reg: SlabIndex::Overflow,
                top: TopStat::default(),
            }),
        };
        let shared = slot.ctx.shared.clone();
        let result: Option<ResultSlot<T>> = needs_slot::<T>().then(|| Rc::new(RefCell::new(None)));
        let slot_result = result.clone();
        let body = move |y: &Yielder<(), Yield>, ()| {
            fiber_body(y, f, slot_result.as_ref());
        };
        let co = Co::with_stack(stack, body);
        slot.co = Some(match slot.spare.take() {
            Some(b) => Box::write(b, co),
            None => Box::new(co),
        });
        slot.reg = inner
            .shared
            .fibers
            .add(&mut inner.reg.borrow_mut(), shared.clone());
        let slot = {
            let mut slots = inner.slots.borrow_mut();
            std::ptr::NonNull::from(&mut **slots.entry(id).insert_entry(slot).into_mut())
        };
        inner.ready.borrow_mut().push_back(Ready { fid: id, slot });
        Ok(JoinHandle {
            fiber: Fiber { shared },
            result,
        })
    }
}

// ---- fiber stacks and the limits on them ----

/// Fiber stacks held by fibers, process-wide: each is two memory mappings (its inaccessible
/// guard and reserve, and its usable part). Stacks kept in the schedulers' pools are not
/// counted (at most a few dozen per scheduler).
static STACKS_HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Memory mappings a fiber stack takes.
const MAPS_PER_STACK: usize = 2;

/// A fiber's stack while a fiber holds it (counted in [`STACKS_HELD`]).
pub(crate) struct HeldStack(std::mem::ManuallyDrop<stack::FiberStack>);

impl HeldStack {
    fn new(s: stack::FiberStack) -> HeldStack {
        STACKS_HELD.fetch_add(1, Ordering::Relaxed);
        HeldStack(std::mem::ManuallyDrop::new(s))
    }

    /// The stack, no longer held by a fiber (for the pool).
    pub(super) fn into_inner(self) -> stack::FiberStack {
        let mut me = std::mem::ManuallyDrop::new(self);
        STACKS_HELD.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: `me` is never dropped, so the stack is taken out exactly once.
        unsafe { std::mem::ManuallyDrop::take(&mut me.0) }
    }
}

impl Drop for HeldStack {
    fn drop(&mut self) {
        STACKS_HELD.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: dropped once, here (`into_inner` forgets `self` instead).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.0) };
    }
}

// SAFETY: the bounds are the wrapped stack's, which this value owns for its whole life.
unsafe impl corosensei::stack::Stack for HeldStack {
    #[inline]
    fn base(&self) -> corosensei::stack::StackPointer {
        self.0.base()
    }

    #[inline]
    fn limit(&self) -> corosensei::stack::StackPointer {
        self.0.limit()
    }
}

/// The most fiber stacks the process may hold: `vm.max_map_count` (read once) less a reserve
/// of mappings for everything else the process maps (the allocators' arenas, the Lua heap,
/// libraries, threads' stacks): past it, an allocation anywhere in the process would fail
/// (and a Rust one aborts the process), not only the next spawn. The reserve is a sixteenth
/// of the limit, at least 1,024 and at most 8,192 mappings.
fn stacks_allowed() -> (usize, usize, usize) {
    static LIMIT: std::sync::OnceLock<(usize, usize, usize)> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let max = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65530);
        let reserve = (max / 16).clamp(1024, 8192);
        (max.saturating_sub(reserve) / MAPS_PER_STACK, max, reserve)
    })
}

/// A stack for a new fiber: from the pool, or mapped; within the mapping limit.
/// The smallest stack a fiber gets: room for the runtime's own calls a fiber makes all the
/// time (sleeps, waits, yields, spawns, joins) in a debug build and under AddressSanitizer,
/// whose frames are larger (16 KiB is enough for a plain debug build, not for that). A fiber
/// given one page (a size of 0, 1 or 4096 was taken as that) overflowed in its first
/// `sleep`, and the process stopped. What needs far more — the symbolizer's parsing of debug
/// information and a thread's first DWARF cache, for a dump taken from the fiber or the
/// report of its panic: about 192 KiB in a debug build — runs on the stack of the code
/// that resumed the fiber (the scheduler's), so such a fiber fits in this size too. Past
/// its stack a fiber stops the process with the overflow's report.
pub const MIN_STACK_SIZE: usize = 64 << 10;

fn take_stack(inner: &Inner, size: usize) -> Result<stack::FiberStack, SpawnError> {
    let held = STACKS_HELD.load(Ordering::Relaxed);
    let (allowed, max_maps, reserve) = stacks_allowed();
    let err = |kind, errno, limit| SpawnError {
        kind,
        stack_size: size,
        stacks: held,
        errno,
        limit,
        reserve,
    };
    if held >= allowed {
        return Err(err(SpawnErrorKind::MapCount, 0, max_maps as u64));
    }
    inner.pool.borrow_mut().take(size).map_err(|e| {
        let errno = e.raw_os_error().unwrap_or(0);
        if e.kind() == std::io::ErrorKind::InvalidInput || errno == libc::EINVAL {
            return err(SpawnErrorKind::StackSize, errno, 0);
        }
        if errno != libc::ENOMEM {
            return err(SpawnErrorKind::Other, errno, 0);
        }
        if (held + 1) * MAPS_PER_STACK + reserve / 2 >= max_maps {
            return err(SpawnErrorKind::MapCount, errno, max_maps as u64);
        }
        match stack::address_space_reserve() {
            Some((limit, room)) => SpawnError {
                reserve: room,
                ..err(SpawnErrorKind::AddressSpace, errno, limit)
            },
            None => err(SpawnErrorKind::OutOfMemory, errno, 0),
        }
    })
}

/// Which limit a spawn hit (see [`SpawnError`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpawnErrorKind {
    /// The stack could not be mapped: out of memory.
    OutOfMemory,
    /// The stack does not fit in the address-space limit (`RLIMIT_AS`, `ulimit -v`), with
    /// room kept for the rest of the process (a sixteenth of the limit, 8 to 64 MiB): past
    /// it, the next allocation anywhere in the process would fail.
    AddressSpace,
    /// The process holds as many fiber stacks as `vm.max_map_count` allows, less a reserve of
    /// mappings for the rest of the process.
    MapCount,
    /// The stack size asked for is too large to map.
    StackSize,
    /// The mapping failed otherwise (see [`SpawnError::errno`]).
    Other,
}

/// Why a fiber could not be made: which limit, the stack size, and the system's error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpawnError {
    kind: SpawnErrorKind,
    stack_size: usize,
    stacks: usize,
    errno: i32,
    limit: u64,
    reserve: usize,
}

impl SpawnError {
    /// Which limit was hit.
    pub fn kind(&self) -> SpawnErrorKind {
        self.kind
    }

    /// The size of the stack the fiber was to get.
    pub fn stack_size(&self) -> usize {
        self.stack_size
    }

    /// Fiber stacks held by fibers in the process when the spawn failed.
    pub fn fiber_stacks(&self) -> usize {
        self.stacks
    }

    /// The `errno` of the failed mapping (0 when the spawn was refused before mapping).
    pub fn errno(&self) -> i32 {
        self.errno
    }
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = self.stack_size;
        let n = self.stacks;
        let os = std::io::Error::from_raw_os_error(self.errno);
        match self.kind {
            SpawnErrorKind::OutOfMemory => write!(
                f,
                "cannot create a fiber: out of memory for its {size}-byte stack ({os}; {n} \
                 fiber stacks in use)"
            ),
            SpawnErrorKind::AddressSpace => write!(
                f,
                "cannot create a fiber: its {size}-byte stack does not fit in the \
                 address-space limit (RLIMIT_AS, ulimit -v) of {} bytes, with {} bytes kept \
                 for the rest of the process ({os}; {n} fiber stacks in use)",
                self.limit, self.reserve
            ),
            SpawnErrorKind::MapCount => write!(
                f,
                "cannot create a fiber: {n} fiber stacks in use, as many as vm.max_map_count \
                 ({}) allows at {MAPS_PER_STACK} memory mappings each, with {} kept for the \
                 rest of the process",
                self.limit, self.reserve
            ),
            SpawnErrorKind::StackSize => {
                write!(f, "cannot create a fiber: a {size}-byte stack is too large")
            }
            SpawnErrorKind::Other => write!(
                f,
                "cannot create a fiber: cannot map its {size}-byte stack ({os})"
            ),
        }
    }
}

impl std::error::Error for SpawnError {}

/// Keeps the spawn functions' frames on the stack (no tail call), so that the number of
/// frames to skip when capturing the creator's trace is the same at every optimisation level.
#[inline(always)]
pub(super) fn no_tail_call<T>(v: T) -> T {
    std::hint::black_box(());
    v
}

/// Captures the creator's return addresses for a child's parent trace: its own frames (cut
/// at its entry when it is a fiber; the spawn machinery skipped). Returns how many.
#[inline(never)]
fn capture_parent_trace(
    creator: Option<&Arc<ControlBlock>>,
    skip: usize,
    ras: &mut [u64; crate::task::PARENT_FRAMES],
) -> usize {
    let (stop, stack) = match creator {
        // A fiber: its own stack, up to its entry.
        Some(c) => (c.entry_sp.load(Ordering::Relaxed), c.stack),
        None => (0, fibertrace_core::capture::thread_stack()),
    };
    // The lean frame-pointer walk (no thread-local access, no allocation) keeps spawning
    // with parent traces within a few percent of without; code built without frame
    // pointers (a user's crate) gets the DWARF walk instead.
    let n = match fibertrace_core::collect_raw(skip, stop, stack, ras) {
        Some(n) => n,
        None => parent_trace_dwarf(skip, stop, ras),
    };
    // Not a tail call: this frame is one of the `skip` ones at every optimisation level.
    no_tail_call(n)
}

/// [`capture_parent_trace`]'s walk where frame pointers cannot be trusted. Called from the
/// same frame as `collect_raw` would be, so `skip` means the same frames.
#[inline(never)]
fn parent_trace_dwarf(
    skip: usize,
    stop_sp: u64,
    ras: &mut [u64; crate::task::PARENT_FRAMES],
) -> usize {
    let opts = CaptureOptions {
        unwinder: Unwinder::Auto,
        // This function's own frame stands where `collect_raw`'s would not: one more.
        offset: skip + 1,
        limit: ras.len(),
        top: 0,
    };
    let mut bt = Backtrace::new();
    fibertrace_core::collect_until(&opts, stop_sp, &mut bt);
    let mut n = 0;
    for f in bt.frames() {
        if let Frame::Ra(a) = f {
            ras[n] = *a;
            n += 1;
        }
    }
    no_tail_call(n)
}

/// Tells the heap views where a fiber's own frames end (see
/// `fibertrace_core::heap::add_fiber_trampoline`): at the trampoline, as its traces do.
pub(crate) fn register_heap_entry() {
    fibertrace_core::heap::add_fiber_trampoline(crate::frames::TRAMPOLINE);
}

/// The body of every fiber, on its own stack.
fn fiber_body<F, T>(y: &Yielder<(), Yield>, f: F, result: Option<&ResultSlot<T>>)
where
    F: FnOnce() -> T,
{
    // This fiber's own context (the scheduler made it current for the resume); its box
    // stays in the fiber's slot until the coroutine has returned.
    let ctx = current_ctx().expect("a fiber body runs in its fiber");
    let shared = &ctx.shared;
    ctx.yielder.set(y as *const _);
    let finish = |out: Result<T, JoinError>| {
        let code = match &out {
            Ok(_) => OUTCOME_OK,
            Err(JoinError::Cancelled) => OUTCOME_CANCELLED,
            Err(JoinError::Panicked(_)) => OUTCOME_PANICKED,
        };
        match result {
            Some(slot) => *slot.borrow_mut() = Some(out),
            // No slot: a zero-sized value without a destructor, handed back by the join
            // (an error is dropped: the join reads the outcome and the stored report).
            None => {
                if let Ok(v) = out {
                    std::mem::forget(v);
                }
            }
        }
        shared.outcome.store(code, Ordering::Release);
    };
    if shared.cancelled.load(Ordering::Relaxed) {
        finish(Err(JoinError::Cancelled));
        return;
    }
    // The indirect call keeps `call_user` a real frame; the stack pointer of the function
    // that calls it (whatever was inlined into it), at the call, is where the fiber's trace
    // ends: that function's stack pointer does not move between the read and the call.
    let call: fn(F) -> T = std::hint::black_box(call_user::<F, T>);
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let here = fibertrace_core::__fibertrace_registers_here!();
        shared.set_stop_sp(here.sp);
        // The last step before the fiber's own code: an interrupt (the sampler's signal)
        // that finds it set is in that code, or at its entry (`call_user`), or past its
        // return (a stack pointer at or above it); one that finds it unset, in the
        // runtime's start-up code. In this function's frame at every optimisation level.
        fibertrace_core::__fibertrace_store_word_here!(&shared.entry_sp, here.sp);
        call(f)
    }));
    if r.is_err() && ctx.dropping.get() {
        // The scheduler is dropping this fiber: let corosensei's unwinding go on.
        if let Err(payload) = r {
            std::panic::resume_unwind(payload);
        }
        unreachable!();
    }
    let out = match r {
        Ok(v) => Ok(v),
        Err(payload) if payload.is::<Cancelled>() => Err(JoinError::Cancelled),
        Err(payload) => Err(panicked(shared, &*payload)),
    };
    finish(out);
}

/// A fiber's panic, reported and kept: out of line, because a report holds its backtrace
/// (a kilobyte) and the report's copies made the frame of every fiber's body 3 KiB deep —
/// most of a parked fiber's stack, which a listing walks.
#[cold]
#[inline(never)]
fn panicked(shared: &ControlBlock, payload: &(dyn std::any::Any + Send)) -> JoinError {
    let report = Box::new(panic::take_report(shared, payload));
    if let Some(Some(write)) =
        with_sched(|s| s.opts.borrow().report_panics.then_some(s.hooks.panicked))
    {
        write(shared, &report);
    }
    *shared.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(report.clone());
    JoinError::Panicked(report)
}
