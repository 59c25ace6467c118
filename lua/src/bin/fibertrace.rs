//! The `fibertrace` command-line program: `run` (a Lua host whose fibers are traced) and
//! `decode` (backtrace tokens in logs).

use clap::{Arg, ArgAction, Command};
use fibertrace_fiber::export::Format;
use fibertrace_lua::decode::LineDecoder;
use fibertrace_lua::symbols::Symbolizer;
use fibertrace_lua::LuaHost;
use std::io::{self, BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The heap tracker: off unless `FIBERTRACE_HEAP` (which `--heap` and `--leaks` set, running
/// the program again) names a tier. Off, it costs a load and a branch per allocation. Below
/// it, the emergency reserve: when the system has no memory left (the Lua heap took the
/// address space a limit allows), `fiber.info()`, a dump or a crash report finish on the
/// reserve where a failed allocation would abort the process.
#[global_allocator]
static HEAP: fibertrace_core::heap::Tracked<fibertrace_core::heap::Reserve<std::alloc::System>> =
    fibertrace_core::heap::Tracked::from_env(
        fibertrace_core::heap::Reserve::new(std::alloc::System),
        fibertrace_core::heap::Tier::Off,
    );

/// Writes a line to standard error; a standard error that cannot be written (closed, full)
/// loses the message, never the program.
macro_rules! err {
    ($($t:tt)*) => {{
        let _ = writeln!(io::stderr(), $($t)*);
    }};
}

/// The longest input line `decode` reads whole (1 MiB); a longer one is reported as soon as
/// it passes the bound (an endless one too) and skipped to its end without being stored, and
/// decoding goes on with the next line.
const MAX_LINE: usize = 1 << 20;

/// The most errors reported for one line; the rest are counted in one line.
const MAX_LINE_ERRORS: usize = 100;

/// One line of input, read with a bounded buffer.
enum Line {
    /// The line (without its newline).
    Text(Vec<u8>),
    /// A line that has just passed [`MAX_LINE`] bytes: the next read skips the rest of it.
    TooLong,
}

/// Reads lines of at most [`MAX_LINE`] bytes.
struct LineReader<R> {
    r: R,
    /// The rest of an overlong line is still to be skipped.
    skipping: bool,
}

impl<R: BufRead> LineReader<R> {
    fn new(r: R) -> Self {
        Self { r, skipping: false }
    }

    /// Reads the next line into `buf` (cleared first), storing at most [`MAX_LINE`] bytes of
    /// it: a longer line is [`Line::TooLong`] as soon as it passes the bound — an endless one
    /// too — and what follows of it is skipped by the next call, without being stored.
    /// `Ok(None)` at the end of the input.
    fn read_line(&mut self, buf: &mut Vec<u8>) -> io::Result<Option<Line>> {
        buf.clear();
        let mut any = false;
        loop {
            let avail = match self.r.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if avail.is_empty() {
                self.skipping = false;
                break;
            }
            let (chunk, done) = match avail.iter().position(|&c| c == b'\n') {
                Some(i) => (&avail[..i], Some(i + 1)),
                None => (avail, None),
            };
            let used = done.unwrap_or(avail.len());
            if self.skipping {
                self.r.consume(used);
                self.skipping = done.is_none();
                continue;
            }
            any = true;
            if buf.len() + chunk.len() > MAX_LINE {
                // Over the bound: what was kept is of no use; the rest is skipped next time.
                *buf = Vec::new();
                self.r.consume(used);
                self.skipping = done.is_none();
                return Ok(Some(Line::TooLong));
            }
            buf.extend_from_slice(chunk);
            self.r.consume(used);
            if done.is_some() {
                break;
            }
        }
        Ok(any.then(|| Line::Text(std::mem::take(buf))))
    }
}

fn cli() -> Command {
    Command::new("fibertrace")
        .about("Tools for fibertrace backtraces")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(
            Command::new("run")
                .about(
                    "Run a Lua script as the main fiber, with Tarantool's `fiber` and `clock` \
                     modules (require 'fiber'); `arg` is set as `lua` sets it. Exits when the \
                     main chunk has returned and no fiber is ready to run (fibers still \
                     waiting are dropped; one that only yields keeps it running), or on \
                     os.exit(n); on an error prints it with an \
                     interleaved native + Lua traceback and exits with 1. SIGQUIT prints \
                     every fiber's trace to stderr and the script goes on; SIGINT and \
                     SIGTERM stop the script at its next Lua line, flush what \
                     it printed and exit with 130 and 143, \
                     SIGHUP, SIGUSR1, SIGUSR2 and SIGALRM likewise with 128 + the signal \
                     (each unless inherited ignored, as under nohup or trap '' INT); while \
                     os.execute runs a \
                     command, SIGINT goes to the command alone, as C's system() has it (the \
                     script gets how the command ended and goes on). \
                     A fiber running when a dump or report is taken is stopped at its next \
                     Lua line to read its Lua frames (this takes SIGPROF; \
                     FIBERTRACE_LUA_SAFE_POINTS=0 turns it off). \
                     Options go before the script: everything after it is the script's",
                )
                .arg(
                    Arg::new("stall-ms")
                        .long("stall-ms")
                        .value_name("N")
                        .value_parser(whole(1, u64::MAX, "milliseconds"))
                        .help(
                            "Report a fiber that runs more than N ms without yielding \
                             (its Lua frames, read at its next Lua line; again at 2N, 4N, \
                             ...). Runs are measured in CPU time; a fiber blocked in the \
                             kernel (a blocking read, os.execute) is reported once blocked \
                             4N ms (at least N + 200), its frames read where it is blocked. A \
                             script's fiber.set_max_slice sets N from then on (the run under \
                             way too)",
                        ),
                )
                .arg(
                    Arg::new("blocked-ms")
                        .long("blocked-ms")
                        .value_name("N")
                        .value_parser(whole(1, u64::MAX, "milliseconds"))
                        .help(
                            "Report a fiber blocked more than N ms (on a channel, condition, \
                             join or sleep), once per wait, with its Lua frames",
                        ),
                )
                .arg(
                    Arg::new("dump-view")
                        .long("dump-view")
                        .value_name("VIEW")
                        .value_parser(["full", "grouped"])
                        .default_value("full")
                        .help(
                            "How the SIGQUIT dump and the deadlock report show fibers: full \
                             (every fiber with its trace) or grouped (fibers in the same \
                             state with the same trace and creator folded into one group \
                             with their count, ids and names, the biggest group first)",
                        ),
                )
                .arg(
                    Arg::new("dump-on-exit")
                        .long("dump-on-exit")
                        .value_name("FORMAT:FILE")
                        .action(ArgAction::Append)
                        .value_parser(parse_dump_on_exit)
                        .help(
                            "When the program ends (its end, an error, os.exit, a deadlock, \
                             SIGINT, SIGTERM or another exit signal), write every fiber in \
                             FORMAT to FILE: text, \
                             grouped, json, pprof (go tool pprof), folded, svg (a flame \
                             graph) or speedscope (repeatable). A FILE that could not be \
                             written is refused before the script runs; a dump that still \
                             cannot be written (a full disk) is an error on stderr, and a \
                             program that would have exited with 0 exits with 1",
                        ),
                )
                .arg(
                    Arg::new("dump-on-exit-wait")
                        .long("dump-on-exit-wait")
                        .value_name("SECONDS")
                        .value_parser(whole(1, 3600, "seconds"))
                        .default_value("10")
                        .help(
                            "After SIGINT, SIGTERM or another exit signal, how long the \
                             --dump-on-exit dumps may take (a dump of 30,000 fibers takes a \
                             few seconds); past it the program ends without the rest, names \
                             the dumps it gave up and leaves no partial file. Without dumps, or once they are \
                             written, it ends within a second",
                        ),
                )
                .arg(
                    Arg::new("http")
                        .long("http")
                        .value_name("ADDR")
                        .value_parser(parse_http)
                        .help(
                            "Serve every fiber's views over HTTP while the program runs, from \
                             a thread of their own (they answer while a fiber spins): \
                             /debug/fibers?format=text|grouped|json|pprof|folded|svg|speedscope, \
                             /debug/pprof/goroutine (pprof, where Go serves it) and an index \
                             at /. PORT or :PORT listens on 127.0.0.1; HOST:PORT as given \
                             (0.0.0.0:PORT exposes the stacks to the network). Port 0 picks \
                             one; the address is printed on stderr",
                        ),
                )
                .arg(
                    Arg::new("native-detail")
                        .long("native-detail")
                        .action(ArgAction::SetTrue)
                        .help(
                            "Show the runtime's and the host's glue in reports and tracebacks \
                             too (catch_unwind, wrappers, the trampoline), which are left out \
                             by default; the Lua VM's own frames (its interpreter and the core \
                             functions it runs Lua through, such as its parser) stay out",
                        ),
                )
                .arg(
                    Arg::new("heap")
                        .long("heap")
                        .value_name("TIER")
                        .num_args(0..=1)
                        .require_equals(true)
                        .default_missing_value("sampled")
                        .value_parser(["sampled", "every"])
                        .help(
                            "Track the heap: who allocated every live byte, charged to the \
                             fiber that made it (fiber.info's memory.heap, the dumps, \
                             require('fibertrace').heap()). sampled (the default): Poisson \
                             sampling by bytes, estimates, cheap; every: each allocation \
                             carries its stack (lws alloc_metadata). The program is run again \
                             with FIBERTRACE_HEAP set (which does the same)",
                        ),
                )
                .arg(
                    Arg::new("heap-interval")
                        .long("heap-interval")
                        .value_name("BYTES")
                        .value_parser(whole(1, 1 << 40, "bytes"))
                        .help("Mean bytes between samples of --heap=sampled (default 524288)"),
                )
                .arg(
                    Arg::new("leaks")
                        .long("leaks")
                        .action(ArgAction::SetTrue)
                        .help(
                            "At exit, print on stderr what the script made and still holds: \
                             the allocations still live, grouped by stack, biggest first, with \
                             the fiber that made each (tracks every allocation unless \
                             --heap=sampled is given). At the script's end and in os.exit the \
                             Lua heap is collected first (the finalizers of what is \
                             unreachable run, as in any collection) and the runtime's spare \
                             objects let go; what was live before the script started, and \
                             what the runtime made outside the script's fibers, is left out \
                             and counted",
                        ),
                )
                .arg(
                    Arg::new("leaks-top")
                        .long("leaks-top")
                        .value_name("N")
                        .value_parser(whole(1, 100_000, "stacks"))
                        .default_value("20")
                        .help("How many stacks the --leaks report lists"),
                )
                .arg(
                    // The script and its arguments as one list, so that option parsing stops
                    // at the script: `run s.lua -h` passes `-h` to the script.
                    Arg::new("script")
                        .value_name("SCRIPT.lua [ARGS]...")
                        .required(true)
                        .num_args(1..)
                        .trailing_var_arg(true)
                        .allow_hyphen_values(true)
                        // Any bytes, as `lua` takes them (a file name need not be UTF-8).
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help(
                            "The script (`-` for standard input), then its arguments \
                             (arg[1], arg[2], ... and `...`)",
                        ),
                ),
        )
        .subcommand(
            Command::new("dump")
                .about(
                    "Print the stacks of every thread of a live process, read from the \
                     outside without running its code: symbols, file:line and inline frames \
                     from its own binaries (found through /proc/PID/root, so a container's \
                     are its own); for a process that uses the fibertrace runtime, every \
                     fiber too (its registry, its suspended stacks, a Lua host's Lua \
                     frames). By default every thread is stopped (ptrace) for the time of \
                     the reading and let go after, whatever happens",
                )
                .arg(
                    Arg::new("target")
                        .value_name("PID | EXE")
                        .required_unless_present("core")
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help(
                            "The process; with --core, the executable the core file names \
                             (when it is no longer where it was)",
                        ),
                )
                .arg(
                    Arg::new("core")
                        .long("core")
                        .value_name("FILE")
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help(
                            "Read a core file instead of a live process: its threads, its \
                             fibers and their stacks, from the memory it holds (the mapped \
                             files for what it left out)",
                        ),
                )
                .arg(
                    Arg::new("root")
                        .long("root")
                        .value_name("DIR")
                        .requires("core")
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help(
                            "With --core: read the files the core names under DIR (a copy \
                             of the machine's files)",
                        ),
                )
                .arg(
                    Arg::new("non-blocking")
                        .long("non-blocking")
                        .action(ArgAction::SetTrue)
                        .help(
                            "Stop nothing: threads blocked in a system call are read where \
                             they wait, running threads are not read, and nothing is exact",
                        ),
                )
                .arg(
                    Arg::new("format")
                        .long("format")
                        .value_name("FORMAT")
                        .value_parser([
                            "text",
                            "grouped",
                            "json",
                            "pprof",
                            "folded",
                            "svg",
                            "speedscope",
                        ])
                        .default_value("text")
                        .help(
                            "text; grouped (identical fibers folded, Go's debug=1); json \
                             (the dump as one JSON object); pprof (gzipped profile.proto), \
                             folded, svg (a flame graph) or speedscope: the threads and \
                             fibers as stacks",
                        ),
                )
                .arg(
                    Arg::new("native-detail")
                        .long("native-detail")
                        .action(ArgAction::SetTrue)
                        .help(
                            "Show every frame, Rust's own glue too (catch_unwind, closure \
                             shims, thread start), which the text leaves out by default",
                        ),
                ),
        )
        .subcommand(
            Command::new("decode")
                .about(
                    "Decode backtraces found in log lines: ~m# (lws; printed as lws's decode \
                     tool prints them, ~b#size: N, 0x… ), ~c# (Swift CBF, base64 or hex), \
                     ~n# (native, with ~i# image tables)",
                )
                .arg(
                    Arg::new("cbf")
                        .long("cbf")
                        .action(ArgAction::SetTrue)
                        .help("Also take the first word of every line as CBF (hex or base64)"),
                )
                .arg(
                    Arg::new("exe")
                        .short('e')
                        .long("exe")
                        .value_name("BINARY")
                        .action(ArgAction::Append)
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help(
                            "Symbolize each frame like `addr2line -a -f -p -i` with this ELF \
                             file or build-id directory (repeatable)",
                        ),
                )
                .arg(
                    Arg::new("files")
                        .value_name("FILE")
                        .num_args(0..)
                        .value_parser(clap::value_parser!(std::ffi::OsString))
                        .help("Input files (standard input when none; `-` for standard input)"),
                ),
        )
}

/// `--dump-on-exit FORMAT:FILE`: a known format, and a file whose directory exists (checked
/// now, so that a mistake shows before the program runs, not after; whether the file can be
/// written is checked once all of them are known, see `main`).
fn parse_dump_on_exit(v: &str) -> Result<(Format, PathBuf), String> {
    let (format, file) = v
        .split_once(':')
        .ok_or_else(|| "expected FORMAT:FILE, e.g. pprof:fibers.pb.gz".to_string())?;
    let format = Format::parse(format).map_err(|e| e.to_string())?;
    if file.is_empty() {
        return Err("the file name is empty".into());
    }
    let file = PathBuf::from(file);
    if file.file_name().is_none() {
        return Err(format!("{}: not a file name", file.display()));
    }
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(format!("{}: no such directory", dir.display()));
    }
    if file.is_dir() {
        return Err(format!("{}: is a directory", file.display()));
    }
    Ok((format, file))
}

/// `--http ADDR`: an address to listen on (resolved now: a mistake shows before the program
/// runs).
fn parse_http(v: &str) -> Result<String, String> {
    fibertrace_fiber::http::parse_addr(v).map_err(|e| e.to_string())?;
    Ok(v.to_string())
}

/// A whole number of `unit` in `lo..=hi`, for a flag's value: clap's own parser answered
/// `-1` and `1e3` with "invalid digit found in string", a number past 64 bits with "number
/// too large to fit in target type", and `0` with "0 is not in 1..18446744073709551615".
fn whole(
    lo: u64,
    hi: u64,
    unit: &'static str,
) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |v: &str| {
        let range = if hi == u64::MAX {
            format!("{lo} or more")
        } else {
            format!("from {lo} to {hi}")
        };
        let expected = format!("a whole number of {unit} is expected, {range}");
        if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(expected);
        }
        match v.parse::<u64>() {
            Ok(n) if (lo..=hi).contains(&n) => Ok(n),
            Ok(_) => Err(expected),
            // (Digits only, past 64 bits.)
            Err(_) => Err(format!("{expected}: this one is past {}", u64::MAX)),
        }
    }
}

