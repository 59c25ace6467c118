//! `/debug/fibers` over HTTP (`fibertrace_fiber::http`): every view served while a fiber
//! spins, the paths Go uses, and every way a client can misbehave answered with a clear
//! status — the server and the process go on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fibertrace_fiber::export::Format;
use fibertrace_fiber::http::{self, Limits};
use fibertrace_fiber::{channel, Scheduler};

/// One test at a time: every view lists the whole process's fibers, so one test's 1,500
/// deep fibers would make another's views megabytes long, and their builds (on a slow
/// machine's two cores) would run past the other's timed bounds.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A raw exchange: sends `req`, reads to the end; (status, headers, body).
fn exchange(addr: SocketAddr, req: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    // (A guard against a hang, not a bound on speed.)
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(req).unwrap();
    read_response(&mut s)
}

fn read_response(s: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(&all)));
    let head = String::from_utf8(all[..end].to_vec()).unwrap();
    let status = head[9..12].parse().unwrap();
    (status, head, all[end + 4..].to_vec())
}

fn get(addr: SocketAddr, target: &str) -> (u16, String, Vec<u8>) {
    exchange(
        addr,
        format!("GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
    )
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
}

#[inline(never)]
fn spin_here(stop: &AtomicBool) -> u64 {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n = std::hint::black_box(n + 1);
    }
    n
}

#[inline(never)]
fn wait_here(ch: &fibertrace_fiber::Channel<u8>) {
    // (Used after the call: not a tail call, so the frame stays in release builds.)
    let v = ch.recv();
    std::hint::black_box(v);
}

/// A scheduler on its own thread: three fibers wait on a channel, one spins until `stop`.
fn spinning_process(stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let started = Arc::new(AtomicBool::new(false));
    let s2 = started.clone();
    let t = std::thread::spawn(move || {
        let s = Scheduler::new();
        let ch = channel::<u8>(0);
        // (A count the compiler cannot see: an unrolled loop would give each waiter its own
        // creation site, and so a group of its own.)
        for _ in 0..std::hint::black_box(3) {
            let c = ch.clone();
            s.builder().name("waiter").spawn(move || wait_here(&c));
        }
        let c = ch.clone();
        s.builder().name("spinner").spawn(move || {
            s2.store(true, Ordering::SeqCst);
            spin_here(&stop);
            c.close();
        });
        s.run().unwrap();
    });
    while !started.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    t
}

