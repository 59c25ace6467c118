//! The runtime's behaviour: spawn, join, yield, sleep, wakeup, cancel, channels, conditions,
//! panics, several schedulers.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use fibertrace_fiber::{
    channel, sleep, spawn, yield_now, Cond, JoinError, RunError, Scheduler, Status,
};

#[test]
fn spawn_join_and_yield_order() {
    let log = Rc::new(RefCell::new(Vec::new()));
    let l2 = log.clone();
    let out = Scheduler::new()
        .block_on(move || {
            let la = l2.clone();
            let a = spawn(move || {
                for i in 0..3 {
                    la.borrow_mut().push(format!("a{i}"));
                    yield_now();
                }
                10
            });
            let lb = l2.clone();
            let b = spawn(move || {
                for i in 0..3 {
                    lb.borrow_mut().push(format!("b{i}"));
                    yield_now();
                }
                20
            });
            a.join().unwrap() + b.join().unwrap()
        })
        .unwrap();
    assert_eq!(out, 30);
    assert_eq!(*log.borrow(), ["a0", "b0", "a1", "b1", "a2", "b2"]);
}

#[test]
fn sleep_orders_by_deadline_and_wakeup_ends_it_early() {
    let order = Scheduler::new()
        .block_on(|| {
            let log = Rc::new(RefCell::new(Vec::new()));
            let mut hs = Vec::new();
            for (name, ms) in [("slow", 60u64), ("fast", 10), ("mid", 30)] {
                let l = log.clone();
                hs.push(spawn(move || {
                    sleep(Duration::from_millis(ms));
                    l.borrow_mut().push(name);
                }));
            }
            // A long sleeper woken early.
            let t0 = Instant::now();
            let sleeper = spawn(|| sleep(Duration::from_secs(30)));
            yield_now();
            assert_eq!(sleeper.fiber().status(), Status::Sleeping);
            assert!(sleeper.fiber().wakeup());
            sleeper.join().unwrap();
            assert!(t0.elapsed() < Duration::from_secs(5));
            for h in hs {
                h.join().unwrap();
            }
            let v = log.borrow().clone();
            v
        })
        .unwrap();
    assert_eq!(order, ["fast", "mid", "slow"]);
}

