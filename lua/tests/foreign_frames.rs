//! The reader of another process's Lua stacks (`frames::foreign`), run on this process's own
//! memory (through `process_vm_readv`, as on another's), gives exactly the levels the Lua
//! debug API gives in-process — names, kinds, sources, lines — over every shape of call
//! LuaJIT names differently.
#![cfg(feature = "luajit")]

use std::cell::RefCell;
use std::rc::Rc;

use fibertrace_lua::frames::foreign::{Reader, SelfMem};
use fibertrace_lua::frames::publish;
use fibertrace_lua::{capture_lua_stack, describe, LuaStack};

fn lines(s: &LuaStack) -> Vec<String> {
    s.levels
        .iter()
        .map(|l| {
            let i = describe(l.id).expect("interned");
            format!(
                "{} in {}:{} (defined {}, {:?}, thread {})",
                i.display_name(),
                i.source,
                i.current_line,
                i.line_defined,
                i.kind,
                l.thread
            )
        })
        .collect()
}

/// What each probe call saw: its tag, the levels read, and their C functions.
type Seen = Vec<(String, Vec<String>, Vec<usize>)>;

const SHAPES: &str = r#"
local probe = probe
function global_fn() probe('global') end
local function local_fn() probe('local') end
local up = function() probe('upvalue') end
local function calls_up() up() end
local obj = {}
function obj:method() probe('method') end
local t = {field = function() probe('field') end}
local function va(...) probe('vararg') return ... end
local mt = setmetatable({}, {
  __index = function(_, k) probe('index') return k end,
  __add = function() probe('add') return 0 end,
  __call = function() probe('call') end,
})
local function iter() probe('iter') return nil end
local function deep(n) if n == 0 then probe('deep') else deep(n - 1) end end
local function tail() return probe('tail') end

global_fn()
local_fn()
calls_up()
obj:method()
t.field()
va(1, 2, 3)
local _ = mt.missing
local _ = mt + 1
mt()
for _ in iter do end
pcall(function() probe('pcall') end)
coroutine.wrap(function() probe('wrap') end)()
local co = coroutine.create(function(a) probe('resume') end)
coroutine.resume(co, 1)
load("(function() probe('string chunk') end)()\nlocal x = 1")()
load("probe('named chunk')", "=named")()
deep(300)
tail()
for i = 1, 200 do if i == 150 then probe('jit loop') end end
local sorted = false
table.sort({3, 1, 2}, function(a, b) if not sorted then sorted = true probe('sort') end return a < b end)
string.gsub('x', 'x', function() probe('gsub') end)
"#;

#[test]
fn the_foreign_reader_gives_the_debug_apis_levels_for_every_shape_of_call() {
    let lua = mlua::Lua::new();
    let main = lua.current_thread();
    // SAFETY: the main state of a Lua used only by this thread.
    unsafe { publish::check(main.state()) }.expect("the layout matches the linked LuaJIT");
    assert_eq!(publish::checked(), publish::MATCHES);
    let seen: Rc<RefCell<Seen>> = Rc::default();
    let seen2 = seen.clone();
    let root = main.state();
    let probe = lua
        .create_function(move |_, what: String| {
            let mut api = LuaStack::new();
            // SAFETY: `root` is the main state of this Lua, on this thread, and no other Lua
            // code runs during the capture.
            unsafe { capture_lua_stack(root, &mut api) };
            let mut reader = Reader::own().expect("checked layout");
            let read = reader.stack(&mut SelfMem, root as u64).expect("readable");
            assert_eq!(lines(&read), lines(&api), "{what}");
            assert_eq!(read.levels, api.levels, "{what}");
            assert_eq!(
                (read.threads, read.truncated, read.omitted, read.omitted_at),
                (api.threads, api.truncated, api.omitted, api.omitted_at),
                "{what}"
            );
            let cfuncs = read.levels.iter().map(|l| l.cfunc).collect();
            seen2.borrow_mut().push((what, lines(&read), cfuncs));
            Ok(())
        })
        .unwrap();
    lua.globals().set("probe", probe).unwrap();
    lua.load(SHAPES).set_name("@shapes.lua").exec().unwrap();
    let seen = seen.borrow();
    let whats: Vec<&str> = seen.iter().map(|(w, _, _)| w.as_str()).collect();
    assert_eq!(
        whats,
        [
            "global",
            "local",
            "upvalue",
            "method",
            "field",
            "vararg",
            "index",
            "add",
            "call",
            "iter",
            "pcall",
            "wrap",
            "resume",
            "string chunk",
            "named chunk",
            "deep",
            "tail",
            "jit loop",
            "sort",
            "gsub"
        ]
    );
    // A few exactly, as the reader gives them (the API gives the same, checked above).
    let get = |w: &str| &seen.iter().find(|(x, _, _)| x == w).unwrap().1;
    assert_eq!(
        get("method")[..3],
        [
            "probe in =[C]:-1 (defined -1, C, thread 0)",
            "method in @shapes.lua:8 (defined 8, Lua, thread 0)",
            "main chunk in @shapes.lua:23 (defined 0, Main, thread 0)",
        ]
    );
    assert_eq!(
        get("index")[1],
        "__index in @shapes.lua:12 (defined 12, Lua, thread 0)"
    );
    assert_eq!(
        get("add")[1],
        "__add in @shapes.lua:13 (defined 13, Lua, thread 0)"
    );
    assert_eq!(
        get("vararg")[1],
        "va in @shapes.lua:10 (defined 10, Lua, thread 0)"
    );
    assert_eq!(
        get("iter")[1],
        "(for generator) in @shapes.lua:16 (defined 16, Lua, thread 0)"
    );
    assert_eq!(
        get("string chunk")[1],
        "function <[string \"(function() probe('string chunk') end)()...\"]:1> in \
         (function() probe('string chunk') end)()\nlocal x = 1:1 (defined 1, Lua, thread 0)"
    );
    assert_eq!(
        get("resume")[..3],
        [
            "probe in =[C]:-1 (defined -1, C, thread 0)",
            "function <shapes.lua:32> in @shapes.lua:32 (defined 32, Lua, thread 0)",
            "resume in =[C]:-1 (defined -1, C, thread 1)",
        ]
    );
    assert_eq!(get("wrap")[2], "? in =[C]:-1 (defined -1, C, thread 1)");
    // LuaJIT drops a Lua function that tail-calls a C function: the C level takes its name.
    assert_eq!(
        get("tail")[..2],
        [
            "tail in =[C]:-1 (defined -1, C, thread 0)",
            "main chunk in @shapes.lua:37 (defined 0, Main, thread 0)",
        ]
    );
    // A library function written in C (not a fast function): its C function is known, as
    // `lua_tocfunction` knows it.
    assert_eq!(get("sort")[2], "sort in =[C]:-1 (defined -1, C, thread 0)");
    let sort = &seen.iter().find(|(x, _, _)| x == "sort").unwrap().2;
    assert!(sort[2] != 0, "{sort:?}");
    let deep = get("deep");
    assert_eq!(deep.len(), fibertrace_lua::frames::MAX_LEVELS);
}
