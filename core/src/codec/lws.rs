//! The libwebsockets compressed backtrace (`lws_backtrace` / `lws_alloc_metadata`), bit-exact,
//! and its log convention (`~m#` + base64, `~b#size: N, 0x… 0x… `).
//!
//! # Wire format
//!
//! Every field of `n` bits is written MSB-first and followed by one pad bit (lws's writer loops
//! `n + 1` times; the documentation does not mention this). Fields, in order:
//!
//! | field | bits (+1 pad) |
//! |---|---|
//! | depth | 5 |
//! | per entry: flag (0 literal, 1 delta) | 1 |
//! | literal: `ql`, then the address | 6, `ql` |
//! | delta: `back − 1`, sign (1 = subtract), `q`, then `d` | 3, 1, 6, `q` |
//! | size bit count `s`, then the size | 6, `s` |
//!
//! then zero bits up to a byte boundary, then a 16-bit big-endian count of all bytes including
//! these two. `sigbits(v) = max(1, bit_length(v))`.
//!
//! # Encoder choices (copied from lws so that output is byte-identical)
//!
//! For entry `n > 0` the candidates are entries `max(0, n−8) … n−1`; the one with the smallest
//! absolute difference wins, ties going to the earliest (farthest back). A delta is written only
//! if that winner is not entry 0 (stock lws tests `hit` for truthiness) and `q + 11 < ql + 7`;
//! otherwise a literal. Pad bits are written as 0.
//!
//! # Differences from stock lws, and how a result can be wrong
//!
//! * 64-bit clean: stock lws shifts an `int`, so values ≥ 2^31 come out garbled on 64-bit hosts
//!   and its decoder sign-extends. For values < 2^31 our output is byte-identical to stock lws;
//!   for larger values it is what lws would write with the shift fixed, which stock lws tools
//!   will misread.
//! * Bit-count fields are 6 bits wide, so a literal or delta needs fewer than 64 significant
//!   bits: encoding fails ([`Error::NotRepresentable`]) if a value ≥ 2^63 would have to be
//!   written.
//! * Depth is a 5-bit field: at most [`MAX_DEPTH`] = 31 entries. [`LwsTrace::from_frames`] keeps
//!   the innermost 31 native frames, as lws's capture does; [`LwsTrace::encode`] refuses more.
//! * The decoder ignores the value of pad bits (gcc -O3 builds of lws set some), so two blobs can
//!   decode to the same trace; re-encoding gives the canonical blob. It rejects deltas that would
//!   leave the 64-bit range (stock lws wraps) and bytes left over after the last field.
//! * lws records raw `_Unwind_GetIP` values: return addresses, not adjusted. [`LwsTrace::to_frames`]
//!   therefore yields [`Frame::Ra`] for every entry.

use super::bits::{BitReader, BitSink, BitWriter, SliceBitWriter};
use super::{base64, Error};
use crate::Frame;
use std::fmt::Write as _;

/// Most entries an lws blob can hold (the depth field has 5 bits).
pub const MAX_DEPTH: usize = 31;

/// Lead-in of a compressed line.
pub const M_LEAD: &str = "~m#";
/// Lead-in of a decoded line.
pub const B_LEAD: &str = "~b#";

/// One lws backtrace: allocation size and addresses, innermost first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LwsTrace {
    /// The allocation size recorded with the trace.
    pub size: u64,
    /// Addresses, innermost first.
    pub addrs: Vec<u64>,
}

fn sigbits(v: u64) -> u32 {
    (64 - v.leading_zeros()).max(1)
}

/// Most bytes an lws blob takes, its 2-byte length included: a 5-bit depth, 31 entries of at
/// most 1+3+1+6+63 bits (a delta), a 6-bit size count and 63 size bits, each field with its
/// pad bit.
pub const MAX_BLOB: usize = (6 + MAX_DEPTH * (2 + 4 + 2 + 7 + 64) + 7 + 64).div_ceil(8) + 2;

/// Writes one lws field: `n` (< 64) bits of `v` then the pad bit, as one write.
#[inline]
fn put(w: &mut impl BitSink, v: u64, n: u32) {
    debug_assert!(n < 64);
    let mask = (1u64 << n) - 1;
    w.write((v & mask) << 1, n + 1);
}

