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

    #[inline]
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

/// Writes bits MSB-first into a fixed buffer; bits beyond its end are dropped and counted
/// ([`SliceBitWriter::overflowed`]).
pub(crate) struct SliceBitWriter<'a> {
    buf: &'a mut [u8],
    len: usize,
    overflow: bool,
}

impl<'a> SliceBitWriter<'a> {
    /// A writer over `buf`, which it zeroes.
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        buf.fill(0);
        SliceBitWriter {
            buf,
            len: 0,
            overflow: false,
        }
    }

    /// Bytes used (the last one zero-padded).
    pub(crate) fn byte_len(&self) -> usize {
        self.len.div_ceil(8)
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
        if self.len + n as usize > self.buf.len() * 8 {
            self.overflow = true;
            return;
        }
        let mut left = n;
        while left > 0 {
            let used = (self.len & 7) as u32;
            let room = 8 - used;
            let take = room.min(left);
            let chunk = ((v >> (left - take)) & ((1u64 << take) - 1)) as u8;
            self.buf[self.len >> 3] |= chunk << (room - take);
            left -= take;
            self.len += take as usize;
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
