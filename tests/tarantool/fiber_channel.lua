-- The cases of Tarantool's test/app/fiber_channel.test.lua (tag 2.6.0),
-- re-expressed as a plain script, plus the unbuffered-channel close cases of
-- the newer test/app-luatest/gh_7746_fiber_channel_close_test.lua that hold
-- in 2.6 too. Runs unchanged under `tarantool fiber_channel.lua` and
-- `fibertrace run fiber_channel.lua`; prints `ok NAME` / `not ok NAME: reason`
-- per case and a closing `N passed, N failed` line; exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')
local ffi = require('ffi')

---------------------------------------------------------------------------
-- The harness (harness.lua, beside this script)
---------------------------------------------------------------------------

local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
                 .. 'harness.lua')
local case, eq, truthy = t.case, t.eq, t.truthy
local raises, wait_until, wait_dead = t.raises, t.wait_until, t.wait_dead
local track = t.track

---------------------------------------------------------------------------
-- Cases
---------------------------------------------------------------------------

local extra = {'Extra', 'arguments', 'are', 'ignored'}

case('new_channel_state', function()
    local ch = fiber.channel(1)
    eq(ch:size(), 1, 'size')
    eq(ch:count(), 0, 'count')
    eq(ch:is_full(), false, 'is_full')
    eq(ch:is_empty(), true, 'is_empty')
end)

case('methods_ignore_extra_arguments', function()
    local ch = fiber.channel(1)
    eq(ch:size(unpack(extra)), 1, 'size')
    eq(ch:count(unpack(extra)), 0, 'count')
    eq(ch:is_full(unpack(extra)), false, 'is_full')
    eq(ch:is_empty(unpack(extra)), true, 'is_empty')
end)

case('get_times_out_on_empty_channel', function()
    local ch = fiber.channel(1)
    -- (timeouts count on the event loop's clock, fiber.clock(), which may lag
    -- behind clock.monotonic() on a loaded machine)
    local t0 = fiber.clock()
    eq(ch:get(.1), nil, 'get(.1)')
    truthy(fiber.clock() - t0 >= 0.09, 'get(.1) waits 0.1 s')
    eq(ch:get(.1, nil), nil, 'get(.1, nil)')
    eq(ch:get(.1, nil, unpack(extra)), nil, 'get(.1, nil, ...)')
end)

case('tostring_of_empty_channel', function()
    eq(tostring(fiber.channel(1)), 'channel: 0', 'tostring')
end)

case('put_without_value_raises', function()
    local ch = fiber.channel(1)
    raises('usage: channel:put(var [, timeout])', ch.put, ch)
    eq(ch:count(), 0, 'count')
end)

case('put_then_get', function()
    local ch = fiber.channel(1)
    eq(ch:put('test'), true, 'put')
    eq(tostring(ch), 'channel: 1', 'tostring')
    eq(ch:get(), 'test', 'get')
end)

case('put_with_nil_timeout_and_extra_arguments', function()
    local ch = fiber.channel(1)
    eq({ch:put('test', nil), ch:get()}, {true, 'test'}, 'put(v, nil), get()')
    eq({ch:put('test', nil, unpack(extra)), ch:get()}, {true, 'test'},
       'put(v, nil, ...), get()')
end)

case('get_rejects_string_timeout', function()
    local ch = fiber.channel(1)
    raises('usage: channel:get([timeout])', ch.get, ch, 'wrong timeout')
end)

case('get_rejects_negative_timeout', function()
    local ch = fiber.channel(1)
    raises('usage: channel:get([timeout])', ch.get, ch, -10)
end)

-- The next cases share one channel and one reader, as the test does.
local shared = fiber.channel(1)
local buffer = {}
local reader

case('put_times_out_on_full_channel', function()
    eq(shared:put(234), true, 'put into the free slot')
    eq(shared:put(345, .1), false, 'put into the full channel')
    eq(shared:count(), 1, 'count')
    eq(shared:is_full(), true, 'is_full')
    eq(shared:is_empty(), false, 'is_empty')
end)

case('reader_fiber_takes_every_put', function()
    reader = fiber.create(function()
        while true do table.insert(buffer, shared:get()) end
    end)
    local results = {}
    for i = 1, 10 do table.insert(results, {i, shared:put(i, 0.1)}) end
    local want = {}
    for i = 1, 10 do want[i] = {i, true} end
    eq(results, want, 'results of the puts')
    -- (the test runs in the console, whose statements each take a loop turn)
    fiber.sleep(0)
    eq(shared:has_readers(), true, 'has_readers')
    eq(shared:has_writers(), false, 'has_writers')
end)

case('cancelled_reader_is_gone', function()
    fiber.cancel(reader)
    eq(shared:has_readers(), false, 'has_readers')
    eq(shared:has_writers(), false, 'has_writers')
    eq(shared:count(), 0, 'count')
end)

case('get_with_numeric_timeout_takes_value', function()
    local v = 4242
    eq(shared:put(v), true, 'put')
    eq(shared:count(), 1, 'count')
    eq(shared:is_full(), true, 'is_full')
    eq(shared:is_empty(), false, 'is_empty')
    eq(shared:get(v), v, 'get(timeout)')
end)

