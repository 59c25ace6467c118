//! The heap views of a Lua host: live allocations grouped by stack, with fibers named and Lua
//! frames (entries a stack hook recorded, see `fibertrace_core::heap::LUA_TAG`) named as in
//! the dumps.
//!
//! [`lua_stack_hook`] puts the running fiber's Lua frames into each recorded stack (LuaJIT).
//! It cannot use the Lua debug API: an allocation happens in the middle of a VM instruction,
//! and `lua_getinfo` pushes onto a stack whose top is not synced then (it corrupted a
//! table constructor's registers when tried). It reads the VM's memory instead, with the
//! reader another process's dump uses (`frames::foreign`), over this process's own memory
//! read in place by probes (`ProbeMem`: the runtime's fault handler turns a read of an
//! unmapped address into a failed read), or, where that handler is not in place (another
//! handler took SIGSEGV over, the signal is blocked, no alternate signal stack), through
//! `process_vm_readv` (a system call per block read: 4.5x slower at coroutine depth 0,
//! 14x at depth 10, `examples/heap_cost.lua`): a stale pointer is a failed read, never a
//! fault, and nothing is written.
//!
//! How a recorded stack can be wrong: an allocation made by compiled code (a LuaJIT trace)
//! has the Lua frames and line of the trace's snapshot nearest before the call (LuaJIT
//! writes the stack back from a snapshot when a trace exits; see `frames::foreign`'s
//! `snapshot`): exact with Lua safe points on (a snapshot at every line and function the
//! trace enters); with `FIBERTRACE_LUA_SAFE_POINTS=0`, a function the trace inlined and
//! entered after its last guard is missing, its caller's line shown. Where the snapshot
//! does not check out, the frames are those the trace was entered with and the innermost
//! line is `-1`. Objects a trace's exit makes (those it did not make yet) have the frames of
//! the snapshot it restores; the JIT compiler's own (a trace, its IR) the Lua line it
//! compiles at. An allocation in a `__gc` finalizer (which LuaJIT runs on the VM's main
//! thread, from the collector's step inside the fiber's own allocation or
//! `collectgarbage`) has the finalizer's levels, then the fiber's (see
//! `Reader::set_called_states`); if compiled code took that step, the fiber's levels are
//! those of its last call out of Lua. The trace's own native frame, in no object, is left out. A stack that
//! cannot be read (a layout not checked, a budget spent) keeps its native frames only.

use fibertrace_core::format::TextOptions;
use fibertrace_core::heap::{self, Group};

/// A live fiber's name.
pub fn fiber_name(id: u64) -> Option<String> {
    fibertrace_fiber::registry::find(id).map(|(_, cb)| cb.name_arc().to_string())
}

