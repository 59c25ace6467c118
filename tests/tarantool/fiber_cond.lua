-- The cases of Tarantool's test/app/fiber_cond.test.lua (tag 2.6.0),
-- re-expressed as a plain script. Runs unchanged under
-- `tarantool fiber_cond.lua` and `fibertrace run fiber_cond.lua`; prints
-- `ok NAME` / `not ok NAME: reason` per case and a closing
-- `N passed, N failed` line; exits 1 on any failure.

local fiber = require('fiber')
local clock = require('clock')

---------------------------------------------------------------------------
-- A tiny harness (kept inline so that the script runs from any directory)
---------------------------------------------------------------------------

local passed, failed = 0, 0
local tracked = {}

local function show(v)
    if type(v) == 'string' then return string.format('%q', v) end
    if type(v) ~= 'table' then return tostring(v) end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b)
        if type(a) == type(b) and type(a) == 'number' then return a < b end
        return tostring(a) < tostring(b)
    end)
    local parts = {}
    for i, k in ipairs(keys) do
        local key = type(k) == 'number' and '' or (tostring(k) .. '=')
        parts[i] = key .. show(v[k])
    end
    return '{' .. table.concat(parts, ', ') .. '}'
end

local function same(a, b)
    if type(a) ~= 'table' or type(b) ~= 'table' then return a == b end
    for k, v in pairs(a) do if not same(v, b[k]) then return false end end
    for k in pairs(b) do if a[k] == nil then return false end end
    return true
end

local function fail(msg) error(msg, 0) end

local function eq(got, want, what)
    if not same(got, want) then
        fail(string.format('%s: expected %s, got %s', what or 'value',
                           show(want), show(got)))
    end
end

local function truthy(v, what)
    if not v then fail((what or 'condition') .. ' does not hold') end
end

-- Calls fn(...) and requires it to raise exactly `want`.
local function raises(want, fn, ...)
    local ok, err = pcall(fn, ...)
    if ok then fail(string.format('expected error %q, the call succeeded', want)) end
    eq(tostring(err), want, 'error')
end

-- A fiber that a case leaves behind is cancelled after the case.
local function track(f)
    tracked[#tracked + 1] = f
    return f
end

local function case(name, fn)
    tracked = {}
    local ok, err = pcall(fn)
    for _, f in ipairs(tracked) do pcall(fiber.cancel, f) end
    if ok then
        passed = passed + 1
        print('ok ' .. name)
    else
        failed = failed + 1
        print('not ok ' .. name .. ': ' .. tostring(err))
    end
end

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

print(string.format('%d passed, %d failed', passed, failed))
io.stdout:flush()
os.exit(failed == 0 and 0 or 1)
