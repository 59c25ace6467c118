//! What a channel guarantees whatever ends an operation (a value, a timeout, `close`, a
//! cancellation unwinding out of a wait): every value delivered at most once, a send that
//! reports failure leaves nothing queued, a receive that took a value returns it, and a
//! wake-up meant for a fiber that leaves is passed on.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use fibertrace_fiber::sync::SendError;
use fibertrace_fiber::{channel, spawn, yield_now, ChannelError, Scheduler};

/// A value that counts its drops.
#[derive(Debug)]
struct Counted(u32, Rc<Cell<u32>>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.1.set(self.1.get() + 1);
    }
}

#[test]
fn a_rendezvous_send_that_times_out_takes_its_value_back() {
    Scheduler::new()
        .block_on(|| {
            let drops = Rc::new(Cell::new(0));
            let ch = channel::<Counted>(0);
            // No receiver: the send queues its value, waits, times out, and takes it back.
            let r = ch.send_back(Counted(1, drops.clone()), Some(Duration::from_millis(5)));
            match r {
                Err(SendError {
                    error: ChannelError::Timeout,
                    value: Some(Counted(1, _)),
                }) => {}
                other => panic!("{other:?}"),
            }
            drop(r);
            assert_eq!(ch.len(), 0, "nothing stays queued");
            assert_eq!(
                drops.get(),
                1,
                "the value came back once (and was dropped here)"
            );
            // A receiver that comes later gets only what is sent later.
            let rx = ch.clone();
            let r = spawn(move || rx.recv().map(|c| c.0));
            yield_now();
            ch.send(Counted(2, drops.clone())).unwrap();
            assert_eq!(r.join().unwrap(), Some(2));
            assert_eq!(drops.get(), 2);
        })
        .unwrap();
}

#[test]
fn a_rendezvous_sender_blocked_at_close_fails_and_gets_its_value_back() {
    Scheduler::new()
        .block_on(|| {
            let drops = Rc::new(Cell::new(0));
            let ch = channel::<Counted>(0);
            let tx = ch.clone();
            let d = drops.clone();
            let s = spawn(move || match tx.send_back(Counted(7, d), None) {
                Err(SendError {
                    error: ChannelError::Closed,
                    value: Some(v),
                }) => v.0,
                other => panic!("{other:?}"),
            });
            yield_now(); // the sender queues its value and waits for a receiver
            assert!(ch.has_writers());
            ch.close();
            assert_eq!(s.join().unwrap(), 7);
            assert_eq!(
                ch.recv().map(|c| c.0),
                None,
                "nobody receives the withdrawn value"
            );
            assert_eq!(drops.get(), 1);
        })
        .unwrap();
}

#[test]
fn close_discarding_drops_queued_values_once_and_fails_blocked_senders() {
    Scheduler::new()
        .block_on(|| {
            let drops = Rc::new(Cell::new(0));
            let ch = channel::<Counted>(2);
            ch.send(Counted(1, drops.clone())).unwrap();
            ch.send(Counted(2, drops.clone())).unwrap();
            let tx = ch.clone();
            let d = drops.clone();
            let s = spawn(move || tx.send(Counted(3, d)));
            yield_now(); // blocked: the channel is full
            ch.close_discarding();
            assert_eq!(drops.get(), 2, "the two queued values");
            assert_eq!(s.join().unwrap(), Err(ChannelError::Closed));
            assert_eq!(drops.get(), 3, "and the blocked sender's");
            assert!(ch.recv().is_none());
        })
        .unwrap();
}

#[test]
fn a_rendezvous_sender_cancelled_while_waiting_leaves_nothing_queued() {
    Scheduler::new()
        .block_on(|| {
            let drops = Rc::new(Cell::new(0));
            let ch = channel::<Counted>(0);
            let tx = ch.clone();
            let d = drops.clone();
            let s = spawn(move || {
                let _ = tx.send(Counted(5, d));
                unreachable!("the send is cancelled");
            });
            yield_now();
            assert_eq!(ch.len(), 1, "the sender's value waits for a receiver");
            s.fiber().cancel();
            assert!(s.join().is_err());
            assert_eq!(ch.len(), 0, "the cancelled sender took its value out");
            assert_eq!(drops.get(), 1);
            assert!(!ch.has_writers());
        })
        .unwrap();
}

