//! [`Backtrace`]: a fixed-capacity list of frames, the capture options, and `append`.
//!
//! A backtrace holds at most [`CAPACITY`] frames inline; capturing into it never allocates.
//! When a stack is deeper than the limit, the trace keeps the innermost frames and the
//! outermost `top` frames, with an [`Frame::Omitted`] marker counting what was left out between
//! them — never a silently cut trace. When the count is unknown (no `top` frames were asked
//! for, or the walk itself hit its safety bound) the trace ends with [`Frame::Truncated`].
//!
//! [`Backtrace::append`] chains another trace (a parent fiber's) after a [`Frame::Parent`]
//! boundary. When the result would not fit, every segment (the trace itself and each ancestor)
//! gets a fair share of the capacity and loses frames from its middle, recorded as `Omitted`;
//! boundary markers are never dropped, so no ancestor disappears.

use arrayvec::ArrayVec;
use serde::{Deserialize, Serialize};

use crate::frame::{FiberId, Frame};

/// Frames a [`Backtrace`] holds inline.
pub const CAPACITY: usize = 64;

/// Which unwinder walks the stack (after the Swift backtrace API).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unwinder {
    /// Frame-pointer walk, with a fall back to DWARF where the chain passes through code built
    /// without frame pointers (e.g. glibc) or ends early.
    #[default]
    Auto,
    /// Frame-pointer walk only: about 1 ns per frame. Loses the frames above a function built
    /// without frame pointers.
    Fast,
    /// DWARF call-frame information (`.eh_frame`) through framehop: about 9 ns per frame, and
    /// correct through code without frame pointers.
    Precise,
}

/// How to capture: after Swift's `Backtrace.capture(algorithm:limit:offset:top:)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureOptions {
    /// The unwinder to use.
    pub unwinder: Unwinder,
    /// The most entries the trace holds, markers included (at most [`CAPACITY`]).
    pub limit: usize,
    /// Frames to skip at the start (innermost), e.g. a wrapper's own frames.
    pub offset: usize,
    /// When the stack is deeper than `limit`: how many outermost frames to keep after the
    /// `Omitted` marker. `0` stops the walk at the limit and ends the trace with `Truncated`.
    pub top: usize,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            unwinder: Unwinder::Auto,
            limit: CAPACITY,
            offset: 0,
            top: 16,
        }
    }
}

impl CaptureOptions {
    /// Options with the given unwinder and the default limits.
    pub fn with_unwinder(unwinder: Unwinder) -> Self {
        CaptureOptions {
            unwinder,
            ..Self::default()
        }
    }

    /// The limit actually applied: at least 1, at most [`CAPACITY`].
    pub(crate) fn effective_limit(&self) -> usize {
        self.limit.clamp(1, CAPACITY)
    }

    /// `top` as applied: it must leave room for at least one inner frame and the marker.
    pub(crate) fn effective_top(&self) -> usize {
        let limit = self.effective_limit();
        if limit < 3 {
            0
        } else {
            self.top.min(limit - 2)
        }
    }
}

/// A captured backtrace: frames innermost first, at most [`CAPACITY`] of them, inline.
///
/// Deserializing a longer list fits it to capacity (see [`Backtrace::from_frames`]).
#[derive(Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "Vec<Frame>", from = "Vec<Frame>")]
pub struct Backtrace {
    /// (Fixed capacity, the length beside the array: a `SmallVec`'s length, which moves when
    /// it spills, is read through a conditional move, and a capture's read of it right after
    /// the previous capture wrote it stalled: ~5 ns a capture.)
    frames: Frames,
}

/// A backtrace's storage.
type Frames = ArrayVec<Frame, CAPACITY>;

/// Appends `more` to `v`, which the caller has checked it fits in (if not: a debug build
/// asserts, a release build drops the rest rather than panic).
fn extend(v: &mut Frames, more: &[Frame]) {
    let n = more.len().min(v.remaining_capacity());
    debug_assert_eq!(n, more.len(), "a backtrace's frames fit its capacity");
    v.try_extend_from_slice(&more[..n])
        .expect("at most the remaining capacity");
}

impl std::fmt::Debug for Backtrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.frames.iter()).finish()
    }
}

impl From<Vec<Frame>> for Backtrace {
    fn from(v: Vec<Frame>) -> Self {
        Backtrace::from_frames(&v)
    }
}

