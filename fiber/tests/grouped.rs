//! The grouped view of a dump (Go's `debug=1`): fibers in the same state with the same trace
//! and creator folded into one group with their count, ids and names, the biggest first.
//! (One test in this binary: fiber ids are then consecutive, and the expected id ranges
//! exact.)

use std::time::Duration;

use fibertrace_fiber::inspect::{self, InfoOptions};
use fibertrace_fiber::{channel, dump, yield_now, Builder, Channel, Scheduler};

#[inline(never)]
fn wait_three(ch: &Channel<u8>) -> u8 {
    let v = wait_two(ch);
    std::hint::black_box(v)
}

#[inline(never)]
fn wait_two(ch: &Channel<u8>) -> u8 {
    let v = ch.recv().unwrap_or(0);
    std::hint::black_box(v)
}

/// The lines of a block that are frames.
fn frames(block: &str) -> Vec<&str> {
    block.lines().filter(|l| l.starts_with('#')).collect()
}

#[test]
fn identical_stacks_fold_into_groups_biggest_first_with_their_ids_and_names() {
    Scheduler::new()
        .block_on(|| {
            let ch = channel::<u8>(1);
            // Workers and sleepers interleaved (ids with gaps), then workers in a row; one
            // worker with another name. Every spawn is the same call site, so workers share
            // their creator's trace.
            let plan = [
                "worker", "idle", "worker", "idle", "other", "worker", "worker",
            ];
            let mut workers = Vec::new();
            let mut sleepers = Vec::new();
            for name in plan {
                let rx = ch.clone();
                let h = Builder::new().name(name).spawn(move || {
                    if name == "idle" {
                        fibertrace_fiber::sleep(Duration::from_secs(60));
                        0
                    } else {
                        wait_three(&rx)
                    }
                });
                if name == "idle" {
                    sleepers.push(h);
                } else {
                    workers.push(h);
                }
            }
            yield_now();
            let snap = inspect::snapshot(&InfoOptions::default());
            let mine = snap
                .schedulers
                .iter()
                .find(|s| s.fibers.iter().any(|f| f.id == workers[0].id()))
                .expect("this scheduler");
            let mut text = String::new();
            dump::render_scheduler_grouped(mine, &mut text);
            let blocks: Vec<&str> = text.split("\n\n").filter(|b| !b.is_empty()).collect();
            assert_eq!(
                blocks[0],
                format!(
                    "scheduler {} {}: 8 fibers in 3 groups",
                    mine.id,
                    fibertrace_fiber::embed::quoted_name(&mine.name)
                ),
                "{text}"
            );
            let w = |i: usize| workers[i].id();
            let s = |i: usize| sleepers[i].id();
            // Workers: ids a, a+2, a+4, a+5, a+6 (the sleepers took a+1 and a+3).
            assert_eq!(w(1), w(0) + 2, "ids are not consecutive: {text}");
            let head = blocks[1].lines().next().unwrap();
            assert!(head.starts_with("5 fibers [channel receive, "), "{text}");
            assert!(
                head.ends_with(&format!(
                    "]: ids {}, {}, {}-{}, names \"worker\" \u{d7}4, \"other\" \u{d7}1:",
                    w(0),
                    w(1),
                    w(2),
                    w(4)
                )),
                "{text}"
            );
            // The group's trace is its members' trace in the full view, from the runtime's
            // receive to our two functions.
            let full = dump::snapshot_text(&snap);
            let first = full
                .split("\n\n")
                .find(|b| b.starts_with(&format!("fiber {} ", w(0))))
                .unwrap();
            assert_eq!(frames(blocks[1]), frames(first), "{text}\n{full}");
            let f = frames(blocks[1]);
            assert!(f[0].contains("fibertrace_fiber::sched::block"), "{text}");
            let two = f
                .iter()
                .position(|l| l.contains(" in grouped::wait_two+0x"));
            let three = f
                .iter()
                .position(|l| l.contains(" in grouped::wait_three+0x"));
            assert_eq!(two.map(|i| i + 1), three, "{text}");
            assert!(blocks[1].contains("\ncreated by fiber "), "{text}");
            // Sleepers: two ids with a gap.
            let head = blocks[2].lines().next().unwrap();
            assert!(head.starts_with("2 fibers [sleep, "), "{text}");
            assert!(
                head.ends_with(&format!("]: ids {}, {}, names \"idle\":", s(0), s(1))),
                "{text}"
            );
            // The running fiber alone.
            let head = blocks[3].lines().next().unwrap();
            assert_eq!(
                head,
                format!(
                    "1 fiber [running]: id {}, name \"main\":",
                    fibertrace_fiber::current_id()
                ),
                "{text}"
            );
            assert_eq!(blocks.len(), 4, "{text}");
            ch.close();
            for h in workers {
                h.join().unwrap();
            }
            for h in sleepers {
                h.fiber().cancel();
            }
        })
        .unwrap();
}
