//! `fibertrace run --http ADDR`: the views of a running Lua program over HTTP — with the
//! Lua frames of its fibers while it waits, and an answer (native frames, a note) while a
//! fiber spins; bad addresses refused before the script runs.

#[path = "../../fiber/tests/common/tied.rs"]
mod tied;
use tied::Tied;

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The script `body` as file `name` in a scratch directory of its own (kept with it).
fn script(name: &str, body: &str) -> (Scratch, PathBuf) {
    let d = Scratch::new("lhttp");
    let p = d.join(name);
    std::fs::write(&p, body).unwrap();
    (d, p)
}

/// Starts `fibertrace run --http 127.0.0.1:0 SCRIPT`; the child (its stdin a pipe the
/// test may write to), the address it serves on, and its stdout.
fn start(path: &PathBuf) -> (Child, SocketAddr, BufReader<std::process::ChildStdout>) {
    start_with(path, &[])
}

/// [`start`] with more options before the script.
fn start_with(
    path: &PathBuf,
    opts: &[&str],
) -> (Child, SocketAddr, BufReader<std::process::ChildStdout>) {
    start_under("", path, opts)
}

/// [`start_with`] under the shell's `limits` (`ulimit -v N`, ...; empty: none).
fn start_under(
    limits: &str,
    path: &PathBuf,
    opts: &[&str],
) -> (Child, SocketAddr, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "{limits}\nexec \"$0\" run --http 127.0.0.1:0 \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_fibertrace"))
        .args(opts)
        .arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line
        .strip_prefix("fibertrace: serving http://")
        .and_then(|r| r.strip_suffix("/debug/fibers\n"))
        .unwrap_or_else(|| panic!("{line:?}"))
        .parse()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, addr, out)
}

fn get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    // (A guard against a hang, not a bound on speed: three views of 4,000 fibers asked at
    // once take 14 s in a debug build on an idle two-core machine, over 20 with one core
    // taken.)
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let all = String::from_utf8_lossy(&all).into_owned();
    let (head, body) = all.split_once("\r\n\r\n").unwrap();
    (head[9..12].parse().unwrap(), body.to_string())
}

const WAITING: &str = r#"local fiber = require('fiber')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for i = 1, 3 do fiber.create(function() wait_here() end):name('worker') end
io.stdout:write('ready\n') io.stdout:flush()
fiber.sleep(60)
"#;

