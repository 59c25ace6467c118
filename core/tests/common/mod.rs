//! Helpers shared by core's integration tests.
#![allow(dead_code)]

use fibertrace_core::{symbolize, Frame};

/// The function name of each frame — the innermost level, i.e. the function (inlined or
/// not) that made the call — with markers spelled out: `<omitted N>`, `<truncated>`, `<parent N>`, `<lua N>`, `??`.
pub fn names(frames: &[Frame]) -> Vec<String> {
    frames
        .iter()
        .map(|f| match f {
            Frame::Omitted(n) => format!("<omitted {n}>"),
            Frame::Truncated => "<truncated>".into(),
            Frame::Parent(p) => format!("<parent {p}>"),
            Frame::Lua(id) => format!("<lua {}>", id.0),
            _ => symbolize::resolve(f)
                .and_then(|r| r.innermost().and_then(|s| s.name.clone()))
                .unwrap_or_else(|| "??".into()),
        })
        .collect()
}

/// The last path segment of each name (`capture::level3` -> `level3`).
pub fn short_names(frames: &[Frame]) -> Vec<String> {
    names(frames)
        .into_iter()
        .map(|n| n.rsplit("::").next().unwrap_or(&n).to_string())
        .collect()
}

/// (file name, line) of the innermost level at a frame.
pub fn file_line(f: &Frame) -> Option<(String, u32)> {
    let r = symbolize::resolve(f)?;
    let s = r.innermost()?;
    let file = s.file.as_ref()?;
    let name = file.rsplit('/').next().unwrap_or(file).to_string();
    Some((name, s.line?))
}

/// The outermost (not inlined) function at a frame, last path segment.
pub fn outer_name(f: &Frame) -> String {
    let n = symbolize::resolve(f)
        .and_then(|r| r.function().map(str::to_string))
        .unwrap_or_else(|| "??".into());
    n.rsplit("::").next().unwrap_or(&n).to_string()
}
