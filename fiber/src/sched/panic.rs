//! Panics in fibers: the fiber's stack is captured when it panics (by a process-wide panic
//! hook that chains to the previous one), and the fiber ends with a report instead of taking
//! the scheduler down. Reports (of a panic, a dump taken from a fiber) resolve symbols on the
//! stack of the code that resumed the fiber ([`on_parent_stack`]), not on the fiber's own,
//! which may be small. (Kept here, out of the scheduler's hot module: placed there, it moved
//! the code of the yield path, and a Lua `fiber.create` measured 5-10% slower.)

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Once;

use fibertrace_core::{Backtrace, CaptureOptions, Unwinder};

use crate::task::{ControlBlock, PanicReport};

thread_local! {
    static LAST: std::cell::RefCell<Option<(Option<String>, Backtrace)>> =
        const { std::cell::RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Installs the hook (once per process). The previous hook still runs after ours.
pub(crate) fn install_hook() {
    HOOK.call_once(|| {
        // (Here, once, as the hook: what every scheduler needs set process-wide.)
        fibertrace_core::symbolize::set_large_stack_runner(on_parent_stack);
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(shared) = super::current_shared() {
                capture(&shared, info.location().map(|l| l.to_string()));
            }
            prev(info);
        }));
    });
}

#[inline(never)]
fn capture(shared: &ControlBlock, location: Option<String>) {
    let mut bt = Backtrace::new();
    let opts = CaptureOptions {
        unwinder: Unwinder::Auto,
        ..CaptureOptions::default()
    };
    fibertrace_core::collect_until(&opts, shared.entry_sp.load(Ordering::Relaxed), &mut bt);
    // Only addresses here: the panic may come from code that holds the symbolizer's lock
    // (a report being written), which is released once the panic has unwound. The panic
    // machinery's frames are cut in `take_report`.
    LAST.with(|l| *l.borrow_mut() = Some((location, bt)));
}

/// `frames` without the panic machinery's own: everything up to the last std::panicking
/// frame.
fn without_machinery(frames: &[fibertrace_core::Frame]) -> Backtrace {
    let cut = frames
        .iter()
        .rposition(|f| {
            fibertrace_core::symbolize::resolve(f)
                .and_then(|r| r.function().map(is_panic_machinery))
                .unwrap_or(false)
        })
        .map_or(0, |i| i + 1);
    Backtrace::from_frames(&frames[cut..])
}

fn is_panic_machinery(name: &str) -> bool {
    name.starts_with("std::panicking::")
        || name.starts_with("core::panicking::")
        || name.starts_with("std::panic::")
        || name.starts_with(module_path!())
        || name.contains("rust_begin_unwind")
        || name.starts_with("<alloc::boxed::Box<F,A> as core::ops::function::Fn")
        || name.starts_with("std::sys::backtrace::__rust_end_short_backtrace")
}

/// The report of a panic that just unwound out of `shared`'s user code.
pub(crate) fn take_report(
    shared: &ControlBlock,
    payload: &(dyn std::any::Any + Send),
) -> PanicReport {
    let message = if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "Box<dyn Any>".to_string()
    };
    let (location, backtrace) = LAST
        .with(|l| l.borrow_mut().take())
        .map_or((None, Backtrace::new()), |(loc, bt)| {
            (loc, without_machinery(bt.frames()))
        });
    let _ = shared;
    PanicReport {
        message,
        location,
        backtrace,
    }
}

/// The fiber stack left below the caller with which [`on_parent_stack`] runs its work in
/// place: room for the ~192 KiB it needs in a debug build, with some to spare. A fiber with
/// that much left (the default 256 KiB stacks near their top, a Lua host's fibers) does not
/// switch: the parent's stack may have to grow for it (the main thread's does), which fails
/// at an address-space limit (`ulimit -v`) reached — a dump at exit out of memory, from a
/// Lua fiber, crashed on the main thread's stack that way.
const ROOM_IN_PLACE: u64 = 224 << 10;

/// Set by a crash report (the crashed fiber's state may be broken): [`on_parent_stack`] runs
/// its work in place from then on.
static NO_STACK_SWITCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// See [`NO_STACK_SWITCH`]. Async-signal-safe (one store).
pub(crate) fn forbid_stack_switch() {
    NO_STACK_SWITCH.store(true, Ordering::Relaxed);
}

