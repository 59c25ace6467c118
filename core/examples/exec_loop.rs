//! A process that keeps replacing itself (for the tests of `fibertrace_core::remote`): it
//! starts 200 threads, and 20 ms later the last of them execs the program with its count less
//! one, until the count is 0; then it waits for its standard input to end. (A thread other
//! than the main one: the one a reader stops last.) Reading such a process used to hang both
//! processes: an exec waits for the threads it kills to be reaped by their tracer, holding a
//! lock that the tracer's next `PTRACE_SEIZE` waits for.
//!
//! ```sh
//! cargo run -p fibertrace-core --example exec_loop -- 100000 &      # then: fibertrace dump $!
//! ```

use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::time::Duration;

fn main() {
    let count: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    for _ in 0..200 {
        std::thread::spawn(|| loop {
            std::thread::park();
        });
    }
    if count == 0 {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return;
    }
    let execs = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        let me = std::env::current_exe().expect("its own path");
        std::process::Command::new(me)
            .arg((count - 1).to_string())
            .exec()
    });
    let e = execs.join();
    eprintln!("exec_loop: {e:?}");
    std::process::exit(1);
}