impl From<Backtrace> for Vec<Frame> {
    fn from(b: Backtrace) -> Self {
        b.frames.to_vec()
    }
}

impl Backtrace {
    /// An empty backtrace.
    pub const fn new() -> Self {
        Backtrace {
            frames: ArrayVec::new_const(),
        }
    }

    /// A backtrace from a list of frames. Longer lists are fitted to [`CAPACITY`] the way
    /// [`Backtrace::append`] fits them (middle frames omitted, markers kept).
    pub fn from_frames(frames: &[Frame]) -> Self {
        let mut bt = Backtrace::new();
        if frames.len() <= CAPACITY {
            extend(&mut bt.frames, frames);
        } else {
            bt.frames = fit(frames, CAPACITY);
        }
        bt
    }

    /// Replaces the entries with `frames`, in place (no temporary: a `Backtrace` is about a
    /// kilobyte, and moving one costs more than copying a short trace). Longer lists are
    /// fitted as by [`Backtrace::from_frames`].
    pub fn set_frames(&mut self, frames: &[Frame]) {
        self.frames.clear();
        if frames.len() <= CAPACITY {
            extend(&mut self.frames, frames);
        } else {
            self.frames = fit(frames, CAPACITY);
        }
    }

    /// Fills the backtrace in place: `f` writes the first frames of its storage (at most
    /// `limit`, at most [`CAPACITY`]) and says how many. `None` leaves it empty and says
    /// `false`.
    ///
    /// # Safety
    /// When `f` returns `Some(n)`, it has written the first `n` slots it was given (the
    /// backtrace then holds them as frames).
    #[inline(always)]
    pub(crate) unsafe fn fill_with(
        &mut self,
        limit: usize,
        f: impl FnOnce(&mut [std::mem::MaybeUninit<Frame>]) -> Option<usize>,
    ) -> bool {
        self.frames.clear();
        // SAFETY: the storage holds CAPACITY slots from `as_mut_ptr`, all free after the
        // clear and exclusively borrowed; viewing them as MaybeUninit is sound whatever
        // they hold.
        let slots = unsafe {
            std::slice::from_raw_parts_mut(
                self.frames.as_mut_ptr() as *mut std::mem::MaybeUninit<Frame>,
                limit.min(CAPACITY),
            )
        };
        let room = slots.len();
        match f(slots) {
            Some(n) => {
                assert!(n <= room, "a fill says it wrote more than it had room for");
                // SAFETY: `f` wrote the first `n` slots (the caller's contract), and
                // n <= room <= CAPACITY.
                unsafe { self.frames.set_len(n) };
                true
            }
            None => false,
        }
    }

    /// The frames, innermost first.
    #[inline]
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// Number of entries (markers included).
    #[inline]
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether the trace has no entries.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Adds one entry if there is room; returns whether it was added.
    #[inline]
    pub fn push(&mut self, frame: Frame) -> bool {
        if self.frames.len() < CAPACITY {
            self.frames.push(frame);
            true
        } else {
            false
        }
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.frames.clear();
    }

    /// Removes the first `k` frames (all of them when there are fewer).
    pub(crate) fn drop_front(&mut self, k: usize) {
        self.frames.drain(..k.min(self.frames.len()));
    }

    /// Appends `other` — the trace of the fiber `parent` that created the owner of this one —
    /// after a [`Frame::Parent`] boundary marker.
    ///
    /// If everything does not fit in [`CAPACITY`], each segment (this trace and every ancestor
    /// trace inside `other`) gets a fair share of the room and loses frames from its middle,
    /// counted in an `Omitted` marker. Boundary markers are always kept.
    pub fn append(&mut self, parent: FiberId, other: &[Frame]) {
        self.append_frames(Frame::Parent(parent), other);
    }

    /// Appends `other` after the marker `boundary` (or directly when `boundary` is `None`),
    /// fitting the result to capacity as [`Backtrace::append`] does.
    pub fn append_with(&mut self, boundary: Option<Frame>, other: &[Frame]) {
        match boundary {
            Some(b) => self.append_frames(b, other),
            None => self.splice(&[], other),
        }
    }

    fn append_frames(&mut self, boundary: Frame, other: &[Frame]) {
        self.splice(&[boundary], other);
    }

