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

use super::bits::BitReader;
use super::{base64, Error};
use crate::{Frame, LuaFrameId};

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

/// The longest code of [`LEN_CODE`].
const MAX_CODE_LEN: usize = 13;

struct Huffman {
    /// Code for each symbol, right-aligned.
    code: [u32; 65],
    /// Symbols sorted by (length, symbol).
    sorted: [u8; 65],
    /// For each length: (first code, index of its first symbol in `sorted`, count).
    per_len: [(u32, usize, u32); MAX_CODE_LEN + 1],
}

/// The canonical code of [`LEN_CODE`], built at compile time.
static HUFFMAN: Huffman = huffman();

const fn huffman() -> Huffman {
    let mut code = [0u32; 65];
    let mut sorted = [0u8; 65];
    let mut per_len = [(0u32, 0usize, 0u32); MAX_CODE_LEN + 1];
    let mut next: u32 = 0;
    let mut idx = 0;
    let mut len = 1;
    while len <= MAX_CODE_LEN {
        let first = next;
        let start = idx;
        let mut s = 0;
        while s < 65 {
            if LEN_CODE[s] as usize == len {
                sorted[idx] = s as u8;
                code[s] = next;
                next += 1;
                idx += 1;
            }
            s += 1;
        }
        per_len[len] = (first, start, next - first);
        next <<= 1;
        len += 1;
    }
    // Every symbol has a length in 1..=MAX_CODE_LEN.
    assert!(idx == 65);
    Huffman {
        code,
        sorted,
        per_len,
    }
}

