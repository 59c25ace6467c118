//! A cheap clock for per-switch accounting: the CPU's time-stamp counter (a few ns to read,
//! against ~20 ns for `Instant::now`), converted to time with a rate measured against the
//! monotonic clock.
//!
//! "A few" is 6-11 ns depending on the machine (11 ns on the virtual machines this was
//! measured on: a fifth of a yield), so the scheduler reads it at every switch only while
//! someone needs runs timed (per-fiber CPU time, `fiber.top`, slices: see
//! `SchedulerOptions::cpu_time`); otherwise once per loop turn while a timer waits.
//!
//! The rate is measured over the time since the first reading (at least 2 ms, sleeping once
//! if the process is younger than that) and re-measured as the process ages, so it converges;
//! each reading pairs the counter with the monotonic clock at one moment (read again if the
//! thread was preempted between the two).
//! On a machine whose counter is not invariant (very old CPUs) durations would be wrong;
//! every x86_64 CPU of the last decade has an invariant counter. The counter is read in
//! `fibertrace_core::arch`'s leaf file for the architecture.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Reads the time-stamp counter (the architecture's, from `fibertrace_core::arch`).
#[inline(always)]
pub fn ticks() -> u64 {
    fibertrace_core::arch::timestamp_counter()
}

struct Base {
    ticks: u64,
    at: Instant,
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let (ticks, at) = paired(Instant::now);
        Base { ticks, at }
    })
}

/// Reads the counter and `clock` at one moment: the counter on both sides of the clock's
/// read, again when the thread was preempted in between (the two counter reads then lie far
/// apart: a pair read across a preemption would skew the rate by the time the thread was
/// off the CPU — on a loaded machine, several times over); the counter halfway.
fn paired<T>(clock: impl Fn() -> T) -> (u64, T) {
    let mut best: Option<(u64, u64, T)> = None;
    for _ in 0..16 {
        let t1 = ticks();
        let c = clock();
        let t2 = ticks();
        let gap = t2.wrapping_sub(t1);
        if best.as_ref().is_none_or(|b| gap < b.0) {
            best = Some((gap, t1 + gap / 2, c));
        }
        // A few hundred ticks: no preemption between the reads.
        if gap < 4096 {
            break;
        }
    }
    let (_, t, c) = best.expect("at least one reading");
    (t, c)
}

/// Picoseconds per tick, as last measured (0 = not yet).
pub(crate) static PS_PER_TICK: AtomicU64 = AtomicU64::new(0);

/// Starts the clock (call early; the first call anchors the rate measurement).
pub fn init() {
    let _ = base();
}

fn ps_per_tick() -> u64 {
    let b = base();
    if b.at.elapsed() < Duration::from_millis(2) {
        std::thread::sleep(Duration::from_millis(2).saturating_sub(b.at.elapsed()));
    }
    let (now, elapsed) = paired(|| b.at.elapsed());
    let dt = now.wrapping_sub(b.ticks).max(1);
    let ps = (elapsed.as_nanos().saturating_mul(1000) / u128::from(dt)) as u64;
    PS_PER_TICK.store(ps.max(1), Ordering::Relaxed);
    ps.max(1)
}

/// Clock ticks of the last rate measurement.
static MEASURED_AT: AtomicU64 = AtomicU64::new(0);

/// The tick-to-time rate, read once: a pass over many fibers converts with it instead of
/// checking the rate (and reading the counter) per conversion.
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    ps_per_tick: u64,
}

impl Rate {
    /// The rate now (re-measured first now and then while the process is young: it
    /// converges as the measured interval grows; about every 2^26 ticks, tens of ms).
    pub fn now() -> Rate {
        let mut ps = PS_PER_TICK.load(Ordering::Relaxed);
        let now = ticks();
        if ps == 0
            || (now.wrapping_sub(MEASURED_AT.load(Ordering::Relaxed)) > 1 << 26
                && base().at.elapsed() < Duration::from_secs(60))
        {
            MEASURED_AT.store(now, Ordering::Relaxed);
            ps = ps_per_tick();
        }
        Rate { ps_per_tick: ps }
    }

    /// `delta_ticks` as a duration.
    #[inline]
    pub fn duration(self, delta_ticks: u64) -> Duration {
        let ns = match delta_ticks.checked_mul(self.ps_per_tick) {
            // The usual case: a 64-bit division by a constant (a multiply), not a call to
            // the 128-bit division routine.
            Some(ps) => ps / 1000,
            None => (u128::from(delta_ticks) * u128::from(self.ps_per_tick) / 1000) as u64,
        };
        Duration::from_nanos(ns)
    }
}

impl Rate {
    /// As [`Rate::now`], but `None` instead of waiting for the clock's first 2 ms (its first
    /// measurement needs them): for a caller that can do without.
    pub fn now_without_wait() -> Option<Rate> {
        if PS_PER_TICK.load(Ordering::Relaxed) == 0
            && base().at.elapsed() < Duration::from_millis(2)
        {
            return None;
        }
        Some(Rate::now())
    }

    /// How many ticks `d` lasts at this rate (saturating).
    pub fn ticks_in(self, d: Duration) -> u64 {
        let t = d.as_nanos().saturating_mul(1000) / u128::from(self.ps_per_tick.max(1));
        u64::try_from(t).unwrap_or(u64::MAX)
    }
}

/// Converts a tick count to a duration.
pub fn to_duration(delta_ticks: u64) -> Duration {
    Rate::now().duration(delta_ticks)
}

/// Time since a tick reading.
pub fn since(t: u64) -> Duration {
    to_duration(ticks().saturating_sub(t))
}
