//! A program that ends while requests come in (`http::finish_answers`, which `fibertrace
//! run` calls at exit): every request sent before the end is answered in full, even one the
//! server had not read yet; one sent after is told the program is ending. In a test binary
//! of its own: the end is for the whole process.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use fibertrace_fiber::http;

fn status_of(s: &mut TcpStream) -> (u16, String) {
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let text = String::from_utf8_lossy(&all).into_owned();
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {text:?}"));
    (status, text)
}

#[test]
fn requests_sent_before_the_end_are_answered_and_later_ones_told_it_ends() {
    let limits = http::Limits {
        max_waiting: 1000,
        max_queued: 1000,
        ..http::Limits::default()
    };
    let server = http::serve_with("127.0.0.1:0", limits).unwrap();
    let addr = server.local_addr();
    // Connected, then their requests sent, then the end at once: the server has read some of
    // them, not all (it told the others nothing: their connections were cut by the exit, or
    // told them 503 as if asked after the end).
    let mut clients: Vec<TcpStream> = (0..150)
        .map(|_| {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            s
        })
        .collect();
    for s in &mut clients {
        s.write_all(b"GET /debug/fibers?format=text HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
    }
    assert!(http::finish_answers(Duration::from_secs(10)));
    for s in &mut clients {
        let (status, text) = status_of(s);
        assert_eq!(status, 200, "{text}");
    }
    // Asked once the end began: told so.
    let mut late = TcpStream::connect(addr).unwrap();
    late.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    late.write_all(b"GET /debug/fibers HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let (status, text) = status_of(&mut late);
    assert_eq!(status, 503, "{text}");
    assert!(text.ends_with("the program is ending\n"), "{text}");
    server.stop();
}
