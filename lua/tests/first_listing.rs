//! A process's first `fiber.info()` reads the program's symbol table only, not its DWARF
//! (loading the DWARF of the `fibertrace` binary took ~45 ms and ~45 MB of resident memory,
//! where Tarantool's first listing takes ~6 ms and ~0.5 MB): every native entry is named from
//! the symbol table, as the DWARF would name it, and the runtime's trampoline (the host's
//! start of a fiber) is left out of every trace. In its own test binary: which files' DWARF
//! the process loaded is process-wide.

use fibertrace_core::symbolize::{dwarf_loads, resolve_address};
use fibertrace_lua::LuaHost;
use mlua::Table;

/// `(key, text)` of each entry of a `backtrace` array.
fn entries(t: &Table) -> Vec<(String, String)> {
    t.sequence_values::<Table>()
        .map(|e| e.unwrap().pairs().next().unwrap().unwrap())
        .collect()
}

/// The address and name of a native entry, `#N  0x55… in path::name+off`.
fn native(text: &str) -> (u64, &str, u64) {
    let (_, rest) = text.split_once(" 0x").unwrap_or_else(|| panic!("{text}"));
    let (addr, rest) = rest.split_once(" in ").unwrap();
    let (name, off) = rest.rsplit_once('+').unwrap();
    (
        u64::from_str_radix(addr, 16).unwrap(),
        name,
        off.parse().unwrap(),
    )
}

#[test]
fn the_first_listing_names_native_frames_from_the_symbol_table_alone() {
    let host = LuaHost::new().unwrap();
    let src = r#"local fiber = require('fiber')
local function leaf()
  fiber.sleep(100)
end
local function top()
  leaf()
end
local f = fiber.create(top)
OTHER = fiber.info()[f:id()].backtrace
SELF = fiber.info()[fiber.id()].backtrace
"#;
    if let Err(e) = host.run_main("@t.lua", src.as_bytes(), &[]) {
        panic!("script failed: {e}");
    }
    assert_eq!(dwarf_loads(), 0, "a listing loads no DWARF");
    let globals = host.lua().globals();
    let other = entries(&globals.get::<Table>("OTHER").unwrap());
    let me = entries(&globals.get::<Table>("SELF").unwrap());
    // The sleeping fiber: its switch point, the host's C function, the Lua levels, the
    // host's start of the fiber; no trampoline after it.
    let names = |v: &[(String, String)]| -> Vec<String> {
        v.iter()
            .map(|(k, t)| match k.as_str() {
                "C" => format!("C {}", native(t).1),
                _ => format!("L {}", t.split_once(' ').unwrap().1.trim_start()),
            })
            .collect()
    };
    let got = names(&other);
    let lua: Vec<&String> = got.iter().filter(|s| s.starts_with("L ")).collect();
    assert_eq!(
        lua,
        [
            "L sleep in =[C]:-1",
            "L leaf in @t.lua:3",
            "L function <t.lua:5> in @t.lua:6"
        ],
        "{got:?}"
    );
    assert_eq!(got[0], "C fibertrace_fiber::sched::sleep", "{got:?}");
    assert!(
        got.contains(&"C fibertrace_lua::host::fiber_fns::f_sleep".to_string()),
        "{got:?}"
    );
    // (The host's start of the fiber: `lua_fiber_main` in an optimised build, where the
    // rest is inlined into the trampoline; its closure in a debug build.)
    assert!(
        got.last()
            .unwrap()
            .starts_with("C fibertrace_lua::host::spawn::"),
        "{got:?}"
    );
    // The running fiber: from fiber.info's C function to the host's start of the main
    // fiber, no trampoline after it either.
    let mine = names(&me);
    assert_eq!(
        mine[0], "C fibertrace_lua::host::fiber_fns::f_info",
        "{mine:?}"
    );
    assert!(
        mine.last().unwrap().starts_with("C fibertrace_lua::host::"),
        "{mine:?}"
    );
    for t in [&got, &mine] {
        assert!(
            !t.iter().any(|s| s.contains("call_user")),
            "the trampoline is left out: {t:?}"
        );
    }
    // The names and offsets are the full lookup's (the DWARF's outermost level), which
    // loads the DWARF.
    for (k, text) in other.iter().chain(&me) {
        if k != "C" {
            continue;
        }
        let (addr, name, off) = native(text);
        // (The first entry of a trace is a return address like the others: looked up one
        // byte back, its offset from the address itself.)
        let full = resolve_address(addr - 1);
        assert_eq!(full.function(), Some(name), "{text}");
        assert_eq!(full.offset_of(addr), Some(off), "{text}");
    }
    assert_eq!(
        dwarf_loads(),
        1,
        "the full lookups loaded the program's DWARF"
    );
}
