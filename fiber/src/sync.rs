//! Channels and condition variables for fibers of one scheduler. Blocking operations suspend
//! the calling fiber (recorded as waiting on the channel or condition, for info and dumps);
//! other fibers run meanwhile.

use std::cell::{Cell, RefCell};
use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasherDefault;

use fibertrace_core::symbolize::AddrHasher;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::control::{FiberId, WaitOn};
use crate::sched::{self, current_id};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A waiting fiber: its scheduler and id.
type Waiter = (u64, FiberId);

/// Fibers waiting on one object, first come first served. Each wait has a ticket; a waiter
/// that leaves by itself (timeout, cancel, a plain wakeup) only drops its ticket from the
/// live set, and the stale queue entry is skipped when it reaches the front. So waking and
/// leaving cost O(1) however many fibers wait (a scan of the queue per wake made 10,000
/// receivers of one channel quadratic).
#[derive(Default)]
struct WaitQueue {
    q: VecDeque<(Waiter, u64)>,
    live: HashSet<u64, BuildHasherDefault<AddrHasher>>,
    next: u64,
}

impl WaitQueue {
    /// Queues `w`; returns its ticket.
    fn push(&mut self, w: Waiter) -> u64 {
        let t = self.next;
        self.next += 1;
        self.q.push_back((w, t));
        self.live.insert(t);
        t
    }

    /// Takes the first waiter still waiting.
    fn pop(&mut self) -> Option<Waiter> {
        while let Some((w, t)) = self.q.pop_front() {
            if self.live.remove(&t) {
                return Some(w);
            }
        }
        None
    }

    /// Takes every waiter still waiting.
    fn take_all(&mut self) -> Vec<Waiter> {
        let live = std::mem::take(&mut self.live);
        self.q
            .drain(..)
            .filter(|(_, t)| live.contains(t))
            .map(|(w, _)| w)
            .collect()
    }

    /// Whether the wait of `ticket` is still queued (nobody took it).
    fn is_queued(&self, ticket: u64) -> bool {
        self.live.contains(&ticket)
    }

    /// Leaves the queue (no-op when a waker took the ticket already).
    fn forget(&mut self, ticket: u64) {
        if self.live.remove(&ticket) && self.q.len() > 2 * self.live.len() + 32 {
            // Mostly stale entries (waits that timed out): compact, amortized O(1).
            let live = &self.live;
            self.q.retain(|(_, t)| live.contains(t));
        }
    }

    fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// Leaves a wait queue when dropped: after the wait ends normally, and also when it ends by
/// unwinding (a cancelled fiber unwinds out of its wait), so no ticket stays live for a
/// fiber that no longer waits (it would swallow the next wake-up).
struct Leave<'a> {
    q: &'a RefCell<WaitQueue>,
    ticket: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if let Ok(mut q) = self.q.try_borrow_mut() {
            q.forget(self.ticket);
        }
    }
}

/// Queues the current fiber on `q` until the returned guard is dropped.
fn enter(q: &RefCell<WaitQueue>) -> Leave<'_> {
    let ticket = q.borrow_mut().push(me());
    Leave { q, ticket }
}

fn wake_one(q: &RefCell<WaitQueue>) {
    let w = q.borrow_mut().pop();
    if let Some((s, id)) = w {
        sched::wake(s, id);
    }
}

fn wake_all(q: &RefCell<WaitQueue>) {
    let ws = q.borrow_mut().take_all();
    for (s, id) in ws {
        sched::wake(s, id);
    }
}

fn me() -> Waiter {
    (sched::current_sched_id(), current_id())
}

/// Errors of channel operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelError {
    /// The channel is closed.
    Closed,
    /// The deadline passed.
    Timeout,
    /// The operation would block and the caller is not a fiber (or `try_` was used).
    WouldBlock,
}

impl std::fmt::Display for ChannelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChannelError::Closed => "channel is closed",
            ChannelError::Timeout => "timed out",
            ChannelError::WouldBlock => "would block",
        })
    }
}

impl std::error::Error for ChannelError {}

struct ChanInner<T> {
    id: u64,
    cap: usize,
    buf: RefCell<VecDeque<T>>,
    closed: Cell<bool>,
    /// Items taken so far (rendezvous senders wait for theirs to be taken).
    taken: Cell<u64>,
    pushed: Cell<u64>,
    receivers: RefCell<WaitQueue>,
    senders: RefCell<WaitQueue>,
}

/// A channel between fibers of one scheduler, with a capacity (0: a rendezvous — a send
/// waits until its value is received). Cloning gives another handle to the same channel.
pub struct Channel<T> {
    inner: Rc<ChanInner<T>>,
}

impl<T> Clone for Channel<T> {
    fn clone(&self) -> Self {
        Channel {
            inner: self.inner.clone(),
        }
    }
}

/// A new channel with room for `capacity` values.
pub fn channel<T>(capacity: usize) -> Channel<T> {
    Channel {
        inner: Rc::new(ChanInner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            cap: capacity,
            buf: RefCell::new(VecDeque::new()),
            closed: Cell::new(false),
            taken: Cell::new(0),
            pushed: Cell::new(0),
            receivers: RefCell::default(),
            senders: RefCell::default(),
        }),
    }
}

impl<T> Channel<T> {
    /// The channel's id (as shown in what a fiber waits on).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Values buffered.
    pub fn len(&self) -> usize {
        self.inner.buf.borrow().len()
    }

    /// Whether no value is buffered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its capacity.
    pub fn capacity(&self) -> usize {
        self.inner.cap
    }

    /// Whether it is full (a send would wait).
    pub fn is_full(&self) -> bool {
        self.len() >= self.inner.cap.max(1)
    }

