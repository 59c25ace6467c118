//! Dumps: the text reads like Go's goroutine dump, JSON parses, and the dump signal works
//! while a fiber spins (checked on a real process: the `fiber_dump` example).

#[path = "common/tied.rs"]
mod tied;
use tied::Tied;

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fibertrace_fiber::{channel, dump, spawn, yield_now, Builder, Scheduler};

#[inline(never)]
fn wait_three(ch: &fibertrace_fiber::Channel<u8>) -> u8 {
    let v = wait_two(ch);
    // Not a tail call: this frame stays on the stack in release builds too.
    std::hint::black_box(v)
}

#[inline(never)]
fn wait_two(ch: &fibertrace_fiber::Channel<u8>) -> u8 {
    let v = ch.recv().unwrap();
    std::hint::black_box(v)
}

#[test]
fn text_dump_reads_like_a_goroutine_dump_and_json_parses() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u8>(1);
            let rx = ch.clone();
            let h = Builder::new()
                .name("consumer")
                .spawn(move || wait_three(&rx));
            let idle = spawn(|| fibertrace_fiber::sleep(Duration::from_secs(60)));
            yield_now();
            let text = dump::dump_text();
            let block = text
                .split("\n\n")
                .find(|b| b.contains("\"consumer\""))
                .unwrap_or_else(|| panic!("{text}"));
            let lines: Vec<&str> = block.lines().collect();
            let head = format!("fiber {} \"consumer\" [channel receive, ", h.id());
            assert!(lines[0].starts_with(&head), "{block}");
            assert!(lines[0].ends_with("]:"), "{block}");
            // Frames: the runtime's receive path, our two functions, the closure.
            let frames: Vec<&&str> = lines.iter().filter(|l| l.starts_with('#')).collect();
            assert!(
                frames[0].contains("fibertrace_fiber::sched::block"),
                "{block}"
            );
            assert!(frames[3].contains(" in dump::wait_two+0x"), "{block}");
            assert!(frames[3].contains("tests/dump.rs:"), "{block}");
            assert!(frames[4].contains(" in dump::wait_three+0x"), "{block}");
            let created = lines
                .iter()
                .position(|l| l.starts_with("created by fiber "))
                .expect("creator section");
            assert!(lines[created].ends_with("\"main\" at:"), "{block}");
            assert!(lines[created + 1].contains("text_dump_reads_like_a_goroutine_dump"));
            let sleeper = text
                .split("\n\n")
                .find(|b| b.contains(&format!("fiber {} ", idle.id())))
                .unwrap();
            assert!(
                sleeper.lines().next().unwrap().contains("[sleep, "),
                "{sleeper}"
            );

            let json: serde_json::Value = serde_json::from_str(&dump::dump_json()).unwrap();
            assert_eq!(json["version"], fibertrace_fiber::inspect::SNAPSHOT_VERSION);
            let scheds = json["schedulers"].as_array().unwrap();
            let mine = scheds
                .iter()
                .find(|s| {
                    s["fibers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|f| f["name"] == "consumer")
                })
                .expect("the scheduler of the consumer");
            assert!(mine["thread"].as_i64().unwrap() > 0, "{mine}");
            assert_eq!(
                mine["running"].as_u64(),
                Some(fibertrace_fiber::current_id())
            );
            let me = mine["fibers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["name"] == "consumer")
                .unwrap();
            assert_eq!(me["status"], "waiting");
            assert_eq!(me["waiting"]["what"], "channel receive");
            assert!(me["backtrace"].as_array().unwrap().len() >= 5);
            assert_eq!(me["parent_backtrace"][0]["name"], "main");
            ch.send(1).unwrap();
            h.join().unwrap();
            idle.fiber().cancel();
        })
        .unwrap();
}

fn example(name: &str) -> std::path::PathBuf {
    // cargo builds examples before running integration tests: target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().join("examples");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is not built (cargo test builds examples)",
        p.display()
    );
    p
}

