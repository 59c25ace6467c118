-- Fiber features of Tarantool after 2.6, from the tests of its newer tags
-- (test/app-luatest/fiber_slice_test.lua, fiber_test.lua,
-- gh_7489_concurrent_fiber_join_test.lua, gh_7210_..., gh_7746_...,
-- test/app/gh-5799-fiber-info, gh-6203-fiber-join-with-timeout,
-- test/app-tap/clock.test.lua), re-expressed as a plain script. Runs
-- unchanged under `tarantool post26.lua` and `fibertrace run post26.lua`;
-- under a Tarantool older than a case's feature the case is skipped. Prints
-- `ok NAME` / `not ok NAME: reason` / `skip NAME: reason` per case and a
-- closing `N passed, N failed` line (`, N skipped` added when some were);
-- exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')
local ffi = require('ffi')

---------------------------------------------------------------------------
-- The harness (harness.lua, beside this script)
---------------------------------------------------------------------------

local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
                 .. 'harness.lua')
local case, eq, truthy = t.case, t.eq, t.truthy
local fail, raises, show = t.fail, t.raises, t.show
local wait_dead, track, within = t.wait_dead, t.track, t.within
local child_stderr, older_than = t.child_stderr, t.older_than

---------------------------------------------------------------------------
-- Fiber slices (test/app-luatest/fiber_slice_test.lua; Tarantool 2.11)
---------------------------------------------------------------------------

local INFINITY = 100 * 365 * 86400
local T = 0.3      -- the slice the timing cases work with
local DELTA = 0.15 -- how far a measured run may be from its expected length

-- Calls fiber.check_slice() until it raises; gives up after 5 s.
local function check_until_exceeded()
    local stop = clock.monotonic() + 5
    while clock.monotonic() < stop do fiber.check_slice() end
    error('the slice was never exceeded', 0)
end

-- Runs body in a new joinable fiber (with a custom max slice if given) and
-- requires it to fail with "fiber slice is exceeded" after `expected` s.
local function expect_slice_error(body, expected, custom)
    local f = fiber.new(body)
    f:set_joinable(true)
    if custom then f:set_max_slice(custom) end
    local t0 = clock.monotonic()
    local st, err = f:join()
    local took = clock.monotonic() - t0
    eq(st, false, 'join status')
    eq(tostring(err), 'fiber slice is exceeded', 'error')
    truthy(math.abs(took - expected) <= DELTA,
           string.format('the fiber ran %.3f s, expected %.3f s', took, expected))
end

-- As in the test, the cases below run in order: the first sets the default
-- max slice to T, and the later ones change it where they say so.
case('slice_exceeded_after_default_max_slice', '2.11.0', function()
    fiber.set_max_slice(T)
    expect_slice_error(check_until_exceeded, T)
end)

case('slice_extended_by_number', '2.11.0', function()
    expect_slice_error(function()
        fiber.extend_slice(T / 2)
        check_until_exceeded()
    end, T * 1.5)
end)

case('slice_extended_by_table', '2.11.0', function()
    expect_slice_error(function()
        fiber.extend_slice({warn = T / 2, err = T / 2})
        check_until_exceeded()
    end, T * 1.5)
end)

case('slice_custom_max_slice_of_a_fiber', '2.11.0', function()
    expect_slice_error(check_until_exceeded, T / 2, T / 2)
end)

case('slice_set_from_inside_as_table', '2.11.0', function()
    expect_slice_error(function()
        fiber.set_slice({warn = T / 2, err = T / 2})
        check_until_exceeded()
    end, T / 2)
end)

case('slice_default_unchanged_by_the_above', '2.11.0', function()
    expect_slice_error(check_until_exceeded, T)
end)

case('slice_default_given_as_table', '2.11.0', function()
    fiber.set_max_slice({warn = T * 1.5, err = T * 1.5})
    expect_slice_error(check_until_exceeded, T * 1.5)
end)

case('slice_new_default_applies_to_running_fiber', '2.11.0', function()
    expect_slice_error(function()
        fiber.set_max_slice(T / 2)
        check_until_exceeded()
    end, T / 2)
end)

case('slice_custom_wins_over_new_default', '2.11.0', function()
    expect_slice_error(function()
        fiber.self():set_max_slice(T / 2)
        fiber.set_max_slice(T * 2)
        check_until_exceeded()
    end, T / 2)
end)

