//! Fiber names of any bytes: kept as text (`str`) with the bytes that are not UTF-8 mapped to
//! private-use code points, quoted in reports so that no byte is lost and no line broken.

/// The first of the 128 code points that stand for the bytes 0x80..=0xFF in a name that is
/// not UTF-8 (U+10FF80..=U+10FFFF, private use).
const NAME_ESC: u32 = 0x10FF00;

fn is_name_esc(c: char) -> bool {
    (NAME_ESC + 0x80..=NAME_ESC + 0xFF).contains(&(c as u32))
}

/// The byte that is not UTF-8 which `c` stands for in a name (see [`name_from_bytes`]).
pub(crate) fn escaped_byte(c: char) -> Option<u8> {
    is_name_esc(c).then(|| (c as u32 - NAME_ESC) as u8)
}

/// The longest fiber name, in bytes (as [`name_to_bytes`] gives them; Tarantool's limit):
/// a longer one is cut there, at a character boundary. (Names are copied into every
/// listing, dump and report: a name of a megabyte made each dump eight.)
pub const NAME_MAX: usize = 255;

/// `name` cut to [`NAME_MAX`] bytes of the name it stands for (a byte that is not UTF-8,
/// kept as one code point, counts as one), at a character boundary.
pub(crate) fn cut_name(name: &str) -> &str {
    if name.len() <= NAME_MAX {
        return name;
    }
    let mut bytes = 0;
    for (i, c) in name.char_indices() {
        bytes += if is_name_esc(c) { 1 } else { c.len_utf8() };
        if bytes > NAME_MAX {
            return &name[..i];
        }
    }
    name
}

fn push_name_byte(out: &mut String, b: u8) {
    // (0x80..=0xFF: every code point made is a valid one.)
    out.extend(char::from_u32(NAME_ESC + b as u32));
}

/// A fiber name of any bytes as the text the runtime keeps (names are `str`): UTF-8 as it
/// is; each byte of an invalid sequence as the private-use code point U+10FF00 + byte, and a
/// name's own characters of that range as their four bytes so, so that [`name_to_bytes`]
/// gives the exact bytes back. Reports made by the runtime show such a byte as that code
/// point; a host gives the bytes back with [`name_to_bytes`].
pub fn name_from_bytes(b: &[u8]) -> std::borrow::Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(b) {
        if !b.contains(&0xF4) || !s.chars().any(is_name_esc) {
            return std::borrow::Cow::Borrowed(s);
        }
    }
    let mut out = String::with_capacity(b.len() * 2);
    let valid = |out: &mut String, s: &str| {
        for c in s.chars() {
            if is_name_esc(c) {
                c.encode_utf8(&mut [0; 4])
                    .bytes()
                    .for_each(|x| push_name_byte(out, x));
            } else {
                out.push(c);
            }
        }
    };
    let mut rest = b;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                valid(&mut out, s);
                break;
            }
            Err(e) => {
                let (ok, bad) = rest.split_at(e.valid_up_to());
                // (`valid_up_to` bytes are UTF-8.)
                valid(&mut out, std::str::from_utf8(ok).unwrap_or_default());
                let n = e.error_len().unwrap_or(bad.len());
                bad[..n].iter().for_each(|&x| push_name_byte(&mut out, x));
                rest = &bad[n..];
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A fiber name in double quotes as the runtime's text reports write it, so that the exact
/// bytes can be read back and a name cannot break a report's lines: a byte that is not UTF-8
/// (see [`name_from_bytes`]) is `\xNN`, a control character `\n`, `\t`, `\r` or `\xNN`,
/// and `"` and `\` are escaped with a backslash; everything else as it is.
pub fn quoted_name(s: &str) -> QuotedName<'_> {
    QuotedName(s)
}

/// See [`quoted_name`].
pub struct QuotedName<'a>(&'a str);

impl std::fmt::Display for QuotedName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write as _;
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                '\n' => f.write_str("\\n")?,
                '\t' => f.write_str("\\t")?,
                '\r' => f.write_str("\\r")?,
                c if is_name_esc(c) => write!(f, "\\x{:02x}", c as u32 - NAME_ESC)?,
                // (C0, DEL and C1: a terminal takes C1's 8-bit CSI as a command too.)
                c if c.is_control() => write!(f, "\\x{:02x}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

/// The bytes of a name made by [`name_from_bytes`] (any other text: its UTF-8).
pub fn name_to_bytes(s: &str) -> std::borrow::Cow<'_, [u8]> {
    if !s.as_bytes().contains(&0xF4) || !s.chars().any(is_name_esc) {
        return std::borrow::Cow::Borrowed(s.as_bytes());
    }
    let mut out = Vec::with_capacity(s.len());
    for c in s.chars() {
        if is_name_esc(c) {
            out.push((c as u32 - NAME_ESC) as u8);
        } else {
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
        }
    }
    std::borrow::Cow::Owned(out)
}