/// Timers fire on time while the ready queue never empties: the loop then looks at them
/// only when the counter read at a switch passes the gate set from the first deadline, never
/// after it (each sleeper wakes no earlier than asked, in deadline order, and none is late by
/// more than what a loaded machine's scheduling explains), and a sleep added while fibers
/// spin is seen (its gate is reset).
#[test]
fn sleepers_wake_on_time_while_other_fibers_keep_yielding() {
    let woke = Scheduler::new()
        .block_on(|| {
            let stop = Rc::new(std::cell::Cell::new(false));
            let spinners: Vec<_> = (0..2)
                .map(|_| {
                    let stop = stop.clone();
                    spawn(move || {
                        // Bounded: a loop that never looked at its timers fails the test
                        // below (late sleepers) instead of hanging it.
                        let t0 = Instant::now();
                        let mut n = 0u64;
                        while !stop.get() && t0.elapsed() < Duration::from_secs(3) {
                            yield_now();
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            let log = Rc::new(RefCell::new(Vec::new()));
            let mut sleepers = Vec::new();
            for ms in [40u64, 5, 20, 80] {
                let log = log.clone();
                sleepers.push(spawn(move || {
                    let t0 = Instant::now();
                    sleep(Duration::from_millis(ms));
                    log.borrow_mut().push((ms, t0.elapsed()));
                }));
                yield_now();
            }
            for s in sleepers {
                s.join().unwrap();
            }
            stop.set(true);
            for s in spinners {
                // They yielded all along: thousands of switches per millisecond of sleep.
                assert!(s.join().unwrap() > 1000);
            }
            let v = log.borrow().clone();
            v
        })
        .unwrap();
    let order: Vec<u64> = woke.iter().map(|(ms, _)| *ms).collect();
    assert_eq!(order, [5, 20, 40, 80]);
    for (ms, took) in woke {
        let asked = Duration::from_millis(ms);
        assert!(took >= asked, "slept {took:?} for {asked:?}");
        assert!(
            took < asked + Duration::from_millis(500),
            "slept {took:?} for {asked:?}"
        );
    }
}

struct Cleanup(Rc<RefCell<bool>>);
impl Drop for Cleanup {
    fn drop(&mut self) {
        *self.0.borrow_mut() = true;
    }
}

#[test]
fn cancel_of_a_sleeping_fiber_runs_its_cleanup() {
    Scheduler::new()
        .block_on(|| {
            let cleaned = Rc::new(RefCell::new(false));
            let c2 = cleaned.clone();
            let reached_end = Rc::new(RefCell::new(false));
            let r2 = reached_end.clone();
            let h = spawn(move || {
                let _guard = Cleanup(c2);
                sleep(Duration::from_secs(3600));
                *r2.borrow_mut() = true;
            });
            yield_now();
            assert_eq!(h.fiber().status(), Status::Sleeping);
            h.fiber().cancel();
            assert!(matches!(h.join(), Err(JoinError::Cancelled)));
            assert!(*cleaned.borrow(), "destructors ran");
            assert!(
                !*reached_end.borrow(),
                "the code after the sleep did not run"
            );
        })
        .unwrap();
}

#[test]
fn channel_buffered_rendezvous_close_and_timeouts() {
    Scheduler::new()
        .block_on(|| {
            // Buffered: the producer runs ahead by the capacity.
            let ch = channel::<u32>(2);
            let tx = ch.clone();
            let p = spawn(move || {
                for i in 0..5 {
                    tx.send(i).unwrap();
                }
                tx.close();
            });
            let mut got = Vec::new();
            while let Some(v) = ch.recv() {
                got.push(v);
            }
            p.join().unwrap();
            assert_eq!(got, [0, 1, 2, 3, 4]);
            assert_eq!(ch.send(9), Err(fibertrace_fiber::ChannelError::Closed));

            // Rendezvous: a send completes only once received.
            let rv = channel::<&'static str>(0);
            let tx = rv.clone();
            let done = Rc::new(RefCell::new(false));
            let d2 = done.clone();
            let s = spawn(move || {
                tx.send("x").unwrap();
                *d2.borrow_mut() = true;
            });
            for _ in 0..3 {
                yield_now();
            }
            assert!(!*done.borrow(), "a rendezvous send waits for its receiver");
            assert_eq!(rv.recv(), Some("x"));
            s.join().unwrap();
            assert!(*done.borrow());

            // Timeouts.
            let empty = channel::<u8>(1);
            let t0 = Instant::now();
            assert_eq!(
                empty.recv_timeout(Duration::from_millis(20)),
                Err(fibertrace_fiber::ChannelError::Timeout)
            );
            assert!(t0.elapsed() >= Duration::from_millis(20));
            empty.try_send(1).unwrap();
            assert_eq!(
                empty.send_timeout(2, Duration::from_millis(10)),
                Err(fibertrace_fiber::ChannelError::Timeout)
            );
        })
        .unwrap();
}

#[test]
fn condition_signal_and_broadcast() {
    Scheduler::new()
        .block_on(|| {
            let c = Rc::new(Cond::new());
            let woke = Rc::new(RefCell::new(0));
            let mut hs = Vec::new();
            for _ in 0..3 {
                let (c, w) = (c.clone(), woke.clone());
                hs.push(spawn(move || {
                    c.wait();
                    *w.borrow_mut() += 1;
                }));
            }
            yield_now();
            c.signal();
            yield_now();
            assert_eq!(*woke.borrow(), 1);
            c.broadcast();
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(*woke.borrow(), 3);
            assert!(!c.wait_timeout(Duration::from_millis(5)));
        })
        .unwrap();
}

#[inline(never)]
fn explode(x: u32) -> u32 {
    if x > 0 {
        panic!("boom {x}");
    }
    x
}

#[test]
fn a_panicking_fiber_is_reported_and_the_others_go_on() {
    Scheduler::new()
        .block_on(|| {
            let bad = spawn(|| explode(3));
            let good = spawn(|| {
                yield_now();
                5
            });
            match bad.join() {
                Err(JoinError::Panicked(r)) => {
                    assert_eq!(r.message, "boom 3");
                    assert!(r.location.as_deref().unwrap().contains("runtime.rs"));
                    let n = common::names(r.backtrace.frames());
                    assert_eq!(n[0], "explode", "{n:?}");
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(good.join().unwrap(), 5);
        })
        .unwrap();
}

#[test]
fn deadlock_is_an_error_not_a_hang() {
    let s = Scheduler::new();
    let ch = channel::<u8>(1);
    let c2 = ch.clone();
    s.spawn(move || {
        c2.recv();
    });
    match s.run() {
        Err(RunError::Deadlock { fibers }) => assert_eq!(fibers.len(), 1),
        other => panic!("{other:?}"),
    }
    ch.close();
    s.run().unwrap();
    assert_eq!(s.fiber_count(), 0);
}

#[test]
fn several_schedulers_on_several_threads() {
    let handles: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                Scheduler::new()
                    .block_on(move || {
                        let ch = channel::<u64>(4);
                        let tx = ch.clone();
                        let p = spawn(move || {
                            for i in 0..1000u64 {
                                tx.send(i * t).unwrap();
                            }
                            tx.close();
                        });
                        let mut sum = 0;
                        while let Some(v) = ch.recv() {
                            sum += v;
                        }
                        p.join().unwrap();
                        sum
                    })
                    .unwrap()
            })
        })
        .collect();
    for (t, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), 499_500 * t as u64);
    }
}

/// Waiters that leave by themselves (timeouts, wakeups) do not disturb the order of the
/// others: values go to the remaining receivers first come, first served.
#[test]
fn receivers_that_time_out_leave_the_queue_in_order() {
    let got = Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let log = Rc::new(RefCell::new(Vec::new()));
            let mut hs = Vec::new();
            for i in 0..6u32 {
                let (rx, log) = (ch.clone(), log.clone());
                hs.push(spawn(move || {
                    // Odd fibers give up after 20 ms; even ones wait for a value.
                    let r = if i % 2 == 1 {
                        rx.recv_timeout(Duration::from_millis(20)).ok()
                    } else {
                        rx.recv()
                    };
                    log.borrow_mut().push((i, r));
                }));
                yield_now(); // queue in spawn order
            }
            sleep(Duration::from_millis(60));
            for v in [100, 101, 102] {
                ch.send(v).unwrap();
            }
            for h in hs {
                h.join().unwrap();
            }
            log.take()
        })
        .unwrap();
    assert_eq!(
        got,
        [
            (1, None),
            (3, None),
            (5, None),
            (0, Some(100)),
            (2, Some(101)),
            (4, Some(102)),
        ]
    );
}

/// 10,000 fibers waiting on one channel (each wake used to scan the whole queue).
#[test]
fn many_receivers_of_one_channel_each_get_one_value() {
    const N: u64 = 10_000;
    let sum = Scheduler::new()
        .block_on(|| {
            let ch = channel::<u64>(1);
            let total = Rc::new(std::cell::Cell::new(0u64));
            let hs: Vec<_> = (0..N)
                .map(|_| {
                    let (rx, t) = (ch.clone(), total.clone());
                    spawn(move || {
                        let v = rx.recv().unwrap();
                        t.set(t.get() + v);
                    })
                })
                .collect();
            yield_now();
            for v in 1..=N {
                ch.send(v).unwrap();
            }
            for h in hs {
                h.join().unwrap();
            }
            total.get()
        })
        .unwrap();
    assert_eq!(sum, N * (N + 1) / 2);
}

/// A condition waiter that times out reports it; one signalled after others timed out is
/// woken (the stale entries ahead of it are skipped).
#[test]
fn condition_timeouts_and_signal_after_them() {
    let got = Scheduler::new()
        .block_on(|| {
            let c = Rc::new(Cond::new());
            let c1 = c.clone();
            let early = spawn(move || c1.wait_timeout(Duration::from_millis(10)));
            let c2 = c.clone();
            let late = spawn(move || c2.wait_timeout(Duration::from_secs(10)));
            sleep(Duration::from_millis(40));
            c.signal();
            (early.join().unwrap(), late.join().unwrap())
        })
        .unwrap();
    assert_eq!(got, (false, true));
}

