//! `/debug/fibers` over HTTP: every view of the process's fibers ([`super::export`]), served
//! from a thread of its own, so it answers while a fiber spins or a scheduler is blocked.
//!
//! Off until [`serve`] is called (`fibertrace run --http ADDR`). Paths:
//!
//! | path | what |
//! |---|---|
//! | `/`, `/debug/fibers/`, `/debug/pprof/` | an index page linking every view |
//! | `/debug/fibers?format=NAME` | one view: `text` (the default), `grouped`, `json`, `pprof`, `folded`, `svg`, `speedscope` |
//! | `/debug/pprof/goroutine` | the pprof profile, where Go serves its goroutines (so Parca, Pyroscope and Grafana Alloy scrape it unchanged); `?debug=1` the grouped text, `?debug=2` the full text, as Go |
//! | `/debug/pprof/heap`, `/debug/pprof/allocs` | the heap profile (pprof with Go's four sample types, labelled by fiber) when the process's allocator tracks the heap (`fibertrace_core::heap`); 404 with why otherwise |
//!
//! Why a server of its own on `std` and not a crate: it serves `GET` (and `HEAD`) of a few
//! fixed paths and closes each connection after one answer, and what it must bound — bytes of
//! a request head, connections at once, time to read a request and to write an answer — is
//! each a line here; the small crates (tiny_http) keep an unbounded pool of connection
//! threads and no head limit of their own to set.
//!
//! How it runs: one thread accepts connections, reads every request head at once (`poll`, no
//! thread per connection) and answers refusals itself; answering threads answer the
//! requests read, in turn: one started with the server (at the memory limit, `ulimit -v`, a
//! thread's stack cannot be had: when a thread was started per connection, every request
//! was dropped unanswered, when the stacks matter most), more as requests come, up to
//! [`Limits::max_connections`], kept after. An answering thread writes what the client's
//! socket takes at once and hands the rest over to the server's thread, which writes it as
//! the client reads (`poll` again) and waits for the client to close: a client that does not
//! read its answer holds no answering thread (when one did, eight such clients delayed every
//! answer by the write timeout, 30 s). While the answers held so add up to
//! [`Limits::max_sending_bytes`] or more, a view asked for is told 503 at once (the index
//! and refusals are still answered): one built then would wait with them, and each held an
//! answering thread until its write timeout, every request behind it waiting. A view is
//! also told 503 when the process is too near its address-space limit (`ulimit -v`) to build
//! it (its last size of that kind, or 16 KiB a fiber, three times over): a failed
//! allocation aborts the process, and a view must never end the program it shows. A
//! request whose client reset its connection while it waited is dropped unbuilt.
//!
//! Limits ([`Limits`]): a request head over [`Limits::max_head`] bytes gets 431; one not sent
//! within [`Limits::read_timeout`] (in all, however it trickles) gets 408; an answer not taken
//! by the client within [`Limits::write_timeout`] (in all) is cut; past
//! [`Limits::max_waiting`] connections whose request has not come yet, a new one gets 503 at
//! once (clients that connect and send nothing — a browser's speculative preconnects, a
//! stalled proxy — cost a descriptor and a look each, and hold no place of an answer), and a
//! request read while [`Limits::max_queued`] others wait for an answering thread gets 503
//! (requests beyond the answers under way wait their turn: a burst of scrapes is answered,
//! not refused); a connection that comes while the process is out of file descriptors
//! (`ulimit -n` reached) gets 503 at once (the server keeps one in reserve to tell it:
//! otherwise it waited unanswered in the listen queue); any method but `GET`/`HEAD` gets 405; a bad query value, or one given
//! twice, 400, saying what is accepted. A request line in absolute form (`GET
//! http://host/path`) is served as its path. A server
//! on the loopback address answers only requests whose `Host` is `localhost`, `127.0.0.1` or
//! `[::1]` (403 otherwise): a web page in the user's browser cannot read the stacks through a
//! name that resolves to 127.0.0.1 (DNS rebinding). A request with more than one `Host` gets
//! 400, on any address (a proxy in front may read another one than the check did). A request never stops the process or a fiber:
//! the views are the same snapshots as every dump (see [`super`] for how one can be wrong:
//! not atomic across fibers; a spinning Lua fiber's frames native only, with a note).
//!
//! A program about to end can wait for the answers under way ([`finish_answers`]): its exit
//! would cut them off, and a client that asked at that moment got no answer. Requests sent
//! before it began (connections not accepted yet, requests not read yet) are taken in first
//! and answered; requests read after are told 503.
//!
//! Listening: [`parse_addr`] takes `PORT` or `:PORT` as the loopback address (127.0.0.1);
//! anything else (`0.0.0.0:6060`, `[::]:6060`, `myhost:6060`) is listened on as given (an IPv6
//! address in brackets: `::6060` is refused, not read as every address) —
//! exposing every fiber's stack beyond the machine is the caller's explicit choice.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::export::{self, Format};

/// The bounds of a server (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Requests answered at once (each takes a snapshot of every fiber and encodes it): the
    /// answering threads, started with the server (none is started per request: at the
    /// memory limit a new thread's stack cannot be had, and the connection was dropped
    /// unanswered).
    pub max_connections: usize,
    /// Connections whose request has not come yet (each waits at most
    /// [`Limits::read_timeout`]; read by the server's one thread, no thread each); one more
    /// gets 503 at once.
    pub max_waiting: usize,
    /// Requests read and waiting for an answering thread; one more gets 503 at once.
    pub max_queued: usize,
    /// Bytes of a request's head (request line and headers).
    pub max_head: usize,
    /// Time to receive a request's head.
    pub read_timeout: Duration,
    /// Time to send an answer.
    pub write_timeout: Duration,
    /// Bytes of answers not yet taken by their clients that the server's thread holds before
    /// views asked for are told 503 (see the module doc).
    pub max_sending_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 8,
            max_waiting: 256,
            max_queued: 64,
            max_head: 8 * 1024,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
            max_sending_bytes: 256 << 20,
        }
    }
}

