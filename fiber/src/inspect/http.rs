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
//! | `/debug/pprof/heap` | 404 with why: no allocation metadata is recorded |
//!
//! Why a server of its own on `std` and not a crate: it serves `GET` (and `HEAD`) of a few
//! fixed paths and closes each connection after one answer, and what it must bound — bytes of
//! a request head, connections at once, time to read a request and to write an answer — is
//! each a line here; the small crates (tiny_http) keep an unbounded pool of connection
//! threads and no head limit of their own to set.
//!
//! Limits ([`Limits`]): a request head over [`Limits::max_head`] bytes gets 431; one not sent
//! within [`Limits::read_timeout`] gets 408; past [`Limits::max_connections`] connections
//! being answered, a new one gets 503 at once; any method but `GET`/`HEAD` gets 405; a bad
//! query value 400, saying what is accepted. A request never stops the process or a fiber:
//! the views are the same snapshots as every dump (see [`super`] for how one can be wrong:
//! not atomic across fibers; a spinning Lua fiber's frames native only, with a note).
//!
//! Listening: [`parse_addr`] takes `PORT` or `:PORT` as the loopback address (127.0.0.1);
//! anything else (`0.0.0.0:6060`, `[::]:6060`, `myhost:6060`) is listened on as given —
//! exposing every fiber's stack beyond the machine is the caller's explicit choice.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::export::{self, Format};

