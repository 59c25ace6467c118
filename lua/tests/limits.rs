//! Resource limits in the Lua host are Lua errors at the call that hit them, and the program
//! goes on: fiber stacks past the address-space limit or `vm.max_map_count`, a full Lua heap,
//! more values than a Lua stack takes; and fiber names are kept as the bytes they were given.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_fibertrace");

struct Out {
    stdout: String,
    stderr: Vec<u8>,
    code: Option<i32>,
}

/// Runs `fibertrace run` on the script `src` (written to a file) with `args`, under
/// `ulimit -v KB` when given.
fn run(name: &str, src: &str, args: &[String], ulimit_kb: Option<u64>) -> Out {
    let dir = Scratch::new("limits");
    let path = dir.join(name);
    std::fs::write(&path, src).unwrap();
    let mut c = Command::new("bash");
    // (glibc's heap is given room up front: the Lua heap is what fills, not Rust's.)
    let limit = ulimit_kb.map_or(String::new(), |kb| {
        format!("export MALLOC_TOP_PAD_=33554432; ulimit -v {kb}; ")
    });
    c.arg("-c")
        .arg(format!("{limit}exec \"$0\" run \"$@\""))
        .arg(EXE)
        .arg(&path)
        .args(args);
    let o = c.output().unwrap();
    Out {
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: o.stderr,
        code: o.status.code(),
    }
}

/// The virtual size (KiB) of `fibertrace run` with a script that has made `fibers` sleeping
/// fibers: the base for a `ulimit -v` that leaves a known room.
fn vm_size_kb(fibers: usize) -> u64 {
    let src = format!(
        "local fiber = require('fiber')
         for i = 1, {fibers} do fiber.create(function() fiber.sleep(10) end) end
         local f = io.open('/proc/self/status') local s = f:read('*a') f:close()
         print(s:match('VmSize:%s*(%d+)')) os.exit(0)"
    );
    let o = run("vmsize.lua", &src, &[], None);
    o.stdout.trim().parse().unwrap()
}

#[test]
fn fiber_create_past_the_address_space_limit_is_a_lua_error_and_the_program_goes_on() {
    // Room for about 40 fiber stacks (plus 320 KiB of reserve and guard each).
    let stack = fibertrace_lua::LuaHost::FIBER_STACK;
    let base = vm_size_kb(0);
    let src = r#"
        local fiber = require('fiber')
        print('before')
        local ran, n = 0, 0
        local ok, err = pcall(function()
            for i = 1, 100000 do
                fiber.create(function() fiber.sleep(0.01) ran = ran + 1 end)
                n = i
            end
        end)
        print(ok, err)
        -- the fibers made still run, and their stacks are reused once they end
        while ran < n do fiber.sleep(0.01) end
        print('ran', ran == n, n > 10)
        local again = 0
        for i = 1, n do fiber.create(function() again = again + 1 end) end
        -- the object of each fiber made after the failure is its own (the failed create's
        -- object, made ahead and never seen, is given to a later fiber with its id)
        local own, objs = 0, {}
        for i = 1, n do
            local f
            f = fiber.new(function()
                if rawequal(fiber.self(), f) and f:id() == fiber.id() then own = own + 1 end
            end)
            objs[f] = true
        end
        local distinct = 0
        for _ in pairs(objs) do distinct = distinct + 1 end
        for _ = 1, 1000 do
            if own == n then break end
            fiber.sleep(0.001)
        end
        print('again', again == n, own == n, distinct == n)
        os.exit(0)
    "#;
    let o = run(
        "as_limit.lua",
        src,
        &[],
        Some(base + 40 * (stack as u64 / 1024 + 320)),
    );
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"before"), "{}", o.stdout);
    let err = lines.get(1).copied().unwrap_or_default();
    assert!(
        err.starts_with(&format!(
            "false\tfiber.create: cannot create a fiber: its {stack}-byte stack does not fit in \
             the address-space limit (RLIMIT_AS, ulimit -v) of "
        )) && err.contains(
            " bytes kept for the rest of the process (Cannot allocate memory (os error 12); "
        ),
        "{err}"
    );
    assert_eq!(
        &lines[2..],
        ["ran\ttrue\ttrue", "again\ttrue\ttrue\ttrue"],
        "{}",
        o.stdout
    );
    assert_eq!(o.code, Some(0));
}

