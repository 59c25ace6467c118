-- What recording every allocation's stack costs a Lua script, per allocation: a table made
-- N times at coroutine depth 0, 1 and 10 (each level's frames are read at every allocation),
-- then at recursion depth 50 and 200.
-- Compare `fibertrace run examples/heap_cost.lua` with `fibertrace run --heap=every
-- examples/heap_cost.lua` (also `--leaks`, which records the same way).
local clock = require('clock')
local N = tonumber(arg[1]) or 20000

local function work(depth)
    local keep = {}
    local t0 = clock.monotonic()
    for i = 1, N do keep[i] = {i} end
    local dt = clock.monotonic() - t0
    print(string.format('%d tables at coroutine depth %2d: %8.3f us per allocation',
        N, depth, dt * 1e6 / N))
end

local function nest(d, depth)
    if d == 0 then return work(depth) end
    local co = coroutine.create(nest)
    assert(coroutine.resume(co, d - 1, depth))
end

for _, depth in ipairs({0, 1, 10}) do nest(depth, depth) end

-- The same in a recursion 50 and 200 Lua levels deep (a record keeps the innermost frames
-- only, and only those are read).
local function rec(d)
    if d == 0 then
        local keep = {}
        local t0 = clock.monotonic()
        for i = 1, N do keep[i] = {i} end
        return clock.monotonic() - t0
    end
    return (rec(d - 1))
end
for _, depth in ipairs({50, 200}) do
    print(string.format('%d tables at recursion depth %3d: %7.3f us per allocation',
        N, depth, rec(depth) * 1e6 / N))
end
