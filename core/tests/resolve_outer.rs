//! The symbol-table tier of the symbolizer (`resolve_outer`): a function's name and start
//! without the DWARF. In its own test binary: which files' DWARF the process loaded is
//! process-wide, and the other tests' lookups load it.

use fibertrace_core::symbolize::{
    self, dwarf_loads, resolve, resolve_outer, resolve_outer_address,
};
use fibertrace_core::Frame;

/// A static in the program's data, not its code.
static DATA: [u64; 4] = [1, 2, 3, 4];

#[inline(never)]
fn first_function(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_mul(3)
}

#[inline(never)]
fn second_function(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_add(7)
}

/// The one test of the binary: the order of its steps is the point (no DWARF, then DWARF).
#[test]
fn names_and_starts_come_from_the_symbol_table_until_a_full_lookup_loads_the_dwarf() {
    let f = first_function as *const () as usize as u64;
    let g = second_function as *const () as usize as u64;
    assert_eq!(first_function(1) + second_function(1), 11);

    // 1. Outer lookups name the functions and give their starts, and load no DWARF.
    assert_eq!(dwarf_loads(), 0, "nothing looked up yet");
    let a = resolve_outer(&Frame::Pc(f + 2)).unwrap();
    assert_eq!(a.function(), Some("resolve_outer::first_function"));
    assert_eq!(a.offset_of(f + 2), Some(2));
    assert_eq!(a.symbols.len(), 1, "the outermost level alone");
    assert_eq!(
        (a.symbols[0].file.as_deref(), a.symbols[0].line),
        (None, None)
    );
    assert!(a.image.as_ref().unwrap().path.ends_with(
        std::env::current_exe()
            .unwrap()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
    ));
    // A return address is looked up one byte back, as in the full tier.
    let b = resolve_outer(&Frame::Ra(g + 1)).unwrap();
    assert_eq!(b.lookup_address, g);
    assert_eq!(b.function(), Some("resolve_outer::second_function"));
    assert_eq!(b.function_start, Some(g));
    // Markers and Lua frames resolve to nothing, as in the full tier.
    assert!(resolve_outer(&Frame::Truncated).is_none());
    // An address outside every image: no name, nothing loaded.
    assert_eq!(resolve_outer_address(8).function(), None);
    // An address in the program but outside its code (a static's): no function, and no
    // DWARF loaded to look for one.
    let data = std::hint::black_box(&DATA) as *const [u64; 4] as u64;
    let d = resolve_outer_address(data);
    assert!(d.image.is_some(), "{d:?}");
    assert_eq!((d.function(), d.function_start), (None, None), "{d:?}");
    // Cached: the same result, shared.
    let again = resolve_outer(&Frame::Pc(f + 2)).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &again));
    assert_eq!(dwarf_loads(), 0, "no outer lookup loads the DWARF");

    // 2. A full lookup loads it once, and gives the same outermost name and start, with
    //    the file and line the outer one leaves out.
    let full = resolve(&Frame::Pc(f + 2)).unwrap();
    assert_eq!(
        dwarf_loads(),
        1,
        "the first full lookup loads the test binary's DWARF"
    );
    assert_eq!(full.function(), a.function());
    assert_eq!(full.function_start, a.function_start);
    let outer = full.symbols.last().unwrap();
    assert!(
        outer
            .file
            .as_deref()
            .is_some_and(|p| p.ends_with("resolve_outer.rs")),
        "{full:?}"
    );
    assert!(outer.line.is_some(), "{full:?}");

    // 3. Once it is loaded, outer lookups of other addresses answer from the loader's
    //    table: the same names and starts.
    let c = resolve_outer(&Frame::Pc(g + 3)).unwrap();
    assert_eq!(c.function(), Some("resolve_outer::second_function"));
    assert_eq!(c.function_start, Some(g));
    assert_eq!(c.function(), resolve(&Frame::Pc(g + 3)).unwrap().function());
    assert_eq!(dwarf_loads(), 1, "loaded once");

    // 4. The cache's clearing forgets outer results too (a library unloaded).
    symbolize::clear_cache();
    let d = resolve_outer(&Frame::Pc(f + 2)).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a, &d));
    assert_eq!(d.function(), a.function());
}
