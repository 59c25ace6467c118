-- Benchmarks that run unchanged under `tarantool bench.lua` and `fibertrace run bench.lua`.
-- Prints one figure per line.
--   the first fiber.info() of the process: its time and the resident memory it added;
--   fiber.create of an empty function (create + run), per fiber;
--   yield ping-pong between two Lua fibers, per switch;
--   fiber.info() over N sleeping fibers (three Lua calls deep), with and without backtraces
--   (the best of 11 calls, and their mean), and with backtraces when every fiber has run
--   since the last call.
local fiber = require('fiber')
local clock = require('clock')

local N_CREATE = tonumber(arg[1]) or 200000
local N_SWITCH = tonumber(arg[2]) or 1000000
local N_SLEEPERS = tonumber(arg[3]) or 10000

-- The best of `runs` timed calls of f, and their mean (the mean carries each call's share
-- of the garbage collector's work, which the best call mostly escapes).
local function best(runs, f)
    local min, sum = math.huge, 0
    for _ = 1, runs do
        local t0 = clock.monotonic()
        f()
        local dt = clock.monotonic() - t0
        sum = sum + dt
        if dt < min then min = dt end
    end
    return min, sum / runs
end

-- 0. The first fiber.info() of the process, one fiber asleep: what loading what a listing
--    needs (the program's symbols) costs, in time and in resident memory (anonymous and
--    file-backed: a mapped file's pages read count).
local function resident_kb()
    local f = io.open('/proc/self/status')
    if not f then return 0 end
    local s = f:read('*a')
    f:close()
    return (tonumber(s:match('RssAnon:%s+(%d+)')) or 0) + (tonumber(s:match('RssFile:%s+(%d+)')) or 0)
end
do
    local sleeper = fiber.create(function() fiber.sleep(1e6) end)
    local kb = resident_kb()
    local t0 = clock.monotonic()
    fiber.info()
    local dt = clock.monotonic() - t0
    print(string.format('first fiber.info() of the process: %.3f ms, resident memory +%d kB',
        dt * 1e3, resident_kb() - kb))
    sleeper:cancel()
end

-- 1. create + run of an empty function.
local function empty() end
local dt = best(5, function()
    for _ = 1, N_CREATE do fiber.create(empty) end
end)
print(string.format('fiber.create (create + run): %.0f ns per fiber', dt / N_CREATE * 1e9))

-- 2. yield ping-pong between two fibers.
local function pinger(n)
    for _ = 1, n do fiber.yield() end
end
dt = best(3, function()
    local a = fiber.new(pinger, N_SWITCH)
    local b = fiber.new(pinger, N_SWITCH)
    a:set_joinable(true)
    b:set_joinable(true)
    a:join()
    b:join()
end)
print(string.format('yield ping-pong: %.1f ns per switch', dt / (2 * N_SWITCH) * 1e9))

-- 3. fiber.info() over sleeping fibers.
local function leaf() while true do fiber.sleep(1e6) end end
local function mid() leaf() end
local function top() mid() end
local sleepers = {}
for i = 1, N_SLEEPERS do sleepers[i] = fiber.create(top) end
local count = 0
for _ in pairs(fiber.info()) do count = count + 1 end
local mean
dt, mean = best(11, function() fiber.info() end)
print(string.format('fiber.info() over %d fibers: %.3f ms', count, dt * 1e3))
print(string.format('fiber.info() over %d fibers, mean of 11 calls: %.3f ms', count, mean * 1e3))
dt, mean = best(11, function() fiber.info({backtrace = false}) end)
print(string.format('fiber.info({backtrace = false}) over %d fibers: %.3f ms', count, dt * 1e3))
print(string.format('fiber.info({backtrace = false}) over %d fibers, mean of 11 calls: %.3f ms',
    count, mean * 1e3))
-- The same, each fiber having run since the last call (woken, back to sleep): no trace of
-- an earlier call may be reused.
dt = math.huge
for _ = 1, 5 do
    for i = 1, N_SLEEPERS do sleepers[i]:wakeup() end
    fiber.yield()
    local t0 = clock.monotonic()
    fiber.info()
    local d = clock.monotonic() - t0
    if d < dt then dt = d end
end
print(string.format('fiber.info() over %d fibers, each moved since: %.3f ms', count, dt * 1e3))
for i = 1, N_SLEEPERS do sleepers[i]:cancel() end
os.exit(0)
