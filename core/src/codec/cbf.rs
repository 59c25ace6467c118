//! Swift's Compact Backtrace Format (CBF) v0, for 16-, 32- and 64-bit words.
//!
//! # Format
//!
//! An info byte `(version << 2) | size` (size 0/1/2 = 16/32/64-bit), then byte instructions:
//!
//! | byte | meaning |
//! |---|---|
//! | `0000_0000` | end |
//! | `0000_0001` | trunc: the trace was truncated here (ends the data) |
//! | `0001_accc` / `0010_accc` / `0011_accc` | pc / ra / async frame; `ccc + 1` big-endian address bytes follow, sign-extended from the first byte's top bit; `a` = absolute, else relative to the previous address (which starts at 0), wrapping at the word size |
//! | `01x_ccccc` | omit: `x = 0` → `ccccc + 1` frames; `x = 1` → `ccccc + 1` big-endian count bytes follow |
//! | `1000_xccc` | rep: repeat the previous frame `ccc + 1` times, or (`x = 1`) a count of `ccc + 1` big-endian bytes |
//!
//! # Mapping onto [`Frame`]
//!
//! `pc`/`ra`/`async` ↔ [`Frame::Pc`]/[`Frame::Ra`]/[`Frame::Async`], `omit n` ↔
//! [`Frame::Omitted`], `trunc` ↔ a final [`Frame::Truncated`]. [`Frame::Lua`] and
//! [`Frame::Parent`] have no CBF form: encoding them fails, as does a `Truncated` that is not
//! last (CBF's `trunc` ends the data) or an address wider than the word size.
//!
//! # Encoder choices (those of Swift's `CompactBacktraceFormat.Encoder`)
//!
//! Each address is written in the minimal number of bytes whose sign extension gives it back;
//! absolute only if strictly shorter than relative, so the first frame is relative to 0. Runs
//! of identical frames (kind and value, omit markers too) become `rep` of the extra copies:
//! inline up to 8, else a minimal big-endian count. Omit counts 1–31 are inline, others external
//! (0, which Swift cannot encode, is an external count of one zero byte). The data ends with
//! `end` unless it ends with `trunc`.
//!
//! # Decoder, and how a result can be wrong
//!
//! Accepts anything the format allows, canonical or not (absolute first frame, oversized
//! counts, no final `end` — the length is known), so re-encoding a decoded trace can give other
//! bytes. Rejects with an [`Error`] what Swift's decoder turns into a silent `.truncated`:
//! reserved opcodes, data ending inside an instruction, `rep` before any frame, a zero `rep`
//! count, counts beyond 64 bits, bytes after `end`/`trunc`, and traces of more than
//! [`DEFAULT_MAX_FRAMES`] (or the caller's limit) frames, which bounds memory: a 3-byte input
//! can otherwise ask for 2^64 repeats.

use super::Error;
use crate::Frame;

/// Default cap on the frames one decode may produce (16 MiB of [`Frame`]s).
pub const DEFAULT_MAX_FRAMES: usize = 1 << 20;

/// Machine word size of a CBF trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WordSize {
    /// 16-bit addresses.
    W16,
    /// 32-bit addresses.
    W32,
    /// 64-bit addresses.
    W64,
}

impl WordSize {
    /// Bytes per word.
    pub fn bytes(self) -> u32 {
        match self {
            WordSize::W16 => 2,
            WordSize::W32 => 4,
            WordSize::W64 => 8,
        }
    }

    fn bits(self) -> u32 {
        self.bytes() * 8
    }

    fn mask(self) -> u64 {
        match self {
            WordSize::W64 => u64::MAX,
            w => (1u64 << w.bits()) - 1,
        }
    }

    fn code(self) -> u8 {
        match self {
            WordSize::W16 => 0,
            WordSize::W32 => 1,
            WordSize::W64 => 2,
        }
    }
}

/// Minimal number of bytes whose sign extension (within a word of `bits`) gives back `v`.
fn signed_count(v: u64, bits: u32) -> u32 {
    // Shift the word to the top of a u64 so that leading ones/zeros count within the word.
    let top = v << (64 - bits);
    let same = if (top as i64) < 0 {
        (!top).leading_zeros()
    } else {
        top.leading_zeros()
    }
    .min(bits);
    // One sign bit must stay; every 8 redundant bits save a byte.
    bits / 8 - (same - 1) / 8
}

