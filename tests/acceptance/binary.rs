//! The `fibertrace` binary end to end, as a user runs it: from another directory, on a
//! script named by a relative path.

use fibertrace_acceptance::{run_in, scratch};

/// The `#N` lines of a report block that are Lua frames (`name in source:line`), without
/// their numbers.
fn lua_frames(block: &str) -> Vec<String> {
    block
        .lines()
        .filter(|l| l.starts_with('#') && l.contains(" in ") && !l.contains(" 0x"))
        .map(|l| l.split_once(' ').map_or(l, |(_, r)| r).trim().to_string())
        .collect()
}

const DEADLOCK: &str = "local fiber = require('fiber')\n\
local a, b = fiber.channel(), fiber.channel()\n\
local function ping()\n\
  a:get()\n\
end\n\
local f = fiber.new(ping)\n\
f:name('ping')\n\
f:set_joinable(true)\n\
f:join()\n";

#[test]
fn a_deadlock_report_from_another_directory_names_the_script_as_given() {
    let dir = scratch("deadlock");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(dir.join("app/s.lua"), DEADLOCK).unwrap();
    let out = run_in(&dir, &["run", "app/s.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The wait-for graph first: main holds the channel ping waits on, and waits for ping.
    assert!(
        err.starts_with(
            "all fibers are asleep — deadlock!\n\n\
             wait-for graph:\n  \
             fiber 1 \"main\" joins fiber 2 \"ping\"\n  \
             fiber 2 \"ping\" receives on channel 1, which fiber 1 \"main\" also holds\n\
             cycle: fiber 1 \"main\" → fiber 2 \"ping\" → fiber 1 \"main\"\n\n\
             scheduler "
        ),
        "{err}"
    );
    let ping = err
        .split("\n\n")
        .find(|b| b.contains("\"ping\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(ping.contains("[channel receive, "), "{ping}");
    assert_eq!(
        lua_frames(ping),
        // (Lua names a function value it was handed by where it is defined.)
        ["get in =[C]:-1", "function <app/s.lua:3> in @app/s.lua:4"],
        "{ping}"
    );
    let main = err
        .split("\n\n")
        .find(|b| b.contains("\"main\" ["))
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        lua_frames(main),
        ["join in =[C]:-1", "main chunk in @app/s.lua:9"],
        "{main}"
    );
}

#[test]
fn a_script_that_does_not_exist_is_a_clear_error_from_anywhere() {
    let dir = scratch("missing");
    let out = run_in(&dir, &["run", "nope/missing.lua"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("nope/missing.lua"), "{err}");
    assert!(err.contains("No such file or directory"), "{err}");
    assert!(out.stdout.is_empty());
}
