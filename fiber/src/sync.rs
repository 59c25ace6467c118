//! Channels and condition variables for fibers of one scheduler. Blocking operations suspend
//! the calling fiber (recorded as waiting on the channel or condition, for info and dumps);
//! other fibers run meanwhile.
//!
//! What a channel guarantees, whatever ends an operation (a value, a timeout, `close`, the
//! fiber's cancellation), as Tarantool's channels do:
//! * a value is delivered at most once, and a send reports success exactly when its value
//!   was buffered, handed to a receiver that was waiting for it, or taken by a receiver
//!   while its sender waited — also when the sender was cancelled meanwhile (the
//!   cancellation is raised at its next wait); a value handed to a waiting receiver is that
//!   receiver's — a receive that comes later, before it runs, does not take it, and its
//!   receive returns it even if it was cancelled meanwhile — and takes no room in the
//!   channel (a discarding close keeps it);
//! * a waiting sender's value waits with it, not in the channel (a rendezvous channel's
//!   count is always 0): a receiver takes it from there, or, taking a buffered value, moves
//!   it into the room it leaves and wakes its sender; a send that fails takes its value back
//!   ([`Channel::send_back`] hands it to the caller; otherwise it is dropped), so nobody
//!   receives a value whose sender was told it was not sent;
//! * a receive that took a value returns it; each receive or send wakes at most one other
//!   fiber (many senders waiting on one channel cost no more per value than one).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;

use fibertrace_core::symbolize::AddrHasher;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::sched::{self, current_id};
use crate::task::{FiberId, WaitOn};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// How many fibers [`Users`] remembers per object.
const USERS_MAX: usize = 16;

/// The fibers that made or used a channel or condition (sent, received, closed, waited,
/// signalled): the first [`USERS_MAX`] distinct ones. The deadlock report's wait-for graph
/// reads them ([`users_of`]) to say which fibers could end a wait on the object.
struct Users {
    id: u64,
    ids: [Cell<FiberId>; USERS_MAX],
    len: Cell<usize>,
    /// More fibers used it than were kept.
    more: Cell<bool>,
}

std::thread_local! {
    /// The live channels and conditions of this thread, by id (they are `!Send`: an object
    /// is used on the thread that made it).
    static OBJECTS: RefCell<HashMap<u64, Weak<Users>, BuildHasherDefault<AddrHasher>>> =
        RefCell::default();
}

impl Users {
    /// The users of a new object `id`, made by the current fiber (none outside a fiber).
    fn new(id: u64) -> Rc<Users> {
        let u = Rc::new(Users {
            id,
            ids: Default::default(),
            len: Cell::new(0),
            more: Cell::new(false),
        });
        u.note();
        let _ = OBJECTS.try_with(|m| {
            if let Ok(mut m) = m.try_borrow_mut() {
                m.insert(id, Rc::downgrade(&u));
            }
        });
        u
    }

    /// Records the current fiber as a user.
    #[inline]
    fn note(&self) {
        let me = current_id();
        let n = self.len.get();
        if me == 0 || (n > 0 && self.ids[n - 1].get() == me) {
            return;
        }
        if self.ids[..n].iter().any(|c| c.get() == me) {
            return;
        }
        if n < USERS_MAX {
            self.ids[n].set(me);
            self.len.set(n + 1);
        } else {
            self.more.set(true);
        }
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        let _ = OBJECTS.try_with(|m| {
            if let Ok(mut m) = m.try_borrow_mut() {
                m.remove(&self.id);
            }
        });
    }
}

/// The fibers that made or used channel or condition `id` (see [`Users`]), and whether more
/// did than are listed; `None` when no such object lives on this thread.
pub(crate) fn users_of(id: u64) -> Option<(Vec<FiberId>, bool)> {
    OBJECTS
        .try_with(|m| {
            let u = m.try_borrow().ok()?.get(&id)?.upgrade()?;
            let ids = u.ids[..u.len.get()].iter().map(Cell::get).collect();
            Some((ids, u.more.get()))
        })
        .ok()
        .flatten()
}

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

