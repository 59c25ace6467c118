//! A scratch directory for one test, shared by the test suites of every crate (included with
//! `#[path]`): made empty, removed when the test passes, kept when it fails (its path said
//! on stderr) for a look at what it holds. Test runs used to leave theirs in the temporary
//! directory: ~500 MB a `cargo test --workspace`, core files mostly.
//!
//! Each one is its own directory (`fibertrace-test-NAME-PID-N`): tests of one binary run on
//! parallel threads, and one's removal must not take another's files.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A test's scratch directory; removed when dropped, unless the thread is panicking.
pub struct Scratch(PathBuf);

impl Scratch {
    /// A new empty directory, named after `name`.
    pub fn new(name: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("fibertrace-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)
            .unwrap_or_else(|e| panic!("a scratch directory {}: {e}", d.display()));
        Scratch(d)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<OsStr> for Scratch {
    fn as_ref(&self) -> &OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the failed test's files are kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