#[test]
fn dump_signal_works_while_a_fiber_spins_and_the_process_goes_on() {
    let mut child = Command::new(example("fiber_dump"))
        .arg("30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .tied()
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("ready pid="), "{line}");
    std::thread::sleep(Duration::from_millis(100));
    let pid = child.id() as i32;
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGQUIT) }, 0);
    // Read stderr until the dump is complete (the spinner's block and the workers').
    let mut err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match err.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut text = String::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(100)) {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        if text.contains("\"spinner\"") && text.matches("worker_loop").count() >= 2 {
            // Give the rest of the dump a moment to arrive.
            std::thread::sleep(Duration::from_millis(200));
            while let Ok(chunk) = rx.try_recv() {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            break;
        }
    }
    // The process is still running after the dump.
    assert!(child.try_wait().unwrap().is_none(), "the process died");
    child.kill().unwrap();
    child.wait().unwrap();
    let spinner = text
        .split("\n\n")
        .find(|b| b.contains("\"spinner\""))
        .unwrap_or_else(|| panic!("no spinner in the dump:\n{text}"));
    let lines: Vec<&str> = spinner.lines().collect();
    assert!(lines[0].ends_with("[running]:"), "{spinner}");
    assert!(
        spinner.contains(" in fiber_dump::spin_forever"),
        "{spinner}"
    );
    let worker = text
        .split("\n\n")
        .find(|b| b.contains("\"worker-0\""))
        .unwrap();
    assert!(
        worker
            .lines()
            .next()
            .unwrap()
            .contains("[channel receive, "),
        "{worker}"
    );
    assert!(worker.contains(" in fiber_dump::wait_for_job"), "{worker}");
    assert!(worker.contains(" in fiber_dump::worker_loop"), "{worker}");
}

#[test]
fn names_in_text_reports_are_quoted_so_their_bytes_read_back() {
    Scheduler::new()
        .block_on(|| {
            let h = spawn(|| fibertrace_fiber::sleep(Duration::from_secs(60)));
            yield_now();
            let f = h.fiber().clone();
            f.set_name_bytes(b"a\xff\"b\\c\nd\x01");
            assert_eq!(f.name_bytes(), b"a\xff\"b\\c\nd\x01");
            let text = dump::dump_text();
            let head = format!("fiber {} \"a\\xff\\\"b\\\\c\\nd\\x01\" [sleep, ", h.id());
            assert!(text.lines().any(|l| l.starts_with(&head)), "{head}\n{text}");
            // The line end in the name did not break the report's line.
            assert!(!text.lines().any(|l| l.starts_with("d\u{1}")), "{text}");
            f.cancel();
        })
        .unwrap();
    assert_eq!(
        fibertrace_fiber::embed::quoted_name("plain name").to_string(),
        "\"plain name\""
    );
}

/// The tests with a marked scheduler take turns: a dump covers every scheduler of the
/// process, and one test's spinning scheduler would add its note to the other's dump.
static MARKED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A frame source as a layer above the runtime (a Lua host) registers one: it adds a frame
/// of its own above each fiber's native frames, named only by itself.
struct Marker;

impl fibertrace_fiber::FrameSource for Marker {
    fn frames(
        &self,
        fiber: fibertrace_fiber::FiberId,
        native: &[fibertrace_core::Frame],
    ) -> Option<Vec<fibertrace_core::Frame>> {
        let mut v = vec![fibertrace_core::Frame::Lua(fibertrace_core::LuaFrameId(
            fiber as u32,
        ))];
        v.extend_from_slice(native);
        Some(v)
    }

    fn name(&self, id: fibertrace_core::LuaFrameId) -> Option<String> {
        Some(format!("marker of fiber {} in @marker.lua:1", id.0))
    }
}

