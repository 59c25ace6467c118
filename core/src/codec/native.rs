//! fibertrace's native compact trace format: one self-contained bit string per trace, smaller
//! than lws and CBF, optionally module-relative against an [`ImageTable`].
//!
//! # Layout (bits, MSB-first; the last byte is zero-padded)
//!
//! ```text
//! version:2 (= 0)  module_relative:1  general:1  count:EG3
//! [fingerprint:8]                    if module_relative: ImageTable::fingerprint()
//! [frame0_is_pc:1]                   if !general and count > 0
//! frames...
//! ```
//!
//! *Simple* traces (not `general`): every frame is native, frame 0 is a [`Frame::Pc`] or
//! [`Frame::Ra`] and all others are [`Frame::Ra`]; no per-frame kind is written. *General*
//! traces write a kind before each frame: `0` Ra, `100` Pc, `101` Async, `1100` Lua (id EG6),
//! `1101` Omitted (count EG2), `1110` Parent (id EG6), `1111` Truncated.
//!
//! An address is coded against a short move-to-front list of *regions*, each remembering its
//! last value. The region is named by a prefix code (`0`, `10`, `110`, `1110` for list positions
//! 0–3, `1111` for another), then the value is either a delta from that region's last value
//! (bit length `L` in a static canonical Huffman code tuned for deltas between functions of a
//! few-megabyte text segment, then a sign bit and the `L − 1` bits below the leading one) or,
//! for a new region, a literal (`L` in 7 bits, then `L − 1` bits). The first address has no
//! region prefix.
//!
//! * Absolute mode: regions are up to 4 anchors chosen by the encoder; `1111` starts a new one
//!   (used when the best delta would exceed 32 bits, e.g. from the executable into libc).
//! * Module-relative mode: a region is an image of the table (or "outside every image", index
//!   `table.len()`, holding absolute addresses); values are offsets `addr − base`. `1111` (and
//!   the first frame) is followed by the image index in EG1. Offsets make the trace independent
//!   of ASLR: decoded against the table of another run of the same binaries, it gives that
//!   run's addresses; [`decode_located`] gives image and offset for offline symbolization.
//!
//! `EGk` is order-k exponential-Golomb.
//!
//! # Invariants, and how a result can be wrong
//!
//! * `decode(encode(frames)) == frames` for every frame list, in both modes.
//! * A module-relative trace decoded against the wrong image table gives wrong addresses; the
//!   8-bit fingerprint (base, end and build id of every image, not paths) catches all but about
//!   1 in 256 such mistakes.
//! * The decoder rejects (with [`Error`]) a frame count above its limit or above the number of
//!   bits left, unknown versions, bit lengths above 64, deltas leaving the 64-bit range, image
//!   indices outside the table, non-zero padding and trailing bytes.

use super::bits::{BitReader, BitWriter};
use super::{base64, Error};
use crate::{Frame, LuaFrameId};
use std::sync::OnceLock;

/// Lead-in of a native trace log line (`~n#` + base64).
pub const N_LEAD: &str = "~n#";
/// Lead-in of an image table log line (`~i#` + base64).
pub const I_LEAD: &str = "~i#";
/// Default cap on the frames one decode may produce.
pub const DEFAULT_MAX_FRAMES: usize = 1 << 20;

const VERSION: u64 = 0;
/// Anchors kept in absolute mode.
const MAX_ANCHORS: usize = 4;
/// In absolute mode, a delta longer than this starts a new anchor instead.
const NEW_ANCHOR_BITS: u32 = 32;

/// Code lengths of the static canonical Huffman code for delta bit lengths 0..=64: a bell
/// around 18 bits (deltas between functions of a text segment of a few MB), 0 (recursion) at
/// 4 bits, long deltas rare.
const LEN_CODE: [u8; 65] = [
    4, 9, 9, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8,
    9, 11, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 13,
    13, 13, 13, 13, 13, 13, 13, 13, 13,
];