/// Encodes `addrs` (innermost first) and `size` as an lws blob with its 2-byte length into
/// `out`, without allocating; returns the bytes written. The same bytes as
/// [`LwsTrace::encode`]. Fails when a value needs 64 bits, when there are more than
/// [`MAX_DEPTH`] addresses, or when `out` is too small (it never is at [`MAX_BLOB`] bytes).
pub fn encode_into(addrs: &[u64], size: u64, out: &mut [u8]) -> Result<usize, Error> {
    let room = out.len().saturating_sub(2);
    let (body, _) = out.split_at_mut(room);
    let mut w = SliceBitWriter::new(body);
    encode_bits(addrs, size, &mut w)?;
    let n = w.finish();
    if w.overflowed() {
        return Err(Error::NotRepresentable(format!(
            "blob needs more than the {} bytes given",
            out.len()
        )));
    }
    let total = n + 2;
    let total16 = u16::try_from(total).map_err(|_| {
        Error::NotRepresentable(format!("blob of {total} bytes exceeds the 16-bit length"))
    })?;
    out[n..total].copy_from_slice(&total16.to_be_bytes());
    Ok(total)
}

/// The bit fields of a blob (without the length trailer).
fn encode_bits(st: &[u64], size: u64, w: &mut impl BitSink) -> Result<(), Error> {
    if st.len() > MAX_DEPTH {
        return Err(Error::NotRepresentable(format!(
            "{} frames; an lws blob holds at most {MAX_DEPTH}",
            st.len()
        )));
    }
    put(w, st.len() as u64, 5);
    for n in 0..st.len() {
        let cur = st[n];
        // Best reference: smallest |difference|, strict `<` so the earliest wins ties.
        let mut best: Option<(usize, u64, bool)> = None;
        // (An index loop: an allocator runs this per allocation, and in a debug build each
        // iterator adapter is a call per step.)
        let mut m = n.saturating_sub(8);
        while m < n {
            let prev = st[m];
            let (d, sub) = if cur > prev {
                (cur - prev, false)
            } else {
                (prev - cur, true)
            };
            match best {
                Some((_, bd, _)) if d >= bd => {}
                _ => best = Some((m, d, sub)),
            }
            m += 1;
        }
        let ql = sigbits(cur);
        let delta = match best {
            // lws tests `hit` for truthiness, so a best reference at index 0 is never used.
            Some((m, d, sub)) if m != 0 && sigbits(d) + 11 < ql + 7 => Some((n - m, d, sub)),
            _ => None,
        };
        match delta {
            Some((back, d, sub)) => {
                let q = sigbits(d);
                if q > 63 {
                    return Err(Error::NotRepresentable(format!(
                        "delta {d:#x} needs 64 bits (lws bit counts are 6 bits)"
                    )));
                }
                put(w, 1, 1);
                put(w, back as u64 - 1, 3);
                put(w, u64::from(sub), 1);
                put(w, u64::from(q), 6);
                put(w, d, q);
            }
            None => {
                if ql > 63 {
                    return Err(Error::NotRepresentable(format!(
                        "address {cur:#x} needs 64 bits (lws bit counts are 6 bits)"
                    )));
                }
                put(w, 0, 1);
                put(w, u64::from(ql), 6);
                put(w, cur, ql);
            }
        }
    }
    let s = sigbits(size);
    if s > 63 {
        return Err(Error::NotRepresentable(format!(
            "size {size} needs 64 bits (lws bit counts are 6 bits)"
        )));
    }
    put(w, u64::from(s), 6);
    put(w, size, s);
    Ok(())
}

/// Reads one lws field of `n` bits and skips its pad bit.
fn get(r: &mut BitReader<'_>, n: u32, what: &'static str) -> Result<u64, Error> {
    let v = r.read(n, what)?;
    r.read(1, what)?;
    Ok(v)
}

impl LwsTrace {
    /// A trace from the native frames of `frames` (markers and Lua frames are skipped), keeping
    /// the innermost [`MAX_DEPTH`] of them like lws's capture does.
    pub fn from_frames(frames: &[Frame], size: u64) -> Self {
        let addrs = frames
            .iter()
            .filter_map(Frame::address)
            .take(MAX_DEPTH)
            .collect();
        Self { size, addrs }
    }

