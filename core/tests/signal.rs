//! Capture inside a signal handler from the interrupted `ucontext`: no lock, no allocation,
//! and DWARF through glibc (the signal lands inside libc's `raise`).

mod common;

use std::cell::UnsafeCell;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};

use fibertrace_core::capture::thread_stack;
use fibertrace_core::unwind::DwarfCache;
use fibertrace_core::{collect_from_ucontext, Backtrace, CaptureOptions, StackBounds, Unwinder};

struct Slot {
    stacks: UnsafeCell<[StackBounds; 1]>,
    cache: UnsafeCell<Option<Box<DwarfCache>>>,
    out: UnsafeCell<Backtrace>,
    mode: UnsafeCell<Unwinder>,
}
// SAFETY: written by the test thread only while no signal is pending, read by the handler
// that runs on that same thread; the DONE flag orders the two.
unsafe impl Sync for Slot {}

static SLOT: Slot = Slot {
    stacks: UnsafeCell::new([StackBounds::new(0, 0)]),
    cache: UnsafeCell::new(None),
    out: UnsafeCell::new(Backtrace::new()),
    mode: UnsafeCell::new(Unwinder::Auto),
};
static DONE: AtomicBool = AtomicBool::new(false);

/// Counts allocations made while the handler runs: the capture must make none.
struct Counting;
static IN_HANDLER: AtomicBool = AtomicBool::new(false);
static ALLOCS_IN_HANDLER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only adds a relaxed counter.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if IN_HANDLER.load(Ordering::Relaxed) {
            ALLOCS_IN_HANDLER.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if IN_HANDLER.load(Ordering::Relaxed) {
            ALLOCS_IN_HANDLER.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

extern "C" fn handler(_sig: libc::c_int, _info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    IN_HANDLER.store(true, Ordering::Relaxed);
    // SAFETY: the handler runs on the thread that filled SLOT before raising the signal; the
    // ucontext is the kernel's; the stack range is this thread's own stack.
    unsafe {
        let opts = CaptureOptions::with_unwinder(*SLOT.mode.get());
        let cache = (*SLOT.cache.get()).as_deref_mut();
        collect_from_ucontext(
            uc,
            &*SLOT.stacks.get(),
            0,
            &opts,
            cache,
            &mut *SLOT.out.get(),
        );
    }
    IN_HANDLER.store(false, Ordering::Relaxed);
    DONE.store(true, Ordering::Release);
}

#[inline(never)]
fn u2() {
    // SAFETY: raising a signal whose handler was installed below.
    unsafe { libc::raise(libc::SIGUSR2) };
    black_box(());
}

#[inline(never)]
fn u1() {
    u2();
    black_box(());
}

#[test]
fn capture_from_ucontext_in_a_signal_handler() {
    fibertrace_core::prepare();
    // SAFETY: installs an SA_SIGINFO handler for SIGUSR2 (unused elsewhere in this test
    // binary) and fills SLOT before any signal is raised.
    unsafe {
        *SLOT.stacks.get() = [thread_stack()];
        *SLOT.cache.get() = Some(Box::new(DwarfCache::new()));
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
    }
    for mode in [Unwinder::Auto, Unwinder::Precise] {
        DONE.store(false, Ordering::Release);
        // SAFETY: no signal is pending; the handler reads this after `raise`.
        unsafe { *SLOT.mode.get() = mode };
        u1();
        assert!(DONE.load(Ordering::Acquire));
        assert_eq!(
            ALLOCS_IN_HANDLER.load(Ordering::Relaxed),
            0,
            "{mode:?} allocated"
        );
        // SAFETY: the handler has finished (DONE) and nothing else writes the slot.
        let bt = unsafe { (*SLOT.out.get()).clone() };
        let n = common::short_names(bt.frames());
        // The first frame is the exact interrupted PC inside libc, then libc's frames, then
        // our chain in order.
        assert!(matches!(bt.frames()[0], fibertrace_core::Frame::Pc(_)));
        let i = n
            .iter()
            .position(|x| x == "u2")
            .unwrap_or_else(|| panic!("{mode:?}: {n:?}"));
        assert!(i >= 1, "{n:?}");
        assert_eq!(
            &n[i..i + 3],
            ["u2", "u1", "capture_from_ucontext_in_a_signal_handler"],
            "{mode:?}: {n:?}"
        );
        assert!(
            n[..i]
                .iter()
                .any(|x| x.contains("raise") || x.contains("kill")),
            "{n:?}"
        );
    }
}