/// Runs a scheduler with the marker source on its own thread: a fiber named `parked` waits
/// on a channel, and the main fiber runs `main` until `stop` is set. Returns the thread and
/// the parked fiber's id once both are in place.
fn marked_scheduler(
    main: fn(&std::sync::atomic::AtomicBool),
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (std::thread::JoinHandle<()>, u64) {
    marked_scheduler_with_arm(main, stop, None)
}

/// [`marked_scheduler`] whose layer says how its running fiber is brought to a safe point.
fn marked_scheduler_with_arm(
    main: fn(&std::sync::atomic::AtomicBool),
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    arm: Option<fibertrace_fiber::inspect::SafePointArm>,
) -> (std::thread::JoinHandle<()>, u64) {
    layered_scheduler(main, stop, arm, None)
}

/// [`marked_scheduler_with_arm`], with `held` as the layer's held source when given (then the
/// parked fiber's layer word is 7, the main fiber's 5).
fn layered_scheduler(
    main: fn(&std::sync::atomic::AtomicBool),
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    arm: Option<fibertrace_fiber::inspect::SafePointArm>,
    held: Option<std::sync::Arc<HeldMarker>>,
) -> (std::thread::JoinHandle<()>, u64) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let s = Scheduler::new();
        s.set_frame_source(Some(std::rc::Rc::new(Marker)));
        s.set_safe_point_arm(arm);
        let words = held.is_some();
        if let Some(held) = held {
            s.set_held_source(Some(held));
        }
        s.block_on(move || {
            let ch = channel::<u8>(1);
            let rx = ch.clone();
            let parked = Builder::new().name("parked").spawn(move || wait_three(&rx));
            if words {
                parked.fiber().set_layer_word(7);
                fibertrace_fiber::current().unwrap().set_layer_word(5);
            }
            yield_now();
            tx.send(parked.id()).unwrap();
            main(&stop);
            ch.send(1).unwrap();
            parked.join().unwrap();
        })
        .unwrap();
    });
    (t, rx.recv().unwrap())
}

#[test]
fn a_dump_from_another_thread_has_the_frame_source_frames_built_on_the_scheduler_thread() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The main fiber sleeps in long naps: the scheduler waits idle (parked) in between, and
    // the dump's request wakes it.
    let (t, parked) = marked_scheduler(
        |stop| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                fibertrace_fiber::sleep(Duration::from_secs(5));
            }
        },
        stop.clone(),
    );
    let t0 = Instant::now();
    let text = dump::dump_text();
    let took = t0.elapsed();
    let block = text
        .split("\n\n")
        .find(|b| b.contains(&format!("fiber {parked} \"parked\"")))
        .unwrap_or_else(|| panic!("{text}"));
    let frames: Vec<&str> = block.lines().filter(|l| l.starts_with('#')).collect();
    assert_eq!(
        frames[0],
        format!("#0  marker of fiber {parked} in @marker.lua:1"),
        "{block}"
    );
    assert!(
        frames[1].contains("fibertrace_fiber::sched::block"),
        "{block}"
    );
    assert!(frames[4].contains("dump::wait_two"), "{block}");
    assert!(!text.contains("not shown"), "{text}");
    assert!(took < Duration::from_secs(2), "the dump took {took:?}");
    // JSON too: the labelled frame is in the snapshot.
    let json: serde_json::Value = serde_json::from_str(&dump::dump_json()).unwrap();
    let f = json["schedulers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["fibers"].as_array().unwrap())
        .find(|f| f["id"] == parked)
        .unwrap();
    assert_eq!(
        f["backtrace"][0]["label"],
        format!("marker of fiber {parked} in @marker.lua:1")
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
}

#[test]
fn a_dump_from_another_thread_says_when_a_spinning_scheduler_cannot_build_its_part() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The main fiber spins without yielding until told to stop: the scheduler never comes
    // back to its loop.
    let (t, parked) = marked_scheduler(
        |stop| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        },
        stop.clone(),
    );
    let t0 = Instant::now();
    let text = dump::dump_text();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    assert!(
        text.contains(
            "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
             not come back to its run loop within 200 ms"
        ),
        "{text}"
    );
    // Its fibers are still there, with their native frames.
    let block = text
        .split("\n\n")
        .find(|b| b.contains(&format!("fiber {parked} \"parked\"")))
        .unwrap_or_else(|| panic!("{text}"));
    let frames: Vec<&str> = block.lines().filter(|l| l.starts_with('#')).collect();
    assert!(
        frames[0].contains("fibertrace_fiber::sched::block"),
        "{block}"
    );
    assert!(!text.contains("marker of fiber"), "{text}");
    assert!(took >= Duration::from_millis(200), "{took:?}");
    assert!(took < Duration::from_secs(3), "the dump took {took:?}");
}

