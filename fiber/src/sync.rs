//! Channels and condition variables for fibers of one scheduler. Blocking operations suspend
//! the calling fiber (recorded as waiting on the channel or condition, for info and dumps);
//! other fibers run meanwhile.
//!
//! What a channel guarantees, whatever ends an operation (a value, a timeout, `close`, the
//! fiber's cancellation unwinding out of its wait):
//! * a value is delivered at most once, and a send reports success exactly when its value
//!   was queued (buffered channel), or taken by a receiver or handed to one that was waiting
//!   for it (a discarding close keeps what was handed over); a value handed to a waiting
//!   receiver is that receiver's — a receive that comes later, before it runs, does not take
//!   it — and takes no room in the channel (as Tarantool hands it over directly); a
//!   rendezvous send that fails takes its value back out of the channel
//!   ([`Channel::send_back`] hands it to the caller; otherwise it is dropped), so a value
//!   never stays queued for a sender that was told it was not sent;
//! * a receive that took a value returns it;
//! * a wake-up meant for a fiber that leaves by unwinding is passed on to the next waiter,
//!   so no value sits in a channel while a receiver sleeps.

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

/// A value in a channel.
struct Queued<T> {
    /// Its ticket (increasing along the queue).
    ticket: u64,
    /// The receiver it was handed to (it was waiting for it), which alone takes it; 0: not
    /// handed, the next receive takes it. A discarding close keeps a handed value.
    to: FiberId,
    value: T,
}

struct ChanInner<T> {
    id: u64,
    cap: usize,
    /// Queued values, in the order they came.
    buf: RefCell<VecDeque<Queued<T>>>,
    /// How many of them were handed to a receiver (they take no room: the rest count
    /// against the capacity).
    handed: Cell<usize>,
    closed: Cell<bool>,
    /// The highest ticket a receiver took. Read for a rendezvous channel only, whose queue
    /// holds one value at a time: every ticket up to it was taken, taken back by its sender,
    /// or discarded (a value handed to a receiver may leave after a later one on a buffered
    /// channel).
    taken: Cell<u64>,
    pushed: Cell<u64>,
    receivers: RefCell<WaitQueue>,
    senders: RefCell<WaitQueue>,
    users: Rc<Users>,
}

impl<T> ChanInner<T> {
    /// Values queued and not handed to a receiver (they count against the capacity).
    fn queued(&self) -> usize {
        self.buf.borrow().len() - self.handed.get()
    }

    /// Counts `q` out of the handed values if it was one (it left the queue).
    fn unhand(&self, q: &Queued<T>) {
        if q.to != 0 {
            self.handed.set(self.handed.get() - 1);
        }
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
            taken: Cell::new(0),
            pushed: Cell::new(0),
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

    /// Values buffered (not those handed to a waiting receiver, which are its already).
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

    /// Whether it is full (a send would wait).
    pub fn is_full(&self) -> bool {
        self.len() >= self.inner.cap.max(1)
    }

    /// Whether it was closed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.get()
    }

    /// Closes it: blocked senders and receivers wake up; buffered values can still be read
    /// (a blocked rendezvous sender takes its value back and fails).
    pub fn close(&self) {
        self.inner.users.note();
        self.inner.closed.set(true);
        wake_all(&self.inner.receivers);
        wake_all(&self.inner.senders);
    }

    /// Closes it and drops every queued value (Tarantool's close before 2.10): blocked
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

    /// Whether a fiber is blocked sending (and not cancelled).
    pub fn has_writers(&self) -> bool {
        has_live_waiters(&self.inner.senders)
    }

    /// Sends, waiting while the channel is full.
    #[inline(never)]
    pub fn send(&self, v: T) -> Result<(), ChannelError> {
        self.send_until(v, None).map_err(|e| e.error)
    }

    /// Sends, waiting at most `d`.
    pub fn send_timeout(&self, v: T, d: Duration) -> Result<(), ChannelError> {
        self.send_until(v, Some(Instant::now() + d))
            .map_err(|e| e.error)
    }

