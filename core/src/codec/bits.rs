//! MSB-first bit writer and reader shared by the lws and native codecs.
//!
//! Bits are packed from the most significant bit of each byte down; the unused low bits of the
//! last byte are zero when writing and ignored when reading.

use super::Error;

/// Appends bits MSB-first to a byte vector.
#[derive(Default, Debug, Clone)]
pub(crate) struct BitWriter {
    bytes: Vec<u8>,
    /// Number of bits written.
    len: usize,
}

impl BitWriter {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Writes the low `n` bits of `v`, most significant first. `n` ≤ 64.
    #[inline]
    pub(crate) fn write(&mut self, v: u64, n: u32) {
        debug_assert!(n <= 64);
        let mut left = n;
        while left > 0 {
            let used = (self.len & 7) as u32;
            if used == 0 {
                self.bytes.push(0);
            }
            let room = 8 - used;
            let take = room.min(left);
            let chunk = ((v >> (left - take)) & ((1u64 << take) - 1)) as u8;
            let last = self.bytes.len() - 1;
            self.bytes[last] |= chunk << (room - take);
            left -= take;
            self.len += take as usize;
        }
    }

    #[cfg(test)]
    pub(crate) fn bit(&mut self, b: bool) {
        self.write(u64::from(b), 1);
    }

    /// Number of bits written so far.
    #[cfg(test)]
    pub(crate) fn bit_len(&self) -> usize {
        self.len
    }

    /// The bytes, the last one zero-padded.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

/// Where MSB-first bits go: a growing vector ([`BitWriter`]) or a fixed buffer
/// ([`SliceBitWriter`], for callers that must not allocate, such as an allocator).
pub(crate) trait BitSink {
    /// Writes the low `n` ≤ 64 bits of `v`, most significant first.
    fn write(&mut self, v: u64, n: u32);
}

impl BitSink for BitWriter {
    #[inline]
    fn write(&mut self, v: u64, n: u32) {
        BitWriter::write(self, v, n)
    }
}

/// Writes bits MSB-first into a fixed buffer through a 128-bit accumulator (a whole byte
/// at a time: an allocator encodes a trace per allocation); bits beyond its end are dropped
/// and counted ([`SliceBitWriter::overflowed`]). Call [`SliceBitWriter::finish`] last.
pub(crate) struct SliceBitWriter<'a> {
    buf: &'a mut [u8],
    /// Whole bytes written.
    bytes: usize,
    acc: u128,
    /// Bits in `acc` not written yet (< 8 between writes).
    nacc: u32,
    overflow: bool,
}

impl<'a> SliceBitWriter<'a> {
    /// A writer over `buf`.
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        SliceBitWriter {
            buf,
            bytes: 0,
            acc: 0,
            nacc: 0,
            overflow: false,
        }
    }

    /// Writes the last bits, zero-padded to a byte; returns the bytes used.
    pub(crate) fn finish(&mut self) -> usize {
        if self.nacc > 0 {
            let b = ((self.acc << (8 - self.nacc)) & 0xff) as u8;
            self.push(b);
            self.nacc = 0;
            self.acc = 0;
        }
        self.bytes
    }

    #[inline]
    fn push(&mut self, b: u8) {
        match self.buf.get_mut(self.bytes) {
            Some(slot) => {
                *slot = b;
                self.bytes += 1;
            }
            None => self.overflow = true,
        }
    }

    /// Whether a write did not fit.
    pub(crate) fn overflowed(&self) -> bool {
        self.overflow
    }
}

impl BitSink for SliceBitWriter<'_> {
    #[inline]
    fn write(&mut self, v: u64, n: u32) {
        debug_assert!(n <= 64);
        if n == 0 {
            return;
        }
        let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        self.acc = (self.acc << n) | u128::from(v & mask);
        self.nacc += n;
        while self.nacc >= 8 {
            self.nacc -= 8;
            let b = ((self.acc >> self.nacc) & 0xff) as u8;
            self.push(b);
        }
    }
}

/// Reads bits MSB-first from a byte slice.
#[derive(Debug, Clone)]
pub(crate) struct BitReader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Reads `n` ≤ 64 bits as an unsigned number; `what` names the field for the error.
    #[inline]
    pub(crate) fn read(&mut self, n: u32, what: &'static str) -> Result<u64, Error> {
        debug_assert!(n <= 64);
        if self.bytes.len() * 8 - self.pos < n as usize {
            return Err(Error::UnexpectedEnd {
                what,
                at: self.bytes.len(),
            });
        }
        let mut v: u64 = 0;
        let mut left = n;
        while left > 0 {
            let byte = self.bytes[self.pos >> 3];
            let used = (self.pos & 7) as u32;
            let room = 8 - used;
            let take = room.min(left);
            let chunk = (u64::from(byte) >> (room - take)) & ((1u64 << take) - 1);
            v = if take == 64 {
                chunk
            } else {
                (v << take) | chunk
            };
            left -= take;
            self.pos += take as usize;
        }
        Ok(v)
    }

    #[inline]
    pub(crate) fn bit(&mut self, what: &'static str) -> Result<bool, Error> {
        Ok(self.read(1, what)? == 1)
    }

    /// Bits consumed so far.
    pub(crate) fn bit_pos(&self) -> usize {
        self.pos
    }

    /// Byte offset of the current bit (for error messages).
    pub(crate) fn byte_pos(&self) -> usize {
        self.pos >> 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_fields() {
        let mut w = BitWriter::new();
        w.write(0b101, 3);
        w.write(u64::MAX, 64);
        w.write(0, 0);
        w.write(0x1234, 13);
        w.bit(true);
        assert_eq!(w.bit_len(), 81);
        let bytes = w.into_bytes();
        assert_eq!(bytes.len(), 11);
        assert_eq!(bytes[0], 0b1011_1111);
        let mut r = BitReader::new(&bytes);
        assert_eq!(r.read(3, "a").unwrap(), 0b101);
        assert_eq!(r.read(64, "b").unwrap(), u64::MAX);
        assert_eq!(r.read(0, "c").unwrap(), 0);
        assert_eq!(r.read(13, "d").unwrap(), 0x1234);
        assert!(r.bit("e").unwrap());
        assert_eq!(r.read(7, "pad").unwrap(), 0);
        assert_eq!(
            r.read(1, "x"),
            Err(Error::UnexpectedEnd { what: "x", at: 11 })
        );
    }
}
