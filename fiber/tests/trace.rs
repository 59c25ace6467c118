//! Exact traces of fibers: suspended, never run, running on another thread, inspected while
//! resumed, deep stacks, parent chains.

mod common;

use std::cell::RefCell;
use std::hint::black_box;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{file_line, info_names, names};
use fibertrace_core::{Frame, Unwinder};
use fibertrace_fiber::info::{fiber_info, InfoOptions};
use fibertrace_fiber::{channel, registry, spawn, yield_now, Channel, Scheduler, Status};

#[inline(never)]
fn c1(ch: &Channel<u32>, lines: &mut [u32; 3]) -> u32 {
    lines[2] = line!() + 1;
    let v = c2(ch, lines);
    black_box(v)
}

#[inline(never)]
fn c2(ch: &Channel<u32>, lines: &mut [u32; 3]) -> u32 {
    lines[1] = line!() + 1;
    let v = c3(ch, lines);
    black_box(v)
}

#[inline(never)]
fn c3(ch: &Channel<u32>, lines: &mut [u32; 3]) -> u32 {
    lines[0] = line!() + 1;
    let v = ch.recv().unwrap();
    black_box(v)
}

#[test]
fn suspended_fiber_blocked_three_calls_deep_in_a_channel_receive() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let rx = ch.clone();
            let lines = std::rc::Rc::new(std::cell::Cell::new([0u32; 3]));
            let l2 = lines.clone();
            let h = fibertrace_fiber::Builder::new()
                .name("consumer")
                .spawn(move || {
                    let mut l = [0; 3];
                    let v = c1(&rx, &mut l);
                    l2.set(l);
                    v
                });
            yield_now();
            assert_eq!(h.fiber().status(), Status::Waiting);
            for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
                // A walk not kept in the fiber (a caller keeping its own): the same frames,
                // before and after the kept one.
                let unkept = h.fiber().backtrace_unkept(u).unwrap();
                let bt = h.fiber().backtrace(u).unwrap();
                assert_eq!(unkept, bt, "{u:?}");
                assert_eq!(h.fiber().backtrace_unkept(u).unwrap(), bt, "{u:?}");
                let n = names(bt.frames());
                // Runtime frames first (the suspend wrapper itself is skipped), then ours.
                assert_eq!(
                    &n[..6],
                    ["block", "recv_until", "recv", "c3", "c2", "c1"],
                    "{u:?}: {n:?}"
                );
                let last = n.last().unwrap();
                assert!(
                    n.len() == 7 || n.len() == 8,
                    "closure (+ trampoline when not inlined): {n:?}"
                );
                assert!(
                    n[6].contains("closure") || last == "call_user",
                    "{u:?}: {n:?}"
                );
            }
            // Info: status, what it waits on, exact user frames without the trampoline.
            let fi = fiber_info(h.id(), &InfoOptions::default()).unwrap();
            assert_eq!(&*fi.name, "consumer");
            assert_eq!(fi.status, Status::Waiting);
            assert_eq!(fi.waiting.as_ref().unwrap().what, "channel receive");
            let bt = fi.backtrace.as_ref().unwrap();
            let n = info_names(bt);
            assert_eq!(&n[3..6], ["c3", "c2", "c1"]);
            assert_eq!(n.len(), 7, "{n:?}");
            assert!(n[6].contains("closure"), "{n:?}");
            ch.send(5).unwrap();
            assert_eq!(h.join().unwrap(), 5);
            assert!(lines.get().iter().all(|&l| l > 0));
        })
        .unwrap();
}

#[test]
fn suspended_frames_have_exact_lines() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let rx = ch.clone();
            let lines = std::rc::Rc::new(std::cell::Cell::new([0u32; 3]));
            let l2 = lines.clone();
            let h = spawn(move || {
                let mut l = [0; 3];
                // Lines are known before the call: c1..c3 fill them before blocking.
                c1_recording(&rx, &mut l, &l2)
            });
            yield_now();
            let bt = h.fiber().backtrace(Unwinder::Auto).unwrap();
            let want = lines.get();
            for (i, w) in want.iter().enumerate() {
                assert_eq!(
                    file_line(&bt.frames()[3 + i]),
                    Some(("trace.rs".to_string(), *w)),
                    "frame {}",
                    3 + i
                );
            }
            ch.send(1).unwrap();
            h.join().unwrap();
        })
        .unwrap();
}

