-- A worker pool where one worker is stuck: fiber.info() shows who waits on what, for how
-- long, and where (native and Lua frames interleaved). Prints YAML-like text, or JSON with
-- `--json`.
local fiber = require('fiber')

local jobs = fiber.channel(10)
local stuck = fiber.cond()  -- nobody ever signals it

local function handle(job)
  if job == 3 then
    stuck:wait()            -- the bug: waits for a reply that never comes
  end
  fiber.sleep(0.01 * job)
end

local function worker(n)
  fiber.name('worker-' .. n)
  while true do
    local job = jobs:get()
    if job == nil then return end
    handle(job)
  end
end

for n = 1, 3 do fiber.create(worker, n) end
for job = 1, 6 do jobs:put(job) end
fiber.sleep(0.2)

local function yaml(v, indent)
  indent = indent or ''
  if type(v) ~= 'table' then return tostring(v) end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local out = {}
  for _, k in ipairs(keys) do
    local x = v[k]
    if type(x) == 'table' and next(x) ~= nil and #x > 0 then
      out[#out + 1] = indent .. tostring(k) .. ':'
      for _, e in ipairs(x) do
        local ek, ev = next(e)
        out[#out + 1] = indent .. '- ' .. tostring(ek) .. ": '" .. tostring(ev) .. "'"
      end
    elseif type(x) == 'table' then
      out[#out + 1] = indent .. tostring(k) .. ':'
      out[#out + 1] = yaml(x, indent .. '  ')
    else
      out[#out + 1] = indent .. tostring(k) .. ': ' .. tostring(x)
    end
  end
  return table.concat(out, '\n')
end

local function json(v)
  if type(v) == 'table' then
    local out, n = {}, #v
    if n > 0 and v[1].fid == nil then   -- an array (fiber.info() itself is keyed by fid)
      for i = 1, n do out[i] = json(v[i]) end
      return '[' .. table.concat(out, ',') .. ']'
    end
    for k, x in pairs(v) do out[#out + 1] = string.format('%q:%s', tostring(k), json(x)) end
    return '{' .. table.concat(out, ',') .. '}'
  elseif type(v) == 'string' then
    return string.format('%q', v)
  end
  return tostring(v)
end

local info = fiber.info()
if arg[1] == '--json' then
  print(json(info))
else
  for fid, f in pairs(info) do
    if f.waiting and f.waiting.on ~= 'sleep' then
      print(string.format('-- fiber %d "%s" has waited %.2f s on %s', fid, f.name,
                          f.waiting.seconds, f.waiting.on))
    end
  end
  print(yaml(info))
end
os.exit(0)