#[test]
fn fiber_create_past_max_map_count_is_a_lua_error_and_the_program_goes_on() {
    let max: usize = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let reserve = (max / 16).clamp(1024, 8192);
    let allowed = (max - reserve) / 2;
    let src = format!(
        r#"
        local fiber = require('fiber')
        print('before')
        local n = 0
        local ok, err = pcall(function()
            for i = 1, {} do fiber.create(function() fiber.sleep(1000) end) n = i end
        end)
        print(n, err)
        -- the process goes on: it allocates, and makes fibers once others end
        local t = {{}} for i = 1, 100000 do t[i] = tostring(i) end
        print('allocated', #t)
        os.exit(0)
    "#,
        allowed + 10
    );
    let o = run("map_count.lua", &src, &[], None);
    // The main fiber holds a stack too.
    let expect = format!(
        "before\n{}\tfiber.create: cannot create a fiber: {allowed} fiber stacks in use, as many \
         as vm.max_map_count ({max}) allows at 2 memory mappings each, with {reserve} kept for \
         the rest of the process\nallocated\t100000\n",
        allowed - 1
    );
    assert_eq!(o.stdout, expect);
    assert_eq!(o.code, Some(0));
}

/// LuaJIT's own allocator (what `fibertrace run` uses), a heap of its own: the heap is
/// measured and then bounded with the address-space limit. (Lua 5.4's allocator is the C
/// library's `malloc`, shared with the host: which small allocations still succeed once
/// Lua's first one failed is not predictable, so neither is which calls raise; that none
/// aborts the process is checked in `reliability.rs`.)
#[cfg(feature = "luajit")]
#[test]
fn with_the_lua_heap_full_fiber_functions_raise_not_enough_memory() {
    let src = include_str!("limits/heap_full.lua");
    let vm: u64 = run(
        "heap_full.lua",
        src,
        &["measure".into()],
        Some(u32::MAX.into()),
    )
    .stdout
    .trim()
    .parse()
    .unwrap();
    let o = run("heap_full.lua", src, &[], Some(vm + 65536));
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"before"), "{}", o.stdout);
    assert_eq!(lines.last(), Some(&"after"), "{}", o.stdout);
    // Each call either completed (it needed no new memory) or raised `not enough memory`;
    // the ones that must make something new raised. (Not the `info` calls: the first that
    // names native frames gets the address space `fibertrace run` set aside for the first
    // report at the limit, and the Lua heap may grow into what the names leave of it.)
    let must_fail = [
        "fiber.self",
        "fiber.cond",
        "fiber.channel",
        "fiber.create",
        "fiber.new",
        "tostring(other)",
        "tostring(ch)",
    ];
    for l in &lines[1..lines.len() - 2] {
        let f: Vec<&str> = l.split('\t').collect();
        assert_eq!(f.len(), 3, "{l}");
        if must_fail.contains(&f[0]) || f[1] == "false" {
            assert_eq!(&f[1..], ["false", "not enough memory"], "{l}");
        }
    }
    assert_eq!(lines.len(), 34, "{}", o.stdout);
    // Once memory is back, fiber.info() works as before (its hook and stack slots were
    // restored after the failures).
    assert_eq!(lines[lines.len() - 2], "info again\ttrue\tsleeping");
    assert_eq!(o.code, Some(0));
}

#[test]
fn caller_controlled_numbers_of_values_fit_the_lua_stack_or_fail_clearly() {
    let src = r#"
        local fiber = require('fiber')
        local unpack = table.unpack or unpack
        local t = {} for i = 1, 8000 do t[i] = i end
        print('before')
        local f = fiber.new(function(...) return ... end, unpack(t, 1, 7997))
        f:set_joinable(true)
        print(select('#', f:join()))
        fiber.create(function(...) print('args', select('#', ...)) end, unpack(t, 1, 7997))
        print('args', select('#', ...))
        os.exit(0)
    "#;
    let o = run("stack.lua", src, &[], None);
    assert_eq!(o.stdout, "before\n7998\nargs\t7997\nargs\t0\n");
    assert_eq!(o.code, Some(0));
    // Script arguments past what a Lua stack takes (LuaJIT's: about 65,000 slots; Lua 5.4
    // takes a million): the script does not start, said plainly.
    let args: Vec<String> = (1..=70_000).map(|i| i.to_string()).collect();
    let o = run("args.lua", "print('ran', #arg)", &args, None);
    if cfg!(feature = "luajit") {
        assert_eq!(o.stdout, "");
        assert_eq!(
            String::from_utf8_lossy(&o.stderr).lines().next(),
            Some(
                "fibertrace: cannot pass 70000 arguments to the script as its `...` (more \
                 than a Lua stack holds): stack overflow; the script was not run"
            )
        );
        assert_eq!(o.code, Some(1));
    } else {
        assert_eq!((o.stdout.as_str(), o.code), ("ran\t70000\n", Some(0)));
    }
    let args: Vec<String> = (1..=20_000).map(|i| i.to_string()).collect();
    let o = run(
        "args.lua",
        "print('ran', #arg, select('#', ...))",
        &args,
        None,
    );
    assert_eq!(o.stdout, "ran\t20000\t20000\n");
}