#[inline(never)]
fn c1_recording(ch: &Channel<u32>, lines: &mut [u32; 3], out: &std::cell::Cell<[u32; 3]>) -> u32 {
    lines[2] = line!() + 2;
    out.set(*lines);
    let v = c2_recording(ch, lines, out);
    black_box(v)
}

#[inline(never)]
fn c2_recording(ch: &Channel<u32>, lines: &mut [u32; 3], out: &std::cell::Cell<[u32; 3]>) -> u32 {
    lines[1] = line!() + 2;
    out.set(*lines);
    let v = c3_recording(ch, lines, out);
    black_box(v)
}

#[inline(never)]
fn c3_recording(ch: &Channel<u32>, lines: &mut [u32; 3], out: &std::cell::Cell<[u32; 3]>) -> u32 {
    lines[0] = line!() + 2;
    out.set(*lines);
    let v = ch.recv().unwrap();
    black_box(v)
}

#[test]
fn a_fiber_that_never_ran_shows_its_entry_and_a_dead_one_nothing() {
    let s = Scheduler::new();
    let h = s.builder().name("lazy").spawn(|| 1u8);
    let bt = h.fiber().backtrace(Unwinder::Auto).unwrap();
    assert_eq!(bt.len(), 1);
    assert!(matches!(bt.frames()[0], Frame::Pc(_)));
    assert_eq!(h.fiber().backtrace_unkept(Unwinder::Fast).unwrap(), bt);
    let r = fibertrace_core::resolve(&bt.frames()[0]).unwrap();
    let name = r.function().unwrap();
    assert_eq!(name, "fibertrace_fiber::frames::call_user");
    assert_eq!(name, fibertrace_fiber::TRAMPOLINE);
    // A closure has no symbol: info names it by type.
    let fi = fiber_info(h.id(), &InfoOptions::default()).unwrap();
    assert_eq!(fi.status, Status::Ready);
    assert_eq!(fi.csw, 0);
    assert_eq!(
        fi.entry,
        "trace::a_fiber_that_never_ran_shows_its_entry_and_a_dead_one_nothing::{{closure}}"
    );
    let f = h.fiber().clone();
    s.run().unwrap();
    assert!(h.is_finished());
    assert_eq!(f.backtrace(Unwinder::Auto), None);
    assert_eq!(f.backtrace_unkept(Unwinder::Auto), None);
}

#[inline(never)]
fn spin_here(stop: &AtomicBool, spins: &AtomicU64) {
    while !stop.load(Ordering::Relaxed) {
        spins.fetch_add(1, Ordering::Relaxed);
        std::hint::spin_loop();
    }
}

#[inline(never)]
fn spin_outer(stop: &AtomicBool, spins: &AtomicU64) {
    spin_here(stop, spins);
    black_box(());
}

#[test]
fn a_fiber_running_on_another_thread_is_sampled() {
    let stop = Arc::new(AtomicBool::new(false));
    let spins = Arc::new(AtomicU64::new(0));
    let fid = Arc::new(AtomicU64::new(0));
    let (s2, sp2, f2) = (stop.clone(), spins.clone(), fid.clone());
    let t = std::thread::spawn(move || {
        Scheduler::new()
            .block_on(move || {
                let h = spawn(move || spin_outer(&s2, &sp2));
                f2.store(h.id(), Ordering::Release);
                h.join().unwrap();
            })
            .unwrap();
    });
    while spins.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let id = fid.load(Ordering::Acquire);
    let (_, f) = registry::find(id).unwrap();
    let fiber = fibertrace_fiber::info::fiber_info(id, &InfoOptions::default()).unwrap();
    assert_eq!(fiber.status, Status::Running);
    let n = common::outer_names(fiber.backtrace.as_ref().unwrap());
    // The interrupted PC is in spin_here (an atomic load may be inlined into it), then
    // spin_outer, then the closure.
    let i = n
        .iter()
        .position(|x| x == "spin_here")
        .unwrap_or_else(|| panic!("spin_here not sampled: {n:?}"));
    assert_eq!(n[i + 1], "spin_outer", "{n:?}");
    let inner = info_names(fiber.backtrace.as_ref().unwrap());
    assert!(inner[i + 2].contains("closure"), "{inner:?}");
    assert_eq!(n.len(), i + 3, "{n:?}");
    drop(f);
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
}

