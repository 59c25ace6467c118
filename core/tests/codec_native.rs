//! The native format on the realistic lines (1–200) of `lws-vectors.tsv`: exact round trips in
//! both modes and the size target.

use fibertrace_core::codec::lws::LwsTrace;
use fibertrace_core::codec::native::{self, ImageRef, ImageTable};
use fibertrace_core::codec::{cbf, Error};
use fibertrace_core::Frame;
use std::collections::BTreeMap;

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

/// Rebuilds plausible image tables: addresses within 64 MiB of each other form one image, and
/// traces sharing an image belong to one process. Returns each trace's process table.
fn inferred_tables(traces: &[Vec<Frame>]) -> Vec<ImageTable> {
    let mut addrs: Vec<u64> = traces.iter().flatten().filter_map(Frame::address).collect();
    addrs.sort_unstable();
    addrs.dedup();
    let mut clusters: Vec<(u64, u64)> = Vec::new();
    for a in addrs {
        match clusters.last_mut() {
            Some((_, hi)) if a - *hi < 64 << 20 => *hi = a,
            _ => clusters.push((a, a)),
        }
    }
    let cluster_of = |a: u64| clusters.partition_point(|&(lo, _)| lo <= a) - 1;
    // Union-find over clusters used together in a trace.
    let mut parent: Vec<usize> = (0..clusters.len()).collect();
    fn root(p: &mut [usize], mut i: usize) -> usize {
        while p[i] != i {
            p[i] = p[p[i]];
            i = p[i];
        }
        i
    }
    for t in traces {
        let cs: Vec<usize> = t
            .iter()
            .filter_map(Frame::address)
            .map(cluster_of)
            .collect();
        for w in cs.windows(2) {
            let (a, b) = (root(&mut parent, w[0]), root(&mut parent, w[1]));
            parent[a] = b;
        }
    }
    let mut procs: BTreeMap<usize, Vec<ImageRef>> = BTreeMap::new();
    for (i, &(lo, hi)) in clusters.iter().enumerate() {
        let r = root(&mut parent, i);
        procs.entry(r).or_default().push(ImageRef {
            base: lo & !0xfff,
            end: hi + 1,
            build_id: (i as u32).to_le_bytes().repeat(5),
            path: format!("/image{i}"),
        });
    }
    let tables: BTreeMap<usize, ImageTable> = procs
        .into_iter()
        .map(|(r, ims)| (r, ImageTable::new(ims)))
        .collect();
    traces
        .iter()
        .map(|t| {
            let c = cluster_of(t[0].address().unwrap());
            tables[&root(&mut parent, c)].clone()
        })
        .collect()
}

#[test]
fn round_trips_on_corpus() {
    let traces = corpus();
    let tables = inferred_tables(&traces);
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
    let tables = inferred_tables(&traces);
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
    let tables = inferred_tables(&traces);
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