/// Wakes the first waiter still waiting that was not cancelled (a cancelled one was woken
/// by its cancellation and leaves by unwinding: as in Tarantool, where waking a fiber takes
/// it off the list it waited on, a value or a signal goes to the next waiter). Returns the
/// one it woke.
fn wake_one(q: &RefCell<WaitQueue>) -> Option<Waiter> {
    loop {
        let w = q.borrow_mut().pop();
        match w {
            Some((s, id)) => {
                if sched::wake_live(s, id) {
                    return Some((s, id));
                }
            }
            None => return None,
        }
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
    /// The operation would block and the caller is not a fiber (or `try_` was used, or its
    /// scheduler is being dropped: a destructor run by the drop cannot wait).
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

/// A failed send, with the value when it is still the sender's: not queued, or taken back
/// out of a rendezvous channel. `None` when the channel's values were discarded
/// ([`Channel::close_discarding`]) with it.
#[derive(Debug, PartialEq, Eq)]
pub struct SendError<T> {
    /// Why.
    pub error: ChannelError,
    /// The value, when it was not sent.
    pub value: Option<T>,
}

/// A value in a channel's buffer.
struct Queued<T> {
    /// The receiver it was handed to (it was waiting for it), which alone takes it; 0: not
    /// handed, the next receive takes it. A discarding close keeps a handed value.
    to: FiberId,
    value: T,
}

/// A sender waiting with its value: Tarantool keeps a blocked writer's message in its wait,
/// where a receiver takes it (a rendezvous), or moves it into the buffer as it frees room.
struct Sending<T> {
    ticket: u64,
    waiter: Waiter,
    /// `None` once taken back by its sender, or delivered.
    value: Option<T>,
}

/// The senders waiting on a channel with their values, first come first served. A sender
/// that leaves (timeout, close, cancellation) takes its value back and leaves an empty entry,
/// skipped when it reaches the front (compacted when most are empty): leaving costs
/// O(log n) however many senders wait.
struct SendQueue<T> {
    q: VecDeque<Sending<T>>,
    /// Entries that still hold a value.
    live: usize,
    next: u64,
    /// Tickets whose values a receiver took, for their senders to see as they wake.
    delivered: HashSet<u64, BuildHasherDefault<AddrHasher>>,
}

impl<T> Default for SendQueue<T> {
    fn default() -> Self {
        SendQueue {
            q: VecDeque::new(),
            live: 0,
            next: 0,
            delivered: HashSet::default(),
        }
    }
}

impl<T> SendQueue<T> {
    /// Queues the current fiber's value; its ticket.
    fn push(&mut self, v: T) -> u64 {
        let ticket = self.next;
        self.next += 1;
        self.q.push_back(Sending {
            ticket,
            waiter: me(),
            value: Some(v),
        });
        self.live += 1;
        ticket
    }

    /// Takes the value of the first sender still waiting that was not cancelled (a cancelled
    /// one fails: its value is not sent), marks it delivered; the value and its sender, to
    /// wake.
    fn take_first(&mut self) -> Option<(T, Waiter)> {
        while self.q.front().is_some_and(|s| s.value.is_none()) {
            self.q.pop_front();
        }
        let s = self
            .q
            .iter_mut()
            .find(|s| s.value.is_some() && !sched::is_cancelled_fiber(s.waiter.0, s.waiter.1))?;
        let v = s.value.take()?;
        self.live -= 1;
        self.delivered.insert(s.ticket);
        Some((v, s.waiter))
    }

    /// Whether the value of `ticket` was delivered (forgotten once said).
    fn was_delivered(&mut self, ticket: u64) -> bool {
        self.delivered.remove(&ticket)
    }

    /// Takes the value of `ticket` back (its sender leaves); `None` if it is not there.
    fn take_back(&mut self, ticket: u64) -> Option<T> {
        let i = self.q.binary_search_by_key(&ticket, |s| s.ticket).ok()?;
        let v = self.q[i].value.take()?;
        self.live -= 1;
        if self.q.len() > 2 * self.live + 32 {
            self.q.retain(|s| s.value.is_some());
        }
        Some(v)
    }

    /// Every sender still waiting (to wake them all: the channel was closed).
    fn waiters(&self) -> Vec<Waiter> {
        self.q
            .iter()
            .filter(|s| s.value.is_some())
            .map(|s| s.waiter)
            .collect()
    }

    /// Whether a sender waits that was not cancelled.
    fn has_live(&self) -> bool {
        self.q
            .iter()
            .any(|s| s.value.is_some() && !sched::is_cancelled_fiber(s.waiter.0, s.waiter.1))
    }
}

struct ChanInner<T> {
    id: u64,
    cap: usize,
    /// Buffered values, in the order they came, and values handed to waiting receivers.
    buf: RefCell<VecDeque<Queued<T>>>,
    /// How many of them were handed to a receiver (they take no room: the rest count
    /// against the capacity).
    handed: Cell<usize>,
    closed: Cell<bool>,
    receivers: RefCell<WaitQueue>,
    senders: RefCell<SendQueue<T>>,
    users: Rc<Users>,
}

impl<T> ChanInner<T> {
    /// Values buffered and not handed to a receiver (they count against the capacity).
    fn queued(&self) -> usize {
        self.buf.borrow().len() - self.handed.get()
    }
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
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    Channel {
        inner: Rc::new(ChanInner {
            id,
            cap: capacity,
            buf: RefCell::new(VecDeque::new()),
            handed: Cell::new(0),
            closed: Cell::new(false),
            receivers: RefCell::default(),
            senders: RefCell::default(),
            users: Users::new(id),
        }),
    }
}

impl<T> Channel<T> {
    /// The channel's id (as shown in what a fiber waits on).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Values buffered (not those handed to a waiting receiver, which are its already, nor
    /// those of senders waiting: a rendezvous channel's count is always 0, as Tarantool's).
    pub fn len(&self) -> usize {
        self.inner.queued()
    }

    /// Whether no value is buffered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its capacity.
    pub fn capacity(&self) -> usize {
        self.inner.cap
    }

    /// Whether its buffer is full (always, for a rendezvous channel, as Tarantool says: a
    /// send waits unless a receiver does).
    pub fn is_full(&self) -> bool {
        self.len() >= self.inner.cap
    }

    /// Whether it was closed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.get()
    }

    /// Closes it: blocked senders and receivers wake up, the senders fail with their values
    /// back; buffered values can still be read.
    pub fn close(&self) {
        self.inner.users.note();
        self.inner.closed.set(true);
        wake_all(&self.inner.receivers);
        let senders = self.inner.senders.borrow().waiters();
        for (s, id) in senders {
            sched::wake(s, id);
        }
    }

    /// Closes it and drops every buffered value (Tarantool's close before 2.10): blocked
    /// senders fail, receivers get nothing more.
    pub fn close_discarding(&self) {
        self.close();
        let all = std::mem::take(&mut *self.inner.buf.borrow_mut());
        // Values already handed to a receiver stay for it (Tarantool hands them over
        // directly: the close does not take them back).
        let (kept, dropped): (VecDeque<_>, VecDeque<_>) = all.into_iter().partition(|q| q.to != 0);
        *self.inner.buf.borrow_mut() = kept;
        // Dropped outside the borrow: a value's destructor may use the channel.
        drop(dropped);
    }

    /// Whether a fiber is blocked receiving (and not cancelled).
    pub fn has_readers(&self) -> bool {
        has_live_waiters(&self.inner.receivers)
    }

    /// Whether a fiber is blocked sending (and not cancelled; none once the channel is
    /// closed: its senders fail).
    pub fn has_writers(&self) -> bool {
        !self.inner.closed.get() && self.inner.senders.borrow().has_live()
    }

    /// Sends, waiting while the channel is full.
    #[inline(never)]
    pub fn send(&self, v: T) -> Result<(), ChannelError> {
        self.send_until(v, None).map_err(|e| e.error)
    }

    /// Sends, waiting at most `d`.
    pub fn send_timeout(&self, v: T, d: Duration) -> Result<(), ChannelError> {
        self.send_until(v, Some(d)).map_err(|e| e.error)
    }

    /// Sends, waiting at most `timeout` (forever: `None`); a send that fails hands its value
    /// back when it is still the sender's (see [`SendError`]).
    #[inline(never)]
    pub fn send_back(&self, v: T, timeout: Option<Duration>) -> Result<(), SendError<T>> {
        let r = self.send_until(v, timeout);
        std::hint::black_box(());
        r
    }

    /// Sends only if that needs no wait: a receiver waits, or there is room.
    pub fn try_send(&self, v: T) -> Result<(), ChannelError> {
        let c = &self.inner;
        c.users.note();
        if c.closed.get() {
            return Err(ChannelError::Closed);
        }
        self.offer(v).map_err(|_| ChannelError::WouldBlock)
    }

    /// Hands `v` to the first receiver waiting (woken for it) when nothing is buffered, or
    /// buffers it when there is room; gives it back otherwise.
    fn offer(&self, v: T) -> Result<(), T> {
        let c = &self.inner;
        if c.queued() == 0 {
            if let Some((_, to)) = wake_one(&c.receivers) {
                c.buf.borrow_mut().push_back(Queued { to, value: v });
                c.handed.set(c.handed.get() + 1);
                return Ok(());
            }
        }
        if c.queued() < c.cap {
            c.buf.borrow_mut().push_back(Queued { to: 0, value: v });
            return Ok(());
        }
        Err(v)
    }

    #[inline(never)]
    fn send_until(&self, v: T, timeout: Option<Duration>) -> Result<(), SendError<T>> {
        let c = &self.inner;
        c.users.note();
        // (A timeout too long for the clock, `Duration::MAX`, is no deadline: a wait for ever.)
        let deadline = timeout.and_then(|d| Instant::now().checked_add(d));
        let fail = |error, v| Err(SendError { error, value: v });
        if c.closed.get() {
            return fail(ChannelError::Closed, Some(v));
        }
        let v = match self.offer(v) {
            Ok(()) => return Ok(()),
            Err(v) => v,
        };
        if current_id() == 0 {
            return fail(ChannelError::WouldBlock, Some(v));
        }
        // (Any other timeout, however short, waits once: Tarantool's waits last at least a
        // turn of its loop.)
        if timeout == Some(Duration::ZERO) {
            return fail(ChannelError::Timeout, Some(v));
        }
        // A cancelled fiber does not start the wait (its value is dropped as it unwinds).
        sched::raise_cancel();
        // The value waits with the sender, where a receiver takes it; whatever ends the wait
        // otherwise (close, timeout, cancellation, a scheduler's drop unwinding the fiber)
        // takes it back first, so nobody receives what its sender was told was not sent.
        let ticket = c.senders.borrow_mut().push(v);
        let guard = TakeBack { ch: self, ticket };
        loop {
            let cancelled = sched::block(WaitOn::ChannelSend(c.id), deadline);
            if c.senders.borrow_mut().was_delivered(ticket) {
                // Sent, even if the fiber was cancelled meanwhile (Tarantool's rule: the
                // cancellation is raised at its next wait).
                std::mem::forget(guard);
                return Ok(());
            }
            if cancelled {
                // Cancelled while it waited: it tries once more without waiting, as
                // Tarantool's does (a receiver that came meanwhile, room made meanwhile);
                // then the cancellation is raised (its value dropped). (The guard finds
                // nothing left to take back.)
                let back = c.senders.borrow_mut().take_back(ticket);
                if let Some(v) = back {
                    if !c.closed.get() && self.offer(v).is_ok() {
                        return Ok(());
                    }
                }
                sched::raise_cancel();
            }
            let error = if sched::dropping() {
                ChannelError::WouldBlock
            } else if c.closed.get() {
                ChannelError::Closed
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                ChannelError::Timeout
            } else {
                // A plain wake-up (`Fiber::wakeup`): it waits on, in its place.
                continue;
            };
            std::mem::forget(guard);
            return fail(error, c.senders.borrow_mut().take_back(ticket));
        }
    }

    /// Receives, waiting while the channel is empty; `None` once it is closed and drained
    /// (and at once in a fiber its scheduler's drop is unwinding: nothing can come then).
    ///
    /// # Panics
    /// Outside a fiber, when it would wait (the channel is open and empty): the caller
    /// cannot wait, and `None` would say the channel is done when it is not. There,
    /// [`Channel::try_recv`] and [`Channel::recv_timeout`] say [`ChannelError::WouldBlock`].
    #[inline(never)]
    pub fn recv(&self) -> Option<T> {
        match self.recv_until(None) {
            Ok(v) => Some(v),
            Err(ChannelError::WouldBlock) if current_id() == 0 => recv_outside_a_fiber(),
            Err(_) => None,
        }
    }

    /// Receives, waiting at most `d`.
    pub fn recv_timeout(&self, d: Duration) -> Result<T, ChannelError> {
        self.recv_until(Some(d))
    }

    /// Receives only if a value is there now (buffered, or a waiting sender's).
    pub fn try_recv(&self) -> Result<T, ChannelError> {
        self.inner.users.note();
        match self.take() {
            Some(v) => Ok(v),
            None if self.inner.closed.get() => Err(ChannelError::Closed),
            None => Err(ChannelError::WouldBlock),
        }
    }

    /// Takes the first value the calling fiber may take: one handed to it, or one buffered
    /// (the first waiting sender's value then moves into the room it leaves, that sender
    /// woken, as Tarantool does), or, with nothing buffered, a waiting sender's (not after a
    /// close: those senders fail).
    fn take(&self) -> Option<T> {
        let c = &self.inner;
        let me = current_id();
        let q = {
            let mut buf = c.buf.borrow_mut();
            buf.iter()
                .position(|q| q.to == 0 || q.to == me)
                .and_then(|i| buf.remove(i))
        };
        if let Some(q) = q {
            if q.to != 0 {
                c.handed.set(c.handed.get() - 1);
            } else if !c.closed.get() && c.queued() < c.cap {
                let next = c.senders.borrow_mut().take_first();
                if let Some((v, (s, id))) = next {
                    c.buf.borrow_mut().push_back(Queued { to: 0, value: v });
                    sched::wake(s, id);
                }
            }
            return Some(q.value);
        }
        if c.closed.get() {
            return None;
        }
        let (v, (s, id)) = c.senders.borrow_mut().take_first()?;
        sched::wake(s, id);
        Some(v)
    }

    #[inline(never)]
    fn recv_until(&self, timeout: Option<Duration>) -> Result<T, ChannelError> {
        let c = &self.inner;
        c.users.note();
        let me = current_id();
        // (A timeout too long for the clock, `Duration::MAX`, is no deadline: a wait for ever.)
        let deadline = timeout.and_then(|d| Instant::now().checked_add(d));
        let mut waited = false;
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
            // (A timeout however short waits once: Tarantool's waits last at least a turn
            // of its loop.)
            let over = if waited {
                deadline.is_some_and(|d| Instant::now() >= d)
            } else {
                timeout == Some(Duration::ZERO)
            };
            if over {
                return Err(ChannelError::Timeout);
            }
            // A cancelled fiber does not start the wait.
            sched::raise_cancel();
            let waiting = enter(&c.receivers);
            let cancelled = sched::block(WaitOn::ChannelReceive(c.id), deadline);
            drop(waiting);
            waited = true;
            if cancelled {
                // A value handed to it is its own, even cancelled (Tarantool's rule: the
                // cancellation is raised at its next wait), and so is one it can take now
                // (Tarantool's cancelled receiver tries once more without waiting);
                // otherwise it unwinds now.
                if let Some(v) = self.take() {
                    return Ok(v);
                }
                sched::raise_cancel();
            }
            if sched::dropping() {
                // Its scheduler is being dropped: nothing can come any more.
                return Err(ChannelError::WouldBlock);
            }
        }
    }
}