#[inline(never)]
fn d3() {
    yield_now();
    black_box(());
}
#[inline(never)]
fn d2() {
    d3();
    black_box(());
}
#[inline(never)]
fn d1() {
    d2();
    black_box(());
}

#[inline(never)]
fn pass_2(line: &std::cell::Cell<u32>) {
    line.set(line!() + 1);
    yield_now();
    black_box(());
}
#[inline(never)]
fn pass_1(line: &std::cell::Cell<u32>) {
    pass_2(line);
    black_box(());
}

/// Two fibers passing the turn to each other: the first to yield runs the other inside its
/// own switch, and the other's yield goes straight back to it. Each, seen by the other while
/// it waits, shows the frames of any yield: its `yield_now` call first, at its line, then
/// its callers, under every unwinder.
#[test]
fn fibers_passing_the_turn_see_each_others_exact_frames() {
    Scheduler::new()
        .block_on(|| {
            type Slot = Rc<RefCell<Option<fibertrace_fiber::Fiber>>>;
            let (fa, fb): (Slot, Slot) = Default::default();
            let lines: [Rc<std::cell::Cell<u32>>; 2] = Default::default();
            let seen = Rc::new(std::cell::Cell::new(0u32));
            let side = |me: Slot, other: Slot, mine: usize| {
                let lines = lines.clone();
                let seen = seen.clone();
                spawn(move || {
                    *me.borrow_mut() = fibertrace_fiber::current();
                    for _ in 0..3 {
                        pass_1(&lines[mine]);
                        // (The other waits in its yield, ready; or has not begun or ended.)
                        let Some(o) = other.borrow().clone() else {
                            continue;
                        };
                        if o.status() != Status::Ready {
                            continue;
                        }
                        for u in [Unwinder::Fast, Unwinder::Precise, Unwinder::Auto] {
                            let bt = o.backtrace(u).unwrap();
                            let n = names(bt.frames());
                            assert_eq!(n[..3], ["yield_now", "pass_2", "pass_1"], "{u:?}: {n:?}");
                            assert_eq!(
                                file_line(&bt.frames()[1]),
                                Some(("trace.rs".to_string(), lines[1 - mine].get())),
                                "{u:?}"
                            );
                        }
                        seen.set(seen.get() + 1);
                    }
                })
            };
            let a = side(fa.clone(), fb.clone(), 0);
            let b = side(fb, fa, 1);
            a.join().unwrap();
            b.join().unwrap();
            seen.get()
        })
        // a runs first and b inside a's first yield: a looks at b (waiting inside a's switch)
        // after each of its 3 yields; b at a (running others inside its own switch) after
        // its first 2 (a has ended at b's third).
        .map(|seen| assert_eq!(seen, 5))
        .unwrap();
}

#[test]
fn inspected_while_another_thread_resumes_it_repeatedly() {
    // Walks to make, and resumes of the walked fiber to see among them: both, however the
    // two threads share the CPUs (under load one can get most of the walker's time slices).
    const WANT: u64 = 2000;
    const RESUMES: u64 = 100;
    let walks = Arc::new(AtomicU64::new(0));
    let resumed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let fid = Arc::new(AtomicU64::new(0));
    let (r2, stop, f2) = (resumed.clone(), done.clone(), fid.clone());
    let t = std::thread::spawn(move || {
        Scheduler::new()
            .block_on(move || {
                // Two fibers switching as fast as they can while the other thread walks one.
                let stop_h = stop.clone();
                let h = spawn(move || {
                    while !stop_h.load(Ordering::Relaxed) {
                        d1();
                        r2.fetch_add(1, Ordering::Relaxed);
                    }
                });
                let stop_o = stop.clone();
                let other = spawn(move || {
                    while !stop_o.load(Ordering::Relaxed) {
                        yield_now();
                    }
                });
                f2.store(h.id(), Ordering::Release);
                h.join().unwrap();
                other.join().unwrap();
            })
            .unwrap()
    });
    while fid.load(Ordering::Acquire) == 0 {
        std::thread::yield_now();
    }
    let (_, f) = registry::find(fid.load(Ordering::Acquire)).unwrap();
    let fiber = fibertrace_fiber::Fiber::from_shared(f);
    let mut torn = Vec::new();
    let mut attempts = 0u64;
    while walks.load(Ordering::Relaxed) < WANT || resumed.load(Ordering::Relaxed) < RESUMES {
        attempts += 1;
        // Suspended walks only (a running fiber is not sampled here).
        if let Some(bt) = fibertrace_fiber::info::suspended_backtrace(&fiber, Unwinder::Fast) {
            walks.fetch_add(1, Ordering::Relaxed);
            let n = names(fibertrace_fiber::info::user_frames(bt.frames()));
            if n.len() != 5 || n[..4] != ["yield_now", "d3", "d2", "d1"] {
                torn.push(n);
            }
        }
        assert!(
            attempts < 50_000_000,
            "the fiber is never seen suspended, or never resumed: {} walks, {} resumes",
            walks.load(Ordering::Relaxed),
            resumed.load(Ordering::Relaxed)
        );
    }
    done.store(true, Ordering::Relaxed);
    t.join().unwrap();
    assert!(
        torn.is_empty(),
        "{} torn traces, first {:?}",
        torn.len(),
        torn.first()
    );
    // The handshake that kept them whole.
    assert_eq!(fibertrace_fiber::switches_unlocked(), unlocked_expected());
}

