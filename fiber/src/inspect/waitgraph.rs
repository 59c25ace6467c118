//! The deadlock report's wait-for graph: for each blocked fiber, the fibers that could end
//! its wait, and the cycles among them.
//!
//! An edge `A → B` says B could end A's wait: A joins B; or A waits on a channel or
//! condition that B *holds* — B made it or used it (sent, received, closed, waited,
//! signalled: the runtime remembers the first 16 fibers per object), or, for a layer above
//! the runtime (Lua), one of B's frames has it in a local or upvalue
//! ([`super::FrameSource::holds`]). A fiber whose wait nobody else holds has no edge: nothing
//! can end it. In a deadlock every fiber is blocked, so a cycle of edges is a set of fibers
//! each waiting for another of the set.
//!
//! How it can be wrong: "holds" is what the runtime and the layer above can see. A fiber that
//! has a handle to a channel it never used, kept where the layer does not look (a Rust
//! closure's capture, a Lua table inside a table, a coroutine inside the fiber), is not
//! counted; so a wait can read "nothing can send to it" when that fiber could. Past 16
//! users an object lists the first 16 and says there were more.
//! Built on the scheduler's own thread (the objects' users are kept per thread).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::FiberInfo;
use crate::task::{FiberId, Status, WaitOn};

/// One blocked fiber and what it waits on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WaitNode {
    /// The fiber.
    pub fiber: FiberId,
    /// Its name.
    pub name: String,
    /// What it waits on.
    pub on: WaitOn,
}

/// A channel or condition some blocked fiber waits on, and the live fibers that hold it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Held {
    /// The object's id.
    pub object: u64,
    /// The live fibers that hold it (see the module doc), by id; its waiters among them.
    pub holders: Vec<FiberId>,
    /// It had more users than the runtime remembers (the list may be short).
    pub more: bool,
}

/// The wait-for graph of one scheduler's blocked fibers (see the module doc).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WaitGraph {
    /// Each blocked fiber (sleepers left out: time ends their wait), by id.
    pub nodes: Vec<WaitNode>,
    /// Each object waited on, by id.
    pub objects: Vec<Held>,
    /// The sets of fibers that wait on one another, each with its cycles, by lowest id.
    pub cycles: Vec<Cycle>,
}

/// Fibers that wait on one another: a strongly connected part of the graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cycle {
    /// Distinct shortest cycles through its fibers (at most [`PATHS_MAX`], looked for from
    /// its first [`STARTS_MAX`] fibers): each a list of fibers, each waiting for the next,
    /// the last for the first; written from its lowest id.
    pub paths: Vec<Vec<FiberId>>,
    /// Every fiber of the part, by id.
    pub members: Vec<FiberId>,
}

/// Cycles named per part of the graph.
pub const PATHS_MAX: usize = 8;
/// Fibers of a part a cycle is looked for from.
pub const STARTS_MAX: usize = 64;
/// Fibers named in one line of the rendered graph; the rest are counted.
pub const NAMES_MAX: usize = 8;

/// The object a wait is on, if it is a channel or condition.
fn object(on: &WaitOn) -> Option<u64> {
    match on {
        WaitOn::ChannelReceive(o) | WaitOn::ChannelSend(o) | WaitOn::Condition(o) => Some(*o),
        _ => None,
    }
}

/// The graph of `fibers` (one scheduler's), with `holds(fiber)` the objects a layer above
/// the runtime sees in that fiber's frames and `users(object)` the fibers that made or used
/// an object.
pub fn build(
    fibers: &[FiberInfo],
    holds: &dyn Fn(FiberId) -> Vec<u64>,
    users: &dyn Fn(u64) -> Option<(Vec<FiberId>, bool)>,
) -> WaitGraph {
    let live: BTreeSet<FiberId> = fibers
        .iter()
        .filter(|f| f.status != Status::Dead)
        .map(|f| f.id)
        .collect();
    let mut nodes: Vec<WaitNode> = fibers
        .iter()
        .filter_map(|f| {
            let w = f.waiting.as_ref()?;
            (w.on != WaitOn::Sleep).then(|| WaitNode {
                fiber: f.id,
                name: f.name.to_string(),
                on: w.on.clone(),
            })
        })
        .collect();
    nodes.sort_by_key(|n| n.fiber);
    let mut held: BTreeMap<u64, (BTreeSet<FiberId>, bool)> = nodes
        .iter()
        .filter_map(|n| object(&n.on))
        .map(|o| {
            let (ids, more) = users(o).unwrap_or_default();
            (
                o,
                (ids.into_iter().filter(|f| live.contains(f)).collect(), more),
            )
        })
        .collect();
    if !held.is_empty() {
        // (Not the running fiber: its frames change under the reading.)
        for f in fibers
            .iter()
            .filter(|f| live.contains(&f.id) && f.status != Status::Running)
        {
            for o in holds(f.id) {
                if let Some((set, _)) = held.get_mut(&o) {
                    set.insert(f.id);
                }
            }
        }
    }
    let objects: Vec<Held> = held
        .into_iter()
        .map(|(object, (set, more))| Held {
            object,
            holders: set.into_iter().collect(),
            more,
        })
        .collect();
    let cycles = Bipartite::new(&nodes, &objects, &live).cycles();
    WaitGraph {
        nodes,
        objects,
        cycles,
    }
}