    /// Whether it was closed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.get()
    }

    /// Closes it: blocked senders and receivers wake up; buffered values can still be read.
    pub fn close(&self) {
        self.inner.closed.set(true);
        wake_all(&self.inner.receivers);
        wake_all(&self.inner.senders);
    }

    /// Sends, waiting while the channel is full.
    #[inline(never)]
    pub fn send(&self, v: T) -> Result<(), ChannelError> {
        self.send_until(v, None)
    }

    /// Sends, waiting at most `d`.
    pub fn send_timeout(&self, v: T, d: Duration) -> Result<(), ChannelError> {
        self.send_until(v, Some(Instant::now() + d))
    }

    /// Sends only if there is room now.
    pub fn try_send(&self, v: T) -> Result<(), ChannelError> {
        let c = &self.inner;
        if c.closed.get() {
            return Err(ChannelError::Closed);
        }
        if c.buf.borrow().len() >= c.cap.max(1) || (c.cap == 0 && c.receivers.borrow().is_empty()) {
            return Err(ChannelError::WouldBlock);
        }
        self.push(v);
        Ok(())
    }

    fn push(&self, v: T) -> u64 {
        let c = &self.inner;
        c.buf.borrow_mut().push_back(v);
        c.pushed.set(c.pushed.get() + 1);
        wake_one(&c.receivers);
        c.pushed.get()
    }

    #[inline(never)]
    fn send_until(&self, v: T, deadline: Option<Instant>) -> Result<(), ChannelError> {
        let c = &self.inner;
        let me = current_id();
        loop {
            if c.closed.get() {
                return Err(ChannelError::Closed);
            }
            if c.buf.borrow().len() < c.cap.max(1) {
                break;
            }
            self.wait_as_sender(me, deadline)?;
        }
        let ticket = self.push(v);
        if c.cap == 0 {
            // Rendezvous: wait until our value is taken.
            while c.taken.get() < ticket {
                if c.closed.get() {
                    return Err(ChannelError::Closed);
                }
                self.wait_as_sender(me, deadline)?;
            }
        }
        Ok(())
    }

    #[inline(never)]
    fn wait_as_sender(&self, me: FiberId, deadline: Option<Instant>) -> Result<(), ChannelError> {
        let c = &self.inner;
        if me == 0 {
            return Err(ChannelError::WouldBlock);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(ChannelError::Timeout);
        }
        let waiting = enter(&c.senders);
        sched::block(WaitOn::ChannelSend(c.id), deadline);
        drop(waiting);
        if deadline.is_some_and(|d| Instant::now() >= d) && !c.closed.get() {
            return Err(ChannelError::Timeout);
        }
        Ok(())
    }

    /// Receives, waiting while the channel is empty; `None` once it is closed and drained.
    #[inline(never)]
    pub fn recv(&self) -> Option<T> {
        self.recv_until(None).ok()
    }

    /// Receives, waiting at most `d`.
    pub fn recv_timeout(&self, d: Duration) -> Result<T, ChannelError> {
        self.recv_until(Some(Instant::now() + d))
    }

    /// Receives only if a value is there now.
    pub fn try_recv(&self) -> Result<T, ChannelError> {
        match self.take() {
            Some(v) => Ok(v),
            None if self.inner.closed.get() => Err(ChannelError::Closed),
            None => Err(ChannelError::WouldBlock),
        }
    }

    fn take(&self) -> Option<T> {
        let c = &self.inner;
        let v = c.buf.borrow_mut().pop_front();
        if v.is_some() {
            c.taken.set(c.taken.get() + 1);
            if c.cap == 0 {
                wake_all(&c.senders);
            } else {
                wake_one(&c.senders);
            }
        }
        v
    }

    #[inline(never)]
    fn recv_until(&self, deadline: Option<Instant>) -> Result<T, ChannelError> {
        let c = &self.inner;
        let me = current_id();
        loop {
            if let Some(v) = self.take() {
                return Ok(v);
            }
            if c.closed.get() {
                return Err(ChannelError::Closed);
            }
            if me == 0 {
                return Err(ChannelError::WouldBlock);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ChannelError::Timeout);
            }
            if c.cap == 0 {
                // A rendezvous sender may be waiting for a receiver to show up.
                wake_one(&c.senders);
            }
            let waiting = enter(&c.receivers);
            sched::block(WaitOn::ChannelReceive(c.id), deadline);
            drop(waiting);
        }
    }
}

/// A condition variable for fibers of one scheduler.
pub struct Cond {
    id: u64,
    waiters: RefCell<WaitQueue>,
}

impl Default for Cond {
    fn default() -> Self {
        Self::new()
    }
}

impl Cond {
    /// A new condition.
    pub fn new() -> Cond {
        Cond {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            waiters: RefCell::default(),
        }
    }

    /// Its id (as shown in what a fiber waits on).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Waits for a signal (or a [`crate::Fiber::wakeup`]).
    #[inline(never)]
    pub fn wait(&self) {
        self.wait_until(None);
    }

    /// Waits at most `d`; returns false on timeout.
    pub fn wait_timeout(&self, d: Duration) -> bool {
        self.wait_until(Some(Instant::now() + d))
    }

    #[inline(never)]
    fn wait_until(&self, deadline: Option<Instant>) -> bool {
        let me = current_id();
        if me == 0 {
            return false;
        }
        let waiting = enter(&self.waiters);
        sched::block(WaitOn::Condition(self.id), deadline);
        let still_waiting = self.waiters.borrow().is_queued(waiting.ticket);
        drop(waiting);
        !(still_waiting && deadline.is_some_and(|d| Instant::now() >= d))
    }

    /// Wakes one waiter.
    pub fn signal(&self) {
        wake_one(&self.waiters);
    }

    /// Wakes every waiter.
    pub fn broadcast(&self) {
        wake_all(&self.waiters);
    }
}