    fn splice(&mut self, middle: &[Frame], other: &[Frame]) {
        let total = self.frames.len() + middle.len() + other.len();
        if total <= CAPACITY {
            extend(&mut self.frames, middle);
            extend(&mut self.frames, other);
            return;
        }
        let mut all: Vec<Frame> = Vec::with_capacity(total);
        all.extend_from_slice(&self.frames);
        all.extend_from_slice(middle);
        all.extend_from_slice(other);
        self.frames = fit(&all, CAPACITY);
    }

    /// Iterates over the segments of a chained trace: this fiber's own frames first, then for
    /// each ancestor `(Some(parent id), its frames)`.
    pub fn segments(&self) -> impl Iterator<Item = (Option<FiberId>, &[Frame])> {
        Segments {
            rest: &self.frames,
            owner: None,
            done: false,
        }
    }
}

struct Segments<'a> {
    rest: &'a [Frame],
    owner: Option<FiberId>,
    done: bool,
}

impl<'a> Iterator for Segments<'a> {
    type Item = (Option<FiberId>, &'a [Frame]);
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let end = self
            .rest
            .iter()
            .position(|f| matches!(f, Frame::Parent(_)))
            .unwrap_or(self.rest.len());
        let seg = &self.rest[..end];
        let owner = self.owner;
        if end < self.rest.len() {
            if let Frame::Parent(id) = self.rest[end] {
                self.owner = Some(id);
            }
            self.rest = &self.rest[end + 1..];
        } else {
            self.done = true;
        }
        Some((owner, seg))
    }
}

/// Fits `frames` into `cap` entries: `Parent` markers are kept; the segments between them
/// share the rest fairly (water-filling) and each over-long segment keeps its innermost and
/// outermost frames around an `Omitted` marker.
pub(crate) fn fit(frames: &[Frame], cap: usize) -> Frames {
    let cap = cap.min(CAPACITY);
    let segs: Vec<&[Frame]> = frames.split(|f| matches!(f, Frame::Parent(_))).collect();
    let markers: Vec<Frame> = frames
        .iter()
        .copied()
        .filter(|f| matches!(f, Frame::Parent(_)))
        .collect();
    let mut out = Frames::new();
    if markers.len() >= cap {
        // Pathological: more ancestors than room. Keep the innermost ancestry.
        out.extend(
            frames
                .iter()
                .copied()
                .filter(|f| matches!(f, Frame::Parent(_)))
                .take(cap.saturating_sub(1)),
        );
        out.push(Frame::Truncated);
        return out;
    }
    let room = cap - markers.len();
    let shares = water_fill(&segs.iter().map(|s| s.len()).collect::<Vec<_>>(), room);
    for (i, seg) in segs.iter().enumerate() {
        squeeze_into(seg, shares[i], &mut out);
        if i < markers.len() {
            out.push(markers[i]);
        }
    }
    out
}

/// Shares `room` among segments of the given lengths: no segment gets more than it needs, the
/// rest is split evenly among the longer ones.
fn water_fill(lens: &[usize], room: usize) -> Vec<usize> {
    let mut shares = vec![0usize; lens.len()];
    let mut left = room;
    let mut open: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
    open.sort_by_key(|&i| lens[i]);
    let mut k = 0;
    while k < open.len() {
        let remaining = open.len() - k;
        let fair = left / remaining;
        let i = open[k];
        if lens[i] <= fair {
            shares[i] = lens[i];
            left -= lens[i];
            k += 1;
        } else {
            // Every remaining segment is longer than the fair share: split what is left,
            // the extra units going to the innermost (earliest) segments.
            let mut rest: Vec<usize> = open[k..].to_vec();
            rest.sort();
            let extra = left % remaining;
            for (j, &i) in rest.iter().enumerate() {
                shares[i] = fair + usize::from(j < extra);
            }
            break;
        }
    }
    shares
}

/// Pushes `seg` into `out` using at most `share` entries: when it is longer, its middle is
/// replaced by one `Omitted` marker (counting omitted frames, including the counts of any
/// `Omitted` markers that were inside the dropped part).
fn squeeze_into(seg: &[Frame], share: usize, out: &mut Frames) {
    if seg.len() <= share {
        extend(out, seg);
        return;
    }
    if share == 0 {
        return;
    }
    let keep = share - 1; // one slot for the marker
    let head = keep.div_ceil(2);
    let tail = keep - head;
    let dropped = &seg[head..seg.len() - tail];
    let mut omitted: u64 = 0;
    for f in dropped {
        match f {
            Frame::Omitted(n) => omitted = omitted.saturating_add(*n),
            Frame::Truncated => {}
            _ => omitted = omitted.saturating_add(1),
        }
    }
    extend(out, &seg[..head]);
    out.push(Frame::Omitted(omitted));
    extend(out, &seg[seg.len() - tail..]);
}

