//! Backtraces against the truth the script itself establishes (what it called, where it
//! waits, LuaJIT's own `debug.traceback` of the thread): the cases a black-box sweep found
//! misreported, each the shape of stack that showed it.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

#[path = "common/bounded.rs"]
mod bounded;

/// Runs `script` (written to a scratch file) with `fibertrace run ARGS… SCRIPT`; its stdout,
/// with the script's path replaced by `S`, after checking that it ended with 0.
fn run_script(name: &str, args: &[&str], script: &str) -> (String, String) {
    let dir = Scratch::new(name);
    let path = dir.join(format!("{name}.lua"));
    std::fs::write(&path, script).unwrap();
    let p = path.to_str().unwrap();
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.push(p);
    let o = bounded::run(&all, b"");
    assert_eq!(o.code, Some(0), "{}\n{}", o.stdout, o.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    (o.stdout.replace(p, "S"), o.stderr.replace(p, "S"))
}

/// A fiber that waits inside 40 nested coroutines: its trace begins at the wait in the
/// innermost one (`sleep`, then the function that called it), in every view, as LuaJIT's
/// own traceback of that coroutine does. Past 16 coroutines the innermost ones were dropped
/// without a word and the wait's native frames sat on an outer `resume`.
#[test]
fn a_fiber_waiting_inside_forty_nested_coroutines_shows_the_innermost_wait() {
    let (out, _) = run_script(
        "nest40",
        &[],
        "local fiber = require('fiber')\n\
         local inner\n\
         local function nest(n)\n\
         \x20 if n == 0 then inner = coroutine.running() fiber.sleep(5) return end\n\
         \x20 local co = coroutine.create(function() nest(n - 1) end)\n\
         \x20 assert(coroutine.resume(co))\n\
         end\n\
         local f = fiber.create(function() nest(40) end)\n\
         fiber.yield()\n\
         -- LuaJIT's own view of the innermost coroutine:\n\
         print((debug.traceback(inner, '', 0):gsub('^%s+', ''):gsub('%s*\\n%s*', '|')))\n\
         local lua = {}\n\
         for _, e in ipairs(fiber.info()[f:id()].backtrace) do\n\
         \x20 if e.L then lua[#lua + 1] = e.L:gsub('^#%d+%s+', '') end\n\
         end\n\
         print(table.concat(lua, '|', 1, 4))\n\
         local d = require('fibertrace').dump()\n\
         local block = d:match('\\nfiber ' .. f:id() .. ' [^\\n]*\\n(.-)\\n\\n')\n\
         local dl = {}\n\
         for l in block:gmatch('[^\\n]+') do\n\
         \x20 if not l:find(' 0x') then dl[#dl + 1] = l:gsub('^#%d+%s+', '') end\n\
         end\n\
         print(table.concat(dl, '|', 1, 4))\n\
         os.exit(0)\n",
    );
    let lines: Vec<&str> = out.lines().collect();
    // (Each VM words its own traceback.)
    let truth = if cfg!(feature = "luajit") {
        "stack traceback:|[C]: in function 'sleep'|S:4: in function 'nest'|S:5: in function <S:5>"
    } else {
        "stack traceback:|[C]: in function 'fiber.sleep'|S:4: in upvalue 'nest'|\
         S:5: in function <S:5>"
    };
    assert_eq!(lines[0], truth, "{out}");
    let want = "sleep in =[C]:-1|nest in @S:4|function <S:5> in @S:5|resume in =[C]:-1";
    assert_eq!(lines[1], want, "fiber.info: {out}");
    assert_eq!(lines[2], want, "dump: {out}");
}

/// A creator's trace in the dumps names its Lua frames, as `fiber.info().parent_backtrace`
/// does, in the text and grouped views and the JSON one: they printed as `[lua frame N]`.
#[test]
fn creators_traces_in_dumps_name_their_lua_frames() {
    let (out, _) = run_script(
        "parents",
        &[],
        "local fiber = require('fiber')\n\
         local ft = require('fibertrace')\n\
         fiber.parent_backtrace_enable()\n\
         local function spawn_worker() local f = fiber.create(function() fiber.sleep(10) end) return f end\n\
         local function setup() local f = spawn_worker() return f end\n\
         local w = setup()\n\
         w:name('worker')\n\
         local function lua_lines(block)\n\
         \x20 local t = {}\n\
         \x20 for l in block:gmatch('[^\\n]+') do\n\
         \x20   if not l:find(' 0x') then t[#t + 1] = (l:gsub('^#%d+%s+', '')) end\n\
         \x20 end\n\
         \x20 return table.concat(t, '|')\n\
         end\n\
         print(lua_lines(ft.dump():match('created by fiber 1 \"main\" at:\\n(.-)\\n\\n')))\n\
         print(lua_lines(ft.dump('grouped'):match('created by fiber 1 \"main\" at:\\n(.-)\\n\\n')))\n\
         local json = ft.dump('json')\n\
         local labels = {}\n\
         for arr in json:gmatch('\"parent_backtrace\": *(%b[])') do\n\
         \x20 for l in arr:gmatch('\"label\": *\"([^\"]*)\"') do labels[#labels + 1] = l end\n\
         end\n\
         print(table.concat(labels, '|'))\n\
         os.exit(0)\n",
    );
    let want = "create in =[C]:-1|spawn_worker in @S:4|setup in @S:5|main chunk in @S:6";
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines, [want, want, want], "{out}");
}