    /// The entries as frames. lws stores return addresses, so every entry is a [`Frame::Ra`].
    pub fn to_frames(&self) -> Vec<Frame> {
        self.addrs.iter().map(|&a| Frame::Ra(a)).collect()
    }

    /// Encodes the compressed blob including its 2-byte length trailer (exactly the bytes lws
    /// base64-encodes after `~m#`).
    pub fn encode(&self) -> Result<Vec<u8>, Error> {
        let mut w = BitWriter::new();
        encode_bits(&self.addrs, self.size, &mut w)?;
        let mut bytes = w.into_bytes();
        let total = bytes.len() + 2;
        // At most MAX_BLOB bytes: far below 65535.
        let total = u16::try_from(total).map_err(|_| {
            Error::NotRepresentable(format!("blob of {total} bytes exceeds the 16-bit length"))
        })?;
        bytes.extend_from_slice(&total.to_be_bytes());
        Ok(bytes)
    }

    /// Decodes a compressed blob with its 2-byte trailer.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() < 2 {
            return Err(Error::UnexpectedEnd {
                what: "length trailer",
                at: bytes.len(),
            });
        }
        let (blob, trailer) = bytes.split_at(bytes.len() - 2);
        let declared = u16::from_be_bytes([trailer[0], trailer[1]]);
        if usize::from(declared) != bytes.len() {
            return Err(Error::LengthMismatch {
                declared: u64::from(declared),
                actual: bytes.len() as u64,
            });
        }
        let mut r = BitReader::new(blob);
        let depth = get(&mut r, 5, "depth")? as usize;
        let mut addrs: Vec<u64> = Vec::with_capacity(depth);
        for n in 0..depth {
            let at = r.byte_pos();
            if get(&mut r, 1, "entry flag")? == 1 {
                let back = get(&mut r, 3, "delta reference")? as usize + 1;
                let sub = get(&mut r, 1, "delta sign")? == 1;
                let q = get(&mut r, 6, "delta bit count")? as u32;
                let d = get(&mut r, q, "delta")?;
                if back > n {
                    return Err(Error::Invalid {
                        what: format!("entry {n} refers {back} back, before the first entry"),
                        at,
                    });
                }
                let base = addrs[n - back];
                let v = if sub {
                    base.checked_sub(d)
                } else {
                    base.checked_add(d)
                };
                let Some(v) = v else {
                    return Err(Error::Invalid {
                        what: format!("entry {n}: delta {d:#x} from {base:#x} leaves 64 bits"),
                        at,
                    });
                };
                addrs.push(v);
            } else {
                let ql = get(&mut r, 6, "literal bit count")? as u32;
                addrs.push(get(&mut r, ql, "literal")?);
            }
        }
        let s = get(&mut r, 6, "size bit count")? as u32;
        let size = get(&mut r, s, "size")?;
        let used = r.bit_pos().div_ceil(8);
        if used != blob.len() {
            return Err(Error::TrailingData { at: used });
        }
        Ok(Self { size, addrs })
    }

    /// The compressed log line, `~m#` + base64.
    pub fn to_m_line(&self) -> Result<String, Error> {
        Ok(format!("{M_LEAD}{}", base64::encode(&self.encode()?)))
    }

    /// Decodes a compressed line's base64, with or without the 3-character lead-in (any
    /// `~?#`, like lws's tool), whitespace around it allowed.
    pub fn from_m_line(line: &str) -> Result<Self, Error> {
        let t = line.trim();
        let b = t.as_bytes();
        let body = if b.len() >= 3 && b[0] == b'~' && b[2] == b'#' {
            &t[3..]
        } else {
            t
        };
        Self::decode(&base64::decode(body)?)
    }

    /// The decoded line exactly as lws's decode tool prints it (without the newline):
    /// `~b#size: N, 0xa 0xb ` — lowercase hex, every address followed by a space.
    pub fn to_b_line(&self) -> String {
        let mut s = format!("{B_LEAD}size: {}, ", self.size);
        for a in &self.addrs {
            let _ = write!(s, "{a:#x} ");
        }
        s
    }

    /// Parses a decoded line, `size: N, 0x… 0x…`, with or without `~b#` and trailing space.
    pub fn from_b_line(line: &str) -> Result<Self, Error> {
        let t = line.trim();
        let t = t.strip_prefix(B_LEAD).unwrap_or(t);
        let rest = t
            .strip_prefix("size:")
            .ok_or_else(|| Error::Syntax(format!("expected `size: N, …`, found {t:?}")))?;
        let (size, addrs) = rest
            .split_once(',')
            .ok_or_else(|| Error::Syntax("expected `,` after the size".into()))?;
        let size = size
            .trim()
            .parse::<u64>()
            .map_err(|e| Error::Syntax(format!("bad size {:?}: {e}", size.trim())))?;
        let addrs = addrs
            .split_whitespace()
            .map(|w| {
                let h = w
                    .strip_prefix("0x")
                    .ok_or_else(|| Error::Syntax(format!("address {w:?} lacks 0x")))?;
                u64::from_str_radix(h, 16)
                    .map_err(|e| Error::Syntax(format!("bad address {w:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { size, addrs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_example_bits() {
        let t = LwsTrace::from_m_line("~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV").unwrap();
        assert_eq!(t.size, 7520);
        assert_eq!(t.addrs, vec![0x406651, 0x406852, 0x406c1b, 0x406294]);
        assert_eq!(
            t.to_b_line(),
            "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 "
        );
        assert_eq!(t.to_m_line().unwrap(), "~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV");
        assert_eq!(
            t.encode().unwrap(),
            vec![
                0x20, 0x5d, 0x01, 0x99, 0x44, 0x2e, 0x80, 0xd0, 0xa4, 0x80, 0x29, 0xe4, 0x85, 0xd0,
                0x18, 0xa5, 0x06, 0xba, 0xc0, 0x00, 0x15
            ]
        );
    }

    #[test]
    fn readme_headline_example_is_other_addresses() {
        let t = LwsTrace::from_m_line("IF0BmagugNDWgCnkhdAYpQa6wAAV").unwrap();
        assert_eq!(t.addrs, vec![0x40666a, 0x40686b, 0x406c34, 0x406294]);
    }

    #[test]
    fn first_entry_delta_is_a_ref_error() {
        // depth 1, entry 0 flagged as a delta (1 back, +1), size 1: lws's tool says "ref err".
        let e = LwsTrace::decode(&[0x0a, 0x00, 0x14, 0x14, 0x00, 0x06]).unwrap_err();
        assert_eq!(
            e,
            Error::Invalid {
                what: "entry 0 refers 1 back, before the first entry".into(),
                at: 0
            }
        );
    }

    #[test]
    fn empty_and_limits() {
        let t = LwsTrace {
            size: 0,
            addrs: vec![],
        };
        let b = t.encode().unwrap();
        assert_eq!(b, vec![0x00, 0x10, 0x00, 0x04]);
        assert_eq!(LwsTrace::decode(&b).unwrap(), t);
        assert_eq!(t.to_b_line(), "~b#size: 0, ");

        let deep = LwsTrace {
            size: 1,
            addrs: vec![0x1000; 32],
        };
        assert!(matches!(deep.encode(), Err(Error::NotRepresentable(_))));
        let capped = LwsTrace::from_frames(&[Frame::Ra(0x1000); 40], 1);
        assert_eq!(capped.addrs.len(), 31);
        assert!(capped.encode().is_ok());

        let big = LwsTrace {
            size: 1 << 63,
            addrs: vec![],
        };
        assert!(matches!(big.encode(), Err(Error::NotRepresentable(_))));
        let kernel = LwsTrace {
            size: 1,
            addrs: vec![0xffff_ffff_8123_4567],
        };
        assert!(matches!(kernel.encode(), Err(Error::NotRepresentable(_))));
    }

    #[test]
    fn decode_errors() {
        assert_eq!(
            LwsTrace::decode(&[0x00]),
            Err(Error::UnexpectedEnd {
                what: "length trailer",
                at: 1
            })
        );
        assert_eq!(
            LwsTrace::decode(&[0x00, 0x10, 0x00, 0x05]),
            Err(Error::LengthMismatch {
                declared: 5,
                actual: 4
            })
        );
        assert_eq!(
            LwsTrace::decode(&[0x00, 0x10, 0x00, 0x00, 0x05]),
            Err(Error::TrailingData { at: 2 })
        );
        assert_eq!(
            LwsTrace::decode(&[0x08, 0x00, 0x03]),
            Err(Error::UnexpectedEnd {
                what: "literal bit count",
                at: 1
            })
        );
    }
}