/// Collects frames during a walk and applies `limit` / `offset` / `top` without allocating:
/// the head goes straight into the backtrace, the outermost `top` frames into a ring.
pub(crate) struct FrameSink<'a> {
    out: &'a mut Backtrace,
    /// The backtrace's storage, written directly during the walk; `len` frames are written.
    /// The backtrace's own length is set once, in `finish` (keeping the length in a register
    /// instead of re-reading the vector's header per frame halves the per-frame cost of
    /// the DWARF walk's bookkeeping).
    head: *mut Frame,
    len: usize,
    /// Only `ring[..ring_len]` (as positions modulo `top`) are initialised. Owned by the
    /// caller so that the sink itself stays small (moving a 1 KiB sink cost a memcpy per
    /// capture).
    ring: &'a mut Ring,
    skip: usize,
    head_cap: usize,
    limit: usize,
    top: usize,
    seen: u64,
    ring_len: usize,
    ring_pos: usize,
    /// Set when the sink needs no more frames (limit reached with `top == 0`).
    pub full: bool,
}

/// Storage for the outermost frames while a walk runs past the limit.
pub(crate) type Ring = [std::mem::MaybeUninit<Frame>; CAPACITY];

/// A fresh ring (uninitialised: costs nothing).
#[inline(always)]
pub(crate) fn new_ring() -> Ring {
    [const { std::mem::MaybeUninit::uninit() }; CAPACITY]
}

impl<'a> FrameSink<'a> {
    #[inline(always)]
    pub fn new(out: &'a mut Backtrace, ring: &'a mut Ring, opts: &CaptureOptions) -> Self {
        out.clear();
        let limit = opts.effective_limit();
        let top = opts.effective_top();
        // A backtrace's storage holds CAPACITY >= limit slots.
        debug_assert!(out.frames.capacity() >= limit);
        let head = out.frames.as_mut_ptr();
        FrameSink {
            out,
            head,
            len: 0,
            skip: opts.offset,
            head_cap: limit,
            limit,
            top,
            seen: 0,
            ring,
            ring_len: 0,
            ring_pos: 0,
            full: false,
        }
    }