#[test]
fn a_receiver_cancelled_after_its_wakeup_passes_the_value_on() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(1);
            let got = Rc::new(RefCell::new(Vec::new()));
            let mut rs = Vec::new();
            for k in 0..2 {
                let rx = ch.clone();
                let g = got.clone();
                rs.push(spawn(move || {
                    let v = rx.recv();
                    g.borrow_mut().push((k, v));
                }));
            }
            yield_now(); // both block, receiver 0 first in line
            assert!(ch.has_readers());
            ch.send(42).unwrap(); // wakes receiver 0...
            rs[0].fiber().cancel(); // ...which is cancelled before it runs
            assert!(ch.has_readers(), "receiver 1 still waits");
            let mut rs = rs.into_iter();
            assert!(rs.next().unwrap().join().is_err());
            rs.next().unwrap().join().unwrap();
            assert_eq!(*got.borrow(), [(1, Some(42))]);
            assert!(!ch.has_readers());
        })
        .unwrap();
}

#[test]
fn has_readers_ignores_a_cancelled_reader() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(0);
            assert!(!ch.has_readers() && !ch.has_writers());
            let rx = ch.clone();
            let r = spawn(move || rx.recv());
            yield_now();
            assert!(ch.has_readers());
            r.fiber().cancel();
            assert!(!ch.has_readers(), "a cancelled reader will not read");
            assert!(r.join().is_err());
        })
        .unwrap();
}

/// The pool: workers on two rendezvous channels, producers handing off with a short
/// timeout and dropping what nobody took. Every delivered value is the channel's own and
/// is delivered once; every value is delivered or handed back, never both.
#[test]
fn hand_off_with_timeout_pools_deliver_each_value_once_to_its_own_channel() {
    Scheduler::new()
        .block_on(|| {
            let drops = Rc::new(Cell::new(0u32));
            let chans = [channel::<Counted>(0), channel::<Counted>(0)];
            let seen: Rc<RefCell<Vec<Vec<u32>>>> = Rc::new(RefCell::new(vec![Vec::new(); 2]));
            let mut workers = Vec::new();
            for (c, ch) in chans.iter().enumerate() {
                for _ in 0..2 {
                    let rx = ch.clone();
                    let seen = seen.clone();
                    workers.push(spawn(move || {
                        while let Some(v) = rx.recv() {
                            seen.borrow_mut()[c].push(v.0);
                            // Work that sometimes outlasts the producers' timeout.
                            if v.0 % 3 == 0 {
                                fibertrace_fiber::sleep(Duration::from_micros(300));
                            }
                        }
                    }));
                }
            }
            const N: u32 = 3000;
            let mut returned = [0u32; 2];
            let mut delivered = [0u32; 2];
            for i in 0..N {
                let c = (i % 2) as usize;
                let v = Counted(i * 2 + c as u32, drops.clone());
                match chans[c].send_back(v, Some(Duration::from_micros(100))) {
                    Ok(()) => delivered[c] += 1,
                    Err(SendError {
                        error: ChannelError::Timeout,
                        value: Some(v),
                    }) => {
                        assert_eq!(v.0 % 2, c as u32);
                        returned[c] += 1;
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            for ch in &chans {
                ch.close();
            }
            for w in workers {
                w.join().unwrap();
            }
            let seen = seen.borrow();
            for c in 0..2 {
                // Each worker saw only its own channel's values, each once.
                assert!(
                    seen[c].iter().all(|v| v % 2 == c as u32),
                    "foreign value on {c}"
                );
                let mut s = seen[c].clone();
                s.sort_unstable();
                s.dedup();
                assert_eq!(s.len(), seen[c].len(), "a value delivered twice on {c}");
                assert_eq!(seen[c].len() as u32, delivered[c]);
                assert_eq!(delivered[c] + returned[c], N / 2);
            }
            assert!(returned.iter().sum::<u32>() > 0, "some hand-offs timed out");
            assert_eq!(drops.get(), N, "every value dropped exactly once");
        })
        .unwrap();
}

/// A rendezvous send to a waiting receiver hands the value over, even with a zero timeout
/// (Tarantool's `ch:put(v, 0)` to a reader that waits).
#[test]
fn a_zero_timeout_send_to_a_waiting_receiver_hands_the_value_over() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(0);
            let rx = ch.clone();
            let r = spawn(move || rx.recv());
            yield_now(); // the receiver waits
            assert_eq!(ch.send_back(9, Some(Duration::ZERO)), Ok(()));
            assert_eq!(r.join().unwrap(), Some(9));
            // With nobody waiting, the same send times out and keeps its value.
            match ch.send_back(10, Some(Duration::ZERO)) {
                Err(SendError {
                    error: ChannelError::Timeout,
                    value: Some(10),
                }) => {}
                other => panic!("{other:?}"),
            }
            assert_eq!(ch.len(), 0);
        })
        .unwrap();
}

