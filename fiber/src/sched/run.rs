//! The run loop: running ready fibers in turns, timers, resuming and the nested start,
//! waking fibers from outside, and the per-turn accounting behind `fiber.top()`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use corosensei::CoroutineResult;

use super::{
    current_ctx, with_sched, Clocked, Co, FiberCore, Inner, Ready, RunError, Slot, TopRow, TopStat,
    Yield, CURRENT, ON_THREAD, SLOT_POOL_MAX,
};
use crate::task::{FiberId, Status};

/// Moves a finished coroutine out of its box, and gives the box back for the next fiber's.
fn unbox(b: Box<Co>) -> (Co, Box<std::mem::MaybeUninit<Co>>) {
    let p = Box::into_raw(b);
    // SAFETY: `p` comes from `Box::into_raw` of an initialized `Co`: it is read (moved out)
    // once, and its allocation is owned again as a `MaybeUninit<Co>` (same layout), whose
    // drop frees it without dropping the moved value.
    unsafe {
        (
            p.read(),
            Box::from_raw(p.cast::<std::mem::MaybeUninit<Co>>()),
        )
    }
}

impl Inner {
    /// The loop of `run` and `block_on`. Compiled on its own, whatever its caller holds: the
    /// yield's cost depends on how the loop around the inlined resume is laid out, and inlined
    /// into `run` beside one more guard it was a third slower (40 -> 57 ns a yield).
    #[inline(never)]
    pub(super) fn run_loop(&self, mut done: impl FnMut() -> bool) -> Result<(), RunError> {
        // Time between runs is nobody's: the first fiber's share starts now.
        self.last_tick.set(crate::clock::ticks());
        loop {
            if self.turn_left.get() == 0 {
                // Between turns (nothing borrowed): what another thread asked of this one's
                // (a request made while it idled woke it up, and it comes here first).
                self.serve_asked();
                // Untimed runs leave the counter as it was: while a timer waits, it is read
                // once a turn (timers are looked at between turns, as Tarantool's event
                // loop does at each iteration).
                if !self.is_clocked() && self.timer_gate.get() != u64::MAX {
                    self.last_tick.set(crate::clock::ticks());
                }
            }
            if self.last_tick.get() >= self.timer_gate.get() {
                self.fire_timers();
            }
            let next = {
                let mut ready = self.ready.borrow_mut();
                let mut left = self.turn_left.get();
                if left == 0 && self.end_after_turn.replace(false) {
                    return Ok(());
                }
                if left == 0 {
                    // A new turn, of the fibers ready now.
                    left = ready.len();
                    self.turn.set(self.turn.get().wrapping_add(1));
                    if self.top_on.get() {
                        self.close_top_turn();
                    }
                }
                let next = ready.pop_front();
                self.turn_left
                    .set(if next.is_some() { left - 1 } else { 0 });
                next
            };
            if let Some(r) = next {
                self.resume(r);
                continue;
            }
            // Nothing ready: the timers due now, whatever the gate says (it is compared with
            // the counter read last — at the last switch, or the turn's start — which may be
            // a while ago).
            if self.fire_timers() {
                continue;
            }
            if done() {
                return Ok(());
            }
            let next_deadline = self.next_deadline();
            match next_deadline {
                Some(when) => {
                    let now = Instant::now();
                    if when > now {
                        self.shared.idle.store(true, Ordering::Relaxed);
                        std::thread::park_timeout(when - now);
                        self.shared.idle.store(false, Ordering::Relaxed);
                        self.last_tick.set(crate::clock::ticks());
                    }
                }
                None => {
                    if self.slots.borrow().is_empty() {
                        return Ok(());
                    }
                    // What another thread asked meanwhile (a cancel that wakes a fiber) is
                    // served before this is called a deadlock.
                    if self.shared.on_thread.asked.load(Ordering::Acquire) {
                        self.serve_asked_now();
                        continue;
                    }
                    let mut fibers: Vec<FiberId> = self.slots.borrow().keys().copied().collect();
                    fibers.sort_unstable();
                    return Err(RunError::Deadlock { fibers });
                }
            }
        }
    }