/// The dumps `--dump-on-exit` asked for.
static DUMPS_ON_EXIT: std::sync::OnceLock<Vec<(Format, PathBuf)>> = std::sync::OnceLock::new();

/// Where the `--dump-on-exit` dumps stand. Three exit paths may reach them at once — the
/// script's end (or error, or deadlock), `os.exit` on a fiber, and an exit signal's thread —
/// and exactly one writes them: the others wait for it (an exit path that went on would end
/// the process in the middle of the writing, and two writers would share the temporary
/// files), then take its outcome. The exit signal's wait is bounded by
/// `--dump-on-exit-wait`, as its own writing is (see [`install_signals`]).
///
/// A claim whose writer raised a Lua error before it finished (`os.exit`'s dumps, out of
/// memory) is taken over by the next claim made on the same thread — the wrapper's fallback
/// that writes them from Rust, or the script's end: a thread that claims again is not writing
/// any more.
#[derive(Clone, Copy, PartialEq)]
enum ExitDumps {
    NotBegun,
    /// By this thread.
    Writing(std::thread::ThreadId),
    /// Written, all of them (true) or not.
    Written(bool),
}

static EXIT_DUMPS: std::sync::Mutex<ExitDumps> = std::sync::Mutex::new(ExitDumps::NotBegun);

/// How many of the `--dump-on-exit` dumps, in their order, the exit path writing them is
/// done with (written or failed): the ones after are those an exit signal's wait gives up
/// ([`dumps_given_up`] names them).
static EXIT_DUMPS_ENDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static EXIT_DUMPS_DONE: std::sync::Condvar = std::sync::Condvar::new();

/// Claims the writing of the `--dump-on-exit` dumps: `None` when the caller is to write them
/// now (and then calls [`finish_exit_dumps`]); otherwise, once another exit path has written
/// them (waiting for it), whether all were written.
fn claim_exit_dumps() -> Option<bool> {
    EXIT_BEGUN.store(true, std::sync::atomic::Ordering::SeqCst);
    // (A panic while the lock was held cannot leave the state half-changed: it is one value.)
    let mut st = EXIT_DUMPS.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        match *st {
            ExitDumps::Writing(by) if by != std::thread::current().id() => {
                st = EXIT_DUMPS_DONE.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            ExitDumps::Written(all) => return Some(all),
            ExitDumps::NotBegun | ExitDumps::Writing(_) => {
                *st = ExitDumps::Writing(std::thread::current().id());
                // The script's own exit (its end, `os.exit`) writes them: an exit signal's
                // halt must not stop it in the middle of them (see `finish_exit_dumps`).
                if on_script_thread() {
                    fibertrace_lua::host::exempt_from_halt(true);
                }
                return None;
            }
        }
    }
}

/// The claimed dumps are written (`all`: every one of them); the exit paths waiting go on.
fn finish_exit_dumps(all: bool) {
    *EXIT_DUMPS.lock().unwrap_or_else(|e| e.into_inner()) = ExitDumps::Written(all);
    EXIT_DUMPS_DONE.notify_all();
    if on_script_thread() {
        fibertrace_lua::host::exempt_from_halt(false);
    }
}

/// Whether the caller runs on the script's thread.
fn on_script_thread() -> bool {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() == SCRIPT_TID.load(std::sync::atomic::Ordering::SeqCst) }
}