/// A receiver cancelled in its wait leaves the queue: the next value goes to a receiver
/// still waiting (not to the cancelled one's stale place), and a condition signal likewise.
#[test]
fn a_cancelled_waiter_does_not_swallow_the_next_wakeup() {
    let got = Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let (r1, r2) = (ch.clone(), ch.clone());
            let first = spawn(move || r1.recv());
            yield_now();
            let second = spawn(move || r2.recv());
            yield_now();
            first.fiber().cancel();
            assert!(matches!(first.join(), Err(JoinError::Cancelled)));
            ch.send(7).unwrap();
            let v = second.join().unwrap();

            let c = Rc::new(Cond::new());
            let (c1, c2) = (c.clone(), c.clone());
            let w1 = spawn(move || c1.wait());
            yield_now();
            let w2 = spawn(move || c2.wait_timeout(Duration::from_secs(10)));
            yield_now();
            w1.fiber().cancel();
            assert!(matches!(w1.join(), Err(JoinError::Cancelled)));
            c.signal();
            (v, w2.join().unwrap())
        })
        .unwrap();
    assert_eq!(got, (Some(7), true));
}

#[inline(never)]
fn explode_unit(n: u32) {
    panic!("unit boom {n}");
}

/// A zero-sized result with a destructor: kept in a result slot, dropped exactly once.
struct Token;

thread_local! {
    static TOKEN_DROPS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl Drop for Token {
    fn drop(&mut self) {
        TOKEN_DROPS.with(|d| d.set(d.get() + 1));
    }
}

#[test]
fn unit_results_returned_panicked_and_cancelled_reach_the_join() {
    Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
        report_panics: false,
        ..Default::default()
    })
    .block_on(|| {
        assert!(matches!(spawn(|| ()).join(), Ok(())));
        match spawn(|| explode_unit(7)).join() {
            Err(JoinError::Panicked(r)) => assert_eq!(r.message, "unit boom 7"),
            other => panic!("{other:?}"),
        }
        let h = spawn(|| sleep(Duration::from_secs(3600)));
        yield_now();
        h.fiber().cancel();
        assert!(matches!(h.join(), Err(JoinError::Cancelled)));
        // Zero-sized with a destructor: one value handed back, one dropped with its handle.
        let joined = spawn(|| Token).join().unwrap();
        assert_eq!(TOKEN_DROPS.with(|d| d.get()), 0);
        drop(joined);
        let dropped = spawn(|| Token);
        yield_now();
        assert!(dropped.is_finished());
        drop(dropped);
        assert_eq!(TOKEN_DROPS.with(|d| d.get()), 2);
    })
    .unwrap();
}

#[test]
fn a_finished_fibers_handle_keeps_its_identity_while_others_come_and_go() {
    Scheduler::new()
        .block_on(|| {
            let h = fibertrace_fiber::Builder::new().name("first").spawn(|| ());
            let first = h.fiber().clone();
            h.join().unwrap();
            // Finished fibers' control blocks are reused by later spawns only when nothing
            // else holds them.
            let mut ids = Vec::new();
            for i in 0..20 {
                let h = fibertrace_fiber::Builder::new()
                    .name(&format!("later{i}"))
                    .spawn(|| ());
                ids.push(h.id());
                fibertrace_fiber::yield_to(h.fiber());
            }
            assert!(!ids.contains(&first.id()));
            assert_eq!(first.name(), "first");
            assert_eq!(first.status(), Status::Dead);
            assert!(first.backtrace(fibertrace_core::Unwinder::Fast).is_none());
        })
        .unwrap();
}

#[inline(never)]
fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

#[test]
fn a_fiber_started_at_once_is_charged_its_own_cpu_time_not_its_creators() {
    Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
        cpu_time: true,
        ..Default::default()
    })
    .block_on(|| {
        let me = fibertrace_fiber::current().unwrap();
        let info = fibertrace_fiber::info::fiber_info(me.id(), &Default::default()).unwrap();
        assert!(info.cpu_time_counted);
        // A switch settles the time this fiber ran so far (its CPU time is charged at
        // each accounting point).
        yield_now();
        let before = me.control_block().cpu_time();
        let h = spawn(|| spin_for(Duration::from_millis(30)));
        let child = h.fiber().clone();
        fibertrace_fiber::yield_to(h.fiber());
        assert!(h.is_finished());
        let mine = me.control_block().cpu_time() - before;
        // Compared with each other, not with wall time: the tick rate is calibrated
        // while the process is young, and may be off by a few percent.
        let theirs = child.control_block().cpu_time();
        assert!(
            theirs >= Duration::from_millis(15),
            "child charged {theirs:?}"
        );
        assert!(theirs > mine * 10, "child {theirs:?}, creator {mine:?}");
        // The creator's own work before the start is its own.
        yield_now();
        let before = me.control_block().cpu_time();
        spin_for(Duration::from_millis(20));
        let h = spawn(|| ());
        let child = h.fiber().clone();
        fibertrace_fiber::yield_to(h.fiber());
        let mine = me.control_block().cpu_time() - before;
        let theirs = child.control_block().cpu_time();
        assert!(
            mine >= Duration::from_millis(10),
            "creator charged {mine:?}"
        );
        assert!(mine > theirs * 10, "creator {mine:?}, child {theirs:?}");
    })
    .unwrap();
}

