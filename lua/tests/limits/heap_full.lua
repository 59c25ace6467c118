if jit then jit.off() end
local fiber = require('fiber')
local clock = require('clock')
local table_new = require('table.new')
local function vmsize()
  local f = io.open('/proc/self/status')
  local s = f:read('*a') f:close()
  return tonumber(s:match('VmSize:%s*(%d+)'))
end
-- everything the calls need, made before the heap is full
local ch = fiber.channel(10)
local ch0 = fiber.channel(0)
local cond = fiber.cond()
local other = fiber.new(function() fiber.sleep(1000) end)
local joinable = fiber.new(function() return 1 end)
joinable:set_joinable(true)
fiber.yield()
local calls = {
  {'fiber.self', fiber.self}, {'fiber.cond', fiber.cond}, {'fiber.channel', fiber.channel},
  {'fiber.create', fiber.create, function() end}, {'fiber.new', fiber.new, function() end},
{'fiber.status', fiber.status}, {'fiber.name', fiber.name},
  {'fiber.find', fiber.find, 1}, {'tostring(other)', tostring, other},
  {'ch:put', ch.put, ch, 1}, {'ch:get', ch.get, ch, 0}, {'tostring(ch)', tostring, ch},
  {'tostring(cond)', tostring, cond}, {'ch0:put', ch0.put, ch0, 1, 0},
  {'fiber.id', fiber.id}, {'fiber.yield', fiber.yield}, {'fiber.sleep', fiber.sleep, 0},
  {'cond:signal', cond.signal, cond}, {'cond:wait', cond.wait, cond, 0},
  {'fiber.time', fiber.time}, {'fiber.clock', fiber.clock}, {'clock.time', clock.time},
  {'clock.monotonic', clock.monotonic}, {'fiber.time64', fiber.time64}, {'clock.time64', clock.time64},
  {'fiber.set_slice', fiber.set_slice, {warn = 10, err = 20}},
  {'joinable:join', joinable.join, joinable},
  {'fiber.info', fiber.info}, {'fiber.info{bt=false}', fiber.info, {backtrace = false}},
  {'other:info', other.info, other}, {'fiber.self():info', function() return fiber.self():info() end},
}
local results = table_new(#calls, 0)
local holder = table_new(1000000, 0)
for i = 1, #calls do results[i] = false end
local errs = table_new(#calls, 0)
local oks = table_new(#calls, 0)
for i = 1, #calls do errs[i] = false oks[i] = false end
local pcall, select, tostring_ = pcall, select, tostring
if arg[1] == 'measure' then print(vmsize()) os.exit(0) end
print('before')
io.stdout:flush()
local k = 0
local function grabs() k = k + 1 holder[k] = tostring_(k + 1e9) end
collectgarbage() collectgarbage()
collectgarbage('stop')
-- fill the heap
local fill = nil
local nfill = 0
local function grab(n) local t = table_new(n, 1) t.next = fill fill = t nfill = nfill + 1 end
for _, n in ipairs({65536, 4096, 256, 16, 1, 0}) do
  while pcall(grab, n) do end
end
while pcall(grabs) do end
for i = 1, #calls do
  local c = calls[i]
  local ok, e = pcall(c[2], select(3, unpack(c)))
  oks[i] = ok
  errs[i] = e
end
fill = nil holder = nil
collectgarbage('restart') collectgarbage()
for i = 1, #calls do
  print(calls[i][1], oks[i], type(errs[i]) == 'string' and errs[i] or type(errs[i]))
end
local info = fiber.info()
print('info again', info[fiber.id()] ~= nil and #info[fiber.id()].backtrace > 0, info[other:id()].status)
print("after")
os.exit(0)
