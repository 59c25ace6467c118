//! Heap per fiber: with the every-allocation tracker as the global allocator, an allocation
//! is charged to the fiber that made it (with its stack), credited back to that fiber when
//! another frees it, shown in `info` and the dumps, and listed as held by an exited fiber
//! once its maker has ended.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use fibertrace_core::heap::{self, Tracked};
use fibertrace_fiber::{dump, yield_now, Builder, InfoOptions, Scheduler};

#[global_allocator]
static HEAP: Tracked<std::alloc::System> = Tracked::every(std::alloc::System);

#[inline(never)]
fn leaf(n: usize) -> Vec<u8> {
    std::hint::black_box(vec![7u8; n])
}

#[inline(never)]
fn middle(n: usize) -> Vec<u8> {
    std::hint::black_box(leaf(n))
}

#[inline(never)]
fn outer(n: usize) -> Vec<u8> {
    std::hint::black_box(middle(n))
}

fn heap_of(s: &Scheduler, id: u64) -> heap::Usage {
    s.info(&InfoOptions::default())
        .into_iter()
        .find(|f| f.id == id)
        .and_then(|f| f.heap)
        .expect("the fiber's heap is shown")
}

fn function(f: &fibertrace_core::Frame) -> String {
    fibertrace_core::resolve(f)
        .and_then(|r| r.function().map(str::to_string))
        .unwrap_or_default()
}

#[test]
fn an_allocation_is_charged_to_its_fiber_with_its_stack_and_credited_back_on_a_free_elsewhere() {
    let sched = Rc::new(Scheduler::new());
    let sc = sched.clone();
    sched
        .block_on(move || {
            let sched = sc;
            let store: Rc<RefCell<Vec<Vec<u8>>>> = Rc::new(RefCell::new(Vec::with_capacity(4)));
            let s2 = store.clone();
            let builder = Builder::new().name("builder").spawn(move || {
                s2.borrow_mut().push(outer(50_000));
                fibertrace_fiber::sleep(Duration::from_secs(3600));
            });
            let s3 = store.clone();
            let go = fibertrace_fiber::channel::<()>(1);
            let rx = go.clone();
            let dropper = Builder::new().name("dropper").spawn(move || {
                // Waits until told (gives up if the test fails first).
                if rx.recv_timeout(Duration::from_secs(30)).is_err() {
                    return;
                }
                let v = s3.borrow_mut().remove(0);
                drop(v);
                fibertrace_fiber::sleep(Duration::from_secs(3600));
            });
            let (bid, did) = (builder.id(), dropper.id());
            yield_now();
            yield_now();
            // The allocation is listed with its three frames, its size and its fiber.
            let mine: Vec<heap::LiveAlloc> = heap::live()
                .into_iter()
                .filter(|a| a.size == 50_000)
                .collect();
            assert_eq!(mine.len(), 1);
            assert_eq!((mine[0].fiber, mine[0].exited), (Some(bid), false));
            let g = heap::group(&mine);
            let names: Vec<String> = g[0].frames[..4].iter().map(function).collect();
            assert_eq!(names[..3], ["heap::leaf", "heap::middle", "heap::outer"]);
            // Its caller is the test's closure (inlined into the runtime's call in release
            // builds: one of the frame's levels).
            let levels: Vec<String> = fibertrace_core::resolve(&g[0].frames[3])
                .map(|r| r.symbols.iter().filter_map(|s| s.name.clone()).collect())
                .unwrap_or_default();
            assert!(
                levels
                    .iter()
                    .any(|n| n.starts_with("heap::an_allocation_is_charged")),
                "{levels:?}"
            );
            // And nothing after it: the runtime's start-up frames (the trampoline, the fiber
            // body, corosensei's stack start) are left out, as the fiber's trace ends there.
            let all: Vec<String> = g[0].frames.iter().map(function).collect();
            assert_eq!(g[0].frames.len(), 4, "{all:?}");
            assert_eq!((g[0].bytes, g[0].objects), (50_000, 1));
            assert_eq!(g[0].fibers.len(), 1);
            assert_eq!(g[0].fibers[0].fiber, Some(bid));

            let text = dump::dump_text();
            let block = text
                .split("\n\n")
                .find(|b| b.contains("\"builder\""))
                .unwrap_or_else(|| panic!("{text}"));
            let line = block.lines().nth(1).unwrap();
            assert!(line.starts_with("heap: "), "{block}");
            let before_b = heap_of(&sched, bid);
            let before_d = heap_of(&sched, did);
            assert!(before_b.live_bytes >= 50_000, "{before_b:?}");

            // The dropper frees it: the builder is credited, the dropper's figure does not
            // move.
            go.send(()).unwrap();
            yield_now();
            yield_now();
            assert_eq!(store.borrow().len(), 0);
            let after_b = heap_of(&sched, bid);
            let after_d = heap_of(&sched, did);
            assert_eq!(before_b.live_bytes - after_b.live_bytes, 50_000);
            assert_eq!(before_b.live_objects - after_b.live_objects, 1);
            assert_eq!(after_d.live_bytes, before_d.live_bytes);
            assert!(heap::live().iter().all(|a| a.size != 50_000));
            builder.fiber().cancel();
            dropper.fiber().cancel();
        })
        .unwrap();
}

#[test]
fn a_fiber_that_ends_leaves_what_it_still_holds_listed_as_held_by_it() {
    let sched = Scheduler::new();
    let mid = sched
        .block_on(|| {
            let keep: Rc<RefCell<Option<Vec<u8>>>> = Rc::new(RefCell::new(None));
            let k2 = keep.clone();
            let maker = Builder::new().name("maker").spawn(move || {
                *k2.borrow_mut() = Some(outer(70_000));
            });
            let mid = maker.id();
            maker.join().unwrap();
            let row = heap::owners()
                .into_iter()
                .find(|r| r.fiber == Some(mid))
                .expect("the ended fiber's slot is kept");
            assert!(row.exited);
            assert!(row.usage.live_bytes >= 70_000);
            let text = dump::dump_text();
            let line = format!("held by exited fiber {mid}: heap: ");
            assert!(text.lines().any(|l| l.starts_with(&line)), "{text}");
            let a = heap::live()
                .into_iter()
                .find(|a| a.size == 70_000)
                .expect("listed");
            assert_eq!((a.fiber, a.exited), (Some(mid), true));
            let snap = fibertrace_fiber::inspect::snapshot(&InfoOptions::default());
            let h = snap.heap.as_ref().expect("the snapshot carries the heap");
            assert!(h
                .exited
                .iter()
                .any(|(f, u)| *f == mid && u.live_bytes >= 70_000));
            let json = serde_json::to_string(&snap).unwrap();
            assert!(json.contains("\"exited\""), "{json}");
            // Freed: nothing left held by it.
            *keep.borrow_mut() = None;
            mid
        })
        .unwrap();
    let after = heap::owners();
    assert!(
        after
            .iter()
            .all(|r| r.fiber != Some(mid) || r.usage.live_bytes < 70_000),
        "{after:?}"
    );
}