/// The graph with the objects as nodes of their own: fiber → the fiber it joins, or the
/// object it waits on; object → its holders. Linear in size where the fiber-to-fiber graph
/// is quadratic (10,000 fibers on one channel that all hold it), and the same reachability
/// but for the step from a fiber back to itself through its own object, which the walks
/// below exclude.
struct Bipartite<'a> {
    nodes: &'a [WaitNode],
    /// Per fiber node: the node it points to (a fiber index, or `nodes.len()` + an object
    /// index); `None`: nothing (a suspended fiber, a join of a fiber not blocked).
    next: Vec<Option<usize>>,
    /// Per object: its holders that are blocked (fiber indices).
    holders: Vec<Vec<usize>>,
}

impl<'a> Bipartite<'a> {
    fn new(nodes: &'a [WaitNode], objects: &[Held], live: &BTreeSet<FiberId>) -> Self {
        let index: BTreeMap<FiberId, usize> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.fiber, i))
            .collect();
        let obj: BTreeMap<u64, usize> = objects
            .iter()
            .enumerate()
            .map(|(i, h)| (h.object, i))
            .collect();
        let next = nodes
            .iter()
            .map(|n| match &n.on {
                WaitOn::Join(t) if live.contains(t) => index.get(t).copied(),
                on => object(on)
                    .and_then(|o| obj.get(&o))
                    .map(|&i| nodes.len() + i),
            })
            .collect();
        let holders = objects
            .iter()
            .map(|h| {
                h.holders
                    .iter()
                    .filter_map(|f| index.get(f).copied())
                    .collect()
            })
            .collect();
        Bipartite {
            nodes,
            next,
            holders,
        }
    }

    fn succ(&self, v: usize) -> &[usize] {
        let n = self.nodes.len();
        if v < n {
            self.next[v].as_slice()
        } else {
            &self.holders[v - n]
        }
    }

    /// The strongly connected parts with at least two fibers, each with its cycles.
    fn cycles(&self) -> Vec<Cycle> {
        let n = self.nodes.len();
        let mut out = Vec::new();
        let mut inside = vec![false; n];
        let mut scratch = Scratch {
            prev: vec![NONE; n],
            touched: Vec::new(),
            expanded: vec![false; self.holders.len()],
            expanded_list: Vec::new(),
        };
        for comp in strongly_connected(n + self.holders.len(), |v| self.succ(v)) {
            let mut fibers: Vec<usize> = comp.into_iter().filter(|&v| v < n).collect();
            if fibers.len() < 2 {
                continue; // a fiber and the object only it holds: not a cycle
            }
            fibers.sort_unstable();
            for &f in &fibers {
                inside[f] = true;
            }
            let mut paths: Vec<Vec<usize>> = Vec::new();
            let mut sets: BTreeSet<Vec<usize>> = BTreeSet::new();
            for &start in fibers.iter().take(STARTS_MAX) {
                let Some(mut path) = self.shortest_cycle(start, &inside, &mut scratch) else {
                    continue;
                };
                let mut set = path.clone();
                set.sort_unstable();
                if !sets.insert(set) {
                    continue;
                }
                let low = (0..path.len()).min_by_key(|&i| path[i]).unwrap_or(0);
                path.rotate_left(low);
                paths.push(path);
                if paths.len() == PATHS_MAX {
                    break;
                }
            }
            for &f in &fibers {
                inside[f] = false;
            }
            paths.sort();
            let id = |i: &usize| self.nodes[*i].fiber;
            out.push(Cycle {
                paths: paths.iter().map(|p| p.iter().map(id).collect()).collect(),
                members: fibers.iter().map(id).collect(),
            });
        }
        out.sort_by_key(|c| c.members[0]);
        out
    }

    /// A shortest cycle of fibers from `start` back to it, through fibers marked in
    /// `inside` (breadth first, an object expanded once). `sc` holds the walk's marks and is
    /// reset before returning, so the walks of a part cost what they visit, not the graph.
    fn shortest_cycle(
        &self,
        start: usize,
        inside: &[bool],
        sc: &mut Scratch,
    ) -> Option<Vec<usize>> {
        let found = self.walk(start, inside, sc);
        for &v in &sc.touched {
            sc.prev[v] = NONE;
        }
        for &o in &sc.expanded_list {
            sc.expanded[o] = false;
        }
        sc.touched.clear();
        sc.expanded_list.clear();
        found
    }

    fn walk(&self, start: usize, inside: &[bool], sc: &mut Scratch) -> Option<Vec<usize>> {
        let n = self.nodes.len();
        let back = |prev: &[usize], v: usize| {
            let mut path = vec![v];
            let mut at = v;
            while at != start {
                at = prev[at];
                path.push(at);
            }
            path.reverse();
            path
        };
        let mut queue = VecDeque::from([start]);
        while let Some(v) = queue.pop_front() {
            let Some(t) = self.next[v] else { continue };
            let single = [t];
            let step: &[usize] = if t < n {
                &single
            } else {
                let hs = &self.holders[t - n];
                // Another waiter on start's own object reaches start through it even when
                // the object was expanded already. (Holders are in index order.)
                if v != start && hs.binary_search(&start).is_ok() {
                    return Some(back(&sc.prev, v));
                }
                if sc.expanded[t - n] {
                    continue;
                }
                sc.expanded[t - n] = true;
                sc.expanded_list.push(t - n);
                hs
            };
            for &w in step {
                if w == v {
                    continue;
                }
                if w == start {
                    return Some(back(&sc.prev, v));
                }
                if inside[w] && sc.prev[w] == NONE {
                    sc.prev[w] = v;
                    sc.touched.push(w);
                    queue.push_back(w);
                }
            }
        }
        None
    }
}