local BAD_SLICE = 'slice must be a number or a table {warn = <number>, err = <number>}'
local NEGATIVE = 'slice value must be >= 0'
local invalid_slices = {
    {'string', 'foo', BAD_SLICE},
    {'negative_number', -1, NEGATIVE},
    {'table_without_warn', {err = 1}, BAD_SLICE},
    {'table_without_err', {warn = 1}, BAD_SLICE},
    {'table_with_string_err', {warn = 1, err = 'foo'}, BAD_SLICE},
    {'table_with_string_warn', {warn = 'bar', err = 1}, BAD_SLICE},
    {'table_with_negative_err', {warn = 1, err = -1}, NEGATIVE},
    {'table_with_negative_warn', {warn = -1, err = 1}, NEGATIVE},
}
for _, row in ipairs(invalid_slices) do
    local label, slice, message = row[1], row[2], row[3]
    case('slice_rejects_' .. label, '2.11.0', function()
        raises(message, fiber.set_slice, slice)
        raises(message, fiber.extend_slice, slice)
        raises(message, fiber.set_max_slice, slice)
        raises(message, fiber.set_max_slice, fiber.self(), slice)
    end)
end

case('slice_warning_is_logged', '2.11.0', function()
    local err = child_stderr([[
        local fiber = require('fiber')
        fiber.set_slice({warn = 0.2, err = 0.5})
        pcall(function()
            local stop = os.clock() + 5
            while os.clock() < stop do fiber.check_slice() end
        end)
    ]])
    local want = 'fiber has not yielded for more than 0.200 seconds'
    truthy(err:find(want, 1, true) ~= nil,
           'the warning is logged (stderr: ' .. show(err) .. ')')
end)

-- fiber_object:info().max_slice shows the effective max slice; an infinite
-- part is left out.
local slice_infos = {
    {'number', 1.5, {err = 1.5}},
    {'table', {warn = 2.5, err = 5.5}, {warn = 2.5, err = 5.5}},
    {'infinite_err', {warn = 1.0, err = INFINITY}, {warn = 1.0}},
    {'infinite_warn', {warn = INFINITY, err = 2.0}, {err = 2.0}},
    {'both_infinite', {warn = INFINITY, err = INFINITY}, nil},
}
for _, row in ipairs(slice_infos) do
    local label, slice, want = row[1], row[2], row[3]
    case('slice_in_info_' .. label, '2.11.0', function()
        -- a custom max slice, set by the fiber on itself
        local f = fiber.new(function()
            fiber.self():set_max_slice(slice)
            return fiber.self():info().max_slice
        end)
        f:set_joinable(true)
        local res = {within(2, f.join, f)}
        eq(res, {true, want}, 'custom max_slice')
        -- the default max slice, seen by a new fiber
        fiber.set_max_slice(slice)
        local g = fiber.new(function() end)
        g:set_joinable(true)
        eq(g:info().max_slice, want, 'default max_slice')
        g:join()
    end)
end

-- Leave no finite default slice behind.
if not older_than('2.11.0') then
    pcall(fiber.set_max_slice, {warn = INFINITY, err = INFINITY})
end

---------------------------------------------------------------------------
-- fiber_object:info(), fiber_object:csw() (test/app/gh-5799-fiber-info,
-- test/app-luatest/gh_7210_backtrace_for_fiber_obj_info_test.lua)
---------------------------------------------------------------------------

case('object_info_backtrace_option', '2.11.0', function()
    eq(fiber.self():info({backtrace = false}).backtrace, nil,
       'backtrace with {backtrace = false}')
    eq(fiber.self():info({bt = false}).backtrace, nil,
       'backtrace with {bt = false}')
end)

case('object_info_matches_fiber_info', '2.10.0', function()
    local c = fiber.cond()
    local f = track(fiber.create(function() c:wait() end))
    local own, listed = f:info(), fiber.info()[f:id()]
    for _, key in ipairs({'fid', 'name', 'csw', 'memory', 'time', 'backtrace'}) do
        eq(own[key], listed[key], 'field ' .. key)
    end
    c:signal()
end)

case('csw_counts_yields_only', '2.10.0', function()
    local matches = 0
    local fibers = {}
    for i = 1, 100 do
        fibers[i] = fiber.new(function()
            for j = 1, 10 do
                fiber.yield()
                if j == fiber.self():csw() and j == fiber.self():info().csw then
                    matches = matches + 1
                end
            end
        end)
        fibers[i]:set_joinable(true)
    end
    for i = 1, 100 do
        eq({within(2, fibers[i].join, fibers[i])}, {true}, 'join of fiber ' .. i)
    end
    eq(matches, 1000, 'yields counted exactly')
end)

case('csw_of_dead_fiber_raises', '2.10.0', function()
    local dead = fiber.create(function() end)
    raises('the fiber is dead', dead.csw, dead)
end)

case('info_of_dead_fiber_raises', '2.10.0', function()
    local dead = fiber.create(function() end)
    raises('the fiber is dead', dead.info, dead)
end)

---------------------------------------------------------------------------
-- Join with a timeout (test/app/gh-6203-fiber-join-with-timeout; 2.10)
---------------------------------------------------------------------------

