//! What the Tarantool-compatible Lua modules need from the runtime: loop turns (one cached
//! clock reading per turn), `fiber.top()` accounting, the run time of the current fiber
//! (fiber slices), joins with a deadline and joins a cancellation does not end, and wake-ups
//! that pass over cancelled waiters.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use fibertrace_fiber::embed::{
    current_run_time, loop_turn, top_disable, top_enable, top_enabled, top_fiber_row, top_sched_row,
};
use fibertrace_fiber::{
    channel, is_cancelled, spawn, yield_now, Builder, Cond, Scheduler, SchedulerOptions,
};

fn spin(d: Duration) {
    let stop = Instant::now() + d;
    while Instant::now() < stop {
        std::hint::spin_loop();
    }
}

/// A turn runs the fibers ready when it began: fibers ready together share a turn, a fiber
/// that yields runs again in a later one, and one made ready during a turn runs in the next.
#[test]
fn loop_turns_group_the_fibers_ready_together() {
    assert_eq!(loop_turn(), (0, 0));
    let turns = Scheduler::new()
        .block_on(|| {
            let log = Rc::new(RefCell::new(Vec::new()));
            let within = loop_turn();
            let again = loop_turn();
            let (l1, l2) = (log.clone(), log.clone());
            let a = spawn(move || l1.borrow_mut().push(("a", loop_turn().1)));
            let b = spawn(move || {
                l2.borrow_mut().push(("b", loop_turn().1));
                yield_now();
                l2.borrow_mut().push(("b again", loop_turn().1));
            });
            yield_now();
            log.borrow_mut().push(("main", loop_turn().1));
            a.join().unwrap();
            b.join().unwrap();
            let log = log.borrow().clone();
            (within, again, log)
        })
        .unwrap();
    let (within, again, log) = turns;
    assert_eq!(within, again);
    assert!(within.0 > 0);
    // a, b and main (which yielded after spawning them) were ready together when the next
    // turn began: one turn; b, which yielded in it, runs again in the next one.
    let turn = |n: &str| log.iter().find(|(k, _)| *k == n).unwrap().1;
    assert_eq!(turn("a"), within.1 + 1);
    assert_eq!(turn("b"), turn("a"));
    assert_eq!(turn("main"), turn("a"));
    assert_eq!(turn("b again"), turn("a") + 1);
}

/// The current fiber's run time grows while it runs and starts again after a switch, on a
/// scheduler that times runs (`SchedulerOptions::cpu_time`, as the Lua host's). On one that
/// does not (the default) it is not known, until `fiber.top` accounting times runs: the run
/// under way then counts from the enable.
#[test]
fn run_time_counts_from_the_last_switch() {
    assert_eq!(current_run_time(), None);
    let timed = Scheduler::with_options(SchedulerOptions {
        cpu_time: true,
        ..Default::default()
    });
    let (before, after) = timed
        .block_on(|| {
            spin(Duration::from_millis(5));
            let before = current_run_time().unwrap();
            yield_now();
            (before, current_run_time().unwrap())
        })
        .unwrap();
    // (the run time comes from the tick counter, whose rate is measured: within 10%)
    assert!(before >= Duration::from_micros(4500), "{before:?}");
    assert!(after < Duration::from_millis(1), "{after:?}");
    let (first, later) = Scheduler::new()
        .block_on(|| {
            spin(Duration::from_millis(5));
            assert_eq!(current_run_time(), None);
            assert!(top_enable());
            let first = current_run_time().unwrap();
            spin(Duration::from_millis(5));
            (first, current_run_time().unwrap())
        })
        .unwrap();
    assert!(first < Duration::from_millis(1), "{first:?}");
    assert!(later >= Duration::from_micros(4500), "{later:?}");
}

/// `fiber.top()` accounting: off until enabled; a busy fiber's share and time; every row's
/// average adds up to at most 100.
#[test]
fn top_rows_share_the_turns() {
    let rows = Scheduler::new()
        .block_on(|| {
            let off = top_enabled();
            assert!(top_enable());
            let busy = Builder::new().name("busy").spawn(|| {
                for _ in 0..40 {
                    spin(Duration::from_micros(300));
                    yield_now();
                }
            });
            let id = busy.id();
            let idle = spawn(|| {
                for _ in 0..40 {
                    yield_now();
                }
            });
            let idle_id = idle.id();
            let mut last = None;
            for _ in 0..40 {
                yield_now();
                last = Some((top_fiber_row(id).unwrap(), top_fiber_row(idle_id).unwrap()));
            }
            let sched = top_sched_row().unwrap();
            let (b, i) = last.unwrap();
            busy.join().unwrap();
            idle.join().unwrap();
            top_disable();
            (off, top_enabled(), sched, b, i)
        })
        .unwrap();
    let (off, on_after, sched, busy, idle) = rows;
    assert!(!off && !on_after);
    assert!(busy.average > idle.average, "{busy:?} {idle:?}");
    assert!(busy.instant > 50.0, "{busy:?}");
    assert!(busy.time >= Duration::from_millis(5), "{busy:?}");
    assert!(busy.time < Duration::from_millis(100), "{busy:?}");
    let sum = sched.average + busy.average + idle.average;
    assert!(sum <= 100.0 + 1e-9, "{sum}");
    assert!(sched.average >= 0.0 && idle.average >= 0.0);
}