/// Rounds of the spinning fiber of [`held_scheduler`]: still while its thread is held.
static SPINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A layer that reads its frames with the scheduler's thread held: each fiber gets a marker
/// frame named after its layer word on top of its native ones, and every call checks the
/// spinning fiber did not move since the read began (its thread is held).
#[derive(Default)]
struct HeldMarker {
    /// The spin count when the read began.
    at: std::sync::atomic::AtomicU64,
    /// Calls that found the spinning fiber moved, and calls in all.
    moved: std::sync::atomic::AtomicU64,
    calls: std::sync::atomic::AtomicU64,
    /// The running fiber's calls.
    running: std::sync::atomic::AtomicU64,
    /// How long the read takes before its first fiber (a source slower than a hold lasts).
    slow: Duration,
    /// The parked fiber's frames, read again after the hold (its marker then `100 + word`),
    /// and how many such reads ran (each checks the thread no longer holds the other).
    after: std::sync::Mutex<Vec<fibertrace_fiber::inspect::AfterHold>>,
    after_runs: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl HeldMarker {
    fn check(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        if SPINS.load(SeqCst) != self.at.load(SeqCst) {
            self.moved.fetch_add(1, SeqCst);
        }
    }
}

impl fibertrace_fiber::HeldSource for HeldMarker {
    fn frames(
        &self,
        word: u64,
        native: &[fibertrace_core::Frame],
    ) -> (Option<Vec<fibertrace_core::Frame>>, Option<String>) {
        self.check();
        let marked = |word: u64, native: &[fibertrace_core::Frame]| {
            let mut v = vec![fibertrace_core::Frame::Lua(fibertrace_core::LuaFrameId(
                word as u32,
            ))];
            v.extend_from_slice(native);
            v
        };
        if word == 7 {
            let (native, runs) = (native.to_vec(), self.after_runs.clone());
            self.after.lock().unwrap().push(Box::new(move || {
                assert!(
                    !fibertrace_core::capture::is_holding_another_thread(),
                    "run after the hold, by a thread that no longer holds the other"
                );
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                (word, marked(100 + word, &native))
            }));
        }
        (Some(marked(word, native)), None)
    }

    fn running_frames(
        &self,
        word: u64,
        native: &[fibertrace_core::Frame],
        register: &dyn Fn(u16) -> Option<u64>,
    ) -> (Option<Vec<fibertrace_core::Frame>>, Option<String>) {
        // Its stack pointer where it was stopped (DWARF 7): inside this thread's spin, a
        // word-aligned address.
        assert!(register(7).is_some_and(|sp| sp != 0 && sp % 8 == 0));
        assert_eq!(register(17), None);
        self.running
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let (frames, _) = self.frames(word, native);
        (frames, Some("read while it spun".into()))
    }

    fn name(&self, id: fibertrace_core::LuaFrameId) -> Option<String> {
        Some(format!("held marker {} in @held.lua:1", id.0))
    }

    fn begin(&self) {
        self.at.store(
            SPINS.load(std::sync::atomic::Ordering::SeqCst),
            std::sync::atomic::Ordering::SeqCst,
        );
        std::thread::sleep(self.slow);
    }

    fn end(&self) -> Vec<fibertrace_fiber::inspect::AfterHold> {
        self.check();
        std::mem::take(&mut *self.after.lock().unwrap())
    }
}

/// A scheduler with the marker source (read on its own thread only) and `held` (read from
/// another, its thread held) on its own thread: a fiber named `parked` waits on a channel
/// (layer word 7), and the main fiber (layer word 5) spins, counting in [`SPINS`], until
/// `stop` is set. Returns the thread and the parked fiber's id once both are in place.
fn held_scheduler(
    held: std::sync::Arc<HeldMarker>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (std::thread::JoinHandle<()>, u64) {
    layered_scheduler(
        |stop| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                SPINS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::hint::spin_loop();
            }
        },
        stop,
        None,
        Some(held),
    )
}