struct Huffman {
    /// Code for each symbol, right-aligned.
    code: [u32; 65],
    /// Symbols sorted by (length, symbol).
    sorted: Vec<u8>,
    /// For each length: (first code, index of its first symbol in `sorted`, count).
    per_len: Vec<(u32, usize, u32)>,
}

fn huffman() -> &'static Huffman {
    static H: OnceLock<Huffman> = OnceLock::new();
    H.get_or_init(|| {
        let max = *LEN_CODE.iter().max().unwrap_or(&0) as usize;
        let mut sorted: Vec<u8> = (0..=64u8).collect();
        sorted.sort_by_key(|&s| (LEN_CODE[s as usize], s));
        let mut code = [0u32; 65];
        let mut per_len = vec![(0u32, 0usize, 0u32); max + 1];
        let mut next: u32 = 0;
        let mut idx = 0;
        for (len, slot) in per_len.iter_mut().enumerate().skip(1) {
            let first = next;
            let start = idx;
            while idx < sorted.len() && LEN_CODE[sorted[idx] as usize] as usize == len {
                code[sorted[idx] as usize] = next;
                next += 1;
                idx += 1;
            }
            *slot = (first, start, next - first);
            next <<= 1;
        }
        Huffman {
            code,
            sorted,
            per_len,
        }
    })
}

fn put_len(w: &mut BitWriter, l: u32) {
    let h = huffman();
    w.write(
        u64::from(h.code[l as usize]),
        u32::from(LEN_CODE[l as usize]),
    );
}

fn get_len(r: &mut BitReader<'_>) -> Result<u32, Error> {
    let h = huffman();
    let mut code: u32 = 0;
    for (first, start, count) in h.per_len.iter().skip(1) {
        code = (code << 1) | r.read(1, "delta length")? as u32;
        if code.wrapping_sub(*first) < *count {
            return Ok(u32::from(h.sorted[start + (code - first) as usize]));
        }
    }
    // The code is complete (Kraft sum 1), so this is unreachable for well-formed tables.
    Err(Error::Invalid {
        what: "bad delta length code".into(),
        at: r.byte_pos(),
    })
}

/// Writes `v` in order-`k` exponential-Golomb.
fn put_eg(w: &mut BitWriter, v: u64, k: u32) {
    let q = (u128::from(v) >> k) + 1;
    let n = 128 - q.leading_zeros(); // bits of q, ≥ 1
    w.write(0, n - 1);
    // q has at most 65 bits: write its top bit then the rest.
    if n > 64 {
        w.write(1, 1);
        w.write(q as u64, 64);
    } else {
        w.write(q as u64, n);
    }
    w.write(v & ((1u64 << k) - 1), k);
}

fn get_eg(r: &mut BitReader<'_>, k: u32, what: &'static str) -> Result<u64, Error> {
    let at = r.byte_pos();
    let mut zeros = 0u32;
    while !r.bit(what)? {
        zeros += 1;
        if zeros > 64 - k {
            return Err(Error::Invalid {
                what: format!("{what} exceeds 64 bits"),
                at,
            });
        }
    }
    let rest = r.read(zeros, what)?;
    let q = (1u128 << zeros) | u128::from(rest);
    let v = ((q - 1) << k) | u128::from(r.read(k, what)?);
    u64::try_from(v).map_err(|_| Error::Invalid {
        what: format!("{what} exceeds 64 bits"),
        at,
    })
}

fn bitlen(v: u64) -> u32 {
    64 - v.leading_zeros()
}

fn put_literal(w: &mut BitWriter, v: u64) {
    let l = bitlen(v);
    w.write(u64::from(l), 7);
    if l > 1 {
        w.write(v, l - 1);
    }
}

fn get_literal(r: &mut BitReader<'_>) -> Result<u64, Error> {
    let at = r.byte_pos();
    let l = r.read(7, "literal length")? as u32;
    match l {
        0 => Ok(0),
        1..=64 => Ok((1u64 << (l - 1)) | r.read(l - 1, "literal")?),
        _ => Err(Error::Invalid {
            what: format!("literal of {l} bits"),
            at,
        }),
    }
}