/// The handshake this process should use: the asymmetric one when asked for
/// (`FIBERTRACE_MEMBARRIER=1`) where the kernel offers the process-wide barrier (Linux 4.14
/// on, unless filtered), else the compare-and-swap.
fn unlocked_expected() -> bool {
    let on = std::env::var_os("FIBERTRACE_MEMBARRIER").is_some_and(|v| !v.is_empty() && v != "0");
    #[cfg(target_os = "linux")]
    // SAFETY: membarrier's query command only returns the commands the kernel offers.
    let offered = unsafe { libc::syscall(libc::SYS_membarrier, 0, 0, 0) } & (1 << 3) != 0;
    #[cfg(not(target_os = "linux"))]
    let offered = false;
    offered && on
}

/// What a listing from another thread costs the process under the asymmetric handshake: a
/// process-wide barrier (which interrupts every CPU that runs a thread of the process) for
/// each fiber that moved since its last walk, none for a fiber whose walk is kept.
#[test]
fn a_listing_from_another_thread_makes_a_barrier_per_walk_and_none_for_a_kept_one() {
    const FIBERS: usize = 64;
    let (fid, sched_id) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let go = Arc::new(AtomicU64::new(0));
    let (f2, s2, g2) = (fid.clone(), sched_id.clone(), go.clone());
    let t = std::thread::spawn(move || {
        let s = Scheduler::new();
        s2.store(s.id(), Ordering::Release);
        s.block_on(move || {
            let ch: Channel<u32> = channel(FIBERS);
            let hs: Vec<_> = (0..FIBERS)
                .map(|_| {
                    let c = ch.clone();
                    spawn(move || while c.recv().is_some() {})
                })
                .collect();
            // Every fiber parks in its receive; after each listing it runs once more and
            // parks again (so that no walk of the listing before holds).
            yield_now();
            for round in 1..=2u64 {
                f2.store(round, Ordering::Release);
                while g2.load(Ordering::Acquire) < round {
                    std::thread::sleep(Duration::from_millis(1));
                }
                for _ in 0..FIBERS {
                    ch.send(0).unwrap();
                }
                yield_now();
            }
            f2.store(3, Ordering::Release);
            ch.close();
            for h in hs {
                h.join().unwrap();
            }
        })
        .unwrap();
    });
    let opts = InfoOptions {
        sample_running: false,
        ..InfoOptions::default()
    };
    let walked = |want: u64| {
        while fid.load(Ordering::Acquire) != want {
            std::thread::sleep(Duration::from_millis(1));
        }
        let s = registry::scheduler(sched_id.load(Ordering::Acquire)).unwrap();
        let before = fibertrace_fiber::barriers_made_here();
        let all = fibertrace_fiber::info::scheduler_info(&s, &opts);
        let made = fibertrace_fiber::barriers_made_here() - before;
        let traced = all
            .iter()
            .filter(|f| {
                f.backtrace
                    .as_ref()
                    .is_some_and(|b| info_names(b).iter().any(|n| n == "recv"))
            })
            .count();
        (traced, made, s)
    };
    let (traced, made, s) = walked(1);
    assert_eq!(traced, FIBERS);
    assert_eq!(fibertrace_fiber::switches_unlocked(), unlocked_expected());
    if fibertrace_fiber::switches_unlocked() {
        assert_eq!(made, FIBERS as u64);
        // Nothing moved: every walk is kept, no barrier.
        let again = fibertrace_fiber::barriers_made_here();
        let all = fibertrace_fiber::info::scheduler_info(&s, &opts);
        assert_eq!(all.len(), FIBERS + 1);
        assert_eq!(fibertrace_fiber::barriers_made_here(), again);
    } else {
        assert_eq!(made, 0);
    }
    go.store(1, Ordering::Release);
    let (traced, made, _) = walked(2);
    assert_eq!(traced, FIBERS);
    let per_walk = u64::from(fibertrace_fiber::switches_unlocked());
    assert_eq!(made, per_walk * FIBERS as u64);
    go.store(2, Ordering::Release);
    t.join().unwrap();
}

