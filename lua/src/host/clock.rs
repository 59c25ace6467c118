//! Clocks: Tarantool's `clock` module (`clock.time`, `monotonic`, `proc`, `thread` and their
//! 64-bit forms in nanoseconds) and `fiber.time`/`fiber.clock` (and their 64-bit forms in
//! microseconds).
//!
//! `fiber.time` and `fiber.clock` read the clocks once per loop turn of the scheduler
//! ([`fibertrace_fiber::embed::loop_turn`]), as Tarantool reads its event loop's cached time:
//! two reads in one run of a fiber (no yield between) are equal; after a yield the clock has
//! moved on. The clocks are read lazily, at the first call of a turn, so a turn in which
//! nobody asks costs nothing.
//!
//! Under LuaJIT the module functions are what Tarantool's are: FFI calls (`clock.*` are
//! C function pointers, type `cdata`; `fiber.time`... Lua functions calling them) of the
//! `extern "C"` functions here, and the 64-bit forms return `int64_t` cdata, exact to the
//! nanosecond (a Lua number is not, past 2^53). Under Lua 5.4 they are C functions and the
//! 64-bit forms return Lua integers (exact too).
//!
//! Invariant: the `extern "C"` functions called through the FFI take no Lua state, never
//! unwind, and never call back into Lua.

use std::cell::Cell;
use std::ffi::{c_int, c_void};

use mlua::ffi;

/// Nanoseconds of a clock.
fn clock_ns(id: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock ids used are supported on Linux.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec)
}

thread_local! {
    /// The loop turn whose clocks are cached, and those clocks (realtime, monotonic; ns).
    static LOOP_CLOCK: Cell<((u64, u64), i64, i64)> = const { Cell::new(((0, 0), 0, 0)) };
}

/// The realtime and monotonic clocks of the current loop turn, in nanoseconds.
#[inline]
fn loop_clock() -> (i64, i64) {
    let turn = fibertrace_fiber::embed::loop_turn();
    let (at, real, mono) = LOOP_CLOCK.get();
    if at == turn && turn.0 != 0 {
        return (real, mono);
    }
    let real = clock_ns(libc::CLOCK_REALTIME);
    let mono = clock_ns(libc::CLOCK_MONOTONIC);
    LOOP_CLOCK.set((turn, real, mono));
    (real, mono)
}

/// Microseconds from nanoseconds, rounded (Tarantool rounds its double seconds so).
fn micros(ns: i64) -> i64 {
    ns.wrapping_add(500).div_euclid(1000)
}

macro_rules! ffi_clock {
    ($($name:ident -> $t:ty = $e:expr;)*) => {$(
        pub(crate) extern "C" fn $name() -> $t {
            $e
        }
    )*};
}

ffi_clock! {
    ft_clock_realtime -> f64 = clock_ns(libc::CLOCK_REALTIME) as f64 / 1e9;
    ft_clock_monotonic -> f64 = clock_ns(libc::CLOCK_MONOTONIC) as f64 / 1e9;
    ft_clock_process -> f64 = clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID) as f64 / 1e9;
    ft_clock_thread -> f64 = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) as f64 / 1e9;
    ft_clock_realtime64 -> i64 = clock_ns(libc::CLOCK_REALTIME);
    ft_clock_monotonic64 -> i64 = clock_ns(libc::CLOCK_MONOTONIC);
    ft_clock_process64 -> i64 = clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID);
    ft_clock_thread64 -> i64 = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
    ft_fiber_time -> f64 = loop_clock().0 as f64 / 1e9;
    ft_fiber_clock -> f64 = loop_clock().1 as f64 / 1e9;
    ft_fiber_time64 -> i64 = micros(loop_clock().0);
    ft_fiber_clock64 -> i64 = micros(loop_clock().1);
}

macro_rules! lua_clock {
    ($($name:ident = $f:ident, $push:ident;)*) => {$(
        pub(crate) unsafe extern "C-unwind" fn $name(l: *mut ffi::lua_State) -> c_int {
            // SAFETY: pushes one number on the calling state (a C function has room).
            unsafe { ffi::$push(l, $f() as _) };
            1
        }
    )*};
}

lua_clock! {
    c_realtime = ft_clock_realtime, lua_pushnumber;
    c_monotonic = ft_clock_monotonic, lua_pushnumber;
    c_process = ft_clock_process, lua_pushnumber;
    c_thread = ft_clock_thread, lua_pushnumber;
    c_realtime64 = ft_clock_realtime64, lua_pushinteger;
    c_monotonic64 = ft_clock_monotonic64, lua_pushinteger;
    c_process64 = ft_clock_process64, lua_pushinteger;
    c_thread64 = ft_clock_thread64, lua_pushinteger;
    c_fiber_time = ft_fiber_time, lua_pushnumber;
    c_fiber_clock = ft_fiber_clock, lua_pushnumber;
    c_fiber_time64 = ft_fiber_time64, lua_pushinteger;
    c_fiber_clock64 = ft_fiber_clock64, lua_pushinteger;
}

/// The C functions of the `clock` module (the FFI replaces them under LuaJIT).
pub(crate) const CLOCK_FNS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"monotonic", c_monotonic),
    (c"monotonic64", c_monotonic64),
    (c"time", c_realtime),
    (c"realtime", c_realtime),
    (c"time64", c_realtime64),
    (c"realtime64", c_realtime64),
    (c"proc", c_process),
    (c"proc64", c_process64),
    (c"thread", c_thread),
    (c"thread64", c_thread64),
];

/// The clock functions of the `fiber` module (the FFI replaces them under LuaJIT).
pub(crate) const FIBER_CLOCK_FNS: &[(&std::ffi::CStr, ffi::lua_CFunction)] = &[
    (c"time", c_fiber_time),
    (c"time64", c_fiber_time64),
    (c"clock", c_fiber_clock),
    (c"clock64", c_fiber_clock64),
];

/// The `extern "C"` functions by the names the prelude gives them, for the FFI.
pub(crate) fn ffi_pointers() -> [(&'static str, *mut c_void); 12] {
    [
        ("realtime", ft_clock_realtime as *mut c_void),
        ("monotonic", ft_clock_monotonic as *mut c_void),
        ("process", ft_clock_process as *mut c_void),
        ("thread", ft_clock_thread as *mut c_void),
        ("realtime64", ft_clock_realtime64 as *mut c_void),
        ("monotonic64", ft_clock_monotonic64 as *mut c_void),
        ("process64", ft_clock_process64 as *mut c_void),
        ("thread64", ft_clock_thread64 as *mut c_void),
        ("fiber_time", ft_fiber_time as *mut c_void),
        ("fiber_clock", ft_fiber_clock as *mut c_void),
        ("fiber_time64", ft_fiber_time64 as *mut c_void),
        ("fiber_clock64", ft_fiber_clock64 as *mut c_void),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_round_to_nearest() {
        assert_eq!(micros(1_499), 1);
        assert_eq!(micros(1_500), 2);
        assert_eq!(micros(0), 0);
        assert_eq!(micros(1_795_432_934_022_499_999), 1_795_432_934_022_500);
    }

    #[test]
    fn without_a_scheduler_the_fiber_clocks_are_not_cached() {
        let a = ft_fiber_clock64();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(ft_fiber_clock64() >= a + 1_000);
    }
}