fn delta_cost(from: u64, to: u64) -> u32 {
    let l = bitlen(from.abs_diff(to));
    u32::from(LEN_CODE[l as usize]) + l
}

fn put_delta(w: &mut BitWriter, from: u64, to: u64) {
    let d = from.abs_diff(to);
    let l = bitlen(d);
    put_len(w, l);
    if l > 0 {
        w.bit(to < from);
        w.write(d, l - 1);
    }
}

fn get_delta(r: &mut BitReader<'_>, from: u64) -> Result<u64, Error> {
    let at = r.byte_pos();
    let l = get_len(r)?;
    if l == 0 {
        return Ok(from);
    }
    let neg = r.bit("delta sign")?;
    let d = (1u64 << (l - 1)) | r.read(l - 1, "delta")?;
    let v = if neg {
        from.checked_sub(d)
    } else {
        from.checked_add(d)
    };
    v.ok_or_else(|| Error::Invalid {
        what: format!("delta {d:#x} from {from:#x} leaves 64 bits"),
        at,
    })
}

/// Prefix code for a region list position: `0`, `10`, `110`, `1110`; `1111` = other/new.
fn put_pos(w: &mut BitWriter, pos: Option<usize>) {
    match pos {
        Some(p) if p < 4 => {
            w.write(((1u64 << p) - 1) << 1, p as u32 + 1);
        }
        _ => w.write(0b1111, 4),
    }
}

fn pos_cost(p: usize) -> u32 {
    (p as u32 + 1).min(4)
}

fn get_pos(r: &mut BitReader<'_>) -> Result<Option<usize>, Error> {
    for p in 0..4 {
        if !r.bit("region")? {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------
// Image table

/// One loaded image (executable or shared object) as the codec needs it.
///
/// `base` is the load bias: `address − base` is the address inside the ELF file (its virtual
/// address), what an offline symbolizer such as `addr2line -e FILE` takes. The image covers
/// `[base, end)`: for a position-independent image the bias is also where its first segment is
/// mapped; for a non-PIE executable the bias is 0 and `end` its highest mapped address.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageRef {
    /// Load bias.
    pub base: u64,
    /// One past the highest address of the image.
    pub end: u64,
    /// GNU build id (may be empty).
    pub build_id: Vec<u8>,
    /// Path on the machine that captured the trace.
    pub path: String,
}

/// The images of a process, in a fixed order (trace frames name images by index).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageTable {
    images: Vec<ImageRef>,
    /// (base, end, index) sorted by base, for lookup.
    by_base: Vec<(u64, u64, u32)>,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], pos: &mut usize, what: &'static str) -> Result<u64, Error> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = b.get(*pos) else {
            return Err(Error::UnexpectedEnd { what, at: *pos });
        };
        *pos += 1;
        let part = u64::from(byte & 0x7f);
        if shift == 63 && part > 1 {
            break;
        }
        v |= part << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(Error::Invalid {
        what: format!("{what} exceeds 64 bits"),
        at: *pos - 1,
    })
}

fn get_bytes<'a>(b: &'a [u8], pos: &mut usize, what: &'static str) -> Result<&'a [u8], Error> {
    let n = get_varint(b, pos, what)?;
    if n > (b.len() - *pos) as u64 {
        return Err(Error::UnexpectedEnd { what, at: b.len() });
    }
    let s = &b[*pos..*pos + n as usize];
    *pos += n as usize;
    Ok(s)
}

impl ImageTable {
    /// A table of these images; trace frames refer to them by their index here. Where images
    /// overlap, the one listed first wins.
    pub fn new(images: Vec<ImageRef>) -> Self {
        let mut by_base: Vec<(u64, u64, u32)> = images
            .iter()
            .enumerate()
            .filter(|(_, im)| im.end > im.base)
            .map(|(i, im)| (im.base, im.end, i as u32))
            .collect();
        by_base.sort_by_key(|&(b, _, i)| (b, i));
        Self { images, by_base }
    }