const NONE: usize = usize::MAX;

/// The marks of a breadth-first walk, kept between walks (see `shortest_cycle`).
struct Scratch {
    prev: Vec<usize>,
    touched: Vec<usize>,
    expanded: Vec<bool>,
    expanded_list: Vec<usize>,
}

/// Tarjan's strongly connected components over nodes `0..n` with successors `succ`,
/// iterative (a graph of 100,000 blocked fibers must not overflow a fiber's stack).
fn strongly_connected<'s>(n: usize, succ: impl Fn(usize) -> &'s [usize]) -> Vec<Vec<usize>> {
    let (mut index, mut low) = (vec![NONE; n], vec![0; n]);
    let mut on_stack = vec![false; n];
    let (mut stack, mut comps, mut next) = (Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if index[root] != NONE {
            continue;
        }
        // (node, next edge to look at)
        let mut work = vec![(root, 0usize)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut e)) = work.last_mut() {
            if let Some(&w) = succ(v).get(*e) {
                *e += 1;
                if index[w] == NONE {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(u, _)) = work.last() {
                low[u] = low[u].min(low[v]);
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                comps.push(comp);
            }
        }
    }
    comps
}

impl WaitGraph {
    /// The fibers that could end `fiber`'s wait (see the module doc), by id.
    pub fn wakers(&self, fiber: FiberId) -> Vec<FiberId> {
        let Ok(i) = self.nodes.binary_search_by_key(&fiber, |n| n.fiber) else {
            return Vec::new();
        };
        match &self.nodes[i].on {
            WaitOn::Join(t) => self
                .nodes
                .binary_search_by_key(t, |n| n.fiber)
                .ok()
                .map(|_| *t)
                .into_iter()
                .collect(),
            on => object(on)
                .and_then(|o| {
                    self.objects
                        .binary_search_by_key(&o, |h| h.object)
                        .ok()
                        .map(|j| &self.objects[j])
                })
                .map(|h| h.holders.iter().copied().filter(|&f| f != fiber).collect())
                .unwrap_or_default(),
        }
    }

