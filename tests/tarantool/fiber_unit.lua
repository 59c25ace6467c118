-- The Lua-visible parts of Tarantool's C unit tests (tag 2.6.0):
-- test/unit/fiber.cc, fiber_channel.cc, fiber_cond.c, fiber_stress.cc and
-- fiber_channel_stress.cc, re-expressed with the Lua API. (fiber_stack.c
-- injects mprotect/madvise faults, which Lua cannot reach.) Runs unchanged
-- under `tarantool fiber_unit.lua` and `fibertrace run fiber_unit.lua`;
-- prints `ok NAME` / `not ok NAME: reason` per case and a closing
-- `N passed, N failed` line; exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')

---------------------------------------------------------------------------
-- The harness (harness.lua, beside this script)
---------------------------------------------------------------------------

local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
                 .. 'harness.lua')
local case, eq, truthy = t.case, t.eq, t.truthy
local show, wait_dead, track = t.show, t.wait_dead, t.track
local within, child_output = t.within, t.child_output

---------------------------------------------------------------------------
-- Cases: test/unit/fiber.cc (fiber_join_test, fiber_name_test,
-- fiber_stack_test)
---------------------------------------------------------------------------

local function joinable(fn, ...)
    local f = fiber.new(fn, ...)
    f:set_joinable(true)
    return f
end

case('join_finished_fiber', function()
    local f = joinable(function() end)
    f:wakeup()
    eq({f:join()}, {true}, 'join result')
end)

case('join_cancelled_fiber', function()
    local f = joinable(function()
        while true do
            fiber.sleep(0.001)
            fiber.testcancel()
        end
    end)
    f:wakeup()
    fiber.sleep(0)
    f:cancel()
    local st, err = f:join()
    eq(st, false, 'join status')
    eq(tostring(err), 'fiber is cancelled', 'error')
end)

case('join_propagates_error', function()
    local f = joinable(function() error('allocator exception', 0) end)
    f:wakeup()
    local st, err = f:join()
    eq(st, false, 'join status')
    eq(tostring(err), 'allocator exception', 'error')
end)

case('uncaught_error_of_started_fiber_is_logged', function()
    local err = child_output([[
        local fiber = require('fiber')
        local f = fiber.new(function() error('unit uncaught marker') end)
        f:wakeup()
        fiber.sleep(0.01)
    ]], 'stderr')
    truthy(err:find('unit uncaught marker', 1, true) ~= nil,
           'the error is logged (stderr: ' .. show(err) .. ')')
end)

case('join_fiber_that_caught_its_error', function()
    local f = joinable(function()
        pcall(error, 'caught inside')
    end)
    f:wakeup()
    eq({f:join()}, {true}, 'join result')
end)

case('cancel_of_dead_joinable_fiber_is_accepted', function()
    local started = false
    local f = joinable(function()
        started = true
        error('dies at once', 0)
    end)
    f:wakeup()
    fiber.sleep(0)
    eq(started, true, 'the fiber ran')
    local ok, err = pcall(fiber.cancel, f)
    truthy(ok, 'cancel of the finished fiber raises nothing (' ..
           tostring(err) .. ')')
    local st, jerr = f:join()
    eq(st, false, 'join status')
    eq(tostring(jerr), 'dies at once', 'error')
end)

case('name_set', function()
    local old = fiber.name()
    fiber.name('Horace')
    eq(fiber.name(), 'Horace', 'name')
    fiber.name(old)
end)

case('name_truncated_to_the_limit', function()
    local old = fiber.name()
    fiber.name(string.rep('a', 255 + 29), {truncate = true})
    eq(fiber.name(), string.rep('a', 255), 'truncated name')
    fiber.name(old)
end)

-- Deep nesting on a fiber's stack. Lua recursion lives on the heap; C-level
-- recursion (each level of string.gsub calls back into Lua from C and keeps
-- a buffer of about 8 KB on the C stack) uses the fiber's own stack. The
-- unit test fills 3/4 of the default stack (512 KB in Tarantool): 40 levels
-- of gsub take about as much. A stack overflow kills the process, so the
-- C-level part runs in a child process.
case('deep_lua_recursion_on_fiber', function()
    local function depth(n) if n == 0 then return 0 end return 1 + depth(n - 1) end
    local f = joinable(function() return depth(10000) end)
    f:wakeup()
    eq({f:join()}, {true, 10000}, 'join result')
end)