case('reader_got_values_in_order', function()
    eq(buffer, {234, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 'values read')
    eq(shared:is_empty(), true, 'is_empty')
    eq(shared:is_full(), false, 'is_full')
end)

case('two_readers_share_the_puts', function()
    local ch = fiber.channel(1)
    local got = {}
    local function read_forever()
        while true do table.insert(got, ch:get()) end
    end
    track(fiber.create(read_forever))
    track(fiber.create(read_forever))
    eq(ch:is_full(), false, 'is_full')
    eq(ch:is_empty(), true, 'is_empty')
    for i = 1, 5 do eq(ch:put(i), true, 'put ' .. i) end
    local results = {}
    for i = 35, 45 do table.insert(results, ch:put(i)) end
    eq(results, {true, true, true, true, true, true, true, true, true, true,
                 true}, 'results of the puts')
    truthy(wait_until(function() return #got >= 16 end, 2),
           'all values read')
    table.sort(got)
    eq(got, {1, 2, 3, 4, 5, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45},
       'values read')
end)

case('close_wakes_reader_with_nil', function()
    local ch = fiber.channel(1)
    eq(ch:is_closed(), false, 'is_closed before close')
    local got = 'nothing'
    local f = fiber.create(function() got = ch:get() end)
    eq(type(f), 'userdata', 'type of a fiber')
    ch:close()
    fiber.yield()
    eq(got, nil, 'value the waiting reader got')
    eq(ch:get(), nil, 'get after close')
    eq(ch:get(), nil, 'get after close, again')
    eq(ch:put(10), false, 'put after close')
    eq(ch:is_closed(), true, 'is_closed after close')
end)

case('tostring_of_closed_channel', function()
    local ch = fiber.channel(1)
    ch:close()
    eq(tostring(ch), 'channel: closed', 'tostring')
end)

case('close_wakes_blocked_writer_with_false', function()
    local ch = fiber.channel(1)
    eq(ch:put(true), true, 'put into the free slot')
    eq(ch:is_closed(), false, 'is_closed before close')
    local res = 'nothing'
    fiber.create(function() res = ch:put(true) end)
    ch:close()
    fiber.yield()
    eq(res, false, 'result of the blocked put')
    -- Tarantool 2.6 closes forcefully: the queued value is dropped.
    eq(ch:get(), nil, 'get after close')
    eq(ch:get(), nil, 'get after close, again')
    eq(ch:put(10), false, 'put after close')
    eq(ch:is_closed(), true, 'is_closed after close')
end)

case('race_of_pushers_and_receivers', function()
    local chans, res, count = {}, {}, 0
    for i = 1, 10 do chans[i] = fiber.channel() end
    for i = 1, 10 do
        track(fiber.create(function(no)
            fiber.self():name('pusher')
            while true do
                chans[no]:put({no})
                fiber.sleep(0.001 * math.random())
            end
        end, i))
    end
    for i = 1, 10 do
        track(fiber.create(function(no)
            fiber.self():name('receiver')
            while true do
                local r = chans[no]:get(math.random() * .001)
                if r ~= nil and r[1] == no then
                    res[no] = true
                elseif r ~= nil then
                    break
                end
                fiber.sleep(0.001 * math.random())
                count = count + 1
            end
            res[no] = false
        end, i))
    end
    truthy(wait_until(function() return count > 2000 end, 5),
           'more than 2000 receive rounds')
    eq(#res, 10, 'receivers with a result')
    eq(res, {true, true, true, true, true, true, true, true, true, true},
       'every receiver got its own values')
end)

case('gh756_close_frees_queued_values', function()
    local refs = 0
    local ok, err = pcall(ffi.cdef, 'struct ft_gh756 { int k; };')
    if not ok and not tostring(err):match('attempt to redefine') then
        error(err)
    end
    local ct = ffi.metatype('struct ft_gh756',
                            {__gc = function() refs = refs - 1 end})
    refs = 10
    local ch = fiber.channel(refs)
    for i = 1, refs do ch:put(ffi.new(ct, i)) end
    -- a helper frame, so that no register keeps the object alive
    local function take() return ch:get().k end
    eq(take(), 1, 'first value')
    collectgarbage('collect')
    eq(refs, 9, 'live objects after the first get')
    eq(take(), 2, 'second value')
    collectgarbage('collect')
    eq(refs, 8, 'live objects after the second get')
    ch:close()
    collectgarbage('collect')
    eq(refs, 0, 'live objects after close')
end)

-- From test/app-luatest/gh_7746_fiber_channel_close_test.lua (newer tags),
-- whose unbuffered-channel cases hold in both close modes and in 2.6.
case('close_wakes_writer_on_unbuffered_channel', function()
    local ch = fiber.channel(0)
    local seen = {}
    local f = fiber.new(function()
        seen.open_before = not ch:is_closed()
        seen.put = ch:put('one')
        seen.closed_after = ch:is_closed()
        seen.put_again = ch:put('one', 0)
    end)
    track(f)
    fiber.yield()
    ch:close()
    eq(ch:is_closed(), true, 'is_closed')
    wait_dead(f, 1)
    eq(seen, {open_before = true, put = false, closed_after = true,
              put_again = false}, 'what the writer saw')
end)

case('close_wakes_reader_on_unbuffered_channel', function()
    local ch = fiber.channel(0)
    local seen = {}
    local f = fiber.new(function()
        seen.open_before = not ch:is_closed()
        seen.got = ch:get() or 'nil'
        seen.closed_after = ch:is_closed()
        seen.got_again = ch:get(0) or 'nil'
    end)
    track(f)
    fiber.yield()
    ch:close()
    eq(ch:is_closed(), true, 'is_closed')
    wait_dead(f, 1)
    eq(seen, {open_before = true, got = 'nil', closed_after = true,
              got_again = 'nil'}, 'what the reader saw')
end)

t.finish()