/// Minimal number of big-endian bytes holding `v` (at least 1).
fn unsigned_count(v: u64) -> u32 {
    (8 - v.leading_zeros() / 8).max(1)
}

fn push_be(out: &mut Vec<u8>, v: u64, n: u32) {
    for i in (0..n).rev() {
        out.push((v >> (8 * i)) as u8);
    }
}

/// Encodes frames as CBF for the given word size (see the module docs for what fails).
pub fn encode(frames: &[Frame], word: WordSize) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(1 + frames.len() * 3);
    out.push(word.code());
    let mut last_addr: u64 = 0;
    let mut i = 0;
    while i < frames.len() {
        let f = frames[i];
        if i > 0 && frames[i - 1] == f && f != Frame::Truncated {
            let run = frames[i..].iter().take_while(|&&g| g == f).count();
            if run <= 8 {
                out.push(0x80 | (run as u8 - 1));
            } else {
                let n = unsigned_count(run as u64);
                out.push(0x88 | (n as u8 - 1));
                push_be(&mut out, run as u64, n);
            }
            i += run;
            continue;
        }
        match f {
            Frame::Pc(a) | Frame::Ra(a) | Frame::Async(a) => {
                if a & !word.mask() != 0 {
                    return Err(Error::NotRepresentable(format!(
                        "address {a:#x} is wider than {} bits",
                        word.bits()
                    )));
                }
                let op: u8 = match f {
                    Frame::Pc(_) => 0x10,
                    Frame::Ra(_) => 0x20,
                    _ => 0x30,
                };
                let delta = a.wrapping_sub(last_addr) & word.mask();
                let abs_n = signed_count(a, word.bits());
                let rel_n = signed_count(delta, word.bits());
                let (abs, v, n) = if abs_n < rel_n {
                    (true, a, abs_n)
                } else {
                    (false, delta, rel_n)
                };
                out.push(op | if abs { 0x08 } else { 0 } | (n as u8 - 1));
                push_be(&mut out, v, n);
                last_addr = a;
            }
            Frame::Omitted(n) => {
                if (1..=31).contains(&n) {
                    out.push(0x40 | (n as u8 - 1));
                } else {
                    let c = unsigned_count(n);
                    if c > word.bytes() {
                        return Err(Error::NotRepresentable(format!(
                            "omit count {n} is wider than {} bits",
                            word.bits()
                        )));
                    }
                    out.push(0x60 | (c as u8 - 1));
                    push_be(&mut out, n, c);
                }
            }
            Frame::Truncated => {
                if i + 1 != frames.len() {
                    return Err(Error::NotRepresentable(
                        "a truncation marker before the last frame (CBF's trunc ends the data)"
                            .into(),
                    ));
                }
                out.push(0x01);
                return Ok(out);
            }
            Frame::Lua(_) => {
                return Err(Error::NotRepresentable("CBF has no Lua frames".into()));
            }
            Frame::Parent(_) => {
                return Err(Error::NotRepresentable(
                    "CBF has no parent-fiber marker".into(),
                ));
            }
        }
        i += 1;
    }
    out.push(0x00);
    Ok(out)
}

/// A decoded CBF trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CbfTrace {
    /// Word size from the info byte.
    pub word: WordSize,
    /// The frames, innermost first; a final [`Frame::Truncated`] stands for `trunc`.
    pub frames: Vec<Frame>,
}

