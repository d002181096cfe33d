//! The crate's pure parts — the memory model, the descriptor, the
//! protocol's vocabulary, the checksums, the frame codecs, request bookkeeping and
//! planning, the open-request budget, the agent's and the KV-cache
//! layer's errors, the KV-cache layer's states, mappings, messages and
//! protocol machines — import only each other, forbid
//! `unsafe`, and do no I/O, so that they could move into a crate of their
//! own. Read from the sources: a change that makes one of them import the
//! agent layer, a transport or the OS fails here, naming the line.
//!
//! The engine on two floors: its core (every engine file that is not a
//! transport's) names no transport, and no transport names another; only
//! the registry (`engine::transports`) names them all. And the engine's
//! parts (each file or folder under `src/engine/`, but the root that
//! declares them and holds the agent's state) import each other without a
//! cycle; and a transport reaches its agent only through its context
//! (`engine::ctx::Ctx`), never the agent's whole state.

use std::path::Path;

/// The pure modules, as paths under `crate::`.
const PURE: &[&str] = &[
    "error",
    "auth::error",
    "gpu::error",
    "storage::obj::error",
    "memory",
    "desc",
    "proto",
    "small",
    "integrity",
    "engine::wire",
    "engine::shm::frames",
    "engine::shm::plan",
    "engine::fabric::tally",
    "engine::requests",
    "engine::plan",
    "engine::budget",
    "cache::config",
    "cache::error",
    "cache::fragments",
    "cache::lookup",
    "cache::machine",
    "cache::machine::receiver",
    "cache::machine::sender",
    "cache::mapping",
    "cache::pattern",
    "cache::state",
    "cache::stats",
    "cache::wire",
];

/// What no pure module may name: the OS, and libraries that reach it.
const IO: &[&str] = &[
    "std::fs",
    "std::net",
    "std::os",
    "std::process",
    "std::thread",
    "libc::",
    "rustix::",
    "io_uring",
    "libloading",
];

/// `module`'s source (`src/<path>.rs`, else `src/<path>/mod.rs`) without
/// its unit tests (everything from a `#[cfg(test)]` item with a body on;
/// a `#[cfg(test)] mod tests;` line pair is skipped) and without comments.
fn source(module: &str) -> Vec<(usize, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file(module));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "#[cfg(test)]" {
            if lines
                .get(i + 1)
                .is_some_and(|l| l.trim_end().ends_with(';'))
            {
                i += 2;
                continue;
            }
            break;
        }
        out.push((i + 1, lines[i].split("//").next().unwrap_or("").to_owned()));
        i += 1;
    }
    out
}

/// `module`'s file, from the package's root.
fn file(module: &str) -> String {
    let rel = format!("src/{}", module.replace("::", "/"));
    let flat = format!("{rel}.rs");
    if Path::new(env!("CARGO_MANIFEST_DIR")).join(&flat).exists() {
        flat
    } else {
        format!("{rel}/mod.rs")
    }
}

/// The modules a line names under `crate::` (a braced list after a module
/// path names each of its members under that path); a visibility
/// (`pub(in crate::engine)`) names nothing.
fn named(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = line.to_owned();
    while let Some(i) = line.find("pub(in crate::") {
        let end = line[i..].find(')').map_or(line.len(), |e| i + e + 1);
        line.replace_range(i..end, "pub");
    }
    let mut rest = line.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let path = path.trim_end_matches(':');
        let after = &rest[path.len()..];
        if let Some(group) = after.strip_prefix("::{") {
            let group = group.split('}').next().unwrap_or("");
            for member in group.split(',') {
                let member = member.trim().split("::").next().unwrap_or("");
                if !member.is_empty() {
                    out.push(format!("{path}::{member}"));
                }
            }
        } else {
            out.push(path.to_owned());
        }
    }
    out
}

/// Whether `path` (under `crate::`) lies in a pure module: a pure module
/// itself, or an item of one. Items of the engine module itself are not
/// pure (its glob of transports and the agent's state).
fn is_pure(path: &str) -> bool {
    PURE.iter().any(|p| {
        path == *p
            || path
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with("::"))
    })
}

