//! Parent traces: exact frames of a chain of creators, the cap on the ancestors shown (and
//! its marker), the bound on the ancestry kept in memory, and turning them off.

mod common;

use std::cell::RefCell;
use std::hint::black_box;
use std::rc::Rc;
use std::sync::{Arc, Mutex, Weak};

use common::{info_names, names};
use fibertrace_fiber::info::{fiber_info, user_frames, InfoOptions};
use fibertrace_fiber::{
    channel, current, spawn, yield_now, Builder, Channel, JoinHandle, Scheduler, SchedulerOptions,
};
use fibertrace_fiber::{parent_trace_copies, ControlBlock};

/// The caps as the README and the docs state them: ancestors shown per fiber, and ancestors
/// kept in memory per lineage (the bounds below are these numbers, not the constants, so a
/// change of the code's constants cannot make a test pass that should fail).
const PARENT_DEPTH_SHOWN: usize = 8;
const PARENT_DEPTH_KEPT: usize = 16;

#[test]
fn the_caps_are_the_documented_ones() {
    assert_eq!(fibertrace_fiber::PARENT_DEPTH_SHOWN, PARENT_DEPTH_SHOWN);
    assert_eq!(fibertrace_fiber::PARENT_DEPTH_KEPT, PARENT_DEPTH_KEPT);
}

/// Tests that make or count copied ancestor traces run one at a time (the count is global).
static COPIES: Mutex<()> = Mutex::new(());

fn copies_lock() -> std::sync::MutexGuard<'static, ()> {
    COPIES.lock().unwrap_or_else(|e| e.into_inner())
}

type Ids = Rc<RefCell<Vec<u64>>>;

#[inline(never)]
fn spawn_a(ch: Channel<u32>, ids: Ids) -> JoinHandle<()> {
    let h = Builder::new().name("a").spawn(move || {
        ids.borrow_mut().push(current().unwrap().id());
        let h = spawn_b(ch, ids);
        h.join().unwrap()
    });
    black_box(h)
}

#[inline(never)]
fn spawn_b(ch: Channel<u32>, ids: Ids) -> JoinHandle<()> {
    let h = Builder::new().name("b").spawn(move || {
        ids.borrow_mut().push(current().unwrap().id());
        let h = spawn_c(ch, ids);
        h.join().unwrap()
    });
    black_box(h)
}

#[inline(never)]
fn spawn_c(ch: Channel<u32>, ids: Ids) -> JoinHandle<()> {
    let h = Builder::new().name("c").spawn(move || {
        ids.borrow_mut().push(current().unwrap().id());
        black_box(ch.recv());
    });
    black_box(h)
}

/// The innermost frame of each ancestor's segment names the function that spawned the next
/// one, in order: c was spawned in `spawn_c` (by b), b in `spawn_b` (by a), a in `spawn_a`
/// (by main), main by the test's thread.
#[test]
fn three_deep_chain_shows_each_creator_at_its_spawn_in_order() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let ids = Ids::default();
            let a = spawn_a(ch.clone(), ids.clone());
            for _ in 0..3 {
                yield_now(); // a runs and spawns b, which spawns c, which parks
            }
            let main_id = current().unwrap().id();
            let [a_id, b_id, c_id] = ids.borrow()[..] else {
                panic!("{:?}", ids.borrow())
            };
            let fi = fiber_info(c_id, &InfoOptions::default()).unwrap();
            let who: Vec<(Option<u64>, &str)> = fi
                .parent_backtrace
                .iter()
                .map(|p| (p.fiber, &*p.name))
                .collect();
            let thread = std::thread::current()
                .name()
                .unwrap_or("thread")
                .to_string();
            assert_eq!(
                who,
                [
                    (Some(b_id), "b"),
                    (Some(a_id), "a"),
                    (Some(main_id), "main"),
                    (None, thread.as_str()),
                ],
                "{who:?}"
            );
            assert_eq!(fi.parent_backtrace_omitted, 0);
            // Each segment starts at the spawn call and ends at the creator's entry.
            let first: Vec<String> = fi
                .parent_backtrace
                .iter()
                .map(|p| info_names(&p.frames)[0].clone())
                .collect();
            assert_eq!(
                first,
                [
                    "spawn_c",
                    "spawn_b",
                    "spawn_a",
                    "three_deep_chain_shows_each_creator_at_its_spawn_in_order"
                ]
            );
            for p in &fi.parent_backtrace[..2] {
                let n = info_names(&p.frames);
                assert_eq!(n.len(), 2, "{n:?}");
                assert!(n[1].contains("closure"), "the creator's entry: {n:?}");
            }
            // The same through the trace itself: the kept chain, its depth, and the flat
            // list with a marker before each ancestor.
            let f = fibertrace_fiber::registry::find(c_id).unwrap().1;
            let pt = f_parent(&f);
            assert_eq!(pt.depth(), 4);
            assert_eq!(pt.kept(), 4);
            assert_eq!(pt.omitted(), 0);
            let markers: Vec<String> = names(&pt.flatten())
                .into_iter()
                .filter(|n| n.starts_with("<parent"))
                .collect();
            assert_eq!(
                markers,
                [
                    format!("<parent {b_id}>"),
                    format!("<parent {a_id}>"),
                    format!("<parent {main_id}>"),
                    "<parent 0>".to_string()
                ]
            );
            ch.send(1).unwrap();
            a.join().unwrap();
        })
        .unwrap();
}

