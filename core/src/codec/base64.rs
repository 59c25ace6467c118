//! Base64 as lws uses it: standard alphabet with `=` padding when writing; when reading, the
//! standard and URL-safe alphabets, optional padding and embedded whitespace are all accepted
//! (like `lws_b64_decode_string_len`).
//!
//! Reading is lenient in one more way: unused low bits of the last character are ignored, so two
//! different texts can decode to the same bytes. Re-encoding gives the canonical text.

use super::Error;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes `data` with the standard alphabet and `=` padding, no line breaks.
pub fn encode(data: &[u8]) -> String {
    let mut out = Vec::with_capacity(encoded_len(data.len()));
    encode_into(data, &mut out);
    // The alphabet and the padding are ASCII.
    String::from_utf8(out).unwrap_or_default()
}

/// The length of [`encode`]'s text for `n` bytes.
pub fn encoded_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// [`encode`], appended to `out` (which grows as a `Vec` does when it lacks the room: reserve
/// [`encoded_len`] first where a failed allocation must not abort).
pub fn encode_into(data: &[u8], out: &mut Vec<u8>) {
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]);
            } else {
                out.push(b'=');
            }
        }
    }
}

fn value(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    }
}

/// Whether `c` can appear in a base64 text this module reads (alphabet or padding).
pub fn is_base64_char(c: u8) -> bool {
    value(c).is_some() || c == b'='
}

/// Decodes a base64 text (see the module docs for what is accepted).
///
/// Errors: a character outside both alphabets, data after the padding, or a lone trailing
/// character (6 bits cannot make a byte).
pub fn decode(text: &str) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3 + 2);
    let mut acc: u32 = 0;
    let mut nacc = 0u32;
    let mut padded = false;
    let mut count = 0usize;
    for (at, c) in text.bytes().enumerate() {
        if c.is_ascii_whitespace() {
            continue;
        }
        if c == b'=' {
            padded = true;
            continue;
        }
        let Some(v) = value(c) else {
            return Err(Error::BadText {
                encoding: "base64",
                found: text[at..].chars().next().unwrap_or('?'),
                at,
            });
        };
        if padded {
            return Err(Error::BadText {
                encoding: "base64",
                found: c as char,
                at,
            });
        }
        count += 1;
        acc = (acc << 6) | u32::from(v);
        nacc += 6;
        if nacc >= 8 {
            nacc -= 8;
            out.push((acc >> nacc) as u8);
            acc &= (1 << nacc) - 1;
        }
    }
    if count % 4 == 1 {
        return Err(Error::Syntax(
            "base64 text has a dangling character (length is 1 mod 4)".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(encode(b""), "");
        assert_eq!(encode(b"f"), "Zg==");
        assert_eq!(encode(b"fo"), "Zm8=");
        assert_eq!(encode(b"foo"), "Zm9v");
        assert_eq!(encode(&[0xfb, 0xff]), "+/8=");
        assert_eq!(decode("Zg==").unwrap(), b"f");
        assert_eq!(decode("Zg").unwrap(), b"f");
        assert_eq!(decode("Zm8").unwrap(), b"fo");
        assert_eq!(decode("Zm 9\nv").unwrap(), b"foo");
        assert_eq!(decode("-_8").unwrap(), vec![0xfb, 0xff]);
        assert_eq!(decode("+/8=").unwrap(), vec![0xfb, 0xff]);
    }

    #[test]
    fn errors() {
        assert_eq!(
            decode("Zm*v"),
            Err(Error::BadText {
                encoding: "base64",
                found: '*',
                at: 2
            })
        );
        assert!(decode("Z").is_err());
        assert!(decode("Zg==Zg").is_err());
        assert!(decode("Zé").is_err());
    }
}