#[test]
fn pure_modules_import_only_pure_modules() {
    let mut wrong = Vec::new();
    for m in PURE {
        let src = source(m);
        assert!(
            src.iter()
                .any(|(_, l)| l.contains("#![forbid(unsafe_code)]")),
            "{m} does not forbid unsafe code"
        );
        for (n, line) in &src {
            for path in named(line) {
                if !is_pure(&path) {
                    wrong.push(format!("{}:{n}: crate::{path}", file(m)));
                }
            }
            if line.contains("super::") {
                wrong.push(format!("{}:{n}: super::", file(m)));
            }
            for io in IO {
                if line.contains(io) {
                    wrong.push(format!("{}:{n}: {io}", file(m)));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "pure modules naming what is not pure:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_checker_sees_what_it_must() {
    // The line forms the sources use, and what they name.
    assert_eq!(
        named("use crate::memory::MemoryType;"),
        ["memory::MemoryType"]
    );
    assert_eq!(
        named("use crate::engine::{shm::frames, rdma::Wr};"),
        ["engine::shm", "engine::rdma"]
    );
    assert_eq!(
        named("    let n = crate::status::DRIVE_MAX_BYTES + crate::proto::MAC_LEN;"),
        ["status::DRIVE_MAX_BYTES", "proto::MAC_LEN"]
    );
    assert!(named("pub(in crate::engine) fn small() {}").is_empty());
    assert!(is_pure("engine::wire::Frame") && is_pure("proto"));
    assert!(!is_pure("engine::rdma") && !is_pure("engine") && !is_pure("agent::TransferAgent"));
    assert!(!is_pure("engine::wire_extra") && is_pure("error::Error"));
}

/// The engine's transports, each a module of its own (a folder, or a file
/// for the small ones).
const TRANSPORTS: &[&str] = &["shm", "rdma", "fabric", "inproc", "tcp", "storage"];

/// The engine's files that are not a transport's, nor the registry, nor
/// its unit tests: its core.
fn engine_core() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let m = name.strip_suffix(".rs")?.to_owned();
            let skip = TRANSPORTS.contains(&m.as_str()) || m == "transports" || m == "tests";
            (!skip).then_some(m)
        })
        .collect();
    out.sort();
    out
}

/// The transports `line` names: `crate::engine::<t>`, `super::<t>`, or
/// (in the engine's own `mod.rs`) `<t>::` at the start of a path; a
/// `mod <t>;` declaration names nothing.
fn transports_named(line: &str) -> Vec<&'static str> {
    let t = line.trim_start();
    if t.starts_with("mod ")
        || t.starts_with("pub(crate) mod ")
        || t.starts_with("pub(in") && t.contains(" mod ")
    {
        return Vec::new();
    }
    let mut out = Vec::new();
    for path in named(line) {
        if let Some(rest) = path.strip_prefix("engine::") {
            let first = rest.split("::").next().unwrap_or("");
            if let Some(&t) = TRANSPORTS.iter().find(|&&t| t == first) {
                out.push(t);
            }
        }
    }
    for &tr in TRANSPORTS {
        let pat = format!("{tr}::");
        let mut at = 0;
        while let Some(i) = line[at..].find(&pat) {
            let i = at + i;
            let before = line[..i].chars().next_back();
            let starts = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':'))
                || line[..i].ends_with("super::");
            if starts && !out.contains(&tr) {
                out.push(tr);
            }
            at = i + pat.len();
        }
    }
    out
}

