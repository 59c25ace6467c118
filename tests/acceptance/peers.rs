//! The exports opened in the real tools: `go tool pprof` (Debian's `golang-go`) reads the
//! pprof profile, a headless Chromium (Debian's `chromium`) draws the flame graph SVG, and
//! speedscope (its release, from npm) loads the speedscope file in the same browser. The live
//! endpoint (`fibertrace run --http`) answers curl, `go tool pprof URL` and the browser.
//!
//! Built only with the `peers` feature (`cargo test -p fibertrace-acceptance --features
//! peers --test peers`), after the tools are installed: CI installs them (see `.ci/run`) and
//! points `FIBERTRACE_SPEEDSCOPE` at speedscope's `dist/release` directory. A tool that is
//! missing is a failure that says how to install it, never a pass.

use fibertrace_acceptance::Tied;

use std::path::Path;
use std::process::Command;

use fibertrace_acceptance::{binary, run_in, scratch};

/// Three workers wait in `wait_here` on a channel nobody writes; the script ends, and
/// `--dump-on-exit` writes every export.
const WORKERS: &str = r#"local fiber = require('fiber')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for i = 1, 3 do fiber.create(function() wait_here() end):name('worker') end
fiber.yield()
"#;

fn tool(cmd: &mut Command, what: &str, install: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} cannot run ({e}): {install}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs the script with every export asked for on exit, in a directory of its own (`name`);
/// returns the directory.
fn exports(name: &str) -> fibertrace_acceptance::Scratch {
    let d = scratch(name);
    std::fs::write(d.join("s.lua"), WORKERS).unwrap();
    let out = run_in(
        &d,
        &[
            "run",
            "--dump-on-exit",
            "pprof:p.pb.gz",
            "--dump-on-exit",
            "svg:f.svg",
            "--dump-on-exit",
            "speedscope:s.json",
            "--dump-on-exit",
            "folded:f.folded",
            "s.lua",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d
}

/// The frames of the workers' stack, root first, from the folded export.
fn workers_folded(d: &Path) -> Vec<String> {
    let folded = std::fs::read_to_string(d.join("f.folded")).unwrap();
    let line = folded
        .lines()
        .find(|l| l.starts_with("lua;fiber:worker;"))
        .unwrap_or_else(|| panic!("{folded}"));
    let (stack, n) = line.rsplit_once(' ').unwrap();
    assert_eq!(n, "3");
    stack.split(';').skip(2).map(str::to_string).collect()
}

#[test]
fn go_tool_pprof_reads_the_profile_with_every_fiber_its_labels_and_lua_frames() {
    let d = exports("peers-pprof");
    let go = |args: &[&str]| {
        tool(
            Command::new("go")
                .args(["tool", "pprof"])
                .args(args)
                .arg(d.join("p.pb.gz"))
                .env("HOME", &d)
                .env("PPROF_TMPDIR", &d),
            "go tool pprof",
            "apt-get install golang-go",
        )
    };
    let traces = go(&["-traces"]);
    let blocks: Vec<&str> = traces
        .split("-----------+-------------------------------------------------------\n")
        .skip(1)
        .collect();
    let workers: Vec<&str> = blocks
        .iter()
        .copied()
        .filter(|b| b.contains("      name:  worker\n"))
        .collect();
    assert_eq!(workers.len(), 3, "{traces}");
    let folded = workers_folded(&d);
    for w in &workers {
        assert!(w.contains("     state:  channel receive\n"), "{w}");
        assert!(w.contains(" scheduler:  lua\n"), "{w}");
        assert!(w.contains("    parent:  1\n"), "{w}");
        assert!(w.contains("  fiber_id:  "), "{w}");
        assert!(w.contains("waiting_ms:  "), "{w}");
        let frames: Vec<&str> = w
            .lines()
            .skip_while(|l| !l.starts_with("         1   "))
            .map(|l| l.trim_start_matches("         1   ").trim())
            .collect();
        assert_eq!(
            frames.first(),
            Some(&"fibertrace_fiber::sched::block"),
            "{w}"
        );
        assert_eq!(
            frames[frames.len() - 3..],
            ["get", "wait_here", "function@s.lua:4"],
            "{w}"
        );
        // Every frame of the folded export, one for one.
        assert_eq!(frames.len(), folded.len(), "{w}\n{folded:?}");
    }
    let main = blocks.iter().find(|b| b.contains("      name:  main\n"));
    assert!(main.is_none(), "the main fiber ended: {traces}");
    let top = go(&["-top"]);
    assert!(top.contains("Type: fibers\n"), "{top}");
    assert!(
        top.contains("Showing nodes accounting for 3, 100% of 3 total"),
        "{top}"
    );
    let row = top
        .lines()
        .find(|l| l.ends_with("  fibertrace_fiber::sched::block"))
        .unwrap_or_else(|| panic!("{top}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[..5], ["3", "100%", "100%", "3", "100%"], "{top}");
    let _ = std::fs::remove_dir_all(&d);
}

fn chromium(d: &Path, url: &str) -> String {
    tool(
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=5000",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", d.join("chromium").display()))
            .arg(url)
            .env("HOME", d),
        "chromium",
        "apt-get install chromium",
    )
}

#[test]
fn a_browser_draws_the_flame_graph_with_every_frame() {
    let d = exports("peers-svg");
    let dom = chromium(&d, &format!("file://{}", d.join("f.svg").display()));
    // Chromium parsed the SVG (a parse error is a page that says so) and the flame graph's
    // script ran (it sets the search box up).
    assert!(!dom.contains("error on line"), "{dom}");
    assert!(dom.contains("fibertrace: 3 fibers"), "{dom}");
    for f in workers_folded(&d) {
        let title = format!(
            "<title>{} (3 fibers, 100.00%)</title>",
            f.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
        );
        assert!(dom.contains(&title), "{title} not in {dom}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn speedscope_loads_the_file_and_lists_every_frame() {
    let d = exports("peers-speedscope");
    let release = std::env::var_os("FIBERTRACE_SPEEDSCOPE").unwrap_or_else(|| {
        panic!(
            "FIBERTRACE_SPEEDSCOPE is not set: `npm pack speedscope@1.25.0`, unpack it, and \
             set it to the package's dist/release directory"
        )
    });
    let index = Path::new(&release).join("index.html");
    assert!(
        index.exists(),
        "{} is not speedscope's release",
        index.display()
    );
    // As speedscope's own command line tool opens a file: a script that hands the file over.
    let bytes = std::fs::read(d.join("s.json")).unwrap();
    let b64 = base64(&bytes);
    let js = d.join("load.js");
    std::fs::write(
        &js,
        format!("speedscope.loadFileFromBase64(\"s.json\", \"{b64}\")"),
    )
    .unwrap();
    let url = format!(
        "file://{}#localProfilePath={}&view=sandwich",
        index.display(),
        js.display()
    );
    // speedscope draws the sandwich table's rows after it has measured the page: a dump
    // taken before that has the header and no row (seen once in CI, under load). Such a
    // dump is taken again, up to three times; every check below reads the last one.
    let mut text = String::new();
    for _ in 0..3 {
        text = strip_tags(&chromium(&d, &url));
        if text.contains("|3 (100%)|3 (100%)|") {
            break;
        }
    }
    assert!(text.contains("fibertrace: 3 fibers - speedscope"), "{text}");
    assert!(text.contains("|scheduler 1 \"lua\"|"), "{text}");
    // The sandwich view's table: total, self, name; the leaf has all three fibers as self.
    let frames = workers_folded(&d);
    let leaf = frames.last().unwrap();
    assert!(
        text.contains(&format!("|3 (100%)|3 (100%)|{}|", escape(leaf))),
        "{leaf}: {text}"
    );
    for f in &frames[..frames.len() - 1] {
        // speedscope names Lua frames without the folded export's `(chunk)`.
        let name = f.rsplit_once(" (").map_or(f.as_str(), |x| x.0);
        assert!(
            text.contains(&format!("|3 (100%)|0 (&lt;0.01%)|{}|", escape(name))),
            "{name}: {text}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The text of a page, every run of tags made one `|`.
fn strip_tags(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => {
                if !in_tag && !out.ends_with('|') {
                    out.push('|');
                }
                in_tag = true;
            }
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out
}

fn base64(b: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Three workers wait in `wait_here`; the main fiber sleeps (the program serves meanwhile).
const SERVING: &str = r#"local fiber = require('fiber')
local ch = fiber.channel()
local function wait_here() local v = ch:get() return v end
for i = 1, 3 do fiber.create(function() wait_here() end):name('worker') end
io.stdout:write('ready\n') io.stdout:flush()
fiber.sleep(120)
"#;

#[test]
fn the_live_endpoint_answers_curl_go_tool_pprof_and_a_browser() {
    use std::io::{BufRead, BufReader};
    let d = scratch("peers-http");
    std::fs::write(d.join("s.lua"), SERVING).unwrap();
    let mut child = Command::new(binary())
        .args(["run", "--http", ":0", "s.lua"])
        .current_dir(&d)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .strip_prefix("fibertrace: serving ")
        .and_then(|r| r.strip_suffix("/debug/fibers\n"))
        .unwrap_or_else(|| panic!("{line:?}"))
        .to_string();
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready, "ready\n");

    // curl: every view, with its status and type; the index links each.
    let curl = |path: &str, out: &Path| {
        tool(
            Command::new("curl")
                .args(["-sS", "--max-time", "30", "-o"])
                .arg(out)
                .args(["-w", "%{http_code} %{content_type}"])
                .arg(format!("{base}{path}")),
            "curl",
            "apt-get install curl",
        )
    };
    let index = d.join("index.html");
    assert_eq!(curl("/", &index), "200 text/html; charset=utf-8");
    let page = std::fs::read_to_string(&index).unwrap();
    for (name, ty) in [
        ("text", "text/plain; charset=utf-8"),
        ("grouped", "text/plain; charset=utf-8"),
        ("json", "application/json"),
        ("pprof", "application/octet-stream"),
        ("folded", "text/plain; charset=utf-8"),
        ("svg", "image/svg+xml"),
        ("speedscope", "application/json"),
    ] {
        let path = format!("/debug/fibers?format={name}");
        assert!(page.contains(&format!("<a href=\"{path}\">")), "{page}");
        let file = d.join(format!("view.{name}"));
        assert_eq!(curl(&path, &file), format!("200 {ty}"), "{name}");
        assert!(std::fs::metadata(&file).unwrap().len() > 0, "{name}");
    }
    let grouped = std::fs::read_to_string(d.join("view.grouped")).unwrap();
    assert!(grouped.contains("3 fibers [channel receive, "), "{grouped}");
    assert!(grouped.contains(" wait_here in @s.lua:3\n"), "{grouped}");

    // go tool pprof fetches the profile where it fetches a Go program's goroutines.
    let top = tool(
        Command::new("go")
            .args(["tool", "pprof", "-top"])
            .arg(format!("{base}/debug/pprof/goroutine"))
            .env("HOME", &d)
            .env("PPROF_TMPDIR", &d),
        "go tool pprof",
        "apt-get install golang-go",
    );
    assert!(top.contains("Type: fibers\n"), "{top}");
    assert!(
        top.contains("Showing nodes accounting for 4, 100% of 4 total"),
        "{top}"
    );

    // The browser draws the flame graph from the endpoint.
    let dom = chromium(&d, &format!("{base}/debug/fibers?format=svg"));
    assert!(!dom.contains("error on line"), "{dom}");
    assert!(dom.contains("fibertrace: 4 fibers"), "{dom}");
    assert!(
        dom.contains("<title>wait_here (s.lua) (3 fibers, 75.00%)</title>"),
        "{dom}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// The frames of each thread as `(tid, [address...])`, from a dump's text: eu-stack's
/// (`TID n:` then `#k  0xADDR name`) or ours (`thread n "name":` then `#k  0xADDR in ...`).
fn thread_addresses(text: &str, eu: bool) -> Vec<(i32, Vec<u64>)> {
    let mut out: Vec<(i32, Vec<u64>)> = Vec::new();
    // Whether the lines are still a thread's (ours go on with the fibers after the threads).
    let mut in_thread = false;
    for line in text.lines() {
        if !eu && (line.starts_with("scheduler ") || line.starts_with("fiber ")) {
            in_thread = false;
            continue;
        }
        let head = if eu {
            line.strip_prefix("TID ").and_then(|r| r.strip_suffix(':'))
        } else {
            line.strip_prefix("thread ")
                .and_then(|r| r.split(' ').next())
        };
        if let Some(tid) = head.and_then(|t| t.parse().ok()) {
            out.push((tid, Vec::new()));
            in_thread = true;
            continue;
        }
        if !in_thread {
            continue;
        }
        let Some(rest) = line.strip_prefix('#') else {
            continue;
        };
        let Some(addr) = rest
            .split_whitespace()
            .nth(1)
            .and_then(|a| a.strip_prefix("0x"))
            .and_then(|a| u64::from_str_radix(a, 16).ok())
        else {
            continue;
        };
        if let Some(t) = out.last_mut() {
            t.1.push(addr);
        }
    }
    out
}

/// `fibertrace dump PID` and `eu-stack -p PID` (Debian's `elfutils`) on the same stopped-in-
/// place process agree on every thread's frames: where eu-stack's walk goes, ours goes the
/// same way, address for address.
#[test]
fn dump_pid_agrees_with_eu_stack_on_every_thread() {
    let d = scratch("eu-stack");
    std::fs::write(
        d.join("s.lua"),
        "local fiber = require('fiber')\n\
         for i = 1, 3 do fiber.create(function() fiber.sleep(60) end) end\n\
         io.stdout:write('ready\\n') io.stdout:flush()\n\
         fiber.sleep(60)\n",
    )
    .unwrap();
    let mut child = fibertrace_acceptance::start_until(&d, &["run", "s.lua"], "ready\n");
    let pid = child.id().to_string();
    // Every thread waits in the kernel: both readers see the same stacks.
    let eu = tool(
        Command::new("eu-stack").args(["-p", &pid]),
        "eu-stack",
        "apt-get install elfutils",
    );
    let ours = run_in(&d, &["dump", &pid, "--native-detail"]);
    // The dump as a pprof profile, read by go tool pprof: threads and fibers, Lua frames in.
    let p = run_in(&d, &["dump", &pid, "--format", "pprof"]);
    assert!(p.status.success());
    std::fs::write(d.join("dump.pb.gz"), &p.stdout).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let traces = tool(
        Command::new("go")
            .args(["tool", "pprof", "-traces"])
            .arg(d.join("dump.pb.gz"))
            .env("HOME", &d)
            .env("PPROF_TMPDIR", &d),
        "go tool pprof",
        "apt-get install golang-go",
    );
    let blocks: Vec<&str> = traces
        .split("-----------+-------------------------------------------------------\n")
        .skip(1)
        .collect();
    let sleepers: Vec<Vec<&str>> = blocks
        .iter()
        .filter(|b| b.contains(" scheduler:  lua\n") && b.contains("     state:  sleep\n"))
        .map(|b| {
            b.lines()
                .skip_while(|l| !l.starts_with("         1   "))
                .map(|l| l.trim_start_matches("         1   ").trim())
                .collect()
        })
        .collect();
    // The three fibers and the main one.
    assert_eq!(sleepers.len(), 4, "{traces}");
    let fibers = sleepers
        .iter()
        .filter(|f| f[f.len() - 2..] == ["sleep", "function@s.lua:2"])
        .count();
    assert_eq!(fibers, 3, "{traces}");
    let threads = blocks
        .iter()
        .filter(|b| b.contains(" scheduler:  threads\n"))
        .count();
    assert_eq!(threads, thread_addresses(&eu, true).len(), "{traces}");
    assert!(ours.status.success());
    let ours = String::from_utf8_lossy(&ours.stdout).into_owned();
    let theirs = thread_addresses(&eu, true);
    let mine = thread_addresses(&ours, false);
    assert!(!theirs.is_empty(), "{eu}");
    let tids = |v: &[(i32, Vec<u64>)]| {
        let mut t: Vec<i32> = v.iter().map(|x| x.0).collect();
        t.sort_unstable();
        t
    };
    assert_eq!(tids(&theirs), tids(&mine), "eu-stack:\n{eu}\nours:\n{ours}");
    for (tid, want) in &theirs {
        let got = &mine.iter().find(|m| m.0 == *tid).unwrap().1;
        assert!(want.len() >= 3, "thread {tid}: eu-stack:\n{eu}");
        assert_eq!(got, want, "thread {tid}: eu-stack:\n{eu}\nours:\n{ours}");
    }
}

/// The heap profile (`require('fibertrace').heap{format = 'pprof'}` under `--heap=every`):
/// `go tool pprof` reads Go's four sample types, and the builder fiber's strings are the
/// biggest in-use entry, labelled with its fiber id.
#[test]
fn go_tool_pprof_reads_the_heap_profile_with_its_four_sample_types_and_fiber_labels() {
    let d = scratch("peers-heap");
    std::fs::write(
        d.join("h.lua"),
        "local fiber = require('fiber')\n\
         keep = {}\n\
         local function build(n) local t = {} for i = 1, n do t[i] = string.rep('h', 300) .. i end return t end\n\
         fiber.create(function() fiber.self():name('builder') keep[1] = build(4000) fiber.sleep(100) end)\n\
         fiber.sleep(0)\n\
         print(require('fibertrace').heap{format = 'pprof', file = 'heap.pb.gz'})\n\
         os.exit(0)\n",
    )
    .unwrap();
    let out = run_in(&d, &["run", "--heap=every", "h.lua"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let go = |args: &[&str]| {
        tool(
            Command::new("go")
                .args(["tool", "pprof"])
                .args(args)
                .arg(d.join("heap.pb.gz"))
                .env("HOME", &d)
                .env("PPROF_TMPDIR", &d),
            "go tool pprof",
            "apt-get install golang-go",
        )
    };
    let raw = go(&["-raw"]);
    assert!(
        raw.contains("alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes"),
        "{raw}"
    );
    let top = go(&["-sample_index=inuse_space", "-top", "-nodecount=3"]);
    assert!(top.contains("Type: inuse_space"), "{top}");
    // The biggest in-use stack (traces come biggest first): the builder's strings, with the
    // Lua frames that made them.
    let traces = go(&["-sample_index=inuse_space", "-traces"]);
    let biggest = traces
        .split("-----------+-------------------------------------------------------\n")
        .nth(1)
        .unwrap_or_else(|| panic!("{traces}"));
    assert!(biggest.contains("      name:  builder\n"), "{biggest}");
    assert!(biggest.contains("  fiber_id:  2\n"), "{biggest}");
    let frames: Vec<&str> = biggest
        .lines()
        .skip_while(|l| !l.contains("fibertrace_lua::host::global_alloc"))
        .map(|l| l.split_whitespace().last().unwrap_or(""))
        .collect();
    assert_eq!(
        frames[..3],
        [
            "fibertrace_lua::host::global_alloc",
            "build",
            "function@h.lua:4"
        ],
        "{biggest}"
    );
}