fn f_parent(f: &Arc<ControlBlock>) -> &fibertrace_fiber::ParentTrace {
    f.parent_trace().expect("a parent trace")
}

/// Spawns a chain of `n` fibers, each from the one before, each parked on `ch` afterwards;
/// the ids in order.
fn chain(n: usize, ch: &Channel<u32>, ids: &Rc<RefCell<Vec<u64>>>) {
    if n == 0 {
        return;
    }
    let (ch2, ids2) = (ch.clone(), ids.clone());
    spawn(move || {
        ids2.borrow_mut().push(current().unwrap().id());
        chain(n - 1, &ch2, &ids2);
        black_box(ch2.recv());
    });
}

/// A chain deeper than the cap: the nearest ancestors are shown, the others counted, in info,
/// in the text dump (`... N more parent fibers`) and in the trace's own counts.
#[test]
fn a_chain_deeper_than_the_cap_shows_the_nearest_and_counts_the_rest() {
    let _g = copies_lock();
    const D: usize = 40;
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(0);
            let ids = Rc::new(RefCell::new(Vec::new()));
            chain(D, &ch, &ids);
            for _ in 0..D {
                yield_now();
            }
            let ids = ids.borrow().clone();
            assert_eq!(ids.len(), D);
            let main_id = current().unwrap().id();
            let deepest = *ids.last().unwrap();
            let fi = fiber_info(deepest, &InfoOptions::default()).unwrap();
            // Ancestors: D - 1 chain fibers, main, the thread.
            let all = D as u64 + 1;
            assert_eq!(fi.parent_backtrace.len(), PARENT_DEPTH_SHOWN);
            assert_eq!(fi.parent_backtrace_omitted, all - PARENT_DEPTH_SHOWN as u64);
            let shown: Vec<Option<u64>> = fi.parent_backtrace.iter().map(|p| p.fiber).collect();
            let want: Vec<Option<u64>> = ids[..D - 1]
                .iter()
                .rev()
                .take(PARENT_DEPTH_SHOWN)
                .map(|&i| Some(i))
                .collect();
            assert_eq!(shown, want);
            let mut text = String::new();
            fibertrace_fiber::dump::render_fiber(&fi, &mut text);
            let last = text.lines().last().unwrap();
            assert_eq!(last, format!("... {} more parent fibers", all - 8));
            assert_eq!(
                text.matches("created by fiber").count(),
                PARENT_DEPTH_SHOWN,
                "{text}"
            );
            // Every fiber of the chain: what is shown and counted adds up to its depth.
            for (k, &id) in ids.iter().enumerate() {
                let fi = fiber_info(id, &InfoOptions::default()).unwrap();
                let depth = k as u64 + 2; // its k chain ancestors, main, the thread
                let shown = fi.parent_backtrace.len() as u64;
                assert_eq!(shown, depth.min(PARENT_DEPTH_SHOWN as u64), "fiber {k}");
                assert_eq!(shown + fi.parent_backtrace_omitted, depth, "fiber {k}");
                let f = fibertrace_fiber::registry::find(id).unwrap().1;
                assert!(f_parent(&f).kept() <= PARENT_DEPTH_KEPT);
                assert_eq!(f_parent(&f).depth(), depth);
                // Near the top: the chain reaches main.
                if k < PARENT_DEPTH_SHOWN - 1 {
                    assert_eq!(fi.parent_backtrace[k].fiber, Some(main_id));
                }
            }
            // A dump line for one ancestor.
            assert_eq!(
                fibertrace_fiber::dump::more_parents_line(1),
                "... 1 more parent fiber"
            );
            for _ in 0..D {
                ch.send(0).unwrap();
            }
        })
        .unwrap();
}

/// Runs `n` generations of a fiber that spawns its successor and ends; returns how many of
/// their control blocks are still alive at the end, how many copied ancestor traces, and the
/// last generation's (depth, kept) from its parent trace.
fn generations(n: usize) -> (usize, usize, u64, usize) {
    let blocks: Rc<RefCell<Vec<Weak<ControlBlock>>>> = Rc::default();
    let last = Rc::new(RefCell::new((0u64, 0usize)));
    fn generation(
        left: usize,
        blocks: Rc<RefCell<Vec<Weak<ControlBlock>>>>,
        last: Rc<RefCell<(u64, usize)>>,
    ) {
        let me = current().unwrap();
        blocks.borrow_mut().push(Arc::downgrade(me.control_block()));
        if left > 1 {
            spawn(move || generation(left - 1, blocks, last));
        } else {
            let t = me.parent_trace().unwrap();
            *last.borrow_mut() = (t.depth(), t.kept());
        }
    }
    let (b2, l2) = (blocks.clone(), last.clone());
    let s = Scheduler::with_options(SchedulerOptions::default());
    s.spawn(move || generation(n, b2, l2));
    s.run().unwrap();
    drop(s);
    let live = blocks
        .borrow()
        .iter()
        .filter(|w| w.strong_count() > 0)
        .count();
    let (depth, kept) = *last.borrow();
    (live, parent_trace_copies(), depth, kept)
}

