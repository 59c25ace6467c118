//! Programs a test starts end with the test: [`Tied::tied`] has the kernel kill the child
//! when the thread that started it ends (a test that panics left its `fibertrace run`
//! running, a script waiting for input that never came). Included with `#[path]` (the Lua
//! crate's tests too).

/// See the module doc.
pub trait Tied {
    /// Kills the child (SIGKILL) when the thread that starts it ends.
    fn tied(&mut self) -> &mut Self;
}

impl Tied for std::process::Command {
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
