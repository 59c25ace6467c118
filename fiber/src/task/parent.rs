//! Parent traces: each fiber's creation segment (its creator's frames at the spawn), kept
//! inline in its control block, and the chain of ancestors as links through the creators'
//! control blocks, shared by every descendant.
//!
//! A report over a chain of D fibers costs O(D) (each entry shows at most
//! [`PARENT_DEPTH_SHOWN`] ancestors and counts the rest), and a lineage of any length keeps at
//! most [`PARENT_DEPTH_KEPT`] ancestors alive. What can be wrong: a linked creator is named by
//! its name now, a copied one by its name when copied; ancestors past the kept chain are only
//! counted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use fibertrace_core::Frame;
use smallvec::SmallVec;

use super::{ControlBlock, FiberId};
use crate::frames::FrameInfo;

/// Frames kept of a creator's stack.
pub const PARENT_FRAMES: usize = 16;

/// Ancestors shown per fiber (fiber info, dumps, Lua's `parent_backtrace`): the nearest ones.
/// The ones past them are counted, never silently dropped: a dump ends the list with
/// `... N more parent fibers`, fiber info says `parent_backtrace_omitted: N`.
pub const PARENT_DEPTH_SHOWN: usize = 8;

/// Most ancestors a parent trace keeps reachable (and so in memory). A spawn whose creator's
/// chain already holds this many links the child to a copy of the creator's nearest
/// [`PARENT_DEPTH_SHOWN`]` - 1` ancestors instead (made once per such creator and shared by
/// all its children), so a lineage of any length keeps at most this many ancestors alive, and
/// the copying costs `PARENT_DEPTH_SHOWN - 1` small allocations once every
/// `PARENT_DEPTH_KEPT - PARENT_DEPTH_SHOWN + 1` generations: constant per spawn on average.
pub const PARENT_DEPTH_KEPT: usize = 2 * PARENT_DEPTH_SHOWN;

/// Copies of ancestors' traces alive now (see [`PARENT_DEPTH_KEPT`]).
static COPIES: AtomicUsize = AtomicUsize::new(0);

/// How many copied ancestor traces are alive in the process: the memory parent traces hold
/// beyond the control blocks they link, which must stay bounded by the number of live fibers
/// (not by the number of generations that ever ran). For tests and soaks.
pub fn parent_trace_copies() -> usize {
    COPIES.load(Ordering::Relaxed)
}

/// A parent trace: the creator's own frames at the moment it spawned the child (cut at the
/// creator's entry), and a link to the creator, whose own parent trace continues the chain
/// (grandparents are shared by reference, never copied per child). Kept inline in the child's
/// control block: spawning with parent traces costs one short frame-pointer walk and no
/// allocation.
///
/// The link keeps the creator's control block (a few hundred bytes, not its stack) alive as
/// long as a descendant lives, so an ancestor that has exited is still named. A block so held
/// is never reused for another fiber (a block is renewed in place only when nothing else
/// holds it), so a link never names the wrong fiber.
///
/// # Caps, and how the result can be wrong
///
/// - Each trace keeps [`PARENT_FRAMES`] of the creator's frames (the middle of a deeper stack
///   is replaced by one `Omitted(n)` frame).
/// - At most [`PARENT_DEPTH_KEPT`] ancestors are reachable from a trace ([`ParentTrace::chain`]);
///   [`ParentTrace::depth`] still counts them all. Past that the chain continues through
///   copies of the nearest ancestors' traces (see [`PARENT_DEPTH_KEPT`]), whose names are the
///   ones the ancestors had when the copy was made (a linked creator's name is read when
///   asked). So a fiber deep in a lineage reaches between [`PARENT_DEPTH_SHOWN`] and
///   [`PARENT_DEPTH_KEPT`] ancestors, never fewer than `min(depth, PARENT_DEPTH_SHOWN)`.
/// - Reports show the nearest [`PARENT_DEPTH_SHOWN`] ([`ParentTrace::shown`]) and count the
///   rest ([`ParentTrace::omitted`]).
pub struct ParentTrace {
    /// The creating fiber (`None`: a thread outside any fiber).
    pub fiber: Option<FiberId>,
    up: Up,
    frames: SmallVec<[Frame; PARENT_FRAMES]>,
    /// The frames as fiber info hands them out (raw, resolved), each made on first request
    /// (the trace never changes).
    info: [OnceLock<Arc<[FrameInfo]>>; 2],
    /// Ancestors reachable from this trace, its own creator included (1..=PARENT_DEPTH_KEPT).
    kept: u32,
    /// Ancestors in all, its own creator included (the ones no longer reachable too).
    depth: u64,
    /// A copy of this trace and its nearest ancestors, for children spawned once this chain is
    /// [`PARENT_DEPTH_KEPT`] long (made by the first such spawn, shared by the next ones).
    cut: OnceLock<Arc<ParentTrace>>,
    /// This is such a copy (counted in [`COPIES`]).
    copy: bool,
}