    /// The start of the run about to begin, as published for the stall watchdog: the last
    /// accounting point while runs are timed, 0 (not known) otherwise.
    #[inline(always)]
    fn run_start(&self) -> u64 {
        if self.is_clocked() {
            self.last_tick.get()
        } else {
            0
        }
    }

    /// Serves what another thread asked of this scheduler's (see `Hooks::asked`): one
    /// relaxed load when nothing was.
    #[inline]
    fn serve_asked(&self) {
        if self.shared.on_thread.asked.load(Ordering::Acquire) {
            self.serve_asked_now();
        }
    }

    #[cold]
    #[inline(never)]
    fn serve_asked_now(&self) {
        self.shared.on_thread.asked.store(false, Ordering::Relaxed);
        // Fibers cancelled from another thread: woken to unwind (see `Fiber::cancel`).
        let cancels = std::mem::take(
            &mut *self
                .shared
                .on_thread
                .cancels
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for fid in cancels {
            self.make_ready_if(fid, false);
        }
        (self.hooks.asked)(&self.shared);
    }

    /// With top on, closes every row's figures for the turn that ends (as Tarantool does at
    /// each loop iteration).
    #[cold]
    pub(super) fn close_top_turn(&self) {
        let now = crate::clock::ticks();
        let total = now.wrapping_sub(self.turn_start.get());
        self.turn_start.set(now);
        let mut ran = 0u64;
        for slot in self.slots.borrow_mut().values_mut() {
            let ticks = slot.ctx.shared.cpu_ticks.load(Ordering::Relaxed);
            let delta = ticks.wrapping_sub(slot.top.last);
            slot.top.last = ticks;
            slot.top.close_turn(delta);
            ran = ran.wrapping_add(delta);
        }
        self.top_turns.set(self.top_turns.get().wrapping_add(1));
        let mut sched = self.top_sched.get();
        let own = total.saturating_sub(ran);
        sched.last = sched.last.wrapping_add(own);
        sched.close_turn(own);
        self.top_sched.set(sched);
        let mut all = self.top_total.get();
        all.close_turn(ran.wrapping_add(own));
        self.top_total.set(all);
    }

    pub(super) fn top_row(&self, t: &TopStat) -> TopRow {
        let all = self.top_total.get();
        let share = |x: f64, of: f64| if of > 0.0 { x / of * 100.0 } else { 0.0 };
        TopRow {
            average: share(t.acc, all.acc),
            instant: share(t.prev as f64, all.prev as f64),
            time: crate::clock::to_duration(t.last.wrapping_sub(t.base)),
        }
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let mut timers = self.timers.borrow_mut();
        let slots = self.slots.borrow();
        // Drop stale entries (fiber gone or woken early) from the top.
        while let Some(std::cmp::Reverse((_, seq, fid))) = timers.peek() {
            match slots.get(fid) {
                Some(s) if s.timer_seq == *seq => break,
                _ => {
                    timers.pop();
                }
            }
        }
        timers.peek().map(|std::cmp::Reverse((when, _, _))| *when)
    }

    /// Makes the fibers whose timers are due ready, and sets the gate of the next check.
    /// Returns whether any was made ready.
    #[inline(never)]
    pub(super) fn fire_timers(&self) -> bool {
        if self.timers.borrow().is_empty() {
            self.timer_gate.set(u64::MAX);
            return false;
        }
        let (now, now_ticks) = (Instant::now(), crate::clock::ticks());
        let mut fired = false;
        loop {
            let top = {
                let timers = self.timers.borrow();
                match timers.peek() {
                    Some(std::cmp::Reverse((when, seq, fid))) if *when <= now => Some((*seq, *fid)),
                    _ => None,
                }
            };
            let Some((seq, fid)) = top else { break };
            self.timers.borrow_mut().pop();
            let due = self
                .slots
                .borrow()
                .get(&fid)
                .is_some_and(|s| s.timer_seq == seq);
            if due {
                fired |= self.make_ready_if(fid, false);
            }
        }
        self.set_timer_gate(now, now_ticks);
        fired
    }

    /// Sets the gate to a little before the first timer is due (`now` read with the counter
    /// at `now_ticks`): a sixteenth of the wait early, so that a tick rate measured a little
    /// off (or counters a little apart between cores) never makes a timer late, and at most
    /// about a second ahead, so that a long sleep is looked at again now and then whatever
    /// the counter does.
    fn set_timer_gate(&self, now: Instant, now_ticks: u64) {
        let first = self
            .timers
            .borrow()
            .peek()
            .map(|std::cmp::Reverse((when, _, _))| *when);
        let gate = match (first, crate::clock::Rate::now_without_wait()) {
            (None, _) => u64::MAX,
            // The clock's rate is not known yet (its first 2 ms): at every iteration.
            (Some(_), None) => 0,
            (Some(when), Some(rate)) => {
                let wait = rate.ticks_in(when.saturating_duration_since(now));
                let wait = (wait - wait / 16).min(1 << 31);
                now_ticks.saturating_add(wait)
            }
        };
        self.timer_gate.set(gate);
    }

    pub(crate) fn make_ready(&self, fid: FiberId) {
        self.make_ready_if(fid, false);
    }

    /// Makes `fid` ready, unless `live_only` and it was cancelled (its cancellation woke it
    /// already). Returns whether it is a fiber here that was made (or was) ready.
    pub(super) fn make_ready_if(&self, fid: FiberId, live_only: bool) -> bool {
        let mut slots = self.slots.borrow_mut();
        let Some(slot) = slots.get_mut(&fid) else {
            return false;
        };
        if live_only && slot.ctx.shared.cancelled.load(Ordering::Relaxed) {
            return false;
        }
        slot.timer_seq = 0;
        if !slot.ctx.queued.get() && fid != self.current.get() {
            slot.ctx.queued.set(true);
            slot.ctx.shared.set_status(Status::Ready);
            let slot = std::ptr::NonNull::from(&mut **slot);
            self.ready.borrow_mut().push_back(Ready { fid, slot });
        }
        true
    }

    /// A wake-up of the running fiber `fid` (Tarantool puts it in the ready list): its next
    /// suspension does not wait (see `run_co`). False when `fid` is not the one running.
    pub(super) fn wake_running(&self, fid: FiberId) -> bool {
        if fid != self.current.get() {
            return false;
        }
        match self.slots.borrow().get(&fid) {
            Some(slot) => {
                slot.ctx.woken.set(true);
                true
            }
            None => false,
        }
    }

    pub(super) fn add_timer(&self, fid: FiberId, when: Instant) {
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        if let Some(s) = self.slots.borrow_mut().get_mut(&fid) {
            s.timer_seq = seq;
        }
        let mut timers = self.timers.borrow_mut();
        // (The heap's growth is the scheduler's own, not the sleeping fiber's.)
        fibertrace_core::heap::outside_fibers(|| timers.push(std::cmp::Reverse((when, seq, fid))));
        // Looked at on the next loop iteration, which sets the gate from the first timer.
        self.timer_gate.set(0);
        // A fiber woken early (or cancelled, or gone) leaves its timer in the heap until the
        // timer's time comes: a fiber that sleeps an hour and is cancelled at once, a million
        // times, would leave a million. Each fiber has at most one live timer, so past twice
        // the number of fibers the stale ones are dropped (amortized O(1) a timer).
        let slots = self.slots.borrow();
        if timers.len() > 2 * slots.len() + 64 {
            timers.retain(|std::cmp::Reverse((_, seq, fid))| {
                slots.get(fid).is_some_and(|s| s.timer_seq == *seq)
            });
        }
    }

    /// Takes a ready fiber's coroutine out of its slot to resume it (`None`: running). The
    /// fiber waiting in `yield_in_place` is never passed here: it is not in the queue (its
    /// place is `Inner::ahead`), and its run goes on from its own frame.
    fn take_co(&self, r: Ready) -> Option<Box<Co>> {
        // `r` is an entry of the ready queue (just taken out of it, or about to be, in
        // `run_nested`). No reference to its slot is live: the map is not borrowed, and the
        // fiber is suspended (its frames use none before it runs again).
        let p = r.slot.as_ptr();
        // SAFETY: a queued entry's slot is in the map and holds fiber `r.fid` (the invariant
        // of `Ready`); only its `ctx.queued` and `co` fields are touched.
        unsafe {
            let ctx: &FiberCore = &(*p).ctx;
            debug_assert_eq!(ctx.shared.id, r.fid);
            let co = (*p).co.take()?;
            (*p).ctx.queued.set(false);
            Some(co)
        }
    }

    /// Resumes ready fiber `r` from the scheduler loop.
    ///
    /// Inlined into the loop, as `run_co` is: every return executed right after a stack
    /// switch is mispredicted (the CPU's return-address stack holds the other stack's
    /// calls), so each function left between the switch back and the next resume cost a
    /// pipeline flush — two of them were a fifth of a yield (51 -> 41 ns).
    #[inline(always)]
    pub(super) fn resume(&self, r: Ready) {
        let Some(co) = self.take_co(r) else {
            return;
        };
        self.run_co(r, co);
        self.current.set(0);
    }

    /// Runs a fiber's coroutine until it suspends or returns, with the bookkeeping of a
    /// resume (run state, status, switch count, CPU time, sampler), then puts it back in its
    /// slot or, when it returned, frees it. Leaves the sampler showing no fiber running and
    /// `CURRENT` as it found it; `self.current` is the caller's to restore.
    #[inline(always)]
    pub(super) fn run_co(&self, this: Ready, mut co: Box<Co>) {
        let fid = this.fid;
        let slot_ptr = this.slot.as_ptr();
        // SAFETY: the slot is boxed in the map, where it stays until the fiber finishes
        // (removed below, after the coroutine returned); see `Ready`.
        let ctx_ptr: *const FiberCore = unsafe { &raw const (*slot_ptr).ctx };
        // SAFETY: as above: the context lives in the slot.
        let ctx = unsafe { &*ctx_ptr };
        let shared = &ctx.shared;
        shared.run.begin_resume(self.unlocked);
        shared.set_status(Status::Running);
        if shared.created_at_start && shared.csw.load(Ordering::Relaxed) == 0 {
            // Its first run starts now: that is its creation time. (While runs are timed,
            // at the last accounting point, read just before: by a nested start, or at the
            // end of the last run.)
            let t = if self.is_clocked() {
                self.last_tick.get()
            } else {
                crate::clock::ticks()
            };
            shared.created.store(t, Ordering::Relaxed);
            shared.since.store(t, Ordering::Relaxed);
        }
        // Counted before it runs: the count differs from the one of its last suspension
        // (trace caches are keyed by it) as soon as it can suspend again.
        shared.add_switch();
        self.current.set(fid);
        let prev = CURRENT.with(|c| c.replace(ctx_ptr));
        let _stack = fibertrace_core::enter_stack(shared.stack);
        let prev_owner = fibertrace_core::heap::switch_to(Some(&shared.heap));
        crate::running::set_running(&self.shared.on_thread, shared, self.run_start());
        let r = co.resume(());
        crate::running::set_idle(&self.shared.on_thread);
        fibertrace_core::heap::restore(prev_owner);
        if self.is_clocked() {
            // Fibers this one started at once ran inside the resume and moved `last_tick`:
            // the time since is this fiber's.
            let t1 = crate::clock::ticks();
            shared.add_ticks(t1.wrapping_sub(self.last_tick.get()));
            self.last_tick.set(t1);
        }
        CURRENT.with(|c| c.set(prev));
        match r {
            CoroutineResult::Yield(y) => {
                // SAFETY: a fiber that suspended is still in the map (see `Ready`), and no
                // reference to its `co` field is live (it was taken out before the resume).
                unsafe { (*slot_ptr).co = Some(co) };
                // Woken while it ran: a wait it began ends at once, as a wake-up now would
                // end it (its timer, if any, is left to lapse).
                let woken = ctx.woken.replace(false);
                if (y == Yield::Ready || woken) && !ctx.queued.get() {
                    if y != Yield::Ready {
                        // SAFETY: as above; only its timer's sequence is touched.
                        unsafe { (*slot_ptr).timer_seq = 0 };
                        shared.set_status(Status::Ready);
                    }
                    ctx.queued.set(true);
                    self.ready.borrow_mut().push_back(this);
                }
            }
            CoroutineResult::Return(()) => {
                shared.run.mark_dead();
                shared.set_status(Status::Dead);
                // What it still holds is "held by exited fiber N" from here on.
                shared.heap.close();
                // The runtime's own bookkeeping below (the registry's free list grows, say)
                // is nobody's heap: after a nested run (`fiber.create`) it was charged to
                // the fiber that started this one, and a script that kept nothing was
                // listed as holding 16 bytes at exit.
                let _outside = fibertrace_core::heap::OutsideFibers::enter();
                let slot = self.slots.borrow_mut().remove(&fid);
                if let Some(slot) = &slot {
                    self.shared
                        .fibers
                        .remove(&mut self.reg.borrow_mut(), slot.reg, fid);
                }
                let (co, spare) = unbox(co);
                let stack = co.into_stack().into_inner();
                self.pool.borrow_mut().give(shared.stack_size, stack);
                if let Some(mut slot) = slot {
                    for &j in &slot.joiners {
                        self.make_ready(j);
                    }
                    // `ctx` and `shared` are not used past this point.
                    let mut free = self.free_slots.borrow_mut();
                    if free.len() < SLOT_POOL_MAX {
                        slot.joiners.clear();
                        slot.spare = Some(spare);
                        free.push(slot);
                    }
                }
            }
        }
    }

    /// Runs ready fiber `target` now, inside the running fiber `me` (as Tarantool's
    /// `fiber_call` does), until it suspends or finishes; then `me` goes on. Two switches
    /// instead of four through the scheduler, in the same order: `target` first, `me` right
    /// after it. `me` counts as suspended meanwhile (its registers are recorded here, so
    /// inspectors walk it like any suspended fiber) and as ready: a wake-up of it is a no-op,
    /// as when it waited in the ready queue. Returns false (and does nothing) when `target`
    /// is not waiting in the ready queue.
    #[inline(never)]
    pub(super) fn run_nested(&self, me: &FiberCore, target: FiberId) -> bool {
        // Searched from the back, where a fiber just spawned is.
        let pos = self.ready.borrow().iter().rposition(|x| x.fid == target);
        let Some(pos) = pos else {
            return false;
        };
        let r = self.ready.borrow()[pos];
        // A fiber in the ready queue is suspended: its coroutine is in its slot (if not, it
        // is left where it is).
        let Some(co) = self.take_co(r) else {
            return false;
        };
        self.ready.borrow_mut().remove(pos);
        // (Inside a yield served in place, whose fiber waits behind the fibers ahead of it.)
        let ahead = self.ahead.get();
        if pos < ahead {
            self.ahead.set(ahead - 1);
        }
        me.queued.set(true);
        // (Recorded here, not in `leave`: the registers are this frame's.)
        me.shared.record_suspension();
        self.leave(me);
        self.nested.set(self.nested.get() + 1);
        self.run_co(r, co);
        self.nested.set(self.nested.get() - 1);
        self.go_on(me);
        true
    }

    /// The running fiber `me`, its registers recorded by the caller, lets others run inside
    /// its switch: it is published suspended, its share of the CPU ends, and no fiber runs
    /// for the sampler until the next one begins.
    #[inline(always)]
    fn leave(&self, me: &FiberCore) {
        let shared = &me.shared;
        shared.run.publish_suspended();
        if self.is_clocked() {
            // `me`'s share of the CPU ends here.
            let t = crate::clock::ticks();
            shared.add_ticks(t.wrapping_sub(self.last_tick.get()));
            self.last_tick.set(t);
        }
        crate::running::set_idle(&self.shared.on_thread);
    }

    /// Back in `me` after [`Inner::leave`] (out of the ready queue): its run goes on, a new
    /// run for the sampler and the stall watchdog, from the end of the last nested one.
    #[inline(always)]
    fn go_on(&self, me: &FiberCore) {
        let shared = &me.shared;
        me.queued.set(false);
        self.current.set(shared.id);
        shared.run.begin_resume(self.unlocked);
        shared.set_status(Status::Running);
        shared.add_switch();
        crate::running::set_running(&self.shared.on_thread, shared, self.run_start());
    }
}

impl Inner {
    /// A yield of the running fiber `me` (`yield_now`) served inside its own switch: `me`
    /// takes its place at the back of the ready queue, as at a yield to the loop (a place
    /// counted, not an entry: see `Inner::ahead`), and the fibers ahead of it run from here,
    /// each inside this switch (as `run_nested` runs a fiber it starts), until none is
    /// ahead; then its run goes on. The order is the loop's, but a
    /// fiber that yields to the next one ready costs one stack switch instead of two (to
    /// the loop, then to the next), and two fibers that pass the turn to each other switch
    /// straight from one to the other.
    ///
    /// Only for a fiber the loop resumed itself (none runs inside another's switch), and
    /// only for what the loop would do between two runs without looking elsewhere: a new
    /// turn is begun here only when no other thread asked for anything, no timer is due,
    /// `fiber.top` is off and the loop was not asked to end. Otherwise `me` suspends to the
    /// loop from here (still queued, at its place), which does the rest. Returns false at
    /// once, having done nothing, when `me` cannot be served here: the caller then
    /// suspends to the loop itself. True when `me` runs again.
    ///
    /// While others run, `me` counts as suspended (its registers are recorded here, so that
    /// inspectors walk it as any suspended fiber) and as ready (queued).
    #[inline(never)]
    pub(super) fn yield_in_place(&self, me: &FiberCore) -> bool {
        let shared = &me.shared;
        if me.dropping.get() || shared.sched != self.shared.id {
            return false;
        }
        if self.nested.get() != 0 {
            // Run inside another's switch: back to it, as `suspend_current` goes (here, so
            // that this switch leaves from the same calls as the one that resumed it).
            shared.record_suspension();
            park_ready(me);
            return true;
        }
        let me_id = shared.id;
        me.woken.set(false);
        // Queued, but not in the queue: its place is the count of fibers ahead of it (those
        // ready now), which run first; those that re-queue go to the back, behind it, as
        // they would behind it in the queue. One push and one pop less per yield.
        me.queued.set(true);
        self.ahead.set(self.ready.borrow().len());
        shared.record_suspension();
        self.leave(me);
        self.nested.set(1);
        loop {
            if self.turn_left.get() == 0 {
                if self.shared.on_thread.asked.load(Ordering::Acquire)
                    || self.end_after_turn.get()
                    || self.top_on.get()
                {
                    break;
                }
                if !self.is_clocked() && self.timer_gate.get() != u64::MAX {
                    self.last_tick.set(crate::clock::ticks());
                }
                // (Timers due: the loop fires them before it begins the turn, which then has
                // the fibers they woke.)
                if self.last_tick.get() >= self.timer_gate.get() {
                    break;
                }
                // A new turn, of the fibers ready now (`me` among them, at its place), as the
                // loop begins one.
                self.turn_left.set(self.ready.borrow().len() + 1);
                self.turn.set(self.turn.get().wrapping_add(1));
            } else if self.last_tick.get() >= self.timer_gate.get() {
                break;
            }
            let ahead = self.ahead.get();
            if ahead == 0 {
                // Its turn: its run goes on.
                self.turn_left.set(self.turn_left.get() - 1);
                self.nested.set(0);
                self.go_on(me);
                return true;
            }
            let Some(r) = self.ready.borrow_mut().pop_front() else {
                // (`ahead` never counts more fibers than the queue holds; not reached.)
                break;
            };
            self.ahead.set(ahead - 1);
            self.turn_left.set(self.turn_left.get() - 1);
            if let Some(co) = self.take_co(r) {
                self.run_co(r, co);
            }
            self.current.set(me_id);
        }
        // The loop's work: `me` takes its place in the queue (it stays queued, so it is not
        // queued twice) and suspends to the loop from here (its recorded registers, in this
        // frame, stay right while it waits).
        // `me` is the `ctx` field of its boxed slot: `CURRENT`, where the caller got it, is
        // only ever set to a slot's context (`run_co`, and the scheduler's drop, which never
        // comes here: `dropping`). Its slot's box starts that field's offset before it.
        let slot = (me as *const FiberCore)
            .cast::<u8>()
            .wrapping_sub(std::mem::offset_of!(Slot, ctx))
            .cast::<Slot>()
            .cast_mut();
        // SAFETY: the start of a live box (above), not null.
        let slot = unsafe { std::ptr::NonNull::new_unchecked(slot) };
        {
            let mut ready = self.ready.borrow_mut();
            let ahead = self.ahead.replace(0);
            debug_assert!(
                ahead <= ready.len(),
                "more fibers counted ahead than queued"
            );
            let at = ahead.min(ready.len());
            ready.insert(at, Ready { fid: me_id, slot });
        }
        self.nested.set(0);
        self.current.set(me_id);
        let y = me.yielder.get();
        // SAFETY: the yielder pointer was stored by this fiber when it started; it points into
        // its own stack (corosensei's parent link), valid for the coroutine's whole life.
        unsafe { (*y).suspend(Yield::Ready) };
        true
    }
}

/// Publishes `me` suspended (its registers recorded by the caller, whose frame stays as it
/// is meanwhile) and switches to whoever resumed it, as a ready fiber. A call of its own, one
/// level below the switch that resumes others in `yield_in_place`: a switch back and forth
/// then returns along the calls the CPU predicts (see `yield_in_place`).
#[inline(never)]
fn park_ready(me: &FiberCore) {
    me.shared.run.publish_suspended();
    let y = me.yielder.get();
    // SAFETY: the yielder pointer was stored by this fiber when it started; it points into
    // its own stack (corosensei's parent link), valid for the coroutine's whole life.
    unsafe { (*y).suspend(Yield::Ready) };
}

/// Makes fiber `fid` of scheduler `sched` (created on this thread) ready, whether or not
/// that scheduler is running right now. Returns whether the fiber is there (not ended).
pub(crate) fn wake(sched: u64, fid: FiberId) -> bool {
    let running = with_sched(|s| (s.shared.id == sched).then(|| s.make_ready_if(fid, false)));
    if let Some(Some(found)) = running {
        return found;
    }
    let inner = ON_THREAD.with(|t| {
        t.borrow()
            .iter()
            .find(|(id, _)| *id == sched)
            .and_then(|(_, w)| w.upgrade())
    });
    inner.is_some_and(|inner| inner.make_ready_if(fid, false))
}

/// As [`wake`], but a fiber that was cancelled (or is gone) is left alone: returns whether
/// the fiber was woken (one lookup, as `wake`'s).
pub(crate) fn wake_live(sched: u64, fid: FiberId) -> bool {
    let running = with_sched(|s| (s.shared.id == sched).then(|| s.make_ready_if(fid, true)));
    if let Some(Some(woke)) = running {
        return woke;
    }
    let inner = ON_THREAD.with(|t| {
        t.borrow()
            .iter()
            .find(|(id, _)| *id == sched)
            .and_then(|(_, w)| w.upgrade())
    });
    inner.is_some_and(|inner| inner.make_ready_if(fid, true))
}

/// The scheduler running on this thread and its loop turn (`(0, 0)`: none). It changes
/// between two runs of a fiber that yielded (a fiber suspended in a turn runs again in a
/// later one), never within one run: a clock read once per turn, as Tarantool's
/// `fiber.time()` and `fiber.clock()` read the event loop's cached time, is one value per
/// turn.
#[inline]
pub fn loop_turn() -> (u64, u64) {
    with_sched(|s| (s.shared.id, s.turn.get())).unwrap_or((0, 0))
}

/// How long the current fiber has run since it was last switched to: what Tarantool's fiber
/// slices measure. `None` outside a fiber, and while the scheduler's runs are not timed (see
/// `SchedulerOptions::cpu_time`; a run under way when `fiber.top` accounting was turned on
/// counts from then).
pub fn current_run_time() -> Option<Duration> {
    current_ctx()?;
    with_sched(|s| {
        s.is_clocked()
            .then(|| crate::clock::since(s.last_tick.get()))
    })
    .flatten()
}

/// Turns `fiber.top()`-style accounting on for the scheduler running on this thread: from
/// now on each fiber's CPU time is counted at every switch (the scheduler counts it anyway
/// with `SchedulerOptions::cpu_time`), and at the end of every loop turn each fiber's share
/// of the turn and a moving average of it are updated (a pass over the fibers per turn).
/// When runs were not timed before, the run under way counts from now. Turning it on resets
/// every figure. Returns false outside a running scheduler.
pub fn top_enable() -> bool {
    with_sched(|s| {
        if s.top_on.get() {
            return;
        }
        s.set_clocked(Clocked::TOP, true);
        s.top_on.set(true);
        s.top_turns.set(0);
        s.top_epoch.set(s.top_epoch.get().wrapping_add(1));
        s.turn_start.set(crate::clock::ticks());
        s.top_sched.set(TopStat::default());
        s.top_total.set(TopStat::default());
        for slot in s.slots.borrow_mut().values_mut() {
            let ticks = slot.ctx.shared.cpu_ticks.load(Ordering::Relaxed);
            slot.top = TopStat {
                last: ticks,
                base: ticks,
                ..TopStat::default()
            };
        }
    })
    .is_some()
}

/// Turns `fiber.top()` accounting off (the figures stay as they were). Unless the scheduler
/// counts CPU time anyway (`SchedulerOptions::cpu_time`), counting stops here: the run under
/// way is not charged for its time since the last switch.
pub fn top_disable() {
    with_sched(|s| {
        s.top_on.set(false);
        s.set_clocked(Clocked::TOP, false);
    });
}

/// Whether `fiber.top()` accounting is on for the scheduler running on this thread.
pub fn top_enabled() -> bool {
    with_sched(|s| s.top_on.get()).unwrap_or(false)
}

/// The scheduler's own row of `fiber.top()`: the time of its turns no fiber ran (switching,
/// timers, and waiting for them).
pub fn top_sched_row() -> Option<TopRow> {
    with_sched(|s| s.top_row(&s.top_sched.get()))
}

/// What `fiber.top()` knew of a fiber when it ended ([`top_at_end`]), for its row while it
/// is still listed (Tarantool lists a joinable fiber that ended until it is joined): the
/// scheduler drops a fiber's figures with its slot.
#[derive(Clone, Copy, Debug)]
pub struct EndedTop {
    stat: super::TopStat,
    /// Its CPU ticks at its end (its last turn's share is closed with the next turn).
    ticks: u64,
    sched: u64,
    turns: u64,
    epoch: u64,
}

/// The running fiber's `fiber.top()` figures as it ends (called by the fiber's own last
/// code): `None` while accounting is off, or outside a fiber.
pub fn top_at_end() -> Option<EndedTop> {
    with_sched(|s| {
        if !s.top_on.get() {
            return None;
        }
        let fid = s.current.get();
        let slots = s.slots.try_borrow().ok()?;
        let slot = slots.get(&fid)?;
        // Its runs before this one, and this one so far (runs are timed while top is on).
        let ran = crate::clock::ticks().wrapping_sub(s.last_tick.get());
        let ticks = slot
            .ctx
            .shared
            .cpu_ticks
            .load(Ordering::Relaxed)
            .wrapping_add(ran);
        Some(EndedTop {
            stat: slot.top,
            ticks,
            sched: s.shared.id,
            turns: s.top_turns.get(),
            epoch: s.top_epoch.get(),
        })
    })
    .flatten()
}

/// The `fiber.top()` row of a fiber that ended, as the scheduler's loop would have kept it:
/// its last turn closed with what it ran of it, every turn since with nothing (its average
/// decays as a live fiber's that does not run). Zero when accounting was turned on again since it ended
/// (every figure is reset then) or it ended while accounting was off (`ended`: `None`);
/// `None` outside this scheduler's thread.
pub fn top_ended_row(ended: Option<&EndedTop>) -> Option<TopRow> {
    with_sched(|s| {
        let Some(e) = ended.filter(|e| e.sched == s.shared.id && e.epoch == s.top_epoch.get())
        else {
            return TopRow::default();
        };
        let mut t = e.stat;
        let since = s.top_turns.get().wrapping_sub(e.turns);
        if since > 0 {
            let d = e.ticks.wrapping_sub(t.last);
            t.last = e.ticks;
            t.close_turn(d);
            // (Past a few thousand turns the average is below any figure printed.)
            for _ in 1..since.min(4096) {
                t.close_turn(0);
            }
        }
        s.top_row(&t)
    })
}

/// Fiber `fid`'s row of `fiber.top()` (`None`: not a fiber of the scheduler running here).
pub fn top_fiber_row(fid: FiberId) -> Option<TopRow> {
    with_sched(|s| {
        let top = s.slots.try_borrow().ok()?.get(&fid).map(|slot| slot.top)?;
        Some(s.top_row(&top))
    })
    .flatten()
}
