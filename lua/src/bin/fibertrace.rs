//! The `fibertrace` command-line program: `run` (a Lua host whose fibers are traced) and
//! `decode` (backtrace tokens in logs).

use clap::{Arg, ArgAction, Command};
use fibertrace_lua::decode::LineDecoder;
use fibertrace_lua::symbols::Symbolizer;
use fibertrace_lua::LuaHost;
use std::io::{self, BufRead, BufReader, Write};
use std::process::ExitCode;

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
                     main chunk returns (or on os.exit(n)); on an error prints it with an \
                     interleaved native + Lua traceback and exits with 1",
                )
                .arg(
                    Arg::new("stall-ms")
                        .long("stall-ms")
                        .value_name("N")
                        .value_parser(clap::value_parser!(u64).range(1..))
                        .help(
                            "Report a fiber that runs more than N ms without yielding \
                             (its stack, sampled by a signal; again at 2N, 4N, ...)",
                        ),
                )
                .arg(
                    Arg::new("script")
                        .value_name("SCRIPT.lua")
                        .required(true)
                        .help("The script (`-` for standard input)"),
                )
                .arg(
                    Arg::new("args")
                        .value_name("ARGS")
                        .num_args(0..)
                        .trailing_var_arg(true)
                        .allow_hyphen_values(true)
                        .help("Arguments for the script (arg[1], arg[2], ... and `...`)"),
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
                        .help(
                            "Symbolize each frame like `addr2line -a -f -p -i` with this ELF \
                             file or build-id directory (repeatable)",
                        ),
                )
                .arg(
                    Arg::new("files")
                        .value_name("FILE")
                        .num_args(0..)
                        .help("Input files (standard input when none; `-` for standard input)"),
                ),
        )
}

fn main() -> ExitCode {
    let m = cli().get_matches();
    match m.subcommand() {
        Some(("run", m)) => run(m),
        Some(("decode", m)) => decode(m),
        _ => ExitCode::from(2),
    }
}

fn run(m: &clap::ArgMatches) -> ExitCode {
    if let Some(&ms) = m.get_one::<u64>("stall-ms") {
        fibertrace_fiber::watchdog::start(fibertrace_fiber::watchdog::Config {
            threshold: std::time::Duration::from_millis(ms),
            ..Default::default()
        });
    }
    let script = m.get_one::<String>("script").cloned().unwrap_or_default();
    let args: Vec<String> = m
        .get_many::<String>("args")
        .map(|v| v.cloned().collect())
        .unwrap_or_default();
    let source = if script == "-" {
        let mut b = Vec::new();
        if let Err(e) = io::Read::read_to_end(&mut io::stdin(), &mut b) {
            eprintln!("fibertrace: <stdin>: {e}");
            return ExitCode::from(1);
        }
        b
    } else {
        match std::fs::read(&script) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("fibertrace: {script}: {e}");
                return ExitCode::from(1);
            }
        }
    };
    // SAFETY: nothing in this program clones the host's `mlua::Lua`; it is used only through
    // the host, which outlives every use.
    let host = match unsafe { LuaHost::new_with_own_allocator() } {
        Ok(h) => h,
        Err(e) => {
            eprintln!("fibertrace: {e}");
            return ExitCode::from(1);
        }
    };
    let interpreter = std::env::args()
        .next()
        .unwrap_or_else(|| "fibertrace".into());
    host.set_arg(&interpreter, &script, &args);
    let chunk = if script == "-" {
        "=stdin".to_string()
    } else {
        format!("@{script}")
    };
    let code = match host.run_main(&chunk, &source, &args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    };
    let _ = io::stdout().flush();
    // `exit` flushes C stdio (Lua's print and io.write); the host is not dropped: fibers
    // still suspended keep their Lua frames and are never unwound.
    std::mem::forget(host);
    std::process::exit(code)
}

fn decode(m: &clap::ArgMatches) -> ExitCode {
    let files: Vec<String> = m
        .get_many::<String>("files")
        .map(|v| v.cloned().collect())
        .unwrap_or_default();
    let files = if files.is_empty() {
        vec!["-".to_string()]
    } else {
        files
    };
    let exes: Vec<String> = m
        .get_many::<String>("exe")
        .map(|v| v.cloned().collect())
        .unwrap_or_default();
    let mut sym = if exes.is_empty() {
        None
    } else {
        match Symbolizer::new(&exes) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("fibertrace: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let mut dec = LineDecoder::new(m.get_flag("cbf"));
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut failed = false;
    for name in &files {
        let reader: Box<dyn BufRead> = if name == "-" {
            Box::new(BufReader::new(io::stdin()))
        } else {
            match std::fs::File::open(name) {
                Ok(f) => Box::new(BufReader::new(f)),
                Err(e) => {
                    eprintln!("fibertrace: {name}: {e}");
                    failed = true;
                    continue;
                }
            }
        };
        let shown = if name == "-" { "<stdin>" } else { name };
        for (n, line) in reader.split(b'\n').enumerate() {
            let line = match line {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("fibertrace: {shown}: read error: {e}");
                    failed = true;
                    break;
                }
            };
            // Logs may hold bytes that are not UTF-8 around the tokens.
            let line = String::from_utf8_lossy(&line);
            for r in dec.decode_line(line.trim_end_matches('\r')) {
                match r {
                    Ok(d) => {
                        let mut lines: Vec<String> = d.line().into_iter().collect();
                        if let Some(s) = sym.as_mut() {
                            lines.extend(s.lines(&d.frames(), dec.table()));
                        }
                        for l in lines {
                            if writeln!(out, "{l}").is_err() {
                                return ExitCode::from(1);
                            }
                        }
                    }
                    Err(e) => {
                        let _ = out.flush();
                        eprintln!("fibertrace: {shown}:{}: {e}", n + 1);
                        failed = true;
                    }
                }
            }
        }
    }
    if out.flush().is_err() {
        return ExitCode::from(1);
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
