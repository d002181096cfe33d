//! The crate's pure parts — the memory model, the descriptor, the
//! protocol's vocabulary, the frame codecs, request bookkeeping and
//! planning, the open-request budget — import only each other, forbid
//! `unsafe`, and do no I/O, so that they could move into a crate of their
//! own. Read from the sources: a change that makes one of them import the
//! agent layer, a transport or the OS fails here, naming the line.

use std::path::Path;

/// The pure modules, as paths under `crate::`.
const PURE: &[&str] = &[
    "memory",
    "desc",
    "proto",
    "small",
    "engine::wire",
    "engine::cma_wire",
    "engine::requests",
    "engine::plan",
    "engine::budget",
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

/// `module`'s source without its unit tests (everything from the first
/// `#[cfg(test)]` on) and without comments.
fn source(module: &str) -> Vec<(usize, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(format!("{}.rs", module.replace("::", "/")));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.lines()
        .enumerate()
        .take_while(|(_, l)| l.trim() != "#[cfg(test)]")
        .map(|(i, l)| (i + 1, l.split("//").next().unwrap_or("").to_owned()))
        .collect()
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
                    wrong.push(format!(
                        "src/{}.rs:{n}: crate::{path}",
                        m.replace("::", "/")
                    ));
                }
            }
            if line.contains("super::") {
                wrong.push(format!("src/{}.rs:{n}: super::", m.replace("::", "/")));
            }
            for io in IO {
                if line.contains(io) {
                    wrong.push(format!("src/{}.rs:{n}: {io}", m.replace("::", "/")));
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
    assert!(!is_pure("engine::rdma") && !is_pure("engine") && !is_pure("error::Error"));
    assert!(!is_pure("engine::wire_extra"));
}
