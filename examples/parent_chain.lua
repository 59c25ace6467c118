-- A benchmark, not a test: the cost of parent traces over long ancestries.
--
--   target/release/fibertrace run examples/parent_chain.lua [MAX_DEPTH] [GENERATIONS]
--
-- 1. A fiber that restarts itself GENERATIONS times (default 300000): each generation creates
--    its successor and exits. The resident memory must not grow with the generations (the
--    ancestry kept is capped): it is printed at each third of the run.
-- 2. For D = 1000, 2000, 5000, 10000 (up to MAX_DEPTH, default 10000): a chain of D fibers,
--    each created by the one before (all alive, asleep), then one `fiber.info()`: its time,
--    the peak resident memory during the call (above the resident memory before it), and how
--    many parent-trace entries the deepest fiber shows (capped: the last entry counts the
--    ancestors left out). Time and memory must grow linearly with D.
--
-- Runs unchanged under `tarantool examples/parent_chain.lua` (2.10+ shows one parent level).
-- Peak memory is read from VmHWM after resetting it (`/proc/self/clear_refs`); where that
-- cannot be reset the column says so.
local fiber = require('fiber')
local clock = require('clock')
-- (Tarantool 2.6 has no parent traces: there the script measures plain fiber.info().)
if fiber.parent_backtrace_enable then fiber.parent_backtrace_enable() end

local max_depth = tonumber(arg and arg[1]) or 10000
local generations = tonumber(arg and arg[2]) or 300000

local function status_kib(key)
  local f = io.open('/proc/self/status')
  if not f then return -1 end
  local s = f:read('*a')
  f:close()
  return tonumber(s:match(key .. ':%s+(%d+)')) or -1
end

local function reset_peak()
  local f = io.open('/proc/self/clear_refs', 'w')
  if not f then return false end
  local ok = f:write('5')
  f:close()
  return ok and true or false
end

local function mib(kib) return kib / 1024 end

-- The first report loads the program's symbol tables (about 30 MiB, once): done before any
-- figure is taken, so the figures show only what the fibers and their traces cost.
fiber.info()

-- Generations: each creates its successor (which starts once it ended) and exits.
collectgarbage()
collectgarbage()
local rss0 = status_kib('VmRSS')
local done = 0
local t0 = clock.monotonic()
local function generation()
  done = done + 1
  if done < generations then fiber.new(generation) end
end
fiber.new(generation)
print(string.format('%9s  %9s  %8s', 'gens', 'rss MiB', 'seconds'))
print(string.format('%9d  %9.1f  %8.1f', 0, mib(rss0), 0))
for third = 1, 3 do
  local upto = math.floor(generations * third / 3)
  while done < upto do fiber.sleep(0.001) end
  collectgarbage()
  print(string.format('%9d  %9.1f  %8.1f', done, mib(status_kib('VmRSS')),
    clock.monotonic() - t0))
end
fiber.sleep(0.01) -- the last one ends
print()

print(string.format('%6s  %9s  %14s  %14s  %s', 'D', 'info s', 'peak +MiB', 'rss after MiB',
  'parent entries of the deepest'))
for _, d in ipairs({1000, 2000, 5000, 10000}) do
  if d > max_depth then break end
  local chain = {}
  local function link(n)
    chain[#chain + 1] = fiber.self()
    if n > 1 then fiber.create(link, n - 1) end
    fiber.sleep(3600)
  end
  fiber.create(link, d)
  collectgarbage()
  collectgarbage()
  local before = status_kib('VmRSS')
  local resettable = reset_peak()
  local t0 = clock.monotonic()
  local all = fiber.info()
  local dt = clock.monotonic() - t0
  local peak = resettable and (status_kib('VmHWM') - before) or -1
  local deepest = all[chain[#chain]:id()]
  local pbt = deepest.parent_backtrace or {}
  local last = pbt[#pbt]
  local shown = #pbt .. (last and (' (last: ' .. (last.C or last.L) .. ')') or '')
  all, deepest, pbt, last = nil, nil, nil, nil
  collectgarbage()
  collectgarbage()
  print(string.format('%6d  %9.3f  %14s  %14.1f  %s', d, dt,
    resettable and string.format('%.1f', mib(peak)) or 'n/a',
    mib(status_kib('VmRSS')), shown))
  for _, f in ipairs(chain) do fiber.cancel(f) end
  chain = nil
  fiber.sleep(0.01) -- the cancelled fibers end
end

os.exit(0)