/// A fiber woken from a sleep or a channel wait, not yet run again, is ready and waits on
/// nothing, in `fiber.info()` and in the dump: it was shown `[sleep, 23ms]`, `waiting.on =
/// 'sleep'`, while it was about to run.
#[test]
fn a_woken_fiber_is_ready_and_waits_on_nothing() {
    let (out, _) = run_script(
        "woken",
        &[],
        "local fiber = require('fiber')\n\
         local ch = fiber.channel()\n\
         local w = fiber.create(function() fiber.name('sleeper') fiber.sleep(10) print('sleeper resumed') end)\n\
         local r = fiber.create(function() fiber.name('reader') ch:get() end)\n\
         local s = fiber.create(function() fiber.name('still') fiber.sleep(10) end)\n\
         w:wakeup()\n\
         r:wakeup()\n\
         local info = fiber.info()\n\
         for _, f in ipairs{w, r, s} do\n\
         \x20 local i = info[f:id()]\n\
         \x20 print(f:name(), i.status, i.waiting and i.waiting.on)\n\
         end\n\
         for h in require('fibertrace').dump():gmatch('\\n(fiber %d+ [^\\n]*)') do\n\
         \x20 print((h:gsub('[%d.]+[mu]?s%]', 'N]')))\n\
         end\n\
         fiber.yield()\n\
         os.exit(0)\n",
    );
    assert_eq!(
        out,
        "sleeper\tready\tnil\n\
         reader\tready\tnil\n\
         still\tsleeping\tsleep\n\
         fiber 1 \"main\" [running]:\n\
         fiber 2 \"sleeper\" [ready]:\n\
         fiber 3 \"reader\" [ready]:\n\
         fiber 4 \"still\" [sleep, N]:\n\
         sleeper resumed\n"
    );
}