/// A dump from another thread while the scheduler's thread spins in native code (no safe
/// point): the thread is held still while the layer's held source reads every fiber (the
/// spinning one did not move during any call), then let go (it spins on); the parked fiber
/// and the running one have the source's frames over their native ones, and the part's
/// note says how they were read, with the source's note for the running fiber.
#[test]
fn a_dump_from_another_thread_holds_a_spinning_scheduler_still_for_its_held_source() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = std::sync::Arc::new(HeldMarker::default());
    let (t, parked) = held_scheduler(held.clone(), stop.clone());
    let text = dump::dump_text();
    // Let go: it spins on.
    let after = SPINS.load(std::sync::atomic::Ordering::SeqCst);
    let t0 = Instant::now();
    while SPINS.load(std::sync::atomic::Ordering::SeqCst) == after {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the thread was not let go"
        );
        std::thread::yield_now();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(
        held.moved.load(SeqCst),
        0,
        "the thread moved during the read"
    );
    // The parked fiber, the running one, and the end's check.
    assert_eq!(held.calls.load(SeqCst), 3, "{text}");
    assert_eq!(held.running.load(SeqCst), 1, "{text}");
    let block = |head: &str| {
        text.split("\n\n")
            .find(|b| b.contains(head))
            .unwrap_or_else(|| panic!("no {head}: {text}"))
            .to_string()
    };
    let parked_block = block(&format!("fiber {parked} \"parked\""));
    let frames: Vec<&str> = parked_block
        .lines()
        .filter(|l| l.starts_with('#'))
        .collect();
    // Its frames as the source gave them again after the hold, once.
    assert_eq!(
        frames[0], "#0  held marker 107 in @held.lua:1",
        "{parked_block}"
    );
    assert_eq!(held.after_runs.load(SeqCst), 1, "{text}");
    assert!(
        frames[1].contains("fibertrace_fiber::sched::block"),
        "{parked_block}"
    );
    let main = block("\"main\" [running]");
    assert!(
        main.contains("\n#0  held marker 5 in @held.lua:1"),
        "{main}"
    );
    assert!(
        main.contains("held_scheduler"),
        "its native frames below: {main}"
    );
    let main_id = main
        .lines()
        .find_map(|l| l.strip_prefix("fiber ")?.split_once(" \"main\" [running]"))
        .map(|(id, _)| id.to_string())
        .unwrap_or_else(|| panic!("{main}"));
    assert!(
        text.contains(&format!(
            "(the scheduler's thread did not come back to its run loop within 200 ms, nor its \
             running fiber to a safe point: the layer's (Lua) frames were read from memory, the \
             thread held still; fiber {main_id}: read while it spun)"
        )),
        "{text}"
    );
    assert!(!text.contains("not shown"), "{text}");
}

/// Two dumps asked at once from two threads while the scheduler's thread spins: each holds
/// the thread in turn (the second waits for the first's hold to end, then holds it again),
/// and each has the held source's frames, the thread still during every call.
#[test]
fn two_dumps_at_once_hold_the_spinning_scheduler_in_turn() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = std::sync::Arc::new(HeldMarker::default());
    let (t, parked) = held_scheduler(held.clone(), stop.clone());
    let dumps: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(dump::dump_text))
        .collect();
    let texts: Vec<String> = dumps.into_iter().map(|d| d.join().unwrap()).collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(held.moved.load(SeqCst), 0, "the thread moved during a read");
    assert_eq!(held.calls.load(SeqCst), 6, "{texts:?}");
    assert_eq!(held.running.load(SeqCst), 2, "{texts:?}");
    // Each read's work for after its hold, taken under that hold, run once.
    assert_eq!(held.after_runs.load(SeqCst), 2, "{texts:?}");
    for text in &texts {
        let block = text
            .split("\n\n")
            .find(|b| b.contains(&format!("fiber {parked} \"parked\"")))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            block.contains("\n#0  held marker 107 in @held.lua:1\n"),
            "{block}"
        );
        assert!(
            text.contains(
                ": the layer's (Lua) frames were read from memory, the thread held still"
            ),
            "{text}"
        );
    }
}

