//! A plain-text frame list: `pc:0x1000 ra:0x1010 async:0x2000 omit:5 trunc`, as in
//! `cbf-vectors.tsv`, extended with `lua:ID` and `parent:ID` for the frame kinds CBF lacks.
//! Addresses are lowercase hex with `0x`; counts and ids decimal.

use super::Error;
use crate::{Frame, LuaFrameId};
use std::fmt::Write as _;

/// Writes frames as space-separated words.
pub fn format_frames(frames: &[Frame]) -> String {
    let mut s = String::new();
    for (i, f) in frames.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        let _ = match *f {
            Frame::Pc(a) => write!(s, "pc:{a:#x}"),
            Frame::Ra(a) => write!(s, "ra:{a:#x}"),
            Frame::Async(a) => write!(s, "async:{a:#x}"),
            Frame::Lua(LuaFrameId(id)) => write!(s, "lua:{id}"),
            Frame::Omitted(n) => write!(s, "omit:{n}"),
            Frame::Truncated => write!(s, "trunc"),
            Frame::Parent(id) => write!(s, "parent:{id}"),
        };
    }
    s
}

fn hex(w: &str, v: &str) -> Result<u64, Error> {
    let h = v
        .strip_prefix("0x")
        .ok_or_else(|| Error::Syntax(format!("{w:?}: address lacks 0x")))?;
    u64::from_str_radix(h, 16).map_err(|e| Error::Syntax(format!("{w:?}: {e}")))
}

fn dec<T: std::str::FromStr>(w: &str, v: &str) -> Result<T, Error>
where
    T::Err: std::fmt::Display,
{
    v.parse::<T>()
        .map_err(|e| Error::Syntax(format!("{w:?}: {e}")))
}

/// Parses a frame list written by [`format_frames`].
pub fn parse_frames(text: &str) -> Result<Vec<Frame>, Error> {
    text.split_whitespace()
        .map(|w| {
            if w == "trunc" {
                return Ok(Frame::Truncated);
            }
            let (k, v) = w
                .split_once(':')
                .ok_or_else(|| Error::Syntax(format!("{w:?}: expected kind:value")))?;
            Ok(match k {
                "pc" => Frame::Pc(hex(w, v)?),
                "ra" => Frame::Ra(hex(w, v)?),
                "async" => Frame::Async(hex(w, v)?),
                "lua" => Frame::Lua(LuaFrameId(dec(w, v)?)),
                "omit" => Frame::Omitted(dec(w, v)?),
                "parent" => Frame::Parent(dec(w, v)?),
                _ => return Err(Error::Syntax(format!("{w:?}: unknown frame kind {k:?}"))),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let f = vec![
            Frame::Pc(0x1000),
            Frame::Ra(0xf10),
            Frame::Async(0x7fff00002000),
            Frame::Lua(LuaFrameId(7)),
            Frame::Omitted(1000),
            Frame::Parent(3),
            Frame::Truncated,
        ];
        let s = format_frames(&f);
        assert_eq!(
            s,
            "pc:0x1000 ra:0xf10 async:0x7fff00002000 lua:7 omit:1000 parent:3 trunc"
        );
        assert_eq!(parse_frames(&s).unwrap(), f);
        assert!(parse_frames("pc:1000").is_err());
        assert!(parse_frames("xx:0x1").is_err());
        assert!(parse_frames("omit:-1").is_err());
    }
}
