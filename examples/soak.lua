-- A soak, not a test: a million fibers created and cancelled while another fiber reads
-- fiber.info() (with backtraces) over and over; prints the resident memory at each tenth of
-- the run, which must stay flat. Runs unchanged under `tarantool examples/soak.lua`.
--
--   target/release/fibertrace run examples/soak.lua [CYCLES]
local fiber = require('fiber')
local cycles = tonumber(arg and arg[1]) or 1000000

local function rss_kib()
  local f = io.open('/proc/self/statm')
  if not f then return -1 end
  local s = f:read('*a')
  f:close()
  local pages = tonumber(s:match('^%d+%s+(%d+)'))
  return pages * 4
end

local t0 = os.clock()
local done = false
local passes = 0
local reader = fiber.create(function()
  while not done do
    local all = fiber.info()
    passes = passes + 1
    fiber.yield()
  end
end)
print(string.format('cycles %d, start: rss %d KiB', cycles, rss_kib()))
local step = math.max(1, math.floor(cycles / 10))
for i = 1, cycles do
  local f = fiber.create(function() fiber.sleep(3600) end)
  fiber.cancel(f)
  fiber.yield() -- the cancelled fiber ends (and the reader takes its turn)
  if i % step == 0 then
    collectgarbage()
    print(string.format('%8d cycles  %6.1f s cpu  rss %d KiB', i, os.clock() - t0, rss_kib()))
  end
end
done = true
fiber.yield()
print(string.format('done: %d info passes, rss %d KiB', passes, rss_kib()))
