//! Fiber slices (`fiber.set_slice`, `extend_slice`, `check_slice`, `set_max_slice`) and the
//! parent-backtrace switch.

use std::ffi::c_int;
use std::io::Write;
use std::time::Duration;

use fibertrace_fiber::FiberId;
use mlua::ffi;

use super::call::lua_fn;
use super::call::Call;
use super::objects::*;
use super::raw::{LErr, LResult};
use super::{with_host, HostState, Slice};

// ---- slices ----

pub(super) const BAD_SLICE: &str =
    "slice must be a number or a table {warn = <number>, err = <number>}";

/// Reads a slice argument: a number (the error part; no warning) or `{warn = n, err = n}`
/// (numbers or numeric strings, read raw); each part `>= 0` (NaN is not).
pub(super) fn slice_arg(c: &mut Call, idx: c_int) -> Result<Slice, LErr> {
    let slice = if c.type_of(idx) == ffi::LUA_TTABLE {
        let part = |c: &mut Call, key: &str| -> Result<Option<f64>, LErr> {
            c.push_field(idx, key)?;
            let t = c.type_of(-1);
            let v = if t == ffi::LUA_TNUMBER || t == ffi::LUA_TSTRING {
                c.to_number(-1)
            } else {
                None
            };
            c.pop(1);
            Ok(v)
        };
        let warn = part(c, "warn")?;
        let err = part(c, "err")?;
        match (warn, err) {
            (Some(warn), Some(err)) => Slice { warn, err },
            _ => return Err(LErr::plain(BAD_SLICE)),
        }
    } else if let Some(err) = c.to_number(idx) {
        Slice {
            warn: Slice::INFINITE,
            err,
        }
    } else {
        return Err(LErr::plain(BAD_SLICE));
    };
    if !(slice.warn >= 0.0 && slice.err >= 0.0) {
        return Err(LErr::plain("slice value must be >= 0"));
    }
    Ok(slice)
}

/// The current run of the current fiber: its id and the switch count the run began with.
pub(super) fn current_run() -> (FiberId, u64) {
    match fibertrace_fiber::current() {
        Some(f) => (f.id(), f.control_block().csw()),
        None => (0, 0),
    }
}

/// The slice of the current run (its max slice unless set or extended in this run).
pub(super) fn run_slice(h: &HostState, run: (FiberId, u64)) -> Slice {
    match h.run_slice {
        Some((r, s)) if r == run => s,
        _ => h
            .recs
            .get(&run.0)
            .and_then(|r| r.max_slice)
            .unwrap_or(h.default_slice),
    }
}

pub(super) fn set_slice_body(c: &mut Call) -> LResult {
    if c.top() != 1 {
        return Err(LErr::plain("fiber.set_slice(slice): bad arguments"));
    }
    let s = slice_arg(c, 1)?;
    let run = current_run();
    with_host(|h| h.run_slice = Some((run, s)));
    Ok(0)
}
lua_fn!(f_set_slice, set_slice_body);

pub(super) fn extend_slice_body(c: &mut Call) -> LResult {
    if c.top() != 1 {
        return Err(LErr::plain("fiber.extend_slice(slice): bad arguments"));
    }
    let s = slice_arg(c, 1)?;
    let run = current_run();
    with_host(|h| {
        let cur = run_slice(h, run);
        let ext = Slice {
            warn: cur.warn + s.warn,
            err: cur.err + s.err,
        };
        h.run_slice = Some((run, ext));
    });
    Ok(0)
}
lua_fn!(f_extend_slice, extend_slice_body);

