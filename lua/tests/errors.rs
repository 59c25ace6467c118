//! How `fibertrace run` shows a script's errors: as `lua` does (a value with `__tostring`
//! shown through it, anything else without one named by its type) and byte-exact (an error
//! message, or a fiber name, that is not UTF-8 is written as its bytes). Fiber names in the
//! runtime's own text reports are quoted with escapes, so their bytes can be read back.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::process::{Command, Stdio};

const EXE: &str = env!("CARGO_BIN_EXE_fibertrace");

/// Runs `src` as a script file; (stdout, stderr, exit code), as bytes.
fn run(name: &str, src: &[u8]) -> (Vec<u8>, Vec<u8>, Option<i32>) {
    run_with(&[], name, src)
}

/// [`run`] with options of `run` before the script.
fn run_with(opts: &[&str], name: &str, src: &[u8]) -> (Vec<u8>, Vec<u8>, Option<i32>) {
    let dir = Scratch::new("errors");
    let path = dir.join(name);
    std::fs::write(&path, src).unwrap();
    let o = Command::new(EXE)
        .arg("run")
        .args(opts)
        .arg(&path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o.stdout, o.stderr, o.status.code())
}

/// The first line of `b` (without its end).
fn first_line(b: &[u8]) -> &[u8] {
    b.split(|&c| c == b'\n').next().unwrap()
}

#[test]
fn a_main_script_error_object_is_shown_through_its_tostring() {
    let (out, err, code) = run(
        "tostring_main.lua",
        b"print('before')\n\
          error(setmetatable({}, {__tostring = function() return 'custom error 42' end}))\n",
    );
    assert_eq!(out, b"before\n");
    assert_eq!(
        first_line(&err),
        b"custom error 42",
        "{}",
        String::from_utf8_lossy(&err)
    );
    assert_eq!(
        err.split(|&c| c == b'\n').nth(1),
        Some(&b"stack traceback:"[..])
    );
    assert_eq!(code, Some(1));
}

/// A `__tostring` that switches fibers (a sleep) still gives the message: the run's end,
/// set before the message was made, turned the sleep into the main fiber's cancellation,
/// and only `fibertrace: fiber was cancelled` was said, without a traceback.
#[test]
fn a_main_script_error_whose_tostring_sleeps_is_shown_through_it() {
    let (out, err, code) = run(
        "tostring_sleeps.lua",
        b"local fiber = require('fiber')\n\
          fiber.create(function() fiber.sleep(0) print('other ran') end)\n\
          error(setmetatable({}, {__tostring = function() fiber.sleep(0.01) return 'slept' end}))\n",
    );
    let err = String::from_utf8_lossy(&err);
    // (The traceback ends with an empty line, as every one does.)
    assert!(err.ends_with(":3\n\n"), "{err}");
    let lines: Vec<&str> = err.trim_end().lines().collect();
    assert_eq!(lines[..2], ["slept", "stack traceback:"], "{err}");
    // (Lua 5.4's `error` is a C function: its native frame comes first, `luaB_error`.)
    let levels: Vec<&str> = lines[2..]
        .iter()
        .map(|l| l.split_once("  ").map_or(*l, |x| x.1))
        .filter(|l| !l.starts_with("0x"))
        .collect();
    assert_eq!(levels.len(), 2, "{err}");
    assert_eq!(levels[0], "error in =[C]:-1", "{err}");
    assert!(
        levels[1].starts_with("main chunk in @") && levels[1].ends_with("/tostring_sleeps.lua:3"),
        "{err}"
    );
    assert_eq!(out, b"other ran\n");
    assert_eq!(code, Some(1));
}

#[test]
fn an_error_object_without_a_usable_tostring_is_named_by_its_type() {
    for (what, src, shown) in [
        (
            "plain table",
            "error({code = 1})",
            "(error object is a table value)",
        ),
        (
            "failing __tostring",
            "error(setmetatable({}, {__tostring = function() error('inner') end}))",
            "(error object is a table value)",
        ),
        (
            "__tostring returning a table",
            "error(setmetatable({}, {__tostring = function() return {} end}))",
            "(error object is a table value)",
        ),
        (
            "boolean",
            "error(true)",
            "(error object is a boolean value)",
        ),
        ("nil", "error(nil)", "(error object is a nil value)"),
        ("number", "error(12.5, 0)", "12.5"),
    ] {
        let (_, err, code) = run("typed.lua", src.as_bytes());
        assert_eq!(
            first_line(&err),
            shown.as_bytes(),
            "{what}: {}",
            String::from_utf8_lossy(&err)
        );
        assert_eq!(code, Some(1), "{what}");
    }
}

