//! pprof: a snapshot as a gzipped `profile.proto` (the format of `go tool pprof`, and of the
//! scrapers that collect Go's `/debug/pprof/goroutine` from a fleet).
//!
//! One sample per fiber, value 1 of sample type `fibers`/`count` (as Go's goroutine profile
//! has `goroutine`/`count`), its stack leaf first, and labels: `fiber_id` (number), `name`,
//! `state` (`channel receive`, `running`, ...), `scheduler` (its name), and when known
//! `parent` (number, the creator's fiber id) and `waiting_ms` (number, how long it has
//! waited). A native frame is a location at its address (a return address less one) in the
//! mapping of its image (path, build id, bounds); its inlined calls are the location's lines,
//! innermost first, as the format wants. A Lua frame is a location of its own, without a
//! mapping or an address, with one line (function, chunk, line); an unnamed one,
//! `function <s.lua:5>` elsewhere, is `function@s.lua:5` here (pprof's tools would cut what
//! is between `<` and `>`). Functions and locations are
//! shared by every sample that has them.
//!
//! The messages are declared here with `prost`'s derive (the fields and numbers of
//! `profile.proto`, the ones this export writes): no code generation step, no `protoc`.
//!
//! How it can be wrong: a mapping's `file_offset` is its first loaded segment's virtual
//! address less the load bias, which is the file offset for every ELF linked the usual way
//! (first segment at offset 0); a tool that symbolizes again from the file (it should not:
//! every mapping says it has functions and lines) would be off for another layout.

use std::collections::HashMap;
use std::io::Write as _;

use fibertrace_core::symbolize;

use super::{stack, state, ExFrame, Kind};
use crate::inspect::Snapshot;

#[derive(Clone, PartialEq, prost::Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(message, optional, tag = "11")]
    period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    period: i64,
    #[prost(int64, repeated, tag = "13")]
    comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    default_sample_type: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
    #[prost(int64, tag = "3")]
    num: i64,
    #[prost(int64, tag = "4")]
    num_unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    memory_start: u64,
    #[prost(uint64, tag = "3")]
    memory_limit: u64,
    #[prost(uint64, tag = "4")]
    file_offset: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    #[prost(int64, tag = "6")]
    build_id: i64,
    #[prost(bool, tag = "7")]
    has_functions: bool,
    #[prost(bool, tag = "8")]
    has_filenames: bool,
    #[prost(bool, tag = "9")]
    has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    has_inline_frames: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// Builds a profile: strings, functions, locations and mappings interned as samples come.
#[derive(Default)]
struct Builder {
    p: Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(i64, i64), u64>,
    /// Native locations by address; a layer's by its (function, line).
    native: HashMap<u64, u64>,
    layer: HashMap<(u64, i64), u64>,
    /// Mappings by (image path, load bias).
    mappings: HashMap<(String, u64), u64>,
}

impl Builder {
    fn new() -> Builder {
        let mut b = Builder::default();
        b.str("");
        b
    }

    fn str(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.p.string_table.len() as i64;
        self.p.string_table.push(s.to_string());
        self.strings.insert(s.to_string(), i);
        i
    }

    fn function(&mut self, name: &str, file: Option<&str>) -> u64 {
        let key = (self.str(name), self.str(file.unwrap_or("")));
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.p.function.len() as u64 + 1;
        self.p.function.push(Function {
            id,
            name: key.0,
            system_name: key.0,
            filename: key.1,
        });
        self.functions.insert(key, id);
        id
    }

    fn mapping(
        &mut self,
        f: &ExFrame,
        images: &[std::sync::Arc<fibertrace_core::image::Image>],
    ) -> u64 {
        let Some(img) = &f.image else {
            return 0;
        };
        let key = (img.path.clone(), img.base);
        if let Some(&id) = self.mappings.get(&key) {
            return id;
        }
        let (start, end) = images
            .iter()
            .find(|i| i.path == img.path && i.base == img.base)
            .map_or((f.address, f.address.saturating_add(1)), |i| {
                (i.start, i.end)
            });
        let id = self.p.mapping.len() as u64 + 1;
        let filename = self.str(&img.path);
        let build_id = self.str(img.build_id.as_deref().unwrap_or(""));
        self.p.mapping.push(Mapping {
            id,
            memory_start: start,
            memory_limit: end,
            file_offset: start.saturating_sub(img.base),
            filename,
            build_id,
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        });
        self.mappings.insert(key, id);
        id
    }