/// The exit code of an exit signal being handled (128 + the signal), 0 while none is.
static EXIT_SIGNALLED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// The kernel id of the thread that runs the script (its host's), once it is made: an exit
/// signal stops the script there ([`fibertrace_lua::host::halt`]) while the program ends.
static SCRIPT_TID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Called by an exit path other than the exit signal's once the dumps are written: when an
/// exit signal came meanwhile, its thread ends the process (with 128 + the signal, flushed,
/// within a second), so this one waits for that instead of racing it with its own code.
fn defer_to_exit_signal() {
    // (A closed standard output's end began in `on_sigpipe`: its exit thread may not have
    // taken it yet.)
    if EXIT_SIGNALLED.load(std::sync::atomic::Ordering::SeqCst) != 0
        || STDOUT_GONE.load(std::sync::atomic::Ordering::SeqCst)
    {
        loop {
            std::thread::park();
        }
    }
}

/// Writes the `--dump-on-exit` dumps, once (the first of the exit paths to get here; the
/// others wait for it: see [`ExitDumps`]); a dump that cannot be written is said on stderr,
/// and the others are still written. Returns false when one could not be (the program then
/// does not end with 0: see [`exit_code`]).
fn dump_on_exit() -> bool {
    let Some(list) = DUMPS_ON_EXIT.get() else {
        return true;
    };
    if let Some(all) = claim_exit_dumps() {
        return all;
    }
    let mut all = true;
    for (format, file) in list {
        // (With the main fiber where its uncaught error was raised, when that ended the
        // script: it has ended by now.)
        let mut snap =
            fibertrace_fiber::inspect::snapshot(&fibertrace_fiber::InfoOptions::default());
        fibertrace_lua::host::with_failed_main(&mut snap);
        let bytes = fibertrace_fiber::export::to_bytes(&snap, *format);
        if let Err(e) = fibertrace_fiber::export::write_file(file, &bytes) {
            err!("fibertrace: --dump-on-exit {format}: {e}");
            all = false;
        }
        EXIT_DUMPS_ENDED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    finish_exit_dumps(all);
    all
}

/// Whether standard output is a pipe whose reader went away (its write end polls POLLERR).
fn stdout_reader_gone() -> bool {
    let mut p = libc::pollfd {
        fd: 1,
        events: 0,
        revents: 0,
    };
    // SAFETY: poll(2) of one descriptor, without waiting.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & (libc::POLLERR | libc::POLLHUP) != 0 }
}

/// Flushes what the script printed so far (C's standard output, where Lua's `print` and
/// `io.write` go, and Rust's), before the script's end or `os.exit` writes the
/// `--dump-on-exit` dumps: a dump into the same terminal or file (`text:/dev/stdout`) came
/// before the script's own output, and a dump's error before what the script printed. (Not
/// on an exit signal's path: a thread may hold the stream's lock there for ever.)
fn flush_script_output() {
    // Standard output without a reader (a pipe whose `head` ended): left as it is, so that
    // the exit's own flush ends the program by SIGPIPE (`on_sigpipe`) after the dumps, not
    // this one before them.
    if stdout_reader_gone() {
        return;
    }
    let _ = io::stdout().flush();
    // SAFETY: `stdout` is the C library's standard output stream, open for the life of the
    // process; fflush on it is a plain call, and no thread of the script's holds its lock at
    // the script's end or in `os.exit` (the script's own thread is here).
    if unsafe { libc::fflush(C_STDOUT) } != 0 {
        // Said at exit (`stdout_at_exit`), with this error: the stream keeps only that one
        // failed.
        let e = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        STDOUT_ERRNO.store(e, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The error of a flush of C's standard output before the exit dumps
/// ([`flush_script_output`]), 0 if none failed: [`stdout_at_exit`] says it.
static STDOUT_ERRNO: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The program's exit code: the script's, except that a success whose `--dump-on-exit` dumps
/// could not all be written is a failure (1): what watches the exit code learns the dump it
/// relies on is missing. A failing script keeps its own code.
fn exit_code(script: i32, dumped: bool) -> i32 {
    if script == 0 && !dumped {
        1
    } else {
        script
    }
}

/// `os.exit` with the `--dump-on-exit` dumps written first, through `fibertrace.dump`, on
/// the fiber that exits (its own trace then has its Lua frames; when the wrapper's Lua cannot
/// allocate, [`exit_dumps_failed`] writes them from Rust, without them). A success (`os.exit()`,
/// `os.exit(true)`, `os.exit(0)`, `os.exit('0')`, which `os.exit` reads as 0) whose dumps
/// could not all be written exits with 1, as [`exit_code`] says.
const EXIT_WRAPPER: &str = r#"
local dump, exit, list, claim, finish, ended, failed = ...
-- (The script may change the globals: the wrapper keeps its own.)
local pcall, select, tonumber, tostring = pcall, select, tonumber, tostring
local stderr = io.stderr
-- Everything the exit needs is made now: with the Lua heap full, os.exit still exits (it
-- raised `not enough memory` and the script went on).
local opts = {}
for i, d in ipairs(list) do opts[i] = {format = d[1], file = d[2]} end
local function write_dumps()
    local mine, all = claim()
    if not mine then return all end
    all = true
    for i = 1, #opts do
        local ok, err = dump(opts[i])
        if not ok then
            pcall(stderr.write, stderr, 'fibertrace: --dump-on-exit ', opts[i].format, ': ', tostring(err), '\n')
            all = false
        end
        ended()
    end
    finish(all)
    return all
end
local function say(e)
    stderr:write('fibertrace: --dump-on-exit: written without the Lua frames of the fiber that exits: ', tostring(e), '\n')
end
-- Whether os.exit takes `code` (nil, a boolean, or a number or numeric string: an integer
-- one in Lua 5.3 and later; not an FFI number, which `tonumber` converts but LuaJIT's
-- os.exit refuses). One it refuses raises its error before the dumps: a failed exit wrote
-- them and marked them done, and the real exit later wrote none.
local type, tointeger = type, math.tointeger
local function exits_with(code)
    local t = type(code)
    if t == 'nil' or t == 'boolean' then return true end
    if t == 'cdata' then return false end
    local n = tonumber(code)
    if n == nil then return false end
    return tointeger == nil or tointeger(n) ~= nil
end
return function(...)
    if not exits_with((...)) then return exit(...) end
    local ok, all = pcall(write_dumps)
    if not ok then
        pcall(say, all)
        ok, all = pcall(failed)
        all = ok and all
    end
    local code = ...
    if not all and (code == nil or code == true or tonumber(code) == 0) then
        return exit(1, select(2, ...))
    end
    return exit(...)
end
"#;

/// `--leaks`: `os.exit` lets go of what the host keeps for its next fibers and collects the
/// Lua heap first ([`fibertrace_lua::LuaHost::release_kept`]), as the end of the main chunk
/// does: the report lists what the script still holds.
fn release_before_exit(host: &fibertrace_lua::LuaHost) -> mlua::Result<()> {
    let lua = host.lua();
    let os: mlua::Table = lua.globals().get("os")?;
    let exit: mlua::Function = os.get("exit")?;
    let wrapped: mlua::Function = lua
        .load("local release, exit, pcall = ...\nreturn function(...) pcall(release) return exit(...) end")
        .set_name(fibertrace_lua::HOST_CHUNK)
        .call((host.release_kept_fn()?, exit, lua.globals().get::<mlua::Function>("pcall")?))?;
    os.set("exit", wrapped)
}

/// [`EXIT_WRAPPER`]'s dumps stopped by an error (the Lua heap full: the wrapper's own calls
/// allocate): they are written from here, as the script's end writes them (without the
/// exiting fiber's Lua frames, which need Lua's memory); returns whether all were. A plain
/// C function (no argument, one boolean result): it allocates nothing in Lua to be called.
///
/// # Safety
/// Called by Lua, on a state of this program's host.
unsafe extern "C-unwind" fn exit_dumps_failed(l: *mut mlua::ffi::lua_State) -> std::ffi::c_int {
    // (A panic must not unwind into the VM.)
    let all = std::panic::catch_unwind(|| {
        flush_script_output();
        // All of them again: the count of those ended restarts (it tells an exit signal's
        // path which ones it gave up on).
        EXIT_DUMPS_ENDED.store(0, std::sync::atomic::Ordering::SeqCst);
        dump_on_exit()
    })
    .unwrap_or(false);
    defer_to_exit_signal();
    // SAFETY: the state of this running C function, with room for one value.
    unsafe { mlua::ffi::lua_pushboolean(l, all as std::ffi::c_int) };
    1
}

/// Replaces `os.exit` with [`EXIT_WRAPPER`].
fn wrap_os_exit(lua: &mlua::Lua, list: &[(Format, PathBuf)]) -> mlua::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let loaded: mlua::Table = lua.globals().get::<mlua::Table>("package")?.get("loaded")?;
    let dump: mlua::Function = loaded.get::<mlua::Table>("fibertrace")?.get("dump")?;
    let os: mlua::Table = lua.globals().get("os")?;
    let exit: mlua::Function = os.get("exit")?;
    let t = lua.create_table()?;
    for (i, (format, file)) in list.iter().enumerate() {
        let pair = lua.create_table()?;
        pair.raw_set(1, format.name())?;
        pair.raw_set(2, lua.create_string(file.as_os_str().as_bytes())?)?;
        t.raw_set(i + 1, pair)?;
    }
    // `claim()`: true when this exit writes the dumps; else false and whether all were
    // written (by the exit path that did, waited for).
    let claim = lua.create_function(|_, ()| {
        Ok(match claim_exit_dumps() {
            None => {
                flush_script_output();
                (true, None)
            }
            Some(all) => {
                defer_to_exit_signal();
                (false, Some(all))
            }
        })
    })?;
    let finish = lua.create_function(|_, all: bool| {
        finish_exit_dumps(all);
        defer_to_exit_signal();
        Ok(())
    })?;
    // SAFETY: `exit_dumps_failed` is a C function that uses its state only to push one
    // boolean (room for it is there: a C function has LUA_MINSTACK slots).
    let failed = unsafe { lua.create_c_function(exit_dumps_failed) }?;
    let ended = lua.create_function(|_, ()| {
        EXIT_DUMPS_ENDED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })?;
    let wrapped: mlua::Function = lua
        .load(EXIT_WRAPPER)
        .set_name(fibertrace_lua::HOST_CHUNK)
        .call((dump, exit, t, claim, finish, ended, failed))?;
    os.set("exit", wrapped)
}

/// Address space set aside for the C library's own allocations once the system refuses
/// memory (see `fibertrace_core::heap::set_aside`).
const SET_ASIDE: usize = 8 << 20;

fn main() -> ExitCode {
    // (Before any thread starts: under `ulimit -v`, each thread's own malloc arena would
    // reserve 64 MiB of what the script may use.)
    fibertrace_core::heap::one_arena_under_limit();
    fibertrace_core::heap::set_aside(SET_ASIDE);
    let m = cli().get_matches();
    match m.subcommand() {
        Some(("run", m)) => {
            // Under `ulimit -v`, room for the first report at the limit to read this
            // program's file and debug information (its native frames were all unnamed).
            let exe = std::env::current_exe().and_then(std::fs::metadata);
            fibertrace_core::symbolize::set_aside_room(exe.map_or(0, |m| m.len()));
            // And three descriptors, for a report when the script used up `ulimit -n`.
            fibertrace_core::symbolize::set_aside_descriptors(3);
            run(m)
        }
        Some(("decode", m)) => decode(m),
        Some(("dump", m)) => dump_process(m),
        _ => ExitCode::from(2),
    }
}

/// `fibertrace dump PID`: another process's threads (see `fibertrace_core::remote`) and,
/// when it uses the fibertrace runtime, its fibers (`fibertrace_fiber::inspect::foreign`).
fn dump_process(m: &clap::ArgMatches) -> ExitCode {
    use fibertrace_core::remote::{DumpOptions, Mode};
    let core = m.get_one::<std::ffi::OsString>("core").map(PathBuf::from);
    let target = m.get_one::<std::ffi::OsString>("target");
    let pid = match (&core, target) {
        (Some(_), _) => 0,
        (None, Some(t)) => match t.to_str().and_then(|t| t.parse::<i32>().ok()) {
            Some(p) if p > 0 => p,
            _ => {
                err!(
                    "error: invalid PID '{}': a process id (a number above 0) is expected\n\n\
                     For more information, try '--help'.",
                    t.to_string_lossy()
                );
                return ExitCode::from(2);
            }
        },
        (None, None) => return ExitCode::from(2),
    };
    let opts = DumpOptions {
        mode: if m.get_flag("non-blocking") {
            Mode::NonBlocking
        } else {
            Mode::Consistent
        },
        ..DumpOptions::default()
    };
    // A Lua host's fibers get their Lua frames (read with the layout it publishes).
    let mut lua = fibertrace_lua::interleave::foreign::LuaLayer::new();
    let d = match &core {
        Some(c) => {
            let exe = target.map(PathBuf::from);
            let root = m.get_one::<std::ffi::OsString>("root").map(PathBuf::from);
            fibertrace_fiber::inspect::foreign::dump_core_with(
                c,
                exe.as_deref(),
                root.as_deref(),
                &opts,
                Some(&mut lua),
            )
        }
        None => fibertrace_fiber::inspect::foreign::dump_with(pid, &opts, Some(&mut lua)),
    };
    let d = match d {
        Ok(d) => d,
        Err(e) => {
            err!("fibertrace: {e}");
            return ExitCode::from(1);
        }
    };
    // (Said in the text too; on stderr for every format.)
    for w in &d.process.warnings {
        err!("fibertrace: warning: {w}");
    }
    fibertrace_fiber::glue::set_native_detail(m.get_flag("native-detail"));
    // (The target may run a Lua host: its glue is left out too.)
    fibertrace_lua::host::register_glue();
    let text: Vec<u8> = match m.get_one::<String>("format").map(String::as_str) {
        Some("json") => match serde_json::to_string_pretty(&d) {
            Ok(j) => (j + "\n").into_bytes(),
            Err(e) => {
                err!("fibertrace: {e}");
                return ExitCode::from(1);
            }
        },
        Some("grouped") => d.to_grouped_text().into_bytes(),
        Some(f @ ("pprof" | "folded" | "svg" | "speedscope")) => {
            use fibertrace_fiber::inspect::export::{to_bytes, Format};
            match Format::parse(f) {
                Ok(fmt) => to_bytes(&d.snapshot(true), fmt),
                Err(e) => {
                    err!("fibertrace: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        _ => d.to_text().into_bytes(),
    };
    let mut out = io::stdout().lock();
    // What was read is written even when the process ended meanwhile (a dying process's
    // last stacks are worth having), or the core file was cut short, but that is no
    // success: said, and the status is 1.
    let ended = |code: ExitCode| {
        if !d.process.warnings.is_empty() {
            // (Said before the dump.)
            return ExitCode::from(1);
        }
        if !d.process.ended {
            return code;
        }
        err!(
            "fibertrace: process {} ended while it was read (killed, or it exited): the dump \
             is incomplete",
            d.process.pid
        );
        ExitCode::from(1)
    };
    match out.write_all(&text).and_then(|()| out.flush()) {
        Ok(()) => ended(ExitCode::SUCCESS),
        // A closed pipe (`| head`) ends it quietly.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ended(ExitCode::SUCCESS),
        Err(e) => {
            err!("fibertrace: cannot write the dump: {e}");
            ExitCode::from(1)
        }
    }
}

/// At exit (the script's end, an error, `os.exit`; not an exit signal's `_exit`): answers of
/// `--http` under way are written first, for at most 2 s (a client that asked as the script
/// ended got its connection closed and no answer).
extern "C" fn http_at_exit() {
    fibertrace_fiber::http::finish_answers(Duration::from_secs(2));
}

/// Says how many stall reports the rate limit suppressed that no report has counted yet
/// (`fibertrace: N stall reports suppressed`), if any: at every exit of `run` — the end of
/// the script, its error, `os.exit` (C `exit`, through `atexit`), SIGINT and SIGTERM.
fn say_suppressed() {
    let n = fibertrace_fiber::watchdog::take_suppressed();
    if n > 0 {
        let msg = format!("fibertrace: {n} stall reports suppressed\n");
        // SAFETY: write(2) of a local buffer to standard error; no lock is taken (this runs in
        // `atexit` and on the signal exit path, where a stream lock may be held forever).
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
}

extern "C" fn say_suppressed_at_exit() {
    // A stall or blocked report found before the exit is delivered before it (the first
    // report of a large binary symbolizes its frames cold, which may take longer than the
    // program has left): waited for, at most 5 s. None is begun from now on. So is a dump
    // the dump signal asked for (it was cut mid-line, or never written).
    fibertrace_fiber::dump::finish_signal_dumps(Duration::from_secs(5));
    fibertrace_fiber::watchdog::finish(Duration::from_secs(5));
    say_suppressed();
}

/// Set when standard output's reader went away and the program's end by SIGPIPE began on
/// the exit signals' path (see [`on_sigpipe`]).
static STDOUT_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set once an exit path has begun its dumps or its `--leaks` report (the script's end,
/// `os.exit`, an exit signal): a SIGPIPE from then on (its last flush) ends the program at
/// once, as it did before the dumps existed.
static EXIT_BEGUN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// SIGPIPE in `run`: a write to a pipe nobody reads. When standard output is that pipe (the
/// script prints into `| head`), the program ends by SIGPIPE as `lua` does — what was
/// written stays written — instead of printing into nothing forever (Rust ignores SIGPIPE,
/// and Lua's `print` drops write errors). With `--dump-on-exit` dumps or a `--leaks` report
/// to write, it ends as on an exit signal, the dumps and the report first, then by SIGPIPE
/// (they were lost). Any other pipe (standard error gone, a pipe the
/// script opened) only fails that write: a report lost, not the program.
extern "C" fn on_sigpipe(_sig: libc::c_int) {
    let mut p = libc::pollfd {
        fd: 1,
        events: 0,
        revents: 0,
    };
    // SAFETY: poll(2), signal(2) and raise(3) are async-signal-safe; errno is put back for
    // the interrupted code. A pipe without a reader polls POLLERR on its write end. SIGPIPE is
    // blocked while this handler runs: the raised one ends the process once it returns.
    unsafe {
        let e = *libc::__errno_location();
        if libc::poll(&mut p, 1, 0) == 1 && p.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            use std::sync::atomic::Ordering::SeqCst;
            // (Lock-free reads: a set `OnceLock`'s list and atomics.)
            let work =
                DUMPS_ON_EXIT.get().is_some_and(|l| !l.is_empty()) || LEAKS_TOP.load(SeqCst) > 0;
            if STDOUT_GONE.load(SeqCst) || EXIT_SIGNALLED.load(SeqCst) != 0 {
                // An exit signal's thread (this one's, or another signal's) is writing the
                // dumps and ends the program after them: the script's writes meanwhile
                // just fail.
            } else if !work || EXIT_BEGUN.load(SeqCst) {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            } else if !STDOUT_GONE.swap(true, SeqCst) {
                on_exit_signal(libc::SIGPIPE);
            }
        }
        *libc::__errno_location() = e;
    }
}

unsafe extern "C" {
    /// The C library's standard output stream (Lua's `print` and `io.write` write to it).
    #[link_name = "stdout"]
    static C_STDOUT: *mut libc::FILE;
}

/// At exit (after the other exit handlers, the `--leaks` report's included): what the
/// script printed is flushed here, and a failed write of it — now, or earlier (Lua's `print`
/// drops write errors: a full disk) — is said on stderr, and the program ends with 1 (or
/// with the failure status the script chose, `os.exit(5)`). The program used to end
/// silently with the script's status, its output lost. (A reader gone
/// ends the program by SIGPIPE first, quietly: `on_sigpipe`.)
fn register_stdout_at_exit() {
    #[cfg(target_env = "gnu")]
    {
        unsafe extern "C" {
            /// glibc's `on_exit(3)`: an exit handler that is given the exit status.
            fn on_exit(
                f: extern "C" fn(libc::c_int, *mut libc::c_void),
                arg: *mut libc::c_void,
            ) -> libc::c_int;
        }
        extern "C" fn with_status(status: libc::c_int, _: *mut libc::c_void) {
            stdout_at_exit(status);
        }
        // SAFETY: registers a function that runs at exit, once; its argument is unused.
        unsafe { on_exit(with_status, std::ptr::null_mut()) };
    }
    #[cfg(not(target_env = "gnu"))]
    {
        extern "C" fn without_status() {
            stdout_at_exit(0);
        }
        // SAFETY: registers a function that runs at exit, once.
        unsafe { libc::atexit(without_status) };
    }
}

/// See [`register_stdout_at_exit`]; `status` is the status the program exits with (0 where
/// the C library does not say it): a failure the script chose (`os.exit(5)`) is kept, a
/// success becomes 1.
fn stdout_at_exit(status: libc::c_int) {
    // An exit signal's thread (or a closed standard output's) ends the process: not raced.
    defer_to_exit_signal();
    let rust = io::stdout().flush().err();
    // SAFETY: `stdout` is the C library's standard output stream, open for the life of the
    // process (nothing here closes it); fflush and ferror on it are plain calls.
    let (flushed, failed) = unsafe {
        let f = libc::fflush(C_STDOUT);
        let e = io::Error::last_os_error();
        (
            if f != 0 { Some(e) } else { None },
            libc::ferror(C_STDOUT) != 0,
        )
    };
    // (The flush found the reader gone and began that end: `on_sigpipe`.)
    defer_to_exit_signal();
    let earlier = match STDOUT_ERRNO.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        e => Some(io::Error::from_raw_os_error(e)),
    };
    let Some(why) = flushed
        .or(rust)
        .or(earlier)
        .or_else(|| failed.then(|| io::Error::other("a write failed")))
    else {
        return;
    };
    let msg = format!("fibertrace: standard output: {why}: what the script printed is lost\n");
    // SAFETY: write(2) of a local buffer to stderr; the other streams flushed (files the
    // script still had open: `_exit` skips the C library's own flush); then the end of the
    // process (every other exit handler ran).
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::fflush(std::ptr::null_mut());
        libc::_exit(if status & 0xff != 0 { status } else { 1 });
    }
}

/// The write end of the pipe the exit signals' handler writes the signal number to.
static EXIT_PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn on_exit_signal(sig: libc::c_int) {
    let fd = EXIT_PIPE.load(std::sync::atomic::Ordering::Relaxed);
    if fd >= 0 {
        // Said here, not only by the exit thread once it reads the pipe: the script's own
        // exit (`os.exit(0)` right after `raise(SIGTERM)`) then defers to the signal's
        // (`defer_to_exit_signal`), where it raced the exit thread and ended with 0 in most
        // runs. The first signal's code stays (the exit thread reads its byte first).
        let _ = EXIT_SIGNALLED.compare_exchange(
            0,
            128 + sig,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        );
        let b = [sig as u8];
        // SAFETY: write(2) is async-signal-safe; the fd is our (non-blocking) pipe; errno is
        // put back for the interrupted code.
        unsafe {
            let e = *libc::__errno_location();
            libc::write(fd, b.as_ptr().cast(), 1);
            *libc::__errno_location() = e;
        }
    }
}

/// How long the `--dump-on-exit` dumps may take after an exit signal, in seconds
/// (`--dump-on-exit-wait`; see [`install_signals`]).
static EXIT_DUMP_WAIT_S: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(10);

/// `--dump-on-exit-wait`.
fn exit_dump_wait() -> Duration {
    Duration::from_secs(EXIT_DUMP_WAIT_S.load(std::sync::atomic::Ordering::Relaxed))
}

/// Two `--dump-on-exit` targets that are one file (`a` and `./a`, or two links to it), if
/// any: the second dump would silently replace the first. Files are compared by their
/// directory (resolved) and name, or, when both exist, as the same inode.
fn same_file_twice(list: &[(Format, PathBuf)]) -> Option<(&PathBuf, &PathBuf)> {
    use std::os::unix::fs::MetadataExt as _;
    let key = |p: &PathBuf| {
        // A link is followed to the file it names, existing or not (a dump into a link to a
        // file not made yet, beside a dump into that file, went into the same file).
        let p = &links_followed(p);
        let id = std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let named = std::fs::canonicalize(dir)
            .ok()
            .zip(p.file_name())
            .map(|(d, n)| d.join(n));
        (id, named)
    };
    let keys: Vec<_> = list.iter().map(|(_, p)| key(p)).collect();
    for (i, a) in keys.iter().enumerate() {
        for (j, b) in keys.iter().enumerate().skip(i + 1) {
            let same_inode = a.0.is_some() && a.0 == b.0;
            let same_name = a.1.is_some() && a.1 == b.1;
            if same_inode || same_name {
                return Some((&list[i].1, &list[j].1));
            }
        }
    }
    None
}

/// `p` with its last component followed while it is a symbolic link (to the path the link
/// holds, relative to the link's directory), at most 40 times (the kernel's own bound); where
/// a link cannot be read, the path so far.
fn links_followed(p: &std::path::Path) -> PathBuf {
    let mut p = p.to_path_buf();
    for _ in 0..40 {
        let is_link = std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink());
        let Some(to) = is_link.then(|| std::fs::read_link(&p).ok()).flatten() else {
            break;
        };
        p = match p.parent() {
            Some(dir) if to.is_relative() => dir.join(to),
            _ => to,
        };
    }
    p
}

/// One byte read from `fd`, waiting at most `wait` (forever: `None`); `None` when none came
/// in time or the pipe was closed.
fn read_byte(fd: libc::c_int, wait: Option<Duration>) -> Option<u8> {
    let deadline = wait.map(|w| std::time::Instant::now() + w);
    loop {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(std::time::Instant::now());
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as libc::c_int;
            // SAFETY: poll(2) on one pollfd of ours.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n == 0 {
                return None;
            }
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return None;
            }
        }
        let mut b = [0u8; 1];
        // SAFETY: reads one byte from our own pipe into a local buffer.
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) };
        if n == 1 {
            return Some(b[0]);
        }
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

/// The exit signal's dumps took longer than `--dump-on-exit-wait`: says so, naming the
/// dumps not written (the one being written and those after it), straight to the standard
/// error's descriptor (the thread writing a dump may hold the stream's lock), and removes
/// the temporary files a dump being written leaves
/// (`fibertrace_fiber::export::temporary_file`); the process ends next.
fn dumps_given_up() {
    let list = DUMPS_ON_EXIT.get().map_or(&[][..], |l| &l[..]);
    let ended = EXIT_DUMPS_ENDED.load(std::sync::atomic::Ordering::SeqCst);
    let left: Vec<String> = list
        .iter()
        .skip(ended)
        .map(|(f, p)| format!("{}:{}", f.name(), p.display()))
        .collect();
    let msg = format!(
        "fibertrace: --dump-on-exit: not written within {} s of the signal \
         (--dump-on-exit-wait): {}; the program ends without {}\n",
        exit_dump_wait().as_secs(),
        left.join(", "),
        if left.len() == 1 { "it" } else { "them" },
    );
    // (All of them written: the wait ran out on something else, said on its own.)
    if !left.is_empty() {
        // SAFETY: write(2) of a local buffer to the standard error's descriptor.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
    for (_, path) in DUMPS_ON_EXIT.get().into_iter().flatten() {
        let real = std::fs::canonicalize(path).ok();
        for p in [Some(path.clone()), real].into_iter().flatten() {
            if let Some(tmp) = fibertrace_fiber::export::temporary_file(&p) {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}

/// What a start that ran out of file descriptors says after the error: the limit, and what
/// `run` needs (its own pipes and the script, beside the standard streams); nothing for
/// other errors.
fn fd_hint(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EMFILE) => {
            let mut rl = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: a plain query into a local.
            let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
                format!("{}", rl.rlim_cur)
            } else {
                "unknown".into()
            };
            format!(
                ": `fibertrace run` needs {RUN_FDS} file descriptors to start, and the limit \
                 on open files is {limit} (ulimit -n)"
            )
        }
        Some(libc::ENFILE) => ": the system's table of open files is full".into(),
        _ => String::new(),
    }
}

/// File descriptors `run` needs to start with no option: the three standard streams, three
/// pipes (the dump signal's and the exit signals' two) and the script while it is read.
const RUN_FDS: u32 = 10;

/// The signals of `run`, whatever dispositions were inherited: SIGQUIT prints every fiber's
/// trace and the program goes on; SIGINT and SIGTERM flush what the script printed (C stdio
/// buffers included: Lua's `print` and `io.write` use them) and exit with 128 + the signal,
/// and so do SIGHUP, SIGUSR1, SIGUSR2 and SIGALRM when not inherited ignored;
/// SIGPIPE ends the program when standard output has no reader any more ([`on_sigpipe`]).
/// The handlers only write to pipes; threads do the work outside them.
fn install_signals() -> Result<(), String> {
    fibertrace_fiber::dump::install_signal(libc::SIGQUIT).map_err(|e| e.to_string())?;
    // A crash (a fault in native code, an abort) reports itself with that dump.
    fibertrace_fiber::dump::install_crash_report().map_err(|e| e.to_string())?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = io::Error::last_os_error();
        return Err(format!("pipe: {e}{}", fd_hint(&e)));
    }
    let (rd, wr) = (fds[0], fds[1]);
    // The handler must never block on a full pipe (a burst of signals).
    // SAFETY: fcntl on our own fd.
    unsafe {
        let fl = libc::fcntl(wr, libc::F_GETFL);
        libc::fcntl(wr, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    EXIT_PIPE.store(wr, std::sync::atomic::Ordering::Relaxed);
    // Flushing waits for the streams' locks: a thread blocked holding one (a script in
    // io.read(), a write to a full pipe) would hold the exit forever. So the process ends
    // within a second of the signal whatever happens, or, with `--dump-on-exit`, within a
    // second of the dumps being written, which get at most `--dump-on-exit-wait` (a dump of
    // tens of thousands of fibers takes seconds; one can hang, on a network file system):
    // past it the process ends without them, says so, and removes their half-written
    // temporary files. A thread made now (not at the signal, when making one can fail —
    // out of memory) waits for the exit code, then for the dumps, then a second.
    let mut tfds = [0i32; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(tfds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = io::Error::last_os_error();
        return Err(format!("pipe: {e}{}", fd_hint(&e)));
    }
    let (timer_rd, timer_wr) = (tfds[0], tfds[1]);
    std::thread::Builder::new()
        .name("fibertrace-exit-timer".into())
        .spawn(move || {
            let Some(code) = read_byte(timer_rd, None) else {
                return;
            };
            let signalled = std::time::Instant::now();
            let dumps = DUMPS_ON_EXIT.get().is_some_and(|l| !l.is_empty());
            let leaks = LEAKS_TOP.load(std::sync::atomic::Ordering::SeqCst) > 0;
            // (A SIGQUIT sent just before the exit signal may not be handled yet.)
            fibertrace_fiber::dump::settle_dump_signal();
            let quit = fibertrace_fiber::dump::signal_dumps_pending();
            if (dumps || leaks || quit) && read_byte(timer_rd, Some(exit_dump_wait())).is_none() {
                if quit && fibertrace_fiber::dump::signal_dumps_pending() {
                    said_given_up("the SIGQUIT dump was not written");
                }
                if dumps {
                    dumps_given_up();
                }
                if leaks {
                    leaks_given_up();
                }
            } else if dumps || leaks || quit {
                // A second from the dumps' end.
                std::thread::sleep(std::time::Duration::from_secs(1));
            } else {
                // A second from the signal (the wait for a SIGQUIT in flight included: it
                // ended a script blocked in `io.read` after 1.1 s).
                std::thread::sleep(
                    std::time::Duration::from_millis(990).saturating_sub(signalled.elapsed()),
                );
            }
            if STDOUT_GONE.load(std::sync::atomic::Ordering::SeqCst) {
                // SAFETY: signal(2) and raise(3): the default action ends the process by
                // SIGPIPE, as the closed standard output's end does when the dumps are done.
                unsafe {
                    libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                    libc::raise(libc::SIGPIPE);
                }
            }
            // SAFETY: ends the process at once.
            unsafe { libc::_exit(i32::from(code)) };
        })
        .map_err(|e| format!("exit thread: {e}"))?;
    std::thread::Builder::new()
        .name("fibertrace-exit".into())
        .spawn(move || loop {
            let mut b = [0u8; 1];
            // SAFETY: reads one byte from our own pipe into a local buffer.
            let n = unsafe { libc::read(rd, b.as_mut_ptr().cast(), 1) };
            if n == 1 {
                // 128 + the signal (at most SIGTERM, 15): fits a byte.
                let code = 128 + i32::from(b[0]);
                let c = [code as u8];
                EXIT_SIGNALLED.store(code, std::sync::atomic::Ordering::SeqCst);
                // The script stops at its next safe point (it went on printing and writing
                // while the dumps were waited for and written, ~100 ms or more); it still
                // serves the dumps' traces there.
                let tid = SCRIPT_TID.load(std::sync::atomic::Ordering::SeqCst);
                if tid != 0 {
                    // (Fibers whose sleep runs out while held are not blocked ones.)
                    fibertrace_fiber::watchdog::close();
                    let _ = fibertrace_lua::host::halt(tid);
                }
                // SAFETY: writes one byte from a local buffer to our own pipe.
                unsafe { libc::write(timer_wr, c.as_ptr().cast(), 1) };
                say_suppressed();
                // A SIGQUIT dump asked just before is written first (the timer bounds the
                // wait, as the dumps').
                fibertrace_fiber::dump::wait_for_signal_dumps(None);
                // (The signal's code is not 0: it stays, whether the dumps were written.)
                dump_on_exit();
                // `--leaks`: its report, as at any exit (`_exit` below runs no `atexit`
                // handler), taken from this thread while the script's goes on.
                leaks_at_signal();
                // The dumps and the report are done: the timer gives the flush its second.
                // SAFETY: as above.
                unsafe { libc::write(timer_wr, c.as_ptr().cast(), 1) };
                if STDOUT_GONE.load(std::sync::atomic::Ordering::SeqCst) {
                    // Standard output has no reader: what the script left in its buffers
                    // has nowhere to go; the program ends by SIGPIPE, as without dumps.
                    // SAFETY: signal(2) and raise(3); the default action ends the process.
                    unsafe {
                        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                        libc::raise(libc::SIGPIPE);
                        libc::_exit(code);
                    }
                }
                let _ = io::stdout().flush();
                // SAFETY: fflush(NULL) flushes every C output stream; the thread holds no
                // stream lock itself.
                unsafe { libc::fflush(std::ptr::null_mut()) };
                // SAFETY: ends the process at once, without running Lua or Rust destructors
                // (fibers may be suspended with Lua frames on their stacks).
                unsafe { libc::_exit(code) };
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        })
        .map_err(|e| format!("exit thread: {e}"))?;
    for (sig, handler) in [
        (libc::SIGINT, on_exit_signal as extern "C" fn(libc::c_int)),
        (libc::SIGTERM, on_exit_signal),
        (libc::SIGPIPE, on_sigpipe),
    ] {
        // An interrupt or termination the parent ignored (`trap '' INT`, a background job
        // of a shell script) stays ignored, as the shells and Go's runtime keep it: it was
        // overridden, and the program ended on a signal its parent had asked to be spared.
        // (SIGPIPE's inherited disposition is not known here: Rust's runtime ignores it
        // before `main`.)
        if sig != libc::SIGPIPE && inherited_ignored(sig)? {
            continue;
        }
        // SAFETY: installs a handler that only calls async-signal-safe functions.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(format!("sigaction: {}", io::Error::last_os_error()));
            }
        }
    }
    // The other signals whose default is to end the process (a closed terminal or ssh
    // session's SIGHUP, SIGUSR1, SIGUSR2, SIGALRM) end it the same way, flushed, with 128 +
    // the signal — unless inherited ignored (`nohup`), which is kept, as for SIGINT and
    // SIGTERM above.
    for sig in [libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2, libc::SIGALRM] {
        if inherited_ignored(sig)? {
            continue;
        }
        // SAFETY: installs a handler that only calls async-signal-safe functions.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_exit_signal as extern "C" fn(libc::c_int) as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(format!("sigaction: {}", io::Error::last_os_error()));
            }
        }
    }
    Ok(())
}

/// Whether signal `sig` is ignored now (as the parent left it, before this program set it).
fn inherited_ignored(sig: libc::c_int) -> Result<bool, String> {
    // SAFETY: reads the signal's disposition into a local.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
            return Err(format!("sigaction: {}", io::Error::last_os_error()));
        }
        Ok(old.sa_sigaction == libc::SIG_IGN)
    }
}