/// Native code that runs inside a C function and calls back into Lua sits between the Lua it
/// called and the C function's level: `load` reading its chunk through a reader function
/// (`reader_func`, `lj_cf_load`), and a C library's `qsort` calling an FFI callback (`qsort`,
/// `lj_cf_ffi_meta___call`) — those frames were printed after the main chunk, as if they
/// had called it.
#[cfg(feature = "luajit")]
#[test]
fn native_code_between_a_callback_and_its_c_function_stays_between_them() {
    let (out, _) = run_script(
        "callbacks",
        &[],
        "local fiber = require('fiber')\n\
         local ffi = require('ffi')\n\
         local ft = require('fibertrace')\n\
         ffi.cdef[[ void qsort(void *base, size_t nmemb, size_t size, int (*compar)(const void *, const void *)); ]]\n\
         local function names(block)\n\
         \x20 local t = {}\n\
         \x20 for l in block:gmatch('[^\\n]+') do\n\
         \x20   local fn = l:match(' 0x%x+ in ([%w_]+)') or l:match('^#%d+%s+(.-)$')\n\
         \x20   if fn then t[#t + 1] = fn end\n\
         \x20 end\n\
         \x20 return table.concat(t, '|')\n\
         end\n\
         local function reader() print(names(ft.dump():match('\\nfiber 1 [^\\n]*\\n(.-)\\n\\n'))) return nil end\n\
         local function loader() load(reader) end\n\
         loader()\n\
         local slept = false\n\
         local function cmp(a, b)\n\
         \x20 if not slept then slept = true fiber.sleep(10) end\n\
         \x20 return 0\n\
         end\n\
         local cb = ffi.cast('int (*)(const void *, const void *)', cmp)\n\
         local arr = ffi.new('int[4]', {3, 1, 2, 0})\n\
         local function sorter() ffi.C.qsort(arr, 4, 4, cb) end\n\
         local f = fiber.create(function() sorter() end)\n\
         fiber.yield()\n\
         print(names(ft.dump():match('\\nfiber 2 [^\\n]*\\n(.-)\\n\\n')))\n\
         os.exit(0)\n",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "dump in =[C]:-1|function <S:13> in @S:13|reader_func|lj_cf_load|load in =[C]:-1|\
         loader in @S:14|main chunk in @S:15",
        "{out}"
    );
    // (The C library's sort may be inlined into `qsort` or `qsort_r`; its frames are
    // `msort_with_tmp` in glibc.)
    let sorted = lines[1];
    let (head, tail) = sorted
        .split_once("|function <S:17> in @S:18|")
        .unwrap_or_else(|| panic!("{out}"));
    assert!(head.ends_with("sleep in =[C]:-1"), "{out}");
    let (native, lua) = tail
        .split_once("|qsort in =[C]:-1|")
        .unwrap_or_else(|| panic!("{out}"));
    assert!(native.ends_with("lj_cf_ffi_meta___call"), "{out}");
    assert!(
        native.contains("msort") || native.contains("qsort"),
        "{out}"
    );
    assert_eq!(lua, "sorter in @S:23|function <S:24> in @S:24", "{out}");
}

/// The creator's trace of a fiber made by `fiber.new` starts at the `new` call, as one made by
/// `fiber.create` starts at `create`: it began with the host's own capture frames
/// (`current_frames`, `spawn_lua`).
#[test]
fn a_fiber_new_creators_trace_starts_at_the_new_call() {
    let (out, _) = run_script(
        "new_parent",
        &[],
        "local fiber = require('fiber')\n\
         fiber.parent_backtrace_enable()\n\
         local function mk() local f = fiber.new(function() fiber.sleep(10) end) return f end\n\
         local function mk2() local f = fiber.create(function() fiber.sleep(10) end) return f end\n\
         for _, f in ipairs{mk(), mk2()} do\n\
         \x20 local t = {}\n\
         \x20 for _, e in ipairs(fiber.info()[f:id()].parent_backtrace) do\n\
         \x20   t[#t + 1] = ((e.C or e.L):gsub('^#%d+%s+', ''):gsub('^0x%x+ in ', ''):gsub('%+%d+$', ''))\n\
         \x20 end\n\
         \x20 print(table.concat(t, '|', 1, 4))\n\
         end\n\
         os.exit(0)\n",
    );
    assert_eq!(
        out,
        "fibertrace_lua::host::spawn::f_new|new in =[C]:-1|mk in @S:3|main chunk in @S:5\n\
         fibertrace_lua::host::spawn::f_create|create in =[C]:-1|mk2 in @S:4|main chunk in @S:5\n"
    );
}

/// `os.exit` in nested calls with `--dump-on-exit`: the exiting fiber's trace begins at the
/// script's own call, without the program's wrapper around `os.exit` (`dump in =[C]`,
/// `exit in =fibertrace:11`, which the script never wrote).
#[test]
fn an_exit_dump_starts_at_the_scripts_own_exit_call() {
    let dir = Scratch::new("exit-dump");
    let file = dir.join("exit.txt");
    let (out, _) = run_script(
        "exit_dump",
        &["--dump-on-exit", &format!("text:{}", file.display())],
        "local function leave() os.exit(0) end\n\
         local function mid() leave() end\n\
         print('before')\n\
         mid()\n",
    );
    assert_eq!(out, "before\n");
    let dump = std::fs::read_to_string(&file).unwrap();
    let main = dump
        .split("\n\n")
        .find(|b| b.starts_with("fiber 1 \"main\" [running]:"))
        .unwrap_or_else(|| panic!("{dump}"));
    let lines: Vec<&str> = main.lines().skip(1).collect();
    assert!(lines.len() == 3, "{dump}");
    assert!(
        lines[0].starts_with("#0  leave in @") && lines[0].ends_with(":1"),
        "{dump}"
    );
    assert!(
        lines[1].starts_with("#1  mid in @") && lines[1].ends_with(":2"),
        "{dump}"
    );
    assert!(
        lines[2].starts_with("#2  main chunk in @") && lines[2].ends_with(":4"),
        "{dump}"
    );
}

