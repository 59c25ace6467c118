//! Every line of `lws-vectors.tsv` (a copy of shared/vectors) round-trips byte for byte, both
//! directions: `~m#` → trace → `~b#` text, and `~b#` text → trace → `~m#`.

use fibertrace_core::codec::lws::LwsTrace;
use fibertrace_core::codec::Error;

const VECTORS: &str = include_str!("data/lws-vectors.tsv");

fn lines() -> Vec<(usize, &'static str, &'static str)> {
    VECTORS
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let (m, b) = l.split_once('\t').expect("tab");
            (i + 1, m, b)
        })
        .collect()
}

#[test]
fn vector_count() {
    assert_eq!(lines().len(), 211);
}

#[test]
fn decode_every_line() {
    for (n, m, b) in lines() {
        let t = LwsTrace::from_m_line(m).unwrap_or_else(|e| panic!("line {n}: {e}"));
        assert_eq!(t.to_b_line(), format!("~b#{b} "), "line {n}");
        assert_eq!(t, LwsTrace::from_b_line(b).unwrap(), "line {n}");
    }
}

#[test]
fn encode_every_line() {
    for (n, m, b) in lines() {
        let t = LwsTrace::from_b_line(b).unwrap_or_else(|e| panic!("line {n}: {e}"));
        assert_eq!(t.to_m_line().unwrap(), m, "line {n}");
    }
}

/// The allocator's encoder (a fixed buffer, no allocation) writes the same bytes as the
/// vectors' `~m#` lines: the blobs hidden in front of allocations are lws's.
#[test]
fn encode_into_a_fixed_buffer_matches_every_line() {
    use fibertrace_core::codec::lws::{encode_into, MAX_BLOB};
    for (n, m, b) in lines() {
        let t = LwsTrace::from_b_line(b).unwrap();
        let mut buf = [0u8; MAX_BLOB];
        let len =
            encode_into(&t.addrs, t.size, &mut buf).unwrap_or_else(|e| panic!("line {n}: {e}"));
        let line = format!("~m#{}", fibertrace_core::codec::base64::encode(&buf[..len]));
        assert_eq!(line, m, "line {n}");
        // Too small a buffer is an error, never a cut blob.
        assert!(
            encode_into(&t.addrs, t.size, &mut buf[..len - 1]).is_err(),
            "line {n}"
        );
    }
    // The largest blob fits MAX_BLOB.
    let worst: Vec<u64> = (0..31u64)
        .map(|i| (1u64 << 62) + i * (1u64 << 58))
        .collect();
    let mut buf = [0u8; MAX_BLOB];
    let len = encode_into(&worst, (1u64 << 63) - 1, &mut buf).unwrap();
    assert_eq!(
        buf[..len].to_vec(),
        LwsTrace {
            size: (1u64 << 63) - 1,
            addrs: worst
        }
        .encode()
        .unwrap()
    );
}

#[test]
fn edge_lines() {
    let l = lines();
    // Line 201: size 0; 202: size 2^31+5; 203: a 41-bit size.
    assert_eq!(LwsTrace::from_m_line(l[200].1).unwrap().size, 0);
    assert_eq!(LwsTrace::from_m_line(l[201].1).unwrap().size, (1 << 31) + 5);
    assert_eq!(
        LwsTrace::from_m_line(l[202].1).unwrap().size,
        1_099_511_627_899
    );
    // Line 204 straddles 2^31 and 2^32.
    assert_eq!(
        LwsTrace::from_m_line(l[203].1).unwrap().addrs,
        vec![0x7fffff00, 0x80000010, 0x7ffffff0, 0x80000000, 0xffffffff]
    );
    // Line 210: the README's addr2line example.
    assert_eq!(l[209].1, "~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV");
}

#[test]
fn stock_lossy_encoding_is_not_ours() {
    // Stock lws on x86-64 garbles values >= 2^31; ours is the 64-bit-clean encoding.
    let t = LwsTrace::from_b_line(
        "size: 64, 0x55d4c3a01234 0x55d4c3a01e80 0x7f3a1234a678 0x55d4c3a00abc",
    )
    .unwrap();
    assert_eq!(
        t.to_m_line().unwrap(),
        "~m#IL1XUw6ASNBeq6mHQD0AL386EjSmeBeq6mHQBV4HQAAAIg=="
    );
    let stock =
        LwsTrace::from_m_line("~m#ILxI0w6ASNJePQGHQD0BLyZ4kjSmeJeFXmHQBV5HQAAAIg==").unwrap();
    // Read u64-clean, the stock line's first literal holds bits 0..=44 of a garbled value: not
    // the address that was captured.
    assert_eq!(stock.addrs[0], 0x1234_c3a0_1234);
    assert_ne!(stock.addrs[0], 0x55d4_c3a0_1234);
}

#[test]
fn lenient_base64_and_lead_in() {
    let want = LwsTrace::from_m_line("~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV").unwrap();
    for s in [
        "IF0BmUQugNCkgCnkhdAYpQa6wAAV",
        "  ~m#IF0BmUQugNCkgCnkhdAYpQa6wAAV\n",
        "~x#IF0BmUQugNCkgCnkhdAYpQa6wAAV",
    ] {
        assert_eq!(LwsTrace::from_m_line(s).unwrap(), want, "{s:?}");
    }
    assert!(matches!(
        LwsTrace::from_m_line("~m#IF0BmUQugNCkgCnkhdAYpQa6wAA"),
        Err(Error::LengthMismatch { .. }) | Err(Error::UnexpectedEnd { .. })
    ));
}
