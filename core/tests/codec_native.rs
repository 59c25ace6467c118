//! The native format on the realistic lines (1–200) of `lws-vectors.tsv`: exact round trips in
//! both modes and the size target.

use fibertrace_core::codec::lws::LwsTrace;
use fibertrace_core::codec::native;
mod synth;
use fibertrace_core::codec::{cbf, Error};
use fibertrace_core::Frame;

const VECTORS: &str = include_str!("data/lws-vectors.tsv");

/// The 200 realistic traces, as lws records them (all return addresses).
fn corpus() -> Vec<Vec<Frame>> {
    VECTORS
        .lines()
        .take(200)
        .map(|l| {
            LwsTrace::from_m_line(l.split('\t').next().unwrap())
                .unwrap()
                .to_frames()
        })
        .collect()
}

#[test]
fn round_trips_on_corpus() {
    let traces = corpus();
    let tables = synth::infer_tables(&traces);
    for (i, (t, tab)) in traces.iter().zip(&tables).enumerate() {
        for (j, f) in [t.clone(), {
            let mut g = t.clone();
            g[0] = Frame::Pc(g[0].address().unwrap());
            g
        }]
        .iter()
        .enumerate()
        {
            let b = native::encode(f, None);
            assert_eq!(&native::decode(&b, None).unwrap(), f, "line {} #{j}", i + 1);
            let b = native::encode(f, Some(tab));
            assert_eq!(
                &native::decode(&b, Some(tab)).unwrap(),
                f,
                "line {} #{j}",
                i + 1
            );
            let line = native::to_line(f, Some(tab));
            assert_eq!(&native::from_line(&line, Some(tab)).unwrap(), f);
        }
    }
}

#[test]
fn sizes_on_corpus() {
    let traces = corpus();
    let tables = synth::infer_tables(&traces);
    let frames: usize = traces.iter().map(Vec::len).sum();
    assert_eq!(frames, 3217);
    let sum = |f: &dyn Fn(usize, &Vec<Frame>) -> usize| -> f64 {
        traces
            .iter()
            .enumerate()
            .map(|(i, t)| f(i, t))
            .sum::<usize>() as f64
            / frames as f64
    };
    let lws = sum(&|_, t| LwsTrace::from_frames(t, 0).encode().unwrap().len());
    let cbf = sum(&|_, t| {
        let mut g = t.clone();
        g[0] = Frame::Pc(g[0].address().unwrap());
        cbf::encode(&g, cbf::WordSize::W64).unwrap().len()
    });
    let abs = sum(&|_, t| native::encode(t, None).len());
    let rel = sum(&|i, t| native::encode(t, Some(&tables[i])).len());
    println!(
        "bytes/frame over {} traces, {frames} frames: lws {lws:.3} (size 0), CBF {cbf:.3}, \
         native absolute {abs:.3}, native module-relative {rel:.3}",
        traces.len()
    );
    assert!(abs < cbf && abs < lws);
    assert!(rel <= 3.0, "module-relative {rel}");
}

#[test]
fn corrupt_input_never_panics() {
    let traces = corpus();
    let tables = synth::infer_tables(&traces);
    let b = native::encode(&traces[0], Some(&tables[0]));
    for cut in 0..b.len() {
        assert!(native::decode(&b[..cut], Some(&tables[0])).is_err());
    }
    for i in 0..b.len() * 8 {
        let mut c = b.clone();
        c[i / 8] ^= 0x80 >> (i % 8);
        let _: Result<_, Error> = native::decode(&c, Some(&tables[0]));
        let _: Result<_, Error> = native::decode(&c, None);
    }
}