local function long_sleeper()
    local f = fiber.new(function() fiber.sleep(10) end)
    f:set_joinable(true)
    f:wakeup()
    fiber.yield()
    return track(f)
end

case('join_with_timeout_times_out', '2.10.0', function()
    local f = long_sleeper()
    local st, err = within(2, f.join, f, 0.1)
    eq(st, false, 'join status')
    eq(tostring(err), 'timed out', 'error')
end)

case('join_rejects_string_timeout', '2.10.0', function()
    local f = long_sleeper()
    raises('fiber:join(timeout): bad arguments', within, 2, f.join, f, 'xxx')
end)

case('join_rejects_negative_timeout', '2.10.0', function()
    local f = long_sleeper()
    raises('fiber:join(timeout): bad arguments', within, 2, f.join, f, -1)
end)

---------------------------------------------------------------------------
-- Concurrent joins (test/app-luatest/gh_7489_concurrent_fiber_join_test.lua;
-- 2.11) and joining oneself (test/app-luatest/fiber_test.lua; 3.2)
---------------------------------------------------------------------------

local ALREADY_JOINED = 'the fiber is already joined by concurrent fiber:join()'

local function second_joiner_fails(with_cancel)
    local blocked = true
    local f1 = fiber.new(function()
        while blocked do fiber.sleep(0.001) end
    end)
    f1:set_joinable(true)
    local f2 = fiber.new(function()
        blocked = false
        f1:join()
    end)
    f2:set_joinable(true)
    track(f1)
    track(f2)
    fiber.yield() -- f1 starts, then f2, which waits for f1
    if with_cancel then f1:cancel() end
    raises(ALREADY_JOINED, within, 2, f1.join, f1)
    within(2, f2.join, f2)
end

case('concurrent_join_is_detected', '2.11.0', function()
    second_joiner_fails(false)
end)

case('concurrent_join_is_detected_after_cancel', '2.11.0', function()
    second_joiner_fails(true)
end)

case('concurrent_join_does_not_join_a_reused_fiber', '2.11.0', function()
    local f1, f2
    local j1 = fiber.new(function()
        local st = f1:join()
        -- a new fiber, which may take over what the joined one left
        f2 = fiber.new(function() while true do fiber.sleep(0.001) end end)
        f2:set_joinable(true)
        return st
    end)
    local j2 = fiber.new(function()
        local ok, err = pcall(fiber.join, f1)
        return not ok and tostring(err) == ALREADY_JOINED
    end)
    f1 = fiber.new(function() end)
    j1:set_joinable(true)
    j2:set_joinable(true)
    f1:set_joinable(true)
    track(j1)
    track(j2)
    fiber.yield() -- j1, j2 and f1 start in this order
    eq({within(2, j1.join, j1)}, {true, true}, 'the first joiner')
    eq({within(2, j2.join, j2)}, {true, true}, 'the second joiner fails')
    if f2 then
        f2:cancel()
        within(2, f2.join, f2)
    end
end)

case('join_of_itself_is_rejected', '3.2.0', function()
    local f = fiber.new(function() fiber.self():join() end)
    f:set_joinable(true)
    track(f)
    f:wakeup()
    fiber.yield()
    local st, err = within(2, f.join, f)
    eq(st, false, 'join status')
    eq(tostring(err), 'cannot join itself', 'error')
end)

---------------------------------------------------------------------------
-- fiber:__serialize and tostring (test/app-luatest/fiber_test.lua)
---------------------------------------------------------------------------

case('serialize_of_new_fiber', nil, function()
    local f = fiber.new(function() end)
    local id = f:id()
    f:name('test fiber')
    eq(f:__serialize(), {id = id, name = 'test fiber', status = 'suspended'},
       '__serialize')
    fiber.yield()
end)

case('serialize_of_dead_fiber', '3.0.0', function()
    local f = fiber.new(function() end)
    local id = f:id()
    fiber.yield()
    eq(f:__serialize(), {id = id, status = 'dead'}, '__serialize')
end)

case('serialize_of_running_fiber', nil, function()
    eq(fiber.self():__serialize(),
       {id = fiber.self():id(), name = fiber.name(), status = 'running'},
       '__serialize')
end)

case('tostring_of_live_fiber', nil, function()
    local f = fiber.new(function() end)
    eq(tostring(f), 'fiber: ' .. f:id(), 'tostring')
    fiber.yield()
end)

case('tostring_of_dead_fiber', '3.0.0', function()
    local f = fiber.new(function() end)
    local id = f:id()
    fiber.yield()
    eq(tostring(f), 'fiber: ' .. id .. ' (dead)', 'tostring')
end)