/// The listing test above again, in a process of its own under the asymmetric handshake
/// (`FIBERTRACE_MEMBARRIER=1`; the handshake is chosen once per process): a barrier per walk
/// of a moved fiber, none for a kept walk, every trace whole.
#[test]
fn a_listing_from_another_thread_under_the_asymmetric_handshake_too() {
    if std::env::var_os("FIBERTRACE_MEMBARRIER").is_some() {
        return; // (this is the child: the test above is the one it runs)
    }
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_listing_from_another_thread_makes_a_barrier_per_walk_and_none_for_a_kept_one",
            "--test-threads=1",
        ])
        .env("FIBERTRACE_MEMBARRIER", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("test result: ok. 1 passed"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Fibers come and go on one thread while another lists them all, over and over: every
/// suspended fiber's trace read is whole. The fibers stay (parked, sleeping) until the reader
/// has checked some of their traces, or 20 s: the run is a few milliseconds, and the reader's
/// first listing that meets frames loads the test binary's symbols (~170 ms on an AMD
/// machine), during which the whole run went by unseen (30 of 30 runs in release there). The
/// symbols are loaded first for the same reason.
#[test]
fn thousand_fibers_come_and_go_while_info_is_read_from_another_thread() {
    Scheduler::new()
        .block_on(|| drop(fibertrace_fiber::info::info(&InfoOptions::default())))
        .unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let d2_ = done.clone();
    // Suspended traces the reader has checked so far.
    let checked_so_far = Arc::new(AtomicU64::new(0));
    let c2 = checked_so_far.clone();
    let t = std::thread::spawn(move || {
        let until = std::time::Instant::now() + Duration::from_secs(20);
        Scheduler::new()
            .block_on(move || {
                let mut hs = Vec::new();
                for i in 0..1000u32 {
                    let c3 = c2.clone();
                    hs.push(spawn(move || {
                        for _ in 0..(i % 7) {
                            yield_now();
                        }
                        fibertrace_fiber::sleep(Duration::from_micros(u64::from(i % 5) * 100));
                        while c3.load(Ordering::Relaxed) < 100 && std::time::Instant::now() < until
                        {
                            fibertrace_fiber::sleep(Duration::from_millis(1));
                        }
                        i
                    }));
                    if i % 10 == 0 {
                        yield_now();
                    }
                }
                let mut sum = 0;
                for h in hs {
                    sum += h.join().unwrap();
                }
                d2_.store(true, Ordering::Release);
                sum
            })
            .unwrap()
    });
    let (mut reads, mut seen, mut checked) = (0, 0usize, 0u64);
    while !done.load(Ordering::Acquire) {
        let all = fibertrace_fiber::info::info(&InfoOptions {
            sample_running: false,
            ..InfoOptions::default()
        });
        reads += 1;
        seen = seen.max(all.len());
        for fi in &all {
            // Every trace read is whole: a suspended fiber's ends in its closure.
            if let (Status::Waiting | Status::Sleeping | Status::Ready, Some(bt), true) =
                (fi.status, &fi.backtrace, fi.csw > 0)
            {
                let n = info_names(bt);
                assert!(
                    n.iter().any(|x| x.contains("closure")) || n.iter().any(|x| x == "call_user"),
                    "{n:?}"
                );
                checked += 1;
            }
        }
        checked_so_far.store(checked, Ordering::Relaxed);
    }
    assert_eq!(t.join().unwrap(), 499_500);
    assert!(
        reads > 0 && seen > 1 && checked >= 100,
        "reads {reads}, most fibers seen {seen}, suspended traces checked {checked}"
    );
}

#[inline(never)]
fn recurse_then_park(n: u32) {
    if n == 0 {
        fibertrace_fiber::suspend();
        return;
    }
    recurse_then_park(n - 1);
    black_box(());
}

#[test]
fn a_nearly_full_stack_and_a_deep_child_keep_their_traces() {
    Scheduler::new()
        .block_on(|| {
            // 64 KiB stack; each level of recursion takes at least 16 bytes... and with
            // debug builds much more: recurse until near the limit.
            let h = fibertrace_fiber::Builder::new()
                .name("deep")
                .stack_size(64 * 1024)
                .spawn(|| recurse_then_park(400));
            yield_now();
            let fi = fiber_info(h.id(), &InfoOptions::default()).unwrap();
            assert!(fi.stack_used_max > 400 * 16, "{}", fi.stack_used_max);
            assert!(fi.stack_used_max <= fi.stack_size);
            let bt = fi.backtrace.unwrap();
            let n = info_names(&bt);
            // Innermost frames, an Omitted marker counting the rest, the outermost ones.
            assert_eq!(n[0], "suspend");
            assert!(n[1..10].iter().all(|x| x == "recurse_then_park"), "{n:?}");
            let om = bt
                .iter()
                .find_map(|f| match f.frame {
                    Frame::Omitted(k) => Some(k),
                    _ => None,
                })
                .expect("omitted marker");
            assert!(om > 300, "{om}");
            assert!(n.last().unwrap().contains("closure"), "{n:?}");
            // The parent trace is intact (kept apart from the child's own stack): the main
            // fiber, then the thread that ran the scheduler.
            assert_eq!(fi.parent_backtrace.len(), 2);
            assert_eq!(&*fi.parent_backtrace[0].name, "main");
            assert_eq!(fi.parent_backtrace[1].fiber, None);
            let p = common::full_names(&fi.parent_backtrace[0].frames);
            assert!(
                p[0].contains("a_nearly_full_stack_and_a_deep_child_keep_their_traces"),
                "{p:?}"
            );
            h.fiber().wakeup();
            h.join().unwrap();
        })
        .unwrap();
}

#[inline(never)]
fn spawn_from_a() -> fibertrace_fiber::JoinHandle<u64> {
    let h = fibertrace_fiber::Builder::new().name("b").spawn(|| {
        let h = spawn_from_b();
        h.join().unwrap()
    });
    black_box(h)
}

#[inline(never)]
fn spawn_from_b() -> fibertrace_fiber::JoinHandle<u64> {
    let h = fibertrace_fiber::Builder::new().name("c").spawn(|| {
        let h = spawn_from_c();
        h.join().unwrap()
    });
    black_box(h)
}

#[inline(never)]
fn spawn_from_c() -> fibertrace_fiber::JoinHandle<u64> {
    let h = fibertrace_fiber::Builder::new().name("d").spawn(|| {
        let me = fibertrace_fiber::current().unwrap();
        let pt = me.parent_trace().unwrap();
        let chain: Vec<(Option<u64>, String, String)> = pt
            .chain()
            .map(|t| {
                let n = names(fibertrace_fiber::info::user_frames(t.frames()));
                (t.fiber, t.name().to_string(), n[0].clone())
            })
            .collect();
        // c, b, a, main, and the thread that ran the scheduler.
        assert_eq!(chain.len(), 5, "{chain:?}");
        assert_eq!(
            chain[..4].iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
            ["c", "b", "a", "main"]
        );
        assert_eq!(chain[4].0, None);
        assert_eq!(chain[4].2, "parent_chain_of_depth_four");
        assert_eq!(chain[0].2, "spawn_from_c");
        assert_eq!(chain[1].2, "spawn_from_b");
        assert_eq!(chain[2].2, "spawn_from_a");
        assert!(chain[3].2.contains("closure"), "{chain:?}");
        // Flattened: a boundary marker naming each ancestor, direct parent first.
        let flat = pt.flatten();
        let markers: Vec<u64> = flat
            .iter()
            .filter_map(|f| match f {
                Frame::Parent(p) => Some(*p),
                _ => None,
            })
            .collect();
        let ids: Vec<u64> = chain.iter().map(|c| c.0.unwrap_or(0)).collect();
        assert_eq!(markers, ids);
        me.parent().unwrap()
    });
    black_box(h)
}

#[test]
fn parent_chain_of_depth_four() {
    Scheduler::new()
        .block_on(|| {
            let a = fibertrace_fiber::Builder::new().name("a").spawn(|| {
                let h = spawn_from_a();
                h.join().unwrap()
            });
            let parent_of_d = a.join().unwrap();
            assert!(parent_of_d > 0);
        })
        .unwrap();
}

#[test]
fn parent_traces_can_be_turned_off() {
    let s = Scheduler::new();
    s.set_parent_traces(false);
    let off = s.block_on(|| {
        let h = spawn(|| {
            let none = fibertrace_fiber::current()
                .unwrap()
                .parent_trace()
                .is_none();
            yield_now();
            none
        });
        // Seen from outside too: no parent section in its info.
        yield_now();
        let info = fiber_info(h.id(), &InfoOptions::default()).unwrap();
        assert!(
            info.parent_backtrace.is_empty(),
            "{:?}",
            info.parent_backtrace
        );
        h.join().unwrap()
    });
    assert!(off.unwrap(), "parent traces off, yet the fiber has one");
    let s = Scheduler::new();
    let on = s.block_on(|| {
        spawn(|| {
            fibertrace_fiber::current()
                .unwrap()
                .parent_trace()
                .is_some()
        })
        .join()
        .unwrap()
    });
    assert!(on.unwrap());
}

#[inline(never)]
fn park_here(ch: &Channel<u32>) -> Option<u32> {
    black_box(1u32); // bodies differ: release builds would merge identical functions
    let v = ch.recv();
    black_box(v)
}

#[inline(never)]
fn park_there(ch: &Channel<u32>) -> Option<u32> {
    black_box(2u32);
    let v = ch.recv();
    black_box(v).map(|x| x + black_box(0))
}

/// Info hands out one shared list while a fiber stays parked, keeps handing it out when the
/// fiber runs and parks at the very same place again, and a new one when it parks elsewhere.
#[test]
fn info_lists_are_shared_while_parked_and_follow_the_fiber() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let rx = ch.clone();
            let h = spawn(move || {
                // One call site (a loop with a data-dependent end is not unrolled).
                while park_here(&rx) != Some(2) {}
                park_there(&rx);
            });
            yield_now();
            let get = |id| {
                let fi = fiber_info(id, &InfoOptions::default()).unwrap();
                (fi.csw, fi.backtrace.unwrap())
            };
            let (csw_a, a) = get(h.id());
            let (_, b) = get(h.id());
            assert!(Arc::ptr_eq(&a, &b), "one list while parked");
            let n = info_names(&a);
            assert_eq!(
                &n[..4],
                ["block", "recv_until", "recv", "park_here"],
                "{n:?}"
            );

            ch.send(1).unwrap();
            yield_now(); // it takes the value and parks at the same call again
            let (csw_c, c) = get(h.id());
            assert!(csw_c > csw_a);
            assert_eq!(info_names(&c), n);
            assert!(
                Arc::ptr_eq(&a, &c),
                "same frames after a new walk: same list"
            );

            ch.send(2).unwrap();
            yield_now(); // now it parks in park_there
            let (_, d) = get(h.id());
            let m = info_names(&d);
            assert_eq!(
                &m[..4],
                ["block", "recv_until", "recv", "park_there"],
                "{m:?}"
            );
            assert!(!Arc::ptr_eq(&a, &d));
            // Raw (unresolved) lists are kept apart from resolved ones.
            let raw = InfoOptions {
                resolve: false,
                ..InfoOptions::default()
            };
            let r = fiber_info(h.id(), &raw).unwrap().backtrace.unwrap();
            assert!(r.iter().all(|f| f.resolved.is_none()));
            assert_eq!(
                r.iter().map(|f| f.frame).collect::<Vec<_>>(),
                d.iter().map(|f| f.frame).collect::<Vec<_>>()
            );
            ch.send(3).unwrap();
            h.join().unwrap();
        })
        .unwrap();
}