    /// Offers the next (outer) frame; returns `false` once no more frames are wanted.
    ///
    /// Always inlined: passed through memory, a 16-byte frame written as two 8-byte halves and
    /// read back whole defeats store-to-load forwarding and cost ~6 ns per frame.
    #[inline(always)]
    pub fn push(&mut self, frame: Frame) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return true;
        }
        self.seen += 1;
        if self.len < self.head_cap {
            // SAFETY: len < head_cap <= capacity: the slot is inside the backtrace's storage,
            // which the sink borrows exclusively.
            unsafe { self.head.add(self.len).write(frame) };
            self.len += 1;
            return true;
        }
        if self.top == 0 {
            self.full = true;
            return false;
        }
        // Past the limit: remember the outermost `top` frames in the ring.
        self.ring[self.ring_pos] = std::mem::MaybeUninit::new(frame);
        self.ring_pos = (self.ring_pos + 1) % self.top;
        if self.ring_len < self.top {
            self.ring_len += 1;
        }
        true
    }

    /// How many frames may be written straight into the backtrace ([`Self::direct_slots`])
    /// without any of the skip / omit logic: nonzero only when nothing is left to skip.
    #[inline(always)]
    pub fn direct_room(&self) -> usize {
        if self.skip == 0 {
            self.head_cap.saturating_sub(self.len)
        } else {
            0
        }
    }

    /// The free slots after the frames already in the backtrace (at least
    /// [`Self::direct_room`] of them).
    #[inline(always)]
    pub fn direct_slots(&mut self) -> &mut [std::mem::MaybeUninit<Frame>] {
        // SAFETY: the storage holds head_cap (<= capacity) slots from `head`, exclusively
        // borrowed by the sink; the ones past `len` are free. Viewing them as MaybeUninit is
        // sound whatever they hold.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.head.add(self.len) as *mut std::mem::MaybeUninit<Frame>,
                self.head_cap - self.len,
            )
        }
    }

    /// Makes `n` directly written frames part of the backtrace.
    ///
    /// # Safety
    /// The first `n` slots of [`Self::direct_slots`] must have been written, and
    /// `n <= self.direct_room()`.
    #[inline(always)]
    pub unsafe fn commit_direct(&mut self, n: usize) {
        self.len += n;
        self.seen += n as u64;
    }

    /// Offers a run of return addresses (outer after inner); returns `false` once no more
    /// frames are wanted. The common case — no skipping, room for all — is one bulk copy.
    #[inline]
    pub fn push_ras(&mut self, ras: &[u64]) -> bool {
        if self.skip == 0 && self.len + ras.len() <= self.head_cap {
            for (k, &a) in ras.iter().enumerate() {
                // SAFETY: len + k < head_cap <= capacity, inside the exclusively borrowed
                // storage.
                unsafe { self.head.add(self.len + k).write(Frame::Ra(a)) };
            }
            self.len += ras.len();
            self.seen += ras.len() as u64;
            return true;
        }
        for &a in ras {
            if !self.push(Frame::Ra(a)) {
                return false;
            }
        }
        true
    }

    /// Ends the capture; `cut_short` says the walk stopped at its safety bound although the
    /// stack went on.
    ///
    /// Inlined for the common case, every frame seen in the backtrace: only its length is
    /// set (the rest is [`Self::finish_rest`]).
    #[inline(always)]
    pub fn finish(&mut self, cut_short: bool) {
        if !self.full && !cut_short && self.seen == self.len as u64 {
            // SAFETY: exactly the first `len` slots were written (push, push_ras,
            // commit_direct).
            unsafe { self.out.frames.set_len(self.len) };
            return;
        }
        self.finish_rest(cut_short);
    }

    /// [`Self::finish`] when frames were cut, omitted or counted beyond the backtrace.
    #[inline(never)]
    fn finish_rest(&mut self, cut_short: bool) {
        let (limit, top, seen, ring_len, ring_pos, full) = (
            self.limit,
            self.top,
            self.seen,
            self.ring_len,
            self.ring_pos,
            self.full,
        );
        // SAFETY: exactly the first `len` slots were written (push, push_ras, commit_direct).
        unsafe { self.out.frames.set_len(self.len) };
        let ring = &*self.ring;
        let out = &mut *self.out;
        let head_len = out.frames.len() as u64;
        if full || (top == 0 && seen > limit as u64) {
            // Limit reached and no count kept: cut with Truncated in the last slot.
            out.frames.truncate(limit - 1);
            out.frames.push(Frame::Truncated);
            return;
        }
        if seen > head_len {
            // Frames beyond the head: keep (limit - top - 1) inner frames, a marker, and the
            // `top` outermost frames seen.
            let keep_head = limit - top - 1;
            let ring_start = if ring_len < top { 0 } else { ring_pos };
            // The tail is the last `top` frames overall: some may still be in the head if
            // fewer than `top` frames went beyond it.
            let mut tail = Frames::new();
            let from_head = top.saturating_sub(ring_len);
            let head_slice_end = out.frames.len();
            extend(&mut tail, &out.frames[head_slice_end - from_head..]);
            for k in 0..ring_len {
                // SAFETY: positions are written in order from 0; with ring_len < top the first
                // ring_len are written, otherwise all `top` are: every index read here was
                // written by `push`.
                tail.push(unsafe { ring[(ring_start + k) % top].assume_init() });
            }
            let omitted = seen - keep_head as u64 - tail.len() as u64;
            out.frames.truncate(keep_head);
            out.frames.push(Frame::Omitted(omitted));
            extend(&mut out.frames, &tail);
        }
        if cut_short {
            if out.frames.len() >= CAPACITY {
                out.frames.pop();
            }
            out.frames.push(Frame::Truncated);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ras(r: std::ops::Range<u64>) -> Vec<Frame> {
        r.map(Frame::Ra).collect()
    }

    fn sink_run(n: u64, opts: CaptureOptions) -> Backtrace {
        let mut bt = Backtrace::new();
        let mut ring = new_ring();
        let mut s = FrameSink::new(&mut bt, &mut ring, &opts);
        for i in 0..n {
            if !s.push(Frame::Ra(i)) {
                break;
            }
        }
        s.finish(false);
        bt
    }

    #[test]
    fn short_stack_is_kept_whole() {
        let bt = sink_run(5, CaptureOptions::default());
        assert_eq!(bt.frames(), &ras(0..5)[..]);
    }

    #[test]
    fn deep_stack_keeps_top_and_counts_omitted() {
        let opts = CaptureOptions {
            limit: 10,
            top: 4,
            ..Default::default()
        };
        let bt = sink_run(100, opts);
        let mut want = ras(0..5);
        want.push(Frame::Omitted(91));
        want.extend(ras(96..100));
        assert_eq!(bt.frames(), &want[..]);
    }

    #[test]
    fn exactly_limit_plus_one() {
        let opts = CaptureOptions {
            limit: 10,
            top: 4,
            ..Default::default()
        };
        let bt = sink_run(11, opts);
        let mut want = ras(0..5);
        want.push(Frame::Omitted(2));
        want.extend(ras(7..11));
        assert_eq!(bt.frames(), &want[..]);
    }

    #[test]
    fn top_zero_truncates() {
        let opts = CaptureOptions {
            limit: 10,
            top: 0,
            ..Default::default()
        };
        let bt = sink_run(100, opts);
        let mut want = ras(0..9);
        want.push(Frame::Truncated);
        assert_eq!(bt.frames(), &want[..]);
        // Exactly at the limit: nothing is lost, no marker.
        assert_eq!(sink_run(10, opts).frames(), &ras(0..10)[..]);
    }

    #[test]
    fn offset_skips_inner_frames() {
        let opts = CaptureOptions {
            offset: 3,
            ..Default::default()
        };
        assert_eq!(sink_run(6, opts).frames(), &ras(3..6)[..]);
    }

    #[test]
    fn append_fits_and_keeps_every_boundary() {
        let mut own = Backtrace::from_frames(&ras(0..60));
        let mut parent = ras(1000..1040);
        parent.push(Frame::Parent(7));
        parent.extend(ras(2000..2030));
        own.append(3, &parent);
        assert_eq!(own.len(), CAPACITY);
        let segs: Vec<_> = own.segments().collect();
        assert_eq!(segs.len(), 3);
        assert_eq!(segs[0].0, None);
        assert_eq!(segs[1].0, Some(3));
        assert_eq!(segs[2].0, Some(7));
        // 62 slots shared by segments of 60, 40, 30: 21 + 21 + 20.
        assert_eq!(segs[0].1.len(), 21);
        assert_eq!(segs[0].1[0], Frame::Ra(0));
        assert_eq!(segs[0].1[10], Frame::Omitted(40));
        assert_eq!(segs[0].1[20], Frame::Ra(59));
        assert_eq!(segs[1].1[0], Frame::Ra(1000));
        assert_eq!(segs[1].1[10], Frame::Omitted(20));
        assert_eq!(segs[1].1[20], Frame::Ra(1039));
        assert_eq!(segs[2].1.len(), 20);
        assert_eq!(segs[2].1[10], Frame::Omitted(11));
        assert_eq!(segs[2].1[19], Frame::Ra(2029));
        // Nothing is lost without being counted.
        let count: u64 = own
            .frames()
            .iter()
            .map(|f| match f {
                Frame::Omitted(n) => *n,
                Frame::Parent(_) => 0,
                _ => 1,
            })
            .sum();
        assert_eq!(count, 130);
    }

    #[test]
    fn append_short_parent_to_deep_own_keeps_parent_whole() {
        let mut own = Backtrace::from_frames(&ras(0..64));
        own.append(1, &ras(500..505));
        let segs: Vec<_> = own.segments().collect();
        assert_eq!(segs[1], (Some(1), &ras(500..505)[..]));
        assert_eq!(segs[0].1.len(), 58);
        assert_eq!(segs[0].1[29], Frame::Omitted(7));
    }

    #[test]
    fn frame_is_16_bytes_and_serializes() {
        assert_eq!(std::mem::size_of::<Frame>(), 16);
        let bt = Backtrace::from_frames(&[Frame::Pc(16), Frame::Omitted(3), Frame::Parent(9)]);
        let json = serde_json::to_string(&bt).unwrap();
        assert_eq!(json, r#"[{"pc":16},{"omitted":3},{"parent":9}]"#);
        let back: Backtrace = serde_json::from_str(&json).unwrap();
        assert_eq!(back, bt);
    }
}