/// A value handed to a receiver that was waiting is that receiver's: a receive that comes
/// later, before the waiting one runs (another fiber's, or the sender's own), gets nothing,
/// and the handed value takes no room (Tarantool hands it over directly). Before, the later
/// receive took it, and the waiting receiver timed out with nothing, or waited forever.
#[test]
fn a_value_handed_to_a_waiting_receiver_is_not_taken_by_a_later_receive() {
    Scheduler::new()
        .block_on(|| {
            for cap in [0, 1] {
                let ch = channel::<&str>(cap);
                let rx = ch.clone();
                let first = spawn(move || rx.recv_timeout(Duration::from_millis(200)));
                yield_now(); // it waits
                ch.send("msg").unwrap();
                assert_eq!(ch.len(), 0, "capacity {cap}: handed, not buffered");
                // The sender's own receive, and another fiber's that runs first.
                assert_eq!(
                    ch.try_recv(),
                    Err(ChannelError::WouldBlock),
                    "capacity {cap}"
                );
                let rx = ch.clone();
                let later = spawn(move || rx.try_recv());
                assert_eq!(later.join().unwrap(), Err(ChannelError::WouldBlock));
                assert_eq!(first.join().unwrap(), Ok("msg"), "capacity {cap}");
            }
            // Capacity 1 with a receiver waiting: the first value is handed, the second
            // fits in the buffer at once.
            let ch = channel::<u32>(1);
            let rx = ch.clone();
            let r = spawn(move || rx.recv());
            yield_now();
            ch.send_back(1, Some(Duration::ZERO)).unwrap();
            assert!(!ch.is_full());
            ch.send_back(2, Some(Duration::ZERO)).unwrap();
            assert_eq!((ch.len(), ch.is_full()), (1, true));
            assert_eq!(r.join().unwrap(), Some(1));
            assert_eq!(ch.try_recv(), Ok(2));
            // Handed to two waiting receivers in turn: each gets its own, in order.
            let ch = channel::<u32>(0);
            let (a, b) = (ch.clone(), ch.clone());
            let ra = spawn(move || a.recv());
            let rb = spawn(move || b.recv());
            yield_now();
            ch.send(1).unwrap();
            ch.send(2).unwrap();
            assert_eq!((ra.join().unwrap(), rb.join().unwrap()), (Some(1), Some(2)));
            // A discarding close keeps a handed value for its receiver.
            let ch = channel::<u32>(0);
            let rx = ch.clone();
            let r = spawn(move || rx.recv());
            yield_now();
            ch.send(5).unwrap();
            ch.close_discarding();
            assert_eq!(r.join().unwrap(), Some(5));
        })
        .unwrap();
}
