//! Compiles the C and C++ programs under `tests/c/`, `tests/cpp/` and
//! `examples/` with the system gcc/g++ against `include/` and the built
//! `libkvxfer.so`, runs them, and runs the C test once more under valgrind.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

// The etcd harness of the library's tests (some of it unused here).
#[allow(dead_code)]
#[path = "../../tests/common/etcd.rs"]
mod etcd;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding `libkvxfer.so` for this build profile.
///
/// `cargo test` builds only what the test binaries link, and nothing links
/// the cdylib, so the first caller runs `cargo build --workspace
/// --all-targets` for the test's own profile: the programs are always
/// compiled against the library of the current sources, never a stale one.
/// The whole workspace and every target, because that is what `cargo test
/// --workspace --all-targets` (the test command) resolves features for: the
/// library and its dependencies are then the ones the tests already built,
/// and only the cdylib is new (`-p kvxfer-capi` alone resolves other
/// features and rebuilds the library, a minute and more).
fn lib_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            // The test binary is target/<profile>/deps/c_programs-<hash>.
            let exe = std::env::current_exe().unwrap();
            let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
            let target = dir.parent().unwrap();
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(["build", "--quiet", "--workspace", "--all-targets"])
                .arg("--target-dir")
                .arg(target)
                .current_dir(manifest());
            if dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo build --workspace");
            assert!(
                status.success(),
                "cargo build --workspace --all-targets failed"
            );
            assert!(
                dir.join("libkvxfer.so").exists(),
                "libkvxfer.so not found in {} after building kvxfer-capi",
                dir.display()
            );
            dir
        })
        .clone()
}

fn out_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-tests");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn compile(compiler: &str, std: &str, source: &Path, out: &Path) {
    let lib = lib_dir();
    let status = Command::new(compiler)
        .args([std, "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .arg("-I")
        .arg(manifest().join("include"))
        .arg(source)
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lkvxfer", "-lpthread", "-ldl", "-lm"])
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run {compiler}: {e} (ci/install-deps.sh test installs it)")
        });
    assert!(
        status.success(),
        "{compiler} failed on {}",
        source.display()
    );
}

fn run(program: &Path, wrapper: &[&str]) -> String {
    run_env(program, wrapper, &[])
}

fn run_env(program: &Path, wrapper: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = match wrapper.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    };
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{stderr}",
        program.display(),
        out.status
    );
    stdout + &stderr
}

/// Valgrind as the C tests run under it: any error or leak fails.
const VALGRIND: &[&str] = &[
    "valgrind",
    "--error-exitcode=99",
    "--leak-check=full",
    "--errors-for-leak-kinds=definite,indirect",
    "--show-leak-kinds=definite,indirect",
    "--quiet",
];

/// Compiles `tests/c/<name>.c` as `<exe>` and runs it (under `wrapper`),
/// which must report its checks passed.
fn c_program(name: &str, exe: &str, wrapper: &[&str]) {
    if wrapper.first() == Some(&"valgrind")
        && Command::new("valgrind").arg("--version").output().is_err()
    {
        panic!("valgrind is required (ci/install-deps.sh test installs it)");
    }
    let exe = out_dir().join(exe);
    compile(
        "gcc",
        "-std=c11",
        &manifest().join(format!("tests/c/{name}.c")),
        &exe,
    );
    let out = run(&exe, wrapper);
    assert!(out.contains("checks passed"), "{out}");
}

#[test]
fn c_agent_test() {
    c_program("agent_test", "agent_test", &[]);
}

/// The C library's libfabric transport (loaded at run time), on
/// `tcp;ofi_rxm`.
#[test]
fn c_fabric_test() {
    let exe = out_dir().join("fabric_test");
    compile(
        "gcc",
        "-std=c11",
        &manifest().join("tests/c/fabric_test.c"),
        &exe,
    );
    let out = run_env(&exe, &[], &[("KVXFER_FABRIC_PROVIDER", "tcp;ofi_rxm")]);
    assert!(out.contains("checks passed"), "{out}");
}

#[test]
fn c_agent_test_under_valgrind() {
    c_program("agent_test", "agent_test_vg", VALGRIND);
}

/// Shared pools through the C ABI.
#[test]
fn c_pool_test() {
    c_program("pool_test", "pool_test", &[]);
}

#[test]
fn c_storage_test() {
    c_program("storage_test", "storage_test", &[]);
}