/// The longest script `run` reads (256 MiB): an endless one (`run /dev/zero`, `yes | run -`)
/// is an error once past it, not a read until memory runs out.
const MAX_SCRIPT: u64 = 256 << 20;

/// Reads a whole script of at most [`MAX_SCRIPT`] bytes.
fn read_script(r: impl io::Read) -> io::Result<Vec<u8>> {
    let mut b = Vec::new();
    io::Read::read_to_end(&mut r.take(MAX_SCRIPT + 1), &mut b)?;
    if b.len() as u64 > MAX_SCRIPT {
        return Err(io::Error::other(format!(
            "script longer than {MAX_SCRIPT} bytes"
        )));
    }
    Ok(b)
}

/// Whether a script is a precompiled chunk, as the VM's loader would take it: its first byte
/// (after a first line starting with `#`, which the loader skips) is the bytecode signature's
/// (ESC, under LuaJIT and Lua 5.4 alike).
fn is_bytecode(src: &[u8]) -> bool {
    let body = match src.first() {
        Some(b'#') => match src.iter().position(|&b| b == b'\n' || b == b'\r') {
            // (A "\r\n" or "\n\r" pair is one line end.)
            Some(i) => match src.get(i + 1) {
                Some(&c) if (c == b'\n' || c == b'\r') && c != src[i] => &src[i + 2..],
                _ => &src[i + 1..],
            },
            None => &[],
        },
        _ => src,
    };
    body.first() == Some(&0x1b)
}