---------------------------------------------------------------------------
-- Graceful channel close, chosen with compat.fiber_channel_close_mode
-- (test/app-luatest/gh_7746_fiber_channel_close_test.lua; 2.11). The 2.6
-- behaviour ("old", forceful) stays the default here; Tarantool 3.x defaults
-- to "new".
---------------------------------------------------------------------------

local function with_close_mode(mode, fn)
    local compat = require('compat')
    compat.fiber_channel_close_mode = mode
    local ok, err = pcall(fn)
    compat.fiber_channel_close_mode = 'default'
    if not ok then error(err, 0) end
end

case('channel_graceful_close_keeps_queued_values', '2.11.0', function()
    with_close_mode('new', function()
        local ch = fiber.channel(10)
        ch:put('one')
        ch:put('two')
        ch:put('three')
        eq(ch:get(), 'one', 'first value')
        ch:close()
        eq(ch:is_closed(), true, 'is_closed')
        eq(ch:put('four'), false, 'put after close')
        eq(ch:get(), 'two', 'value queued before close')
        eq(ch:is_closed(), true, 'is_closed after a get')
        eq(ch:get(), 'three', 'last queued value')
        eq(ch:get(), nil, 'get from the drained channel')
    end)
end)

case('channel_forceful_close_drops_queued_values', '2.11.0', function()
    with_close_mode('old', function()
        local ch = fiber.channel(10)
        ch:put('one')
        ch:put('two')
        ch:put('three')
        eq(ch:get(), 'one', 'first value')
        ch:close()
        eq(ch:is_closed(), true, 'is_closed')
        eq(ch:put('four'), false, 'put after close')
        eq(ch:get(), nil, 'get after close')
    end)
end)

case('channel_graceful_close_wakes_writer', '2.11.0', function()
    with_close_mode('new', function()
        local ch = fiber.channel(0)
        local seen = {}
        local f = track(fiber.new(function()
            seen.put = ch:put('one')
            seen.closed = ch:is_closed()
            seen.put_again = ch:put('one', 0)
        end))
        fiber.yield()
        ch:close()
        wait_dead(f, 1)
        eq(seen, {put = false, closed = true, put_again = false},
           'what the writer saw')
    end)
end)

case('channel_graceful_close_wakes_reader', '2.11.0', function()
    with_close_mode('new', function()
        local ch = fiber.channel(0)
        local seen = {}
        local f = track(fiber.new(function()
            seen.got = ch:get() or 'nil'
            seen.closed = ch:is_closed()
            seen.got_again = ch:get(0) or 'nil'
        end))
        fiber.yield()
        ch:close()
        wait_dead(f, 1)
        eq(seen, {got = 'nil', closed = true, got_again = 'nil'},
           'what the reader saw')
    end)
end)

-- test/app/fiber_channel.test.lua at newer tags: with a graceful close the
-- queued values live until the channel itself is collected.
case('channel_graceful_close_frees_values_with_channel', '2.11.0', function()
    with_close_mode('new', function()
        local refs = 0
        local ok, err = pcall(ffi.cdef, 'struct ft_post_gh756 { int k; };')
        if not ok and not tostring(err):match('attempt to redefine') then
            error(err)
        end
        local ct = ffi.metatype('struct ft_post_gh756',
                                {__gc = function() refs = refs - 1 end})
        refs = 10
        local ch = fiber.channel(refs)
        for i = 1, refs do ch:put(ffi.new(ct, i)) end
        local function take() return ch:get().k end
        eq({take(), take()}, {1, 2}, 'values taken')
        collectgarbage('collect')
        eq(refs, 8, 'live objects after two gets')
        ch:close()
        collectgarbage('collect')
        eq(refs, 8, 'live objects after a graceful close')
        ch = nil -- luacheck: ignore
        collectgarbage('collect')
        collectgarbage('collect')
        eq(refs, 0, 'live objects once the channel is collected')
    end)
end)

---------------------------------------------------------------------------
-- Signed 64-bit clocks (test/app-tap/clock.test.lua at newer tags; 2.10):
-- an earlier reading minus a later one is negative.
---------------------------------------------------------------------------

local function earlier_minus_later(read)
    local a = read()
    fiber.sleep(0.001)
    return a - read()
end

for _, row in ipairs({
    {'clock_time64', clock.time64}, {'clock_realtime64', clock.realtime64},
    {'clock_thread64', clock.thread64}, {'clock_monotonic64', clock.monotonic64},
    {'clock_proc64', clock.proc64}, {'fiber_time64', fiber.time64},
    {'fiber_clock64', fiber.clock64},
}) do
    case(row[1] .. '_can_be_subtracted', '2.10.0', function()
        truthy(earlier_minus_later(row[2]) < 0, 'the difference is negative')
    end)
end

t.finish()