/// Objects through the C ABI, against the S3 server `ci/test.sh` starts
/// (`KVXFER_S3_ENDPOINT`; SKIPPED without one): the harness makes the
/// bucket, the program writes, reads and fails as it should.
#[test]
fn c_obj_test() {
    let Ok(endpoint) = std::env::var("KVXFER_S3_ENDPOINT") else {
        println!(
            "SKIPPED c_obj_test: no S3 server (KVXFER_S3_ENDPOINT unset; ci/test.sh starts one)"
        );
        return;
    };
    let bucket = format!("kvxfer-c-{}", std::process::id());
    let mut c = kvxfer_core::storage::obj::ObjectStoreConfig::from_env(bucket.as_str()).unwrap();
    c.endpoint = endpoint;
    c.build().unwrap().create_bucket().unwrap();
    let exe = out_dir().join("obj_test");
    compile(
        "gcc",
        "-std=c11",
        &manifest().join("tests/c/obj_test.c"),
        &exe,
    );
    let out = run_env(&exe, &[], &[("KVXFER_S3_BUCKET", &bucket)]);
    assert!(out.contains("checks passed"), "{out}");
}

/// The etcd-backed metadata store through the C ABI, against an etcd of
/// the test's own.
#[test]
fn c_etcd_test() {
    let etcd = match etcd::Etcd::start(1) {
        Ok(e) => e,
        Err(why) => {
            println!("SKIPPED c_etcd_test: {why}");
            return;
        }
    };
    let exe = out_dir().join("etcd_test");
    compile(
        "gcc",
        "-std=c11",
        &manifest().join("tests/c/etcd_test.c"),
        &exe,
    );
    let endpoint = etcd.endpoints().join(",");
    let out = run_env(&exe, &[], &[("KVXFER_TEST_ETCD", &endpoint)]);
    assert!(out.contains("checks passed"), "{out}");
}

/// GPU memory through the C ABI, against the stand-in CUDA driver of
/// `tests/gpu/fakecuda.c` (preloaded: its device memory faults when the
/// host touches it).
#[test]
fn c_gpu_test() {
    let dir = out_dir();
    let fake = dir.join("libcuda-fake.so");
    let status = Command::new("gcc")
        .args([
            "-O2",
            "-shared",
            "-fPIC",
            "-pthread",
            "-Wl,-soname,libcuda.so",
            "-o",
        ])
        .arg(&fake)
        .arg(manifest().join("../tests/gpu/fakecuda.c"))
        .status()
        .expect("gcc runs (ci/install-deps.sh installs it)");
    assert!(status.success(), "building the stand-in CUDA driver failed");
    let exe = dir.join("gpu_test");
    compile(
        "gcc",
        "-std=c11",
        &manifest().join("tests/c/gpu_test.c"),
        &exe,
    );
    let out = run_env(&exe, &[], &[("LD_PRELOAD", fake.to_str().unwrap())]);
    assert!(out.contains("checks passed"), "{out}");
}

#[test]
fn c_cache_test() {
    c_program("cache_test", "cache_test", &[]);
}

#[test]
fn c_cache_test_under_valgrind() {
    c_program("cache_test", "cache_test_vg", VALGRIND);
}

#[test]
fn cpp_adapter_transfer_agent_test() {
    let exe = out_dir().join("transfer_agent_test");
    compile(
        "g++",
        "-std=c++17",
        &manifest().join("tests/cpp/transfer_agent_test.cpp"),
        &exe,
    );
    let out = run(&exe, &[]);
    assert!(out.contains("5 passed, 0 failed"), "{out}");
}

#[test]
fn documented_c_example_compiles_and_runs() {
    let exe = out_dir().join("example");
    compile(
        "gcc",
        "-std=c11",
        &manifest().join("examples/example.c"),
        &exe,
    );
    let out = run(&exe, &[]);
    assert!(out.contains("received"), "{out}");
}

#[test]
fn headers_compile_twice_in_c_and_cpp() {
    let dir = out_dir();
    let c = dir.join("twice.c");
    std::fs::write(&c, "#include <kvxfer.h>\n#include <kvxfer.h>\nint main(void) { return kvxfer_version() == 0; }\n").unwrap();
    compile("gcc", "-std=c99", &c, &dir.join("twice_c"));
    let cpp = dir.join("twice.cpp");
    std::fs::write(
        &cpp,
        "#include <kvxfer/transfer_agent.hpp>\n#include <kvxfer/transfer_agent.hpp>\n#include <kvxfer.h>\nint main() { return kvxfer_version() == nullptr; }\n",
    )
    .unwrap();
    compile("g++", "-std=c++17", &cpp, &dir.join("twice_cpp"));
}