/// The stacks `--leaks` lists at exit (0: no report).
static LEAKS_TOP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What was live when the script started (the runtime's set-up, the Lua state's own): not
/// the script's leaks, left out of the `--leaks` report.
static LEAKS_BASE: std::sync::OnceLock<fibertrace_lua::HeapBaseline> = std::sync::OnceLock::new();

/// `--leaks`: the live heap at exit, on stderr (an `atexit` handler: every way out passes
/// there). Off a fiber's stack (the symbolizer wants more than a fiber has).
extern "C" fn leaks_at_exit() {
    EXIT_BEGUN.store(true, std::sync::atomic::Ordering::SeqCst);
    let top = LEAKS_TOP.swap(0, std::sync::atomic::Ordering::SeqCst);
    if top == 0 {
        // Taken by the exit signal's thread, which writes it and ends the process: this
        // exit (the script's end, `os.exit`) waits for that instead of ending it first.
        if LEAKS_ON_SIGNAL.load(std::sync::atomic::Ordering::SeqCst) {
            defer_to_exit_signal();
        }
        return;
    }
    // (The report's own allocations, the thread it may run on included, are not tracked:
    // made by a fiber that called `os.exit`, they were listed as that fiber's.)
    fibertrace_core::heap::untracked(|| report_leaks(top));
}