/// A fiber that restarts itself (spawns its successor, then ends) keeps at most the capped
/// ancestry alive: the same number of control blocks and copied traces after 10 times more
/// generations; its depth still counts them all.
#[test]
fn memory_after_many_generations_does_not_grow_with_them() {
    let _g = copies_lock();
    let base = parent_trace_copies();
    let (live_a, copies_a, depth_a, kept_a) = generations(1_000);
    let (live_b, copies_b, depth_b, kept_b) = generations(10_000);
    // Ancestors: the earlier generations and the scheduler's thread.
    assert_eq!(depth_a, 1_000);
    assert_eq!(depth_b, 10_000);
    assert!(kept_a <= PARENT_DEPTH_KEPT && kept_b <= PARENT_DEPTH_KEPT);
    assert!(kept_a >= PARENT_DEPTH_SHOWN && kept_b >= PARENT_DEPTH_SHOWN);
    // Everything is released with the scheduler.
    assert_eq!(live_a, 0);
    assert_eq!(live_b, 0);
    assert_eq!(copies_a, base);
    assert_eq!(copies_b, base);
}

/// While the last generation lives, what it keeps is bounded by the cap, whatever the count
/// of generations before it.
#[test]
fn a_live_descendant_keeps_a_bounded_ancestry() {
    let _g = copies_lock();
    let base = parent_trace_copies();
    for n in [100usize, 5_000] {
        let blocks: Rc<RefCell<Vec<Weak<ControlBlock>>>> = Rc::default();
        let seen = Rc::new(RefCell::new((0usize, 0usize, 0u64)));
        fn generation(
            left: usize,
            blocks: Rc<RefCell<Vec<Weak<ControlBlock>>>>,
            seen: Rc<RefCell<(usize, usize, u64)>>,
        ) {
            let me = current().unwrap();
            blocks.borrow_mut().push(Arc::downgrade(me.control_block()));
            if left > 1 {
                spawn(move || generation(left - 1, blocks, seen));
                return;
            }
            // The last one: every earlier generation has ended.
            let live = blocks
                .borrow()
                .iter()
                .filter(|w| w.strong_count() > 0)
                .count();
            let fi = fiber_info(me.id(), &InfoOptions::default()).unwrap();
            *seen.borrow_mut() = (live, parent_trace_copies(), fi.parent_backtrace_omitted);
        }
        let (b2, s2) = (blocks.clone(), seen.clone());
        Scheduler::new()
            .block_on(move || spawn(move || generation(n, b2, s2)).join())
            .unwrap()
            .unwrap();
        let (live, copies, omitted) = *seen.borrow();
        // Itself, at most PARENT_DEPTH_KEPT ancestors' blocks, and a few finished blocks the
        // scheduler keeps for reuse.
        assert!(
            live <= PARENT_DEPTH_KEPT + 1 + 4,
            "{n} generations: {live} blocks alive"
        );
        assert!(
            copies - base < PARENT_DEPTH_SHOWN,
            "{n} generations: {copies} copies"
        );
        // Its ancestors: n - 1 generations, main, the thread; 8 shown.
        assert_eq!(omitted, n as u64 + 1 - PARENT_DEPTH_SHOWN as u64);
    }
    assert_eq!(parent_trace_copies(), base);
}

/// Off means off: a fiber spawned with parent traces off has none (and info shows none), and
/// one spawned after turning them back on has one.
#[test]
fn parent_traces_turned_off_are_not_captured() {
    let s = Scheduler::new();
    s.set_parent_traces(false);
    let seen = s
        .block_on(|| {
            let h = spawn(|| {
                let me = current().unwrap();
                let fi = fiber_info(me.id(), &InfoOptions::default()).unwrap();
                (
                    me.parent_trace().is_none(),
                    fi.parent_backtrace.len(),
                    me.parent(),
                )
            });
            h.join().unwrap()
        })
        .unwrap();
    assert!(seen.0, "no parent trace");
    assert_eq!(seen.1, 0);
    assert!(seen.2.is_some(), "the creator is still named");
    s.set_parent_traces(true);
    let on = s
        .block_on(|| spawn_naming_its_creator().join().unwrap())
        .unwrap();
    assert_eq!(on.as_deref(), Some("spawn_naming_its_creator"));
}

/// Spawns a fiber that returns the innermost function of its parent trace.
#[inline(never)]
fn spawn_naming_its_creator() -> JoinHandle<Option<String>> {
    let h = spawn(|| {
        let me = current().unwrap();
        let t = me.parent_trace()?;
        names(user_frames(t.frames())).into_iter().next()
    });
    black_box(h)
}
