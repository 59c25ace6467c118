//! The `fibertrace` command-line program.

use clap::{Arg, ArgAction, Command};
use fibertrace_lua::decode::LineDecoder;
use fibertrace_lua::symbols::Symbolizer;
use std::io::{self, BufRead, BufReader, Write};
use std::process::ExitCode;

fn cli() -> Command {
    Command::new("fibertrace")
        .about("Tools for fibertrace backtraces")
        .subcommand_required(true)
        .arg_required_else_help(true)
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
    let Some(("decode", m)) = m.subcommand() else {
        return ExitCode::from(2);
    };
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