/// Why a server could not start.
#[derive(Debug)]
pub enum HttpError {
    /// The address is not `PORT`, `:PORT` or `HOST:PORT`, or its host does not resolve.
    Address(String),
    /// Binding failed (in use, no permission).
    Bind(SocketAddr, io::Error),
    /// The server's thread could not be started.
    Thread(io::Error),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Address(m) => f.write_str(m),
            HttpError::Bind(a, e) => write!(f, "cannot listen on {a}: {e}"),
            HttpError::Thread(e) => write!(f, "cannot start the HTTP thread: {e}"),
        }
    }
}

impl std::error::Error for HttpError {}

/// The addresses `s` names: `PORT` or `:PORT` is the loopback address; `HOST:PORT` (a name,
/// an IPv4 address, `[IPv6]`) as given.
pub fn parse_addr(s: &str) -> Result<Vec<SocketAddr>, HttpError> {
    // (A long address is cut in the message: a megabyte given made a megabyte's error.)
    let bad = |why: &str| {
        HttpError::Address(format!(
            "bad address {}: {why} (expected PORT, :PORT or HOST:PORT, e.g. \
             127.0.0.1:6060)",
            super::export::short_quoted(s)
        ))
    };
    let port_only = s.strip_prefix(':').unwrap_or(s);
    if !port_only.is_empty() && port_only.bytes().all(|b| b.is_ascii_digit()) {
        let port: u16 = port_only
            .parse()
            .map_err(|_| bad("the port is past 65535"))?;
        return Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))]);
    }
    if s.is_empty() {
        return Err(bad("empty"));
    }
    if let Some((scheme, _)) = s.split_once("://") {
        return Err(bad(&format!(
            "an address, not a URL: leave out {}",
            super::export::short_quoted(&format!("{scheme}://"))
        )));
    }
    if let Some(n) = s.strip_prefix('-') {
        if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("a port is a number from 0 to 65535"));
        }
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(bad("an IPv6 host goes in brackets, e.g. [::1]:6060"));
    }
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("the port is not a number"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("the port is past 65535"))?;
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| bad(&format!("cannot resolve it: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(bad("it resolves to no address"));
    }
    Ok(addrs)
}

/// A running server; [`Server::stop`] (or dropping it) stops it.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    queue: Arc<Queue>,
    /// Told by the server's thread once it no longer listens.
    closed: Receiver<()>,
}

impl Server {
    /// The address it listens on (the port chosen, when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections and waits until the port is closed (answers under way
    /// finish on their own: requests read are answered, answers handed to the server's
    /// thread are written, each within the write timeout).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The answering threads end once the requests read are answered.
        self.queue.close();
        self.queue.outbox.wake();
        if let Some(t) = self.thread.take() {
            // It closes the port at once (its `poll` waits a second at most, and the wake-up
            // ends that), then goes on with the answers it holds: it is left to them.
            let _ = self.closed.recv_timeout(Duration::from_secs(5));
            drop(t);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

/// Serves the views on `addr` (see [`parse_addr`]) with the default [`Limits`].
pub fn serve(addr: &str) -> Result<Server, HttpError> {
    serve_with(addr, Limits::default())
}

/// Serves the views on `addr` with `limits`.
pub fn serve_with(addr: &str, limits: Limits) -> Result<Server, HttpError> {
    let addrs = parse_addr(addr)?;
    let listener = bind(&addrs)?;
    let local = listener
        .local_addr()
        .map_err(|e| HttpError::Bind(addrs[0], e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| HttpError::Bind(local, e))?;
    // Under an address-space limit, room kept for the views (see `VIEW_ROOM`).
    VIEW_ASIDE.take(VIEW_ROOM);
    let stop = Arc::new(AtomicBool::new(false));
    let (queue, woken) = Queue::new().map_err(HttpError::Thread)?;
    let queue = Arc::new(queue);
    let (closed_tx, closed) = std::sync::mpsc::sync_channel(1);
    // One answering thread now, so that one is there at the memory limit; more as requests
    // come (up to `max_connections`), kept after.
    if let Err(e) = Queue::start_thread(&queue, &limits) {
        queue.close();
        return Err(HttpError::Thread(e));
    }
    let (stop2, q) = (stop.clone(), queue.clone());
    let thread = std::thread::Builder::new()
        .name("fibertrace-http".into())
        .spawn(move || accept_loop(listener, limits, &stop2, &q, woken, closed_tx));
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            queue.close();
            return Err(HttpError::Thread(e));
        }
    };
    {
        let mut all = SWEEPERS.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|q| q.strong_count() > 0);
        all.push(Arc::downgrade(&queue));
    }
    Ok(Server {
        addr: local,
        stop,
        thread: Some(thread),
        queue,
        closed,
    })
}

fn bind(addrs: &[SocketAddr]) -> Result<TcpListener, HttpError> {
    let mut last = None;
    for a in addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(HttpError::Bind(*a, e)),
        }
    }
    Err(last.unwrap_or_else(|| HttpError::Address("no address to listen on".into())))
}

/// A request read (or refused while reading: the status and why), waiting for an answering
/// thread.
struct Job {
    stream: TcpStream,
    req: Result<Request, (u16, String)>,
    /// Counted in [`WRITING`] until answered.
    _writing: Writing,
}

/// The requests read, for the answering threads.
struct Queue {
    state: std::sync::Mutex<QueueState>,
    ready: std::sync::Condvar,
    /// Where answering threads hand answers over to the server's thread.
    outbox: Outbox,
    /// The last of [`SWEEP_ASKED`] the server's thread answered with a last look (see
    /// [`finish_answers`]).
    swept: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    jobs: std::collections::VecDeque<Job>,
    closed: bool,
    /// Answering threads started (and not ended).
    threads: usize,
    /// Of them, the ones waiting for a job.
    idle: usize,
}

impl Queue {
    /// An empty queue, and the end of its outbox's wake-up the server's thread watches.
    fn new() -> io::Result<(Queue, UnixStream)> {
        let (waker, woken) = UnixStream::pair()?;
        waker.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let q = Queue {
            state: Default::default(),
            ready: Default::default(),
            outbox: Outbox {
                state: Default::default(),
                waker,
            },
            swept: AtomicU64::new(0),
        };
        Ok((q, woken))
    }