case('deep_c_recursion_on_fiber_stack', function()
    local out = child_output([[
        local fiber = require('fiber')
        local function nest(n)
            if n == 0 then return '' end
            return (string.gsub('x', 'x', function() return 'x' .. nest(n - 1) end))
        end
        local f = fiber.new(function() return #nest(40) end)
        f:set_joinable(true)
        print('depth', select(2, f:join()))
    ]], 'stdout')
    eq(out, 'depth\t40\n', 'output of the child (empty if it crashed)')
end)

---------------------------------------------------------------------------
-- Cases: test/unit/fiber_channel.cc
---------------------------------------------------------------------------

case('channel_basic_state', function()
    local ch = fiber.channel(1)
    truthy(ch ~= nil, 'fiber.channel(1)')
    eq({ch:size(), ch:count(), ch:is_full(), ch:is_empty()},
       {1, 0, false, true}, 'size, count, is_full, is_empty')
    local item = {}
    ch:put(item)
    eq({ch:size(), ch:count(), ch:is_full(), ch:is_empty()},
       {1, 1, true, false}, 'size, count, is_full, is_empty with one item')
    truthy(rawequal(ch:get(), item), 'get returns the object put')
end)

case('channel_put_with_timeouts', function()
    local ch = fiber.channel(1)
    local item = {}
    eq(ch:put(item, 0), true, 'put(0) into the free slot')
    eq(ch:put(item, 0), false, 'put(0) into the full channel')
    truthy(rawequal(ch:get(), item), 'get returns the object put')
    eq(ch:put(item, 0.01), true, 'put(0.01) into the free slot')
    truthy(rawequal(ch:get(), item), 'get returns the object put again')
end)

case('channel_closed_refuses_put_and_get', function()
    local ch = fiber.channel(1)
    ch:close()
    eq(ch:put({}), false, 'put after close')
    eq(ch:get(), nil, 'get after close')
end)

---------------------------------------------------------------------------
-- Cases: test/unit/fiber_cond.c (two waiters, a signal each, a broadcast)
---------------------------------------------------------------------------

local cond = fiber.cond()
local cond_log = {timeouts = {}, signals = {}, broadcasts = {}, order = {}}
local cond_fibers = {}

local function cond_waiter(name)
    table.insert(cond_log.timeouts, cond:wait(0))
    table.insert(cond_log.signals, cond:wait())
    table.insert(cond_log.order, name)
    table.insert(cond_log.broadcasts, cond:wait())
end

-- f1 is waiting before f2 starts; a signal wakes the longest waiter, and f1,
-- back to waiting after its wakeup, queues behind f2.
case('cond_wait_zero_times_out', function()
    cond_fibers[1] = joinable(cond_waiter, 'f1')
    cond_fibers[1]:wakeup()
    fiber.sleep(0.01)
    cond_fibers[2] = joinable(cond_waiter, 'f2')
    cond_fibers[2]:wakeup()
    fiber.sleep(0.01)
    eq(cond_log.timeouts, {false, false}, 'results of wait(0)')
end)

case('cond_signals_wake_waiters_in_turn', function()
    cond:signal()
    fiber.sleep(0)
    cond:signal()
    fiber.sleep(0)
    eq(cond_log.signals, {true, true}, 'results of the waits')
    eq(cond_log.order, {'f1', 'f2'}, 'order of wakeups')
end)

case('cond_broadcast_wakes_both', function()
    cond:broadcast()
    fiber.sleep(0)
    eq(cond_log.broadcasts, {true, true}, 'results of the waits')
    for i, f in ipairs(cond_fibers) do
        eq({within(1, f.join, f)}, {true}, 'join of waiter ' .. i)
    end
end)

---------------------------------------------------------------------------
-- Cases: test/unit/fiber_stress.cc, test/unit/fiber_channel_stress.cc
-- (the counts are smaller than the C tests', to keep the run short)
---------------------------------------------------------------------------

case('stress_many_yielding_fibers', function()
    local rounds = {}
    local fibers = {}
    for i = 1, 100 do
        rounds[i] = 0
        fibers[i] = track(fiber.new(function()
            for _ = 1, 1000 do
                fiber.wakeup(fiber.self())
                fiber.yield()
                rounds[i] = rounds[i] + 1
            end
        end))
        fibers[i]:wakeup()
    end
    for _, f in ipairs(fibers) do wait_dead(f, 20) end
    for i = 1, 100 do eq(rounds[i], 1000, 'rounds of fiber ' .. i) end
end)

case('stress_channel_of_one', function()
    local n = 100000
    local ch = fiber.channel(1)
    local pusher = joinable(function()
        for i = 1, n do ch:put(i) end
    end)
    local sum, in_order = 0, true
    local popper = joinable(function()
        for i = 1, n do
            local v = ch:get()
            if v ~= i then in_order = false end
            sum = sum + v
        end
    end)
    track(pusher)
    track(popper)
    pusher:wakeup()
    popper:wakeup()
    eq({within(20, pusher.join, pusher)}, {true}, 'join of the pusher')
    eq({within(20, popper.join, popper)}, {true}, 'join of the popper')
    eq(in_order, true, 'values arrive in order')
    eq(sum, n * (n + 1) / 2, 'sum of the values')
end)

t.finish()
