-- The cases of Tarantool's test/app-tap/clock.test.lua (tag 2.6.0),
-- re-expressed as a plain script, plus the cases that later tags added and
-- that 2.6 already satisfies (the cache of fiber.time/clock, the units of the
-- 64-bit forms). Runs unchanged under `tarantool clock.lua` and
-- `fibertrace run clock.lua`; prints `ok NAME` / `not ok NAME: reason` per
-- case and a closing `N passed, N failed` line; exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')

---------------------------------------------------------------------------
-- The harness (harness.lua, beside this script)
---------------------------------------------------------------------------

local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
                 .. 'harness.lua')
local case, eq, truthy = t.case, t.eq, t.truthy
local same = t.same

---------------------------------------------------------------------------
-- Cases
---------------------------------------------------------------------------

-- test/app-tap/clock.test.lua at 2.6.0
case('realtime_positive', function()
    truthy(clock.realtime() > 0, 'realtime() > 0')
end)
case('thread_positive', function()
    truthy(clock.thread() > 0, 'thread() > 0')
end)
case('monotonic_positive', function()
    truthy(clock.monotonic() > 0, 'monotonic() > 0')
end)
case('proc_positive', function()
    truthy(clock.proc() > 0, 'proc() > 0')
end)
case('realtime64_positive', function()
    truthy(clock.realtime64() > 0, 'realtime64() > 0')
end)
case('thread64_positive', function()
    truthy(clock.thread64() > 0, 'thread64() > 0')
end)
case('monotonic64_positive', function()
    truthy(clock.monotonic64() > 0, 'monotonic64() > 0')
end)
case('proc64_positive', function()
    truthy(clock.proc64() > 0, 'proc64() > 0')
end)

case('monotonic_does_not_go_back', function()
    local a = clock.monotonic()
    local b = clock.monotonic()
    truthy(a <= b, 'monotonic() <= a later monotonic()')
end)

case('realtime_is_close_to_os_time', function()
    local d = math.abs(clock.realtime() - os.time())
    truthy(d < 2, 'realtime() within 2 s of os.time(), off by ' .. d)
end)

-- Cases added to the test in later tags whose behaviour 2.6 already has.
case('time_positive', function()
    truthy(clock.time() > 0, 'time() > 0')
end)
case('time64_positive', function()
    truthy(clock.time64() > 0, 'time64() > 0')
end)
case('fiber_time_positive', function()
    truthy(fiber.time() > 0, 'fiber.time() > 0')
end)
case('fiber_clock_positive', function()
    truthy(fiber.clock() > 0, 'fiber.clock() > 0')
end)
case('fiber_time64_positive', function()
    truthy(fiber.time64() > 0, 'fiber.time64() > 0')
end)
case('fiber_clock64_positive', function()
    truthy(fiber.clock64() > 0, 'fiber.clock64() > 0')
end)

case('monotonic64_does_not_go_back', function()
    local a = clock.monotonic64()
    local b = clock.monotonic64()
    truthy(a <= b, 'monotonic64() <= a later monotonic64()')
end)

-- fiber.time/clock and their 64-bit forms are read once per event-loop turn:
-- two reads with a busy (non-yielding) pause between them are equal.
local function spin(seconds)
    local stop = clock.monotonic() + seconds
    while clock.monotonic() < stop do end
end

case('fiber_time_is_cached', function()
    local a = fiber.time()
    spin(0.002)
    eq(fiber.time(), a, 'a second fiber.time()')
end)

case('fiber_time64_is_cached', function()
    local a = fiber.time64()
    spin(0.002)
    eq(fiber.time64(), a, 'a second fiber.time64()')
end)

case('fiber_clock_is_cached', function()
    local a = fiber.clock()
    spin(0.002)
    eq(fiber.clock(), a, 'a second fiber.clock()')
end)

case('fiber_clock64_is_cached', function()
    local a = fiber.clock64()
    spin(0.002)
    eq(fiber.clock64(), a, 'a second fiber.clock64()')
end)

-- (A yield can take less than a microsecond, under Tarantool too: in a loop
-- of yields, Tarantool 2.6's fiber.clock64() stays the same across most of
-- them. The test's "growing after yield" means "read afresh after a yield":
-- the fiber first runs 5 us without yielding, so a fresh reading is greater.)
case('fiber_clock_grows_after_yield', function()
    local a = fiber.clock()
    spin(0.000005)
    fiber.yield()
    truthy(a < fiber.clock(), 'fiber.clock() after a yield is greater')
end)

case('fiber_clock64_grows_after_yield', function()
    local a = fiber.clock64()
    spin(0.000005)
    fiber.yield()
    truthy(a < fiber.clock64(), 'fiber.clock64() after a yield is greater')
end)

-- Units: the 64-bit fiber clocks count microseconds, the clock module's
-- 64-bit clocks nanoseconds.
local function close_to(seconds, value64, scale, what)
    local d = math.abs(seconds - tonumber(value64) / scale)
    truthy(d < 1, what .. ' matches its seconds form (off by ' .. d .. ' s)')
end

case('fiber_time64_in_microseconds', function()
    close_to(fiber.time(), fiber.time64(), 1e6, 'fiber.time64()/1e6')
end)

case('fiber_clock64_in_microseconds', function()
    close_to(fiber.clock(), fiber.clock64(), 1e6, 'fiber.clock64()/1e6')
end)

case('time64_in_nanoseconds', function()
    close_to(clock.time(), clock.time64(), 1e9, 'clock.time64()/1e9')
end)

case('realtime64_in_nanoseconds', function()
    close_to(clock.realtime(), clock.realtime64(), 1e9, 'clock.realtime64()/1e9')
end)

case('thread64_in_nanoseconds', function()
    close_to(clock.thread(), clock.thread64(), 1e9, 'clock.thread64()/1e9')
end)

case('proc64_in_nanoseconds', function()
    close_to(clock.proc(), clock.proc64(), 1e9, 'clock.proc64()/1e9')
end)

t.finish()
