//! Bindings of the system libfabric (Debian's libfabric-dev): bindgen over
//! its headers, and its static inline functions (fi_domain, fi_write, ...)
//! wrapped in C by bindgen and compiled with cc.

use std::env;
use std::path::PathBuf;

fn main() {
    let lib = pkg_config::Config::new()
        .atleast_version("1.11")
        .probe("libfabric")
        .expect("libfabric-dev (pkg-config libfabric)");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let wrap = out.join("fabric_static");
    let mut b = bindgen::Builder::default()
        .header("src/fabric.h")
        .allowlist_function("fi_.*")
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
