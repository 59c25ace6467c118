//! Interleaved traces in call order, in the build users run (CI runs this file in release
//! too: the frames a release build inlines or tail-calls are where order went wrong): a fiber
//! parked inside a debug hook, and a fiber caught inside `fiber.info()`.

#[path = "../../fiber/tests/common/tied.rs"]
mod tied;
use tied::Tied;

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::process::Command;
#[cfg(feature = "luajit")]
use std::{path::Path, process::Output};

/// A scratch directory for one test, removed when it passes (see `tests/scratch.rs`).
fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("order-{name}"))
}

// (Used by the LuaJIT-only test.)
#[cfg(feature = "luajit")]
fn run(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .arg("run")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

#[cfg(feature = "luajit")]
fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fiber parked inside a debug hook (its hook waits on a channel) ends at its entry
/// function: the hook's level, the hooked function's, and nothing after them. The hook's C
/// path (`lj_dispatch_ins`) was taken for the interpreter (see the VM map's C-file rule), and
/// the walk showed the hook's count as a frame (`0x309 in ??` for a count of 777) in place of
/// the host's frames.
// (LuaJIT: its interpreter, fast functions and `jit.off`.)
#[cfg(feature = "luajit")]
#[test]
fn a_fiber_parked_inside_a_debug_hook_ends_at_its_entry_function() {
    let d = dir("hook");
    std::fs::write(
        d.join("s.lua"),
        "jit.off()\n\
         local fiber = require('fiber')\n\
         local ch = fiber.channel()\n\
         local f = fiber.create(function()\n\
         debug.sethook(function() ch:get() end, '', 777)\n\
         local s = 0\n\
         for k = 1, 1e5 do s = s + (k % 7) end\n\
         end)\n\
         f:name('hooked')\n\
         fiber.sleep(0.01)\n\
         print(require('fibertrace').dump())\n",
    )
    .unwrap();
    for detail in [false, true] {
        let args: &[&str] = if detail {
            &["--native-detail", "s.lua"]
        } else {
            &["s.lua"]
        };
        let out = run(&d, args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let all = text(&out.stdout);
        let block = all
            .split("\n\n")
            .find(|b| b.starts_with("fiber 2 \"hooked\" [channel receive, "))
            .unwrap_or_else(|| panic!("{all}"));
        let frames: Vec<&str> = block
            .lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| l.split_once(' ').map_or(l, |x| x.1.trim_start()))
            .collect();
        let at = frames
            .iter()
            .position(|f| *f == "get in =[C]:-1")
            .expect(block);
        assert_eq!(
            frames[at + 1..at + 3],
            ["__mod in @s.lua:5", "function <s.lua:4> in @s.lua:7"],
            "{block}"
        );
        assert!(!block.contains("??"), "{block}");
        if detail {
            assert!(
                frames[at + 3].contains(" in fibertrace_lua::host::spawn::call_in_thread+"),
                "{block}"
            );
        } else {
            assert_eq!(frames.len(), at + 3, "{block}");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A fiber caught by SIGQUIT while it runs `fiber.info()` (read at a safe point inside the
/// listing's own Lua code) is shown in call order: the listing's Lua level, the host's frames
/// that run it, `info in =[C]`, then the fiber's function, and nothing after it. The
/// protected-call trampoline inside the listing tail-called its closure, leaving its Lua
/// level (`? in =[C]`) without a native frame: every Lua level was put above the host's
/// frames, the fiber's function before the frames it called (helper's sweep).
#[test]
fn a_fiber_dumped_inside_fiber_info_is_shown_in_call_order() {
    use std::io::Read as _;
    let d = dir("ininfo");
    std::fs::write(
        d.join("s.lua"),
        "local fiber = require('fiber')\n\
         for i = 1, 200 do fiber.create(function() fiber.sleep(100) end) end\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         local f = fiber.create(function()\n\
         fiber.self():name('lister')\n\
         for i = 1, 1e6 do local x = fiber.info() if i % 8 == 0 then fiber.yield() end end\n\
         end)\n\
         fiber.sleep(60)\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fibertrace"))
        .args(["run", "s.lua"])
        .current_dir(&d)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line, "ready\n");
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    for _ in 0..8 {
        // SAFETY: signals our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
        std::thread::sleep(std::time::Duration::from_millis(150));
    }
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(143));
    let err = reader.join().unwrap();
    let caught: Vec<Vec<&str>> = err
        .split("\n\n")
        .filter(|b| b.contains(" \"lister\" [running]:"))
        .map(|b| {
            b.lines()
                .filter(|l| l.starts_with('#'))
                .map(|l| l.split_once(' ').map_or(l, |x| x.1.trim_start()))
                .collect()
        })
        .filter(|f: &Vec<&str>| f.contains(&"info in =[C]:-1"))
        .collect();
    assert!(
        !caught.is_empty(),
        "never caught inside fiber.info():\n{err}"
    );
    for frames in caught {
        let at = |what: &str| {
            frames
                .iter()
                .position(|f| f.contains(what))
                .unwrap_or_else(|| panic!("{what} missing: {frames:#?}"))
        };
        let (listing, host, info, entry) = (
            at("in =fiber.info:"),
            at("fibertrace_lua::host::fiber_fns::info_body"),
            at("info in =[C]:-1"),
            at("function <s.lua:4> in @s.lua:6"),
        );
        assert!(
            listing < host && host < info && info + 1 == entry,
            "{frames:#?}"
        );
        assert_eq!(entry + 1, frames.len(), "{frames:#?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