/// CPU time is counted while the scheduler times runs: not by default (a switch reads no
/// clock); from `top_enable` on, the run under way counted from that call (not from its
/// start); no more after `top_disable`.
#[test]
fn cpu_time_is_counted_only_while_runs_are_timed() {
    use fibertrace_fiber::embed::{top_disable, top_enable};
    Scheduler::new()
        .block_on(|| {
            let me = fibertrace_fiber::current().unwrap();
            let cpu = || me.control_block().cpu_time();
            spin_for(Duration::from_millis(20));
            yield_now();
            assert_eq!(cpu(), Duration::ZERO);
            let info = || fibertrace_fiber::info::fiber_info(me.id(), &Default::default()).unwrap();
            // (Not a measurement, and the info says so.)
            assert_eq!((info().cpu_time, info().cpu_time_counted), (0.0, false));
            // Not counted: the run was not timed until now.
            spin_for(Duration::from_millis(20));
            assert!(top_enable());
            spin_for(Duration::from_millis(10));
            yield_now();
            let counted = cpu();
            // (Wall time on the CPU, in ticks at a rate calibrated within a few percent;
            // the 20 ms before the enable would make it 30.)
            assert!(
                counted >= Duration::from_millis(8) && counted < Duration::from_millis(25),
                "{counted:?}"
            );
            assert!(info().cpu_time_counted);
            assert!((info().cpu_time - counted.as_secs_f64()).abs() < 0.001);
            top_disable();
            spin_for(Duration::from_millis(10));
            yield_now();
            assert_eq!(cpu(), counted);
            // Counted once: a lower bound from then on, still said to be counted.
            assert!(info().cpu_time_counted);
        })
        .unwrap();
}

/// The creation time of fiber `id`, in seconds since the epoch.
fn created(id: fibertrace_fiber::FiberId) -> f64 {
    let opts = fibertrace_fiber::InfoOptions {
        backtrace: false,
        ..Default::default()
    };
    fibertrace_fiber::info::fiber_info(id, &opts)
        .expect("a live fiber")
        .created
}

#[test]
fn a_fiber_created_at_start_is_dated_by_its_first_run() {
    Scheduler::new()
        .block_on(|| {
            // The last accounting point (this fiber's start) is well before the spawns.
            spin_for(Duration::from_millis(20));
            let plain = spawn(yield_now);
            let at_start = fibertrace_fiber::Builder::new()
                .created_at_start()
                .spawn(yield_now);
            let (plain_id, late_id) = (plain.fiber().id(), at_start.fiber().id());
            let spawned = created(plain_id);
            // Until it runs, it shows the scheduler's last accounting point: before the
            // spawn. (Creation times are within a few microseconds: each reading converts
            // the tick count with the clocks read then.)
            let provisional = created(late_id);
            assert!(provisional < spawned - 0.010, "{provisional} vs {spawned}");
            // Busy, not suspended: the two wait in the ready queue.
            spin_for(Duration::from_millis(40));
            yield_to_both(&plain, &at_start);
            // It first ran after the creator's 40 ms: that is its creation time now; the
            // other keeps its spawn time.
            let late = created(late_id);
            assert!(late - spawned >= 0.030, "{late} vs {spawned}");
            assert!((created(plain_id) - spawned).abs() < 0.005);
            plain.join().unwrap();
            at_start.join().unwrap();
        })
        .unwrap();
}

fn yield_to_both(a: &fibertrace_fiber::JoinHandle<()>, b: &fibertrace_fiber::JoinHandle<()>) {
    fibertrace_fiber::yield_to(a.fiber());
    fibertrace_fiber::yield_to(b.fiber());
}

/// Another thread reads the registry over and over while the scheduler spawns and ends
/// fibers: no reading misses or repeats a fiber that lives through it, and none shows a
/// fiber twice.
#[test]
fn registry_readers_on_another_thread_see_every_live_fiber_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let stop = Arc::new(AtomicBool::new(false));
    let stayers: Arc<Mutex<Vec<fibertrace_fiber::FiberId>>> = Arc::default();
    let (s2, st2) = (stop.clone(), stayers.clone());
    let sched_thread = std::thread::spawn(move || {
        Scheduler::new()
            .block_on(move || {
                let keep: Vec<_> = (0..10)
                    .map(|_| spawn(|| sleep(Duration::from_secs(3600))))
                    .collect();
                st2.lock()
                    .unwrap()
                    .extend(keep.iter().map(|h| h.fiber().id()));
                let mut rounds = 0u64;
                while !s2.load(Ordering::Relaxed) || rounds < 20 {
                    let batch: Vec<_> = (0..500).map(|i| spawn(move || i)).collect();
                    for h in batch {
                        h.join().unwrap();
                    }
                    rounds += 1;
                }
                for h in &keep {
                    h.fiber().cancel();
                }
            })
            .unwrap();
    });
    let scheds = || {
        fibertrace_fiber::registry::schedulers()
            .into_iter()
            .filter(|s| s.fibers().len() > 1)
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while stayers.lock().unwrap().len() < 10 {
        assert!(Instant::now() < deadline, "the scheduler did not start");
        std::thread::yield_now();
    }
    let want = stayers.lock().unwrap().clone();
    let mut readings = 0;
    let mut churn_seen = 0;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) || readings < 50 {
        for s in scheds() {
            if !want.iter().all(|id| s.fiber(*id).is_some()) {
                continue; // another test's scheduler
            }
            let fibers = s.fibers();
            let ids: Vec<_> = fibers.iter().map(|f| f.id()).collect();
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
            for id in &want {
                assert_eq!(ids.iter().filter(|x| *x == id).count(), 1, "{id}");
            }
            churn_seen += ids.len() - want.len();
            readings += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    sched_thread.join().unwrap();
    assert!(readings >= 50);
    // The readings did overlap the churn.
    assert!(churn_seen > 0, "no short-lived fiber was ever seen");
}

/// Started by the scheduler (not nested), a fiber created at start is dated by that run too.
#[test]
fn a_fiber_created_at_start_and_run_by_the_scheduler_is_dated_by_that_run() {
    Scheduler::new()
        .block_on(|| {
            let marker = spawn(yield_now);
            let spawned = created(marker.fiber().id());
            let h = fibertrace_fiber::Builder::new()
                .created_at_start()
                .spawn(yield_now);
            let id = h.fiber().id();
            spin_for(Duration::from_millis(40));
            // Through the ready queue: the scheduler runs both, then this fiber again.
            yield_now();
            let late = created(id);
            assert!(late - spawned >= 0.030, "{late} vs {spawned}");
            marker.join().unwrap();
            h.join().unwrap();
        })
        .unwrap();
}

/// A fiber that sleeps long and is cancelled at once leaves a stale timer behind; a million
/// such fibers must not leave a million timers (the heap is compacted past twice the
/// number of fibers).
#[test]
fn timers_of_cancelled_sleepers_do_not_accumulate() {
    let s = Scheduler::new();
    s.block_on(move || {
        for _ in 0..20_000 {
            let h = spawn(|| fibertrace_fiber::sleep(Duration::from_secs(3600)));
            yield_now();
            h.fiber().cancel();
            let _ = h.join();
        }
    })
    .unwrap();
    // At most two fibers lived at a time: the heap never held more than 2 * 2 + 64 + 1.
    assert!(s.timer_entries() <= 69, "{} timers", s.timer_entries());
}

/// Calls `yield_to` on the fiber it is given when dropped (from a fiber's stack being
/// unwound).
struct StartsOnDrop(Rc<RefCell<Option<fibertrace_fiber::Fiber>>>);
impl Drop for StartsOnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.borrow_mut().take() {
            fibertrace_fiber::yield_to(&f);
        }
    }
}