/// `fiber.check_slice()`: warns once per run (stderr) past the warning part, raises `fiber
/// slice is exceeded` past the error part, counted from when the fiber last got the CPU.
pub(super) fn check_slice_body(c: &mut Call) -> LResult {
    if c.top() != 0 {
        return Err(LErr::plain("fiber.check_slice(): bad arguments"));
    }
    let Some(ran) = fibertrace_fiber::embed::current_run_time() else {
        return Ok(0);
    };
    let ran = ran.as_secs_f64();
    let run = current_run();
    let warn = with_host(|h| {
        let mut s = run_slice(h, run);
        let warn = (s.warn < ran).then_some(s.warn);
        if warn.is_some() {
            s.warn = Slice::INFINITE;
            h.run_slice = Some((run, s));
        }
        (warn, s.err < ran)
    })
    .ok_or_else(no_host)?;
    if let Some(w) = warn.0 {
        let name = fibertrace_fiber::current()
            .map(|f| f.name())
            .unwrap_or_default();
        // (The name quoted with escapes, as in the runtime's other reports: a name's
        // newline or bytes that are not UTF-8 broke the line.)
        let _ = writeln!(
            std::io::stderr().lock(),
            "fibertrace: fiber {} {}: fiber has not yielded for more than {w:.3} seconds",
            run.0,
            fibertrace_fiber::embed::quoted_name(&name)
        );
    }
    if warn.1 {
        return Err(LErr::plain("fiber slice is exceeded"));
    }
    Ok(0)
}
lua_fn!(f_check_slice, check_slice_body);

/// `fiber.set_max_slice(slice)` (the default of fibers without their own) and
/// `fiber.set_max_slice(f, slice)` / `f:set_max_slice(slice)` (a fiber's own). A new max
/// slice applies to the current run at once when it is the current fiber's.
///
/// The default also drives fibertrace's stall detector (an addition to Tarantool): while it
/// has a finite part, a fiber that runs longer than that (the warning part, else the error
/// part) without yielding is reported with its stack, whether or not it calls
/// `check_slice()`.
pub(super) fn set_max_slice_body(c: &mut Call) -> LResult {
    let top = c.top();
    if top != 1 && top != 2 {
        return Err(LErr::plain(
            "fiber.set_max_slice([id,] slice): bad arguments",
        ));
    }
    let s = slice_arg(c, top)?;
    let run = current_run();
    if top == 2 {
        let (fid, _) = check_fiber(c, 1, false)?;
        with_host(|h| {
            if let Some(r) = h.recs.get_mut(&fid) {
                r.max_slice = Some(s);
            }
            if fid == run.0 {
                h.run_slice = Some((run, s));
            }
        });
        return Ok(0);
    }
    let started_by_us = with_host(|h| {
        h.default_slice = s;
        let own = h.recs.get(&run.0).and_then(|r| r.max_slice).is_some();
        if !own {
            h.run_slice = Some((run, s));
        }
        h.watchdog_by_slice
    })
    .ok_or_else(no_host)?;
    let part = if s.warn < Slice::INFINITE {
        s.warn
    } else {
        s.err
    };
    if part < Slice::INFINITE && part > 0.0 {
        let threshold = Duration::from_secs_f64(part);
        if fibertrace_fiber::watchdog::is_running() {
            fibertrace_fiber::watchdog::set_threshold(threshold);
        } else {
            fibertrace_fiber::watchdog::start(fibertrace_fiber::watchdog::Config {
                threshold,
                ..Default::default()
            });
            with_host(|h| h.watchdog_by_slice = true);
        }
    } else if started_by_us && part >= Slice::INFINITE {
        fibertrace_fiber::watchdog::stop();
        with_host(|h| h.watchdog_by_slice = false);
    }
    Ok(0)
}
lua_fn!(f_set_max_slice, set_max_slice_body);

pub(super) fn pbt_enable_body(_c: &mut Call) -> LResult {
    with_host(|h| h.parent_backtrace = true);
    Ok(0)
}
lua_fn!(f_pbt_enable, pbt_enable_body);

pub(super) fn pbt_disable_body(_c: &mut Call) -> LResult {
    with_host(|h| h.parent_backtrace = false);
    Ok(0)
}
lua_fn!(f_pbt_disable, pbt_disable_body);
