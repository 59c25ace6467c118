//! Codec figures: bytes per frame for lws / CBF / native / interned on the vector corpus and the
//! synthetic workload (printed first), then criterion timings of encode and decode with
//! throughput in frames (criterion prints elem/s; 1000 / Melem/s = ns per frame).
//!
//! `cargo bench -p fibertrace-core --bench codec` (add `-- --quick` for a fast run).

use criterion::{black_box, criterion_group, Criterion, Throughput};
use fibertrace_core::codec::cbf::{self, WordSize};
use fibertrace_core::codec::intern::StackStore;
use fibertrace_core::codec::lws::LwsTrace;
use fibertrace_core::codec::native::{self, ImageTable};
#[path = "../tests/synth/mod.rs"]
mod synth;

use fibertrace_core::Frame;
use std::time::Instant;
use synth::{Program, Rng};

const LWS_TSV: &str = include_str!("../tests/data/lws-vectors.tsv");

struct Corpus {
    traces: Vec<Vec<Frame>>,
    /// Same traces with frame 0 as a program counter (CBF's usual shape).
    cbf_traces: Vec<Vec<Frame>>,
    tables: Vec<ImageTable>,
    frames: usize,
}

fn corpus() -> Corpus {
    let traces = synth::lws_corpus(LWS_TSV);
    let cbf_traces = traces
        .iter()
        .map(|t| {
            let mut g = t.clone();
            if let Some(a) = g[0].address() {
                g[0] = Frame::Pc(a);
            }
            g
        })
        .collect();
    let tables = synth::infer_tables(&traces);
    let frames = traces.iter().map(Vec::len).sum();
    Corpus {
        traces,
        cbf_traces,
        tables,
        frames,
    }
}

/// ns per frame of `f` run over the corpus (best of 5 rounds of 20 passes).
fn ns_per_frame(frames: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        best = best.min(t.elapsed().as_nanos() as f64 / (20 * frames) as f64);
    }
    best
}

fn print_figures(c: &Corpus) {
    let per = |n: usize| n as f64 / c.frames as f64;
    let lws_blobs: Vec<Vec<u8>> = c
        .traces
        .iter()
        .map(|t| LwsTrace::from_frames(t, 0).encode().unwrap())
        .collect();
    let cbf_blobs: Vec<Vec<u8>> = c
        .cbf_traces
        .iter()
        .map(|t| cbf::encode(t, WordSize::W64).unwrap())
        .collect();
    let abs_blobs: Vec<Vec<u8>> = c.traces.iter().map(|t| native::encode(t, None)).collect();
    let rel_blobs: Vec<Vec<u8>> = c
        .traces
        .iter()
        .zip(&c.tables)
        .map(|(t, tab)| native::encode(t, Some(tab)))
        .collect();
    let size = |v: &[Vec<u8>]| per(v.iter().map(Vec::len).sum());
    // The vectors' own lws lines carry real allocation sizes.
    let lws_real: usize = LWS_TSV
        .lines()
        .take(200)
        .map(|l| {
            LwsTrace::from_m_line(l.split('\t').next().unwrap())
                .unwrap()
                .encode()
                .unwrap()
                .len()
        })
        .sum();
    println!(
        "== bytes/frame, lws-vectors.tsv lines 1-200 ({} traces, {} frames) ==",
        c.traces.len(),
        c.frames
    );
    println!(
        "lws blob              {:.3}  (with the vectors' alloc sizes: {:.3})",
        size(&lws_blobs),
        per(lws_real)
    );
    println!("CBF (64-bit)          {:.3}", size(&cbf_blobs));
    println!("native absolute       {:.3}", size(&abs_blobs));
    println!(
        "native module-rel.    {:.3}  (image tables inferred per process)",
        size(&rel_blobs)
    );

    // Interned: 100,000 traces of the synthetic program.
    let p = Program::new(1);
    let mut r = Rng::new(2);
    let traces: Vec<Vec<Frame>> = (0..100_000).map(|_| p.trace(&mut r)).collect();
    let s = StackStore::new();
    let t0 = Instant::now();
    for t in &traces {
        s.insert(t).unwrap();
    }
    let ins = t0.elapsed().as_nanos() as f64;
    let st = s.stats();
    println!(
        "interned store        {:.3}  ({} traces, {} frames, {} nodes; synthetic program); \
         insert {:.1} ns/frame",
        st.bytes_per_frame(),
        st.traces,
        st.frames,
        st.nodes,
        ins / st.frames as f64
    );
    let ids: Vec<_> = traces.iter().map(|t| s.insert(t).unwrap()).collect();
    let mut out = Vec::with_capacity(64);
    let t0 = Instant::now();
    for id in &ids {
        out.clear();
        s.get_into(*id, &mut out);
        black_box(&out);
    }
    println!(
        "interned lookup       {:.1} ns/frame",
        t0.elapsed().as_nanos() as f64 / st.frames as f64
    );

    println!("== ns/frame (encode / decode), same corpus ==");
    let n = c.frames;
    let e = ns_per_frame(n, || {
        for t in &c.traces {
            black_box(LwsTrace::from_frames(t, 0).encode().unwrap());
        }
    });
    let d = ns_per_frame(n, || {
        for b in &lws_blobs {
            black_box(LwsTrace::decode(b).unwrap());
        }
    });
    println!("lws                   {e:.1} / {d:.1}");
    let e = ns_per_frame(n, || {
        for t in &c.cbf_traces {
            black_box(cbf::encode(t, WordSize::W64).unwrap());
        }
    });
    let d = ns_per_frame(n, || {
        for b in &cbf_blobs {
            black_box(cbf::decode(b).unwrap());
        }
    });
    println!("CBF                   {e:.1} / {d:.1}");
    let e = ns_per_frame(n, || {
        for t in &c.traces {
            black_box(native::encode(t, None));
        }
    });
    let d = ns_per_frame(n, || {
        for b in &abs_blobs {
            black_box(native::decode(b, None).unwrap());
        }
    });
    println!("native absolute       {e:.1} / {d:.1}");
    let e = ns_per_frame(n, || {
        for (t, tab) in c.traces.iter().zip(&c.tables) {
            black_box(native::encode(t, Some(tab)));
        }
    });
    let d = ns_per_frame(n, || {
        for (b, tab) in rel_blobs.iter().zip(&c.tables) {
            black_box(native::decode(b, Some(tab)).unwrap());
        }
    });
    println!("native module-rel.    {e:.1} / {d:.1}");
}

