//! What a channel guarantees whatever ends an operation (a value, a timeout, `close`, a
//! cancellation): every value delivered at most once, a send that reports failure leaves
//! nothing queued, a send whose value was taken and a receive handed a value succeed even in
//! a cancelled fiber (Tarantool's rules), and a receive wakes one sender at most.

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
            // The sender's value waits with it, not in the channel (Tarantool's count).
            assert_eq!((ch.len(), ch.is_empty(), ch.is_full()), (0, true, true));
            assert!(ch.has_writers());
            s.fiber().cancel();
            assert!(!ch.has_writers(), "a cancelled sender will not send");
            assert_eq!(ch.try_recv().map(|c| c.0), Err(ChannelError::WouldBlock));
            assert!(s.join().is_err());
            assert_eq!(drops.get(), 1, "the cancelled sender dropped its value");
            assert!(!ch.has_writers());
        })
        .unwrap();
}

/// The sweep's case: a value handed to a waiting receiver that is cancelled before it runs is
/// still that receiver's (its receive returns it, as Tarantool's does), and the next value
/// goes to the next receiver. (The first was handed on to the second receiver, which took it
/// instead of its own; its own stayed handed to it, unseen: lost.)
#[test]
fn a_receiver_cancelled_after_its_wakeup_returns_its_value_and_the_next_is_not_lost() {
    for cap in [0, 1, 5] {
        Scheduler::new()
            .block_on(move || {
                let ch = channel::<u32>(cap);
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
                ch.send_timeout(42, Duration::ZERO).unwrap(); // handed to receiver 0...
                rs[0].fiber().cancel(); // ...which is cancelled before it runs
                assert!(ch.has_readers(), "receiver 1 still waits");
                ch.send_timeout(43, Duration::ZERO).unwrap();
                for r in rs {
                    let _ = r.join();
                }
                let mut got = got.borrow().clone();
                got.sort();
                assert_eq!(got, [(0, Some(42)), (1, Some(43))], "capacity {cap}");
                assert!(!ch.has_readers());
                assert_eq!(ch.len(), 0);
            })
            .unwrap();
    }
}

/// A sender whose value a receiver took, cancelled before it runs again, was told its value
/// was sent (Tarantool's rule; a caller that retried on the error sent it twice): from a
/// rendezvous, and from a full buffer, where the receive that frees room moves the waiting
/// sender's value into it.
#[test]
fn a_sender_whose_value_was_taken_is_told_so_even_if_cancelled_before_it_runs() {
    for cap in [0, 1] {
        Scheduler::new()
            .block_on(move || {
                let ch = channel::<u32>(cap);
                if cap == 1 {
                    ch.send(1).unwrap();
                }
                let tx = ch.clone();
                let s = spawn(move || tx.send(7));
                yield_now(); // blocked: nobody receives, or the buffer is full
                assert!(ch.has_writers());
                let first = ch.try_recv();
                s.fiber().cancel();
                assert_eq!(s.join().map_err(|_| ()), Ok(Ok(())), "capacity {cap}");
                if cap == 0 {
                    assert_eq!(first, Ok(7));
                } else {
                    assert_eq!(first, Ok(1));
                    assert_eq!((ch.len(), ch.try_recv()), (1, Ok(7)), "moved into the room");
                }
                assert!(!ch.has_writers());
                assert_eq!(ch.try_recv(), Err(ChannelError::WouldBlock));
            })
            .unwrap();
    }
}

/// Many senders waiting on a rendezvous channel: each receive takes one sender's value and
/// wakes that sender only (every receive woke them all: 8,000 senders took 15 s).
#[test]
fn a_receive_wakes_only_the_sender_whose_value_it_took() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u32>(0);
            let n = 300;
            let mut ss = Vec::new();
            for i in 0..n {
                let tx = ch.clone();
                ss.push(spawn(move || tx.send(i)));
            }
            yield_now();
            let fibers: Vec<_> = ss.iter().map(|s| s.fiber().clone()).collect();
            let mut sum = 0;
            for _ in 0..n {
                sum += ch.recv().unwrap();
            }
            assert_eq!(sum, n * (n - 1) / 2);
            for s in ss {
                s.join().unwrap().unwrap();
            }
            // Each sender ran twice: to send, and once its value was taken.
            for f in fibers {
                assert_eq!(f.control_block().csw(), 2, "fiber {}", f.id());
            }
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
