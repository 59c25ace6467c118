//! Exact-frame tests of capture from the current stack, from a suspended coroutine, through
//! glibc, and of the omission markers. Run in debug and release (CI runs both).

mod common;

use std::hint::black_box;

use common::{file_line, names, short_names};
use fibertrace_core::{
    collect, collect_from, Backtrace, CaptureOptions, Frame, SavedContext, StackBounds, Unwinder,
};

const ALL: [Unwinder; 3] = [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto];

#[inline(never)]
fn level1(opts: &CaptureOptions) -> (Backtrace, [u32; 3]) {
    let (r, l) = (level2(opts), line!());
    black_box(&r);
    (r.0, [r.1[0], r.1[1], l])
}

#[inline(never)]
fn level2(opts: &CaptureOptions) -> (Backtrace, [u32; 2]) {
    let (r, l) = (level3(opts), line!());
    black_box(&r);
    (r.0, [r.1, l])
}

#[inline(never)]
fn level3(opts: &CaptureOptions) -> (Backtrace, u32) {
    let (bt, l) = (collect(opts), line!());
    black_box(&bt);
    (bt, l)
}

#[test]
fn current_stack_exact_frames_every_unwinder() {
    for u in ALL {
        let (bt, lines) = level1(&CaptureOptions::with_unwinder(u));
        let n = short_names(&bt.frames()[..4]);
        assert_eq!(
            n,
            [
                "level3",
                "level2",
                "level1",
                "current_stack_exact_frames_every_unwinder"
            ],
            "{u:?}: {bt:?}"
        );
        // The capture call never appears; file:line is the call site in each function.
        assert!(!names(bt.frames()).iter().any(|n| n.contains("collect")));
        for (i, want) in lines.iter().enumerate() {
            assert_eq!(
                file_line(&bt.frames()[i]),
                Some(("capture.rs".to_string(), *want)),
                "{u:?} frame {i}"
            );
        }
        assert!(matches!(bt.frames()[0], Frame::Ra(_)));
    }
}

#[test]
fn unwinders_agree_on_the_whole_stack() {
    // One call site for all three, so that every return address can match.
    let mut t: Vec<Backtrace> = ALL
        .iter()
        .map(|&u| level1(&CaptureOptions::with_unwinder(u)).0)
        .collect();
    let (auto, precise, fast) = (t.pop().unwrap(), t.pop().unwrap(), t.pop().unwrap());
    // DWARF goes through glibc's thread start; the frame-pointer walk may stop before it.
    assert_eq!(precise, auto);
    assert!(fast.len() <= precise.len());
    assert_eq!(fast.frames(), &precise.frames()[..fast.len()]);
}

// ---- suspended coroutine ---------------------------------------------------------------

mod coro {
    use super::*;
    use corosensei::stack::{DefaultStack, Stack};
    use corosensei::{Coroutine, CoroutineResult, Yielder};
    use std::cell::Cell;
    use std::rc::Rc;

    pub struct Fixture {
        pub co: Coroutine<(), (), (), DefaultStack>,
        pub ctx: Rc<Cell<SavedContext>>,
        pub lines: Rc<Cell<[u32; 3]>>,
    }

    #[inline(never)]
    fn traced_suspend(y: &Yielder<(), ()>, ctx: &Cell<SavedContext>) {
        let mut c = ctx.get();
        c.record();
        ctx.set(c);
        y.suspend(());
        black_box(());
    }

    #[inline(never)]
    fn s1(y: &Yielder<(), ()>, ctx: &Cell<SavedContext>, lines: &Cell<[u32; 3]>) {
        let l = line!();
        s2(y, ctx, lines);
        let mut v = lines.get();
        v[2] = l + 1;
        lines.set(v);
        black_box(());
    }

    #[inline(never)]
    fn s2(y: &Yielder<(), ()>, ctx: &Cell<SavedContext>, lines: &Cell<[u32; 3]>) {
        let l = line!();
        s3(y, ctx, lines);
        let mut v = lines.get();
        v[1] = l + 1;
        lines.set(v);
        black_box(());
    }