    /// Sends, waiting at most `timeout` (forever: `None`); a send that fails hands its value
    /// back when it is still the sender's (see [`SendError`]).
    #[inline(never)]
    pub fn send_back(&self, v: T, timeout: Option<Duration>) -> Result<(), SendError<T>> {
        let r = self.send_until(v, timeout.map(|d| Instant::now() + d));
        std::hint::black_box(());
        r
    }

    /// Sends only if there is room now.
    pub fn try_send(&self, v: T) -> Result<(), ChannelError> {
        let c = &self.inner;
        c.users.note();
        if c.closed.get() {
            return Err(ChannelError::Closed);
        }
        if c.queued() >= c.cap.max(1) || (c.cap == 0 && !self.has_readers()) {
            return Err(ChannelError::WouldBlock);
        }
        let _ = self.push(v);
        Ok(())
    }

    /// Queues `v`, handed to the first receiver waiting, if any (woken for it); its ticket,
    /// and whether it was handed.
    fn push(&self, v: T) -> (u64, bool) {
        let c = &self.inner;
        let ticket = c.pushed.get() + 1;
        c.pushed.set(ticket);
        c.buf.borrow_mut().push_back(Queued {
            ticket,
            to: 0,
            value: v,
        });
        let woke = wake_one(&c.receivers);
        if let Some((_, to)) = woke {
            if let Some(last) = c.buf.borrow_mut().back_mut() {
                last.to = to;
                c.handed.set(c.handed.get() + 1);
            }
        }
        (ticket, woke.is_some())
    }

    /// Takes the value with `ticket` back out of the queue, if it is still there (the room
    /// it leaves goes to the next waiting sender).
    fn withdraw(&self, ticket: u64) -> Option<T> {
        let mut buf = self.inner.buf.borrow_mut();
        let i = buf.binary_search_by_key(&ticket, |q| q.ticket).ok()?;
        let q = buf.remove(i)?;
        drop(buf);
        self.inner.unhand(&q);
        wake_one(&self.inner.senders);
        Some(q.value)
    }

    #[inline(never)]
    fn send_until(&self, v: T, deadline: Option<Instant>) -> Result<(), SendError<T>> {
        let c = &self.inner;
        c.users.note();
        let me = current_id();
        let fail = |error, v| Err(SendError { error, value: v });
        loop {
            if c.closed.get() {
                return fail(ChannelError::Closed, Some(v));
            }
            if c.queued() < c.cap.max(1) {
                break;
            }
            // (Unwinding out of this wait drops `v`: it was never queued.)
            if let Err(e) = self.wait_as_sender(me, deadline) {
                return fail(e, Some(v));
            }
        }
        let (ticket, woke) = self.push(v);
        if c.cap == 0 && !woke {
            // Rendezvous with nobody waiting: wait until our value is taken. Whatever ends
            // the wait otherwise (close, timeout, cancellation unwinding) takes it back out
            // first. (With a receiver waiting, the value is handed to it, as Tarantool does:
            // even a zero timeout succeeds; were that receiver cancelled before it runs, the
            // wake-up and the value pass to the next receiver.)
            let guard = Unqueue { ch: self, ticket };
            loop {
                if c.taken.get() >= ticket {
                    std::mem::forget(guard);
                    return Ok(());
                }
                let err = if c.closed.get() {
                    Some(ChannelError::Closed)
                } else {
                    self.wait_as_sender(me, deadline).err()
                };
                if let Some(e) = err {
                    std::mem::forget(guard);
                    if c.taken.get() >= ticket {
                        return Ok(());
                    }
                    return fail(e, self.withdraw(ticket));
                }
            }
        }
        // A sender woken for room that leaves by unwinding passes the room on (see
        // `wait_as_sender`); one that queued passes nothing.
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
        // Declared first, dropped last: an unwinding waiter leaves the queue before it wakes
        // the next one.
        let pass_on = PassOn {
            ch: self,
            senders: true,
        };
        let waiting = enter(&c.senders);
        sched::block(WaitOn::ChannelSend(c.id), deadline);
        drop(waiting);
        std::mem::forget(pass_on);
        if sched::dropping() {
            // Its scheduler is being dropped: no room can come any more.
            return Err(ChannelError::WouldBlock);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) && !c.closed.get() {
            // A wake-up for room may have come with the timeout: pass it on.
            if c.queued() < c.cap.max(1) {
                wake_one(&c.senders);
            }
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
        self.inner.users.note();
        match self.take() {
            Some(v) => Ok(v),
            None if self.inner.closed.get() => Err(ChannelError::Closed),
            None => Err(ChannelError::WouldBlock),
        }
    }

    /// Takes the first value the calling fiber may take: one handed to it, or one handed
    /// to nobody.
    fn take(&self) -> Option<T> {
        let c = &self.inner;
        let me = current_id();
        let q = {
            let mut buf = c.buf.borrow_mut();
            let i = buf.iter().position(|q| q.to == 0 || q.to == me)?;
            buf.remove(i)?
        };
        c.unhand(&q);
        c.taken.set(c.taken.get().max(q.ticket));
        if c.cap == 0 {
            wake_all(&c.senders);
        } else {
            wake_one(&c.senders);
        }
        Some(q.value)
    }

    #[inline(never)]
    fn recv_until(&self, deadline: Option<Instant>) -> Result<T, ChannelError> {
        let c = &self.inner;
        c.users.note();
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
            // Declared first, dropped last (see `wait_as_sender`).
            let pass_on = PassOn {
                ch: self,
                senders: false,
            };
            let waiting = enter(&c.receivers);
            sched::block(WaitOn::ChannelReceive(c.id), deadline);
            drop(waiting);
            std::mem::forget(pass_on);
            if sched::dropping() {
                // Its scheduler is being dropped: nothing can come any more.
                return Err(ChannelError::WouldBlock);
            }
        }
    }
}