#[test]
fn every_view_is_served_while_a_fiber_spins() {
    let _one = one_at_a_time();
    let stop = Arc::new(AtomicBool::new(false));
    let proc_thread = spinning_process(stop.clone());
    let server = http::serve("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback());

    // The index links every view.
    let (status, head, body) = get(addr, "/");
    assert_eq!(status, 200);
    assert_eq!(
        header(&head, "Content-Type"),
        Some("text/html; charset=utf-8")
    );
    let page = String::from_utf8(body).unwrap();
    for f in Format::ALL {
        assert!(
            page.contains(&format!("<a href=\"/debug/fibers?format={}\">", f.name())),
            "{page}"
        );
    }
    assert!(
        page.contains("<a href=\"/debug/pprof/goroutine\">"),
        "{page}"
    );

    for f in Format::ALL {
        let (status, head, body) = get(addr, &format!("/debug/fibers?format={}", f.name()));
        assert_eq!(status, 200, "{}", f.name());
        assert_eq!(header(&head, "Content-Type"), Some(f.media_type()));
        assert_eq!(
            header(&head, "Content-Length").map(|v| v.parse::<usize>().unwrap()),
            Some(body.len())
        );
        match f {
            Format::Text => {
                let t = String::from_utf8(body).unwrap();
                // The spinning fiber, sampled where it spins; the waiters where they wait.
                let spinner = t
                    .split("\n\n")
                    .find(|b| b.contains("\"spinner\" [running]"))
                    .unwrap_or_else(|| panic!("{t}"));
                // (`in http::spin_here+0x..`, or `inlined into http::spin_here` in release.)
                assert!(spinner.contains("http::spin_here"), "{spinner}");
                // (Other tests of this process may have fibers of their own waiting there.)
                let waiters: Vec<&str> = t
                    .split("\n\n")
                    .filter(|b| b.contains("\"waiter\" [channel receive, "))
                    .collect();
                assert_eq!(waiters.len(), 3, "{t}");
                assert!(
                    waiters
                        .iter()
                        .all(|b| b.matches("http::wait_here").count() == 1),
                    "{t}"
                );
            }
            Format::Grouped => {
                let t = String::from_utf8(body).unwrap();
                assert!(t.contains("3 fibers [channel receive, "), "{t}");
            }
            Format::Pprof => assert_eq!(&body[..2], [0x1f, 0x8b]),
            Format::Json | Format::Speedscope => {
                serde_json::from_slice::<serde_json::Value>(&body).unwrap();
            }
            Format::Svg => {
                let t = String::from_utf8(body).unwrap();
                assert!(t.contains("<svg") && t.contains("http::wait_here"), "{t}");
            }
            Format::Folded => {
                let t = String::from_utf8(body).unwrap();
                assert!(
                    t.contains(";fiber:waiter;") && t.contains(";fiber:spinner;"),
                    "{t}"
                );
            }
        }
    }
    // The default view is the text dump; Go's paths give pprof, grouped and text.
    let (_, _, body) = get(addr, "/debug/fibers");
    assert!(String::from_utf8(body)
        .unwrap()
        .contains("\"spinner\" [running]"));
    let (status, head, body) = get(addr, "/debug/pprof/goroutine");
    assert_eq!(status, 200);
    assert_eq!(
        header(&head, "Content-Type"),
        Some("application/octet-stream")
    );
    assert_eq!(&body[..2], [0x1f, 0x8b]);
    let (_, _, body) = get(addr, "/debug/pprof/goroutine?debug=1");
    assert!(String::from_utf8(body)
        .unwrap()
        .contains("3 fibers [channel receive, "));
    let (_, _, body) = get(addr, "/debug/pprof/goroutine?debug=2");
    assert!(String::from_utf8(body)
        .unwrap()
        .contains("\"spinner\" [running]"));
    // HEAD: the same head, no body.
    let (status, head, body) = exchange(
        addr,
        b"HEAD /debug/fibers?format=json HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!((status, body.len()), (200, 0));
    assert!(
        header(&head, "Content-Length")
            .unwrap()
            .parse::<usize>()
            .unwrap()
            > 0
    );

    stop.store(true, Ordering::SeqCst);
    proc_thread.join().unwrap();
    server.stop();
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
}

#[test]
fn bad_requests_get_clear_answers_and_the_server_goes_on() {
    let _one = one_at_a_time();
    let limits = Limits {
        // (Room for a connection still closing while the next request comes: the one-by-one
        // checks below must not meet the limit; the limit has its own server further down.)
        max_connections: 8,
        max_head: 1024,
        read_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let server = http::serve_with("127.0.0.1:0", limits).unwrap();
    let addr = server.local_addr();
    let body = |r: (u16, String, Vec<u8>)| (r.0, String::from_utf8(r.2).unwrap());

    assert_eq!(
        body(get(addr, "/debug/fibers?format=tree")),
        (
            400,
            "unknown dump format \"tree\": one of text, grouped, json, pprof, folded, svg, \
             speedscope\n"
                .into()
        )
    );
    assert_eq!(
        body(get(addr, "/debug/pprof/goroutine?debug=9")),
        (
            400,
            "bad debug=\"9\": 0 (pprof), 1 (grouped text) or 2 (full text)\n".into()
        )
    );
    assert_eq!(
        body(get(addr, "/nothing/here")),
        (
            404,
            "no such page \"/nothing/here\": see / for the views\n".into()
        )
    );
    assert_eq!(
        body(get(addr, "/debug/pprof/heap")),
        (
            404,
            format!(
                "no heap profile: {}\n",
                fibertrace_fiber::export::NOT_TRACKED
            )
        )
    );
    let r = exchange(
        addr,
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\n\r\nabc",
    );
    assert_eq!(header(&r.1, "Allow"), Some("GET, HEAD"));
    assert_eq!(
        body(r),
        (405, "method POST not allowed: GET or HEAD\n".into())
    );
    assert_eq!(
        body(exchange(addr, b"GARBAGE\r\n\r\n")),
        (400, "bad request line\n".into())
    );
    assert_eq!(
        body(exchange(addr, b"GET / SPDY/3\r\n\r\n")),
        (400, "unsupported protocol \"SPDY/3\"\n".into())
    );
    assert_eq!(
        body(exchange(addr, b"GET /\xff HTTP/1.1\r\n\r\n")),
        (400, "the request line is not UTF-8\n".into())
    );
    // Escapes: a format named with %-escapes is decoded; a bad escape stays as written.
    assert_eq!(get(addr, "/debug/fibers?format=%67rouped").0, 200);
    assert_eq!(get(addr, "/debug/fibers?format=%zz").0, 400);
    // A head past the limit, and one that never ends.
    let big = format!("GET / HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(2000));
    assert_eq!(
        body(exchange(addr, big.as_bytes())),
        (431, "request head over 1024 bytes\n".into())
    );
    {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let chunk = [b'a'; 256];
        let _ = s.write_all(b"GET / HTTP/1.1\r\nX-Endless: ");
        // Keeps sending until the server answers and stops reading.
        for _ in 0..64 {
            if s.write_all(&chunk).is_err() {
                break;
            }
        }
        let (status, _, _) = read_response(&mut s);
        assert_eq!(status, 431);
    }
    // A client that sends half a request and goes away: nothing to answer; the next is.
    {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /debug/fib").unwrap();
    }
    // Another host name on a loopback server (DNS rebinding): refused. The loopback names
    // (with or without a port), a bare-LF request and no Host at all are served.
    assert_eq!(
        body(exchange(
            addr,
            b"GET / HTTP/1.1\r\nHost: evil.example:80\r\n\r\n"
        )),
        (
            403,
            "this server listens on the loopback address and answers only requests for \
             localhost, 127.0.0.1 or [::1] (Host header)\n"
                .into()
        )
    );
    for host in ["localhost", "127.0.0.1:8080", "[::1]:1", "LOCALHOST"] {
        let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
        assert_eq!(exchange(addr, req.as_bytes()).0, 200, "{host}");
    }
    assert_eq!(exchange(addr, b"GET / HTTP/1.0\n\n").0, 200);
    assert_eq!(exchange(addr, b"GET / HTTP/1.0\r\n\r\n").0, 200);
    // Two Host headers (a loopback name first, another after it, or the same twice): 400,
    // whichever one a proxy in front would have read.
    for hosts in [
        "Host: localhost\r\nHost: evil.example",
        "host: 127.0.0.1\r\nX-Other: 1\r\nHOST: localhost",
        "Host: localhost\r\nHost: localhost",
    ] {
        let req = format!("GET / HTTP/1.1\r\n{hosts}\r\n\r\n");
        assert_eq!(
            body(exchange(addr, req.as_bytes())),
            (400, "more than one Host header\n".into()),
            "{hosts}"
        );
    }
    // A header whose name only ends in "host" is not one.
    let req = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Forwarded-Host: evil.example\r\n\r\n";
    assert_eq!(exchange(addr, req).0, 200);
    // A client that trickles its head a byte every 100 ms (each gap well inside the read
    // timeout) still gets 408 when the timeout has passed since the connection: the answer
    // and the close come about 0.5 s + the 0.5 s drain after it connected, where a timeout
    // per read would have waited until 0.9 s + 0.5 s before even answering.
    {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        for b in b"GET / HTTP/1.1\r\nX-Slow".iter().take(9) {
            let _ = s.write_all(&[*b]);
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(read_response(&mut s).0, 408);
        assert!(
            t0.elapsed() < Duration::from_millis(1600),
            "{:?}",
            t0.elapsed()
        );
    }
    // A client that sends nothing gets 408 after the read timeout.
    let t0 = Instant::now();
    let mut silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(read_response(&mut silent).0, 408);
    assert!(t0.elapsed() >= Duration::from_millis(500));

    server.stop();
    // Clients that connect and send nothing hold places of connections waiting for their
    // request, not of answers: with two places of answers, two silent clients leave a
    // request answered (it was told 503 until they timed out: 8 idle sockets locked every
    // client out of the default server for 5 s).
    let server = http::serve_with(
        "127.0.0.1:0",
        Limits {
            max_connections: 2,
            max_waiting: 3,
            // (The silent clients must hold their places through the checks below, on a
            // loaded machine too.)
            read_timeout: Duration::from_secs(2),
            ..limits
        },
    )
    .unwrap();
    let addr = server.local_addr();
    let mut held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(get(addr, "/").0, 200);
    // A third fills the places of waiting connections: a new one is told 503 at once,
    // without waiting for them; once they time out, requests are answered again.
    held.push(TcpStream::connect(addr).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    let (status, head, _) = get(addr, "/");
    assert_eq!(status, 503);
    assert_eq!(header(&head, "Retry-After"), Some("1"));
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(get(addr, "/").0, 200);
    drop(held);

    // Many clients at once: each gets an answer, 200 or 503, none hangs.
    let answers: Vec<u16> = (0..16)
        .map(|_| std::thread::spawn(move || get(addr, "/debug/fibers?format=grouped").0))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(
        answers.iter().all(|s| *s == 200 || *s == 503),
        "{answers:?}"
    );
    assert!(answers.contains(&200), "{answers:?}");
    server.stop();
}

#[test]
fn addresses_are_checked_before_listening() {
    let err = |a: &str| http::parse_addr(a).unwrap_err().to_string();
    let hint = "(expected PORT, :PORT or HOST:PORT, e.g. 127.0.0.1:6060)";
    assert_eq!(err(""), format!("bad address \"\": empty {hint}"));
    // A megabyte of address: a message of a line, not of a megabyte.
    let long = "x".repeat(1 << 20);
    assert_eq!(
        err(&long),
        format!(
            "bad address \"{}\"... (1048576 bytes): no port {hint}",
            "x".repeat(64)
        )
    );
    assert_eq!(
        err("nohost"),
        format!("bad address \"nohost\": no port {hint}")
    );
    assert_eq!(
        err(":99999"),
        format!("bad address \":99999\": the port is past 65535 {hint}")
    );
    assert_eq!(
        err("host:"),
        format!("bad address \"host:\": the port is not a number {hint}")
    );
    assert_eq!(err(":"), format!("bad address \":\": no host {hint}"));
    assert_eq!(
        err("::6060"),
        format!("bad address \"::6060\": an IPv6 host goes in brackets, e.g. [::1]:6060 {hint}")
    );
    // A URL for an address, a negative port: what is wrong, not a symptom of it.
    assert_eq!(
        err("http://127.0.0.1:0"),
        format!(
            "bad address \"http://127.0.0.1:0\": an address, not a URL: leave out \"http://\" {hint}"
        )
    );
    assert_eq!(
        err("-1"),
        format!("bad address \"-1\": a port is a number from 0 to 65535 {hint}")
    );
    assert_eq!(
        err("127.0.0.1:x"),
        format!("bad address \"127.0.0.1:x\": the port is not a number {hint}")
    );
    // A port alone is the loopback address; a host as given.
    assert_eq!(
        http::parse_addr("6060").unwrap(),
        ["127.0.0.1:6060".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(
        http::parse_addr(":6060").unwrap(),
        ["127.0.0.1:6060".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(
        http::parse_addr("0.0.0.0:6060").unwrap(),
        ["0.0.0.0:6060".parse::<SocketAddr>().unwrap()]
    );
    // A port in use.
    let first = http::serve("127.0.0.1:0").unwrap();
    let taken = first.local_addr();
    let e = http::serve(&taken.to_string()).err().unwrap().to_string();
    assert_eq!(
        e,
        format!("cannot listen on {taken}: Address already in use (os error 98)")
    );
}

/// Clients that connect and send nothing cost the server no thread and hold no place of an
/// answer: with a hundred of them connected, requests are answered at once (64 of them used
/// to lock every client out with 503 until they timed out, 5 s). Requests beyond the
/// answers under way wait their turn (they were told 503: a scraper counts that a failed
/// scrape), and an absolute-form request line is served as its path.
#[test]
fn idle_clients_and_bursts_of_requests_are_all_answered() {
    let _one = one_at_a_time();
    let server = http::serve_with(
        "127.0.0.1:0",
        Limits {
            max_connections: 2,
            ..Limits::default()
        },
    )
    .unwrap();
    let addr = server.local_addr();
    let idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    assert_eq!(get(addr, "/debug/fibers?format=text").0, 200);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Forty at once, two answered at a time: every one gets its answer.
    let answers: Vec<u16> = (0..40)
        .map(|_| std::thread::spawn(move || get(addr, "/debug/fibers?format=json").0))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(answers.iter().all(|&s| s == 200), "{answers:?}");
    let (status, _, body) = get(addr, "http://localhost/debug/fibers?format=folded");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // A parameter given twice: which one was meant is not known.
    let (status, _, body) = get(addr, "/debug/fibers?format=json&format=svg");
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (400, "format given more than once\n")
    );
    let text = |r: (u16, String, Vec<u8>)| (r.0, String::from_utf8_lossy(&r.2).into_owned());
    // The absolute form's host is checked as the Host header is.
    let r = exchange(
        addr,
        b"GET http://evil.example/debug/fibers HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(r.0, 403);
    // Whitespace before a header's colon, and HTTP/1.1 without a Host: 400.
    assert_eq!(
        text(exchange(addr, b"GET / HTTP/1.1\r\nHost :localhost\r\n\r\n")),
        (
            400,
            "whitespace between a header's name and its colon\n".into()
        )
    );
    assert_eq!(
        text(exchange(addr, b"GET / HTTP/1.1\r\n\r\n")),
        (400, "no Host header (HTTP/1.1 requires one)\n".into())
    );
    assert_eq!(exchange(addr, b"GET / HTTP/1.0\r\n\r\n").0, 200);
    drop(idle);
    server.stop();

    // Two hundred silent clients timing out together get their 408s from the server's own
    // thread: the answers' places stay free (each 408 took one for its drain, and a request
    // that came then was told 503).
    let server = http::serve_with(
        "127.0.0.1:0",
        Limits {
            max_connections: 2,
            read_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
    )
    .unwrap();
    let addr = server.local_addr();
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(350));
    let answers: Vec<u16> = (0..8)
        .map(|_| std::thread::spawn(move || get(addr, "/").0))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(answers.iter().all(|&s| s == 200), "{answers:?}");
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(read_response(&mut c).0, 408);
    }
    server.stop();
}

/// Recurses `depth` calls deep, then waits on `ch` (a deep stack for the views to print).
#[inline(never)]
fn deep_wait(depth: u32, ch: &fibertrace_fiber::Channel<u8>) {
    if depth == 0 {
        wait_here(ch);
    } else {
        deep_wait(std::hint::black_box(depth - 1), ch);
    }
    std::hint::black_box(depth);
}

/// Asks for the full text view (and reads nothing of the answer).
fn ask_and_read_nothing(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /debug/fibers?format=text HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    s
}

/// A client that does not read its answer holds no answering thread: with one answering
/// thread, a request that comes after three clients that read nothing of their answers (each
/// larger than the socket buffers between them and the server can take) is answered at once,
/// and the three get their whole answers when they read — also after the server stopped.
/// With their room full (`max_sending_bytes`), views are told 503 until it frees.
#[test]
fn clients_that_do_not_read_their_answers_hold_up_no_other() {
    let _one = one_at_a_time();
    // Fibers 60 calls deep: a text view of several MiB.
    let (stop, ready) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (stop2, ready2) = (stop.clone(), ready.clone());
    let t = std::thread::spawn(move || {
        let s = Scheduler::new();
        let ch = channel::<u8>(0);
        for _ in 0..std::hint::black_box(1500) {
            let c = ch.clone();
            s.builder().name("deep").spawn(move || deep_wait(60, &c));
        }
        s.builder().name("ready").spawn(move || {
            ready2.store(true, Ordering::SeqCst);
            while !stop2.load(Ordering::SeqCst) {
                fibertrace_fiber::sleep(Duration::from_millis(10));
            }
            ch.close();
        });
        s.run().unwrap();
    });
    while !ready.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // The size of one answer, and the most the buffers between a client and the server hold
    // (the server's send buffer grows to tcp_wmem's maximum; a client that reads nothing
    // keeps its receive window at tcp_rmem's default).
    let server = http::serve_with(
        "127.0.0.1:0",
        Limits {
            max_connections: 1,
            write_timeout: Duration::from_secs(60),
            ..Limits::default()
        },
    )
    .unwrap();
    let addr = server.local_addr();
    let (status, head, body) = get(addr, "/debug/fibers?format=text");
    assert_eq!(status, 200);
    let sysctl = |name: &str, i: usize| -> usize {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).map_or(4 << 20, |v| {
            v.split_whitespace().nth(i).unwrap().parse().unwrap()
        })
    };
    let buffered = sysctl("tcp_wmem", 2) + sysctl("tcp_rmem", 1);
    assert!(
        body.len() > buffered + (1 << 20),
        "an answer of {} bytes fits in the {buffered} bytes of buffers: make the fibers deeper",
        body.len()
    );
    let len: usize = header(&head, "Content-Length").unwrap().parse().unwrap();
    assert_eq!(len, body.len());

    let slow: Vec<TcpStream> = (0..3).map(|_| ask_and_read_nothing(addr)).collect();
    // Their answers are made (one after the other, on the one answering thread) ...
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let (status, _, _) = get(addr, "/debug/fibers?format=grouped");
    assert_eq!(status, 200);
    // ... and the request after them waits for that, not for them to be read (the write
    // timeout is 60 s).
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    // The server stops at once, and what it holds is still written.
    let t0 = Instant::now();
    server.stop();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
    for mut c in slow {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (status, head, body) = read_response(&mut c);
        assert_eq!(status, 200);
        let len: usize = header(&head, "Content-Length").unwrap().parse().unwrap();
        assert_eq!(body.len(), len);
        assert!(len > buffered, "{len}");
    }

    // A room of one byte for answers clients do not take: once one is held, a view asked
    // for is told 503 at once (built, it would wait with them, holding an answering thread
    // until its write timeout, and every request behind it); the index is served. The unread
    // answer is cut at its write timeout, and views are served again.
    let server = http::serve_with(
        "127.0.0.1:0",
        Limits {
            max_connections: 1,
            write_timeout: Duration::from_millis(1500),
            max_sending_bytes: 1,
            ..Limits::default()
        },
    )
    .unwrap();
    let addr = server.local_addr();
    let mut slow = ask_and_read_nothing(addr);
    // Once its first bytes come, its answer is built and held (the answering thread is free).
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    assert!(slow.peek(&mut [0; 1]).unwrap() > 0);
    let t0 = Instant::now();
    let (status, _, body) = get(addr, "/debug/fibers?format=grouped");
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 503, "{body}");
    assert!(
        body.ends_with(" MiB of answers wait for clients that do not read them; try again\n"),
        "{body}"
    );
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(get(addr, "/").0, 200);
    let mut all = Vec::new();
    std::thread::sleep(Duration::from_millis(2000));
    let _ = slow.read_to_end(&mut all);
    assert!(all.len() < len, "{} of {len} bytes: not cut", all.len());
    assert_eq!(get(addr, "/debug/fibers?format=grouped").0, 200);
    server.stop();

    stop.store(true, Ordering::SeqCst);
    t.join().unwrap();
}
