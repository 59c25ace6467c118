//! libunwind as an independent oracle (feature `libunwind`): its frames must agree with
//! ours on the same stacks, and linking it must leave the process's `_Unwind_*` ABI (and so
//! the cost of a Rust panic) alone.
#![cfg(feature = "libunwind")]

mod common;
#[path = "../benches/shared/mod.rs"]
mod shared;

use std::hint::black_box;
use std::time::Instant;

use fibertrace_core::unwind::libunwind;
use fibertrace_core::{collect, collect_from, CaptureOptions, Frame, Unwinder};

#[inline(never)]
fn both() -> (Vec<Frame>, Vec<u64>) {
    // Same call site depth: each capture is made from this function.
    let ours = collect(&CaptureOptions::with_unwinder(Unwinder::Auto));
    let theirs = libunwind::current_stack(64);
    black_box(&theirs);
    (ours.frames().to_vec(), theirs)
}

#[inline(never)]
fn deeper(n: u32) -> (Vec<Frame>, Vec<u64>) {
    if n == 0 {
        return both();
    }
    let r = deeper(n - 1);
    black_box(&r);
    r
}

#[test]
fn libunwind_agrees_on_the_current_stack() {
    let (ours, theirs) = deeper(5);
    // Frame 0 differs (two different call sites in `both`); from the caller of `both` on,
    // every return address must be the same.
    let ours: Vec<u64> = ours.iter().filter_map(|f| f.address()).collect();
    assert!(ours.len() >= 8, "{ours:x?}");
    assert_eq!(common::short_names(&[Frame::Ra(ours[1])]), ["deeper"]);
    let n = ours.len().min(theirs.len());
    assert!(
        n >= ours.len() - 1,
        "libunwind found fewer frames: {theirs:x?}"
    );
    assert_eq!(ours[1..n], theirs[1..n]);
}

mod coro {
    use corosensei::stack::{DefaultStack, Stack};
    use corosensei::{Coroutine, Yielder};
    use fibertrace_core::{SavedContext, StackBounds};
    use std::cell::Cell;
    use std::rc::Rc;

    use super::shared::park;

    pub fn parked() -> (Coroutine<(), (), ()>, SavedContext) {
        let stack = DefaultStack::new(128 * 1024).unwrap();
        let bounds = StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16);
        let ctx = Rc::new(Cell::new(SavedContext::new(bounds)));
        let c2 = ctx.clone();
        let mut co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| park(y, &c2, 6));
        co.resume(());
        let saved = ctx.get();
        (co, saved)
    }
}

#[test]
fn libunwind_agrees_on_a_suspended_coroutine() {
    let (mut co, ctx) = coro::parked();
    let theirs = libunwind::suspended(&ctx, 64);
    for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
        let ours: Vec<u64> = collect_from(&ctx, &CaptureOptions::with_unwinder(u))
            .frames()
            .iter()
            .filter_map(|f| f.address())
            .collect();
        // libunwind stops where the stack pointer leaves the coroutine's stack; ours where
        // reads would. The frames both report are the same.
        let n = ours.len().min(theirs.len());
        assert!(n >= 9, "{u:?}: ours {ours:x?} theirs {theirs:x?}");
        assert_eq!(ours[..n], theirs[..n], "{u:?}");
    }
    co.resume(());
}

#[inline(never)]
fn panic_deep(n: u32) {
    if n == 0 {
        std::panic::panic_any(7u32);
    }
    panic_deep(n - 1);
    black_box(());
}

#[test]
fn linking_libunwind_does_not_take_over_the_unwind_abi() {
    // Rust panics go through whichever library provides `_Unwind_RaiseException`.
    let provider = libunwind::unwind_abi_provider().expect("symbol found");
    assert!(
        provider.contains("libgcc_s"),
        "panics would run on {provider}"
    );
    // And a panic through 20 frames costs what it costs with libgcc (about 10-20 µs here;
    // on libunwind it was 400 µs). A generous bound that only interposition would break.
    std::panic::set_hook(Box::new(|_| {}));
    let mut best = u128::MAX;
    for _ in 0..50 {
        let t = Instant::now();
        let r = std::panic::catch_unwind(|| panic_deep(20));
        best = best.min(t.elapsed().as_nanos());
        assert!(r.is_err());
    }
    let _ = std::panic::take_hook();
    assert!(best < 150_000, "a panic through 20 frames took {best} ns");
}