/// Takes a rendezvous sender's value back out of the channel when its wait ends by
/// unwinding (cancellation): nobody will be told it was sent.
struct Unqueue<'a, T> {
    ch: &'a Channel<T>,
    ticket: u64,
}

impl<T> Drop for Unqueue<'_, T> {
    fn drop(&mut self) {
        if let Ok(mut buf) = self.ch.inner.buf.try_borrow_mut() {
            if let Ok(i) = buf.binary_search_by_key(&self.ticket, |q| q.ticket) {
                let q = buf.remove(i);
                drop(buf);
                if let Some(q) = &q {
                    self.ch.inner.unhand(q);
                }
                wake_one(&self.ch.inner.senders);
                drop(q);
            }
        }
    }
}

/// Passes a wake-up on when a waiter leaves by unwinding (cancellation): a receiver woken
/// for a value (or a sender woken for room) that never uses it must not leave the next
/// waiter asleep.
struct PassOn<'a, T> {
    ch: &'a Channel<T>,
    senders: bool,
}

impl<T> Drop for PassOn<'_, T> {
    fn drop(&mut self) {
        let c = &self.ch.inner;
        if !self.senders {
            // Values handed to this receiver go to the next one waiting, or to whoever
            // receives next.
            let me = current_id();
            let mine: Vec<u64> = match c.buf.try_borrow() {
                Ok(buf) => buf
                    .iter()
                    .filter(|q| me != 0 && q.to == me)
                    .map(|q| q.ticket)
                    .collect(),
                Err(_) => return,
            };
            for ticket in mine {
                let to = wake_one(&c.receivers).map_or(0, |(_, id)| id);
                let Ok(mut buf) = c.buf.try_borrow_mut() else {
                    return;
                };
                if let Some(q) = buf.iter_mut().find(|q| q.ticket == ticket) {
                    q.to = to;
                    if to == 0 {
                        c.handed.set(c.handed.get() - 1);
                    }
                }
            }
        }
        let Ok(buf) = c.buf.try_borrow() else {
            return;
        };
        let has_value = buf.iter().any(|q| q.to == 0);
        drop(buf);
        let has_room = c.queued() < c.cap.max(1);
        if self.senders && has_room {
            wake_one(&c.senders);
        } else if !self.senders && has_value {
            wake_one(&c.receivers);
        }
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
        self.users.note();
        let me = current_id();
        if me == 0 {
            return false;
        }
        let waiting = enter(&self.waiters);
        sched::block(WaitOn::Condition(self.id), deadline);
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
