//! Shared fuzz helpers: the properties each target checks, callable from the fuzz targets and
//! from ordinary tests.

use fibertrace_core::codec::native::{ImageRef, ImageTable};
use fibertrace_core::codec::{cbf, lws, native};
use fibertrace_core::{Frame, LuaFrameId};

/// Reads bytes as a little stream of choices.
pub struct Src<'a>(pub &'a [u8]);

impl Src<'_> {
    pub fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    /// A u64 of 1–8 bytes (first byte picks the width), so small and huge values both occur.
    pub fn u64(&mut self) -> Option<u64> {
        let n = usize::from(self.u8()? % 8) + 1;
        let mut v = 0u64;
        for _ in 0..n {
            v = (v << 8) | u64::from(self.u8()?);
        }
        Some(v)
    }
}

/// Frames drawn from fuzz bytes; `mask` limits addresses (word size).
pub fn frames(src: &mut Src<'_>, mask: u64, all_kinds: bool) -> Vec<Frame> {
    let mut v = Vec::new();
    let mut last = 0u64;
    while let Some(k) = src.u8() {
        let Some(x) = src.u64() else { break };
        // Half the addresses near the previous one, as in real traces.
        let a = if k & 0x80 != 0 {
            last.wrapping_add(x % 4096)
        } else {
            x
        } & mask;
        let f = match k % if all_kinds { 7 } else { 5 } {
            0 | 1 => Frame::Ra(a),
            2 => Frame::Pc(a),
            3 => Frame::Async(a),
            4 => Frame::Omitted(x & mask),
            5 => Frame::Lua(LuaFrameId(x as u32)),
            _ => Frame::Parent(x),
        };
        if f.address().is_some() {
            last = a;
        }
        v.push(f);
    }
    v
}

/// lws: decoding never panics; decode(encode(t)) == t.
pub fn check_lws(data: &[u8]) {
    if let Ok(t) = lws::LwsTrace::decode(data) {
        if let Ok(b) = t.encode() {
            assert_eq!(lws::LwsTrace::decode(&b).unwrap(), t);
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = lws::LwsTrace::from_m_line(s);
        let _ = lws::LwsTrace::from_b_line(s);
    }
    let mut src = Src(data);
    let size = src.u64().unwrap_or(0);
    let addrs: Vec<u64> = std::iter::from_fn(|| src.u64())
        .take(lws::MAX_DEPTH)
        .collect();
    let t = lws::LwsTrace { size, addrs };
    match t.encode() {
        Ok(b) => {
            assert_eq!(lws::LwsTrace::decode(&b).unwrap(), t);
            assert_eq!(
                lws::LwsTrace::from_m_line(&t.to_m_line().unwrap()).unwrap(),
                t
            );
            assert_eq!(lws::LwsTrace::from_b_line(&t.to_b_line()).unwrap(), t);
        }
        Err(_) => assert!(t.size >> 63 != 0 || t.addrs.iter().any(|a| a >> 63 != 0)),
    }
}

/// CBF: decoding never panics; decode(encode(frames)) == frames.
pub fn check_cbf(data: &[u8]) {
    if let Ok(t) = cbf::decode_with_limit(data, 1 << 16) {
        if let Ok(b) = cbf::encode(&t.frames, t.word) {
            assert_eq!(cbf::decode_with_limit(&b, 1 << 16).unwrap(), t);
        }
    }
    let mut src = Src(data);
    let (word, mask) = match src.u8().unwrap_or(2) % 3 {
        0 => (cbf::WordSize::W16, 0xffff),
        1 => (cbf::WordSize::W32, 0xffff_ffff),
        _ => (cbf::WordSize::W64, u64::MAX),
    };
    let mut f = frames(&mut src, mask, false);
    if data.len().is_multiple_of(3) {
        f.push(Frame::Truncated);
    }
    let b = cbf::encode(&f, word).expect("encodable frames");
    let t = cbf::decode(&b).expect("decodes");
    assert_eq!(t.word, word);
    assert_eq!(t.frames, f);
}

fn table() -> ImageTable {
    ImageTable::new(vec![
        ImageRef {
            base: 0x5555_5555_4000,
            end: 0x5555_5600_0000,
            build_id: vec![1; 20],
            path: "/bin/a".into(),
        },
        ImageRef {
            base: 0x7f00_0000_0000,
            end: 0x7f00_0100_0000,
            build_id: vec![2; 20],
            path: "/lib/b.so".into(),
        },
        ImageRef {
            base: 0,
            end: 0x10_0000,
            build_id: vec![],
            path: "/low".into(),
        },
    ])
}

/// Native: decoding never panics; decode(encode(frames)) == frames in both modes.
pub fn check_native(data: &[u8]) {
    let t = table();
    for tab in [None, Some(&t)] {
        if let Ok(f) = native::decode(data, tab) {
            assert_eq!(native::decode(&native::encode(&f, tab), tab).unwrap(), f);
        }
    }
    let _ = ImageTable::decode(data);
    let mut src = Src(data);
    let f = frames(&mut src, u64::MAX, true);
    for tab in [None, Some(&t)] {
        let b = native::encode(&f, tab);
        assert_eq!(native::decode(&b, tab).unwrap(), f);
    }
}