    /// The images, in index order.
    pub fn images(&self) -> &[ImageRef] {
        &self.images
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.images.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }

    /// The index of the image containing `addr`.
    pub fn find(&self, addr: u64) -> Option<usize> {
        // Candidates: images whose base ≤ addr; overlaps are rare, so scan back a little.
        let n = self.by_base.partition_point(|&(b, _, _)| b <= addr);
        self.by_base[..n]
            .iter()
            .rev()
            .filter(|&&(_, e, _)| addr < e)
            .map(|&(_, _, i)| i as usize)
            .min()
    }

    /// 8-bit fingerprint of bases, ends and build ids (not paths), written into
    /// module-relative traces to catch decoding against the wrong table.
    pub fn fingerprint(&self) -> u8 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: &[u8]| {
            for &x in b {
                h = (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for im in &self.images {
            eat(&im.base.to_le_bytes());
            eat(&im.end.to_le_bytes());
            eat(&(im.build_id.len() as u64).to_le_bytes());
            eat(&im.build_id);
        }
        (h ^ (h >> 8) ^ (h >> 16) ^ (h >> 24) ^ (h >> 32) ^ (h >> 40) ^ (h >> 48) ^ (h >> 56)) as u8
    }

    /// Serializes the table: varint count, then per image varint base, varint size, build id
    /// and path (each a varint length and bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_varint(&mut out, self.images.len() as u64);
        for im in &self.images {
            put_varint(&mut out, im.base);
            put_varint(&mut out, im.end.wrapping_sub(im.base));
            put_varint(&mut out, im.build_id.len() as u64);
            out.extend_from_slice(&im.build_id);
            put_varint(&mut out, im.path.len() as u64);
            out.extend_from_slice(im.path.as_bytes());
        }
        out
    }

    /// Parses [`ImageTable::encode`]'s output.
    pub fn decode(b: &[u8]) -> Result<Self, Error> {
        let mut pos = 0;
        let n = get_varint(b, &mut pos, "image count")?;
        // Every image takes at least 4 bytes: bounds the allocation.
        if n > (b.len() / 4) as u64 {
            return Err(Error::LengthMismatch {
                declared: n,
                actual: (b.len() / 4) as u64,
            });
        }
        let mut images = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let base = get_varint(b, &mut pos, "image base")?;
            let at = pos;
            let size = get_varint(b, &mut pos, "image size")?;
            let end = base.checked_add(size).ok_or_else(|| Error::Invalid {
                what: "image end leaves 64 bits".into(),
                at,
            })?;
            let build_id = get_bytes(b, &mut pos, "build id")?.to_vec();
            let at = pos;
            let path = std::str::from_utf8(get_bytes(b, &mut pos, "image path")?)
                .map_err(|_| Error::Invalid {
                    what: "image path is not UTF-8".into(),
                    at,
                })?
                .to_owned();
            images.push(ImageRef {
                base,
                end,
                build_id,
                path,
            });
        }
        if pos != b.len() {
            return Err(Error::TrailingData { at: pos });
        }
        Ok(Self::new(images))
    }

    /// The table as a log line, `~i#` + base64.
    pub fn to_line(&self) -> String {
        format!("{I_LEAD}{}", base64::encode(&self.encode()))
    }

    /// Parses a `~i#` line (the lead-in is optional).
    pub fn from_line(line: &str) -> Result<Self, Error> {
        let t = line.trim();
        Self::decode(&base64::decode(t.strip_prefix(I_LEAD).unwrap_or(t))?)
    }
}

// ---------------------------------------------------------------------------------------------
// Traces

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Region {
    /// Image index (module mode; `table.len()` = outside); unused in absolute mode.
    key: usize,
    last: u64,
}

struct AddrCoder<'t> {
    table: Option<&'t ImageTable>,
    regions: Vec<Region>,
}

