//! The fuzz targets' properties (fuzz/src/lib.rs) on deterministic pseudo-random inputs, so
//! that stable `cargo test` checks them too, plus inputs kept from fuzzing runs.

#[path = "../../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz;

mod synth;

use synth::Rng;

fn inputs(seed: u64, n: usize) -> Vec<Vec<u8>> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| {
            let len = r.below(200) as usize;
            (0..len).map(|_| r.next_u64() as u8).collect()
        })
        .collect()
}

#[test]
fn lws_properties() {
    for d in inputs(1, 20_000) {
        fuzz::check_lws(&d);
    }
}

#[test]
fn cbf_properties() {
    for d in inputs(2, 20_000) {
        fuzz::check_cbf(&d);
    }
}

#[test]
fn native_properties() {
    for d in inputs(3, 20_000) {
        fuzz::check_native(&d);
    }
}