    fn location(
        &mut self,
        f: &ExFrame,
        images: &[std::sync::Arc<fibertrace_core::image::Image>],
    ) -> u64 {
        if f.kind == Kind::Native {
            if let Some(&id) = self.native.get(&f.address) {
                return id;
            }
        }
        let lines: Vec<Line> = f
            .levels
            .iter()
            .map(|l| Line {
                function_id: self.function(&pprof_name(&l.name, f.kind), l.file.as_deref()),
                line: i64::from(l.line),
            })
            .collect();
        let layer_key = (lines[0].function_id, lines[0].line);
        if f.kind != Kind::Native {
            if let Some(&id) = self.layer.get(&layer_key) {
                return id;
            }
        }
        let id = self.p.location.len() as u64 + 1;
        let mapping_id = if f.kind == Kind::Native {
            self.mapping(f, images)
        } else {
            0
        };
        self.p.location.push(Location {
            id,
            mapping_id,
            address: f.address,
            line: lines,
        });
        if f.kind == Kind::Native {
            self.native.insert(f.address, id);
        } else {
            self.layer.insert(layer_key, id);
        }
        id
    }

    fn label_str(&mut self, key: &str, value: &str) -> Label {
        Label {
            key: self.str(key),
            str: self.str(value),
            num: 0,
            num_unit: 0,
        }
    }

    fn label_num(&mut self, key: &str, value: i64, unit: &str) -> Label {
        Label {
            key: self.str(key),
            str: 0,
            num: value,
            num_unit: if unit.is_empty() { 0 } else { self.str(unit) },
        }
    }
}

/// A function's name as pprof keeps it: pprof's tools drop what is between `<` and `>` as
/// template arguments, so a Lua function without a name, `function <s.lua:5>`, is written
/// `function@s.lua:5`.
fn pprof_name(name: &str, kind: Kind) -> std::borrow::Cow<'_, str> {
    match name
        .strip_prefix("function <")
        .and_then(|r| r.strip_suffix('>'))
    {
        Some(place) if kind == Kind::Layer => format!("function@{place}").into(),
        _ => name.into(),
    }
}

/// The snapshot as a gzipped `profile.proto` (see the module doc).
pub(super) fn profile(snap: &Snapshot) -> Vec<u8> {
    let images = symbolize::images();
    let mut b = Builder::new();
    let vt = ValueType {
        r#type: b.str("fibers"),
        unit: b.str("count"),
    };
    b.p.sample_type.push(vt.clone());
    b.p.period_type = Some(vt);
    b.p.period = 1;
    b.p.time_nanos = (snap.taken_at * 1e9) as i64;
    let comment = b.str(&format!("fibertrace snapshot version {}", snap.version));
    b.p.comment.push(comment);
    for s in &snap.schedulers {
        for fi in &s.fibers {
            let location_id: Vec<u64> = stack(fi).iter().map(|f| b.location(f, &images)).collect();
            let mut label = vec![
                b.label_num("fiber_id", fi.id as i64, ""),
                b.label_str("name", &fi.name),
                b.label_str("state", &state(fi)),
                b.label_str("scheduler", &s.name),
            ];
            if let Some(p) = fi.parent {
                label.push(b.label_num("parent", p as i64, ""));
            }
            if let Some(w) = fi.waiting.as_ref().filter(|_| !s.times_unknown) {
                label.push(b.label_num(
                    "waiting_ms",
                    (w.seconds.max(0.0) * 1e3) as i64,
                    "milliseconds",
                ));
            }
            b.p.sample.push(Sample {
                location_id,
                value: vec![1],
                label,
            });
        }
    }
    let raw = prost::Message::encode_to_vec(&b.p);
    let mut gz = flate2::write::GzEncoder::new(
        Vec::with_capacity(raw.len() / 4 + 64),
        flate2::Compression::fast(),
    );
    // Writing into a Vec does not fail.
    let _ = gz.write_all(&raw);
    gz.finish().unwrap_or_default()
}