/// A wait with a deadline gives up in time; several waiters are woken in the order they
/// began to wait; a waiter that gave up is not woken later.
#[test]
fn waits_with_deadlines_and_several_joiners() {
    let (timed_out, order) = Scheduler::new()
        .block_on(|| {
            let target = spawn(|| fibertrace_fiber::sleep(Duration::from_millis(30)));
            let f = target.fiber().clone();
            let t0 = Instant::now();
            let done = f.wait_until(Some(Instant::now() + Duration::from_millis(5)));
            let timed_out = (done, t0.elapsed() >= Duration::from_millis(5));
            let order = Rc::new(RefCell::new(Vec::new()));
            let mut hs = Vec::new();
            for i in 0..3 {
                let (f, o) = (f.clone(), order.clone());
                hs.push(spawn(move || {
                    assert!(f.wait_until(None));
                    o.borrow_mut().push(i);
                }));
            }
            // The one that gave up above must not be woken by the end: it sleeps meanwhile.
            let woke = Rc::new(Cell::new(false));
            let w = woke.clone();
            let sleeper = spawn(move || {
                fibertrace_fiber::suspend();
                w.set(true);
            });
            for h in hs {
                h.join().unwrap();
            }
            target.join().unwrap();
            yield_now();
            assert!(!woke.get());
            sleeper.fiber().wakeup();
            sleeper.join().unwrap();
            let o = order.borrow().clone();
            (timed_out, o)
        })
        .unwrap();
    assert_eq!(timed_out, (false, true));
    assert_eq!(order, [0, 1, 2]);
}

/// A join that ignores cancellation goes on waiting when its fiber is cancelled; the
/// cancellation is raised at the next suspension after it.
#[test]
fn a_cancelled_joiner_keeps_waiting_when_told_to() {
    let got = Scheduler::new()
        .block_on(|| {
            let child = spawn(|| fibertrace_fiber::sleep(Duration::from_millis(20)));
            let f = child.fiber().clone();
            let seen = Rc::new(RefCell::new(Vec::new()));
            let s = seen.clone();
            let joiner = spawn(move || {
                let done = f.wait_until_ignoring_cancel(None);
                s.borrow_mut()
                    .push(format!("joined {done} {}", is_cancelled()));
                yield_now();
                s.borrow_mut().push("not reached".to_string());
            });
            yield_now();
            joiner.fiber().cancel();
            yield_now();
            let before = seen.borrow().len();
            let r = joiner.join();
            child.join().unwrap();
            let s = seen.borrow().clone();
            (before, r.is_err(), s)
        })
        .unwrap();
    assert_eq!(got, (0, true, vec!["joined true true".to_string()]));
}

/// A value sent while the only receiver waiting was cancelled (woken by its cancellation,
/// not run yet) is not handed to it: a discarding close drops it, and a receiver after
/// gets it otherwise; a condition's signal likewise goes to a waiter not cancelled.
#[test]
fn wake_ups_pass_over_cancelled_waiters() {
    let got = Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let rx = ch.clone();
            let r = spawn(move || rx.recv());
            yield_now();
            r.fiber().cancel();
            ch.send(1).unwrap();
            ch.close_discarding();
            let dropped = ch.is_empty();
            assert!(r.join().is_err());

            let c = Rc::new(Cond::new());
            let (c1, c2) = (c.clone(), c.clone());
            let w1 = spawn(move || c1.wait_timeout(Duration::from_secs(5)));
            yield_now();
            let w2 = spawn(move || c2.wait_timeout(Duration::from_secs(5)));
            yield_now();
            w1.fiber().cancel();
            c.signal();
            let second = w2.join().unwrap();
            assert!(w1.join().is_err());
            (dropped, second)
        })
        .unwrap();
    assert_eq!(got, (true, true));
}