    #[inline(never)]
    fn s3(y: &Yielder<(), ()>, ctx: &Cell<SavedContext>, lines: &Cell<[u32; 3]>) {
        let l = line!();
        traced_suspend(y, ctx);
        let mut v = lines.get();
        v[0] = l + 1;
        lines.set(v);
        black_box(());
    }

    pub fn suspended() -> Fixture {
        let stack = DefaultStack::new(256 * 1024).unwrap();
        // The top 16 bytes hold corosensei's parent link, stale while suspended: not ours.
        let bounds = StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16);
        let ctx = Rc::new(Cell::new(SavedContext::new(bounds)));
        let lines = Rc::new(Cell::new([0; 3]));
        let (c2, l2) = (ctx.clone(), lines.clone());
        let mut co = Coroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| {
            s1(y, &c2, &l2);
        });
        assert!(matches!(co.resume(()), CoroutineResult::Yield(())));
        Fixture { co, ctx, lines }
    }

    impl Fixture {
        pub fn finish(mut self) -> [u32; 3] {
            assert!(matches!(self.co.resume(()), CoroutineResult::Return(())));
            self.lines.get()
        }
    }
}

#[test]
fn suspended_coroutine_exact_frames_every_unwinder() {
    let fx = coro::suspended();
    let ctx = fx.ctx.get();
    let mut traces = Vec::new();
    for u in ALL {
        let bt = collect_from(&ctx, &CaptureOptions::with_unwinder(u));
        let n = short_names(bt.frames());
        // Frame 0 is the exact suspension point, inside the wrapper (where `record` was
        // inlined into it).
        assert_eq!(common::outer_name(&bt.frames()[0]), "traced_suspend");
        assert_eq!(&n[1..4], ["s3", "s2", "s1"], "{u:?}: {n:?}");
        assert!(matches!(bt.frames()[0], Frame::Pc(_)));
        // The walk stays on the coroutine's stack: nothing of this test's thread appears.
        assert!(
            !n.iter()
                .any(|x| x.contains("suspended_coroutine_exact_frames")),
            "{u:?}: {n:?}"
        );
        // Skipping the suspend wrapper.
        let opts = CaptureOptions {
            offset: 1,
            ..CaptureOptions::with_unwinder(u)
        };
        let skipped = collect_from(&ctx, &opts);
        assert_eq!(skipped.frames(), &bt.frames()[1..]);
        traces.push(bt);
    }
    let lines = fx.finish();
    for bt in &traces {
        for (i, want) in lines.iter().enumerate() {
            assert_eq!(
                file_line(&bt.frames()[i + 1]),
                Some(("capture.rs".to_string(), *want))
            );
        }
    }
}

#[test]
fn corrupted_frame_chain_in_suspended_stack_ends_the_walk() {
    let fx = coro::suspended();
    let ctx = fx.ctx.get();
    let good = collect_from(&ctx, &CaptureOptions::with_unwinder(Unwinder::Fast));
    // The wrapper's frame record: [fp] = s3's frame pointer. Corrupt it in several ways.
    let slot = ctx.regs.fp as *mut u64;
    // SAFETY: `slot` is the saved-rbp word of traced_suspend's live frame on the suspended
    // coroutine's stack; the coroutine is not running, and the word is restored below.
    let saved = unsafe { slot.read() };
    let s3_fp = saved;
    let s3_slot = s3_fp as *mut u64;
    // SAFETY: as above, s3's saved-rbp word on the same suspended stack.
    let s3_saved = unsafe { s3_slot.read() };
    let cases: [(&str, *mut u64, u64); 5] = [
        ("null", slot, 0),
        ("misaligned", slot, saved + 3),
        ("outside the stack", slot, 0x10),
        ("points to itself", slot, ctx.regs.fp),
        ("cycle back down", s3_slot, ctx.regs.fp),
    ];
    let mut results = Vec::new();
    for (what, at, value) in cases {
        // SAFETY: see above; restored right after the walks.
        unsafe { at.write(value) };
        for u in ALL {
            results.push((
                what,
                u,
                collect_from(&ctx, &CaptureOptions::with_unwinder(u)),
            ));
        }
        // SAFETY: restores the original words before anything else happens: a panic with
        // the chain corrupted would make the coroutine's force-unwind on drop loop forever.
        unsafe {
            slot.write(saved);
            s3_slot.write(s3_saved);
        }
    }
    fx.finish();
    for (what, u, bt) in results {
        assert!(bt.len() >= 2, "{what} {u:?}: {bt:?}");
        assert_eq!(bt.frames()[..2], good.frames()[..2], "{what} {u:?}");
        assert!(bt.len() < 64, "{what} {u:?}: {bt:?}");
    }
}