/// Starts a child that starts its own child, `depth` levels down, each with `yield_to`; the
/// innermost checks its own trace and its ancestors' while they wait for it, then sleeps.
#[inline(never)]
fn start_nested(
    depth: u32,
    ancestors: Vec<fibertrace_fiber::Fiber>,
    log: Rc<RefCell<Vec<String>>>,
) {
    let me = fibertrace_fiber::current().unwrap();
    if depth == 0 {
        nested_leaf(&me, &ancestors, &log);
        return;
    }
    let mut chain = ancestors;
    chain.push(me.clone());
    let l = log.clone();
    let h = fibertrace_fiber::Builder::new()
        .name(&format!("n{}", depth - 1))
        .spawn(move || start_nested(depth - 1, chain, l));
    log.borrow_mut().push(format!("start {depth}"));
    fibertrace_fiber::yield_to(h.fiber());
    log.borrow_mut().push(format!("back {depth}"));
    h.join().unwrap();
    black_box(());
}

#[inline(never)]
fn nested_leaf(
    me: &fibertrace_fiber::Fiber,
    ancestors: &[fibertrace_fiber::Fiber],
    log: &Rc<RefCell<Vec<String>>>,
) {
    // Its own stack, however deep the nesting of stacks it runs inside.
    for u in [Unwinder::Fast, Unwinder::Precise] {
        let n = names(me.backtrace(u).unwrap().frames());
        let at = n.iter().position(|f| f == "nested_leaf");
        assert_eq!(
            at.map(|i| &n[i..i + 2]),
            Some(&["nested_leaf".to_string(), "start_nested".to_string()][..]),
            "{u:?}: {n:?}"
        );
    }
    // Every ancestor waits in `yield_to`, called from `start_nested`, and counts as ready.
    for a in ancestors {
        assert_eq!(a.status(), Status::Ready, "{}", a.name());
        for u in [Unwinder::Fast, Unwinder::Precise] {
            let n = names(a.backtrace(u).unwrap().frames());
            assert_eq!(
                &n[..2],
                ["yield_to", "start_nested"],
                "{}: {u:?}: {n:?}",
                a.name()
            );
        }
        // Waking a fiber that waits for the one it started changes nothing.
        a.wakeup();
    }
    log.borrow_mut().push("leaf".to_string());
    fibertrace_fiber::sleep(Duration::from_millis(1));
    log.borrow_mut().push("leaf woke".to_string());
}

