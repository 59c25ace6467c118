-- Which fiber holds the memory? Run: fibertrace run --heap examples/heap.lua
-- (--heap=every records every allocation's stack; --heap alone samples, for production).
local fiber = require('fiber')
local cache = {}
local function remember(k, v) cache[k] = v end
local function load_user(id) remember(id, string.rep('u', 200) .. id) end
fiber.create(function()
  fiber.self():name('loader')
  for i = 1, 5000 do load_user(i) end
  fiber.sleep(1000)
end)
fiber.create(function() fiber.self():name('idle') fiber.sleep(1000) end)
fiber.sleep(0)
for _, f in pairs(fiber.info()) do print(f.fid, f.name, f.memory.heap) end
print(require('fibertrace').heap{format = 'text', top = 1})
os.exit(0)
