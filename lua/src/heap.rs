//! The heap views of a Lua host: live allocations grouped by stack, with fibers named and Lua
//! frames (entries a stack hook recorded, see `fibertrace_core::heap::LUA_TAG`) named as in
//! the dumps.

use fibertrace_core::format::TextOptions;
use fibertrace_core::heap::{self, Group, LiveAlloc};

/// A live fiber's name.
pub fn fiber_name(id: u64) -> Option<String> {
    fibertrace_fiber::registry::find(id).map(|(_, cb)| cb.name_arc().to_string())
}

/// `allocs` grouped by stack (most bytes first), each group with its frames as text lines
/// (`0x… in f+0x… at file:line`, `leaf in @s.lua:3`), index numbers left out.
pub fn heap_groups(allocs: &[LiveAlloc]) -> Vec<(Group, Vec<String>)> {
    let namer = |id| crate::render::lua_line(id);
    let opts = TextOptions {
        lua: Some(&namer),
        ..TextOptions::default()
    };
    heap::group(allocs)
        .into_iter()
        .map(|mut g| {
            g.frames = as_frames(&g);
            let text = fibertrace_core::format::text(&g.frames, &opts);
            let lines = text
                .lines()
                .map(|l| match l.split_once(' ') {
                    Some((n, rest)) if n.starts_with('#') => rest.trim_start().to_string(),
                    _ => l.to_string(),
                })
                .collect();
            (g, lines)
        })
        .collect()
}

/// A group's recorded entries as frames (tagged entries as Lua frames).
fn as_frames(g: &Group) -> Vec<fibertrace_core::Frame> {
    let addrs: Vec<u64> = g.frames.iter().filter_map(|f| f.address()).collect();
    heap::frames_of(&addrs)
}

/// The live heap as a report: totals, then the `top` stacks with most bytes, each with the
/// fibers holding its bytes and its frames.
pub fn heap_text(top: usize) -> String {
    if heap::tier() == heap::Tier::Off {
        return format!("{}\n", fibertrace_fiber::export::NOT_TRACKED);
    }
    let namer = |id| crate::render::lua_line(id);
    let opts = TextOptions {
        lua: Some(&namer),
        hide: fibertrace_fiber::glue::filter(),
        ..TextOptions::default()
    };
    let groups: Vec<Group> = heap::group(&heap::live())
        .into_iter()
        .map(|mut g| {
            g.frames = as_frames(&g);
            g
        })
        .collect();
    let mut out = heap::render_groups(&groups, top, &fiber_name, &opts);
    if let Some(s) = fibertrace_fiber::inspect::HeapSummary::now() {
        out.push('\n');
        fibertrace_fiber::dump::render_heap_summary(&s, &mut out);
    }
    out
}