/// While the program waits, every fiber's Lua frames are in the views (the scheduler builds
/// its part at its next turn).
#[test]
fn the_views_of_a_waiting_program_have_its_lua_frames() {
    let (_dir, path) = script("waiting.lua", WAITING);
    let (mut child, addr, mut out) = start(&path);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let s = path.to_str().unwrap();
    let (status, folded) = get(addr, "/debug/fibers?format=folded");
    assert_eq!(status, 200);
    let workers = folded
        .lines()
        .find(|l| l.starts_with("lua;fiber:worker;"))
        .unwrap_or_else(|| panic!("{folded}"));
    assert!(workers.ends_with(" 3"), "{folded}");
    let lua: Vec<&str> = workers
        .trim_end_matches(" 3")
        .split(';')
        .filter(|f| f.ends_with(".lua)") || f.ends_with("([C])"))
        .collect();
    let chunk = format!("({s})");
    assert_eq!(
        lua,
        [
            format!("function <{s}:4> {chunk}").as_str(),
            &format!("wait_here {chunk}"),
            "get ([C])"
        ]
        .map(|x| x.to_string()),
        "{folded}"
    );
    // (The main fiber prints `ready` and then sleeps: a request answered at once may find
    // it running between the two, at line 6.)
    let t0 = std::time::Instant::now();
    let main = loop {
        let (status, text) = get(addr, "/debug/pprof/goroutine?debug=2");
        assert_eq!(status, 200);
        let main = text
            .split("\n\n")
            .find(|b| b.contains("\"main\" ["))
            .unwrap_or_else(|| panic!("{text}"))
            .to_string();
        if main.contains("\"main\" [sleep, ") || t0.elapsed() > Duration::from_secs(10) {
            break main;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(main.contains("\"main\" [sleep, "), "{main}");
    assert!(main.contains(&format!("main chunk in @{s}:6")), "{main}");
    child.kill().unwrap();
    child.wait().unwrap();
}

const SPINNING: &str = r#"local fiber = require('fiber')
local clock = require('clock')
local ch = fiber.channel()
for i = 1, 3 do fiber.create(function() ch:get() end):name('worker') end
local f = fiber.new(function()
  local said = false
  local t = clock.monotonic() + 60
  while clock.monotonic() < t do if not said then said = true io.stdout:write('spinning\n') io.stdout:flush() end end
end)
f:name('spinner')
f:set_joinable(true)
f:join()
"#;

/// The Lua frames of a view's group or fiber whose heading line contains `heading` (its
/// `#N  name in source:line` lines that are not native `0x...` frames), numbers left out.
fn lua_frames_of(text: &str, heading: &str) -> Vec<String> {
    let block = text
        .split("\n\n")
        .find(|b| b.lines().next().is_some_and(|l| l.contains(heading)))
        .unwrap_or_else(|| panic!("no {heading:?} in:\n{text}"));
    block
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| {
            l.trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start()
        })
        .filter(|body| !body.starts_with("0x"))
        .map(str::to_string)
        .collect()
}

/// While a Lua fiber spins without yielding, the views still answer, with every fiber's Lua
/// frames: the spinning one's read inside it at its next Lua line (LuaJIT's profiler hook,
/// which reaches its compiled loop), the others' read there too.
#[test]
fn the_views_answer_while_a_lua_fiber_spins() {
    let (_dir, path) = script("spinning.lua", SPINNING);
    let (mut child, addr, mut out) = start(&path);
    let p = path.display();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "spinning\n");
    for _ in 0..3 {
        let t0 = Instant::now();
        let (status, text) = get(addr, "/debug/fibers?format=grouped");
        assert_eq!(status, 200);
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert_eq!(
            lua_frames_of(&text, "1 fiber [running]: id 5, name \"spinner\":"),
            [format!("function <{p}:5> in @{p}:8")],
            "{text}"
        );
        assert_eq!(
            lua_frames_of(&text, "3 fibers [channel receive, "),
            [
                "get in =[C]:-1".to_string(),
                format!("function <{p}:4> in @{p}:4")
            ],
            "{text}"
        );
        assert_eq!(
            lua_frames_of(&text, "1 fiber [join, "),
            [
                "join in =[C]:-1".to_string(),
                format!("main chunk in @{p}:12")
            ],
            "{text}"
        );
        assert!(!text.contains("not shown"), "{text}");
    }
    assert_eq!(get(addr, "/debug/pprof/goroutine").0, 200);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A view asked as the script ends is answered in full: the program's exit waits for the
/// answers under way (at most 2 s). It closed the connection with no answer at all. (1,000
/// fibers: their JSON view takes ~0.5 s in a debug build, well inside the wait on a loaded
/// machine; 3,000 took 1.4 s, and past the wait under load.)
#[test]
fn a_view_asked_as_the_script_ends_is_answered_in_full() {
    let (_d, path) = script(
        "ends.lua",
        "local fiber = require('fiber')\n\
         for i = 1, 1000 do fiber.create(function() fiber.sleep(60) end) end\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         io.stdin:read('*l')\n\
         os.exit(0)\n",
    );
    let (mut child, addr, mut out) = start(&path);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    // The request, then at once the line that ends the script.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /debug/fibers?format=json HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    child.stdin.take().unwrap().write_all(b"end\n").unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let text = String::from_utf8_lossy(&all);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    let fibers: usize = json["schedulers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["fibers"].as_array().unwrap().len())
        .sum();
    assert_eq!(fibers, 1001);
}

#[test]
fn a_bad_or_taken_address_is_refused_before_the_script_runs() {
    let (_dir, path) = script("never.lua", "print('ran')\n");
    let run = |addr: &str| {
        Command::new(env!("CARGO_BIN_EXE_fibertrace"))
            .args(["run", "--http", addr])
            .arg(&path)
            .output()
            .unwrap()
    };
    let out = run("nohost");
    assert_eq!(
        (out.status.code(), out.stdout.as_slice()),
        (Some(2), &b""[..])
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "invalid value 'nohost' for '--http <ADDR>': bad address \"nohost\": no port \
             (expected PORT, :PORT or HOST:PORT, e.g. 127.0.0.1:6060)"
        ),
        "{err}"
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = taken.local_addr().unwrap().to_string();
    let out = run(&a);
    assert_eq!(
        (out.status.code(), out.stdout.as_slice()),
        (Some(1), &b""[..])
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("fibertrace: --http: cannot listen on {a}: Address already in use (os error 98)\n")
    );
}

/// With `--heap`, `/debug/pprof/heap` (where Go serves it) answers the heap profile; without,
/// a 404 that says how to turn it on (checked in the fiber crate's tests).
#[test]
fn the_heap_profile_is_served_where_go_serves_it_when_the_heap_is_tracked() {
    let (_dir, path) = script("heap.lua", WAITING);
    let (mut child, addr, mut out) = start_with(&path, &["--heap=every"]);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    for target in ["/debug/pprof/heap", "/debug/pprof/allocs"] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        let at = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&all[..at]);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("heap.pb.gz"), "{head}");
        // A gzip stream.
        assert_eq!(&all[at + 4..at + 6], &[0x1f, 0x8b]);
    }
    child.kill().unwrap();
    let _ = child.wait();
}

