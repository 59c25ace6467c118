//! `fibertrace decode`: finds encoded backtraces in log text and prints them decoded.
//!
//! Recognized tokens, anywhere in a line (logs have other text around them):
//!
//! * `~m#BASE64` — an lws compressed backtrace; printed as lws's decode tool prints it,
//!   `~b#size: N, 0x… 0x… ` (each address followed by a space).
//! * `~c#DATA` — Swift Compact Backtrace Format, as base64 or hex (a v0 CBF in hex starts with
//!   `0`, in base64 with `A`); printed as a frame list `pc:0x… ra:0x… omit:N trunc`.
//! * `~i#BASE64` — an image table; later `~n#` tokens in the same input use it.
//! * `~n#BASE64` — a native trace; printed as a frame list.
//!
//! With `cbf_lines`, the first word of every line is also taken as CBF (hex or base64), as in
//! the CBF vector files.
//!
//! Input is hostile: a token may decode to at most [`MAX_TOKEN_FRAMES`] frames (a CBF
//! repeat count can ask a 15-byte token for 2^64 frames), and a line to at most
//! [`MAX_LINE_FRAMES`] (many small tokens that each expand); a token over the first, or
//! malformed, is an error for that token alone, and the line's other tokens and the next
//! lines go on; past the second, the rest of the line is one error that counts the tokens
//! left (image tables excepted: they yield no frames, and are read wherever they are, so
//! that the tokens after them decode against the right table). Results are handed out one by one ([`LineDecoder::decode_line_each`]), never held
//! for a whole line. Work is linear in the line's length plus the frames produced.

use fibertrace_core::codec::native::{self, ImageTable};
use fibertrace_core::codec::{base64, cbf, lws, text, Error};
use fibertrace_core::Frame;

/// One decoded token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// An lws trace.
    Lws(lws::LwsTrace),
    /// Frames from CBF or the native format.
    Frames(Vec<Frame>),
    /// An image table was read (nothing to print).
    Table,
}

impl Decoded {
    /// The output line, if any.
    pub fn line(&self) -> Option<String> {
        match self {
            Decoded::Lws(t) => Some(t.to_b_line()),
            // (A token can hold no frame: said, not an empty line.)
            Decoded::Frames(f) if f.is_empty() => Some("(no frames)".into()),
            Decoded::Frames(f) => Some(text::format_frames(f)),
            Decoded::Table => None,
        }
    }

    /// The frames, for symbolization.
    pub fn frames(&self) -> Vec<Frame> {
        match self {
            Decoded::Lws(t) => t.to_frames(),
            Decoded::Frames(f) => f.clone(),
            Decoded::Table => Vec::new(),
        }
    }
}

/// Where [`LineDecoder::decode_line_each`] hands its results.
trait Sink: FnMut(Result<Decoded, String>, Option<&ImageTable>) {}
impl<F: FnMut(Result<Decoded, String>, Option<&ImageTable>)> Sink for F {}

/// Decoder state across lines (the current image table).
#[derive(Debug, Default)]
pub struct LineDecoder {
    /// Take the first word of each line as CBF.
    pub cbf_lines: bool,
    table: Option<ImageTable>,
}

fn is_token_char(c: u8) -> bool {
    base64::is_base64_char(c)
}

/// The most frames one token may decode to (65,536: far above any real trace, 1 MiB of
/// frames).
pub const MAX_TOKEN_FRAMES: usize = 1 << 16;

/// The most frames the tokens of one line may decode to together (16 tokens at the
/// per-token limit).
pub const MAX_LINE_FRAMES: usize = 1 << 20;