#[test]
fn the_engine_core_names_no_transport_and_no_transport_another() {
    let mut wrong = Vec::new();
    for m in engine_core() {
        let module = if m == "mod" {
            "engine".to_owned()
        } else {
            format!("engine::{m}")
        };
        for (n, line) in source(&module) {
            for t in transports_named(&line) {
                wrong.push(format!(
                    "{}:{n}: the core names transport {t}",
                    file(&module)
                ));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    for &t in TRANSPORTS {
        let mut files = Vec::new();
        let dir = root.join(t);
        if dir.is_dir() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let name = e.unwrap().file_name().into_string().unwrap();
                if let Some(m) = name.strip_suffix(".rs") {
                    files.push(if m == "mod" {
                        format!("engine::{t}")
                    } else {
                        format!("engine::{t}::{m}")
                    });
                }
            }
        } else {
            files.push(format!("engine::{t}"));
        }
        for module in files {
            for (n, line) in source(&module) {
                for other in transports_named(&line).into_iter().filter(|&o| o != t) {
                    wrong.push(format!(
                        "{}:{n}: transport {t} names transport {other}",
                        file(&module)
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the engine's floors crossed:\n{}",
        wrong.join("\n")
    );
}

/// The modules of every transport (its file, or each file of its folder).
fn transport_modules() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut out = Vec::new();
    for &t in TRANSPORTS {
        if root.join(t).is_dir() {
            out.extend(unit_modules(t));
        } else {
            out.push(format!("engine::{t}"));
        }
    }
    out
}

/// What in `line` reaches past a transport's context to the agent's whole
/// state: the state's type (`Inner`), the engine itself, or the context's
/// way back to the state (`state()`, the core's).
fn reaches_the_state(line: &str) -> Vec<&'static str> {
    let word = |w: &str| {
        line.match_indices(w).any(|(i, _)| {
            let before = line[..i].chars().next_back();
            let after = line[i + w.len()..].chars().next();
            let edge = |c: Option<char>| c.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            edge(before) && edge(after)
        })
    };
    let mut out = Vec::new();
    for w in ["Inner", "Engine"] {
        if word(w) {
            out.push(w);
        }
    }
    if line.contains(".state()") {
        out.push(".state()");
    }
    out
}

#[test]
fn transports_reach_their_agent_through_their_context_only() {
    let mut wrong = Vec::new();
    for module in transport_modules() {
        for (n, line) in source(&module) {
            for what in reaches_the_state(&line) {
                wrong.push(format!("{}:{n}: {what}", file(&module)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "transports reaching past their context (engine::ctx::Ctx):\n{}",
        wrong.join("\n")
    );
    // The checker itself.
    assert_eq!(reaches_the_state("fn f(inner: &Inner) {"), ["Inner"]);
    assert_eq!(reaches_the_state("let x = cx.state().peers;"), [".state()"]);
    assert_eq!(
        reaches_the_state("use crate::engine::{Engine, Peer};"),
        ["Engine"]
    );
    assert!(reaches_the_state("let r = cx.registry(); InnerLoop; EngineKind").is_empty());
    assert!(transport_modules().contains(&"engine::shm::pool".to_owned()));
}

#[test]
fn the_floor_checker_sees_what_it_must() {
    assert_eq!(transports_named("use crate::engine::shm::Shm;"), ["shm"]);
    assert_eq!(
        transports_named("use crate::engine::{Inner, inproc, rdma};"),
        ["inproc", "rdma"]
    );
    assert_eq!(
        transports_named("        let s = shm::Shm::open(a);"),
        ["shm"]
    );
    assert_eq!(
        transports_named("    x.rdma.ack_timeout; cross_memory::copy()"),
        Vec::<&str>::new()
    );
    assert!(
        transports_named("mod shm;").is_empty()
            && transports_named("pub(crate) mod shm;").is_empty()
    );
    assert!(
        engine_core().contains(&"submit".to_owned()) && !engine_core().contains(&"tcp".to_owned())
    );
}

/// The engine's parts: each file and folder under `src/engine/` but the
/// root (`mod.rs`, which declares them all and holds the agent's state
/// that every part uses) and the unit tests.
fn engine_units() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let m = if e.path().is_dir() {
                name
            } else {
                name.strip_suffix(".rs")?.to_owned()
            };
            (m != "mod" && m != "tests").then_some(m)
        })
        .collect();
    out.sort();
    out
}

/// The modules of part `unit`: its file, or every file of its folder
/// (nested folders included).
fn unit_modules(unit: &str) -> Vec<String> {
    fn walk(dir: &Path, module: &str, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            if e.path().is_dir() {
                walk(&e.path(), &format!("{module}::{name}"), out);
            } else if let Some(m) = name.strip_suffix(".rs") {
                out.push(if m == "mod" {
                    module.to_owned()
                } else {
                    format!("{module}::{m}")
                });
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut out = Vec::new();
    if root.join(unit).is_dir() {
        walk(&root.join(unit), &format!("engine::{unit}"), &mut out);
    } else {
        out.push(format!("engine::{unit}"));
    }
    out.sort();
    out
}

/// The parts `line` names (as `crate::engine::<part>`), of `units`.
fn units_named<'a>(line: &str, units: &'a [String]) -> Vec<&'a str> {
    let mut out = Vec::new();
    for path in named(line) {
        if let Some(rest) = path.strip_prefix("engine::") {
            let first = rest.split("::").next().unwrap_or("");
            if let Some(u) = units.iter().find(|u| *u == first)
                && !out.contains(&u.as_str())
            {
                out.push(u.as_str());
            }
        }
    }
    out
}

/// A cycle in `edges` (part → the parts it names), as the parts on it.
fn find_cycle(units: &[String], edges: &[(usize, usize)]) -> Option<Vec<String>> {
    // Depth-first search, colouring: 0 unseen, 1 on the path, 2 done.
    fn visit(
        v: usize,
        edges: &[(usize, usize)],
        colour: &mut [u8],
        path: &mut Vec<usize>,
    ) -> Option<Vec<usize>> {
        colour[v] = 1;
        path.push(v);
        for &(_, w) in edges.iter().filter(|(a, _)| *a == v) {
            if colour[w] == 1 {
                let at = path.iter().position(|&p| p == w).unwrap();
                return Some(path[at..].to_vec());
            }
            if colour[w] == 0
                && let Some(c) = visit(w, edges, colour, path)
            {
                return Some(c);
            }
        }
        path.pop();
        colour[v] = 2;
        None
    }
    let mut colour = vec![0u8; units.len()];
    for v in 0..units.len() {
        if colour[v] == 0 {
            let mut path = Vec::new();
            if let Some(c) = visit(v, edges, &mut colour, &mut path) {
                return Some(c.into_iter().map(|i| units[i].clone()).collect());
            }
        }
    }
    None
}

#[test]
fn the_engine_parts_import_each_other_without_a_cycle() {
    let units = engine_units();
    let mut edges = Vec::new();
    let mut why = Vec::new();
    for (a, unit) in units.iter().enumerate() {
        for module in unit_modules(unit) {
            for (n, line) in source(&module) {
                // Within a folder `super::` names the folder; a flat file
                // names the other parts by `crate::engine::` (so it must).
                if !module.contains(&format!("{unit}::")) && line.contains("super::") {
                    panic!("{}:{n}: `super::` in a flat engine file", file(&module));
                }
                for named in units_named(&line, &units) {
                    let b = units.iter().position(|u| u == named).unwrap();
                    if a != b && !edges.contains(&(a, b)) {
                        edges.push((a, b));
                        why.push(format!("{}:{n}: {unit} -> {named}", file(&module)));
                    }
                }
            }
        }
    }
    if let Some(cycle) = find_cycle(&units, &edges) {
        let lines: Vec<&String> =
            why.iter()
                .filter(|w| {
                    cycle.iter().enumerate().any(|(i, u)| {
                        w.ends_with(&format!(" {u} -> {}", cycle[(i + 1) % cycle.len()]))
                    })
                })
                .collect();
        panic!(
            "the engine's parts import each other in a cycle: {}\n{}",
            cycle.join(" -> "),
            lines
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

#[test]
fn the_cycle_finder_sees_what_it_must() {
    let units: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    assert_eq!(find_cycle(&units, &[(0, 1), (1, 2)]), None);
    assert_eq!(
        find_cycle(&units, &[(0, 1), (1, 2), (2, 1)]),
        Some(vec!["b".to_owned(), "c".to_owned()])
    );
    assert_eq!(
        units_named(
            "use crate::engine::{Inner, target::attach, sock};",
            &units_of(&["target", "sock"])
        ),
        ["target", "sock"]
    );
    assert!(
        engine_units().contains(&"target".to_owned())
            && !engine_units().contains(&"mod".to_owned())
    );
    assert!(unit_modules("target").contains(&"engine::target::payload".to_owned()));
}

fn units_of(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}