thread_local! {
    /// Set while this thread runs work on a fiber's parent stack (see [`on_parent_stack`]).
    static ON_PARENT_STACK: Cell<bool> = const { Cell::new(false) };
    /// A stack of this thread's own, for the work of a fiber run inside another fiber's
    /// switch (see [`on_parent_stack`]): made at its first use, then kept.
    static SIDE_STACK: std::cell::RefCell<Option<corosensei::stack::DefaultStack>> =
        const { std::cell::RefCell::new(None) };
}

/// The size of [`SIDE_STACK`]: [`ROOM_IN_PLACE`] and more (only what is used is touched).
const SIDE_STACK_SIZE: usize = 1 << 20;

/// Runs `work` on the stack of the code that resumed the running fiber (the scheduler's own
/// stack, for a fiber its loop resumed), or on a stack of the thread's own for a fiber run
/// inside another fiber's switch (started by `yield_to`, or run by another's yield in place:
/// the resuming fiber's stack may be nearly full — the work ran there and overflowed it when
/// that fiber was deep in recursion): the symbolizer's parsing of debug information needs
/// about 100 KiB of stack
/// in a debug build, and a fiber given `MIN_STACK_SIZE` that panicked or took a dump stopped
/// the process with an overflow. That stack is free below where its code was suspended,
/// until the fiber switches back. In place outside a fiber, off its stack (a signal's or a
/// safe point's own stack), with [`ROOM_IN_PLACE`] left on it, inside such a run already (its
/// stack is in use), while the fiber is unwound by its scheduler's drop, and during a crash
/// report (the fiber's state may be broken).
pub(crate) fn on_parent_stack(work: &mut dyn FnMut()) {
    let nested = ON_PARENT_STACK.try_with(Cell::get).unwrap_or(true);
    // (Where this call's frame is: the fiber's stack left below it.)
    let here = &raw const nested as u64;
    let ctx = super::current_ctx().filter(|c| {
        !nested
            && !c.dropping.get()
            && !c.yielder.get().is_null()
            && !NO_STACK_SWITCH.load(Ordering::Relaxed)
            && c.shared.stack.contains(here)
            // (The bounds begin with the reserve, closed until an overflow opens it.)
            && here.saturating_sub(c.shared.stack.lo + crate::stack::RESERVE as u64)
                < ROOM_IN_PLACE
    });
    let Some(ctx) = ctx else {
        work();
        return;
    };
    /// The work, moved to the other stack of the same thread.
    struct SameThread<'a>(&'a mut dyn FnMut());
    // SAFETY: corosensei asks for `Send` so that no reference to the yielder reaches the
    // parent's side; the work runs on this same thread, before this call returns, and holds
    // no yielder (the symbolizer's lookups do not suspend).
    unsafe impl Send for SameThread<'_> {}
    /// Clears the flag however the work ends.
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            let _ = ON_PARENT_STACK.try_with(|c| c.set(false));
        }
    }
    if super::with_sched(|s| s.nested.get() != 0).unwrap_or(false) {
        // Resumed by another fiber: on the side stack (taken out while in use; made if
        // there is none — if that fails, out of memory, in place).
        let stack = SIDE_STACK
            .try_with(|s| s.borrow_mut().take())
            .ok()
            .flatten()
            .or_else(|| corosensei::stack::DefaultStack::new(SIDE_STACK_SIZE).ok());
        let Some(mut stack) = stack else {
            work();
            return;
        };
        ON_PARENT_STACK.with(|c| c.set(true));
        let _done = Done;
        let bounds = {
            use corosensei::stack::Stack;
            fibertrace_core::StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64)
        };
        // (Walks from there, of an allocation's stack say, stay inside it.)
        let _entered = fibertrace_core::enter_stack(bounds);
        corosensei::on_stack(&mut stack, work);
        let _ = SIDE_STACK.try_with(|s| *s.borrow_mut() = Some(stack));
        return;
    }
    ON_PARENT_STACK.with(|c| c.set(true));
    let _done = Done;
    let w = SameThread(work);
    let y = ctx.yielder.get();
    // SAFETY: the yielder pointer was stored by this fiber when it started and points into
    // its own stack (corosensei's parent link), valid while it runs; the parent is suspended
    // in its resume of this fiber, which cannot return while this call runs.
    unsafe {
        (*y).on_parent_stack(move || {
            let w = w;
            (w.0)()
        })
    }
}