fn decode_cbf(data: &str) -> Result<Vec<Frame>, Error> {
    let bytes = if data.starts_with('0') {
        if !data.len().is_multiple_of(2) {
            return Err(Error::Syntax(format!(
                "hex CBF has an odd number of digits ({})",
                data.len()
            )));
        }
        data.as_bytes()
            .chunks(2)
            .enumerate()
            .map(|(i, p)| {
                let s = std::str::from_utf8(p).unwrap_or("??");
                u8::from_str_radix(s, 16).map_err(|_| Error::BadText {
                    encoding: "hex",
                    found: s.chars().find(|c| !c.is_ascii_hexdigit()).unwrap_or('?'),
                    at: 2 * i,
                })
            })
            .collect::<Result<Vec<u8>, Error>>()?
    } else {
        base64::decode(data)?
    };
    Ok(cbf::decode_with_limit(&bytes, MAX_TOKEN_FRAMES)?.frames)
}

impl LineDecoder {
    /// A decoder.
    pub fn new(cbf_lines: bool) -> Self {
        Self {
            cbf_lines,
            table: None,
        }
    }

    /// The image table read from the last `~i#` token, if any.
    pub fn table(&self) -> Option<&ImageTable> {
        self.table.as_ref()
    }

    /// Decodes every token of one line, in order. Each result is independent: a bad token does
    /// not stop the others.
    pub fn decode_line(&mut self, line: &str) -> Vec<Result<Decoded, String>> {
        let mut out = Vec::new();
        self.decode_line_each(line, |r, _| out.push(r));
        out
    }

    /// [`LineDecoder::decode_line`], handing each result to `f` as soon as it is decoded,
    /// with the image table in force for it (see [`LineDecoder::table`]).
    pub fn decode_line_each(
        &mut self,
        line: &str,
        mut f: impl FnMut(Result<Decoded, String>, Option<&ImageTable>),
    ) {
        let mut budget = MAX_LINE_FRAMES;
        let mut left = 0u64;
        // (An image table's result, or its error, is given even past the budget.)
        let give = |r: Result<Decoded, String>,
                    table: Option<&ImageTable>,
                    f: &mut dyn Sink,
                    budget: &mut usize,
                    left: &mut u64,
                    image_table: bool| {
            if *left > 0 && !image_table {
                *left += 1;
                return;
            }
            let n = match &r {
                Ok(Decoded::Frames(v)) => v.len(),
                Ok(Decoded::Lws(t)) => t.addrs.len(),
                _ => 0,
            };
            if n > *budget {
                *left = 1;
                return;
            }
            *budget -= n;
            f(r, table)
        };
        let b = line.as_bytes();
        if self.cbf_lines {
            if let Some(w) = line.split_whitespace().next() {
                if !w.starts_with('~') {
                    give(
                        decode_cbf(w)
                            .map(Decoded::Frames)
                            .map_err(|e| format!("CBF {}: {e}", abbreviate(w))),
                        self.table.as_ref(),
                        &mut f,
                        &mut budget,
                        &mut left,
                        false,
                    );
                }
            }
        }
        let mut i = 0;
        while i + 3 <= b.len() {
            if b[i] == b'~' && b[i + 2] == b'#' && matches!(b[i + 1], b'm' | b'c' | b'n' | b'i') {
                let kind = b[i + 1];
                let start = i + 3;
                let mut end = start;
                while end < b.len() && is_token_char(b[end]) {
                    end += 1;
                }
                let tok = &line[start..end];
                let lead = &line[i..start];
                if left > 0 && kind != b'i' {
                    // Past the line's budget: counted, not decoded. (An image table yields
                    // no frames and is still read: later tokens and lines decode with it.)
                    left += 1;
                    i = end.max(i + 1);
                    continue;
                }
                let res = if tok.is_empty() {
                    // (A character that cannot start a token is named: "nothing" would be
                    // wrong when there is something.)
                    Err(Error::Syntax(match line[end..].chars().next() {
                        Some(c) if !c.is_whitespace() => format!(
                            "no token after the lead-in: {c:?} is not a base64 or hex character"
                        ),
                        _ => "nothing after the lead-in".into(),
                    }))
                } else {
                    match kind {
                        b'm' => lws::LwsTrace::from_m_line(tok).map(Decoded::Lws),
                        b'c' => decode_cbf(tok).map(Decoded::Frames),
                        b'i' => ImageTable::from_line(tok).map(|t| {
                            self.table = Some(t);
                            Decoded::Table
                        }),
                        _ => base64::decode(tok).and_then(|bytes| {
                            if native::is_module_relative(&bytes) && self.table.is_none() {
                                Err(Error::Syntax(
                                    "module-relative trace but no ~i# image table before it".into(),
                                ))
                            } else {
                                native::decode_located(
                                    &bytes,
                                    self.table.as_ref(),
                                    MAX_TOKEN_FRAMES,
                                )
                                .map(|v| Decoded::Frames(v.into_iter().map(|l| l.frame).collect()))
                            }
                        }),
                    }
                };
                give(
                    res.map_err(|e| format!("{lead}{}: {e}", abbreviate(tok))),
                    self.table.as_ref(),
                    &mut f,
                    &mut budget,
                    &mut left,
                    kind == b'i',
                );
                i = end.max(i + 1);
            } else {
                i += 1;
            }
        }
        if left > 0 {
            f(
                Err(format!(
                    "the line's tokens decode to more than {MAX_LINE_FRAMES} frames: its last \
                 {left} tokens are not shown"
                )),
                self.table.as_ref(),
            );
        }
    }
}