#[cold]
#[inline(never)]
fn recv_outside_a_fiber() -> ! {
    panic!(
        "Channel::recv outside a fiber on an open, empty channel: it cannot wait there (use \
         try_recv, or recv from a fiber)"
    )
}

/// Takes a waiting sender's value back out of the channel when its wait ends by unwinding
/// (cancellation, its scheduler's drop): nobody will be told it was sent.
struct TakeBack<'a, T> {
    ch: &'a Channel<T>,
    ticket: u64,
}

impl<T> Drop for TakeBack<'_, T> {
    fn drop(&mut self) {
        let v = match self.ch.inner.senders.try_borrow_mut() {
            Ok(mut q) => q.take_back(self.ticket),
            Err(_) => None,
        };
        // Dropped outside the borrow: a value's destructor may use the channel.
        drop(v);
    }
}

/// Whether a queue holds a waiter that still waits and is not cancelled.
fn has_live_waiters(q: &RefCell<WaitQueue>) -> bool {
    let q = q.borrow();
    q.q.iter()
        .any(|((s, id), t)| q.live.contains(t) && !sched::is_cancelled_fiber(*s, *id))
}

/// A condition variable for fibers of one scheduler.
pub struct Cond {
    id: u64,
    waiters: RefCell<WaitQueue>,
    users: Rc<Users>,
}