#[test]
fn yield_to_runs_the_fiber_inside_the_caller_twelve_levels_deep() {
    let log = Rc::new(RefCell::new(Vec::new()));
    let l = log.clone();
    let sched = Scheduler::new();
    sched
        .block_on(move || {
            let me = fibertrace_fiber::current().unwrap();
            let csw = me.control_block().csw();
            start_nested(12, Vec::new(), l);
            // Two switches back in: after the started fiber suspended, after the join's wait.
            assert_eq!(me.control_block().csw() - csw, 2);
        })
        .unwrap();
    let log = log.borrow();
    // Each level starts the next, which runs at once; when the leaf sleeps, each waiting
    // level goes on (innermost first) before the scheduler runs anything else.
    let mut want: Vec<String> = (1..=12).rev().map(|d| format!("start {d}")).collect();
    want.push("leaf".into());
    want.extend((1..=12).map(|d| format!("back {d}")));
    want.push("leaf woke".into());
    assert_eq!(*log, want);
}

#[inline(never)]
fn park_briefly() {
    fibertrace_fiber::sleep(Duration::from_millis(1));
    black_box(());
}

#[inline(never)]
fn start_reader(seen: Rc<RefCell<Vec<Vec<String>>>>, main: u64) {
    let h = spawn(move || {
        let fi = fiber_info(main, &InfoOptions::default()).unwrap();
        seen.borrow_mut()
            .push(info_names(fi.backtrace.as_ref().unwrap()));
    });
    fibertrace_fiber::yield_to(h.fiber());
    black_box(());
}

#[test]
fn info_read_at_one_suspension_is_not_reused_at_the_next() {
    let seen = Rc::new(RefCell::new(Vec::new()));
    let s2 = seen.clone();
    Scheduler::new()
        .block_on(move || {
            let main = fibertrace_fiber::current_id();
            let s3 = s2.clone();
            spawn(move || {
                yield_now();
                // The main fiber sleeps in park_briefly: read (and cached) here.
                let fi = fiber_info(main, &InfoOptions::default()).unwrap();
                s3.borrow_mut()
                    .push(info_names(fi.backtrace.as_ref().unwrap()));
            });
            yield_now();
            park_briefly();
            // Now it waits in yield_to, called from start_reader: a new trace.
            start_reader(s2, main);
        })
        .unwrap();
    let seen = seen.borrow();
    assert_eq!(seen.len(), 2);
    let at = |n: &[String], f: &str| n.iter().position(|x| x == f);
    assert!(at(&seen[0], "park_briefly").is_some(), "{:?}", seen[0]);
    assert_eq!(seen[1][..2], ["yield_to", "start_reader"], "{:?}", seen[1]);
}