/// The live allocations grouped by stack (most bytes first; read one at a time, see
/// `heap::group_live`), each group with its frames as text lines (`0x… in f+0x… at
/// file:line`, `leaf in @s.lua:3`), index numbers left out.
pub fn heap_groups() -> Vec<(Group, Vec<String>)> {
    let namer = |id| crate::render::lua_line(id);
    // The runtime's and the host's glue left out, as the text form leaves it out.
    let opts = TextOptions {
        lua: Some(&namer),
        hide: fibertrace_fiber::glue::filter(),
        ..TextOptions::default()
    };
    heap::group_live(|_| true)
        .groups
        .into_iter()
        .map(|g| {
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

/// The live heap as a report: totals, then the `top` stacks with most bytes, each with the
/// fibers holding its bytes and its frames.
pub fn heap_text(top: usize) -> String {
    heap_text_since(top, None)
}

/// What [`heap_text_since`] leaves out: the live allocations of a moment, by pointer, size
/// and innermost return address (an address freed and handed out again is another
/// allocation).
pub type HeapBaseline = std::collections::HashSet<(usize, usize, u64)>;

/// The live allocations now, as a [`HeapBaseline`] (empty when the heap is not tracked).
pub fn heap_baseline() -> HeapBaseline {
    if heap::tier() == heap::Tier::Off {
        return HeapBaseline::new();
    }
    heap::live()
        .iter()
        .map(|a| (a.ptr, a.size, a.addrs.first().copied().unwrap_or(0)))
        .collect()
}

/// The blocks the Lua VM keeps for itself (its string table, its temporary buffer, its
/// compiled traces) as `(address, size)` (size 0: any), read when the host let go of what it keeps at exit
/// (`LuaHost::release_kept`): a report of what the script made leaves them out. The VM
/// resizes them as the program goes (a string table grown by the script's strings stays
/// at that size while enough strings live).
static VM_OWN: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

/// Sets [`VM_OWN`].
pub(crate) fn set_vm_own(v: Vec<(usize, usize)>) {
    *VM_OWN.lock().unwrap_or_else(|e| e.into_inner()) = v;
}

/// [`heap_text`] of the allocations not in `base` (all of them without one), with a line
/// saying how many were left out. With a baseline (a script's leaks: what it made since)
/// what is charged to code outside fibers is left out too: the runtime's and the host's
/// own (the scheduler between fibers, the objects the host makes ahead for the next
/// fibers), not the script's, whose code runs in fibers; and so are the Lua VM's own
/// tables (its string table, its buffer, its compiled traces: read when the host let go
/// of what it keeps, `LuaHost::release_kept`).
pub fn heap_text_since(top: usize, base: Option<&HeapBaseline>) -> String {
    if heap::tier() == heap::Tier::Off {
        return format!("{}\n", fibertrace_fiber::export::NOT_TRACKED);
    }
    let skipped = fibertrace_core::symbolize::skipped_for_memory();
    // Grouped as read (no list of every live allocation: at exit under a memory limit, a
    // report of hundreds of thousands of them needs room for its distinct stacks alone).
    let vm_own = VM_OWN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let grouped = heap::group_live(|a| match base {
        None => true,
        Some(base) => {
            let old = a.fiber.is_none()
                || vm_own
                    .iter()
                    .any(|&(p, n)| p == a.ptr && (n == a.size || n == 0))
                || base.contains(&(a.ptr, a.size, a.addrs.first().copied().unwrap_or(0)));
            !old
        }
    });
    let mut out = String::new();
    if base.is_some() {
        out.push_str(&format!(
            "(left out: {} allocations, {} bytes, live since before the script started or \
             made outside its fibers — the runtime's and the Lua state's own)\n",
            grouped.left_out, grouped.left_out_bytes
        ));
    }
    let namer = |id| crate::render::lua_line(id);
    let opts = TextOptions {
        lua: Some(&namer),
        hide: fibertrace_fiber::glue::filter(),
        ..TextOptions::default()
    };
    let none = grouped.groups.is_empty();
    if base.is_some() && none {
        out.push_str("heap: nothing the script made is still live\n");
    }
    let groups: Vec<Group> = grouped.groups;
    if base.is_none() || !none {
        // (Names quoted as the runtime's reports quote them: a byte that is not UTF-8 as
        // `\xNN`, not as the private character that stands for it.)
        let quoted =
            |id| fiber_name(id).map(|n| fibertrace_fiber::embed::quoted_name(&n).to_string());
        out.push_str(&heap::render_groups(&groups, top, &quoted, &opts));
    }
    // What each fiber holds of what is listed (the process's totals per fiber count what was
    // left out too: a fiber's total was larger than the whole report's).
    let listed = base.is_some().then(|| {
        let mut by: std::collections::BTreeMap<u64, (bool, heap::Usage)> = Default::default();
        for sh in groups.iter().flat_map(|g| &g.fibers) {
            let Some(f) = sh.fiber else { continue };
            let e = by.entry(f).or_insert((sh.exited, heap::Usage::default()));
            e.1.live_bytes += sh.bytes;
            e.1.live_objects += sh.objects;
        }
        by
    });
    if fibertrace_core::symbolize::skipped_for_memory() > skipped {
        out.push_str(
            "(native frames shown as addresses above were left unnamed: too little address \
             space was left (a memory limit, `ulimit -v`) to read their debug information)\n",
        );
    }
    match listed {
        Some(by) if !by.is_empty() => {
            out.push('\n');
            for (f, (exited, u)) in by {
                let who = if exited {
                    "held by exited fiber"
                } else {
                    "held by fiber"
                };
                out.push_str(&format!(
                    "{who} {f}: {}\n",
                    fibertrace_fiber::dump::heap_words(&u)
                ));
            }
        }
        Some(_) => {}
        None => {
            if let Some(s) = fibertrace_fiber::inspect::HeapSummary::now() {
                out.push('\n');
                fibertrace_fiber::dump::render_heap_summary(&s, &mut out);
            }
        }
    }
    out
}

/// Most threads of a chain of coroutines the stack hook reads (see
/// `Reader::set_max_threads`).
const HOOK_THREADS: usize = 32;

/// The tracker's stack hook (`fibertrace_core::heap::set_stack_hook`, installed by the host
/// when the heap is tracked): the running fiber's Lua frames interleaved with the recorded
/// native frames, each a `LUA_TAG | id` entry. See the module doc.
pub fn lua_stack_hook(
    addrs: &mut [u64; fibertrace_core::codec::lws::MAX_DEPTH],
    n: usize,
) -> usize {
    use fibertrace_core::Frame;
    use smallvec::SmallVec;
    let Some(f) = fibertrace_fiber::current() else {
        return n;
    };
    let root = f.layer_word();
    if root == 0 {
        return n;
    }
    // A reader per stack: its caches are keyed by address, which the collector reuses.
    let Ok(mut reader) = crate::frames::foreign::Reader::own() else {
        return n;
    };
    // (A record keeps the innermost frames: a nest of thousands of coroutines is not walked
    // at every allocation.)
    reader.set_max_threads(HOOK_THREADS);
    // (Nor are levels read past the innermost ones a record keeps: a recursion hundreds of
    // levels deep cost every allocation ~35 us.)
    reader.set_max_levels(addrs.len());
    // (A `__gc` finalizer the collector runs while this fiber allocates runs on the VM's main
    // thread: its levels are this allocation's innermost.)
    reader.set_called_states(fibertrace_core::capture::stack_here());
    // Read in place where the fault handler turns a bad read into a failure (`ProbeMem`);
    // otherwise through the kernel, in blocks (a channel's creation read the stack ~160
    // times, a system call each, 0.3 ms; see `Blocks`).
    use crate::frames::foreign::{Blocks, Memory, ProbeMem, RunningTop, SelfMem};
    // (The native frames: the first in a trace's machine code is where compiled code called
    // out to allocate.)
    let cut_native = n > 0 && addrs[n - 1] == heap::TRUNC_TAG;
    let given = if cut_native { n - 1 } else { n };
    let all: SmallVec<[Frame; 64]> = addrs[..given].iter().map(|&a| Frame::Ra(a)).collect();
    let mut read = |mem: &mut dyn Memory| {
        // The innermost Lua level's line, when the interpreter allocates from inside one of
        // its instructions (the PC it saved for the call: checked against the function's
        // code). Compiled code (a trace) allocating: its frames and line from the trace's
        // snapshot nearest before the call (the functions it inlined too), or, when that
        // does not check out, from the base the trace was entered with and no line — not
        // the state's recorded base, that of its last call out of Lua (a `fiber.yield` long
        // returned showed as the allocation's innermost level).
        let top = match reader.interpreter_top(mem, root) {
            Ok(Some(t)) => Some(t),
            _ => reader
                .running_top(mem, root, None, &all)
                .ok()
                .flatten()
                .filter(|t| t.compiled)
                .map(|t| {
                    if t.snapshot {
                        t
                    } else {
                        RunningTop { pc: None, ..t }
                    }
                }),
        };
        (
            reader.stack_running(mem, root, top),
            top.is_some_and(|t| t.compiled),
        )
    };
    let stack = fibertrace_fiber::embed::overflow::ProbeReads::with(|p| match p {
        Some(p) => read(&mut ProbeMem(p)),
        None => read(&mut Blocks::new(SelfMem)),
    });
    let (Ok(lua), compiled) = stack else {
        return n;
    };
    if lua.levels.is_empty() {
        return n;
    }
    // (The native stack went on past the frames given: its last entry says so.)
    // Compiled code allocating: the trace's machine code, in no object the loader knows, is
    // the VM's own (the Lua levels above stand for it); shown, it came after them as
    // `0x… in ??`, the innermost code as the outermost caller.
    let native: Vec<Frame> = all
        .into_iter()
        .filter(|f| {
            !compiled
                || f.lookup_address()
                    .is_some_and(fibertrace_core::symbolize::in_loaded_object)
        })
        .collect();
    let bt = crate::interleave(&native, &lua, &crate::InterleaveOptions::default());
    let mut k = 0;
    let mut cut = cut_native;
    for fr in bt.frames() {
        if k == addrs.len() {
            cut = true;
            break;
        }
        let v = match fr {
            Frame::Ra(a) | Frame::Pc(a) | Frame::Async(a) => *a,
            Frame::Lua(id) => heap::LUA_TAG | u64::from(id.0),
            // Lua levels left unread (deeper than a record keeps): the record ends here.
            Frame::Omitted(_) | Frame::Truncated => {
                cut = true;
                break;
            }
            _ => continue,
        };
        addrs[k] = v;
        k += 1;
    }
    if cut && k > 0 {
        if k == addrs.len() {
            addrs[k - 1] = heap::TRUNC_TAG;
        } else {
            addrs[k] = heap::TRUNC_TAG;
            k += 1;
        }
    }
    k
}
