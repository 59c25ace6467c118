-- Compiled loops: a sieve, a mandelbrot, a loop of calls. Prints the CPU seconds of each.
-- `examples/safe_point_cost.sh` runs it with and without the check that lets a dump stop a
-- spinning fiber at its next Lua line (LuaJIT's profiler in line mode).
local function sieve(n)
  local p = {}
  for i = 2, n do p[i] = true end
  local c = 0
  for i = 2, n do
    if p[i] then
      c = c + 1
      for j = i * i, n, i do
        p[j] = false
      end
    end
  end
  return c
end
local function mandel(w)
  local iter, n = 50, 0
  for y = 0, w - 1 do
    local ci = 2 * y / w - 1
    for x = 0, w - 1 do
      local cr = 2 * x / w - 1.5
      local zr, zi = 0, 0
      local k = 0
      while k < iter do
        local zr2 = zr * zr
        local zi2 = zi * zi
        if zr2 + zi2 > 4 then break end
        zi = 2 * zr * zi + ci
        zr = zr2 - zi2 + cr
        k = k + 1
      end
      n = n + k
    end
  end
  return n
end
local function add(a, b)
  return a + b
end
local function calls(n)
  local s = 0
  for i = 1, n do
    s = add(s, i % 13)
  end
  return s
end
local t0 = os.clock()
for _ = 1, 5 do sieve(2000000) end
local t1 = os.clock()
mandel(1200)
local t2 = os.clock()
calls(100000000)
local t3 = os.clock()
print(string.format("%.4f %.4f %.4f %.4f", t1 - t0, t2 - t1, t3 - t2, t3 - t0))
