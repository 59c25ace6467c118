// With the `libunwind` feature, libunwind.so is linked (through the `unwind` crate). It
// exports the whole `_Unwind_*` ABI; if it came first among the libraries that define it,
// every Rust panic and `std::backtrace` of the host process would run on it (34x slower
// panics measured). Naming libgcc_s here puts it ahead of libunwind in the link order (a
// crate's native libraries precede those of its dependencies), so the process keeps
// libgcc's `_Unwind_*` and libunwind serves only the `unw_*` calls made on purpose.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_LIBUNWIND").is_some() {
        println!("cargo:rustc-link-lib=dylib=gcc_s");
    }
}