const MANY: &str = r#"local fiber = require('fiber')
local function leaf() fiber.sleep(60) end
local function mid(n) if n == 0 then leaf() else mid(n - 1) end end
for i = 1, 4000 do fiber.create(mid, 30) end
io.stdout:write('ready\n') io.stdout:flush()
fiber.sleep(60)
"#;

/// Requests made at once are answered one after the other by the scheduler's thread, each
/// with its Lua frames: a second one waited while that thread built the first (20,000
/// fibers), ran out of its wait and said the thread "did not come back to its run loop".
#[test]
fn views_asked_at_once_each_have_their_lua_frames() {
    let (_dir, path) = script("many.lua", MANY);
    let (mut child, addr, mut out) = start(&path);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let answers: Vec<(u16, String)> = (0..3)
        .map(|_| std::thread::spawn(move || get(addr, "/debug/fibers?format=json")))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    for (status, body) in &answers {
        assert_eq!(*status, 200);
        assert!(
            !body.contains("not shown"),
            "{}",
            &body[..body.len().min(2000)]
        );
        // The fibers' Lua frames: their `leaf` level.
        assert!(
            body.contains("leaf in @"),
            "{}",
            &body[..body.len().min(2000)]
        );
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// At the memory limit (`ulimit -v`, the Lua heap filled down to allocations of 200 bytes),
/// the views are still served: the answering threads were started with the server (a thread
/// started per connection could not get its stack there, and every request was dropped
/// unanswered: a reset connection, no status), and the server keeps room for its views (what
/// the heap's last allocation left, often nothing, was all a view had: half of such runs
/// answered every view 503).
#[test]
fn at_the_memory_limit_the_views_are_still_served() {
    let (_dir, path) = script(
        "full.lua",
        "local fiber = require('fiber')\n\
         local hold = {}\n\
         local ok = false\n\
         for _, size in ipairs({1048000, 65000, 4000, 200}) do\n\
             ok = ok or pcall(function() while true do hold[#hold + 1] = string.rep('x', size) .. #hold end end)\n\
         end\n\
         io.stdout:write('filled ', tostring(ok), '\\n') io.stdout:flush()\n\
         fiber.sleep(60)\n",
    );
    let (mut child, addr, mut out) = start_under("ulimit -v 1500000", &path, &[]);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "filled false\n");
    let s = path.to_str().unwrap();
    for _ in 0..5 {
        let (status, text) = get(addr, "/debug/fibers?format=text");
        assert_eq!(status, 200, "{text}");
        assert!(text.contains(&format!("main chunk in @{s}:8")), "{text}");
        let (status, _) = get(addr, "/debug/fibers?format=json");
        assert_eq!(status, 200);
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Under `ulimit -v` the server's threads take little of what the script may use: its Lua
/// heap fills to within 32 MB of what it fills to without `--http` (each helper thread's own
/// malloc arena reserved 64 MiB, and eight answering threads started at once left it a few
/// MB, or kept the program from starting).
#[test]
fn under_a_memory_limit_the_server_leaves_the_script_its_room() {
    let (_dir, path) = script(
        "fill.lua",
        "local hold = {}\n\
         pcall(function() while true do hold[#hold + 1] = string.rep('x', 1048000) .. #hold end end)\n\
         print(#hold)\n",
    );
    let filled = |http: bool| -> u64 {
        let o = Command::new("bash")
            .arg("-c")
            .arg(if http {
                "ulimit -v 700000; exec \"$0\" run --http 127.0.0.1:0 \"$1\""
            } else {
                "ulimit -v 700000; exec \"$0\" run \"$1\""
            })
            .arg(env!("CARGO_BIN_EXE_fibertrace"))
            .arg(&path)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out.trim().parse().unwrap_or_else(|_| panic!("{out}"))
    };
    let (alone, served) = (filled(false), filled(true));
    assert!(alone > 300, "{alone} MB");
    assert!(
        served + 32 >= alone,
        "{served} MB with --http, {alone} MB without"
    );
}

/// Out of file descriptors (the script holds every one `ulimit -n` allows), a request is
/// told so at once (503); it waited unanswered in the listen queue. With one descriptor
/// free, a view is served with its native frames named: the program's file is opened with
/// the descriptors set aside for it (every frame of the program was `?? (fibertrace+0x…)`).
#[test]
fn out_of_file_descriptors_a_request_is_told_so() {
    let (_dir, path) = script(
        "fds.lua",
        "local fiber = require('fiber')\n\
         local files = {}\n\
         while true do\n\
           local f = io.open('/dev/null') if not f then break end\n\
           files[#files + 1] = f\n\
         end\n\
         io.stdout:write('full\\n') io.stdout:flush()\n\
         io.stdin:read('*l')\n\
         table.remove(files):close()\n\
         io.stdout:write('one free\\n') io.stdout:flush()\n\
         fiber.sleep(60)\n",
    );
    let (mut child, addr, mut out) = start_under("ulimit -n 64", &path, &[]);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "full\n");
    for _ in 0..3 {
        let t0 = Instant::now();
        assert_eq!(
            get(addr, "/debug/fibers?format=text"),
            (
                503,
                "the process is out of file descriptors; try again\n".into()
            )
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "one free\n");
    let (status, text) = get(addr, "/debug/fibers?format=text");
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains(&format!("main chunk in @{}:11", path.display())),
        "{text}"
    );
    assert!(
        text.contains(" in fibertrace_fiber::sched::sleep"),
        "{text}"
    );
    assert!(!text.contains("?? (fibertrace+"), "{text}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Near the address-space limit (`ulimit -v`, the Lua heap filled), a view too big to build
/// there is told 503, and the program goes on (building it, an answering thread's failed
/// allocation aborted the process: `memory allocation of 67108864 bytes failed`); the index
/// is still served.
#[test]
fn a_view_too_big_for_the_memory_left_is_refused_and_the_program_goes_on() {
    let (_dir, path) = script(
        "big.lua",
        "local fiber = require('fiber')\n\
         local function rec(d) if d == 0 then fiber.sleep(60) else rec(d - 1) end end\n\
         for i = 1, 400 do fiber.create(rec, 30) end\n\
         local hold = {}\n\
         local ok = pcall(function() while true do hold[#hold + 1] = string.rep('x', 1048000) .. #hold end end)\n\
         io.stdout:write('filled ', tostring(ok), '\\n') io.stdout:flush()\n\
         fiber.sleep(60)\n",
    );
    let (mut child, addr, mut out) = start_under("ulimit -v 3000000", &path, &[]);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "filled false\n");
    for _ in 0..3 {
        let (status, body) = get(addr, "/debug/fibers?format=json");
        assert_eq!(status, 503, "{}", &body[..body.len().min(300)]);
        assert!(
            body.starts_with("not enough memory to build this view now (about ")
                && body.ends_with(
                    " MiB; the process is near its address-space limit, ulimit -v); try again\n"
                ),
            "{body}"
        );
    }
    assert_eq!(get(addr, "/").0, 200);
    assert!(child.try_wait().unwrap().is_none(), "the program ended");
    child.kill().unwrap();
    child.wait().unwrap();
}