#[test]
fn a_fiber_error_object_is_reported_through_its_tostring() {
    let (out, err, code) = run(
        "tostring_fiber.lua",
        b"local fiber = require('fiber')\n\
          local f = fiber.create(function()\n\
            fiber.name('worker')\n\
            error(setmetatable({}, {__tostring = function() return 'obj boom' end}))\n\
          end)\n\
          print('after', f:status())\n",
    );
    assert_eq!(out, b"after\tdead\n");
    let err = String::from_utf8(err).unwrap();
    let first = err.lines().next().unwrap();
    let id = first
        .strip_prefix("fibertrace: fiber ")
        .and_then(|r| r.split_once(' '))
        .map(|(id, _)| id)
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        first,
        format!("fibertrace: fiber {id} \"worker\" failed: obj boom")
    );
    assert_eq!(err.lines().nth(1), Some("stack traceback:"));
    assert_eq!(code, Some(0));
}

#[test]
fn error_messages_and_fiber_names_that_are_not_utf8_are_written_as_their_bytes() {
    // A fiber's error, under a name that is not UTF-8.
    let (_, err, code) = run(
        "bytes_fiber.lua",
        b"local fiber = require('fiber')\n\
          fiber.create(function() fiber.name('w\\255\\254') error('bad \\200\\201 bytes', 0) end)\n",
    );
    let line = first_line(&err);
    assert!(
        line.ends_with(b" \"w\xff\xfe\" failed: bad \xc8\xc9 bytes"),
        "{line:?}"
    );
    assert_eq!(code, Some(0));
    // The main script's error.
    let (_, err, code) = run("bytes_main.lua", b"error('main \\255 end', 0)\n");
    assert_eq!(first_line(&err), b"main \xff end");
    assert_eq!(code, Some(1));
    // Through __tostring.
    let (_, err, code) = run(
        "bytes_tostring.lua",
        b"error(setmetatable({}, {__tostring = function() return '\\192\\193' end}))\n",
    );
    assert_eq!(first_line(&err), b"\xc0\xc1");
    assert_eq!(code, Some(1));
}

