//! `parent_backtrace` in `fiber.info()`: the exact entries of a chain of creators, the cap on
//! the creators shown and its `... N more parent fibers` entry, and the ancestry kept in
//! memory by a fiber that restarts itself, bounded whatever the number of generations.
//!
//! Entries are projected as in `host.rs`: Lua entries whole (without their number), native
//! entries only for the host's C functions, by the last segment of their name.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};

use fibertrace_fiber::{parent_trace_copies, ControlBlock};
use fibertrace_lua::LuaHost;
use mlua::Table;

/// The caps the README states: creators shown per fiber, creators kept per lineage.
const SHOWN: usize = 8;
const KEPT: usize = 16;

/// Tests that make or count copied ancestor traces run one at a time (the count is global).
static COPIES: Mutex<()> = Mutex::new(());

const KEEP: &[&str] = &[
    "f_create",
    "f_new",
    "call_in_thread",
    "lua_fiber_main",
    "run_main_fiber",
];

fn c_name(s: &str) -> Option<String> {
    // "#1  0x55.. in path::name+off"
    let (_, rest) = s.split_once(" in ")?;
    let name = rest.rsplit_once('+').map_or(rest, |(n, _)| n);
    let last = name.rsplit("::").next().unwrap_or(name);
    KEEP.contains(&last).then(|| format!("C {last}"))
}

fn strip_number(s: &str) -> &str {
    s.split_once(' ').map_or(s, |(_, r)| r.trim_start())
}

/// The entries projected, and the texts as they are.
fn project(entries: &Table) -> (Vec<String>, Vec<String>) {
    let (mut out, mut raw) = (Vec::new(), Vec::new());
    for e in entries.sequence_values::<Table>() {
        let e = e.unwrap();
        let (k, v): (String, String) = e.pairs().next().unwrap().unwrap();
        match k.as_str() {
            "L" => out.push(format!("L {}", strip_number(&v))),
            "C" => out.extend(c_name(&v)),
            other => panic!("unexpected key {other}"),
        }
        raw.push(v);
    }
    (out, raw)
}

fn run(src: &str) -> LuaHost {
    let host = LuaHost::new().unwrap();
    let lua = host.lua();
    lua.globals()
        .set(
            "tcb_watch",
            lua.create_function(|_, ()| {
                watch();
                Ok(())
            })
            .unwrap(),
        )
        .unwrap();
    lua.globals()
        .set(
            "tcb_live",
            lua.create_function(|_, ()| Ok((live_blocks(), parent_trace_copies())))
                .unwrap(),
        )
        .unwrap();
    if let Err(e) = host.run_main("@t.lua", src.as_bytes(), &[]) {
        panic!("script failed: {e}");
    }
    host
}

thread_local! {
    /// The control blocks of the fibers that called `tcb_watch`.
    static WATCHED: RefCell<Vec<Weak<ControlBlock>>> = const { RefCell::new(Vec::new()) };
}

fn watch() {
    let me = fibertrace_fiber::current().expect("in a fiber");
    WATCHED.with(|w| w.borrow_mut().push(Arc::downgrade(me.control_block())));
}

fn live_blocks() -> usize {
    WATCHED.with(|w| w.borrow().iter().filter(|b| b.strong_count() > 0).count())
}