/// The `--leaks` report was not written within `--dump-on-exit-wait` of an exit signal:
/// said on stderr (the program ends without it).
fn leaks_given_up() {
    said_given_up("--leaks: the report was not written");
}

/// Says on stderr that `what` (was not written) within `--dump-on-exit-wait` of an exit
/// signal, and that the program ends without the rest.
fn said_given_up(what: &str) {
    let msg = format!(
        "\nfibertrace: {what} within {} s of the signal (--dump-on-exit-wait); the program \
         ends without the rest\n",
        exit_dump_wait().as_secs()
    );
    // SAFETY: write(2) of a local buffer to the standard error's descriptor.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Whether the exit signal's thread took the `--leaks` report (see [`leaks_at_signal`]).
static LEAKS_ON_SIGNAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The `--leaks` report from the exit signal's thread (`_exit` after it runs no `atexit`
/// handler), if no other exit path took it first.
fn leaks_at_signal() {
    // (Said before the report is taken: an exit path that finds it taken then waits.)
    LEAKS_ON_SIGNAL.store(true, std::sync::atomic::Ordering::SeqCst);
    let top = LEAKS_TOP.swap(0, std::sync::atomic::Ordering::SeqCst);
    if top == 0 {
        return;
    }
    fibertrace_core::heap::untracked(|| report_leaks(top));
}

/// The body of [`leaks_at_exit`].
fn report_leaks(top: usize) {
    // What the script wrote through C's streams (`print`, `io.write`) first, as it came
    // before (`exit` flushes them only after this handler). Not after an exit signal: a
    // flush waits for the streams' locks, which a script blocked in `io.read()` holds (the
    // signal's thread flushes later, under its timer).
    // Nor into a standard output without a reader: that flush would end the program by
    // SIGPIPE before the report (the exit's own flush ends it after).
    if EXIT_SIGNALLED.load(std::sync::atomic::Ordering::SeqCst) == 0 && !stdout_reader_gone() {
        let _ = io::stdout().flush();
        // SAFETY: `fflush(NULL)` flushes every open output stream; no stream is closed here.
        unsafe { libc::fflush(std::ptr::null_mut()) };
    }
    let report = || {
        fibertrace_core::heap::untracked(|| fibertrace_lua::heap_text_since(top, LEAKS_BASE.get()))
    };
    // (On a thread of its own when on a fiber, whose stack is small; not at the memory limit,
    // where starting a thread can abort the process: `heap::room_for_thread`.)
    let text = if fibertrace_fiber::current().is_some()
        && fibertrace_core::heap::room_for_thread(8 << 20)
    {
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .stack_size(8 << 20)
                .spawn_scoped(s, report)
                .ok()
                .and_then(|h| h.join().ok())
        })
        .unwrap_or_else(report)
    } else {
        report()
    };
    let collected = if fibertrace_lua::LuaHost::kept_released() {
        ""
    } else if fibertrace_lua::LuaHost::release_collect_failed() {
        "(the Lua heap was not collected first: the collection ran out of memory (it \
         allocates too), so garbage not yet collected is listed too)\n"
    } else if fibertrace_lua::LuaHost::release_in_finalizer() {
        "(the Lua heap was not collected first: os.exit was called inside a __gc finalizer, \
         where no collection can run, so garbage not yet collected is listed too)\n"
    } else {
        "(the Lua heap was not collected first: the run ended neither at the script's end \
         nor through os.exit (a signal, or an exit from native code), so garbage not yet \
         collected is listed too)\n"
    };
    let _ = write!(
        io::stderr(),
        "fibertrace: --leaks: live at exit:\n{collected}{text}"
    );
}

