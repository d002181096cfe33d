//! Bindings of the system libfabric (Debian's libfabric-dev): bindgen over
//! its headers, and its static inline functions (fi_domain, fi_write, ...)
//! wrapped in C by bindgen and compiled with cc. Nothing links libfabric:
//! the few functions it exports that are called (`EXPORTED`) are resolved
//! at run time (src/lib.rs), so a program built with this crate runs
//! without libfabric installed.

use std::env;
use std::path::PathBuf;

/// The functions of libfabric's own (not inline) that src/lib.rs resolves
/// at run time.
const EXPORTED: [&str; 6] = [
    "fi_getinfo",
    "fi_freeinfo",
    "fi_dupinfo",
    "fi_fabric",
    "fi_strerror",
    "fi_version",
];

fn main() {
    // Its headers only: no link directives.
    let lib = pkg_config::Config::new()
        .atleast_version("1.11")
        .cargo_metadata(false)
        .probe("libfabric")
        .expect("libfabric-dev (pkg-config libfabric)");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let wrap = out.join("fabric_static");
    let mut b = bindgen::Builder::default()
        .header("src/fabric.h")
        .allowlist_function("fi_.*")
        .blocklist_function(EXPORTED.join("|"))
        // Inline, but calls fi_dupinfo: not wrapped (use fi_dupinfo(NULL)).
        .blocklist_function("fi_allocinfo")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrap)
        .derive_default(true)
        .layout_tests(false);
    for p in &lib.include_paths {
        b = b.clang_arg(format!("-I{}", p.display()));
    }
    b.generate()
        .expect("bindgen over libfabric")
        .write_to_file(out.join("bindings.rs"))
        .unwrap();
    let mut c = cc::Build::new();
    c.file(wrap.with_extension("c"))
        .include(env::var("CARGO_MANIFEST_DIR").unwrap())
        .warnings(false);
    for p in &lib.include_paths {
        c.include(p);
    }
    c.compile("kvxfer_fabric_static");
    println!("cargo:rerun-if-changed=src/fabric.h");
}