fn v(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn three_creators_in_order_each_at_its_fiber_create() {
    let host = run(r#"local fiber = require('fiber')
fiber.parent_backtrace_enable()
local a, b, c
local function make_c()
  c = fiber.create(function() fiber.sleep(100) end)
end
local function make_b()
  b = fiber.create(function() make_c(); fiber.sleep(100) end)
end
local function make_a()
  a = fiber.create(function() make_b(); fiber.sleep(100) end)
end
make_a()
local i = fiber.info()[c:id()]
RESULT = i.parent_backtrace
OK = i.parent == b:id() and fiber.info()[b:id()].parent == a:id()
  and fiber.info()[a:id()].parent == fiber.id()
"#);
    let g = host.lua().globals();
    assert!(g.get::<bool>("OK").unwrap());
    let (got, raw) = project(&g.get::<Table>("RESULT").unwrap());
    assert_eq!(
        got,
        v(&[
            // b, at its call of make_c
            "C f_create",
            "L create in =[C]:-1",
            "L make_c in @t.lua:5",
            "L function <t.lua:8> in @t.lua:8",
            "C call_in_thread",
            "C lua_fiber_main",
            // a, at its call of make_b
            "C f_create",
            "L create in =[C]:-1",
            "L make_b in @t.lua:8",
            "L function <t.lua:11> in @t.lua:11",
            "C call_in_thread",
            "C lua_fiber_main",
            // main, at its call of make_a
            "C f_create",
            "L create in =[C]:-1",
            "L make_a in @t.lua:11",
            "L main chunk in @t.lua:13",
            "C call_in_thread",
            "C run_main_fiber",
        ])
    );
    // Numbered from 1 on, no count of creators left out (there are none).
    for (k, e) in raw.iter().enumerate() {
        assert!(e.starts_with(&format!("#{:<2} ", k + 1)), "{e}");
    }
    assert!(!raw.iter().any(|e| e.contains("more parent")), "{raw:?}");
}

#[test]
fn a_chain_deeper_than_the_cap_ends_with_the_count_of_creators_left_out() {
    let _g = COPIES.lock().unwrap_or_else(|e| e.into_inner());
    let host = run(r#"local fiber = require('fiber')
fiber.parent_backtrace_enable()
CHAIN = {}
local function link(n)
  CHAIN[#CHAIN + 1] = fiber.self()
  if n > 1 then fiber.create(link, n - 1) end
  fiber.sleep(100)
end
fiber.create(link, 30)
local all = fiber.info()
DEEPEST = all[CHAIN[30]:id()].parent_backtrace
TENTH = all[CHAIN[10]:id()].parent_backtrace
SIXTH = all[CHAIN[6]:id()].parent_backtrace
"#);
    let g = host.lua().globals();
    // The deepest has 29 chain creators and main: 8 shown, 22 counted.
    for (name, creators) in [("DEEPEST", 30usize), ("TENTH", 10), ("SIXTH", 6)] {
        let (got, raw) = project(&g.get::<Table>(name).unwrap());
        let segments = got.iter().filter(|e| *e == "L create in =[C]:-1").count();
        assert_eq!(segments, creators.min(SHOWN), "{name}: {got:?}");
        let last = raw.last().unwrap();
        if creators > SHOWN {
            assert_eq!(
                *last,
                format!(
                    "#{:<2} ... {} more parent fibers",
                    raw.len(),
                    creators - SHOWN
                ),
                "{name}"
            );
        } else {
            assert!(!last.contains("more parent"), "{name}: {last}");
            assert_eq!(got.last().unwrap(), "C run_main_fiber", "{name}");
        }
        // The nearest creator first: the chain's `link` at its fiber.create.
        assert_eq!(got[2], "L function <t.lua:4> in @t.lua:6", "{name}");
    }
}

/// A fiber that restarts itself (creates its successor with fiber.new, then ends): the last
/// generation keeps alive only the capped ancestry, the same for 200 or 4,000 generations,
/// and its parent_backtrace counts every creator.
#[test]
fn generations_keep_a_bounded_ancestry() {
    let _g = COPIES.lock().unwrap_or_else(|e| e.into_inner());
    let base = parent_trace_copies();
    for n in [200usize, 4_000] {
        WATCHED.with(|w| w.borrow_mut().clear());
        let host = run(&format!(
            r#"local fiber = require('fiber')
fiber.parent_backtrace_enable()
local N, done = {n}, 0
local function generation()
  tcb_watch()
  done = done + 1
  if done < N then
    fiber.new(generation)
  else
    LIVE, COPIES = tcb_live()
    LAST = fiber.info()[fiber.id()].parent_backtrace
  end
end
fiber.new(generation)
while done < N do fiber.sleep(0.001) end
"#
        ));
        let g = host.lua().globals();
        let live: usize = g.get("LIVE").unwrap();
        let copies: usize = g.get("COPIES").unwrap();
        // Itself and at most KEPT ancestors' blocks (and a few finished ones kept for reuse).
        assert!(live <= KEPT + 1 + 4, "{n} generations: {live} blocks alive");
        assert!(copies - base < SHOWN, "{n} generations: {copies} copies");
        // Creators: n - 1 generations and main.
        let (_, raw) = project(&g.get::<Table>("LAST").unwrap());
        let last = raw.last().unwrap();
        assert_eq!(
            *last,
            format!("#{:<2} ... {} more parent fibers", raw.len(), n - SHOWN)
        );
        drop(host);
    }
    assert_eq!(parent_trace_copies(), base);
}