/// The heap tier `--heap`/`--leaks` ask for, and, when the process does not run it yet, the
/// program run again with `FIBERTRACE_HEAP` set (the tracker's tier is fixed when the
/// process starts). Returns only when the tier runs (or none was asked for); an error
/// otherwise.
fn heap_tier(m: &clap::ArgMatches) -> Result<(), String> {
    use fibertrace_core::heap::{self, Tier};
    // The tracker reads the variable before anything can be said (at the first allocation)
    // and takes what it does not know for unset: said here instead of silently ignored.
    if let Some(v) = std::env::var_os("FIBERTRACE_HEAP") {
        if !["every", "sampled", "off", "", "0"].iter().any(|k| v == *k) {
            return Err(format!(
                "FIBERTRACE_HEAP={}: not a heap tier (every, sampled or off)",
                v.to_string_lossy()
            ));
        }
    }
    let asked = m.get_one::<String>("heap").map(String::as_str);
    let want = match (asked, m.get_flag("leaks")) {
        (Some("every"), _) | (None, true) => Some(("every", Tier::Every)),
        (Some(_), _) => Some(("sampled", Tier::Sampled)),
        (None, false) => None,
    };
    // LuaJIT's C keeps no frame pointers inside this binary, which does: DWARF where they
    // are missing.
    heap::configure(heap::Config {
        sample_interval: m
            .get_one::<u64>("heap-interval")
            .copied()
            .unwrap_or(heap::config().sample_interval),
        precise: true,
        ..heap::config()
    });
    let Some((name, tier)) = want else {
        return Ok(());
    };
    if heap::tier() == tier {
        return Ok(());
    }
    if std::env::var_os("FIBERTRACE_HEAP").is_some_and(|v| v == name) {
        return Err(format!(
            "--heap={name}: the heap tracker does not run in this build (its tier is {:?})",
            heap::tier()
        ));
    }
    let exe =
        std::env::current_exe().map_err(|e| format!("--heap: cannot find this program: {e}"))?;
    use std::os::unix::process::CommandExt as _;
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("FIBERTRACE_HEAP", name)
        .exec();
    Err(format!("--heap: cannot run this program again: {e}"))
}

/// `--heap-interval` where nothing is sampled: a usage error (the interval would be
/// silently unused), or `None`.
fn interval_unused(m: &clap::ArgMatches) -> Option<&'static str> {
    m.get_one::<u64>("heap-interval")?;
    match (
        m.get_one::<String>("heap").map(String::as_str),
        m.get_flag("leaks"),
    ) {
        (Some("every"), _) | (None, true) => Some(
            "--heap=every (and --leaks without --heap=sampled) records every allocation: \
             there is no interval to set",
        ),
        (Some(_), _) => None,
        (None, false) if std::env::var_os("FIBERTRACE_HEAP").is_some_and(|v| v == "sampled") => {
            None
        }
        (None, false) => Some("the heap is not tracked: add --heap (sampled)"),
    }
}

