//! The interned store on 100,000 traces of the synthetic program: exact round trips, size,
//! concurrency.

use fibertrace_core::codec::intern::{StackId, StackStore};
mod synth;

use std::sync::Arc;
use synth::{Program, Rng};

#[test]
fn hundred_thousand_traces() {
    let p = Program::new(1);
    let mut r = Rng::new(2);
    let s = StackStore::new();
    let traces: Vec<_> = (0..100_000).map(|_| p.trace(&mut r)).collect();
    let ids: Vec<StackId> = traces.iter().map(|t| s.insert(t).unwrap()).collect();
    for (t, id) in traces.iter().zip(&ids) {
        assert_eq!(&s.get(*id).unwrap(), t);
    }
    let st = s.stats();
    let distinct = {
        let mut v = ids.clone();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    println!(
        "interned: {} traces, {} frames, {distinct} distinct traces, {} nodes, {} distinct \
         frames, {} bytes = {:.3} bytes/frame (+4 bytes/trace for the caller's id: {:.3})",
        st.traces,
        st.frames,
        st.nodes,
        st.distinct_frames,
        st.bytes,
        st.bytes_per_frame(),
        (st.bytes as f64 + 4.0 * st.traces as f64) / st.frames as f64
    );
    assert_eq!(st.traces, 100_000);
    assert_eq!(st.refused, 0);
    assert!(st.bytes_per_frame() <= 1.0);
}

#[test]
fn concurrent_inserts_agree() {
    let p = Arc::new(Program::new(3));
    let s = Arc::new(StackStore::new());
    let handles: Vec<_> = (0..4)
        .map(|k| {
            let (p, s) = (p.clone(), s.clone());
            std::thread::spawn(move || {
                // Same seed in every thread: the same traces race to be inserted.
                let mut r = Rng::new(9 + k % 2);
                (0..5000)
                    .map(|_| {
                        let t = p.trace(&mut r);
                        (s.insert(&t).unwrap(), t)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for res in &results {
        for (id, t) in res {
            assert_eq!(&s.get(*id).unwrap(), t);
        }
    }
    assert_eq!(
        results[0].iter().map(|x| x.0).collect::<Vec<_>>(),
        results[2].iter().map(|x| x.0).collect::<Vec<_>>()
    );
    assert_eq!(s.stats().traces, 20_000);
}
