//! The deadlock report's wait-for graph: who waits on what, who else could end each wait, and
//! the cycle named.

use fibertrace_fiber::{channel, suspend, yield_now, RunError, Scheduler};

/// Two fibers take two one-token channels (used as locks) in opposite orders; a third joins
/// one of them; a fourth waits on a channel nobody else has; a fifth is suspended.
#[test]
fn a_lock_order_deadlock_names_its_cycle() {
    let s = Scheduler::new();
    let (m1, m2, lone) = (channel::<u8>(1), channel::<u8>(1), channel::<u8>(0));
    m1.try_send(0).unwrap();
    m2.try_send(0).unwrap();
    let (a1, a2, b1, b2) = (m1.clone(), m2.clone(), m1.clone(), m2.clone());
    let a = s.builder().name("a").spawn(move || {
        a1.recv();
        yield_now();
        a2.recv();
    });
    let b = s.builder().name("b").spawn(move || {
        b2.recv();
        yield_now();
        b1.recv();
    });
    let (aid, bid) = (a.id(), b.id());
    let boss = s.builder().name("boss").spawn(move || {
        let _ = a.join();
    });
    let l2 = lone.clone();
    let lonely = s.builder().name("lonely").spawn(move || {
        l2.recv();
    });
    let idle = s.builder().name("idle").spawn(suspend);
    match s.run() {
        Err(RunError::Deadlock { fibers }) => assert_eq!(fibers.len(), 5),
        other => panic!("{other:?}"),
    }
    let report = s.deadlock_report();
    let (m1, m2, lone) = (m1.id(), m2.id(), lone.id());
    let (boss, lonely, idle) = (boss.id(), lonely.id(), idle.id());
    let expected = format!(
        "all fibers are asleep — deadlock!\n\
         \n\
         wait-for graph:\n  \
         fiber {aid} \"a\" receives on channel {m2}, which fiber {bid} \"b\" also holds\n  \
         fiber {bid} \"b\" receives on channel {m1}, which fiber {aid} \"a\" also holds\n  \
         fiber {boss} \"boss\" joins fiber {aid} \"a\"\n  \
         fiber {lonely} \"lonely\" receives on channel {lone}, which no other fiber is known \
         to hold\n  \
         fiber {idle} \"idle\" is suspended: only an explicit wakeup ends it\n\
         cycle: fiber {aid} \"a\" → fiber {bid} \"b\" → fiber {aid} \"a\"\n\
         \n"
    );
    assert!(report.starts_with(&expected), "{report}");
    // The dump follows, with each fiber's frames.
    let rest = &report[expected.len()..];
    assert!(rest.starts_with("scheduler "), "{report}");
    assert!(
        rest.contains(&format!("fiber {aid} \"a\" [channel receive, ")),
        "{report}"
    );

    // The same graph as data.
    let g = s.wait_graph();
    let ids: Vec<_> = g
        .nodes
        .iter()
        .map(|n| (n.fiber, g.wakers(n.fiber)))
        .collect();
    assert_eq!(
        ids,
        [
            (aid, vec![bid]),
            (bid, vec![aid]),
            (boss, vec![aid]),
            (lonely, vec![]),
            (idle, vec![])
        ]
    );
    assert_eq!(g.cycles.len(), 1);
    assert_eq!(
        (g.cycles[0].paths.clone(), g.cycles[0].members.clone()),
        (vec![vec![aid, bid]], vec![aid, bid])
    );
}

/// A ring of joins: each of 2,000 fibers joins the next, the last joins the first. The cycle
/// is found without deep recursion, named in full.
#[test]
fn a_ring_of_joins_is_one_cycle() {
    use std::cell::RefCell;
    use std::rc::Rc;
    let s = Scheduler::new();
    let n = 2000;
    let handles: Rc<RefCell<Vec<Option<fibertrace_fiber::JoinHandle<()>>>>> =
        Rc::new(RefCell::new(Vec::new()));
    let mut ids = Vec::new();
    for i in 0..n {
        let hs = handles.clone();
        let h = s.spawn(move || {
            let next = hs.borrow_mut()[(i + 1) % n].take().unwrap();
            let _ = next.join();
        });
        ids.push(h.id());
        handles.borrow_mut().push(Some(h));
    }
    assert!(matches!(s.run(), Err(RunError::Deadlock { .. })));
    let g = s.wait_graph();
    assert_eq!(g.cycles.len(), 1);
    assert_eq!(g.cycles[0].paths, [ids.clone()]);
    assert_eq!(g.cycles[0].members, ids);
    let report = s.deadlock_report();
    let cycle = report.lines().find(|l| l.starts_with("cycle: ")).unwrap();
    assert_eq!(cycle.matches(" → ").count(), n);
    // Unblock and finish: nothing leaks.
    drop(handles);
}

/// 10,000 fibers on one channel that each used: one line for them all (not a line per fiber
/// naming the 9,999 others), and the knot of those the runtime knows hold it.
#[test]
fn ten_thousand_waiters_on_one_channel_read_as_one_line() {
    let s = Scheduler::new();
    let ch = channel::<u8>(0);
    for _ in 0..10_000 {
        let c = ch.clone();
        s.builder().name("w").spawn(move || {
            c.recv();
        });
    }
    assert!(matches!(s.run(), Err(RunError::Deadlock { .. })));
    let report = s.deadlock_report();
    let graph: Vec<&str> = report.split("\n\n").nth(1).unwrap().lines().collect();
    assert_eq!(graph.len(), 3, "{graph:?}");
    assert!(graph[1].starts_with("  10000 fibers ("), "{}", graph[1]);
    assert!(
        graph[1].ends_with(&format!(
            " and 9992 more) receive on channel {}, which no other fiber is known to hold (more fibers used it than the runtime remembers)",
            ch.id()
        )),
        "{}",
        graph[1]
    );
    // The runtime remembers 16 users of an object: the knot it can prove is theirs.
    assert!(
        graph[2].starts_with("  all 16 fibers of this knot wait on one another: "),
        "{}",
        graph[2]
    );
    let g = s.wait_graph();
    assert_eq!(g.objects.len(), 1);
    assert_eq!(g.objects[0].holders.len(), 16);
    assert!(g.objects[0].more);
}

/// The graph quotes names as every other text view does: control characters escaped as
/// `\x1b` (it printed Rust's debug form, `\u{1b}`, and for a Lua name's bytes that are not
/// UTF-8 the code points that stand for them, `\u{10ffff}`, where the dumps say `\xff`).
#[test]
fn the_graph_quotes_names_as_the_dumps_do() {
    let s = Scheduler::new();
    let name = "ab\x1b[31m\n\"q";
    let (tx, rx) = (channel::<u8>(0), channel::<u8>(0));
    let (t2, r2) = (tx.clone(), rx.clone());
    let a = s.builder().name(name).spawn(move || {
        r2.recv();
        let _ = t2.send(1);
    });
    let _b = s.builder().name("b").spawn(move || {
        let _ = a.join();
    });
    assert!(matches!(s.run(), Err(RunError::Deadlock { .. })));
    let mut out = String::new();
    s.wait_graph().render(&mut out);
    assert!(out.contains(r#""ab\x1b[31m\n\"q""#), "{out}");
    assert!(!out.contains("\\u{"), "{out}");
    drop((tx, rx));
}