    /// The graph as the deadlock report shows it: a line per wait (the fibers that wait
    /// alike — on one object, or joining one fiber — on one line, then who else holds the
    /// object), then each cycle. Empty when no fiber is blocked.
    pub fn render(&self, out: &mut String) {
        if self.nodes.is_empty() {
            return;
        }
        let names: BTreeMap<FiberId, &str> = self
            .nodes
            .iter()
            .map(|n| (n.fiber, n.name.as_str()))
            .collect();
        let waits: BTreeMap<FiberId, &WaitOn> =
            self.nodes.iter().map(|n| (n.fiber, &n.on)).collect();
        let held: BTreeMap<u64, &Held> = self.objects.iter().map(|h| (h.object, h)).collect();
        let fiber = |id: FiberId| match names.get(&id) {
            // (Quoted as every other text view quotes names: control characters and bytes
            // that are not UTF-8 escaped the same way.)
            Some(name) => format!("{id} {}", crate::sched::quoted_name(name)),
            None => id.to_string(),
        };
        let list = |ids: &[FiberId]| {
            let mut s = ids
                .iter()
                .take(NAMES_MAX)
                .map(|&i| fiber(i))
                .collect::<Vec<_>>()
                .join(", ");
            if ids.len() > NAMES_MAX {
                let _ = write!(s, " and {} more", ids.len() - NAMES_MAX);
            }
            s
        };
        // The waits, grouped: same wait, in the order of their first fiber.
        let mut groups: Vec<(&WaitOn, Vec<FiberId>)> = Vec::new();
        let mut at: std::collections::HashMap<&WaitOn, usize> = Default::default();
        for n in &self.nodes {
            let key = &n.on;
            match at.get(&key) {
                Some(&i) => groups[i].1.push(n.fiber),
                None => {
                    at.insert(key, groups.len());
                    groups.push((&n.on, vec![n.fiber]));
                }
            }
        }
        out.push_str("wait-for graph:\n");
        for (on, who) in &groups {
            let one = who.len() == 1;
            let subject = if one {
                format!("fiber {}", fiber(who[0]))
            } else {
                format!("{} fibers ({})", who.len(), list(who))
            };
            let (verb, what) = match on {
                WaitOn::Join(id) => {
                    let end = if names.contains_key(id) {
                        ""
                    } else {
                        ", which is not among the blocked fibers"
                    };
                    let verb = if one { "joins" } else { "join" };
                    let _ = writeln!(out, "  {subject} {verb} fiber {}{end}", fiber(*id));
                    continue;
                }
                WaitOn::Wakeup => {
                    let (verb, them) = if one { ("is", "it") } else { ("are", "them") };
                    let _ = writeln!(
                        out,
                        "  {subject} {verb} suspended: only an explicit wakeup ends {them}"
                    );
                    continue;
                }
                WaitOn::Sleep => continue,
                WaitOn::ChannelReceive(o) => {
                    (["receives on", "receive on"], format!("channel {o}"))
                }
                WaitOn::ChannelSend(o) => (["sends on", "send on"], format!("channel {o}")),
                WaitOn::Condition(o) => (["waits on", "wait on"], format!("condition {o}")),
            };
            let _ = write!(out, "  {subject} {} {what}, ", verb[usize::from(!one)]);
            let h = object(on).and_then(|o| held.get(&o));
            let others: Vec<FiberId> = h
                .map(|h| {
                    h.holders
                        .iter()
                        .copied()
                        // (`who` is in id order, as the nodes are.)
                        .filter(|f| who.binary_search(f).is_err())
                        .collect()
                })
                .unwrap_or_default();
            let more = h.is_some_and(|h| h.more);
            match others.as_slice() {
                [] => out.push_str("which no other fiber is known to hold"),
                [one] => {
                    let _ = write!(out, "which fiber {} also holds", fiber(*one));
                }
                many => {
                    let _ = write!(out, "which fibers {} also hold", list(many));
                }
            }
            if more {
                out.push_str(" (more fibers used it than the runtime remembers)");
            }
            out.push('\n');
        }
        for c in &self.cycles {
            let mut covered = BTreeSet::new();
            for p in &c.paths {
                // A cycle of fibers that all wait alike on one object (each holds it) says
                // no more than the object's line: the knot's line below names them.
                let first = waits.get(&p[0]).copied();
                if first.is_some_and(|on| object(on).is_some())
                    && p.iter().all(|f| waits.get(f).copied() == first)
                {
                    continue;
                }
                let mut path: Vec<String> =
                    p.iter().map(|&i| format!("fiber {}", fiber(i))).collect();
                path.push(format!("fiber {}", fiber(p[0])));
                let _ = writeln!(out, "cycle: {}", path.join(" → "));
                covered.extend(p.iter().copied());
            }
            if covered.len() < c.members.len() {
                let _ = writeln!(
                    out,
                    "  all {} fibers of this knot wait on one another: {}",
                    c.members.len(),
                    list(&c.members)
                );
            }
        }
    }
}
