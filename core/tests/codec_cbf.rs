//! Every line of `cbf-vectors.tsv` (a copy of shared/vectors) decodes to its frame list and
//! re-encodes to the same bytes.

use fibertrace_core::codec::cbf::{self, WordSize};
use fibertrace_core::codec::text::{format_frames, parse_frames};

const VECTORS: &str = include_str!("data/cbf-vectors.tsv");

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn every_line_both_directions() {
    let mut n = 0;
    for (i, line) in VECTORS.lines().enumerate() {
        let (hex, text) = line.split_once('\t').unwrap();
        let bytes = unhex(hex);
        let t = cbf::decode(&bytes).unwrap_or_else(|e| panic!("line {}: {e}", i + 1));
        assert_eq!(t.word, WordSize::W64);
        assert_eq!(format_frames(&t.frames), text, "line {}", i + 1);
        let frames = parse_frames(text).unwrap();
        assert_eq!(t.frames, frames, "line {}", i + 1);
        assert_eq!(
            cbf::encode(&frames, WordSize::W64).unwrap(),
            bytes,
            "line {}",
            i + 1
        );
        n += 1;
    }
    assert_eq!(n, 20);
}
