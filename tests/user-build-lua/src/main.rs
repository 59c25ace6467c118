//! What a user embedding the Lua host gets in their own build: a Lua fiber suspended in
//! `channel:get()` three Lua calls deep, seen through `fiber.info()`, with its frames
//! asserted exactly (the Lua levels, and the native frames that anchor them).

use fibertrace_lua::LuaHost;

const SCRIPT: &str = r#"local fiber = require('fiber')
local ch = fiber.channel(1)
local function level3()
  local v = ch:get()
  return v
end
local function level2()
  local v = level3()
  return v
end
local function level1()
  local v = level2()
  return v
end
local f = fiber.create(level1)
local lines = {}
for _, e in ipairs(fiber.info()[f:id()].backtrace) do
  local k, v = next(e)
  lines[#lines + 1] = k .. ' ' .. v
end
RESULT = table.concat(lines, '\n')
ch:put(1)
"#;

/// The entry without its number: `C fibertrace_fiber::sched::block` (no address, no
/// offset) or `L level3 in @t.lua:4`.
fn entry(line: &str) -> String {
    let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
    let rest = rest.trim_start();
    let rest = rest.split_once(' ').map_or(rest, |(_, r)| r).trim_start();
    match kind {
        "C" => {
            let name = rest.split_once(" in ").map_or(rest, |(_, n)| n);
            let name = name.rsplit_once('+').map_or(name, |(n, _)| n);
            format!("C {name}")
        }
        _ => format!("{kind} {rest}"),
    }
}

fn check(got: &[String]) -> Result<(), String> {
    let all = || got.join("\n");
    let lua = [
        "L get in =[C]:-1",
        "L level3 in @t.lua:4",
        "L level2 in @t.lua:8",
        "L function <t.lua:11> in @t.lua:12",
    ];
    let at = got
        .iter()
        .position(|e| e == lua[0])
        .ok_or_else(|| format!("no channel get in:\n{}", all()))?;
    if got.get(at..at + lua.len()) != Some(&lua.map(String::from)[..]) {
        return Err(format!("Lua levels are not {lua:?} in:\n{}", all()));
    }
    if got.iter().filter(|e| e.starts_with("L ")).count() != lua.len() {
        return Err(format!("Lua levels other than {lua:?} in:\n{}", all()));
    }
    let want = [
        (0, "C fibertrace_fiber::sched::block"),
        (at - 1, "C fibertrace_lua::host::channel::ch_get"),
        (
            at + lua.len(),
            "C fibertrace_lua::host::spawn::call_in_thread",
        ),
    ];
    for (i, w) in want {
        if got.get(i).map(String::as_str) != Some(w) {
            return Err(format!("entry {i} is not {w:?} in:\n{}", all()));
        }
    }
    Ok(())
}

fn main() {
    let host = LuaHost::new().expect("a Lua host");
    let r = match host.run_main("@t.lua", SCRIPT.as_bytes(), &[]) {
        Err(e) => Err(format!("the script failed: {e}")),
        Ok(()) => match host.lua().globals().get::<String>("RESULT") {
            Ok(s) => check(&s.lines().map(entry).collect::<Vec<_>>()),
            Err(e) => Err(format!("no RESULT: {e}")),
        },
    };
    match r {
        Ok(()) => println!("ok suspended Lua fiber in fiber.info()\n1 passed, 0 failed"),
        Err(why) => {
            println!("not ok suspended Lua fiber in fiber.info(): {why}\n0 passed, 1 failed");
            std::process::exit(1);
        }
    }
}