impl<'t> AddrCoder<'t> {
    fn new(table: Option<&'t ImageTable>) -> Self {
        Self {
            table,
            regions: Vec::with_capacity(MAX_ANCHORS),
        }
    }

    fn touch(&mut self, pos: Option<usize>, r: Region) {
        if let Some(p) = pos {
            self.regions.remove(p);
        }
        self.regions.insert(0, r);
        if self.table.is_none() {
            self.regions.truncate(MAX_ANCHORS);
        }
    }

    fn encode(&mut self, w: &mut BitWriter, addr: u64) {
        match self.table {
            None => {
                let best = self
                    .regions
                    .iter()
                    .enumerate()
                    .map(|(p, r)| (pos_cost(p) + delta_cost(r.last, addr), p))
                    .min();
                let pos = match best {
                    Some((_, p))
                        if bitlen(self.regions[p].last.abs_diff(addr)) <= NEW_ANCHOR_BITS =>
                    {
                        Some(p)
                    }
                    _ => None,
                };
                if !self.regions.is_empty() {
                    put_pos(w, pos);
                }
                match pos {
                    Some(p) => put_delta(w, self.regions[p].last, addr),
                    None => put_literal(w, addr),
                }
                self.touch(pos, Region { key: 0, last: addr });
            }
            Some(t) => {
                let (key, value) = match t.find(addr) {
                    Some(i) => (i, addr - t.images[i].base),
                    None => (t.len(), addr),
                };
                let pos = self.regions.iter().position(|r| r.key == key);
                let first = self.regions.is_empty();
                if !first {
                    put_pos(w, pos);
                }
                if first || pos.is_none_or(|p| p >= 4) {
                    put_eg(w, key as u64, 1);
                }
                match pos {
                    Some(p) => put_delta(w, self.regions[p].last, value),
                    None => put_literal(w, value),
                }
                self.touch(pos, Region { key, last: value });
            }
        }
    }

    /// Decodes one address; returns it with its image index (module mode).
    fn decode(&mut self, r: &mut BitReader<'_>) -> Result<(u64, Option<usize>), Error> {
        let first = self.regions.is_empty();
        let at = r.byte_pos();
        let mut pos = if first { None } else { get_pos(r)? };
        if let Some(p) = pos {
            if p >= self.regions.len() {
                return Err(Error::Invalid {
                    what: format!("region {p} of {}", self.regions.len()),
                    at,
                });
            }
        }
        match self.table {
            None => {
                let addr = match pos {
                    Some(p) => get_delta(r, self.regions[p].last)?,
                    None => get_literal(r)?,
                };
                self.touch(pos, Region { key: 0, last: addr });
                Ok((addr, None))
            }
            Some(t) => {
                let key = match pos {
                    Some(p) => self.regions[p].key,
                    None => {
                        let k = get_eg(r, 1, "image index")?;
                        if k > t.len() as u64 {
                            return Err(Error::Invalid {
                                what: format!("image {k} of a table of {}", t.len()),
                                at,
                            });
                        }
                        let k = k as usize;
                        pos = self.regions.iter().position(|r| r.key == k);
                        if pos.is_some_and(|p| p < 4) {
                            return Err(Error::Invalid {
                                what: "image named by index although it has a short code".into(),
                                at,
                            });
                        }
                        k
                    }
                };
                let value = match pos {
                    Some(p) => get_delta(r, self.regions[p].last)?,
                    None => get_literal(r)?,
                };
                self.touch(pos, Region { key, last: value });
                if key == t.len() {
                    return Ok((value, None));
                }
                let addr = t.images[key]
                    .base
                    .checked_add(value)
                    .ok_or_else(|| Error::Invalid {
                        what: "offset beyond 64 bits".into(),
                        at,
                    })?;
                Ok((addr, Some(key)))
            }
        }
    }
}