/// A scheduler dropped with fibers left: a destructor of a suspended fiber that asks to start
/// another fiber still in the ready queue (`yield_to`) starts nothing — the queue is emptied
/// before the fibers are unwound (its entries point into slots the drop frees) — and the
/// fiber that never ran never runs.
#[test]
fn a_destructor_run_by_the_scheduler_drop_starts_no_queued_fiber() {
    for _ in 0..20 {
        let s = Scheduler::new();
        let target: Rc<RefCell<Option<fibertrace_fiber::Fiber>>> = Rc::new(RefCell::new(None));
        let t2 = target.clone();
        // Parked for good, with a destructor on its stack.
        s.spawn(move || {
            let _guard = StartsOnDrop(t2);
            fibertrace_fiber::suspend();
        });
        // (Its run ends as a deadlock: the only fiber left waits for a wake-up.)
        assert!(matches!(s.run(), Err(RunError::Deadlock { .. })));
        // Queued, never run.
        let ran = Rc::new(std::cell::Cell::new(false));
        let r2 = ran.clone();
        let never = s.spawn(move || r2.set(true));
        assert_eq!(never.fiber().status(), Status::Ready);
        *target.borrow_mut() = Some(never.fiber().clone());
        assert_eq!(s.fiber_count(), 2);
        drop(s);
        assert!(
            !ran.get(),
            "a queued fiber ran while its scheduler was dropped"
        );
    }
}

/// A scheduler runs once at a time: `run` or `block_on` called from one of its own fibers is
/// refused (its loop would see the calling fiber as not running), and the outer run goes on.
#[test]
fn running_a_scheduler_from_its_own_fiber_is_refused() {
    let s = Rc::new(Scheduler::new());
    let inner = s.clone();
    let got = s
        .block_on(move || {
            let ran = Rc::new(std::cell::Cell::new(false));
            let r2 = ran.clone();
            inner.spawn(move || r2.set(true));
            let run = inner.run();
            let block = inner.block_on(|| 1).err().map(|e| e.to_string());
            yield_now();
            (run, block, ran.get())
        })
        .unwrap();
    assert_eq!(got.0, Err(RunError::Reentered));
    assert_eq!(
        got.1.as_deref(),
        Some("the scheduler is already running: run or block_on from its own fiber")
    );
    // The fiber spawned from inside ran in the outer run, as usual.
    assert!(got.2);
    // And the scheduler runs again once the outer run ended.
    assert_eq!(s.block_on(|| 7).unwrap(), 7);
}

/// Waits something does in a destructor that the scheduler's drop runs (unwinding a fiber
/// left suspended) end at once instead of switching — a switch there made the unwinding
/// start over inside the destructor: a panic while panicking, the process aborted. Each wait
/// says it did not get what it waited for; none sleeps or hangs.
#[test]
fn waits_in_destructors_run_by_the_scheduler_drop_end_at_once() {
    struct WaitsOnDrop(
        Rc<RefCell<Vec<String>>>,
        fibertrace_fiber::Channel<u8>,
        Rc<Cond>,
    );
    impl Drop for WaitsOnDrop {
        fn drop(&mut self) {
            let mut log = Vec::new();
            yield_now();
            log.push("yielded".to_string());
            let t0 = Instant::now();
            sleep(Duration::from_secs(30));
            log.push(format!("slept {}", t0.elapsed() < Duration::from_secs(5)));
            log.push(format!(
                "recv {:?}",
                self.1.recv_timeout(Duration::from_secs(30))
            ));
            log.push(format!("recv {:?}", self.1.recv()));
            self.1.try_send(1).unwrap();
            log.push(format!(
                "send {:?}",
                self.1.send_timeout(2, Duration::from_secs(30))
            ));
            log.push(format!(
                "cond {}",
                self.2.wait_timeout(Duration::from_secs(30))
            ));
            fibertrace_fiber::suspend();
            log.push("suspended".to_string());
            self.0.borrow_mut().extend(log);
        }
    }
    let log = Rc::new(RefCell::new(Vec::new()));
    let s = Scheduler::new();
    let (l2, ch, cond) = (log.clone(), channel::<u8>(1), Rc::new(Cond::new()));
    s.spawn(move || {
        let _guard = WaitsOnDrop(l2, ch, cond);
        fibertrace_fiber::suspend();
    });
    assert!(matches!(s.run(), Err(RunError::Deadlock { .. })));
    let t0 = Instant::now();
    drop(s);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(
        *log.borrow(),
        [
            "yielded",
            "slept true",
            "recv Err(WouldBlock)",
            "recv None",
            "send Err(WouldBlock)",
            "cond false",
            "suspended"
        ]
    );
}

/// `end_run_after_turn`: `block_on` returns at the end of the turn, with the main fiber's
/// result, though another fiber is still ready (it only yields); without it the loop would
/// run that fiber forever.
#[test]
fn end_run_after_turn_ends_block_on_though_a_fiber_is_still_ready() {
    let sched = fibertrace_fiber::Scheduler::new();
    let turns = std::rc::Rc::new(std::cell::Cell::new(0u32));
    let t = turns.clone();
    let r = sched.block_on(move || {
        fibertrace_fiber::spawn(move || loop {
            t.set(t.get() + 1);
            fibertrace_fiber::yield_now();
        });
        fibertrace_fiber::yield_now();
        fibertrace_fiber::end_run_after_turn();
        7
    });
    assert_eq!(r.unwrap(), 7);
    // The spinner ran in the turns before the end, and in no more than one after.
    assert!((1..=3).contains(&turns.get()), "{}", turns.get());
}

