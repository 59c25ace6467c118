local fiber = require('fiber')
local function leaf(n)
  fiber.sleep(1000)
end
local function middle(n)
  leaf(n)
end
for i = 1, 3 do
  fiber.create(function() middle(i) end):name('worker' .. i)
end
local ch = fiber.channel()
fiber.create(function() ch:get() end):name('reader')
print('ready')
io.stdout:flush()
fiber.sleep(1000)
