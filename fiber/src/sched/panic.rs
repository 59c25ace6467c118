//! Panics in fibers: the fiber's stack is captured when it panics (by a process-wide panic
//! hook that chains to the previous one), and the fiber ends with a report instead of taking
//! the scheduler down.

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
        fibertrace_core::symbolize::set_large_stack_runner(super::on_parent_stack);
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