/// Timeouts too long for the clock (`Duration::MAX`) are waits for ever, as std's are: they
/// panicked in the runtime's own deadline arithmetic ("overflow when adding duration to
/// instant") — the fiber died, or, for a condition outside a fiber, the process.
#[test]
fn timeouts_too_long_for_the_clock_wait_for_ever() {
    // Outside a fiber: a condition's wait ends at once, as with any timeout there.
    assert!(!Cond::new().wait_timeout(Duration::MAX));
    let out = Scheduler::new()
        .block_on(|| {
            let sleeper = spawn(|| {
                let t0 = Instant::now();
                sleep(Duration::MAX);
                t0.elapsed()
            });
            let ch = channel::<u32>(0);
            let c2 = ch.clone();
            let receiver = spawn(move || c2.recv_timeout(Duration::MAX));
            let full = channel::<u32>(1);
            full.try_send(1).unwrap();
            let f2 = full.clone();
            let sender = spawn(move || f2.send_timeout(2, Duration::MAX).is_ok());
            let cond = Rc::new(Cond::new());
            let c3 = cond.clone();
            let waiter = spawn(move || c3.wait_timeout(Duration::MAX));
            sleep(Duration::from_millis(20));
            // Each is still waiting, and ends as its wait says when it comes.
            for f in [
                sleeper.fiber(),
                receiver.fiber(),
                sender.fiber(),
                waiter.fiber(),
            ] {
                assert_ne!(f.status(), Status::Dead);
            }
            sleeper.fiber().wakeup();
            ch.send(7).unwrap();
            assert_eq!(full.recv(), Some(1));
            cond.signal();
            (
                sleeper.join().unwrap() >= Duration::from_millis(20),
                receiver.join().unwrap(),
                sender.join().unwrap(),
                waiter.join().unwrap(),
            )
        })
        .unwrap();
    assert_eq!(out, (true, Ok(7), true, true));
}

/// A join of a fiber of another scheduler panics, as documented: it returned at once with
/// `Cancelled` for a fiber nobody cancelled (which then finished normally).
#[test]
fn a_join_across_schedulers_is_refused_not_a_false_cancellation() {
    let a = Scheduler::new();
    let h = a.spawn(|| {
        sleep(Duration::from_millis(5));
        42
    });
    let id = h.id();
    let b = Scheduler::new();
    let r = b.block_on(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.join()));
        let msg = r.err().map(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "?".into())
        });
        msg
    });
    let msg = r.unwrap().expect("the join did not panic");
    assert!(
        msg.starts_with(&format!("join of fiber {id} of scheduler "))
            && msg.ends_with(": a fiber is joined from its own scheduler"),
        "{msg}"
    );
    a.run().unwrap();
}

/// A fiber given a stack smaller than the runtime's own calls need (0, one page) gets
/// `MIN_STACK_SIZE`: its sleeps, yields, spawns and joins work (with one page, its first
/// `sleep` overflowed the stack and the process stopped), with its scheduler's options too.
#[test]
fn a_tiny_stack_is_raised_to_what_the_runtime_needs() {
    for size in [0, 1, 4096] {
        let out = Scheduler::new()
            .block_on(move || {
                let f = fibertrace_fiber::Builder::new().stack_size(size).spawn(|| {
                    sleep(Duration::from_millis(1));
                    yield_now();
                    let inner = spawn(|| 5);
                    inner.join().unwrap()
                });
                (f.join().unwrap(), f_size(size))
            })
            .unwrap();
        assert_eq!(out, (5, fibertrace_fiber::MIN_STACK_SIZE), "{size}");
        let s = Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
            stack_size: size,
            ..Default::default()
        });
        let out = s
            .block_on(|| {
                let f = spawn(|| {
                    sleep(Duration::from_millis(1));
                    spawn(|| 6).join().unwrap()
                });
                let n = f.fiber().control_block().stack_size();
                (f.join().unwrap(), n)
            })
            .unwrap();
        assert_eq!(out, (6, fibertrace_fiber::MIN_STACK_SIZE), "{size}");
    }
    assert_eq!(fibertrace_fiber::MIN_STACK_SIZE, 64 << 10);
}

/// The stack size a fiber spawned with `stack_size(size)` gets.
fn f_size(size: usize) -> usize {
    let f = fibertrace_fiber::Builder::new()
        .stack_size(size)
        .spawn(|| ());
    let n = f.fiber().control_block().stack_size();
    f.join().unwrap();
    n
}

/// A cancellation from another thread ends a blocked fiber's wait at once (only the flag was
/// set: a fiber sleeping 5 s unwound after 5 s), the scheduler woken from its idle wait.
#[test]
fn a_cancel_from_another_thread_interrupts_a_sleep() {
    let out = Scheduler::new()
        .block_on(|| {
            let h = spawn(|| sleep(Duration::from_secs(5)));
            yield_now();
            let f = h.fiber().clone();
            let t0 = Instant::now();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                f.cancel();
            });
            let r = h.join();
            (r, t0.elapsed())
        })
        .unwrap();
    assert!(matches!(out.0, Err(JoinError::Cancelled)), "{:?}", out.0);
    assert!(out.1 < Duration::from_secs(3), "{:?}", out.1);
}

