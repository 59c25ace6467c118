-- The harness of the scripts of this directory: cases, checks and helpers.
-- Each script loads it from its own directory, so that it runs from any
-- directory, under `tarantool SCRIPT` and `fibertrace run SCRIPT` alike:
--
--   local t = dofile((debug.getinfo(1, 'S').source:match('^@(.*/)') or '')
--                    .. 'harness.lua')
--
-- A case prints `ok NAME` or `not ok NAME: reason` (or, under a Tarantool
-- older than the case's feature, `skip NAME: ...`); `t.finish()` prints the
-- closing `N passed, N failed` line and exits 1 if any case failed.

local fiber = require('fiber')
local clock = require('clock')

local t = {}
local passed, failed, skipped = 0, 0, 0
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
t.show = show

local function same(a, b)
    if type(a) ~= 'table' or type(b) ~= 'table' then return a == b end
    for k, v in pairs(a) do if not same(v, b[k]) then return false end end
    for k in pairs(b) do if a[k] == nil then return false end end
    return true
end
t.same = same

local function fail(msg) error(msg, 0) end
t.fail = fail

local function eq(got, want, what)
    if not same(got, want) then
        fail(string.format('%s: expected %s, got %s', what or 'value',
                           show(want), show(got)))
    end
end
t.eq = eq

local function truthy(v, what)
    if not v then fail((what or 'condition') .. ' does not hold') end
end
t.truthy = truthy

-- Calls fn(...) and requires it to raise exactly `want`.
function t.raises(want, fn, ...)
    local ok, err = pcall(fn, ...)
    if ok then fail(string.format('expected error %q, the call succeeded', want)) end
    eq(tostring(err), want, 'error')
end

-- Waits (yielding) until cond() is true; false after `timeout` seconds.
local function wait_until(cond, timeout)
    local deadline = clock.monotonic() + (timeout or 2)
    while not cond() do
        if clock.monotonic() > deadline then return false end
        fiber.sleep(0.001)
    end
    return true
end
t.wait_until = wait_until

function t.wait_dead(f, timeout)
    truthy(wait_until(function() return f:status() == 'dead' end, timeout),
           'the fiber ends in time')
end

-- A fiber that a case leaves behind is cancelled after the case.
function t.track(f)
    tracked[#tracked + 1] = f
    return f
end

-- "file:line: " of the caller, as luaL_error prefixes a message raised by a
-- C function that the caller called (not as a tail call).
function t.here()
    local info = debug.getinfo(2, 'Sl')
    return info.short_src .. ':' .. info.currentline .. ': '
end

function t.nothing() end

local function pack(...) return {n = select('#', ...), ...} end
t.pack = pack

-- Runs fn(...) in a helper fiber and returns its results (or raises its
-- error); raises if it has not returned within `timeout` seconds, so that a
-- hang becomes a failure.
function t.within(timeout, fn, ...)
    local args = pack(...)
    local out
    local helper = fiber.create(function()
        out = pack(pcall(fn, unpack(args, 1, args.n)))
    end)
    local deadline = clock.monotonic() + timeout
    while out == nil do
        if clock.monotonic() > deadline then
            pcall(fiber.cancel, helper)
            fail('no return within ' .. timeout .. ' s (hangs)')
        end
        fiber.sleep(0.001)
    end
    if not out[1] then error(out[2], 0) end
    return unpack(out, 2, out.n)
end

-- Runs a Lua source with the same program that runs this script, in a
-- child process; returns what it wrote to the stream `which` ('stdout' or
-- 'stderr'; Tarantool's log goes to stderr without box.cfg).
local function child_output(source, which)
    local low = 0
    while arg[low - 1] ~= nil do low = low - 1 end
    local prog = arg[low]
    local path = os.tmpname()
    local file = assert(io.open(path, 'w'))
    file:write(source)
    file:close()
    local run = rawget(_G, '_TARANTOOL') and '' or ' run'
    local redirect = which == 'stderr' and '2>&1 >/dev/null' or '2>/dev/null'
    local pipe = io.popen(string.format("timeout 20 '%s'%s '%s' %s",
                                        prog, run, path, redirect))
    local out = pipe:read('*a')
    pipe:close()
    os.remove(path)
    return out
end
t.child_output = child_output

function t.child_stderr(source) return child_output(source, 'stderr') end

-- Under Tarantool (which sets _TARANTOOL), a case whose feature came in a
-- later version than the one running is skipped; other programs run all.
local running = rawget(_G, '_TARANTOOL')

local function older_than(since)
    if running == nil or since == nil then return false end
    local have = {running:match('^(%d+)%.(%d+)%.(%d+)')}
    local need = {since:match('^(%d+)%.(%d+)%.(%d+)')}
    for i = 1, 3 do
        local h, n = tonumber(have[i]), tonumber(need[i])
        if h ~= n then return h < n end
    end
    return false
end
t.older_than = older_than

-- case(NAME, FN) or case(NAME, SINCE, FN): SINCE is the first Tarantool
-- version with the behaviour (nil: every version has it).
function t.case(name, since, fn)
    if fn == nil then since, fn = nil, since end
    if older_than(since) then
        skipped = skipped + 1
        print(string.format('skip %s: needs Tarantool %s, this is %s',
                            name, since, running))
        return
    end
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

-- The closing line, and the exit: 1 if any case failed.
function t.finish()
    local summary = string.format('%d passed, %d failed', passed, failed)
    if skipped > 0 then summary = summary .. string.format(', %d skipped', skipped) end
    print(summary)
    io.stdout:flush()
    os.exit(failed == 0 and 0 or 1)
end

return t