fn abbreviate(s: &str) -> String {
    if s.chars().count() > 24 {
        format!("{}…", s.chars().take(24).collect::<String>())
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_tokens_in_log_text() {
        let mut d = LineDecoder::new(false);
        let r = d.decode_line(
            "12:00:01 [alloc] ~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV, again ~m#IF0BmagugNDWgCnkhdAYpQa6wAAV.",
        );
        let lines: Vec<_> = r.into_iter().map(|x| x.unwrap().line().unwrap()).collect();
        assert_eq!(
            lines,
            vec![
                "~b#size: 7520, 0x406651 0x406852 0x406c1b 0x406294 ",
                "~b#size: 7520, 0x40666a 0x40686b 0x406c34 0x406294 "
            ]
        );
        assert!(d.decode_line("no tokens here ~x#abc ~m").is_empty());
        let mut d = LineDecoder::new(true);
        assert_eq!(d.decode_line("ééééééééééééééééééééééééééé x").len(), 1);
    }

    #[test]
    fn cbf_hex_and_base64() {
        let mut d = LineDecoder::new(false);
        let want = "pc:0x9999";
        let r = d.decode_line("x ~c#021200999900 y ~c#AhIAmZkA");
        assert_eq!(r.len(), 2);
        for x in r {
            assert_eq!(x.unwrap().line().unwrap(), want);
        }
        let mut d = LineDecoder::new(true);
        let r = d.decode_line("021200999900\tpc:0x9999");
        assert_eq!(r[0].clone().unwrap().line().unwrap(), want);
    }

    #[test]
    fn errors_name_the_token() {
        let mut d = LineDecoder::new(false);
        let r = d.decode_line("~m#IF0BmUQugNCkgCnkhdAYpQa6wAA");
        assert_eq!(
            r,
            vec![Err(
                "~m#IF0BmUQugNCkgCnkhdAYpQa6…: length field says 49152 bytes but the data has 20"
                    .to_string()
            )]
        );
        // A lead-in followed by a character no token starts with is told so; one followed
        // by nothing (or a space) has nothing after it.
        assert_eq!(
            d.decode_line("~c#@@@@ ~n# ~m#"),
            vec![
                Err(
                    "~c#: no token after the lead-in: '@' is not a base64 or hex character"
                        .to_string()
                ),
                Err("~n#: nothing after the lead-in".to_string()),
                Err("~m#: nothing after the lead-in".to_string()),
            ]
        );
    }
}
