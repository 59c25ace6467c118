//! What the acceptance tests share: the `fibertrace` binary as a user runs it (from another
//! directory), scratch directories, and the repository's sources.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Programs a test starts end with the test: [`Tied::tied`] has the kernel kill the child
/// when the thread that started it ends (a test that panicked left its `fibertrace run`
/// running, a script waiting for a file that never came).
pub trait Tied {
    /// Kills the child (SIGKILL) when the thread that starts it ends.
    fn tied(&mut self) -> &mut Self;
}

impl Tied for Command {
    fn tied(&mut self) -> &mut Self {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls may be made: `prctl` is a plain system call.
        unsafe {
            self.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            })
        }
    }
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// The `fibertrace` binary: `$FIBERTRACE_BIN`, else the one cargo built beside these tests
/// (`cargo test --workspace` builds it, for the Lua crate's own tests).
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("FIBERTRACE_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<this test> -> target/<profile>/fibertrace
    let exe = std::env::current_exe().expect("the test's own path");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("fibertrace"))
        .expect("a target directory");
    assert!(
        p.exists(),
        "{} is not built: run the workspace's tests (cargo test --workspace), or set \
         FIBERTRACE_BIN",
        p.display()
    );
    p
}

#[path = "../scratch.rs"]
mod scratch_dir;
pub use scratch_dir::Scratch;

/// A new empty directory for one test, removed when the test passes (see [`Scratch`]).
pub fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("acc-{name}"))
}

/// Runs the binary with `args` in directory `cwd`.
pub fn run_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the binary runs")
}

/// The binary with `args`, to run in `cwd` with its standard output piped (see
/// [`spawn_until`]).
pub fn command_in(cwd: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(binary());
    c.args(args)
        .current_dir(cwd)
        .stdout(std::process::Stdio::piped());
    c
}

/// Spawns `cmd` (its standard output piped) and returns once its first line is `first` (a
/// script saying it is ready); the child runs on, its output no longer read.
pub fn spawn_until(mut cmd: Command, first: &str) -> std::process::Child {
    use std::io::BufRead;
    let mut child = cmd.tied().spawn().expect("the binary runs");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("its output piped"))
        .read_line(&mut line)
        .expect("its first line");
    if line != first {
        let _ = child.kill();
        let _ = child.wait();
        panic!("its first line is {line:?}, not {first:?}");
    }
    child
}

/// Runs the binary with `args` in `cwd` until its first line is `first` (see
/// [`spawn_until`]).
pub fn start_until(cwd: &Path, args: &[&str], first: &str) -> std::process::Child {
    spawn_until(command_in(cwd, args), first)
}