    /// Queues `job` unless `limits.max_queued` are waiting (or the server stopped): it comes
    /// back then. Starts one more answering thread when none is idle and fewer than
    /// `limits.max_connections` run (a thread that cannot be started: the ones there answer).
    fn push(q: &Arc<Queue>, job: Job, limits: &Limits) -> Result<(), Job> {
        let mut g = q.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.closed || g.jobs.len() >= limits.max_queued {
            return Err(job);
        }
        g.jobs.push_back(job);
        let more = g.idle < g.jobs.len() && g.threads < limits.max_connections;
        drop(g);
        q.ready.notify_one();
        if more {
            let _ = Queue::start_thread(q, limits);
        }
        Ok(())
    }

    /// Starts an answering thread (none at the memory limit: a thread that cannot map its
    /// signal stack aborts the process as it starts, see
    /// `fibertrace_core::heap::room_for_thread`).
    fn start_thread(q: &Arc<Queue>, limits: &Limits) -> io::Result<()> {
        if !fibertrace_core::heap::room_for_thread(8 << 20) {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        q.state.lock().unwrap_or_else(|e| e.into_inner()).threads += 1;
        let (q2, limits) = (q.clone(), *limits);
        let spawned = std::thread::Builder::new()
            .name("fibertrace-http-answer".into())
            // Encoding runs here: gzip's state in a debug build wants more than 2 MiB
            // would give with room to spare (only what is touched is committed).
            .stack_size(8 << 20)
            .spawn(move || answer_loop(&q2, &limits));
        if let Err(e) = spawned {
            q.state.lock().unwrap_or_else(|e| e.into_inner()).threads -= 1;
            return Err(e);
        }
        Ok(())
    }

    /// The next job; `None` once the server stopped and none is left.
    fn pop(&self) -> Option<Job> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(j) = g.jobs.pop_front() {
                return Some(j);
            }
            if g.closed {
                g.threads -= 1;
                return None;
            }
            g.idle += 1;
            g = self.ready.wait(g).unwrap_or_else(|e| e.into_inner());
            g.idle -= 1;
        }
    }

    fn close(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.ready.notify_all();
    }
}

fn answer_loop(q: &Queue, limits: &Limits) {
    while let Some(job) = q.pop() {
        answer(job, limits, &q.outbox);
    }
}

/// Answers being written by the server's thread (see the module doc): an answering thread
/// writes what the client's socket takes at once and hands the rest over here.
struct Outbox {
    state: std::sync::Mutex<OutboxState>,
    /// Written to wake the server's thread (its `poll` watches the other end).
    waker: UnixStream,
}

#[derive(Default)]
struct OutboxState {
    /// Handed over, not yet taken by the server's thread.
    new: Vec<Sending>,
    /// Bytes not yet written of the answers handed over (new or being written).
    bytes: usize,
    /// Connections handed over and not yet closed.
    count: usize,
    /// The server's thread has ended: nothing more is taken.
    closed: bool,
}

impl Outbox {
    /// Hands `snd` over to the server's thread, unless it is gone or holds
    /// `limits.max_sending_bytes` (or `limits.max_waiting` connections) already: `snd`
    /// comes back then.
    fn hand_over(&self, mut snd: Sending, limits: &Limits) -> Result<(), Sending> {
        let left = snd.left();
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // (Past `max_sending_bytes` too: the answer is made, and holding it here costs what
        // holding it on an answering thread would; no new view is built meanwhile, see
        // `may_build`.)
        let full = g.count >= limits.max_waiting;
        // (At the memory limit the list may not grow: the answering thread writes it.)
        if g.closed || full || g.new.try_reserve(1).is_err() {
            return Err(snd);
        }
        snd.counted = left;
        snd.handed = true;
        g.bytes += left;
        g.count += 1;
        g.new.push(snd);
        drop(g);
        self.wake();
        Ok(())
    }

    /// Wakes the server's thread (a byte it reads; when the socket is full, it is awake
    /// already).
    fn wake(&self) {
        let _ = (&self.waker).write(&[1]);
    }
}

/// How far a write got.
enum Progress {
    Done,
    More,
    Failed,
}

/// An answer on its way to its client: being written (`writing` is set), then, written,
/// waiting a moment for the client to close (closing first, with bytes of the client's not
/// read, would reset the connection and could lose the answer).
struct Sending {
    stream: TcpStream,
    /// The head and the body; `parts[part][off..]` is next.
    parts: [Vec<u8>; 2],
    part: usize,
    off: usize,
    /// The end of the write timeout while writing; of the wait for the close after.
    deadline: Option<Instant>,
    /// Counted in [`WRITING`] until written.
    writing: Option<Writing>,
    /// Bytes counted in the outbox's total for this answer (0: none).
    counted: usize,
    /// Handed over by an answering thread: counted in the outbox's connections (a refusal
    /// the server's thread wrote itself is not).
    handed: bool,
}

/// How long a written answer's connection waits for the client to close.
const CLOSE_WAIT: Duration = Duration::from_millis(500);

impl Sending {
    /// A connection whose answer is written, waiting for the client to close.
    fn closing(stream: TcpStream) -> Sending {
        let _ = stream.shutdown(Shutdown::Write);
        Sending {
            stream,
            parts: Default::default(),
            part: 2,
            off: 0,
            deadline: Instant::now().checked_add(CLOSE_WAIT),
            writing: None,
            counted: 0,
            handed: false,
        }
    }

    /// Bytes not written yet.
    fn left(&self) -> usize {
        match self.part {
            0 => self.parts[0].len().saturating_sub(self.off) + self.parts[1].len(),
            1 => self.parts[1].len().saturating_sub(self.off),
            _ => 0,
        }
    }