/// The bounds of a server (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections answered at once; one more gets 503.
    pub max_connections: usize,
    /// Bytes of a request's head (request line and headers).
    pub max_head: usize,
    /// Time to receive a request's head.
    pub read_timeout: Duration,
    /// Time to send an answer.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 8,
            max_head: 8 * 1024,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
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
    let bad = |why: &str| {
        HttpError::Address(format!(
            "bad address {s:?}: {why} (expected PORT, :PORT or HOST:PORT, e.g. \
             127.0.0.1:6060)"
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
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    if host.is_empty() {
        return Err(bad("no host"));
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
}

impl Server {
    /// The address it listens on (the port chosen, when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections and waits for the server's thread (answers under way
    /// finish on their own threads).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept: connect to ourselves (the loopback address of our port when we
        // listen on every address).
        let mut to = self.addr;
        if to.ip().is_unspecified() {
            to.set_ip(match to {
                SocketAddr::V4(_) => [127, 0, 0, 1].into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let woke = TcpStream::connect_timeout(&to, Duration::from_secs(1)).is_ok();
        if let Some(t) = self.thread.take() {
            // Without the wake-up the accept may never return: leave the thread (it stops
            // at its next connection) rather than hang here.
            if woke {
                let _ = t.join();
            }
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
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name("fibertrace-http".into())
        .spawn(move || accept_loop(listener, limits, &stop2))
        .map_err(HttpError::Thread)?;
    Ok(Server {
        addr: local,
        stop,
        thread: Some(thread),
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

fn accept_loop(listener: TcpListener, limits: Limits, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else {
            // (Out of descriptors, a connection reset before accept: try the next; a short
            // pause so a persistent error does not spin.)
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if active.fetch_add(1, Ordering::SeqCst) >= limits.max_connections {
            active.fetch_sub(1, Ordering::SeqCst);
            busy(stream);
            continue;
        }
        let slot = Slot(active.clone());
        let spawned = std::thread::Builder::new()
            .name("fibertrace-http-conn".into())
            // Encoding runs here: gzip's state in a debug build wants more than 2 MiB
            // would give with room to spare (only what is touched is committed).
            .stack_size(8 << 20)
            .spawn(move || {
                let _slot = slot;
                answer(stream, &limits);
            });
        if let Err(e) = spawned {
            // The closure (with the stream and the slot) was dropped: nothing to answer on.
            let _ = e;
        }
    }
}

/// A connection being answered; gives its place back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answers 503 without reading the request (the acceptor must not wait on a client).
fn busy(mut s: TcpStream) {
    let _ = s.set_nonblocking(true);
    let _ = s.write_all(&response(
        503,
        "text/plain; charset=utf-8",
        b"too many connections being answered; try again\n",
        &[("Retry-After", "1")],
        false,
    ));
    let _ = s.shutdown(Shutdown::Write);
}

/// A request as far as this server reads it.
struct Request {
    head_only: bool,
    path: String,
    query: Vec<(String, String)>,
}

/// Reads the request head: `Err` is the status to answer with (400, 405, 408, 431).
fn read_request(s: &mut TcpStream, limits: &Limits) -> Result<Request, (u16, String)> {
    let _ = s.set_read_timeout(Some(limits.read_timeout));
    let deadline = std::time::Instant::now() + limits.read_timeout;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    let end = loop {
        if let Some(i) = find(&head, b"\r\n\r\n") {
            break i;
        }
        if head.len() > limits.max_head {
            return Err((431, format!("request head over {} bytes", limits.max_head)));
        }
        if std::time::Instant::now() >= deadline {
            return Err((408, "request not received in time".into()));
        }
        match s.read(&mut buf) {
            Ok(0) => return Err((400, "connection closed before the request's end".into())),
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err((408, "request not received in time".into()))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((400, format!("reading the request: {e}"))),
        }
    };
    if end > limits.max_head {
        return Err((431, format!("request head over {} bytes", limits.max_head)));
    }
    let line_end = find(&head, b"\r\n").unwrap_or(end);
    let line = std::str::from_utf8(&head[..line_end])
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
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err((405, format!("method {method} not allowed: GET or HEAD"))),
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

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
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

fn answer(mut s: TcpStream, limits: &Limits) {
    let _ = s.set_write_timeout(Some(limits.write_timeout));
    let resp = match read_request(&mut s, limits) {
        Ok(req) => {
            let (status, ty, body, extra) = route(&req);
            let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
            response(status, ty, &body, &extra, req.head_only)
        }
        Err((status, why)) => {
            let allow = [("Allow", "GET, HEAD")];
            let extra: &[(&str, &str)] = if status == 405 { &allow } else { &[] };
            response(
                status,
                "text/plain; charset=utf-8",
                format!("{why}\n").as_bytes(),
                extra,
                false,
            )
        }
    };
    let _ = s.write_all(&resp);
    let _ = s.flush();
    let _ = s.shutdown(Shutdown::Write);
    // Drain what the client still sends (a body we did not read) briefly, so closing does
    // not reset the connection before it read the answer.
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 4096];
    for _ in 0..64 {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => break,
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

fn view(fmt: Format) -> Routed {
    let body = export::export(fmt);
    let mut extra = Vec::new();
    if fmt == Format::Pprof {
        extra.push((
            "Content-Disposition",
            "attachment; filename=\"fibers.pb.gz\"".to_string(),
        ));
    }
    (200, fmt.media_type(), body, extra)
}

fn route(req: &Request) -> Routed {
    let q = |k: &str| {
        req.query
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    match req.path.as_str() {
        "/" | "/debug/fibers/" | "/debug/pprof/" | "/debug/pprof" => (
            200,
            "text/html; charset=utf-8",
            index().into_bytes(),
            Vec::new(),
        ),
        "/debug/fibers" => match Format::parse(q("format").unwrap_or("text")) {
            Ok(f) => view(f),
            Err(e) => text(400, format!("{e}\n")),
        },
        "/debug/pprof/goroutine" => match q("debug").unwrap_or("0") {
            "0" | "" => view(Format::Pprof),
            "1" => view(Format::Grouped),
            "2" => view(Format::Text),
            other => text(
                400,
                format!("bad debug={other:?}: 0 (pprof), 1 (grouped text) or 2 (full text)\n"),
            ),
        },
        "/debug/pprof/heap" | "/debug/pprof/allocs" => text(
            404,
            "no heap profile: this process records no allocation metadata\n".into(),
        ),
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
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

fn response(
    status: u16,
    ty: &str,
    body: &[u8],
    extra: &[(&str, &str)],
    head_only: bool,
) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {ty}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n",
        reason(status),
        body.len()
    )
    .into_bytes();
    for (k, v) in extra {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}