fn benches(cr: &mut Criterion) {
    let c = corpus();
    let lws_blobs: Vec<Vec<u8>> = c
        .traces
        .iter()
        .map(|t| LwsTrace::from_frames(t, 0).encode().unwrap())
        .collect();
    let cbf_blobs: Vec<Vec<u8>> = c
        .cbf_traces
        .iter()
        .map(|t| cbf::encode(t, WordSize::W64).unwrap())
        .collect();
    let abs_blobs: Vec<Vec<u8>> = c.traces.iter().map(|t| native::encode(t, None)).collect();
    let mut g = cr.benchmark_group("codec");
    g.throughput(Throughput::Elements(c.frames as u64));
    g.bench_function("lws/encode", |b| {
        b.iter(|| {
            for t in &c.traces {
                black_box(LwsTrace::from_frames(t, 0).encode().unwrap());
            }
        })
    });
    g.bench_function("lws/decode", |b| {
        b.iter(|| {
            for x in &lws_blobs {
                black_box(LwsTrace::decode(x).unwrap());
            }
        })
    });
    g.bench_function("cbf/encode", |b| {
        b.iter(|| {
            for t in &c.cbf_traces {
                black_box(cbf::encode(t, WordSize::W64).unwrap());
            }
        })
    });
    g.bench_function("cbf/decode", |b| {
        b.iter(|| {
            for x in &cbf_blobs {
                black_box(cbf::decode(x).unwrap());
            }
        })
    });
    g.bench_function("native/encode", |b| {
        b.iter(|| {
            for t in &c.traces {
                black_box(native::encode(t, None));
            }
        })
    });
    g.bench_function("native/decode", |b| {
        b.iter(|| {
            for x in &abs_blobs {
                black_box(native::decode(x, None).unwrap());
            }
        })
    });
    g.finish();
}

criterion_group!(group, benches);

fn main() {
    print_figures(&corpus());
    group();
    Criterion::default().configure_from_args().final_summary();
}