/// Names are cut to `NAME_MAX` (255) bytes at a character boundary, however they are given:
/// a megabyte's name made every dump and listing eight megabytes.
#[test]
fn names_are_cut_to_name_max_bytes() {
    use fibertrace_fiber::NAME_MAX;
    assert_eq!(NAME_MAX, 255);
    let names = Scheduler::new()
        .block_on(|| {
            let mut got = Vec::new();
            let long = "n".repeat(1 << 20);
            let f = fibertrace_fiber::Builder::new().name(&long).spawn(|| ());
            got.push(f.fiber().name());
            // Two-byte characters: cut before the one that would cross the limit.
            f.fiber().set_name(&"é".repeat(200));
            got.push(f.fiber().name());
            // Bytes that are not UTF-8 count one each, and come back exactly.
            f.fiber().set_name_bytes(&[0xFF; 300]);
            assert_eq!(f.fiber().name_bytes(), vec![0xFF; 255]);
            let g = fibertrace_fiber::Builder::new()
                .name_bytes(&[b'x'; 256])
                .spawn(|| ());
            got.push(g.fiber().name());
            let shared: std::sync::Arc<str> = std::sync::Arc::from("s".repeat(300));
            let h = fibertrace_fiber::Builder::new()
                .shared_name(shared)
                .spawn(|| ());
            got.push(h.fiber().name());
            // Exactly the limit: kept whole.
            let exact = "e".repeat(255);
            let i = fibertrace_fiber::Builder::new().name(&exact).spawn(|| ());
            got.push(i.fiber().name());
            for j in [f, g, h, i] {
                j.join().unwrap();
            }
            got
        })
        .unwrap();
    assert_eq!(
        names,
        [
            "n".repeat(255),
            "é".repeat(127),
            "x".repeat(255),
            "s".repeat(255),
            "e".repeat(255)
        ]
    );
}

/// `wakeup` says whether the fiber was there to wake: not once it ended, nor from another
/// thread (true was returned for a dead fiber).
#[test]
fn wakeup_says_whether_the_fiber_was_there() {
    let (asleep, ended, elsewhere) = Scheduler::new()
        .block_on(|| {
            let h = spawn(|| sleep(Duration::from_secs(30)));
            yield_now();
            let f = h.fiber().clone();
            let elsewhere = std::thread::spawn({
                let f = f.clone();
                move || f.wakeup()
            })
            .join()
            .unwrap();
            let asleep = f.wakeup();
            h.join().unwrap();
            (asleep, f.wakeup(), elsewhere)
        })
        .unwrap();
    assert_eq!((asleep, ended, elsewhere), (true, false, false));
}

/// `recv` outside a fiber on an open, empty channel panics with the reason: it returned
/// `None`, which says "closed and drained", and a `while let Some(v) = ch.recv()` loop ended
/// with values still to come. A value there, or a closed channel, is answered as in a fiber.
#[test]
fn recv_outside_a_fiber_that_would_wait_panics_with_the_reason() {
    let ch = fibertrace_fiber::channel::<u32>(2);
    ch.try_send(7).unwrap();
    assert_eq!(ch.recv(), Some(7));
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ch.recv())).unwrap_err();
    let msg = p.downcast_ref::<&str>().copied().unwrap_or_default();
    assert_eq!(
        msg,
        "Channel::recv outside a fiber on an open, empty channel: it cannot wait there (use \
         try_recv, or recv from a fiber)"
    );
    assert_eq!(
        ch.try_recv(),
        Err(fibertrace_fiber::ChannelError::WouldBlock)
    );
    ch.close();
    assert_eq!(ch.recv(), None);
}

/// A scheduler's shared state outlives its thread (an inspector holds it, from the registry):
/// sampling it, its snapshot and a dump after its thread exited are answered, nothing
/// running, where the sampling signal went to the exited thread's `pthread_t`, freed with
/// its stack (a segfault of the inspecting process; an HTTP view could end the program it
/// showed).
#[test]
fn inspecting_a_scheduler_whose_thread_exited_is_safe() {
    let (tx, rx) = std::sync::mpsc::channel();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    // A stack too large for the C library's cache of thread stacks: unmapped at its exit.
    let t = std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(move || {
            let s = Scheduler::new();
            let id = s.id();
            s.block_on(move || {
                let mine: Vec<_> = fibertrace_fiber::registry::schedulers()
                    .into_iter()
                    .filter(|x| x.id == id)
                    .collect();
                tx.send(mine).unwrap();
                wait.recv().unwrap();
            })
            .unwrap();
        })
        .unwrap();
    let held = rx.recv().unwrap();
    assert_eq!(held.len(), 1);
    go.send(()).unwrap();
    t.join().unwrap();
    for _ in 0..3 {
        let s = fibertrace_fiber::sample::sample(&held[0], Duration::from_millis(100));
        assert!(s.is_none());
    }
    let snap = fibertrace_fiber::inspect::scheduler_snapshot(&held[0], &Default::default());
    assert!(snap.fibers.is_empty(), "{:?}", snap.fibers.len());
    // (Every scheduler's part: the exited one's is not listed any more.)
    let text = fibertrace_fiber::dump::dump_text();
    assert!(
        !text.contains(&format!("scheduler {} ", held[0].id)),
        "{text}"
    );
}

/// Fibers that pass the turn to each other (a yield runs the fibers ahead of the yielding
/// one inside its switch, and their yields go straight back to it) run in the loop's order,
/// a fiber spawned meanwhile taking its place at the back; each resume counts one switch;
/// each fiber is charged its own CPU time, not the time of those that ran inside its yield.
#[test]
fn fibers_passing_the_turn_keep_the_loops_order_switch_counts_and_cpu_times() {
    Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
        cpu_time: true,
        ..Default::default()
    })
    .block_on(|| {
        let log = Rc::new(RefCell::new(Vec::new()));
        let late = Rc::new(RefCell::new(None));
        let worker = |name: &'static str, spin: u64| {
            let log = log.clone();
            let late = late.clone();
            spawn(move || {
                for i in 0..3 {
                    log.borrow_mut().push(format!("{name}{i}"));
                    spin_for(Duration::from_millis(spin));
                    if name == "b" && i == 0 {
                        let log = log.clone();
                        *late.borrow_mut() = Some(spawn(move || {
                            for i in 0..2 {
                                log.borrow_mut().push(format!("d{i}"));
                                yield_now();
                            }
                        }));
                    }
                    yield_now();
                }
            })
        };
        let hs = [worker("a", 10), worker("b", 0), worker("c", 0)];
        let fibers: Vec<_> = hs.iter().map(|h| h.fiber().clone()).collect();
        for h in hs {
            h.join().unwrap();
        }
        late.borrow_mut().take().unwrap().join().unwrap();
        assert_eq!(
            *log.borrow(),
            ["a0", "b0", "c0", "a1", "d0", "b1", "c1", "a2", "d1", "b2", "c2"]
        );
        // The first run and one after each of the three yields.
        for f in &fibers {
            assert_eq!(f.control_block().csw(), 4, "fiber {}", f.id());
        }
        let [a, b, c] = [0, 1, 2].map(|i| fibers[i].control_block().cpu_time());
        assert!(a >= Duration::from_millis(20), "a charged {a:?}");
        assert!(a > b * 10 && a > c * 10, "a {a:?}, b {b:?}, c {c:?}");
    })
    .unwrap();
}

