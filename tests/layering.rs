//! The crate's pure parts — the memory model, the descriptor, the
//! protocol's vocabulary, the checksums, the frame codecs, request bookkeeping and
//! planning, the open-request budget, the agent's and the KV-cache
//! layer's errors, the KV-cache layer's states, mappings, messages and
//! protocol machines — import only each other, forbid
//! `unsafe`, and do no I/O, so that they could move into a crate of their
//! own. Read from the sources: a change that makes one of them import the
//! agent layer, a transport or the OS fails here, naming the line.

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
    "engine::cma_wire",
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
        named("use crate::engine::{cma_wire, rdma::Wr};"),
        ["engine::cma_wire", "engine::rdma"]
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