fn is_simple(frames: &[Frame]) -> bool {
    frames.iter().enumerate().all(|(i, f)| match f {
        Frame::Ra(_) => true,
        Frame::Pc(_) => i == 0,
        _ => false,
    })
}

/// Encodes a trace; module-relative when `table` is given (see the module docs).
pub fn encode(frames: &[Frame], table: Option<&ImageTable>) -> Vec<u8> {
    let mut w = BitWriter::new();
    let general = !is_simple(frames);
    w.write(VERSION, 2);
    w.bit(table.is_some());
    w.bit(general);
    put_eg(&mut w, frames.len() as u64, 3);
    if let Some(t) = table {
        w.write(u64::from(t.fingerprint()), 8);
    }
    if !general {
        if let Some(f) = frames.first() {
            w.bit(matches!(f, Frame::Pc(_)));
        }
    }
    let mut ac = AddrCoder::new(table);
    for f in frames {
        if general {
            match f {
                Frame::Ra(_) => w.write(0b0, 1),
                Frame::Pc(_) => w.write(0b100, 3),
                Frame::Async(_) => w.write(0b101, 3),
                Frame::Lua(LuaFrameId(id)) => {
                    w.write(0b1100, 4);
                    put_eg(&mut w, u64::from(*id), 6);
                }
                Frame::Omitted(n) => {
                    w.write(0b1101, 4);
                    put_eg(&mut w, *n, 2);
                }
                Frame::Parent(id) => {
                    w.write(0b1110, 4);
                    put_eg(&mut w, *id, 6);
                }
                Frame::Truncated => w.write(0b1111, 4),
            }
        }
        if let Some(a) = f.address() {
            ac.encode(&mut w, a);
        }
    }
    w.into_bytes()
}

/// A decoded frame with the image it lies in (module-relative traces only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    /// The frame, with absolute addresses (image base + offset).
    pub frame: Frame,
    /// Index of its image in the table, if it is a native frame inside one.
    pub image: Option<usize>,
}

/// Decodes a trace. A module-relative trace needs the table it was written against.
pub fn decode(bytes: &[u8], table: Option<&ImageTable>) -> Result<Vec<Frame>, Error> {
    Ok(decode_located(bytes, table, DEFAULT_MAX_FRAMES)?
        .into_iter()
        .map(|l| l.frame)
        .collect())
}

/// Whether a trace is module-relative (needs an image table to decode).
pub fn is_module_relative(bytes: &[u8]) -> bool {
    bytes.first().is_some_and(|b| b & 0x20 != 0)
}

