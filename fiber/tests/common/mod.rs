//! Helpers shared by the fiber crate's tests.
#![allow(dead_code)]

use fibertrace_core::{symbolize, Frame};
use fibertrace_fiber::info::FrameInfo;

/// Innermost function name at each frame (the function making the call), last path
/// segment; markers spelled out.
pub fn names(frames: &[Frame]) -> Vec<String> {
    frames
        .iter()
        .map(|f| match f {
            Frame::Omitted(n) => format!("<omitted {n}>"),
            Frame::Truncated => "<truncated>".into(),
            Frame::Parent(p) => format!("<parent {p}>"),
            Frame::Lua(id) => format!("<lua {}>", id.0),
            _ => {
                let n = symbolize::resolve(f)
                    .and_then(|r| r.innermost().and_then(|s| s.name.clone()))
                    .unwrap_or_else(|| "??".into());
                short(&n)
            }
        })
        .collect()
}

/// The functions the frames are in: for each frame the outermost function at its address
/// (the one whose frame it is), where [`names`] gives the innermost inlined one. A sample
/// of a running fiber can land in code inlined into its innermost function (a comparison
/// in `busy_3`, named `partial_cmp` by [`names`]).
pub fn owners(frames: &[Frame]) -> Vec<String> {
    frames
        .iter()
        .map(|f| {
            let n = symbolize::resolve(f)
                .and_then(|r| r.symbols.last().and_then(|s| s.name.clone()))
                .unwrap_or_else(|| "??".into());
            short(&n)
        })
        .collect()
}

/// The last `::` segment of a name, generic arguments ignored.
pub fn short(n: &str) -> String {
    let mut depth = 0i32;
    let mut cut = 0;
    let b = n.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'<' => depth += 1,
            b'>' => depth -= 1,
            b':' if depth == 0 && i + 1 < b.len() && b[i + 1] == b':' => {
                cut = i + 2;
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    let s = &n[cut..];
    match s.find('<') {
        Some(k) if k > 0 => s[..k].to_string(),
        _ => s.to_string(),
    }
}

pub fn info_names(frames: &[FrameInfo]) -> Vec<String> {
    names(&frames.iter().map(|f| f.frame).collect::<Vec<_>>())
}

/// (file name, line) of the innermost level at a frame.
pub fn file_line(f: &Frame) -> Option<(String, u32)> {
    let r = symbolize::resolve(f)?;
    let s = r.innermost()?;
    let file = s.file.as_ref()?;
    Some((file.rsplit('/').next().unwrap_or(file).to_string(), s.line?))
}

/// Full innermost names of frame infos.
pub fn full_names(frames: &[FrameInfo]) -> Vec<String> {
    frames
        .iter()
        .map(|f| {
            symbolize::resolve(&f.frame)
                .and_then(|r| r.innermost().and_then(|s| s.name.clone()))
                .unwrap_or_default()
        })
        .collect()
}

/// Outermost (not inlined) function at each frame, last path segment.
pub fn outer_names(frames: &[FrameInfo]) -> Vec<String> {
    frames
        .iter()
        .map(|f| {
            symbolize::resolve(&f.frame)
                .and_then(|r| r.function().map(short))
                .unwrap_or_default()
        })
        .collect()
}
