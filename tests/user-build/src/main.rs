//! What a Rust user gets from fibertrace in their own build: this crate depends on
//! `fibertrace-core` and `fibertrace-fiber` like any user's crate, and is built by `run.sh`
//! from outside the repository (so without its `.cargo/config.toml`: no forced frame
//! pointers) with the profile settings of each cell of a matrix.
//!
//! It checks exact frames: the current stack, a fiber suspended three user calls deep under
//! each unwinder, a parent trace, and the text and JSON dumps (a running fiber's trace starts
//! at the user's call into the report). Names always; file:line where the build has line
//! tables (`FT_EXPECT_LINES=1`, set by `run.sh`). Prints `ok NAME` / `not ok NAME: why` and a
//! closing `N passed, N failed`; exits 1 on any failure.

use std::cell::RefCell;

use fibertrace_core::symbolize;
use fibertrace_core::{collect, CaptureOptions, Frame, Unwinder};
use fibertrace_fiber::{channel, yield_now, Builder, Channel, Scheduler};

/// One function level of a frame (inlined levels are levels too), innermost first.
#[derive(Clone, Debug)]
struct Level {
    name: String,
    file: Option<String>,
    line: Option<u32>,
}

fn levels(frames: &[Frame]) -> Vec<Level> {
    let mut v = Vec::new();
    for f in frames {
        let Some(r) = symbolize::resolve(f) else {
            v.push(Level {
                name: format!("{f:?}"),
                file: None,
                line: None,
            });
            continue;
        };
        if r.symbols.is_empty() {
            v.push(Level {
                name: "??".into(),
                file: None,
                line: None,
            });
        }
        for s in &r.symbols {
            v.push(Level {
                name: s.name.clone().unwrap_or_else(|| "??".into()),
                file: s.file.clone(),
                line: s.line,
            });
        }
    }
    v
}

fn names(l: &[Level]) -> Vec<&str> {
    l.iter().map(|l| l.name.as_str()).collect()
}

struct Checks {
    passed: usize,
    failed: usize,
    lines: bool,
}

impl Checks {
    fn check(&mut self, name: &str, r: Result<(), String>) {
        match r {
            Ok(()) => {
                self.passed += 1;
                println!("ok {name}");
            }
            Err(why) => {
                self.failed += 1;
                println!("not ok {name}: {why}");
            }
        }
    }
}

/// `want` (names, with the line expected for each where `Some`) stands exactly at `at` in
/// `got`; lines are checked when the build has line tables.
fn expect_at(
    got: &[Level],
    at: usize,
    want: &[(&str, Option<u32>)],
    lines: bool,
) -> Result<(), String> {
    let all = || format!("{:?}", names(got));
    if got.len() < at + want.len() {
        return Err(format!("too few frames: {}", all()));
    }
    for (k, (name, line)) in want.iter().enumerate() {
        let g = &got[at + k];
        if g.name != *name {
            return Err(format!(
                "frame {} is {:?}, want {name:?}: {}",
                at + k,
                g.name,
                all()
            ));
        }
        if lines {
            if let Some(line) = line {
                let file_ok = g
                    .file
                    .as_deref()
                    .is_some_and(|f| f.ends_with("src/main.rs"));
                if !file_ok || g.line != Some(*line) {
                    return Err(format!(
                        "{name} at {:?}:{:?}, want src/main.rs:{line}",
                        g.file, g.line
                    ));
                }
            }
        }
    }
    Ok(())
}