impl Default for Cond {
    fn default() -> Self {
        Self::new()
    }
}

impl Cond {
    /// A new condition.
    pub fn new() -> Cond {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Cond {
            id,
            waiters: RefCell::default(),
            users: Users::new(id),
        }
    }

    /// Its id (as shown in what a fiber waits on).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Waits for a signal (or a [`crate::Fiber::wakeup`]). Outside a fiber it returns at once
    /// (nothing could signal meanwhile), as a spurious wake-up.
    #[inline(never)]
    pub fn wait(&self) {
        self.wait_until(None);
    }

    /// Waits at most `d`; returns false on timeout. A `d` too long for the clock
    /// (`Duration::MAX`) waits until signalled.
    pub fn wait_timeout(&self, d: Duration) -> bool {
        self.wait_until(Instant::now().checked_add(d))
    }

    #[inline(never)]
    fn wait_until(&self, deadline: Option<Instant>) -> bool {
        self.users.note();
        let me = current_id();
        if me == 0 {
            return false;
        }
        let waiting = enter(&self.waiters);
        if sched::block(WaitOn::Condition(self.id), deadline) {
            sched::raise_cancel();
        }
        let still_waiting = self.waiters.borrow().is_queued(waiting.ticket);
        drop(waiting);
        // (Its scheduler being dropped, the wait ends at once, unsignalled: as a timeout.)
        !(still_waiting && (deadline.is_some_and(|d| Instant::now() >= d) || sched::dropping()))
    }

    /// Wakes one waiter.
    pub fn signal(&self) {
        self.users.note();
        wake_one(&self.waiters);
    }

    /// Wakes every waiter.
    pub fn broadcast(&self) {
        self.users.note();
        wake_all(&self.waiters);
    }
}
