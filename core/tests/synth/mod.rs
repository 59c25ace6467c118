//! A synthetic program for measuring codecs and the stack store: deterministic traces with the
//! shape of a real fiber server's allocation stacks. Not a model of any particular program;
//! used by tests and benchmarks only.
//!
//! The program has 4000 functions in a 12 MiB PIE text segment and a few libc entry points.
//! A function has 0–6 call sites (30% are leaves); callees are mostly functions defined near it
//! (locality), 3% of sites recurse, 2% call into libc. Every trace starts from the same 6 root
//! frames (`_start` … scheduler loop), enters one of 16 fiber tasks (Zipf-weighted), then walks
//! call sites (Zipf-weighted: a function's first site is taken most often) until it stops (12%
//! per step) or reaches 48 frames, and ends in a 2-frame allocator wrapper.

// Each test crate and the codec bench use a different part of it.
#![allow(dead_code)]

use fibertrace_core::codec::native::{ImageRef, ImageTable};
use fibertrace_core::Frame;
use std::collections::BTreeMap;

/// A deterministic xorshift64* generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    /// Index in `0..n` with Zipf(1) weights.
    pub fn zipf(&mut self, n: usize) -> usize {
        let h: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
        let mut x = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * h;
        for i in 0..n {
            x -= 1.0 / (i + 1) as f64;
            if x <= 0.0 {
                return i;
            }
        }
        n - 1
    }
}

const NFUNCS: usize = 4000;
const TEXT_BASE: u64 = 0x5612_3400_0000;
const TEXT_SIZE: u64 = 12 << 20;
const LIBC_BASE: u64 = 0x7f3a_1200_0000;

/// A call site: its return address and the function it calls (`None`: a libc leaf).
#[derive(Debug, Clone, Copy)]
struct Site {
    ra: u64,
    callee: Option<usize>,
}

/// The synthetic program (see the module docs).
#[derive(Debug, Clone)]
pub struct Program {
    sites: Vec<Vec<Site>>,
    roots: Vec<Frame>,
    tasks: Vec<usize>,
    alloc: [Frame; 2],
}

impl Program {
    /// The program built from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut r = Rng::new(seed);
        let mut starts: Vec<u64> = (0..NFUNCS)
            .map(|_| (TEXT_BASE + r.below(TEXT_SIZE)) & !0xf)
            .collect();
        starts.sort_unstable();
        let mut sites = Vec::with_capacity(NFUNCS);
        for (f, &start) in starts.iter().enumerate() {
            let n = if r.chance(0.3) {
                0
            } else {
                1 + r.below(6) as usize
            };
            let v = (0..n)
                .map(|_| {
                    let ra = start + 16 + r.below(2048);
                    let callee = if r.chance(0.02) {
                        None
                    } else if r.chance(0.03) {
                        Some(f)
                    } else {
                        Some((f + 1 + r.below(400) as usize) % NFUNCS)
                    };
                    Site { ra, callee }
                })
                .collect();
            sites.push(v);
        }
        let roots = (0..6)
            .map(|i| Frame::Ra(TEXT_BASE + TEXT_SIZE + 0x100 * i + r.below(0x80)))
            .collect();
        let tasks = (0..16)
            .map(|_| r.below(NFUNCS as u64 / 4) as usize)
            .collect();
        let alloc = [
            Frame::Ra(LIBC_BASE + 0x9_a000 + r.below(0x100)),
            Frame::Ra(TEXT_BASE + 0x40 + r.below(0x100)),
        ];
        Self {
            sites,
            roots,
            tasks,
            alloc,
        }
    }

    /// One trace, innermost first.
    pub fn trace(&self, r: &mut Rng) -> Vec<Frame> {
        let mut path: Vec<Frame> = self.roots.clone();
        let mut f = self.tasks[r.zipf(self.tasks.len())];
        path.push(Frame::Ra(
            TEXT_BASE + (f as u64) * 0x1000 % TEXT_SIZE + 0x31,
        ));
        while path.len() < 48 && !self.sites[f].is_empty() && !r.chance(0.12) {
            let s = self.sites[f][r.zipf(self.sites[f].len())];
            path.push(Frame::Ra(s.ra));
            match s.callee {
                Some(c) => f = c,
                None => {
                    path.push(Frame::Ra(LIBC_BASE + r.below(0x18_0000)));
                    break;
                }
            }
        }
        path.extend_from_slice(&self.alloc);
        path.reverse();
        path
    }
}

/// Rebuilds plausible image tables for traces whose tables are unknown (the lws vectors): addresses within 64 MiB of each other form one image, and
/// traces sharing an image belong to one process. Returns each trace's process table.
pub fn infer_tables(traces: &[Vec<Frame>]) -> Vec<ImageTable> {
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
        .map(|t| match t.iter().find_map(Frame::address) {
            Some(a) => tables[&root(&mut parent, cluster_of(a))].clone(),
            None => ImageTable::default(),
        })
        .collect()
}

/// The 200 realistic traces of the lws vector file (lines 1–200), as frames.
pub fn lws_corpus(tsv: &str) -> Vec<Vec<Frame>> {
    tsv.lines()
        .take(200)
        .filter_map(|l| {
            fibertrace_core::codec::lws::LwsTrace::from_m_line(l.split('\t').next()?).ok()
        })
        .map(|t| t.to_frames())
        .collect()
}