/// Decodes a trace into frames with their images, producing at most `max_frames` frames.
pub fn decode_located(
    bytes: &[u8],
    table: Option<&ImageTable>,
    max_frames: usize,
) -> Result<Vec<Located>, Error> {
    let mut r = BitReader::new(bytes);
    let version = r.read(2, "version")?;
    if version != VERSION {
        return Err(Error::Invalid {
            what: format!("unsupported native format version {version}"),
            at: 0,
        });
    }
    let module = r.bit("header")?;
    let general = r.bit("header")?;
    let count = get_eg(&mut r, 3, "frame count")?;
    if count > max_frames as u64 {
        return Err(Error::LimitExceeded {
            what: "number of frames",
            limit: max_frames as u64,
        });
    }
    // Every frame takes at least one bit: a cheap bound before allocating.
    if count > (bytes.len() * 8 - r.bit_pos()) as u64 {
        return Err(Error::LengthMismatch {
            declared: count,
            actual: (bytes.len() * 8 - r.bit_pos()) as u64,
        });
    }
    let table = match (module, table) {
        (false, _) => None,
        (true, None) => {
            return Err(Error::Invalid {
                what: "module-relative trace needs an image table".into(),
                at: 0,
            })
        }
        (true, Some(t)) => {
            let fp = r.read(8, "fingerprint")? as u8;
            if fp != t.fingerprint() {
                return Err(Error::Invalid {
                    what: format!(
                        "trace was written against another image table (fingerprint {fp:#04x}, table has {:#04x})",
                        t.fingerprint()
                    ),
                    at: 1,
                });
            }
            Some(t)
        }
    };
    let frame0_pc = if !general && count > 0 {
        r.bit("frame kind")?
    } else {
        false
    };
    let mut ac = AddrCoder::new(table);
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count {
        enum K {
            Pc,
            Ra,
            Async,
        }
        let kind = if !general {
            if i == 0 && frame0_pc {
                K::Pc
            } else {
                K::Ra
            }
        } else if !r.bit("frame kind")? {
            K::Ra
        } else if !r.bit("frame kind")? {
            if r.bit("frame kind")? {
                K::Async
            } else {
                K::Pc
            }
        } else {
            let f = match r.read(2, "frame kind")? {
                0 => Frame::Lua(LuaFrameId(
                    u32::try_from(get_eg(&mut r, 6, "Lua frame id")?).map_err(|_| {
                        Error::Invalid {
                            what: "Lua frame id exceeds 32 bits".into(),
                            at: r.byte_pos(),
                        }
                    })?,
                )),
                1 => Frame::Omitted(get_eg(&mut r, 2, "omitted count")?),
                2 => Frame::Parent(get_eg(&mut r, 6, "parent fiber id")?),
                _ => Frame::Truncated,
            };
            out.push(Located {
                frame: f,
                image: None,
            });
            continue;
        };
        let (a, image) = ac.decode(&mut r)?;
        let frame = match kind {
            K::Pc => Frame::Pc(a),
            K::Ra => Frame::Ra(a),
            K::Async => Frame::Async(a),
        };
        out.push(Located { frame, image });
    }
    let used = r.bit_pos().div_ceil(8);
    if used != bytes.len() {
        return Err(Error::TrailingData { at: used });
    }
    let pad = (8 - r.bit_pos() % 8) % 8;
    if r.read(pad as u32, "padding")? != 0 {
        return Err(Error::Invalid {
            what: "non-zero padding bits".into(),
            at: used.saturating_sub(1),
        });
    }
    Ok(out)
}

/// The trace as a log line, `~n#` + base64.
pub fn to_line(frames: &[Frame], table: Option<&ImageTable>) -> String {
    format!("{N_LEAD}{}", base64::encode(&encode(frames, table)))
}