/// The order in which fibers took their steps, shared by the fibers of one test.
#[derive(Clone, Default)]
struct StepLog(Rc<RefCell<Vec<&'static str>>>);

impl StepLog {
    /// A step that writes `name` to the log when it is taken.
    fn step(&self, name: &'static str) -> impl FnOnce() + 'static {
        let log = self.0.clone();
        move || log.borrow_mut().push(name)
    }
}

/// A fiber started at once (`yield_to`) by one that runs inside another's yield, and was
/// ahead of that yielding fiber in the queue, leaves its place: the yielding fiber goes on
/// right after the one that started it, before the started one runs again — the order of the
/// loop, where the yielding fiber would wait in the queue. (The yielding fiber's place is a
/// count of the fibers ahead of it; one taken out of the queue ahead of it counts it down.)
#[test]
fn a_fiber_started_at_once_from_ahead_of_a_yielding_one_leaves_its_place() {
    let log = StepLog::default();
    let l = log.clone();
    Scheduler::new()
        .block_on(move || {
            let step = |s: &'static str| l.step(s);
            let (a0, a1) = (step("a0"), step("a1"));
            let a = spawn(move || {
                a0();
                yield_now();
                a1();
            });
            // `b` starts `c`, spawned after it.
            let later = Rc::new(RefCell::new(None::<fibertrace_fiber::Fiber>));
            let (b0, b1, b2) = (step("b0"), step("b1"), step("b2"));
            let c_of_b = later.clone();
            let b = spawn(move || {
                b0();
                let c = c_of_b.borrow().clone().unwrap();
                fibertrace_fiber::yield_to(&c);
                b1();
                yield_now();
                b2();
            });
            let (c0, c1) = (step("c0"), step("c1"));
            let c = spawn(move || {
                c0();
                yield_now();
                c1();
            });
            *later.borrow_mut() = Some(c.fiber().clone());
            for h in [a, b, c] {
                h.join().unwrap();
            }
        })
        .unwrap();
    // `a` yields with `b` and `c` ahead of it; `b` starts `c`, which yields back to `b`, which
    // yields: `a` is at the front then (`c` and `b` went to the back, behind it).
    assert_eq!(*log.0.borrow(), ["a0", "b0", "c0", "b1", "a1", "c1", "b2"]);
}

/// A yield served in place that must go back to the loop (a new turn with `fiber.top`
/// turned on meanwhile) leaves its fiber at its place in the queue: behind the fibers that
/// were ahead of it and not run yet, ahead of those that yielded meanwhile.
#[test]
fn a_yield_in_place_that_goes_back_to_the_loop_keeps_its_place() {
    let log = StepLog::default();
    let l = log.clone();
    Scheduler::new()
        .block_on(move || {
            let step = |s: &'static str| l.step(s);
            let (a0, a1, d0, d1) = (step("a0"), step("a1"), step("d0"), step("d1"));
            let late = Rc::new(RefCell::new(None));
            let late_of_a = late.clone();
            let a = spawn(move || {
                a0();
                // Made ready in this turn: it runs in the next one, ahead of `a`.
                *late_of_a.borrow_mut() = Some(spawn(move || {
                    d0();
                    yield_now();
                    d1();
                }));
                yield_now();
                a1();
            });
            let (b0, b1) = (step("b0"), step("b1"));
            let b = spawn(move || {
                b0();
                // The turn ends with `b`; the next one begins in the loop, not in `a`'s
                // yield (the loop closes `fiber.top`'s turns).
                assert!(fibertrace_fiber::embed::top_enable());
                yield_now();
                b1();
            });
            for h in [a, b] {
                h.join().unwrap();
            }
            late.borrow_mut().take().unwrap().join().unwrap();
            fibertrace_fiber::embed::top_disable();
        })
        .unwrap();
    assert_eq!(*log.0.borrow(), ["a0", "b0", "d0", "a1", "b1", "d1"]);
}

/// A cancel from another thread reaches a fiber that only yields to another one (their
/// yields run each other inside their switches, never through the loop's turn start, where
/// what other threads asked is served).
#[test]
fn a_cancel_from_another_thread_reaches_fibers_that_pass_the_turn() {
    let out = Scheduler::new()
        .block_on(|| {
            let done = Rc::new(std::cell::Cell::new(false));
            let t0 = Instant::now();
            let pass = |done: Rc<std::cell::Cell<bool>>| {
                spawn(move || {
                    while !done.get() && t0.elapsed() < Duration::from_secs(10) {
                        yield_now();
                    }
                })
            };
            let x = pass(done.clone());
            let y = pass(done.clone());
            let f = x.fiber().clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                f.cancel();
            });
            let r = x.join();
            let took = t0.elapsed();
            done.set(true);
            y.join().unwrap();
            (r, took)
        })
        .unwrap();
    assert!(matches!(out.0, Err(JoinError::Cancelled)), "{:?}", out.0);
    assert!(out.1 < Duration::from_secs(5), "{:?}", out.1);
}

/// `end_run_after_turn` ends the run though two fibers keep passing the turn to each other
/// inside their own switches.
#[test]
fn end_run_after_turn_ends_block_on_though_fibers_pass_the_turn() {
    let turns = Rc::new(std::cell::Cell::new(0u32));
    let t = turns.clone();
    let r = Scheduler::new().block_on(move || {
        for _ in 0..2 {
            let t = t.clone();
            spawn(move || loop {
                t.set(t.get() + 1);
                yield_now();
            });
        }
        yield_now();
        fibertrace_fiber::end_run_after_turn();
        7
    });
    assert_eq!(r.unwrap(), 7);
    // Each spinner ran in the turns before the end, and in no more than one after.
    assert!((2..=6).contains(&turns.get()), "{}", turns.get());
}