thread_local! {
    static LINES: RefCell<Vec<(&'static str, u32)>> = const { RefCell::new(Vec::new()) };
}

/// Records the line of a call, by name, for the checks.
fn mark(what: &'static str, line: u32) {
    LINES.with(|l| l.borrow_mut().push((what, line)));
}

fn line_of(what: &str) -> Option<u32> {
    LINES.with(|l| l.borrow().iter().find(|(w, _)| *w == what).map(|(_, n)| *n))
}

// ---- the current stack ----

#[inline(never)]
fn capture_here() -> Vec<Frame> {
    mark("capture_here", line!() + 1);
    let bt = collect(&CaptureOptions::default());
    std::hint::black_box(bt.frames().to_vec())
}

#[inline(never)]
fn outer_current() -> Vec<Frame> {
    mark("outer_current", line!() + 1);
    let v = capture_here();
    std::hint::black_box(v)
}

// ---- a suspended fiber, three user calls deep ----

#[inline(never)]
fn level3(rx: &Channel<u32>) -> u32 {
    mark("level3", line!() + 1);
    let v = rx.recv().unwrap_or(0);
    std::hint::black_box(v)
}

#[inline(never)]
fn level2(rx: &Channel<u32>) -> u32 {
    mark("level2", line!() + 1);
    let v = level3(rx);
    std::hint::black_box(v)
}

#[inline(never)]
fn level1(rx: &Channel<u32>) -> u32 {
    mark("level1", line!() + 1);
    let v = level2(rx);
    std::hint::black_box(v)
}

// ---- a parent trace ----

#[inline(never)]
fn spawner_inner(rx: Channel<u32>) -> fibertrace_fiber::JoinHandle<u32> {
    mark("spawner_inner", line!() + 1);
    let h = Builder::new().name("consumer").spawn(move || level1(&rx));
    std::hint::black_box(h)
}

#[inline(never)]
fn spawner_outer(rx: Channel<u32>) -> fibertrace_fiber::JoinHandle<u32> {
    mark("spawner_outer", line!() + 1);
    let h = spawner_inner(rx);
    std::hint::black_box(h)
}

// ---- reports ----

#[inline(never)]
fn take_dump() -> String {
    mark("take_dump", line!() + 1);
    let s = fibertrace_fiber::dump::dump_text();
    std::hint::black_box(s)
}

#[inline(never)]
fn take_json() -> String {
    mark("take_json", line!() + 1);
    let s = fibertrace_fiber::dump::dump_json();
    std::hint::black_box(s)
}

/// The user levels of the suspended consumer, outermost last.
fn consumer_levels() -> Vec<(&'static str, Option<u32>)> {
    vec![
        ("user_build::level3", line_of("level3")),
        ("user_build::level2", line_of("level2")),
        ("user_build::level1", line_of("level1")),
    ]
}

/// The consumer's trace: runtime frames (`fibertrace_fiber::`, and what they inlined from
/// `core`/`std`), then exactly level3, level2, level1, then at most the spawn closure and the
/// runtime's trampoline.
fn check_consumer(got: &[Level], lines: bool) -> Result<(), String> {
    let all = || format!("{:?}", names(got));
    let at = got
        .iter()
        .position(|l| l.name == "user_build::level3")
        .ok_or_else(|| format!("no level3 in {}", all()))?;
    if at == 0 || !got[0].name.starts_with("fibertrace_fiber::") {
        return Err(format!(
            "the trace does not start in the runtime: {}",
            all()
        ));
    }
    // Inlined levels carry no path in a build with line tables only (`recv_until<u32>`).
    if let Some(l) = got[..at]
        .iter()
        .find(|l| l.name.starts_with("user_build::"))
    {
        return Err(format!("{:?} above the user's frames: {}", l.name, all()));
    }
    expect_at(got, at, &consumer_levels(), lines)?;
    for l in &got[at + 3..] {
        // (An inlined closure has no path with line tables only.)
        let closure = l.name.starts_with("user_build::spawner_inner::{{closure}}")
            || l.name.starts_with("{closure");
        let trampoline = l.name.starts_with("fibertrace_fiber::frames::call_user");
        if !(closure || trampoline) {
            return Err(format!("{:?} below level1: {}", l.name, all()));
        }
    }
    Ok(())
}

/// A parent trace: spawner_inner, then spawner_outer, where `spawn` was called.
fn check_parent(got: &[Level], lines: bool) -> Result<(), String> {
    expect_at(
        got,
        0,
        &[
            ("user_build::spawner_inner", line_of("spawner_inner")),
            ("user_build::spawner_outer", line_of("spawner_outer")),
        ],
        lines,
    )
}

/// Function names of the frame lines (`#N  0x... in NAME+0x.. at FILE:LINE`, and the
/// `inlined into NAME at FILE:LINE` lines under them) of one section of a text dump.
fn text_levels(section: &str) -> Vec<Level> {
    let mut v = Vec::new();
    for line in section.lines() {
        let t = line.trim_start();
        let rest = if t.starts_with('#') {
            match t.split_once(" in ") {
                Some((_, r)) => r,
                None => continue,
            }
        } else if let Some(r) = t.strip_prefix("inlined into ") {
            r
        } else {
            continue;
        };
        let (name, loc) = match rest.rsplit_once(" at ") {
            Some((n, l)) => (n, Some(l)),
            None => (rest, None),
        };
        let name = match name.rfind("+0x") {
            Some(i) => &name[..i],
            None => name,
        };
        let (file, line) = match loc.and_then(|l| l.rsplit_once(':')) {
            Some((f, n)) => (Some(f.to_string()), n.parse().ok()),
            None => (None, None),
        };
        v.push(Level {
            name: name.trim().to_string(),
            file,
            line,
        });
    }
    v
}

/// The section of fiber `id` in a text dump, split at its first "created by" line.
fn fiber_section(dump: &str, id: u64) -> Option<(&str, &str)> {
    let head = format!("fiber {id} ");
    let start = dump.find(&head)?;
    let rest = &dump[start..];
    let end = rest[1..].find("\nfiber ").map_or(rest.len(), |e| e + 1);
    let sec = &rest[..end];
    Some(match sec.find("created by") {
        Some(c) => (&sec[..c], &sec[c..]),
        None => (sec, ""),
    })
}

/// Levels of a JSON frame list (`[{frame, resolved: {symbols: [{name, file, line}]}}]`).
fn json_levels(frames: &serde_json::Value) -> Vec<Level> {
    let mut v = Vec::new();
    for f in frames.as_array().into_iter().flatten() {
        for s in f["resolved"]["symbols"].as_array().into_iter().flatten() {
            v.push(Level {
                name: s["name"].as_str().unwrap_or("??").to_string(),
                file: s["file"].as_str().map(str::to_string),
                line: s["line"].as_u64().map(|n| n as u32),
            });
        }
    }
    v
}

fn check_report_start(got: &[Level], entry: &str, lines: bool) -> Result<(), String> {
    if let Some(l) = got.iter().find(|l| {
        l.name.starts_with("fibertrace_fiber::inspect::")
    }) {
        return Err(format!(
            "the report's machinery shows: {:?} in {:?}",
            l.name,
            names(got)
        ));
    }
    expect_at(
        got,
        0,
        &[(&format!("user_build::{entry}") as &str, line_of(entry))],
        lines,
    )
}

fn main() {
    let lines = std::env::var("FT_EXPECT_LINES").is_ok_and(|v| v == "1");
    let mut c = Checks {
        passed: 0,
        failed: 0,
        lines,
    };
    // The build is what the cell says: the user's code keeps frame pointers only when forced.
    let want_fp = std::env::var("FT_FRAME_POINTERS").is_ok_and(|v| v == "1");
    let table = fibertrace_core::image::table();
    let keeps = table
        .code_range(level2 as *const () as usize as u64)
        .map(|r| r.2);
    c.check(
        "the user's code keeps frame pointers only when forced",
        if keeps == Some(want_fp) {
            Ok(())
        } else {
            Err(format!("keeps frame pointers: {keeps:?}, want {want_fp}"))
        },
    );
    mark("main", line!() + 1);
    let cur = outer_current();
    let cur = levels(&cur);
    c.check(
        "current stack",
        expect_at(
            &cur,
            0,
            &[
                ("user_build::capture_here", line_of("capture_here")),
                ("user_build::outer_current", line_of("outer_current")),
                ("user_build::main", line_of("main")),
            ],
            c.lines,
        ),
    );

    let c = Scheduler::new()
        .block_on(move || {
            let mut c = c;
            let ch = channel::<u32>(1);
            let h = spawner_outer(ch.clone());
            yield_now(); // the consumer runs and blocks in recv()
            let lines = c.lines;
            for u in [Unwinder::Fast, Unwinder::Auto, Unwinder::Precise] {
                let got = match h.fiber().backtrace(u) {
                    Some(bt) => levels(bt.frames()),
                    None => Vec::new(),
                };
                c.check(
                    &format!("suspended fiber, {u:?}"),
                    check_consumer(&got, lines),
                );
            }
            let parent = match h.fiber().parent_trace() {
                Some(p) => levels(p.frames()),
                None => Vec::new(),
            };
            c.check("parent trace", check_parent(&parent, lines));

            let dump = take_dump();
            let me = fibertrace_fiber::current_id();
            match (fiber_section(&dump, h.id()), fiber_section(&dump, me)) {
                (Some((frames, created)), Some((mine, _))) => {
                    c.check(
                        "text dump: suspended fiber",
                        check_consumer(&text_levels(frames), lines),
                    );
                    c.check(
                        "text dump: created by",
                        check_parent(&text_levels(created), lines),
                    );
                    c.check(
                        "text dump: running fiber starts at the user's call",
                        check_report_start(&text_levels(mine), "take_dump", lines),
                    );
                }
                _ => c.check("text dump", Err(format!("fibers missing in:\n{dump}"))),
            }

            let json = take_json();
            match serde_json::from_str::<serde_json::Value>(&json) {
                Ok(v) => {
                    let by_id = |id: u64| {
                        v["schedulers"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .flat_map(|s| s["fibers"].as_array().into_iter().flatten())
                            .find(|f| f["id"].as_u64() == Some(id))
                            .cloned()
                    };
                    match (by_id(h.id()), by_id(me)) {
                        (Some(cons), Some(mine)) => {
                            c.check(
                                "json dump: suspended fiber",
                                check_consumer(&json_levels(&cons["backtrace"]), lines),
                            );
                            c.check(
                                "json dump: created by",
                                check_parent(
                                    &json_levels(&cons["parent_backtrace"][0]["frames"]),
                                    lines,
                                ),
                            );
                            c.check(
                                "json dump: running fiber starts at the user's call",
                                check_report_start(
                                    &json_levels(&mine["backtrace"]),
                                    "take_json",
                                    lines,
                                ),
                            );
                        }
                        _ => c.check("json dump", Err(format!("fibers missing in {json}"))),
                    }
                }
                Err(e) => c.check("json dump", Err(format!("not JSON ({e}): {json}"))),
            }
            ch.send(7).unwrap();
            let _ = h.join();
            c
        })
        .unwrap();
    println!("{} passed, {} failed", c.passed, c.failed);
    if c.failed > 0 {
        std::process::exit(1);
    }
}