    /// Writes what the socket takes now (non-blocking).
    fn write_some(&mut self) -> Progress {
        while self.part < 2 {
            let buf = &self.parts[self.part][self.off..];
            if buf.is_empty() {
                self.part += 1;
                self.off = 0;
                continue;
            }
            match self.stream.write(buf) {
                Ok(0) => return Progress::Failed,
                Ok(n) => self.off += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::More,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Progress::Failed,
            }
        }
        Progress::Done
    }

    /// The answer is written: the writing side is closed, and the connection waits a moment
    /// for the client to close.
    fn written(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        self.writing = None;
        self.parts = Default::default();
        self.deadline = Instant::now().checked_add(CLOSE_WAIT);
    }

    /// Reads what the client still sends (without waiting); whether it is done (closed, or
    /// an error).
    fn drain_some(&mut self) -> bool {
        let mut sink = [0u8; 4096];
        loop {
            match self.stream.read(&mut sink) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }

    /// Writes the rest here, waiting on the client (within the write timeout), then waits for
    /// its close: when the server's thread cannot take the answer.
    fn finish_here(mut self) {
        let _ = self.stream.set_nonblocking(false);
        if self.writing.is_some() {
            while self.part < 2 {
                let buf = &self.parts[self.part][self.off..];
                if !write_until(&mut self.stream, buf, self.deadline) {
                    return;
                }
                self.part += 1;
                self.off = 0;
            }
            self.written();
        }
        drain(&mut self.stream, CLOSE_WAIT);
    }
}

/// A connection whose request head is being read.
struct Pending {
    stream: TcpStream,
    head: Vec<u8>,
    deadline: Option<Instant>,
    loopback: bool,
}

impl Pending {
    /// Reads what has arrived (without waiting): the request once its head is complete, or
    /// the refusal (400, 431) once it cannot be; `None` while more is to come.
    fn read_some(&mut self, limits: &Limits) -> Option<Result<Request, (u16, String)>> {
        let mut buf = [0u8; 2048];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Some(Err((
                        400,
                        "connection closed before the request's end".into(),
                    )))
                }
                Ok(n) => {
                    // (Only the bytes that came since the last look are searched again.)
                    let from = self.head.len().saturating_sub(3);
                    self.head.extend_from_slice(&buf[..n]);
                    if let Some(end) = head_end(&self.head, from) {
                        return Some(parse_request(&self.head, end, limits, self.loopback));
                    }
                    if self.head.len() > limits.max_head {
                        let why = format!("request head over {} bytes", limits.max_head);
                        return Some(Err((431, why)));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Some(Err((400, format!("reading the request: {e}")))),
            }
        }
    }
}

