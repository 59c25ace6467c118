//! A fiber's frames as reports hand them out ([`FrameInfo`]: a frame and its resolution),
//! and the runtime's trampoline, the outermost frame of every fiber, which reports leave out.
//!
//! The trampoline (`call_user`) is generic, so its instances have no common address; it is
//! recognized by its symbol's path, taken from where it is defined ([`TRAMPOLINE`], built
//! with `module_path!`), so moving the function moves the name with it. A test resolves a
//! fiber's outermost frame and checks it against [`TRAMPOLINE`].
//!
//! How a result can be wrong: without symbols the trampoline cannot be recognized and shows
//! as the last raw frame; a trampoline into which the user's code was inlined is kept (its
//! inlined frames are the user's).

use std::sync::Arc;

use fibertrace_core::symbolize::{self, Resolved};
use fibertrace_core::Frame;
use serde::{Deserialize, Serialize};

/// One frame, with its resolution when asked.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FrameInfo {
    /// The raw frame.
    pub frame: Frame,
    /// Names, lines and image (native frames, when resolved).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub resolved: Option<Arc<Resolved>>,
    /// The line a layer above the runtime gives a frame it added (a Lua frame:
    /// `name in source:line`; see [`crate::inspect::FrameSource`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub label: Option<Arc<str>>,
}

/// The path of the trampoline's symbol (every instance's demangled name starts with it).
pub const TRAMPOLINE: &str = concat!(module_path!(), "::call_user");

/// Calls the user's function: the outermost frame of every fiber's trace.
#[inline(never)]
pub(crate) fn call_user<F: FnOnce() -> T, T>(f: F) -> T {
    let r = f();
    std::hint::black_box(());
    r
}

/// Frames with their resolutions; a trailing runtime trampoline frame (`call_user` with
/// no user code inlined into it) is left out.
pub fn frames_info(frames: &[Frame], resolve: bool) -> Vec<FrameInfo> {
    user_frames(frames)
        .iter()
        .map(|f| frame_info(f, resolve))
        .collect()
}

/// As [`frames_info`], built straight into a shared list (one allocation).
pub(crate) fn frames_info_shared(frames: &[Frame], resolve: bool) -> Arc<[FrameInfo]> {
    user_frames(frames)
        .iter()
        .map(|f| frame_info(f, resolve))
        .collect()
}

fn frame_info(f: &Frame, resolve: bool) -> FrameInfo {
    FrameInfo {
        frame: *f,
        resolved: if resolve { symbolize::resolve(f) } else { None },
        label: None,
    }
}

/// Frames without the trailing runtime trampoline (see [`frames_info`]).
pub fn user_frames(frames: &[Frame]) -> &[Frame] {
    match frames.last() {
        Some(f @ Frame::Ra(_)) if symbolize::resolve(f).is_some_and(|r| is_trampoline(&r)) => {
            &frames[..frames.len() - 1]
        }
        _ => frames,
    }
}

/// Frames without a trailing frame in the runtime's trampoline, whatever the trampoline
/// inlined: for a host whose fiber bodies are its own code (an interpreter's fibers, whose
/// user code is the interpreter's stack), where what is inlined into the trampoline is the
/// host's, never the user's. It needs only the symbol table
/// ([`symbolize::resolve_outer`]), where [`user_frames`] needs the DWARF's inline levels.
pub fn without_trampoline(frames: &[Frame]) -> &[Frame] {
    match frames.last() {
        Some(f @ Frame::Ra(_))
            if symbolize::resolve_outer(f)
                .is_some_and(|r| r.function().is_some_and(|n| n.starts_with(TRAMPOLINE))) =>
        {
            &frames[..frames.len() - 1]
        }
        _ => frames,
    }
}

pub(crate) fn is_trampoline(r: &Resolved) -> bool {
    r.symbols.len() == 1 && r.function().is_some_and(|n| n.starts_with(TRAMPOLINE))
}