/// Decodes a `~n#` line (the lead-in is optional).
pub fn from_line(line: &str, table: Option<&ImageTable>) -> Result<Vec<Frame>, Error> {
    let t = line.trim();
    decode(&base64::decode(t.strip_prefix(N_LEAD).unwrap_or(t))?, table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ImageTable {
        ImageTable::new(vec![
            ImageRef {
                base: 0x5555_5555_4000,
                end: 0x5555_5560_0000,
                build_id: vec![0xab; 20],
                path: "/usr/bin/app".into(),
            },
            ImageRef {
                base: 0x7fff_f7d8_0000,
                end: 0x7fff_f7fa_0000,
                build_id: vec![0xcd; 20],
                path: "/lib/libc.so.6".into(),
            },
        ])
    }

    #[test]
    fn huffman_is_complete() {
        let kraft: f64 = LEN_CODE.iter().map(|&l| 0.5f64.powi(i32::from(l))).sum();
        assert_eq!(kraft, 1.0);
        for l in 0..=64u32 {
            let mut w = BitWriter::new();
            put_len(&mut w, l);
            let b = w.into_bytes();
            assert_eq!(get_len(&mut BitReader::new(&b)).unwrap(), l);
        }
    }

    #[test]
    fn eg_extremes() {
        for k in [0, 1, 2, 3, 6] {
            for v in [0, 1, 7, 8, 1000, u64::MAX >> 1, u64::MAX - 1, u64::MAX] {
                let mut w = BitWriter::new();
                put_eg(&mut w, v, k);
                let b = w.into_bytes();
                assert_eq!(get_eg(&mut BitReader::new(&b), k, "x").unwrap(), v);
            }
        }
    }

    #[test]
    fn exact_bytes_simple() {
        let f = [Frame::Pc(0x1000), Frame::Ra(0x1010)];
        // 0000 (version, mode, kinds) | EG3(2) = 1 010 | pc 1 | literal: 0001101 (13 bits),
        // 0x000 (12 bits below the leading one) | region 0 | L=5: 11111000 | + | 0000 | pad
        let b = encode(&f, None);
        assert_eq!(decode(&b, None).unwrap(), f);
        assert_eq!(b, vec![0x0a, 0x8d, 0x00, 0x07, 0xc0, 0x00]);
        assert_eq!(to_line(&f, None), "~n#Co0AB8AA");
        assert_eq!(encode(&[], None), vec![0x08]);
        assert_eq!(decode(&[0x08], None).unwrap(), []);
    }

    #[test]
    fn all_kinds_both_modes() {
        let t = table();
        let f = vec![
            Frame::Pc(0x5555_5555_6000),
            Frame::Lua(LuaFrameId(12)),
            Frame::Ra(0x7fff_f7d9_1234),
            Frame::Ra(0x5555_5555_6010),
            Frame::Async(0x1234),
            Frame::Omitted(u64::MAX),
            Frame::Ra(0),
            Frame::Ra(u64::MAX),
            Frame::Parent(7),
            Frame::Ra(0x7fff_f7d9_1234),
            Frame::Truncated,
        ];
        for tab in [None, Some(&t)] {
            let b = encode(&f, tab);
            assert_eq!(decode(&b, tab).unwrap(), f);
        }
        let loc = decode_located(&encode(&f, Some(&t)), Some(&t), 100).unwrap();
        let images: Vec<_> = loc.iter().map(|l| l.image).collect();
        assert_eq!(
            images,
            vec![
                Some(0),
                None,
                Some(1),
                Some(0),
                None,
                None,
                None,
                None,
                None,
                Some(1),
                None
            ]
        );
    }

    #[test]
    fn table_round_trip_and_checks() {
        let t = table();
        assert_eq!(t.find(0x5555_5555_4000), Some(0));
        assert_eq!(t.find(0x5555_5555_3fff), None);
        assert_eq!(t.find(0x7fff_f7f9_ffff), Some(1));
        assert_eq!(t.find(0x7fff_f7fa_0000), None);
        let line = t.to_line();
        assert_eq!(ImageTable::from_line(&line).unwrap(), t);
        let f = [Frame::Ra(0x5555_5555_6000)];
        let b = encode(&f, Some(&t));
        assert!(is_module_relative(&b));
        assert!(decode(&b, None).is_err());
        let mut other = t.images().to_vec();
        other[0].build_id[0] = 0;
        let other = ImageTable::new(other);
        assert_ne!(other.fingerprint(), t.fingerprint());
        assert!(matches!(
            decode(&b, Some(&other)),
            Err(Error::Invalid { at: 1, .. })
        ));
    }

    #[test]
    fn hostile_counts() {
        // Count EG3 with a huge prefix: rejected before allocating.
        assert!(decode(&[0x00, 0x00, 0x00, 0x01, 0xff], None).is_err());
        assert!(matches!(
            decode(
                &[0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00],
                None
            ),
            Err(Error::Invalid { .. }) | Err(Error::UnexpectedEnd { .. })
        ));
        assert!(matches!(decode(&[0xc0], None), Err(Error::Invalid { .. })));
        assert!(matches!(
            decode(&[0x08, 0x00], None),
            Err(Error::TrailingData { at: 1 })
        ));
        assert_eq!(decode(&[0x09, 0x00], None).unwrap(), [Frame::Ra(0)]);
        let mut b = encode(&[Frame::Ra(0), Frame::Ra(0)], None);
        assert_eq!(b.len(), 3);
        b[2] |= 1;
        assert!(matches!(
            decode(&b, None),
            Err(Error::Invalid { at: 2, .. })
        ));
    }
}