// ---- through glibc qsort ---------------------------------------------------------------

mod qsort {
    use super::*;
    use std::cell::RefCell;

    thread_local! {
        pub static CAPTURED: RefCell<Vec<Backtrace>> = const { RefCell::new(Vec::new()) };
        pub static MODE: std::cell::Cell<Unwinder> = const { std::cell::Cell::new(Unwinder::Auto) };
        /// `Some(with_cache)`: capture as a signal handler would, from a saved context.
        pub static IN_HANDLER: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    }

    #[inline(never)]
    fn q2() {
        let opts = CaptureOptions::with_unwinder(MODE.with(|m| m.get()));
        let bt = match IN_HANDLER.with(|h| h.get()) {
            None => collect(&opts),
            Some(with_cache) => {
                let mut ctx = SavedContext::new(fibertrace_core::capture::thread_stack());
                ctx.record();
                let mut cache = fibertrace_core::unwind::DwarfCache::new();
                let mut out = Backtrace::new();
                fibertrace_core::capture::collect_from_in_handler(
                    &ctx,
                    &opts,
                    with_cache.then_some(&mut cache),
                    &mut out,
                );
                out
            }
        };
        CAPTURED.with(|c| c.borrow_mut().push(bt));
        black_box(());
    }

    #[inline(never)]
    fn q1() {
        q2();
        black_box(());
    }

    pub extern "C" fn compare(a: *const libc::c_void, b: *const libc::c_void) -> libc::c_int {
        // SAFETY: qsort passes pointers to elements of the i32 array below.
        let (a, b) = unsafe { (*(a as *const i32), *(b as *const i32)) };
        if CAPTURED.with(|c| c.borrow().is_empty()) {
            q1();
        }
        a.cmp(&b) as libc::c_int
    }

    #[inline(never)]
    pub fn sort_with_callback(mode: Unwinder) -> Backtrace {
        MODE.with(|m| m.set(mode));
        CAPTURED.with(|c| c.borrow_mut().clear());
        let mut v: Vec<i32> = (0..64).rev().collect();
        // SAFETY: a valid i32 array, its length and element size, and a comparator that
        // reads two i32s.
        unsafe {
            libc::qsort(
                v.as_mut_ptr() as *mut libc::c_void,
                v.len(),
                4,
                Some(compare),
            );
        }
        assert!(v.windows(2).all(|w| w[0] <= w[1]));
        black_box(&v);
        CAPTURED.with(|c| c.borrow_mut().pop().unwrap())
    }
}

#[test]
fn chain_through_glibc_qsort() {
    // `Fast` too: its frame-pointer walk would stop (or go astray) in glibc, which keeps no
    // frame pointers; it sees that and walks again with DWARF.
    for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
        let bt = qsort::sort_with_callback(u);
        let n = short_names(bt.frames());
        assert_eq!(&n[..3], ["q2", "q1", "compare"], "{u:?}: {n:?}");
        // Through glibc's frames (no frame pointers there) back to our code.
        let sorter = n
            .iter()
            .position(|x| x == "sort_with_callback")
            .unwrap_or_else(|| panic!("{u:?} lost the caller of qsort: {n:?}"));
        // (glibc's qsort is its merge sort: named `qsort_r` from the dynamic symbols, or
        // `msort_with_tmp` inlined into it when glibc's detached debug file is installed.)
        assert!(
            n[3..sorter]
                .iter()
                .any(|x| x == "qsort" || x == "qsort_r" || x == "msort_with_tmp"),
            "{u:?}: {n:?}"
        );
        assert_eq!(n[sorter + 1], "chain_through_glibc_qsort", "{u:?}: {n:?}");
    }
}