fn get_len(r: &mut BitReader<'_>) -> Result<u32, Error> {
    let h = &HUFFMAN;
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

/// The encoder's MSB-first bit writer: the same bits as [`super::bits::BitWriter`], but
/// through a 64-bit accumulator whose whole bytes are stored (one 8-byte store) after each
/// write, instead of a loop over bytes with a push per byte.
struct AccWriter {
    /// Zero-filled output, at least 8 bytes longer than `pos`; truncated by `finish`.
    buf: Vec<u8>,
    /// Whole bytes written.
    pos: usize,
    /// Bits not yet counted in `pos`, left-aligned (the top `n` bits), the rest zero.
    acc: u64,
    /// Number of pending bits, < 8 between writes.
    n: u32,
}

impl AccWriter {
    /// Longest field of one [`AccWriter::put`].
    const MAX_PUT: u32 = 56;

    /// A writer whose buffer starts at `bytes` (it grows as needed).
    // Not `vec![0; n]`: that is glibc's calloc, which bypasses its per-thread cache (about
    // 8 ns more per trace than malloc and a memset).
    #[allow(clippy::slow_vector_initialization)]
    fn with_capacity(bytes: usize) -> Self {
        let mut buf = Vec::with_capacity(bytes.max(16));
        buf.resize(buf.capacity(), 0);
        Self {
            buf,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    /// Writes `v`, which has at most `k` ≤ 56 significant bits, as `k` bits MSB-first.
    #[inline(always)]
    fn put(&mut self, v: u64, k: u32) {
        debug_assert!(k <= Self::MAX_PUT && v >> k == 0);
        // n + k ≤ 63; the shift is 64 only when both are 0, and then v = 0 (wrapping is fine).
        self.acc |= v.wrapping_shl(64 - self.n - k);
        self.n += k;
        let bytes = self.acc.to_be_bytes();
        match self.buf.get_mut(self.pos..self.pos + 8) {
            Some(dst) => dst.copy_from_slice(&bytes),
            None => {
                self.buf = grown(std::mem::take(&mut self.buf));
                self.buf[self.pos..self.pos + 8].copy_from_slice(&bytes);
            }
        }
        let whole = self.n / 8;
        self.pos += whole as usize;
        self.acc <<= whole * 8;
        self.n %= 8;
    }

    /// Like [`AccWriter::put`] for up to 64 bits.
    #[inline(always)]
    fn put_long(&mut self, v: u64, k: u32) {
        if k > Self::MAX_PUT {
            self.put(v >> 32, k - 32);
            self.put(v & 0xffff_ffff, 32);
        } else {
            self.put(v, k);
        }
    }

    /// Like [`AccWriter::put`] for up to 128 bits (`v` may have bits above `k`: they are
    /// dropped).
    #[inline(always)]
    fn put_wide(&mut self, v: u128, mut k: u32) {
        while k > 32 {
            k -= 32;
            self.put(((v >> k) & 0xffff_ffff) as u64, 32);
        }
        self.put((v & ((1u128 << k) - 1)) as u64, k);
    }

    /// The bytes, the last one zero-padded.
    #[inline]
    fn finish(mut self) -> Vec<u8> {
        // The byte at `pos` already holds the pending bits (stored by the last `put`) or is
        // still zero.
        self.buf.truncate(self.pos + usize::from(self.n > 0));
        self.buf
    }
}

/// An [`AccWriter`]'s buffer, doubled (by value: a reference into the writer would keep its
/// accumulator out of registers).
#[cold]
#[inline(never)]
fn grown(mut buf: Vec<u8>) -> Vec<u8> {
    buf.resize(buf.len() * 2 + 16, 0);
    buf
}

/// Writes `v` in order-`k` exponential-Golomb (`k` ≤ 6): `n − 1` zeros, `q = (v >> k) + 1` in
/// its `n` bits, then the low `k` bits of `v`.
#[inline(always)]
fn put_eg(w: &mut AccWriter, v: u64, k: u32) {
    debug_assert!(k <= 6);
    let hi = v >> k;
    if hi < 1 << 24 {
        // q ≤ 2^24: n ≤ 25, 2n − 1 + k ≤ 55 bits in one write (the zeros are its top bits).
        let q = hi + 1;
        let n = bitlen(q);
        w.put((q << k) | (v & ((1 << k) - 1)), 2 * n - 1 + k);
    } else {
        // q has at most 65 bits.
        let q = u128::from(hi) + 1;
        let n = 128 - q.leading_zeros();
        w.put_wide(0, n - 1);
        w.put_wide((q << k) | u128::from(v & ((1 << k) - 1)), n + k);
    }
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

/// Writes `v` as a literal: its bit length `L` in 7 bits, then the `L − 1` bits below its
/// leading one.
#[inline(always)]
fn put_literal(w: &mut AccWriter, v: u64) {
    let l = bitlen(v);
    if l == 0 {
        w.put(0, 7);
        return;
    }
    let low = v ^ (1 << (l - 1));
    if l + 6 <= AccWriter::MAX_PUT {
        w.put((u64::from(l) << (l - 1)) | low, l + 6);
    } else {
        w.put(u64::from(l), 7);
        w.put_long(low, l - 1);
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

/// Writes the `pn`-bit `prefix`, then the delta from `from` to `to`: the Huffman code of its bit
/// length `L`, then (if `L` > 0) the sign and the `L − 1` bits below the leading one.
#[inline(always)]
fn put_delta(w: &mut AccWriter, prefix: u64, pn: u32, from: u64, to: u64) {
    let d = from.abs_diff(to);
    let l = bitlen(d);
    let clen = u32::from(LEN_CODE[l as usize]);
    // pn ≤ 7 (kind and region codes), clen ≤ 13.
    let head = (prefix << clen) | u64::from(HUFFMAN.code[l as usize]);
    let hn = pn + clen;
    if l == 0 {
        w.put(head, hn);
        return;
    }
    // The sign takes the place of the leading one.
    let tail = (d ^ (1 << (l - 1))) | (u64::from(to < from) << (l - 1));
    if hn + l <= AccWriter::MAX_PUT {
        w.put((head << l) | tail, hn + l);
    } else {
        w.put(head, hn);
        w.put_long(tail, l);
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
/// Returns the code and its length for a position below 4.
#[inline(always)]
fn pos_code(p: usize) -> (u64, u32) {
    debug_assert!(p < 4);
    (((1u64 << p) - 1) << 1, p as u32 + 1)
}

/// The code for another (or a new) region.
const POS_OTHER: (u64, u32) = (0b1111, 4);

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageTable {
    images: Vec<ImageRef>,
    /// Disjoint, sorted `(start, end, index)`: the image that [`ImageTable::find`] gives for
    /// the addresses of `[start, end)`, overlaps resolved.
    segments: Vec<(u64, u64, u32)>,
    /// [`ImageTable::fingerprint`], computed once.
    fingerprint: u8,
}

impl Default for ImageTable {
    fn default() -> Self {
        Self::new(Vec::new())
    }
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

/// [`ImageTable::fingerprint`] of these images.
fn fingerprint(images: &[ImageRef]) -> u8 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for im in images {
        eat(&im.base.to_le_bytes());
        eat(&im.end.to_le_bytes());
        eat(&(im.build_id.len() as u64).to_le_bytes());
        eat(&im.build_id);
    }
    (h ^ (h >> 8) ^ (h >> 16) ^ (h >> 24) ^ (h >> 32) ^ (h >> 40) ^ (h >> 48) ^ (h >> 56)) as u8
}

impl ImageTable {
    /// A table of these images; trace frames refer to them by their index here. Where images
    /// overlap, the one listed first wins.
    pub fn new(images: Vec<ImageRef>) -> Self {
        // Sweep over image starts and ends; between two event addresses, the lowest index of
        // the images covering them wins.
        let mut events: Vec<(u64, bool, u32)> = images
            .iter()
            .enumerate()
            .filter(|(_, im)| im.end > im.base)
            .flat_map(|(i, im)| [(im.base, true, i as u32), (im.end, false, i as u32)])
            .collect();
        events.sort_unstable();
        let mut covering = std::collections::BTreeSet::new();
        let mut segments: Vec<(u64, u64, u32)> = Vec::new();
        let mut e = 0;
        while e < events.len() {
            let at = events[e].0;
            while e < events.len() && events[e].0 == at {
                let (_, start, i) = events[e];
                if start {
                    covering.insert(i);
                } else {
                    covering.remove(&i);
                }
                e += 1;
            }
            // Some image still covers `at`, so an end event follows.
            if let Some(&i) = covering.first() {
                let next = events[e].0;
                match segments.last_mut() {
                    Some(last) if last.1 == at && last.2 == i => last.1 = next,
                    _ => segments.push((at, next, i)),
                }
            }
        }
        let fingerprint = fingerprint(&images);
        Self {
            images,
            segments,
            fingerprint,
        }
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
        self.segment(addr).map(|s| s.2 as usize)
    }

    /// The segment containing `addr`.
    #[inline]
    fn segment(&self, addr: u64) -> Option<(u64, u64, u32)> {
        let n = self.segments.partition_point(|&(b, _, _)| b <= addr);
        let s = *self.segments[..n].last()?;
        (addr < s.1).then_some(s)
    }

    /// 8-bit fingerprint of bases, ends and build ids (not paths), written into
    /// module-relative traces to catch decoding against the wrong table.
    pub fn fingerprint(&self) -> u8 {
        self.fingerprint
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

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
struct Region {
    /// Image index (module mode; `table.len()` = outside); unused in absolute mode.
    key: usize,
    last: u64,
}

/// Regions with a short code (list positions 0–3).
const SHORT: usize = 4;
const _: () = assert!(MAX_ANCHORS == SHORT);

/// Where a key is in the region list.
enum Slot {
    /// At this position (< [`SHORT`]).
    Short(usize),
    /// Further down, at this index of `rest`.
    Rest(usize),
    /// Not in the list.
    New,
}

/// The region list, kept as its first [`SHORT`] positions plus the others in any order: those
/// are all coded alike (`1111` and the image index), and a region taken from there moves to
/// the front, so their order never shows in a trace.
struct AddrCoder<'t> {
    table: Option<&'t ImageTable>,
    /// List positions 0..`len`.
    short: [Region; SHORT],
    len: usize,
    /// Module mode: the regions beyond position 3, unordered (absolute mode drops them).
    rest: Vec<Region>,
    /// Encoder, module mode: the table segment of the last address looked up, as (start, end,
    /// image index, image base).
    hit: (u64, u64, usize, u64),
}

impl<'t> AddrCoder<'t> {
    fn new(table: Option<&'t ImageTable>) -> Self {
        Self {
            table,
            short: [Region::default(); SHORT],
            len: 0,
            rest: Vec::new(),
            hit: (1, 0, 0, 0),
        }
    }

    #[inline(always)]
    fn slot(&self, key: usize) -> Slot {
        match self.short[..self.len].iter().position(|r| r.key == key) {
            Some(p) => Slot::Short(p),
            None => match self.rest.iter().position(|r| r.key == key) {
                Some(i) => Slot::Rest(i),
                None => Slot::New,
            },
        }
    }

    /// Moves the region at short position `p` to the front with value `last`.
    #[inline(always)]
    fn touch_short(&mut self, p: usize, last: u64) {
        let key = self.short[p].key;
        let mut q = p;
        while q > 0 {
            self.short[q] = self.short[q - 1];
            q -= 1;
        }
        self.short[0] = Region { key, last };
    }

    /// Puts a region taken from `rest` (or a new one) at the front.
    fn push_front(&mut self, r: Region) {
        if self.len == SHORT {
            let out = self.short[SHORT - 1];
            if self.table.is_some() {
                self.rest.push(out);
            }
        } else {
            self.len += 1;
        }
        self.short.copy_within(..SHORT - 1, 1);
        self.short[0] = r;
    }

    /// Moves the region at `slot` (or a new one) to the front with value `last`.
    fn touch(&mut self, slot: Slot, key: usize, last: u64) {
        match slot {
            Slot::Short(p) => self.touch_short(p, last),
            Slot::Rest(i) => {
                self.rest.swap_remove(i);
                self.push_front(Region { key, last });
            }
            Slot::New => self.push_front(Region { key, last }),
        }
    }

    /// The image index of `addr` (`table.len()` if outside every image) and its value.
    #[inline(always)]
    fn locate(&mut self, t: &ImageTable, addr: u64) -> (usize, u64) {
        let (start, end, _, _) = self.hit;
        if addr < start || addr >= end {
            match t.segment(addr) {
                Some((start, end, i)) => {
                    let i = i as usize;
                    self.hit = (start, end, i, t.images[i].base);
                }
                None => return (t.len(), addr),
            }
        }
        (self.hit.2, addr - self.hit.3)
    }

    /// Writes the `pn`-bit `prefix` (a frame kind, or nothing), then `addr` (module mode, `t`
    /// is the coder's table).
    #[inline(always)]
    fn encode_module(
        &mut self,
        t: &ImageTable,
        w: &mut AccWriter,
        prefix: u64,
        pn: u32,
        addr: u64,
    ) {
        let (key, value) = self.locate(t, addr);
        if self.len > 0 && self.short[0].key == key {
            // The usual case: the same image as the last address.
            put_delta(w, prefix << 1, pn + 1, self.short[0].last, value);
            self.short[0].last = value;
            return;
        }
        let slot = self.slot(key);
        match slot {
            Slot::Short(p) => {
                let (code, n) = pos_code(p);
                put_delta(w, (prefix << n) | code, pn + n, self.short[p].last, value);
                self.touch_short(p, value);
                return;
            }
            _ if self.len == 0 => w.put(prefix, pn),
            _ => w.put((prefix << POS_OTHER.1) | POS_OTHER.0, pn + POS_OTHER.1),
        }
        put_eg(w, key as u64, 1);
        match slot {
            Slot::Rest(i) => put_delta(w, 0, 0, self.rest[i].last, value),
            _ => put_literal(w, value),
        }
        self.touch(slot, key, value);
    }

    /// Writes the `pn`-bit `prefix` (a frame kind, or nothing), then `addr` (absolute mode).
    #[inline(always)]
    fn encode_absolute(&mut self, w: &mut AccWriter, prefix: u64, pn: u32, addr: u64) {
        if self.len == 0 {
            w.put(prefix, pn);
            put_literal(w, addr);
            self.push_front(Region { key: 0, last: addr });
            return;
        }
        // The cheapest anchor, the first of equals.
        let mut best = (u32::MAX, 0);
        for (p, r) in self.short[..self.len].iter().enumerate() {
            let c = pos_cost(p) + delta_cost(r.last, addr);
            if c < best.0 {
                best = (c, p);
            }
        }
        let p = best.1;
        let last = self.short[p].last;
        if bitlen(last.abs_diff(addr)) <= NEW_ANCHOR_BITS {
            let (code, n) = pos_code(p);
            put_delta(w, (prefix << n) | code, pn + n, last, addr);
            self.touch_short(p, addr);
        } else {
            w.put((prefix << POS_OTHER.1) | POS_OTHER.0, pn + POS_OTHER.1);
            put_literal(w, addr);
            self.push_front(Region { key: 0, last: addr });
        }
    }

    /// Decodes one address; returns it with its image index (module mode).
    fn decode(&mut self, r: &mut BitReader<'_>) -> Result<(u64, Option<usize>), Error> {
        let first = self.len == 0;
        let at = r.byte_pos();
        let pos = if first { None } else { get_pos(r)? };
        if let Some(p) = pos {
            if p >= self.len {
                return Err(Error::Invalid {
                    what: format!("region {p} of {}", self.len),
                    at,
                });
            }
        }
        match self.table {
            None => {
                let addr = match pos {
                    Some(p) => {
                        let addr = get_delta(r, self.short[p].last)?;
                        self.touch_short(p, addr);
                        addr
                    }
                    None => {
                        let addr = get_literal(r)?;
                        self.push_front(Region { key: 0, last: addr });
                        addr
                    }
                };
                Ok((addr, None))
            }
            Some(t) => {
                let (key, slot) = match pos {
                    Some(p) => (self.short[p].key, Slot::Short(p)),
                    None => {
                        let k = get_eg(r, 1, "image index")?;
                        if k > t.len() as u64 {
                            return Err(Error::Invalid {
                                what: format!("image {k} of a table of {}", t.len()),
                                at,
                            });
                        }
                        let k = k as usize;
                        let slot = self.slot(k);
                        if let Slot::Short(_) = slot {
                            return Err(Error::Invalid {
                                what: "image named by index although it has a short code".into(),
                                at,
                            });
                        }
                        (k, slot)
                    }
                };
                let value = match slot {
                    Slot::Short(p) => get_delta(r, self.short[p].last)?,
                    Slot::Rest(i) => get_delta(r, self.rest[i].last)?,
                    Slot::New => get_literal(r)?,
                };
                self.touch(slot, key, value);
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
    match frames.split_first() {
        None => true,
        Some((first, rest)) => {
            matches!(first, Frame::Pc(_) | Frame::Ra(_))
                && rest.iter().all(|f| matches!(f, Frame::Ra(_)))
        }
    }
}

/// Encodes a trace; module-relative when `table` is given (see the module docs).
pub fn encode(frames: &[Frame], table: Option<&ImageTable>) -> Vec<u8> {
    // About 3 bytes a frame are usual; the writer grows if needed.
    let mut w = AccWriter::with_capacity(16 + 4 * frames.len());
    let general = !is_simple(frames);
    w.put(
        (VERSION << 2) | (u64::from(table.is_some()) << 1) | u64::from(general),
        4,
    );
    put_eg(&mut w, frames.len() as u64, 3);
    if let Some(t) = table {
        w.put(u64::from(t.fingerprint()), 8);
    }
    if !general {
        if let Some(f) = frames.first() {
            w.put(u64::from(matches!(f, Frame::Pc(_))), 1);
        }
    }
    let mut ac = AddrCoder::new(table);
    // One loop per mode and frame shape, each with its address coder inlined.
    match (table, general) {
        (Some(t), false) => {
            put_frames::<false>(&mut w, frames, |w, p, n, a| ac.encode_module(t, w, p, n, a))
        }
        (Some(t), true) => {
            put_frames::<true>(&mut w, frames, |w, p, n, a| ac.encode_module(t, w, p, n, a))
        }
        (None, false) => {
            put_frames::<false>(&mut w, frames, |w, p, n, a| ac.encode_absolute(w, p, n, a))
        }
        (None, true) => {
            put_frames::<true>(&mut w, frames, |w, p, n, a| ac.encode_absolute(w, p, n, a))
        }
    }
    w.finish()
}

/// Writes the frames; `addr(w, prefix, prefix_len, address)` writes an address after its frame
/// kind code (empty in a simple trace).
#[inline(always)]
fn put_frames<const GENERAL: bool>(
    w: &mut AccWriter,
    frames: &[Frame],
    mut addr: impl FnMut(&mut AccWriter, u64, u32, u64),
) {
    for f in frames {
        let (kind, kn) = if !GENERAL {
            (0, 0)
        } else {
            match f {
                Frame::Ra(_) => (0b0, 1),
                Frame::Pc(_) => (0b100, 3),
                Frame::Async(_) => (0b101, 3),
                Frame::Lua(LuaFrameId(id)) => {
                    w.put(0b1100, 4);
                    put_eg(w, u64::from(*id), 6);
                    continue;
                }
                Frame::Omitted(n) => {
                    w.put(0b1101, 4);
                    put_eg(w, *n, 2);
                    continue;
                }
                Frame::Parent(id) => {
                    w.put(0b1110, 4);
                    put_eg(w, *id, 6);
                    continue;
                }
                Frame::Truncated => {
                    w.put(0b1111, 4);
                    continue;
                }
            }
        };
        if let Some(a) = f.address() {
            addr(w, kind, kn, a);
        }
    }
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
        assert_eq!(LEN_CODE.iter().max(), Some(&(MAX_CODE_LEN as u8)));
        for l in 0..=64u32 {
            let mut w = AccWriter::with_capacity(0);
            w.put(
                u64::from(HUFFMAN.code[l as usize]),
                u32::from(LEN_CODE[l as usize]),
            );
            let b = w.finish();
            assert_eq!(get_len(&mut BitReader::new(&b)).unwrap(), l);
        }
    }

    /// A small deterministic generator (xorshift64*).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// A number of random bit length.
        fn num(&mut self) -> u64 {
            self.next() >> self.below(64)
        }
    }

    #[test]
    fn acc_writer_matches_bit_writer() {
        let mut r = Rng(0x1234_5678_9abc_def1);
        for _ in 0..2000 {
            let mut w = AccWriter::with_capacity(r.below(4) as usize);
            let mut reference = crate::codec::bits::BitWriter::new();
            for _ in 0..r.below(100) {
                let v = r.next();
                match r.below(3) {
                    0 => {
                        let k = r.below(57) as u32;
                        w.put(v & ((1 << k) - 1), k);
                        reference.write(v, k);
                    }
                    1 => {
                        let k = r.below(65) as u32;
                        w.put_long(if k == 64 { v } else { v & ((1 << k) - 1) }, k);
                        reference.write(v, k);
                    }
                    _ => {
                        let hi = r.next();
                        let k = r.below(129) as u32;
                        w.put_wide((u128::from(hi) << 64) | u128::from(v), k);
                        reference.write(hi, k.saturating_sub(64));
                        reference.write(v, k.min(64));
                    }
                }
            }
            assert_eq!(w.finish(), reference.into_bytes());
        }
    }

    #[test]
    fn eg_extremes() {
        for k in [0, 1, 2, 3, 6] {
            for v in [
                0,
                1,
                7,
                8,
                1000,
                (1 << (24 + k)) - 1,
                1 << (24 + k),
                u64::MAX >> 1,
                u64::MAX - 1,
                u64::MAX,
            ] {
                let mut w = AccWriter::with_capacity(0);
                put_eg(&mut w, v, k);
                let b = w.finish();
                let mut r = BitReader::new(&b);
                assert_eq!(get_eg(&mut r, k, "x").unwrap(), v);
                // Nothing but padding is left.
                assert!(b.len() * 8 - r.bit_pos() < 8);
            }
        }
    }

    #[test]
    fn find_picks_the_first_listed_image() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let images: Vec<ImageRef> = (0..r.below(8))
                .map(|_| {
                    let base = r.below(64);
                    ImageRef {
                        base,
                        end: base + r.below(24),
                        ..ImageRef::default()
                    }
                })
                .collect();
            let t = ImageTable::new(images.clone());
            for addr in 0..100 {
                let want = images
                    .iter()
                    .position(|im| im.base <= addr && addr < im.end);
                assert_eq!(t.find(addr), want, "{addr} in {images:?}");
            }
        }
        let edge = ImageTable::new(vec![ImageRef {
            base: u64::MAX - 1,
            end: u64::MAX,
            ..ImageRef::default()
        }]);
        assert_eq!(edge.find(u64::MAX - 1), Some(0));
        assert_eq!(edge.find(u64::MAX), None);
        assert_eq!(ImageTable::default(), ImageTable::new(Vec::new()));
    }

    /// Pins the encoder's output byte for byte: an FNV-1a hash of the encodings of many random
    /// traces in both modes, as the bit-at-a-time encoder wrote them. A new value means a new
    /// format.
    #[test]
    fn encodings_unchanged() {
        let mut r = Rng(0x0123_4567_89ab_cdef);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for _ in 0..3000 {
            let images: Vec<ImageRef> = (0..r.below(6))
                .map(|i| {
                    let base = match r.below(3) {
                        0 => r.num(),
                        _ => 0x5555_0000_0000 + r.below(1 << 34),
                    };
                    ImageRef {
                        base,
                        end: base.saturating_add(r.num() >> r.below(40)),
                        build_id: vec![i as u8; r.below(21) as usize],
                        path: String::new(),
                    }
                })
                .collect();
            let anchors: Vec<u64> = images.iter().flat_map(|im| [im.base, im.end]).collect();
            let table = ImageTable::new(images);
            let general = r.below(2) == 0;
            let mut prev = 0x5555_0000_0000 + r.below(1 << 30);
            let frames: Vec<Frame> = (0..r.below(60))
                .map(|i| {
                    let a = match r.below(8) {
                        0 => r.num(),
                        1 => [0, 1, u64::MAX][r.below(3) as usize],
                        2 | 3 => prev.wrapping_add(r.num() >> 20),
                        4 => prev.wrapping_sub(r.num() >> 20),
                        5 => prev,
                        _ if anchors.is_empty() => r.num(),
                        _ => anchors[r.below(anchors.len() as u64) as usize]
                            .wrapping_add(r.num() >> 30),
                    };
                    let f = match (general, r.below(12)) {
                        (false, 0) if i == 0 => Frame::Pc(a),
                        (false, _) => Frame::Ra(a),
                        (true, 0) => Frame::Pc(a),
                        (true, 1) => Frame::Async(a),
                        (true, 2) => Frame::Lua(LuaFrameId(r.num() as u32)),
                        (true, 3) => Frame::Omitted(r.num()),
                        (true, 4) => Frame::Parent(r.num()),
                        (true, 5) => Frame::Truncated,
                        _ => Frame::Ra(a),
                    };
                    if f.address().is_some() {
                        prev = a;
                    }
                    f
                })
                .collect();
            for tab in [None, Some(&table)] {
                let b = encode(&frames, tab);
                assert_eq!(decode(&b, tab).unwrap(), frames);
                for x in b.iter().chain(&(b.len() as u64).to_le_bytes()) {
                    h = (h ^ u64::from(*x)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        assert_eq!(h, 0x3acd_06af_fbdb_6f01);
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
