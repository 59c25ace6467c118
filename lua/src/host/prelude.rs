//! The parts of the `fiber` and `clock` modules written in Lua, as Tarantool writes them in
//! Lua too: the FFI clocks (LuaJIT), `clock.bench`, `fiber._internal.schedule_task` and its
//! worker fiber, the module's `__serialize`, the `compat` module (the options that concern
//! fibers), and the error objects `fiber_object:join()` returns.
//!
//! [`PRELUDE`] runs once when a host is made, with `(fiber, clock, hidden)`: `hidden` holds
//! what scripts must not see (`stall`, the close-mode setter, the clocks' C pointers). It
//! returns the error constructor `make_error(type, value)` and the metatable of
//! `fiber.info()`'s result; the host keeps both in the registry.

/// See the module docs.
pub(crate) const PRELUDE: &str = r#"
local fiber, clock, hidden = ...

-- Clocks: under LuaJIT, FFI calls of the host's C functions (exact 64-bit cdata).
local ptr = hidden.ptr
if ptr ~= nil and jit ~= nil then
    local ffi = require('ffi')
    local function fn(ret, name)
        return ffi.cast(ret .. ' (*)(void)', ptr[name])
    end
    clock.realtime = fn('double', 'realtime')
    clock.monotonic = fn('double', 'monotonic')
    clock.proc = fn('double', 'process')
    clock.thread = fn('double', 'thread')
    clock.realtime64 = fn('int64_t', 'realtime64')
    clock.monotonic64 = fn('int64_t', 'monotonic64')
    clock.proc64 = fn('int64_t', 'process64')
    clock.thread64 = fn('int64_t', 'thread64')
    clock.time = clock.realtime
    clock.time64 = clock.realtime64
    local time, time64 = fn('double', 'fiber_time'), fn('int64_t', 'fiber_time64')
    local clk, clk64 = fn('double', 'fiber_clock'), fn('int64_t', 'fiber_clock64')
    fiber.time = function() return time() end
    fiber.time64 = function() return time64() end
    fiber.clock = function() return clk() end
    fiber.clock64 = function() return clk64() end
end

-- LuaJIT's profiler serves one user: the host's (it stops a running fiber at a safe point to
-- read its Lua frames for a dump or a stall report). A script that starts `jit.profile` takes
-- it over; the host stands aside until the script stops it, then takes it back.
if jit ~= nil and type(package) == 'table' and type(package.preload) == 'table' then
    local open = package.preload['jit.profile']
    if type(open) == 'function' then
        local taken = hidden.script_profiles
        package.preload['jit.profile'] = function(...)
            local m = open(...)
            if type(m) == 'table' then
                local start, stop = m.start, m.stop
                m.start = function(...)
                    taken(true)
                    return start(...)
                end
                m.stop = function(...)
                    local ok, err = pcall(stop, ...)
                    taken(false)
                    if not ok then
                        error(err, 2)
                    end
                end
            end
            return m
        end
    end
end

-- LuaJIT's C declaration parser nests one C call per level of struct or union braces, with no
-- limit and no Lua instruction in between (where a C stack overflow could be raised): a
-- declaration nested a few hundred levels deep would run a fiber's stack into its guard.
-- The functions that parse a declaration refuse one nested deeper than C requires compilers
-- to take (63 levels; the limit is 64), before parsing it. A declaration without a brace costs one search.
if jit ~= nil then
    local ok, ffi = pcall(require, 'ffi')
    if ok and type(ffi) == 'table' then
        local find, byte, error, type = string.find, string.byte, error, type
        local MAX_BRACES = 64
        -- Braces are counted as LuaJIT's C lexer sees them: not inside comments or
        -- string and character literals.
        local function check(name, decl)
            if type(decl) ~= 'string' or not find(decl, '{', 1, true) then
                return
            end
            local depth, i, n = 0, 1, #decl
            while i <= n do
                local c = byte(decl, i)
                if c == 123 then -- {
                    depth = depth + 1
                    if depth > MAX_BRACES then
                        error('ffi.' .. name .. ': C declaration nested too deep (more than '
                            .. MAX_BRACES .. ' levels of braces)', 3)
                    end
                elseif c == 125 then -- }
                    if depth > 0 then depth = depth - 1 end
                elseif c == 47 then -- /
                    local d = byte(decl, i + 1)
                    if d == 42 then -- /* to */
                        local e = find(decl, '*/', i + 2, true)
                        if e == nil then return end
                        i = e + 1
                    elseif d == 47 then -- // to the end of the line
                        local e = find(decl, '\n', i + 2, true)
                        if e == nil then return end
                        i = e
                    end
                elseif c == 34 or c == 39 then -- " or '
                    local j = i + 1
                    while j <= n do
                        local d = byte(decl, j)
                        if d == 92 then -- backslash
                            j = j + 2
                        elseif d == c or d == 10 then
                            break
                        else
                            j = j + 1
                        end
                    end
                    i = j
                end
                i = i + 1
            end
        end
        for _, name in ipairs({'cdef', 'typeof', 'new', 'cast', 'sizeof', 'alignof',
                               'offsetof', 'istype', 'metatype'}) do
            local f = ffi[name]
            if type(f) == 'function' then
                ffi[name] = function(decl, ...)
                    check(name, decl)
                    return f(decl, ...)
                end
            end
        end
    end
end

-- clock.bench(fun, ...): {CPU seconds of the call, its results...}.
local proc = clock.proc
clock.bench = function(fun, ...)
    local overhead = proc()
    overhead = proc() - overhead
    local started = proc()
    local res = {0, fun(...)}
    res[1] = proc() - started - overhead
    return res