/// As a signal handler captures (no thread-local cache, the image table only if built): a
/// `Fast` walk from a saved context into glibc's qsort cannot trust glibc's `rbp`. With a
/// DWARF cache it walks again with DWARF; without one it ends right after the first glibc
/// frame and says so with `Truncated`.
#[test]
fn fast_in_a_handler_through_glibc_falls_back_or_says_it_stopped() {
    fibertrace_core::prepare();
    let run = |with_cache: bool| {
        qsort::IN_HANDLER.with(|h| h.set(Some(with_cache)));
        let bt = qsort::sort_with_callback(Unwinder::Fast);
        qsort::IN_HANDLER.with(|h| h.set(None));
        bt
    };
    let table = fibertrace_core::image::table();
    let in_libc = |f: &Frame| {
        f.lookup_address()
            .and_then(|a| table.code_image(a))
            .is_some_and(|i| i.is_libc)
    };

    // Frame 0 is the recording point inside q2 (its innermost level is the inlined
    // `SavedContext::record` where debug info says so).
    let bt = run(false);
    let n = short_names(bt.frames());
    assert_eq!(&n[1..3], ["q1", "compare"], "{n:?}");
    let f = bt.frames();
    assert_eq!(f.last(), Some(&Frame::Truncated), "{n:?}");
    assert_eq!(f.len(), 5, "one glibc frame, then the marker: {n:?}");
    assert!(in_libc(&f[3]), "{n:?}");

    let bt = run(true);
    let n = short_names(bt.frames());
    assert_eq!(&n[1..3], ["q1", "compare"], "{n:?}");
    let sorter = n
        .iter()
        .position(|x| x == "sort_with_callback")
        .unwrap_or_else(|| panic!("lost the caller of qsort: {n:?}"));
    // And on past it, to the test harness (this test may be inlined there in release).
    assert!(n.len() > sorter + 3, "{n:?}");
    assert!(!bt.frames().contains(&Frame::Truncated), "{n:?}");
}

// ---- deep stacks: omitted and truncated ------------------------------------------------

#[inline(never)]
fn rec(n: u32, opts: &CaptureOptions) -> Backtrace {
    if n == 0 {
        let bt = collect(opts);
        black_box(&bt);
        return bt;
    }
    let bt = rec(n - 1, opts);
    black_box(&bt);
    bt
}

#[test]
fn deep_recursion_keeps_top_frames_and_counts_the_rest() {
    for u in ALL {
        let full = rec(0, &CaptureOptions::with_unwinder(u));
        let outer = full.len() - 1; // frames above rec(0)
        assert!(full.len() < 64);
        let opts = CaptureOptions {
            unwinder: u,
            limit: 20,
            top: 5,
            offset: 0,
        };
        let deep = rec(200, &opts);
        let f = deep.frames();
        assert_eq!(f.len(), 20);
        assert!(short_names(&f[..14]).iter().all(|n| n == "rec"), "{u:?}");
        assert_eq!(
            f[14],
            Frame::Omitted((201 + outer - 14 - 5) as u64),
            "{u:?}"
        );
        assert_eq!(&f[15..], &full.frames()[full.len() - 5..], "{u:?}");

        let opts = CaptureOptions { top: 0, ..opts };
        let cut = rec(200, &opts);
        assert_eq!(cut.len(), 20);
        assert!(short_names(&cut.frames()[..19]).iter().all(|n| n == "rec"));
        assert_eq!(cut.frames()[19], Frame::Truncated);
    }
}

#[test]
fn parent_trace_appended_at_capacity_keeps_both() {
    let parent = rec(100, &CaptureOptions::default());
    let mut own = rec(100, &CaptureOptions::default());
    assert_eq!(own.len(), 64);
    own.append(42, parent.frames());
    assert_eq!(own.len(), 64);
    let segs: Vec<_> = own.segments().collect();
    assert_eq!(segs.len(), 2);
    assert_eq!(segs[1].0, Some(42));
    // Both keep their innermost frames and their outermost frames.
    for (_, s) in &segs {
        assert_eq!(short_names(&s[..3]), ["rec", "rec", "rec"]);
        assert!(s.iter().any(|f| matches!(f, Frame::Omitted(_))));
    }
    assert_eq!(segs[0].1.last(), parent.frames().last());
    assert_eq!(segs[1].1.last(), parent.frames().last());
}
