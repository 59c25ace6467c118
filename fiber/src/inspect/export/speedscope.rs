//! speedscope: a snapshot in speedscope's file format
//! (`https://www.speedscope.app/file-format-schema.json`).
//!
//! One `sampled` profile per scheduler, named `scheduler ID "NAME"`, one sample of weight 1
//! per fiber (in the snapshot's order), each stack root first, from one shared frame table
//! (`name`, `file`, `line`; an inlined call is a frame of its own after the function it was
//! inlined into, and a layer's (Lua) frame has its chunk as file). speedscope's "left heavy"
//! view then merges the fibers that share a stack.

use std::collections::HashMap;

use serde::Serialize;

use super::stack;
use crate::inspect::Snapshot;

#[derive(Serialize, PartialEq, Eq, Hash, Clone)]
struct FrameEntry {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<u32>,
}

#[derive(Serialize)]
struct Shared {
    frames: Vec<FrameEntry>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Profile {
    r#type: &'static str,
    name: String,
    unit: &'static str,
    start_value: u64,
    end_value: u64,
    samples: Vec<Vec<usize>>,
    weights: Vec<u64>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct File {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared,
    profiles: Vec<Profile>,
    name: String,
    active_profile_index: usize,
    exporter: String,
}

/// The snapshot as a speedscope file (see the module doc).
pub(super) fn file(snap: &Snapshot) -> Vec<u8> {
    let mut frames: Vec<FrameEntry> = Vec::new();
    let mut index: HashMap<FrameEntry, usize> = HashMap::new();
    let mut profiles = Vec::new();
    for s in &snap.schedulers {
        let mut samples = Vec::with_capacity(s.fibers.len());
        for fi in &s.fibers {
            let mut st = Vec::new();
            for f in stack(fi).iter().rev() {
                for l in f.levels.iter().rev() {
                    let e = FrameEntry {
                        name: l.name.clone(),
                        file: l.file.clone(),
                        line: (l.line > 0).then_some(l.line),
                    };
                    let i = *index.entry(e.clone()).or_insert_with(|| {
                        frames.push(e);
                        frames.len() - 1
                    });
                    st.push(i);
                }
            }
            samples.push(st);
        }
        let n = samples.len() as u64;
        profiles.push(Profile {
            r#type: "sampled",
            name: format!("scheduler {} {}", s.id, crate::sched::quoted_name(&s.name)),
            unit: "none",
            start_value: 0,
            end_value: n,
            weights: vec![1; samples.len()],
            samples,
        });
    }
    let fibers: usize = snap.schedulers.iter().map(|s| s.fibers.len()).sum();
    let f = File {
        schema: "https://www.speedscope.app/file-format-schema.json",
        shared: Shared { frames },
        profiles,
        name: format!("fibertrace: {fibers} fibers"),
        active_profile_index: 0,
        exporter: concat!("fibertrace ", env!("CARGO_PKG_VERSION")).to_string(),
    };
    serde_json::to_vec(&f).unwrap_or_default()
}
