-- Who created this fiber? With parent traces on, every Lua-created fiber keeps the trace of
-- its creator at the fiber.create call (native and Lua frames), chained through ancestors.
local fiber = require('fiber')
fiber.parent_backtrace_enable()

local function serve(conn)
  fiber.sleep(60)           -- a request handler, blocked
end

local function accept_loop()
  for conn = 1, 2 do
    fiber.create(serve, conn)
  end
  fiber.sleep(60)
end

local function start_server()
  local f = fiber.create(accept_loop)   -- (not a tail call: LuaJIT drops tail-calling frames)
  return f
end

start_server()
for fid, f in pairs(fiber.info()) do
  if f.parent_backtrace then
    print(string.format('fiber %d "%s" (%s), created by fiber %d', fid, f.name, f.status, f.parent))
    print('  backtrace:')
    for _, e in ipairs(f.backtrace) do print('    ' .. (e.C or e.L)) end
    print('  parent_backtrace:')
    for _, e in ipairs(f.parent_backtrace) do print('    ' .. (e.C or e.L)) end
  end
end
os.exit(0)