/// How a chain continues past a trace.
enum Up {
    /// The creating fiber's control block: its name now, and its own parent trace.
    Creator(Arc<ControlBlock>),
    /// A name fixed when the trace was made (a thread's) or copied (a fiber's), and the copied
    /// chain beyond it (`None`: the chain ends here; [`ParentTrace::depth`] counts the rest).
    Fixed {
        name: Arc<str>,
        parent: Option<Arc<ParentTrace>>,
    },
}

impl std::fmt::Debug for ParentTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParentTrace")
            .field("fiber", &self.fiber)
            .field("name", &self.name())
            .field("frames", &self.frames)
            .field("kept", &self.kept)
            .field("depth", &self.depth)
            .finish()
    }
}

impl Drop for ParentTrace {
    fn drop(&mut self) {
        if self.copy {
            COPIES.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl ParentTrace {
    pub(crate) fn from_parts(
        creator: Option<Arc<ControlBlock>>,
        thread_name: Option<Arc<str>>,
        frames: &[Frame],
    ) -> ParentTrace {
        let mut t = Self::linked(creator, thread_name);
        t.frames = fit_frames(frames);
        t
    }

    /// A trace without frames yet, linked to its creator (or naming the thread): the link, or
    /// when the creator's chain is [`PARENT_DEPTH_KEPT`] long, its copy cut shorter.
    #[inline]
    pub(super) fn linked(
        creator: Option<Arc<ControlBlock>>,
        thread_name: Option<Arc<str>>,
    ) -> ParentTrace {
        let fiber = creator.as_ref().map(|c| c.id);
        let (up, kept, depth) = match creator {
            None => (
                Up::Fixed {
                    name: thread_name.unwrap_or_else(|| Arc::from("thread")),
                    parent: None,
                },
                1,
                1,
            ),
            Some(c) => {
                let above = c.parent_trace.as_ref().map(|t| (t.kept, t.depth));
                match above {
                    None => (Up::Creator(c), 1, 1),
                    Some((kept, depth)) if (kept as usize) < PARENT_DEPTH_KEPT => {
                        (Up::Creator(c), kept + 1, depth + 1)
                    }
                    Some((_, depth)) => {
                        let cut = c.parent_trace.as_ref().map(ParentTrace::cut_copy);
                        let kept = cut.as_ref().map_or(0, |p| p.kept) + 1;
                        let name = c.name_arc();
                        (Up::Fixed { name, parent: cut }, kept, depth + 1)
                    }
                }
            }
        };
        ParentTrace {
            fiber,
            up,
            frames: SmallVec::new(),
            info: [OnceLock::new(), OnceLock::new()],
            kept,
            depth,
            cut: OnceLock::new(),
            copy: false,
        }
    }

    /// This trace and its nearest ancestors, `PARENT_DEPTH_SHOWN - 1` in all, copied once
    /// (cold: once every several generations of a lineage).
    #[cold]
    fn cut_copy(&self) -> Arc<ParentTrace> {
        self.cut
            .get_or_init(|| self.copy_chain(PARENT_DEPTH_SHOWN - 1))
            .clone()
    }

    /// A copy of this trace and the next `levels - 1` ancestors (`levels` ≥ 1), with the
    /// names they have now; the copy's chain ends there.
    fn copy_chain(&self, levels: usize) -> Arc<ParentTrace> {
        let nodes: SmallVec<[&ParentTrace; PARENT_DEPTH_KEPT]> =
            self.chain().take(levels.max(1)).collect();
        let mut parent: Option<Arc<ParentTrace>> = None;
        // From the farthest: each copy links the one made before it.
        for t in nodes.iter().rev() {
            let kept = parent.as_ref().map_or(0, |p| p.kept) + 1;
            COPIES.fetch_add(1, Ordering::Relaxed);
            parent = Some(Arc::new(ParentTrace {
                fiber: t.fiber,
                up: Up::Fixed {
                    name: t.name(),
                    parent: parent.take(),
                },
                frames: t.frames.clone(),
                info: t.info.clone(),
                kept,
                depth: t.depth,
                cut: OnceLock::new(),
                copy: true,
            }));
        }
        parent.expect("at least one level is copied")
    }

    /// Copies a creator's return addresses (just captured) into the inline frame buffer.
    pub(super) fn fill_return_addresses(&mut self, ras: &[u64]) {
        let ras = &ras[..ras.len().min(PARENT_FRAMES)];
        let buf = self.frames.as_mut_ptr();
        for (i, &a) in ras.iter().enumerate() {
            // SAFETY: the inline buffer holds PARENT_FRAMES frames and i < that.
            unsafe { buf.add(i).write(Frame::Ra(a)) };
        }
        // SAFETY: the first `ras.len()` entries were written just above.
        unsafe { self.frames.set_len(ras.len()) };
    }

    /// The creator's frames, innermost first.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// The frames with their resolutions (`resolve`): each list is made once and shared by
    /// every later call.
    pub fn frames_info(&self, resolve: bool) -> Arc<[FrameInfo]> {
        self.info[usize::from(resolve)]
            .get_or_init(|| crate::frames::frames_info_shared(&self.frames, resolve))
            .clone()
    }

    /// The creator's name (its current name; as it was when copied for a copied ancestor; the
    /// thread's name for a thread).
    pub fn name(&self) -> Arc<str> {
        match &self.up {
            Up::Creator(c) => c.name_arc(),
            Up::Fixed { name, .. } => name.clone(),
        }
    }

    /// The creator's own parent trace (`None` at the first fiber, a thread, or where the kept
    /// chain ends: see [`ParentTrace::depth`]).
    pub fn parent(&self) -> Option<&ParentTrace> {
        match &self.up {
            Up::Creator(c) => c.parent_trace.as_ref(),
            Up::Fixed { parent, .. } => parent.as_deref(),
        }
    }

    /// How many ancestors there are from this trace's creator up, all of them, including
    /// those the chain no longer reaches.
    pub fn depth(&self) -> u64 {
        self.depth
    }

    /// How many ancestors [`ParentTrace::chain`] reaches (at most [`PARENT_DEPTH_KEPT`]).
    pub fn kept(&self) -> usize {
        self.kept as usize
    }

    /// How many ancestors reports leave out: [`ParentTrace::depth`] minus the
    /// [`ParentTrace::shown`] ones.
    pub fn omitted(&self) -> u64 {
        self.depth - self.kept.min(PARENT_DEPTH_SHOWN as u32) as u64
    }

    /// The nearest ancestors, direct parent first: the [`PARENT_DEPTH_SHOWN`] reports show.
    pub fn shown(&self) -> impl Iterator<Item = &ParentTrace> {
        self.chain().take(PARENT_DEPTH_SHOWN)
    }

    /// The shown chain as one list: each ancestor's frames after a [`Frame::Parent`] marker
    /// naming it (the first marker names the direct parent; 0 names a thread). At most
    /// [`PARENT_DEPTH_SHOWN`] ancestors; [`ParentTrace::omitted`] counts the others.
    pub fn flatten(&self) -> Vec<Frame> {
        let mut out = Vec::new();
        for t in self.shown() {
            out.push(Frame::Parent(t.fiber.unwrap_or(0)));
            out.extend_from_slice(t.frames());
        }
        out
    }

    /// Every ancestor the chain reaches, from the direct parent up (at most
    /// [`PARENT_DEPTH_KEPT`]).
    pub fn chain(&self) -> impl Iterator<Item = &ParentTrace> {
        let mut cur = Some(self);
        std::iter::from_fn(move || {
            let t = cur?;
            cur = t.parent();
            Some(t)
        })
    }
}

fn fit_frames(f: &[Frame]) -> SmallVec<[Frame; PARENT_FRAMES]> {
    if f.len() <= PARENT_FRAMES {
        return SmallVec::from_slice(f);
    }
    // Keep the innermost and outermost frames; count what the middle held.
    let head = PARENT_FRAMES / 2;
    let tail = PARENT_FRAMES - head - 1;
    let omitted: u64 = f[head..f.len() - tail]
        .iter()
        .map(|x| match x {
            Frame::Omitted(n) => *n,
            _ => 1,
        })
        .sum();
    let mut v: SmallVec<[Frame; PARENT_FRAMES]> = SmallVec::from_slice(&f[..head]);
    v.push(Frame::Omitted(omitted));
    v.extend_from_slice(&f[f.len() - tail..]);
    v
}