fn run(m: &clap::ArgMatches) -> ExitCode {
    if m.value_source("leaks-top") == Some(clap::parser::ValueSource::CommandLine)
        && !m.get_flag("leaks")
    {
        err!(
            "error: --leaks-top sets how many stacks the --leaks report lists, and --leaks is \
             not given\n\n\
             For more information, try '--help'."
        );
        return ExitCode::from(2);
    }
    if let Some(why) = interval_unused(m) {
        err!(
            "error: --heap-interval sets the sampling of --heap=sampled, and {why}\n\n\
             For more information, try '--help'."
        );
        return ExitCode::from(2);
    }
    if let Err(e) = heap_tier(m) {
        err!("fibertrace: {e}");
        return ExitCode::from(1);
    }
    // (Registered first: it runs after every other exit handler.)
    register_stdout_at_exit();
    if m.get_flag("leaks") {
        let top = m.get_one::<u64>("leaks-top").copied().unwrap_or(20) as usize;
        LEAKS_TOP.store(top, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: registers a function that runs at exit, once.
        unsafe { libc::atexit(leaks_at_exit) };
    }
    fibertrace_fiber::glue::set_native_detail(m.get_flag("native-detail"));
    fibertrace_fiber::dump::set_view(match m.get_one::<String>("dump-view").map(String::as_str) {
        Some("grouped") => fibertrace_fiber::dump::View::Grouped,
        _ => fibertrace_fiber::dump::View::Full,
    });
    let stall = m.get_one::<u64>("stall-ms").copied();
    let blocked = m.get_one::<u64>("blocked-ms").copied();
    if stall.is_some() || blocked.is_some() {
        fibertrace_fiber::watchdog::start(fibertrace_fiber::watchdog::Config {
            // Without --stall-ms, no stall is reported.
            threshold: stall.map_or(Duration::MAX, Duration::from_millis),
            blocked_longer_than: blocked.map(Duration::from_millis),
            ..Default::default()
        });
    }
    let mut all = m
        .get_many::<std::ffi::OsString>("script")
        .map(|v| v.cloned().collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter();
    let script = all.next().unwrap_or_default();
    // The script takes every word from itself on, options too (`run s.lua -h` passes `-h`
    // to it), so an option `run` does not know comes here as the script: said as such, not
    // as a missing file (a script whose name starts with `-` is run when it exists).
    let name = script.as_encoded_bytes();
    if name.len() > 1 && name[0] == b'-' && std::fs::symlink_metadata(&script).is_err() {
        err!(
            "error: unexpected argument '{}' (not an option of `fibertrace run`; a script whose \
             name begins with '-' is given as ./NAME)\n\nUsage: fibertrace run [OPTIONS] \
             <SCRIPT.lua [ARGS]...>\n\nFor more information, try '--help'.",
            fibertrace_core::format::Escaped(&script.to_string_lossy())
        );
        return ExitCode::from(2);
    }
    if name.is_empty() {
        err!("fibertrace: the script's name is empty (a file, or - for standard input)");
        return ExitCode::from(1);
    }
    // `--heap every s.lua`: the tier was taken as the script (it goes after '=').
    if matches!(name, b"every" | b"sampled")
        && m.contains_id("heap")
        && std::fs::symlink_metadata(&script).is_err()
    {
        let t = script.to_string_lossy();
        err!(
            "fibertrace: {t}: No such file or directory (os error 2): `--heap {t}` takes {t} as \
             the script; the tier goes after '=': --heap={t}"
        );
        return ExitCode::from(1);
    }
    let args: Vec<Vec<u8>> = all.map(|a| a.into_encoded_bytes()).collect();
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_slice()).collect();
    if let Err(e) = install_signals() {
        err!("fibertrace: {e}");
        return ExitCode::from(1);
    }
    // SAFETY: registers a function that only takes a count and writes it with write(2).
    unsafe { libc::atexit(say_suppressed_at_exit) };
    if let Some(v) = m.get_many::<(Format, PathBuf)>("dump-on-exit") {
        let list: Vec<(Format, PathBuf)> = v.cloned().collect();
        if let Some((a, b)) = same_file_twice(&list) {
            err!(
                "error: --dump-on-exit: {} and {} are the same file (the second dump would \
                 replace the first)\n\nFor more information, try '--help'.",
                a.display(),
                b.display()
            );
            return ExitCode::from(2);
        }
        // What else the writes at exit would meet, found now: a link to nothing, a loop of
        // links, a name too long, a directory or a file that cannot be written. (After the
        // check above: a link to a file another dump makes first is one file twice.)
        for (_, file) in &list {
            if let Err(e) = fibertrace_fiber::export::check_writable(file) {
                err!("error: --dump-on-exit: {e}\n\nFor more information, try '--help'.");
                return ExitCode::from(2);
            }
        }
        let _ = DUMPS_ON_EXIT.set(list);
    }
    if let Some(&w) = m.get_one::<u64>("dump-on-exit-wait") {
        EXIT_DUMP_WAIT_S.store(w, std::sync::atomic::Ordering::Relaxed);
    }
    // The server lives as long as the process (never dropped: `exit` ends its thread).
    if let Some(addr) = m.get_one::<String>("http") {
        match fibertrace_fiber::http::serve(addr) {
            Ok(server) => {
                err!(
                    "fibertrace: serving http://{}/debug/fibers",
                    server.local_addr()
                );
                std::mem::forget(server);
                // SAFETY: registers a function that runs at exit, once.
                unsafe { libc::atexit(http_at_exit) };
            }
            Err(e) => {
                err!("fibertrace: --http: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let script_bytes = script.as_encoded_bytes();
    let (shown, read): (&[u8], _) = if script == "-" {
        (b"<stdin>", read_script(io::stdin().lock()))
    } else {
        (
            script_bytes,
            std::fs::File::open(&script).and_then(read_script),
        )
    };
    let source = match read {
        Ok(b) => b,
        Err(e) => {
            // The name as its bytes, as the shell passed it.
            let mut m = b"fibertrace: ".to_vec();
            m.extend_from_slice(shown);
            m.extend_from_slice(format!(": {e}{}\n", fd_hint(&e)).as_bytes());
            let _ = io::stderr().write_all(&m);
            return ExitCode::from(1);
        }
    };
    if is_bytecode(&source) {
        let mut m = b"fibertrace: ".to_vec();
        m.extend_from_slice(shown);
        m.extend_from_slice(
            b": a precompiled (bytecode) chunk: not run (the VM's bytecode loader trusts its \
              input: a damaged or crafted file can crash the process); run the script's source\n",
        );
        let _ = io::stderr().write_all(&m);
        return ExitCode::from(1);
    }
    // A first line starting with `#` (`#!/usr/bin/env fibertrace run`) is skipped, as `lua`
    // skips it in a file (LuaJIT's loader does so itself, Lua 5.4's only for files): its
    // line end stays, so line numbers are the file's.
    let mut source = source;
    if source.first() == Some(&b'#') {
        let end = source
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
            .unwrap_or(source.len());
        source.drain(..end);
    }
    // With the heap tracked, the Lua state allocates through the process's allocator, so
    // Lua's own allocations are counted too (see `new_with_own_allocator`).
    // SAFETY: nothing in this program clones the host's `mlua::Lua`; it is used only through
    // the host, which outlives every use.
    let made = unsafe { LuaHost::new_with_own_allocator() };
    let host = match made {
        Ok(h) => h,
        Err(e) => {
            err!("fibertrace: {e}");
            return ExitCode::from(1);
        }
    };
    // SAFETY: gettid has no preconditions.
    SCRIPT_TID.store(
        unsafe { libc::gettid() },
        std::sync::atomic::Ordering::SeqCst,
    );
    // (`args_os`: an interpreter path that is not UTF-8 is kept, not a panic.)
    let interpreter = std::env::args_os()
        .next()
        .unwrap_or_else(|| "fibertrace".into());
    host.set_arg(interpreter.as_encoded_bytes(), script_bytes, &args);
    if LEAKS_TOP.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if let Err(e) = release_before_exit(&host) {
            err!("fibertrace: --leaks: {e}");
            return ExitCode::from(1);
        }
        let base = fibertrace_core::heap::untracked(fibertrace_lua::heap_baseline);
        let _ = LEAKS_BASE.set(base);
    }
    if let Some(list) = DUMPS_ON_EXIT.get() {
        if let Err(e) = wrap_os_exit(host.lua(), list) {
            err!("fibertrace: --dump-on-exit: {e}");
            return ExitCode::from(1);
        }
    }
    let chunk = if script == "-" {
        b"=stdin".to_vec()
    } else {
        [b"@", script_bytes].concat()
    };
    let code = match host.run_main(&chunk, &source, &args) {
        Ok(()) => 0,
        Err(e) => {
            // After what the script printed before it (a file or a pipe shared with stderr,
            // `> out 2>&1`, had the error first: stdout is buffered there).
            flush_script_output();
            // The message as its bytes (a script's error need not be UTF-8).
            let mut b = e.to_bytes();
            b.push(b'\n');
            let _ = io::stderr().write_all(&b);
            1
        }
    };
    if LEAKS_TOP.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        host.release_kept();
    }
    flush_script_output();
    let code = exit_code(code, dump_on_exit());
    // An exit signal's thread ends the process (its dumps, its report): not raced.
    defer_to_exit_signal();
    let _ = io::stdout().flush();
    // `exit` flushes C stdio (Lua's print and io.write); the host is not dropped: fibers
    // still suspended keep their Lua frames and are never unwound.
    std::mem::forget(host);
    std::process::exit(code)
}

/// Standard output could not be written. A reader that went away (a closed pipe: `| head`)
/// ends the program quietly, keeping what was written (exit 0, or 1 if a line had failed
/// before); any other failure (a full disk) is an error.
fn output_failed(e: &io::Error, failed: bool) -> ExitCode {
    if e.kind() == io::ErrorKind::BrokenPipe {
        return if failed {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        };
    }
    err!("fibertrace: standard output: {e}");
    ExitCode::from(1)
}

fn decode(m: &clap::ArgMatches) -> ExitCode {
    use fibertrace_core::format::Escaped;
    // File names as the shell passed them (not necessarily UTF-8).
    let files: Vec<std::ffi::OsString> = m
        .get_many::<std::ffi::OsString>("files")
        .map(|v| v.cloned().collect())
        .unwrap_or_default();
    let files = if files.is_empty() {
        vec!["-".into()]
    } else {
        files
    };
    let exes: Vec<std::ffi::OsString> = m
        .get_many::<std::ffi::OsString>("exe")
        .map(|v| v.cloned().collect())
        .unwrap_or_default();
    let mut sym = if exes.is_empty() {
        None
    } else {
        match Symbolizer::new(&exes) {
            Ok(s) => Some(s),
            Err(e) => {
                err!("fibertrace: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let mut dec = LineDecoder::new(m.get_flag("cbf"));
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut failed = false;
    for name in &files {
        let reader: Box<dyn io::Read> = if name == "-" {
            Box::new(io::stdin())
        } else {
            match std::fs::File::open(name) {
                Ok(f) => Box::new(f),
                Err(e) => {
                    err!("fibertrace: {}: {e}", Escaped(&name.to_string_lossy()));
                    failed = true;
                    continue;
                }
            }
        };
        let shown = if name == "-" {
            "<stdin>".into()
        } else {
            Escaped(&name.to_string_lossy()).to_string()
        };
        let mut reader = LineReader::new(BufReader::new(reader));
        let mut buf = Vec::new();
        let mut n = 0u64;
        loop {
            // Before a read that may wait (nothing read ahead is left: `tail -f log |
            // fibertrace decode`), what was decoded goes out, not when 8 KiB have piled up
            // (or never, for a program killed meanwhile).
            if reader.r.buffer().is_empty() {
                if let Err(e) = out.flush() {
                    return output_failed(&e, failed);
                }
            }
            let line = match reader.read_line(&mut buf) {
                Ok(Some(Line::Text(l))) => l,
                Ok(Some(Line::TooLong)) => {
                    n += 1;
                    // What was decoded before goes out before the error.
                    if let Err(e) = out.flush() {
                        return output_failed(&e, true);
                    }
                    err!(
                        "fibertrace: {shown}:{n}: line longer than {MAX_LINE} bytes: skipped to its end"
                    );
                    failed = true;
                    continue;
                }
                Ok(None) => break,
                Err(e) => {
                    err!("fibertrace: {shown}: read error: {e}");
                    failed = true;
                    break;
                }
            };
            n += 1;
            // Logs may hold bytes that are not UTF-8 around the tokens.
            let text = String::from_utf8_lossy(&line);
            let mut write_error: Option<io::Error> = None;
            let mut errors = 0usize;
            dec.decode_line_each(text.trim_end_matches('\r'), |r, table| {
                if write_error.is_some() {
                    return;
                }
                match r {
                    Ok(d) => {
                        let mut lines: Vec<String> = d.line().into_iter().collect();
                        if let Some(s) = sym.as_mut() {
                            lines.extend(s.lines(&d.frames(), table));
                        }
                        for l in lines {
                            if let Err(e) = writeln!(out, "{l}") {
                                write_error = Some(e);
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        failed = true;
                        errors += 1;
                        if errors > MAX_LINE_ERRORS {
                            return;
                        }
                        // What was decoded before goes out before the error about this line.
                        if let Err(e) = out.flush() {
                            write_error = Some(e);
                            return;
                        }
                        // (The token is the log's text: written with its control
                        // characters escaped, as a terminal would take them as commands.)
                        err!("fibertrace: {shown}:{n}: {}", Escaped(&e));
                    }
                }
            });
            if let Some(e) = write_error {
                return output_failed(&e, failed);
            }
            if errors > MAX_LINE_ERRORS {
                err!(
                    "fibertrace: {shown}:{n}: {} more errors on this line not shown",
                    errors - MAX_LINE_ERRORS
                );
            }
            drop(text);
            buf = line;
        }
    }
    if let Err(e) = out.flush() {
        return output_failed(&e, failed);
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