/// A held source slower than a hold lasts (5 s): the thread goes on when the hold runs out
/// (whatever the reader does), the read is dropped, and the part has native frames only,
/// with the note that says the layer's frames are not shown.
#[test]
fn a_held_read_that_outlives_the_hold_is_dropped_and_the_thread_goes_on() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = std::sync::Arc::new(HeldMarker {
        slow: Duration::from_millis(5500),
        ..HeldMarker::default()
    });
    let (t, parked) = held_scheduler(held.clone(), stop.clone());
    let text = dump::dump_text();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    use std::sync::atomic::Ordering::SeqCst;
    // It was read (every call found the thread moved on: the hold had run out).
    assert_eq!(held.calls.load(SeqCst), 3, "{text}");
    assert_eq!(held.moved.load(SeqCst), 3, "{text}");
    assert!(!text.contains("held marker"), "{text}");
    // What it left for after the hold is dropped with the read, not run.
    assert_eq!(held.after_runs.load(SeqCst), 0, "{text}");
    assert!(
        text.contains(
            "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
             not come back to its run loop within 200 ms"
        ),
        "{text}"
    );
    let block = text
        .split("\n\n")
        .find(|b| b.contains(&format!("fiber {parked} \"parked\"")))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        block
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("fibertrace_fiber::sched::block")),
        "{block}"
    );
}

/// Set by [`arm_flag`], polled by the spinning fiber of [`spin_to_safe_points`].
static ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A layer's arm: raises a flag the spinning fiber polls (a Lua host sends a signal that sets
/// the VM's hook instead).
fn arm_flag(_tid: i32) -> Result<(), &'static str> {
    ARMED.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

fn arm_refusing(_tid: i32) -> Result<(), &'static str> {
    Err("the layer says no")
}

/// Spins without yielding; at each raised flag, a safe point where the layer gives the
/// running fiber's frames: one frame of its own.
fn spin_to_safe_points(stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if ARMED.swap(false, std::sync::atomic::Ordering::AcqRel) {
            fibertrace_fiber::inspect::serve_at_safe_point(&mut || {
                Some(vec![fibertrace_core::Frame::Lua(
                    fibertrace_core::LuaFrameId(7_000_001),
                )])
            });
        }
        std::hint::spin_loop();
    }
}

#[test]
fn a_dump_from_another_thread_is_built_at_a_safe_point_inside_a_spinning_fiber() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (t, parked) = marked_scheduler_with_arm(spin_to_safe_points, stop.clone(), Some(arm_flag));
    let t0 = Instant::now();
    let text = dump::dump_text();
    let took = t0.elapsed();
    let served_again = fibertrace_fiber::inspect::serve_at_safe_point(&mut || None);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    // Not a scheduler's thread: nothing to serve.
    assert!(!served_again);
    assert!(!text.contains("not shown"), "{text}");
    assert!(took < Duration::from_secs(2), "the dump took {took:?}");
    // The running fiber: the frames the layer gave at the safe point, labelled by its source.
    let running = text
        .split("\n\n")
        .find(|b| b.contains("\"main\" [running]"))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(
        running
            .lines()
            .take_while(|l| !l.starts_with("created by "))
            .filter(|l| l.starts_with('#'))
            .collect::<Vec<_>>(),
        ["#0  marker of fiber 7000001 in @marker.lua:1"],
        "{running}"
    );
    // The others: the source's frames too, read at the same safe point.
    let block = text
        .split("\n\n")
        .find(|b| b.contains(&format!("fiber {parked} \"parked\"")))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        block.contains(&format!("#0  marker of fiber {parked} in @marker.lua:1\n")),
        "{block}"
    );
}

#[test]
fn a_layer_that_cannot_bring_its_fiber_to_a_safe_point_is_named_in_the_note() {
    let _turn = MARKED.lock().unwrap_or_else(|e| e.into_inner());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (t, _parked) =
        marked_scheduler_with_arm(spin_to_safe_points, stop.clone(), Some(arm_refusing));
    let text = dump::dump_text();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap();
    assert!(
        text.contains(
            "(frames of the layer above the runtime (Lua) not shown: the scheduler's thread did \
             not come back to its run loop within 200 ms, and its running fiber cannot be \
             stopped at a safe point: the layer says no)"
        ),
        "{text}"
    );
}