#[test]
fn the_signal_dump_quotes_names_so_their_bytes_read_back() {
    // (The signal is sent from the background: `system` ignores SIGQUIT while it waits.)
    // SIGQUIT's dump is written by the runtime: names are quoted with escapes (a byte that
    // is not UTF-8 as \xNN, a quote, a backslash and a line end escaped).
    let (_, err, code) = run(
        "dump_names.lua",
        b"local fiber = require('fiber')\n\
          local f = fiber.create(function() fiber.name('a\\255\"b\\\\c\\nd') fiber.sleep(10) end)\n\
          local pid = io.open('/proc/self/stat'):read('*n')\n\
          fiber.yield()\n\
          os.execute('(sleep 0.05; kill -QUIT ' .. pid .. ') &')\n\
          fiber.sleep(1)\n\
          os.exit(0)\n",
    );
    let err = String::from_utf8(err).unwrap();
    assert!(
        err.lines()
            .any(|l| l.starts_with("fiber ") && l.contains(r#" "a\xff\"b\\c\nd" ["#)),
        "{err}"
    );
    assert_eq!(code, Some(0));
}

/// The slice warning and the heap report quote names as the dump does (the warning wrote
/// the name's bytes raw, its newline breaking the line; the heap report wrote Rust's debug
/// form, `\u{10ffff}` for the byte 0xff).
#[test]
fn the_slice_warning_and_the_heap_report_quote_names_as_the_dump_does() {
    let (out, err, code) = run_with(
        &["--heap"],
        "slice_names.lua",
        b"local fiber = require('fiber')\n\
          local clock = require('clock')\n\
          fiber.set_max_slice({warn = 0.05, err = 10})\n\
          local f = fiber.new(function()\n\
          \x20 fiber.name('a\\255\"b\\\\c\\nd')\n\
          \x20 local t = clock.monotonic() + 0.15\n\
          \x20 while clock.monotonic() < t do end\n\
          \x20 fiber.check_slice()\n\
          end)\n\
          f:set_joinable(true)\n\
          f:join()\n\
          keep = {}\n\
          fiber.create(function() fiber.name('h\\255\\n') for i = 1, 20000 do keep[i] = string.rep('x', 200) .. i end fiber.sleep(10) end)\n\
          io.write(require('fibertrace').heap({format = 'text', top = 1}))\n\
          os.exit(0)\n",
    );
    let err = String::from_utf8(err).unwrap();
    assert!(
        err.lines().any(|l| l
            == r#"fibertrace: fiber 2 "a\xff\"b\\c\nd": fiber has not yielded for more than 0.050 seconds"#),
        "{err}"
    );
    let out = String::from_utf8(out).unwrap();
    assert!(
        out.lines()
            .any(|l| l.starts_with("[1] ") && l.contains(r#" allocations — fiber 3 "h\xff\n": "#)),
        "{out}"
    );
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn script_names_and_arguments_that_are_not_utf8_reach_the_script_as_their_bytes() {
    use std::os::unix::ffi::OsStrExt;
    let dir = Scratch::new("errors-args");
    let name = std::ffi::OsStr::from_bytes(b"n\xfe.lua");
    std::fs::write(
        dir.join(name),
        b"io.write(arg[0], '|', select('#', ...), '|', arg[1], '|', arg[2], '|', ..., '\\n')\n\
          error('bad \\255 ' .. arg[1])\n",
    )
    .unwrap();
    let o = Command::new(EXE)
        .arg("run")
        .arg(name)
        .arg(std::ffi::OsStr::from_bytes(b"a\xffb"))
        .arg("-h")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.stdout, b"n\xfe.lua|2|a\xffb|-h|a\xffb\n");
    assert_eq!(first_line(&o.stderr), b"n\xfe.lua:2: bad \xff a\xffb");
    assert_eq!(o.status.code(), Some(1));
    // A script that cannot be opened is named by its bytes too.
    let o = Command::new(EXE)
        .arg("run")
        .arg(std::ffi::OsStr::from_bytes(b"no\xfe.lua"))
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(
        o.stderr,
        b"fibertrace: no\xfe.lua: No such file or directory (os error 2)\n"
    );
    assert_eq!(o.status.code(), Some(1));
}

/// Errors raised by the VM itself (arithmetic, a call or an index of nil, a comparison, a
/// concatenation, a `for` limit, an erroring `__index`), in the main chunk and in a fiber:
/// the traceback is the Lua levels in their order and nothing after them, and with
/// `--native-detail` the host's frames follow, starting at `call_in_thread`. LuaJIT's
/// interpreter was taken to reach over the C code linked between its pieces (`lj_meta_arith`
/// among it): the walk skipped that frame's record and showed a bogus `0x7f… in ??+0`
/// below the main chunk, losing every native frame after it.
// (LuaJIT: its interpreter, fast functions and `jit.off`.)
#[cfg(feature = "luajit")]
#[test]
fn errors_raised_by_the_vm_itself_end_at_the_outermost_lua_level() {
    let cases: [(&str, &str, &[&str]); 8] = [
        (
            "local a = nil + 1",
            "attempt to perform arithmetic on a nil value",
            &[],
        ),
        (
            "local a = nil; a()",
            "attempt to call local 'a' (a nil value)",
            &[],
        ),
        (
            "local a = #nil",
            "attempt to get length of a nil value",
            &[],
        ),
        (
            "local a = nil; return a.x",
            "attempt to index local 'a' (a nil value)",
            &[],
        ),
        (
            "local t = setmetatable({}, {__index = function() error('idx') end}); return t.x",
            "idx",
            &["error in =[C]:-1", "__index in @e.lua:1"],
        ),
        ("return {} < {}", "attempt to compare two table values", &[]),
        (
            "return 'a' .. {}",
            "attempt to concatenate a table value",
            &[],
        ),
        ("for i = 1, 'x' do end", "'for' limit must be a number", &[]),
    ];
    let dir = Scratch::new("errors-vm");
    for (body, msg, inner) in cases {
        for in_fiber in [false, true] {
            let src = if in_fiber {
                format!(
                    "local function f() {body} end\nrequire('fiber').create(function() f() end)\n"
                )
            } else {
                format!("local function f() {body} end\nf()\n")
            };
            std::fs::write(dir.join("e.lua"), &src).unwrap();
            let mut levels: Vec<String> = inner.iter().map(|s| s.to_string()).collect();
            levels.push("f in @e.lua:1".into());
            levels.push(if in_fiber {
                "function <e.lua:2> in @e.lua:2".into()
            } else {
                "main chunk in @e.lua:2".into()
            });
            let head = if in_fiber {
                format!("fibertrace: fiber 2 \"lua\" failed: e.lua:1: {msg}")
            } else {
                format!("e.lua:1: {msg}")
            };
            let mut want = format!("{head}\nstack traceback:\n");
            for (i, l) in levels.iter().enumerate() {
                want.push_str(&format!("#{}  {l}\n", i + 1));
            }
            for detail in [false, true] {
                let mut cmd = Command::new(EXE);
                cmd.arg("run");
                if detail {
                    cmd.arg("--native-detail");
                }
                let o = cmd.arg("e.lua").current_dir(&dir).output().unwrap();
                let err = String::from_utf8_lossy(&o.stderr).into_owned();
                assert_eq!(o.status.code(), Some(if in_fiber { 0 } else { 1 }), "{src}");
                assert!(err.starts_with(&want), "{src} (detail {detail}):\n{err}");
                let rest = &err[want.len()..];
                assert!(!err.contains("??"), "{src} (detail {detail}):\n{err}");
                if detail {
                    let next = rest.lines().next().unwrap_or_default();
                    assert!(
                        next.contains(" in fibertrace_lua::host::spawn::call_in_thread+"),
                        "{src}:\n{err}"
                    );
                } else {
                    assert!(rest.trim().is_empty(), "{src}:\n{err}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A LuaJIT fast function that raises an argument error does so in its C fallback
/// (`lj_ffh_*`): that native frame comes first, right above the fast function's level, as a
/// C function's own frame does (`select(0)`: `lj_cf_select`, then `select`). It used to land
/// below the main chunk, the fast function having no C function to anchor it.
// (LuaJIT: its interpreter, fast functions and `jit.off`.)
#[cfg(feature = "luajit")]
#[test]
fn a_fast_functions_error_shows_its_c_fallback_innermost() {
    let cases = [
        (
            "math.floor('a')",
            "floor",
            "bad argument #1 to 'floor' (number expected, got string)",
            "lj_ffh_math_",
        ),
        (
            "setmetatable(1, {})",
            "setmetatable",
            "bad argument #1 to 'setmetatable' (table expected, got number)",
            "lj_ffh_setmetatable+",
        ),
        (
            "pcall()",
            "pcall",
            "bad argument #1 to 'pcall' (value expected)",
            "lj_ffh_pcall+",
        ),
        (
            "coroutine.resume(1)",
            "resume",
            "bad argument #1 to 'resume' (coroutine expected)",
            "lj_ffh_coroutine_resume+",
        ),
        (
            "tostring()",
            "tostring",
            "bad argument #1 to 'tostring' (value expected)",
            "lj_ffh_tostring+",
        ),
        // Fallbacks that tail-jump to a shared helper (`lj_ffh_pairs`: `jmp ffh_pairs`;
        // `getmetatable` recycles `ipairs`'s): the helper's frame stands for them.
        (
            "pairs()",
            "pairs",
            "bad argument #1 to 'pairs' (value expected)",
            "ffh_pairs+",
        ),
        (
            "ipairs()",
            "ipairs",
            "bad argument #1 to 'ipairs' (value expected)",
            "ffh_pairs+",
        ),
        (
            "getmetatable()",
            "getmetatable",
            "bad argument #1 to 'getmetatable' (value expected)",
            "ffh_pairs+",
        ),
    ];
    let dir = Scratch::new("errors-ff");
    for (call, name, msg, native) in cases {
        let src = format!("local function f() local x = {call} return x end\nf()\n");
        std::fs::write(dir.join("e.lua"), &src).unwrap();
        let o = Command::new(EXE)
            .args(["run", "e.lua"])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{src}");
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(
            lines[..2],
            [format!("e.lua:1: {msg}").as_str(), "stack traceback:"],
            "{err}"
        );
        let frame = lines[2].split_once(" in ").map(|x| x.1).unwrap_or_default();
        assert!(
            lines[2].starts_with("#1  0x") && frame.starts_with(native),
            "{src}:\n{err}"
        );
        assert_eq!(
            lines[3..],
            [
                format!("#2  {name} in =[C]:-1").as_str(),
                "#3  f in @e.lua:1",
                "#4  main chunk in @e.lua:2",
                ""
            ],
            "{src}:\n{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
