//! The one error type of the codecs.

use std::fmt;

/// Why a backtrace could not be encoded or decoded.
///
/// Decoders treat their input as hostile: every malformed input ends in one of these, never in a
/// panic. Byte offsets count from the start of the decoded binary data (after base64/hex), bit
/// offsets from its first bit.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The input ends in the middle of something.
    UnexpectedEnd {
        /// What was being read.
        what: &'static str,
        /// Byte offset where more input was needed.
        at: usize,
    },
    /// A base64 or hex text contains a character that does not belong there.
    BadText {
        /// Which text encoding.
        encoding: &'static str,
        /// The offending character.
        found: char,
        /// Its offset (in characters) in the text.
        at: usize,
    },
    /// A length field disagrees with the real length.
    LengthMismatch {
        /// What the data says.
        declared: u64,
        /// What it is.
        actual: u64,
    },
    /// Bytes follow the end of the encoded trace.
    TrailingData {
        /// Byte offset of the first unused byte.
        at: usize,
    },
    /// A field holds a value that the format does not allow here.
    Invalid {
        /// What is wrong, in words.
        what: String,
        /// Byte offset of the field.
        at: usize,
    },
    /// The input asks for more than the decoder is willing to produce.
    LimitExceeded {
        /// What was limited.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// The frames cannot be expressed in this format (encoding only).
    NotRepresentable(String),
    /// A text form (`~b#` line, frame list) could not be parsed.
    Syntax(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnexpectedEnd { what, at } => {
                write!(f, "input ends inside {what} (at byte {at})")
            }
            Error::BadText {
                encoding,
                found,
                at,
            } => write!(f, "invalid {encoding} character {found:?} at offset {at}"),
            Error::LengthMismatch { declared, actual } => write!(
                f,
                "length field says {declared} bytes but the data has {actual}"
            ),
            Error::TrailingData { at } => write!(f, "unexpected data after the end, at byte {at}"),
            Error::Invalid { what, at } => write!(f, "{what} (at byte {at})"),
            Error::LimitExceeded { what, limit } => {
                write!(f, "{what} exceeds the decoder's limit of {limit}")
            }
            Error::NotRepresentable(what) => write!(f, "cannot encode: {what}"),
            Error::Syntax(what) => write!(f, "{what}"),
        }
    }
}

impl std::error::Error for Error {}