/// An uncaught error ends the script: the exit dump shows the main fiber where the error was
/// raised, and says so, beside the fibers still waiting. It had ended by the time the dump
/// was written, and the one stack that mattered was missing from the post-mortem file.
#[test]
fn an_exit_dump_after_an_uncaught_error_shows_where_it_was_raised() {
    let dir = Scratch::new("error-dump");
    let file = dir.join("err.txt");
    let script = dir.join("fails.lua");
    std::fs::write(
        &script,
        "local fiber = require('fiber')\n\
         local function boom() local t = nil; return t.x end\n\
         local function mid() local r = boom(); return r end\n\
         fiber.create(function() fiber.name('bystander'); fiber.sleep(10) end)\n\
         mid()\n",
    )
    .unwrap();
    let o = bounded::run(
        &[
            "run",
            "--dump-on-exit",
            &format!("text:{}", file.display()),
            script.to_str().unwrap(),
        ],
        b"",
    );
    assert_eq!(o.code, Some(1), "{}", o.stderr);
    let p = script.display().to_string();
    let dump = std::fs::read_to_string(&file).unwrap().replace(&p, "S");
    let blocks: Vec<&str> = dump.split("\n\n").collect();
    assert_eq!(blocks[0], "scheduler 1 \"lua\": 2 fibers", "{dump}");
    // (Each VM words its own error.)
    let message = if cfg!(feature = "luajit") {
        "S:2: attempt to index local 't' (a nil value)"
    } else {
        "S:2: attempt to index a nil value (local 't')"
    };
    assert_eq!(
        blocks[1],
        format!(
            "(fiber 1 \"main\" ended by an uncaught error: {message}; its trace is where the \
             error was raised)"
        ),
        "{dump}"
    );
    assert_eq!(
        blocks[2],
        "fiber 1 \"main\" [dead]:\n\
         #0  boom in @S:2\n\
         #1  mid in @S:3\n\
         #2  main chunk in @S:5",
        "{dump}"
    );
    assert!(
        blocks[3].starts_with("fiber 2 \"bystander\" [sleep, "),
        "{dump}"
    );
    assert!(
        o.stderr.contains("stack traceback:\n#1  boom in @"),
        "{}",
        o.stderr
    );
}

/// A fiber deep in 150 nested coroutines (Lua 5.4 allows 200 nested C calls): one `... N
/// frames omitted ...` marker, in the middle,
/// and the trace ends at the fiber's entry function. The native trace's own cut (the resumes'
/// frames, hidden anyway) showed as a second marker after the entry function.
#[test]
fn a_deep_nest_of_coroutines_has_one_omission_in_its_middle() {
    let (out, _) = run_script(
        "deep_nest",
        &[],
        "local fiber = require('fiber')\n\
         local function nest(k)\n\
         \x20 if k == 0 then fiber.sleep(10) return end\n\
         \x20 local co = coroutine.create(nest)\n\
         \x20 assert(coroutine.resume(co, k - 1))\n\
         end\n\
         local f = fiber.create(function() nest(150) end)\n\
         fiber.yield()\n\
         print(require('fibertrace').dump():match('\\nfiber 2 [^\\n]*\\n(.-)\\n\\n'))\n\
         os.exit(0)\n",
    );
    let lines: Vec<&str> = out.lines().collect();
    let marks: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains(" frames omitted ..."))
        .collect();
    // (LuaJIT's resumes run in its VM, whose frames are not shown: one marker. Lua 5.4's run
    // through C functions that are, and its native trace's own cut is a second marker, in
    // the middle too.)
    if cfg!(feature = "luajit") {
        assert_eq!(marks.len(), 1, "{out}");
    } else {
        assert!(!marks.is_empty() && marks.len() <= 2, "{out}");
    }
    assert!(
        marks.iter().all(|&m| m > 10 && m + 2 < lines.len()),
        "{out}"
    );
    assert!(
        lines.last().unwrap().ends_with("function <S:7> in @S:7"),
        "{out}"
    );
}