/// The server's thread: accepts connections and reads their request heads, all at once
/// (`poll`), each within its read timeout, hands each request read to the answering threads
/// ([`Queue`]), and writes the answers they hand back ([`Outbox`]) as their clients take
/// them. Stopped, it closes the port, tells `closed`, and ends once the answers it holds are
/// written (or their time is up).
fn accept_loop(
    listener: TcpListener,
    limits: Limits,
    stop: &AtomicBool,
    q: &Arc<Queue>,
    mut woken: UnixStream,
    closed: SyncSender<()>,
) {
    use std::os::fd::AsRawFd;
    let mut listener = Some(listener);
    let mut pending: Vec<Pending> = Vec::new();
    let mut sending: Vec<Sending> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    // A descriptor kept in reserve: out of descriptors, it is closed to accept a connection
    // and tell it so (503), then taken again.
    let mut spare = std::fs::File::open("/dev/null").ok();
    loop {
        // The program is about to end (`finish_answers`): a last look at what came, so that
        // a request sent before the end is answered (it may not have been read yet: it was
        // told nothing, its connection closed by the exit).
        let asked = SWEEP_ASKED.load(Ordering::SeqCst);
        if asked > q.swept.load(Ordering::SeqCst) {
            if let Some(l) = &listener {
                accept_all(l, &limits, &mut pending, &mut spare, &mut sending);
            }
            for i in (0..pending.len()).rev() {
                if let Some(req) = pending[i].read_some(&limits) {
                    let p = pending.swap_remove(i);
                    dispatch(p.stream, req, &limits, q);
                }
            }
            q.swept.store(asked, Ordering::SeqCst);
        }
        if stop.load(Ordering::SeqCst) && listener.is_some() {
            listener = None;
            pending.clear();
            let _ = closed.try_send(());
        }
        // The answers handed over since the last look.
        {
            let mut g = q.outbox.state.lock().unwrap_or_else(|e| e.into_inner());
            if listener.is_none() && sending.is_empty() && g.new.is_empty() {
                g.closed = true;
                return;
            }
            if sending.try_reserve(g.new.len()).is_ok() {
                sending.append(&mut g.new);
            }
        }
        if spare.is_none() {
            spare = std::fs::File::open("/dev/null").ok();
        }
        let now = Instant::now();
        // Requests not read in time: 408.
        let mut i = 0;
        while i < pending.len() {
            if pending[i].deadline.is_some_and(|d| d <= now) {
                let p = pending.swap_remove(i);
                let late = Err((408, "request not received in time".into()));
                dispatch(p.stream, late, &limits, q);
            } else {
                i += 1;
            }
        }
        // Answers not taken in time are cut; connections done waiting for the close, closed.
        let (mut released, mut ended) = (0, 0);
        sending.retain_mut(|snd| {
            if snd.deadline.is_some_and(|d| d <= now) {
                released += std::mem::take(&mut snd.counted);
                ended += usize::from(snd.handed);
                return false;
            }
            true
        });
        let wait = pending
            .iter()
            .filter_map(|p| p.deadline)
            .chain(sending.iter().filter_map(|s| s.deadline))
            .min()
            .map_or(1000, |d| {
                d.saturating_duration_since(now).as_millis().clamp(1, 1000) as i32
            });
        fds.clear();
        fds.push(libc::pollfd {
            // (Stopped: no listener; poll skips a negative descriptor.)
            fd: listener.as_ref().map_or(-1, |l| l.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.push(libc::pollfd {
            fd: woken.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(pending.iter().map(|p| libc::pollfd {
            fd: p.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        fds.extend(sending.iter().map(|s| libc::pollfd {
            fd: s.stream.as_raw_fd(),
            events: if s.writing.is_some() {
                libc::POLLOUT
            } else {
                libc::POLLIN
            },
            revents: 0,
        }));
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs, written by the kernel.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if n < 0 {
            // (Interrupted by a signal; anything else: a short pause, then again.)
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if fds[1].revents != 0 {
            let mut sink = [0u8; 64];
            while matches!(woken.read(&mut sink), Ok(n) if n > 0) {}
        }
        // The answers whose clients took more (or closed), last first (a removal moves the
        // last one into its place, which was looked at already).
        let base = 2 + pending.len();
        for i in (0..sending.len()).rev() {
            if fds[base + i].revents == 0 {
                continue;
            }
            let snd = &mut sending[i];
            let done = if snd.writing.is_some() {
                match snd.write_some() {
                    Progress::More => false,
                    Progress::Failed => true,
                    Progress::Done => {
                        released += std::mem::take(&mut snd.counted);
                        snd.written();
                        // (A client that closed at once is done.)
                        snd.drain_some()
                    }
                }
            } else {
                snd.drain_some()
            };
            if done {
                released += std::mem::take(&mut sending[i].counted);
                ended += usize::from(sending[i].handed);
                sending.swap_remove(i);
            }
        }
        if released != 0 || ended != 0 {
            let mut g = q.outbox.state.lock().unwrap_or_else(|e| e.into_inner());
            g.bytes = g.bytes.saturating_sub(released);
            g.count = g.count.saturating_sub(ended);
        }
        // The connections that have something to read (or ended), last first.
        for i in (0..pending.len()).rev() {
            if fds[i + 2].revents == 0 {
                continue;
            }
            if let Some(req) = pending[i].read_some(&limits) {
                let p = pending.swap_remove(i);
                dispatch(p.stream, req, &limits, q);
            }
        }
        if fds[0].revents != 0 {
            if let Some(l) = &listener {
                accept_all(l, &limits, &mut pending, &mut spare, &mut sending);
            }
        }
    }
}

/// Accepts every connection waiting: each is read from then, or gets 503 at once past
/// [`Limits::max_waiting`], or when the process is out of file descriptors (accepted
/// through `spare`: otherwise the connections waited unanswered in the backlog).
fn accept_all(
    listener: &TcpListener,
    limits: &Limits,
    pending: &mut Vec<Pending>,
    spare: &mut Option<std::fs::File>,
    closing: &mut Vec<Sending>,
) {
    // The spare first, when a descriptor came free (a connection closed since): a new
    // connection would take it otherwise, and the next one find no spare to be told with.
    if spare.is_none() {
        *spare = std::fs::File::open("/dev/null").ok();
    }
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if pending.len() >= limits.max_waiting || stream.set_nonblocking(true).is_err() {
                    busy(stream);
                    continue;
                }
                let loopback = stream.local_addr().is_ok_and(|a| a.ip().is_loopback());
                pending.push(Pending {
                    stream,
                    head: Vec::new(),
                    deadline: Instant::now().checked_add(limits.read_timeout),
                    loopback,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                let accepted = spare.take().and_then(|f| {
                    drop(f);
                    listener.accept().ok()
                });
                let Some((stream, _)) = accepted else {
                    // (No spare to give: the next look tries again, after a short pause so
                    // that the error does not spin.)
                    *spare = std::fs::File::open("/dev/null").ok();
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                };
                // Written at once; the connection then waits for the client to close (it
                // may not have sent its request yet: closing on it now would reset its
                // connection as it sends, and lose the answer). The spare is taken again
                // once a descriptor is free.
                let mut stream = stream;
                let _ = stream.set_nonblocking(true);
                let _ = stream.write(&out_of_descriptors());
                if closing.try_reserve(1).is_ok() {
                    closing.push(Sending::closing(stream));
                }
            }
            Err(_) => {
                // (A connection reset before accept, say: the next look tries again; a
                // short pause so a persistent error does not spin.)
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        }
    }
}

/// Hands a request read to the answering threads, or answers 503 at once past
/// [`Limits::max_queued`].
fn dispatch(
    stream: TcpStream,
    req: Result<Request, (u16, String)>,
    limits: &Limits,
    q: &Arc<Queue>,
) {
    // A refusal is a few bytes: written here, at once (an idle connection's 408 took an
    // answering thread's place, for its drain).
    let req = match req {
        Ok(_) if ENDING.load(Ordering::SeqCst) => {
            refuse(stream, 503, "the program is ending");
            return;
        }
        Ok(r) => r,
        Err((status, why)) => {
            refuse(stream, status, &why);
            return;
        }
    };
    let job = Job {
        stream,
        req: Ok(req),
        _writing: Writing::new(),
    };
    if let Err(job) = Queue::push(q, job, limits) {
        busy(job.stream);
    }
}

/// The program is ending ([`finish_answers`]): requests read are told 503.
static ENDING: AtomicBool = AtomicBool::new(false);

/// Every server's queue, for [`finish_answers`]'s last look.
static SWEEPERS: std::sync::Mutex<Vec<std::sync::Weak<Queue>>> = std::sync::Mutex::new(Vec::new());

/// How many last looks [`finish_answers`] asked for (each server's thread answers with
/// [`Queue::swept`]).
static SWEEP_ASKED: AtomicU64 = AtomicU64::new(0);

/// Answers, of every server, whose request was read and which are not written yet
/// ([`finish_answers`]).
static WRITING: AtomicUsize = AtomicUsize::new(0);

/// One answer counted in [`WRITING`] while it lives.
struct Writing;

impl Writing {
    fn new() -> Writing {
        WRITING.fetch_add(1, Ordering::SeqCst);
        Writing
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        WRITING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits, at most `timeout`, until every answer under way (its request read, its answer not
/// written yet) is written, for a program about to end: its exit cut them off (a client that
/// asked as the script ended got its connection closed and no answer). Requests sent before
/// the call are answered too: each server takes in what came first. Whether none is left.
/// Answers asked after this returned are not waited for (told 503 while it waits).
pub fn finish_answers(timeout: Duration) -> bool {
    let t0 = Instant::now();
    // First, every server takes what came until now: connections waiting to be accepted,
    // requests sent and not read yet (a request sent just before the end was told nothing,
    // its connection closed by the exit). A server's thread that does not look within a
    // quarter of the time (busy, or ended) is not waited for.
    let gen = SWEEP_ASKED.fetch_add(1, Ordering::SeqCst) + 1;
    let queues: Vec<Arc<Queue>> = SWEEPERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    for q in &queues {
        q.outbox.wake();
    }
    while queues.iter().any(|q| {
        q.swept.load(Ordering::SeqCst) < gen
            && !q
                .outbox
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .closed
    }) {
        if t0.elapsed() >= timeout / 4 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(queues);
    // Requests read from now on are told 503 (a scraper polling steadily kept the wait
    // busy until its end, and the answers under way were cut).
    ENDING.store(true, Ordering::SeqCst);
    while WRITING.load(Ordering::SeqCst) != 0 {
        if t0.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// What a request gets when too many are under way (503).
const BUSY: &[u8] = b"too many connections being answered; try again\n";

/// The head of a 503 answer.
fn busy_head() -> Vec<u8> {
    response_head(
        503,
        "text/plain; charset=utf-8",
        BUSY.len(),
        &[("Retry-After", "1")],
    )
}

/// A 503 for a connection accepted while the process is out of file descriptors.
fn out_of_descriptors() -> Vec<u8> {
    let body = b"the process is out of file descriptors; try again\n";
    let head = response_head(
        503,
        "text/plain; charset=utf-8",
        body.len(),
        &[("Retry-After", "1")],
    );
    [head.as_slice(), body].concat()
}

/// Answers 503 without reading the request (the acceptor must not wait on a client).
fn busy(s: TcpStream) {
    answer_at_once(s, &[busy_head().as_slice(), BUSY].concat());
}

/// Answers a refusal (`status`, `why`) without waiting on the client.
fn refuse(s: TcpStream, status: u16, why: &str) {
    let allow = [("Allow", "GET, HEAD")];
    let extra: &[(&str, &str)] = if status == 405 { &allow } else { &[] };
    let body = format!("{why}\n").into_bytes();
    let head = response_head(status, "text/plain; charset=utf-8", body.len(), extra);
    answer_at_once(s, &[head, body].concat());
}

/// Writes a short answer without waiting (what the socket's buffer takes), then closes
/// (the server's thread must not wait on a client).
fn answer_at_once(mut s: TcpStream, answer: &[u8]) {
    let _ = s.set_nonblocking(true);
    let _ = s.write_all(answer);
    // Take in what the request already sent (without waiting for more): closing with
    // unread bytes would reset the connection and lose the answer.
    let mut sink = [0u8; 4096];
    for _ in 0..4 {
        if !matches!(s.read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
    let _ = s.shutdown(Shutdown::Write);
}

/// A request as far as this server reads it.
struct Request {
    head_only: bool,
    path: String,
    query: Vec<(String, String)>,
}

/// The request whose head is `head[..end]` (`end`: where its empty line starts): `Err` is
/// the status to answer with (400, 403, 405, 431). `loopback`: the connection came to a
/// loopback address (see the `Host` check in the module doc).
fn parse_request(
    head: &[u8],
    end: usize,
    limits: &Limits,
    loopback: bool,
) -> Result<Request, (u16, String)> {
    if end > limits.max_head {
        return Err((431, format!("request head over {} bytes", limits.max_head)));
    }
    let head = &head[..end];
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(end);
    let line = head[..line_end]
        .strip_suffix(b"\r")
        .unwrap_or(&head[..line_end]);
    let line = std::str::from_utf8(line)
        .map_err(|_| (400, "the request line is not UTF-8".to_string()))?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err((400, "bad request line".into()));
    };
    if !version.starts_with("HTTP/1.") {
        return Err((400, format!("unsupported protocol {version:?}")));
    }
    // (RFC 9112 5.1: whitespace between a field's name and its colon is a 400: a proxy may
    // read such a line otherwise than the checks below do.)
    let spaced = head.split(|&b| b == b'\n').skip(1).any(|l| {
        l.iter()
            .position(|&b| b == b':')
            .is_some_and(|c| c > 0 && matches!(l[c - 1], b' ' | b'\t'))
    });
    if spaced {
        return Err((
            400,
            "whitespace between a header's name and its colon".into(),
        ));
    }
    // (RFC 9112: a request with more than one is answered 400. Which one a proxy in front
    // reads is not known: the loopback check below must not pass one name and serve another.)
    let hosts = host_headers(head).count();
    if hosts > 1 {
        return Err((400, "more than one Host header".into()));
    }
    if hosts == 0 && version != "HTTP/1.0" {
        return Err((400, "no Host header (HTTP/1.1 requires one)".into()));
    }
    // The absolute form's authority (`GET http://host/path`) is the request's host too.
    let authority = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
        .map(|rest| {
            rest.split(['/', '?'])
                .next()
                .unwrap_or("")
                .to_ascii_lowercase()
        });
    let refused = || {
        (
            403,
            "this server listens on the loopback address and answers only requests for \
             localhost, 127.0.0.1 or [::1] (Host header)"
                .to_string(),
        )
    };
    if loopback && !host_is_loopback(head) {
        return Err(refused());
    }
    if loopback && authority.is_some_and(|a| !name_is_loopback(&a)) {
        return Err(refused());
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err((405, format!("method {method} not allowed: GET or HEAD"))),
    };
    // The absolute form (`GET http://host/path`, RFC 9112 3.2.2): its path.
    let target = match target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (unescape(k), unescape(v))
        })
        .collect();
    Ok(Request {
        head_only,
        path: unescape(path),
        query,
    })
}

/// Where the head ends (the start of its empty line's terminator), looking from `from`.
fn head_end(head: &[u8], from: usize) -> Option<usize> {
    let tail = &head[from.min(head.len())..];
    let crlf = tail.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = tail.windows(2).position(|w| w == b"\n\n");
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(from + a.min(b)),
        (a, b) => a.or(b).map(|i| from + i),
    }
}

/// The values of the head's `Host` header lines (trimmed, lowercase).
fn host_headers(head: &[u8]) -> impl Iterator<Item = String> + '_ {
    head.split(|&b| b == b'\n').skip(1).filter_map(|l| {
        let l = String::from_utf8_lossy(l);
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("host")
            .then(|| v.trim().to_ascii_lowercase())
    })
}

/// Whether the `Host` header, if any, names the loopback address (see [`serve`]: a web page
/// must not reach a loopback server through a name that resolves to it, DNS rebinding).
fn host_is_loopback(head: &[u8]) -> bool {
    let Some(host) = host_headers(head).next() else {
        return true;
    };
    name_is_loopback(&host)
}

/// Whether `host` (`name[:port]`, `[v6][:port]`, lowercase) names the loopback address.
fn name_is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    matches!(name, "localhost" | "127.0.0.1" | "::1")
}

/// `%XX` and `+` decoded (lossy: a bad escape stays as written, bytes that are not UTF-8
/// become U+FFFD).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Answers a request read (or its refusal) on an answering thread, within the write
/// timeout, then lets the client close first (for a moment).
fn answer(job: Job, limits: &Limits, outbox: &Outbox) {
    let Job {
        stream: s,
        req,
        _writing: writing,
    } = job;
    let (head, body) = match req {
        Ok(req) => {
            // A client gone already (its connection reset while the request waited): no
            // view is built for it (a hundred such requests took the answering threads for
            // seconds, and the requests behind them were told 503).
            if reset(&s) {
                return;
            }
            let gate = |kind: usize| may_build(kind, outbox, limits);
            let (status, ty, body, extra) = route(&req, &gate);
            let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let head = response_head(status, ty, body.len(), &extra);
            (head, if req.head_only { Vec::new() } else { body })
        }
        Err((status, why)) => {
            let allow = [("Allow", "GET, HEAD")];
            let extra: &[(&str, &str)] = if status == 405 { &allow } else { &[] };
            let body = format!("{why}\n").into_bytes();
            let head = response_head(status, "text/plain; charset=utf-8", body.len(), extra);
            (head, body)
        }
    };
    // The whole answer within the write timeout, however slowly the client reads.
    let deadline = Instant::now().checked_add(limits.write_timeout.max(Duration::from_millis(1)));
    let _ = s.set_nonblocking(true);
    let mut snd = Sending {
        stream: s,
        parts: [head, body],
        part: 0,
        off: 0,
        deadline,
        writing: Some(writing),
        counted: 0,
        handed: false,
    };
    match snd.write_some() {
        Progress::Failed => return,
        Progress::Done => snd.written(),
        Progress::More => {}
    }
    // What the client did not take yet, and the wait for its close: the server's thread's.
    if let Err(snd) = outbox.hand_over(snd, limits) {
        snd.finish_here();
    }
}

/// Whether the peer reset the connection (or it failed): nothing can be written to it.
fn reset(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: poll(2) of one descriptor of ours, without waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
}

/// Writes `buf` in pieces, each waiting at most until `deadline`; whether all was written.
fn write_until(s: &mut TcpStream, buf: &[u8], deadline: Option<Instant>) -> bool {
    for piece in buf.chunks(64 * 1024) {
        let mut piece = piece;
        while !piece.is_empty() {
            if let Some(d) = deadline {
                match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => {
                        if s.set_write_timeout(Some(left)).is_err() {
                            return false;
                        }
                    }
                    _ => return false,
                }
            }
            match s.write(piece) {
                Ok(0) => return false,
                Ok(n) => piece = &piece[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }
    true
}

/// Reads and drops what arrives for at most `d` in all.
fn drain(s: &mut TcpStream, d: Duration) {
    let until = Instant::now() + d;
    let mut sink = [0u8; 4096];
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match s.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

type Routed = (u16, &'static str, Vec<u8>, Vec<(&'static str, String)>);

fn text(status: u16, body: String) -> Routed {
    (
        status,
        "text/plain; charset=utf-8",
        body.into_bytes(),
        Vec::new(),
    )
}

/// Whether a view may be built now (`None`) or the answer to give instead (503): not while
/// the answers held for clients that do not read them fill their room (a view built then
/// would wait with them: each such request held an answering thread until its write timeout,
/// and every request, the index's too, waited behind them), nor when the process is too
/// near its address-space limit for the view's size (its last one of that kind, or 16 KiB a
/// fiber; three times that, for the snapshot and the growth of the buffer): a failed
/// allocation aborts the process, and a view must never end the program it shows. Views
/// under construction count against the room (`BUILDING`) until [`Built`] is dropped.
fn may_build(kind: usize, outbox: &Outbox, limits: &Limits) -> Result<Built, Routed> {
    let held = outbox.state.lock().unwrap_or_else(|e| e.into_inner()).bytes;
    if held > 0 && held >= limits.max_sending_bytes {
        return Err(text(
            503,
            format!(
                "{} MiB of answers wait for clients that do not read them; try again\n",
                held >> 20
            ),
        ));
    }
    let fibers: usize = crate::registry::schedulers()
        .iter()
        .map(|s| s.fibers().len())
        .sum();
    let last = LAST_SIZE.get(kind).map_or(0, |l| l.load(Ordering::Relaxed));
    let need = last.max(fibers.saturating_mul(16 << 10)).saturating_mul(3);
    let building = BUILDING
        .fetch_add(need, Ordering::SeqCst)
        .saturating_add(need);
    let built = Built { kind, need };
    let room = |b| fibertrace_core::heap::room_for(b);
    let fits = room(building) || (VIEW_ASIDE.give_back() && room(building));
    if !fits {
        return Err(text(
            503,
            format!(
                "not enough memory to build this view now (about {} MiB; the process is near \
                 its address-space limit, ulimit -v); try again\n",
                (need >> 20).max(1)
            ),
        ));
    }
    Ok(built)
}

/// Bytes of address space the views under construction may take ([`may_build`]).
static BUILDING: AtomicUsize = AtomicUsize::new(0);

/// Address space kept for the views under an address-space limit (`ulimit -v`): taken when
/// the server starts and again after each view, given back when a view finds too little
/// room. A program whose heap took everything up to the limit (the moment its fibers are
/// worth a look) left the views what its last allocation could not use, a few KiB or none,
/// and every view was refused (503).
static VIEW_ASIDE: fibertrace_core::heap::RoomAside = fibertrace_core::heap::RoomAside::new();

/// What [`VIEW_ASIDE`] takes (8 MiB: the views of a few hundred fibers).
const VIEW_ROOM: usize = 8 << 20;

/// The size of the last view of each kind (the formats in [`Format::ALL`]'s order, then the
/// heap profile).
static LAST_SIZE: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// A view under construction (see [`may_build`]): its room given back when dropped.
struct Built {
    kind: usize,
    need: usize,
}

impl Built {
    fn done(&self, size: usize) {
        if let Some(l) = LAST_SIZE.get(self.kind) {
            l.store(size, Ordering::Relaxed);
        }
    }
}

impl Drop for Built {
    fn drop(&mut self) {
        if BUILDING.fetch_sub(self.need, Ordering::SeqCst) == self.need {
            // The last view under construction is done: the room for the next one is
            // taken again (when there is room: its memory was given back to the allocator,
            // which may keep it).
            VIEW_ASIDE.take(VIEW_ROOM);
        }
    }
}

/// The gate of every view: [`may_build`] with the server's outbox and limits.
type Gate<'a> = &'a dyn Fn(usize) -> Result<Built, Routed>;

fn view(fmt: Format, gate: Gate<'_>) -> Routed {
    let kind = Format::ALL.iter().position(|&f| f == fmt).unwrap_or(0);
    let built = match gate(kind) {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let body = export::export(fmt);
    built.done(body.len());
    let mut extra = Vec::new();
    if fmt == Format::Pprof {
        extra.push((
            "Content-Disposition",
            "attachment; filename=\"fibers.pb.gz\"".to_string(),
        ));
    }
    (200, fmt.media_type(), body, extra)
}

/// The heap profile (pprof, Go's four sample types), or 404 with why when the heap is not
/// tracked.
fn heap_view(gate: Gate<'_>) -> Routed {
    let built = match gate(Format::ALL.len()) {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let name = |id: u64| crate::registry::find(id).map(|(_, cb)| cb.name_arc().to_string());
    match export::heap_pprof(&name, &|_| None, fibertrace_core::heap::frames_of) {
        Ok(body) => {
            built.done(body.len());
            (
                200,
                Format::Pprof.media_type(),
                body,
                vec![(
                    "Content-Disposition",
                    "attachment; filename=\"heap.pb.gz\"".to_string(),
                )],
            )
        }
        Err(e) => text(404, format!("no heap profile: {e}\n")),
    }
}

fn route(req: &Request, gate: Gate<'_>) -> Routed {
    let q = |k: &str| {
        req.query
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    // A parameter given twice (`format=json&format=svg`): which one was meant is not known.
    for k in ["format", "debug"] {
        if req.query.iter().filter(|(n, _)| n == k).count() > 1 {
            return text(400, format!("{k} given more than once\n"));
        }
    }
    match req.path.as_str() {
        "/" | "/debug/fibers/" | "/debug/pprof/" | "/debug/pprof" => (
            200,
            "text/html; charset=utf-8",
            index().into_bytes(),
            Vec::new(),
        ),
        "/debug/fibers" => match Format::parse(q("format").unwrap_or("text")) {
            Ok(f) => view(f, gate),
            Err(e) => text(400, format!("{e}\n")),
        },
        "/debug/pprof/goroutine" => match q("debug").unwrap_or("0") {
            "0" | "" => view(Format::Pprof, gate),
            "1" => view(Format::Grouped, gate),
            "2" => view(Format::Text, gate),
            other => text(
                400,
                format!("bad debug={other:?}: 0 (pprof), 1 (grouped text) or 2 (full text)\n"),
            ),
        },
        "/debug/pprof/heap" | "/debug/pprof/allocs" => heap_view(gate),
        other => text(
            404,
            format!("no such page {other:?}: see / for the views\n"),
        ),
    }
}

/// The index page: a link to every view.
fn index() -> String {
    let mut rows = String::new();
    for f in Format::ALL {
        let what = match f {
            Format::Text => "every fiber with its full trace and parent chain",
            Format::Grouped => "fibers with the same state and stack folded, biggest group first",
            Format::Json => "the snapshot, versioned (docs/snapshot-schema.md)",
            Format::Pprof => "pprof profile.proto, gzipped: go tool pprof",
            Format::Folded => "folded stacks: flamegraph.pl, inferno",
            Format::Svg => "a flame graph of the fibers' stacks",
            Format::Speedscope => "speedscope's file format",
        };
        rows.push_str(&format!(
            "<li><a href=\"/debug/fibers?format={n}\">{n}</a>: {what}</li>\n",
            n = f.name()
        ));
    }
    format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fibertrace: \
         fibers of process {pid}</title></head>\n<body>\n<h1>fibers of process {pid}</h1>\n\
         <ul>\n{rows}</ul>\n<p>Where Go serves them: <a href=\"/debug/pprof/goroutine\">\
         /debug/pprof/goroutine</a> (pprof), <a href=\"/debug/pprof/goroutine?debug=1\">\
         ?debug=1</a> (grouped), <a href=\"/debug/pprof/goroutine?debug=2\">?debug=2</a> \
         (full text).</p>\n</body></html>\n",
        pid = std::process::id()
    )
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

fn response_head(status: u16, ty: &str, len: usize, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {ty}\r\nContent-Length: {len}\r\n\
         Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n",
        reason(status),
    )
    .into_bytes();
    for (k, v) in extra {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out
}
