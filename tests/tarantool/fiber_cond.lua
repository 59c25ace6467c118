-- The cases of Tarantool's test/app/fiber_cond.test.lua (tag 2.6.0),
-- re-expressed as a plain script. Runs unchanged under
-- `tarantool fiber_cond.lua` and `fibertrace run fiber_cond.lua`; prints
-- `ok NAME` / `not ok NAME: reason` per case and a closing
-- `N passed, N failed` line; exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')

---------------------------------------------------------------------------
-- The harness (harness.lua, beside this script)
---------------------------------------------------------------------------

local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
                 .. 'harness.lua')
local case, eq, truthy = t.case, t.eq, t.truthy
local raises, track = t.raises, t.track

---------------------------------------------------------------------------
-- Cases
---------------------------------------------------------------------------

case('tostring_of_cond', function()
    eq(tostring(fiber.cond()), 'cond', 'tostring')
end)

case('wait_without_cond_raises', function()
    local c = fiber.cond()
    raises('usage: cond:wait([timeout])', c.wait)
end)

case('wait_on_string_raises', function()
    local c = fiber.cond()
    raises("bad argument #1 to '?' (fiber.cond expected, got string)",
           c.wait, '1')
end)

case('wait_with_string_timeout_times_out', function()
    local c = fiber.cond()
    -- (timeouts count on the event loop's clock, fiber.clock(), which may lag
    -- behind clock.monotonic() on a loaded machine)
    local t0 = fiber.clock()
    eq(c:wait('0.05'), false, "wait('0.05')")
    truthy(fiber.clock() - t0 >= 0.04, 'the string is taken as seconds')
end)

case('wait_rejects_negative_timeout', function()
    local c = fiber.cond()
    raises('usage: cond:wait([timeout])', c.wait, c, -1)
end)

case('wait_times_out', function()
    local c = fiber.cond()
    local t0 = fiber.clock()
    eq(c:wait(0.1), false, 'wait(0.1)')
    truthy(fiber.clock() - t0 >= 0.09, 'wait(0.1) lasts 0.1 s')
end)

case('wait_ends_on_broadcast', function()
    local c = fiber.cond()
    fiber.create(function() fiber.sleep(0.05) c:broadcast() end)
    local t0 = clock.monotonic()
    eq(c:wait(1), true, 'wait(1)')
    truthy(clock.monotonic() - t0 < 0.5, 'woken by the broadcast, not the timeout')
end)

-- The next two cases share a cond and four waiters, as the test does.
-- (The waiters are cleaned up after the second case only.)
local shared = fiber.cond()
local marks = {}
local waiters = {}

case('signal_wakes_one_waiter', function()
    for i = 1, 4 do
        waiters[i] = fiber.create(function()
            shared:wait()
            table.insert(marks, '#')
        end)
    end
    shared:signal()
    fiber.sleep(0.05)
    eq(marks, {'#'}, 'waiters woken')
end)

case('broadcast_wakes_every_waiter', function()
    for _, f in ipairs(waiters) do track(f) end
    shared:broadcast()
    fiber.sleep(0.05)
    eq(marks, {'#', '#', '#', '#'}, 'waiters woken')
end)

t.finish()