/// Decodes CBF bytes, producing at most [`DEFAULT_MAX_FRAMES`] frames.
pub fn decode(bytes: &[u8]) -> Result<CbfTrace, Error> {
    decode_with_limit(bytes, DEFAULT_MAX_FRAMES)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], Error> {
        if self.bytes.len() - self.pos < n {
            return Err(Error::UnexpectedEnd {
                what,
                at: self.bytes.len(),
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A zero-extended big-endian count of `n` bytes.
    fn count(&mut self, n: usize, what: &'static str) -> Result<u64, Error> {
        let at = self.pos;
        let mut v: u64 = 0;
        for &b in self.take(n, what)? {
            if v >> 56 != 0 {
                return Err(Error::Invalid {
                    what: format!("{what} does not fit in 64 bits"),
                    at,
                });
            }
            v = (v << 8) | u64::from(b);
        }
        Ok(v)
    }
}

/// Decodes CBF bytes, failing with [`Error::LimitExceeded`] past `max_frames` frames.
pub fn decode_with_limit(bytes: &[u8], max_frames: usize) -> Result<CbfTrace, Error> {
    let Some(&info) = bytes.first() else {
        return Err(Error::UnexpectedEnd {
            what: "info byte",
            at: 0,
        });
    };
    let word = match (info >> 2, info & 3) {
        (0, 0) => WordSize::W16,
        (0, 1) => WordSize::W32,
        (0, 2) => WordSize::W64,
        (0, _) => {
            return Err(Error::Invalid {
                what: "reserved word size 3".into(),
                at: 0,
            })
        }
        (v, _) => {
            return Err(Error::Invalid {
                what: format!("unsupported CBF version {v}"),
                at: 0,
            })
        }
    };
    let mut r = Reader { bytes, pos: 1 };
    let mut frames: Vec<Frame> = Vec::new();
    let mut last_addr: u64 = 0;
    let too_many = || Error::LimitExceeded {
        what: "number of frames",
        limit: max_frames as u64,
    };
    while r.pos < bytes.len() {
        let at = r.pos;
        let op = bytes[at];
        r.pos += 1;
        let frame = match op {
            0x00 | 0x01 => {
                if op == 0x01 {
                    if frames.len() >= max_frames {
                        return Err(too_many());
                    }
                    frames.push(Frame::Truncated);
                }
                if r.pos != bytes.len() {
                    return Err(Error::TrailingData { at: r.pos });
                }
                return Ok(CbfTrace { word, frames });
            }
            0x10..=0x3f => {
                let n = usize::from(op & 7) + 1;
                let data = r.take(n, "address")?;
                let mut v: u64 = if data[0] & 0x80 != 0 { u64::MAX } else { 0 };
                for &b in data {
                    v = (v << 8) | u64::from(b);
                }
                let a = if op & 0x08 != 0 {
                    v
                } else {
                    last_addr.wrapping_add(v)
                } & word.mask();
                last_addr = a;
                match op >> 4 {
                    1 => Frame::Pc(a),
                    2 => Frame::Ra(a),
                    _ => Frame::Async(a),
                }
            }
            0x40..=0x7f => {
                let c = u64::from(op & 0x1f) + 1;
                if op & 0x20 == 0 {
                    Frame::Omitted(c)
                } else {
                    Frame::Omitted(r.count(c as usize, "omit count")?)
                }
            }
            0x80..=0x8f => {
                let c = u64::from(op & 7) + 1;
                let n = if op & 0x08 == 0 {
                    c
                } else {
                    r.count(c as usize, "rep count")?
                };
                let Some(&prev) = frames.last() else {
                    return Err(Error::Invalid {
                        what: "rep before any frame".into(),
                        at,
                    });
                };
                if n == 0 {
                    return Err(Error::Invalid {
                        what: "rep count 0".into(),
                        at,
                    });
                }
                if n > (max_frames - frames.len()) as u64 {
                    return Err(too_many());
                }
                frames.extend(std::iter::repeat_n(prev, n as usize));
                continue;
            }
            _ => {
                return Err(Error::Invalid {
                    what: format!("reserved CBF opcode {op:#04x}"),
                    at,
                })
            }
        };
        if frames.len() >= max_frames {
            return Err(too_many());
        }
        frames.push(frame);
    }
    Ok(CbfTrace { word, frames })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(signed_count(0, 64), 1);
        assert_eq!(signed_count(0x7f, 64), 1);
        assert_eq!(signed_count(0x80, 64), 2);
        assert_eq!(signed_count(u64::MAX, 64), 1);
        assert_eq!(signed_count(0xffff_ffff_ffff_ff00, 64), 2);
        assert_eq!(signed_count(0xffff, 16), 1);
        assert_eq!(signed_count(0x8000, 16), 2);
        assert_eq!(signed_count(0x7fff, 16), 2);
        assert_eq!(signed_count(0xffff_ff80, 32), 1);
        assert_eq!(signed_count(1 << 63, 64), 8);
        assert_eq!(unsigned_count(0), 1);
        assert_eq!(unsigned_count(0x100), 2);
        assert_eq!(unsigned_count(u64::MAX), 8);
    }

    #[test]
    fn swift_hand_vectors() {
        // pc abs 0x7f, then rep with 3-byte count 0x100001, then end: 1,048,578 frames.
        let b = [0x02, 0x18, 0x7f, 0x8a, 0x10, 0x00, 0x01, 0x00];
        assert_eq!(
            decode(&b),
            Err(Error::LimitExceeded {
                what: "number of frames",
                limit: 1 << 20
            })
        );
        let t = decode_with_limit(&b, 2_000_000).unwrap();
        assert_eq!(t.frames.len(), 1_048_578);
        assert!(t.frames.iter().all(|&f| f == Frame::Pc(0x7f)));
        // Same, cut inside the count.
        assert_eq!(
            decode(&[0x02, 0x18, 0x7f, 0x8a, 0x10, 0x00]),
            Err(Error::UnexpectedEnd {
                what: "rep count",
                at: 6
            })
        );
    }

    #[test]
    fn word_sizes() {
        let f = [Frame::Pc(0xffff), Frame::Ra(0x10)];
        let b = encode(&f, WordSize::W16).unwrap();
        assert_eq!(b, vec![0x00, 0x10, 0xff, 0x20, 0x11, 0x00]);
        assert_eq!(decode(&b).unwrap().frames, f);
        assert_eq!(decode(&b).unwrap().word, WordSize::W16);
        let f = [Frame::Pc(0xffff_ffff), Frame::Ra(0x8000_0000)];
        let b = encode(&f, WordSize::W32).unwrap();
        // 0x80000000 is 4 bytes absolute and 4 relative: the tie goes to relative.
        assert_eq!(
            b,
            vec![0x01, 0x10, 0xff, 0x23, 0x80, 0x00, 0x00, 0x01, 0x00]
        );
        assert_eq!(decode(&b).unwrap().frames, f);
        assert!(encode(&[Frame::Pc(0x1_0000)], WordSize::W16).is_err());
        assert!(encode(&[Frame::Omitted(0x1_0000)], WordSize::W16).is_err());
    }

    #[test]
    fn markers() {
        let f = [
            Frame::Omitted(0),
            Frame::Omitted(31),
            Frame::Omitted(32),
            Frame::Omitted(32),
        ];
        let b = encode(&f, WordSize::W64).unwrap();
        assert_eq!(b, vec![0x02, 0x60, 0x00, 0x5e, 0x60, 0x20, 0x80, 0x00]);
        assert_eq!(decode(&b).unwrap().frames, f);
        assert!(encode(&[Frame::Truncated, Frame::Pc(1)], WordSize::W64).is_err());
        assert!(encode(&[Frame::Lua(crate::LuaFrameId(1))], WordSize::W64).is_err());
        assert!(encode(&[Frame::Parent(1)], WordSize::W64).is_err());
        assert_eq!(encode(&[], WordSize::W64).unwrap(), vec![0x02, 0x00]);
    }

    #[test]
    fn decode_errors() {
        assert!(matches!(decode(&[]), Err(Error::UnexpectedEnd { .. })));
        assert!(matches!(decode(&[0x03]), Err(Error::Invalid { at: 0, .. })));
        assert!(matches!(decode(&[0x06]), Err(Error::Invalid { at: 0, .. })));
        assert!(matches!(
            decode(&[0x02, 0x02]),
            Err(Error::Invalid { at: 1, .. })
        ));
        assert!(matches!(
            decode(&[0x02, 0x90]),
            Err(Error::Invalid { at: 1, .. })
        ));
        assert!(matches!(
            decode(&[0x02, 0x80]),
            Err(Error::Invalid { at: 1, .. })
        ));
        assert!(matches!(
            decode(&[0x02, 0x10, 0x01, 0x88, 0x00]),
            Err(Error::Invalid { at: 3, .. })
        ));
        assert_eq!(
            decode(&[0x02, 0x00, 0x00]),
            Err(Error::TrailingData { at: 2 })
        );
        assert!(matches!(
            decode(&[0x02, 0x68, 1, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(Error::Invalid { at: 2, .. })
        ));
        assert_eq!(
            decode(&[0x02, 0x17, 1]),
            Err(Error::UnexpectedEnd {
                what: "address",
                at: 3
            })
        );
        // No `end`: accepted, the length is known.
        assert_eq!(decode(&[0x02, 0x10, 0x05]).unwrap().frames, [Frame::Pc(5)]);
        // Absolute first frame, 8-byte kernel address.
        assert_eq!(
            decode(&[0x02, 0x18, 0x80]).unwrap().frames,
            [Frame::Pc(0xffff_ffff_ffff_ff80)]
        );
    }
}