/// A heap frame for the exports: a native return address resolved here, or a layer's frame
/// (Lua) with its label.
fn heap_frame(
    f: &fibertrace_core::Frame,
    labels: &HashMap<fibertrace_core::LuaFrameId, String>,
) -> Option<ExFrame> {
    let info = crate::frames::FrameInfo {
        frame: *f,
        resolved: None,
        label: match f {
            fibertrace_core::Frame::Lua(id) => labels.get(id).map(|s| std::sync::Arc::from(&**s)),
            _ => None,
        },
    };
    // The runtime's and the hosts' glue left out, as the text views leave it out.
    super::ex_frame(&info, crate::inspect::glue::filter())
}

/// What a heap profile is made of, gathered where the names are known (see
/// [`heap_profile`]): per (recorded stack, fiber), the four figures and whether the fiber
/// ended; live fibers' names; Lua frames' labels.
/// Per (recorded stack, fiber): alloc objects, alloc space, inuse objects, inuse space, and
/// whether the fiber ended.
pub(crate) type HeapRows = HashMap<(Vec<u64>, Option<u64>), ([i64; 4], bool)>;

pub(crate) struct HeapData {
    pub rows: HeapRows,
    pub names: HashMap<u64, String>,
    pub labels: HashMap<fibertrace_core::LuaFrameId, String>,
    pub frames_of: fn(&[u64]) -> Vec<fibertrace_core::Frame>,
}

/// The live heap and the allocations made so far as a gzipped `profile.proto` heap profile,
/// as Go's: sample types `alloc_objects`/`count`, `alloc_space`/`bytes`,
/// `inuse_objects`/`count`, `inuse_space`/`bytes` (the default), one sample per stack and
/// fiber, labelled `fiber_id` (number), `name` (a live fiber's), `exited` (`true` for an
/// ended fiber's). Stacks start at the code that asked for memory (the allocation
/// machinery left out). In the sampled tier the figures are the samples' estimates.
pub(crate) fn heap_profile(d: &HeapData) -> Vec<u8> {
    use fibertrace_core::heap;
    let images = symbolize::images();
    let mut b = Builder::new();
    for (t, u) in [
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ] {
        let vt = ValueType {
            r#type: b.str(t),
            unit: b.str(u),
        };
        b.p.sample_type.push(vt);
    }
    b.p.default_sample_type = b.str("inuse_space");
    b.p.period_type = Some(ValueType {
        r#type: b.str("space"),
        unit: b.str("bytes"),
    });
    b.p.period = if heap::tier() == heap::Tier::Sampled {
        heap::config().sample_interval as i64
    } else {
        1
    };
    b.p.time_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    // Merged again after the machinery and the start-up frames are cut off (two recorded
    // stacks can differ only there).
    let mut by: HeapRows = HashMap::new();
    for ((addrs, fiber), (v, exited)) in &d.rows {
        let own = heap::own_frames(addrs);
        let e = by.entry((addrs[own].to_vec(), *fiber)).or_default();
        for (sum, x) in e.0.iter_mut().zip(v) {
            *sum += x;
        }
        e.1 |= *exited;
    }
    let mut keys: Vec<_> = by.into_iter().collect();
    keys.sort_by(|a, b| {
        b.1 .0[3]
            .cmp(&a.1 .0[3])
            .then(b.1 .0[1].cmp(&a.1 .0[1]))
            .then(a.0.cmp(&b.0))
    });
    for ((addrs, fiber), (values, exited)) in keys {
        let location_id: Vec<u64> = (d.frames_of)(&addrs)
            .iter()
            .filter_map(|f| heap_frame(f, &d.labels))
            .map(|f| b.location(&f, &images))
            .collect();
        let mut label = Vec::new();
        if let Some(f) = fiber {
            label.push(b.label_num("fiber_id", f as i64, ""));
            if exited {
                label.push(b.label_str("exited", "true"));
            } else if let Some(n) = d.names.get(&f) {
                label.push(b.label_str("name", n));
            }
        }
        b.p.sample.push(Sample {
            location_id,
            value: values.to_vec(),
            label,
        });
    }
    let raw = prost::Message::encode_to_vec(&b.p);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let _ = gz.write_all(&raw);
    gz.finish().unwrap_or_default()
}