end

-- fiber._internal.schedule_task(f, arg): f(arg) later, in a worker fiber, in the order
-- scheduled; scheduling never yields. A task that raises (or cancels the worker) breaks the
-- worker down: a new one takes over the tasks left.
local stall = hidden.stall
local head, tail, worker
local function run_tasks()
    while true do
        local task = head
        if task == nil then
            stall()
        else
            head = task.next
            if head == nil then tail = nil end
            task.f(task.arg)
            fiber.sleep(0)
        end
    end
end
local function worker_main()
    pcall(run_tasks)
    worker = fiber.new(worker_main)
end
local function schedule_task(f, arg)
    local task = {f = f, arg = arg}
    if tail == nil then head = task else tail.next = task end
    tail = task
    if worker == nil then worker = fiber.new(worker_main) end
    worker:wakeup()
end
fiber._internal = fiber._internal or {}
fiber._internal.schedule_task = schedule_task

setmetatable(fiber, {__serialize = function(self)
    local res = {}
    for k, v in pairs(self) do
        if k ~= '_internal' then res[k] = v end
    end
    return res
end})

-- compat: the options that concern fibers. fibertrace keeps Tarantool 2.6's behaviour by
-- default ('old'); Tarantool 3.x defaults both to 'new'.
local INFINITY = 100 * 365 * 86400
local options = {
    fiber_channel_close_mode = {
        default = 'old',
        brief = 'Whether a closed channel keeps the values queued before close ' ..
                '(new: graceful close) or drops them (old: forceful close).',
        action = function(is_new) hidden.set_close_mode(is_new) end,
    },
    fiber_slice_default = {
        default = 'old',
        brief = 'The default max slice of fibers: {warn = 0.5, err = 1.0} (new) ' ..
                'or none (old).',
        action = function(is_new)
            fiber.set_max_slice(is_new and {warn = 0.5, err = 1.0} or INFINITY)
        end,
    },
}
local order = {'fiber_channel_close_mode', 'fiber_slice_default'}
for _, o in pairs(options) do o.current = o.default == 'new'; o.selected = false end

local function set_option(name, val)
    local option = options[name]
    if option == nil then
        error(('Invalid option %s'):format(tostring(name)), 3)
    end
    local new, selected
    if val == 'new' then
        new, selected = true, true
    elseif val == 'old' then
        new, selected = false, true
    elseif val == 'default' then
        new, selected = option.default == 'new', false
    else
        error(('Invalid argument %s in option %s'):format(tostring(val), name), 3)
    end
    if new ~= option.current then option.action(new) end
    option.current = new
    option.selected = selected
end

local option_methods = {}
function option_methods.is_new(o)
    if type(o) ~= 'table' then error('usage: compat.<option_name>:is_new()', 2) end
    local v = o.current == 'default' and o.default or o.current
    return v == 'new'
end
function option_methods.is_old(o)
    if type(o) ~= 'table' then error('usage: compat.<option_name>:is_old()', 2) end
    local v = o.current == 'default' and o.default or o.current
    return v == 'old'
end
local option_mt = {__index = option_methods}

local compat = {}
function compat.dump()
    local lines = {}
    for _, name in ipairs(order) do
        local o = options[name]
        if o.selected then
            lines[#lines + 1] = ("compat.%s = '%s'"):format(name, o.current and 'new' or 'old')
        end
    end
    return table.concat(lines, '\n')
end
local compat_mt = {}
function compat_mt.__index(_, key)
    local o = options[key]
    if o == nil then error(('Invalid option %s'):format(tostring(key)), 2) end
    local current = 'default'
    if o.selected then current = o.current and 'new' or 'old' end
    return setmetatable({brief = o.brief, default = o.default, current = current}, option_mt)
end
function compat_mt.__newindex(_, key, val) set_option(key, val) end
function compat_mt.__call(_, list)
    if type(list) ~= 'table' then
        error("usage: compat({<option_name> = 'new'/'old'/'default'})", 2)
    end
    for k, v in pairs(list) do set_option(k, v) end
end
package.loaded.compat = setmetatable(compat, compat_mt)

-- Error objects (what Tarantool's box.error objects are to the fiber module): type,
-- base_type, message, trace; tostring() is the message; `..` concatenates the message.
local error_mt = {}
local error_methods = {}
local function is_error(e) return type(e) == 'table' and getmetatable(e) == error_mt end
function error_methods.unpack(e)
    if not is_error(e) then error('Usage: error:unpack()', 2) end
    local r = {}
    for k, v in pairs(e) do r[k] = v end
    return r
end
function error_methods.raise(e)
    if not is_error(e) then error('Usage: error:raise()', 2) end
    error(e)
end
function error_methods.match(e, ...)
    if not is_error(e) then error('Usage: error:match()', 2) end
    return string.match(e.message, ...)
end
function error_methods.__serialize(e) return e.message end
error_mt.__index = error_methods
error_mt.__tostring = function(e) return e.message end
error_mt.__concat = function(a, b)
    if is_error(a) then return a.message .. b end
    return a .. b.message
end
local function make_error(etype, value)
    if is_error(value) then return value end
    local ok, msg = pcall(tostring, value)
    if not ok or type(msg) ~= 'string' then msg = '(error object is not a string)' end
    return setmetatable({type = etype, base_type = etype, message = msg, trace = {}},
                        error_mt)
end

return make_error, {__serialize = 'mapping'}
"#;
