//! Folded stacks and the flame graph drawn from them.
//!
//! One line per distinct stack, root first, with the number of fibers that have it:
//!
//! ```text
//! lua;fiber:worker;lua_fiber_main;call_in_thread;function <s.lua:9> (s.lua);handle (s.lua);get ([C]);fibertrace_lua::host::channel::channel_get;... 40
//! ```
//!
//! The first field is the scheduler's name (the thread), the second `fiber:` and the fiber's
//! name (in a dump of another process, its threads are the part `threads`, each
//! `thread:NAME` or `thread:TID` when it has no name); then every function level, an inlined call after the function it was inlined into;
//! a layer's frame (Lua) is its function name and its chunk in parentheses. A native
//! function is named without its file and line, so a flame merges its calls from different
//! lines, as flame graphs of native code do. `;` in a name (`[u8; 4]`) is written `,`, and a
//! line end as a space, so every line splits back into its frames; any other control
//! character (a fiber named with an escape sequence) as `\xNN` (`\u{NN}` past `\x7f`), as
//! the text view writes it: raw, it made the flame graph's SVG an ill-formed XML file; so
//! are U+FFFE and U+FFFF, which XML does not allow either, as `\u{fffe}`, `\u{ffff}`. A
//! name's byte that is not UTF-8 is `\xNN`, as the text view writes it.
//! Lines are sorted.

use std::collections::BTreeMap;

use super::{stack, Kind};
use crate::inspect::Snapshot;

fn clean(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            ';' => out.push(','),
            '\n' | '\r' => out.push(' '),
            c if c.is_control() && (c as u32) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            // Characters XML does not allow (an SVG with one is not read at all).
            '\u{fffe}' | '\u{ffff}' => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            // A name's byte that is not UTF-8, as the text view writes it (not the private
            // character that stands for it).
            c => match crate::sched::names::escaped_byte(c) {
                Some(b) => out.push_str(&format!("\\x{b:02x}")),
                None => out.push(c),
            },
        }
    }
    out
}

/// The snapshot's fibers as folded stacks (see the module doc).
pub fn folded(snap: &Snapshot) -> String {
    folded_with(snap, true)
}

/// [`folded`], with each fiber's name (`fiber:NAME`) or, without `names`, `fibers` for all.
fn folded_with(snap: &Snapshot, names: bool) -> String {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for s in &snap.schedulers {
        for fi in &s.fibers {
            let mut line = clean(&s.name);
            // (Scheduler 0: the threads of a dump of another process; schedulers count from 1.)
            if s.id == 0 {
                line.push_str(";thread:");
                if fi.name.is_empty() {
                    line.push_str(&fi.id.to_string());
                } else {
                    line.push_str(&clean(&fi.name));
                }
            } else if names {
                line.push_str(";fiber:");
                line.push_str(&clean(&fi.name));
            } else {
                line.push_str(";fibers");
            }
            for f in stack(fi).iter().rev() {
                for l in f.levels.iter().rev() {
                    line.push(';');
                    match (f.kind, &l.file) {
                        (Kind::Layer, Some(file)) => {
                            line.push_str(&clean(&format!("{} ({file})", l.name)))
                        }
                        _ => line.push_str(&clean(&l.name)),
                    }
                }
            }
            *counts.entry(line).or_default() += 1;
        }
    }
    let mut out = String::new();
    for (line, n) in counts {
        out.push_str(&line);
        out.push(' ');
        out.push_str(&n.to_string());
        out.push('\n');
    }
    out
}

/// The snapshot's folded stacks drawn as a flame graph (an SVG that a browser shows and
/// searches), by the `inferno` crate. A snapshot without fibers gives an SVG that says so.
///
/// With more fiber names than the image has pixels across, most names' fibers are narrower
/// than a pixel, and the flame graph leaves out what is narrower than a tenth of one: fibers
/// named one by one (20,000 fibers with their own names) were all left out, the graph
/// empty below its threads. Then the fibers' names are left out (equal stacks merge), and
/// the subtitle says so.
pub(super) fn svg(snap: &Snapshot) -> Vec<u8> {
    let fibers: usize = snap.schedulers.iter().map(|s| s.fibers.len()).sum();
    let mut opts = inferno::flamegraph::Options::default();
    let width = opts.image_width.unwrap_or(1200);
    let distinct = if fibers > width {
        let all = snap.schedulers.iter().flat_map(|s| &s.fibers);
        all.map(|f| &*f.name)
            .collect::<std::collections::HashSet<_>>()
            .len()
    } else {
        fibers
    };
    let names = distinct <= width;
    let text = folded_with(snap, names);
    if !names {
        opts.subtitle = Some(format!(
            "{distinct} fiber names, more than the image has pixels across: names left out, \
             equal stacks merged (the folded stacks and the other exports name every fiber)"
        ));
    }
    opts.title = format!("fibertrace: {fibers} fibers");
    opts.count_name = "fibers".to_string();
    opts.name_type = "Function:".to_string();
    let mut out = Vec::new();
    // inferno fails only on a write error (none into a Vec) or input it cannot read, which
    // folded lines are not; an error is drawn as a message in the SVG rather than lost.
    if let Err(e) = inferno::flamegraph::from_lines(&mut opts, text.lines(), &mut out) {
        out.clear();
        out.extend_from_slice(
            format!(
                "<?xml version=\"1.0\" standalone=\"no\"?>\n<svg version=\"1.1\" \
                 xmlns=\"http://www.w3.org/2000/svg\" width=\"800\" height=\"40\"><text x=\"10\" \
                 y=\"25\">flame graph failed: {}</text></svg>\n",
                xml_escape(&e.to_string())
            )
            .as_bytes(),
        );
    }
    out
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