#[test]
fn fiber_names_are_kept_as_their_bytes() {
    let src = r#"
        local fiber = require('fiber')
        local n = 'a\255\254b\192\244\143\191\191z'
        fiber.name(n)
        print(fiber.name() == n, #fiber.name())
        local f = fiber.new(function() fiber.sleep(10) end)
        f:name(n .. '2')
        print(f:name() == n .. '2', f:__serialize().name == n .. '2')
        local found = 0
        for _, v in pairs(fiber.info()) do
            if v.name == n or v.name == n .. '2' then found = found + 1 end
        end
        print('info', found)
        fiber.top_enable() fiber.yield()
        local keys = 0
        for k in pairs(fiber.top().cpu) do if k == f:id() .. '/' .. n .. '2' then keys = keys + 1 end end
        print('top', keys)
        print(pcall(fiber.name, string.rep('\195\169', 200), {truncate = true}))
        print(#fiber.name(), fiber.name():byte(-1))
        print(pcall(fiber.name, string.rep('x', 256)))
        fiber.name(12.5) print(fiber.name())
        fiber.create(function() fiber.name(n) error('boom', 0) end)
        os.exit(0)
    "#;
    let o = run("names.lua", src, &[], None);
    assert_eq!(
        o.stdout,
        "true\t10\ntrue\ttrue\ninfo\t2\ntop\t1\ntrue\n255\t195\n\
         false\tFiber name is too long\n12.5\n"
    );
    let report = b"\" failed: boom\n";
    let mut want = b"\"a\xff\xfeb\xc0\xf4\x8f\xbf\xbfz".to_vec();
    want.extend_from_slice(report);
    assert!(
        o.stderr.windows(want.len()).any(|w| w == want.as_slice()),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.code, Some(0));
}

/// With the heap tracked (`--heap`, `--heap=every`), Lua allocates through the process's
/// allocator: one that fails is Lua's `not enough memory`, which `pcall` catches, as without
/// tracking. mlua's allocator, used before for that, aborted the process (`memory allocation
/// of N bytes failed`, SIGABRT).
#[test]
fn with_the_heap_tracked_a_full_address_space_is_not_enough_memory_not_an_abort() {
    let dir = Scratch::new("limits-heap");
    let path = dir.join("oom.lua");
    std::fs::write(
        &path,
        "local t = {}\n\
         local ok, e = pcall(function() for i = 1, 1e6 do t[i] = string.rep('x', 1048576) .. i end end)\n\
         t = nil collectgarbage() collectgarbage()\n\
         print('caught', ok, e)\n",
    )
    .unwrap();
    for tier in ["--heap", "--heap=every"] {
        let o = Command::new("bash")
            .arg("-c")
            .arg("ulimit -v 1000000; exec \"$0\" run \"$@\"")
            .arg(EXE)
            .arg(tier)
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let out = String::from_utf8_lossy(&o.stdout);
        // (With every allocation carrying its stack, the collection after the error can
        // itself find no memory — LuaJIT allocates while it shrinks its tables — and that
        // error, outside the pcall, ends the script: a Lua error too, not an abort.)
        match o.status.code() {
            Some(0) => assert_eq!(out, "caught\tfalse\tnot enough memory\n", "{tier}: {err}"),
            Some(1) if tier == "--heap=every" => {
                assert!(err.starts_with("not enough memory"), "{tier}: {err}");
                assert_eq!(out, "", "{tier}: {err}");
            }
            c => panic!("{tier}: exit {c:?}: {err}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
