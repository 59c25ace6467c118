//! The frame type: one entry of a backtrace.
//!
//! A [`Frame`] is 16 bytes and `Copy`. It is either a native address (with its kind: an exact
//! program counter, a return address, or an async resume point), an interned Lua frame (the id
//! is given out by the Lua side, which owns the table of Lua frame descriptions), or a marker
//! that says where the trace is not a plain list of calls: frames left out in the middle
//! ([`Frame::Omitted`]), frames lost at the end ([`Frame::Truncated`]), or the point where the
//! frames of a parent fiber begin ([`Frame::Parent`]).
//!
//! Frames are listed innermost first: index 0 is the frame that was executing.

use serde::{Deserialize, Serialize};

/// Identifier of a fiber, as given out by a fiber runtime. `core` attaches no meaning to it
/// beyond naming the fiber in a [`Frame::Parent`] marker.
pub type FiberId = u64;

/// Identifier of an interned Lua frame description (function name, chunk, line). The Lua side
/// owns the table that maps ids to descriptions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LuaFrameId(pub u32);

/// One entry of a backtrace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Frame {
    /// An exact program counter: the instruction that was executing (the top frame of a
    /// signal-interrupted or suspended context). Symbolized at the address itself.
    Pc(u64),
    /// A return address: the instruction after a call. Symbolized at `address - 1`, so that the
    /// call instruction, not the next line, is named.
    Ra(u64),
    /// An async resume point (Swift CBF's `async` frames). Symbolized like a return address.
    Async(u64),
    /// A Lua frame, interned by the Lua side.
    Lua(LuaFrameId),
    /// `n` frames were left out here (deep stack; see [`crate::CaptureOptions::top`]).
    Omitted(u64),
    /// The trace ends here but the stack went on: an unknown number of frames is missing.
    Truncated,
    /// The frames after this marker belong to the fiber that created the one before it: the
    /// parent fiber, named by its id.
    Parent(FiberId),
}

const _: () = assert!(std::mem::size_of::<Frame>() == 16);

impl Frame {
    /// The native address of this frame, if it has one.
    #[inline]
    pub fn address(&self) -> Option<u64> {
        match *self {
            Frame::Pc(a) | Frame::Ra(a) | Frame::Async(a) => Some(a),
            _ => None,
        }
    }

    /// The address to symbolize: the address itself for a program counter, `address - 1` for
    /// a return address or async resume point (so that the call site is named).
    #[inline]
    pub fn lookup_address(&self) -> Option<u64> {
        match *self {
            Frame::Pc(a) => Some(a),
            Frame::Ra(a) | Frame::Async(a) => Some(a.saturating_sub(1)),
            _ => None,
        }
    }

    /// Whether this frame is a marker rather than a call (native or Lua).
    #[inline]
    pub fn is_marker(&self) -> bool {
        matches!(
            self,
            Frame::Omitted(_) | Frame::Truncated | Frame::Parent(_)
        )
    }
}
