//! Raw libfabric bindings (see build.rs), with libfabric loaded at run
//! time: [`load`] opens `libfabric.so.1` (or the file that
//! `KVXFER_LIBFABRIC` names, such as the EFA installer's
//! `/opt/amazon/efa/lib/libfabric.so.1`) once per process and resolves the
//! few functions libfabric exports that are called here ([`fi_getinfo`],
//! [`fi_freeinfo`], [`fi_dupinfo`], [`fi_fabric`], [`fi_strerror`],
//! [`fi_version`]); every other call goes through the objects' operation
//! tables (libfabric's inline functions, compiled in C). A program built
//! with this crate starts without libfabric installed; [`load`] then says
//! why it cannot be used.

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod raw {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}
pub use raw::*;

use std::ffi::{OsString, c_char, c_int, c_void};
use std::sync::OnceLock;

/// The file [`load`] opens unless `KVXFER_LIBFABRIC` names another.
pub const DEFAULT_LIBRARY: &str = "libfabric.so.1";

/// libfabric, loaded, and the functions resolved from it.
struct Lib {
    getinfo: unsafe extern "C" fn(
        u32,
        *const c_char,
        *const c_char,
        u64,
        *const fi_info,
        *mut *mut fi_info,
    ) -> c_int,
    freeinfo: unsafe extern "C" fn(*mut fi_info),
    dupinfo: unsafe extern "C" fn(*const fi_info) -> *mut fi_info,
    fabric: unsafe extern "C" fn(*mut fi_fabric_attr, *mut *mut fid_fabric, *mut c_void) -> c_int,
    strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    version: unsafe extern "C" fn() -> u32,
    /// Open for the rest of the process (in a static, never dropped): the
    /// objects opened through it point into its code.
    _lib: libloading::Library,
}

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

/// Loads libfabric (once per process; later calls return the first
/// outcome): `Err` says which file could not be loaded, or which function
/// it lacks. Every other function of this crate may be called only after
/// it returned `Ok`.
pub fn load() -> Result<(), String> {
    match LIB.get_or_init(open) {
        Ok(_) => Ok(()),
        Err(e) => Err(e.clone()),
    }
}

fn open() -> Result<Lib, String> {
    let name: OsString =
        std::env::var_os("KVXFER_LIBFABRIC").unwrap_or_else(|| DEFAULT_LIBRARY.into());
    let shown = name.to_string_lossy().into_owned();
    // SAFETY: loading libfabric runs its initialisers, which set up its own
    // state only (its providers are found and initialised later, by
    // fi_getinfo).
    let lib = unsafe { libloading::Library::new(&name) }
        .map_err(|e| format!("cannot load libfabric ({shown}): {}", with_cause(&e)))?;
    /// The function `name` of `lib`, as a `T`.
    ///
    /// # Safety
    /// `T` is the function's type.
    unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str, file: &str) -> Result<T, String> {
        // SAFETY: by the caller, `T` is the symbol's type.
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{file} lacks {name}: {}", with_cause(&e)))
    }
    // SAFETY: each type is the function's prototype in rdma/fabric.h and
    // rdma/fi_errno.h.
    unsafe {
        Ok(Lib {
            getinfo: sym(&lib, "fi_getinfo", &shown)?,
            freeinfo: sym(&lib, "fi_freeinfo", &shown)?,
            dupinfo: sym(&lib, "fi_dupinfo", &shown)?,
            fabric: sym(&lib, "fi_fabric", &shown)?,
            strerror: sym(&lib, "fi_strerror", &shown)?,
            version: sym(&lib, "fi_version", &shown)?,
            _lib: lib,
        })
    }
}

/// `e` and its causes (libloading's own text is "dlopen failed"; the
/// loader's reason is its source).
fn with_cause(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

/// The library, loaded.
fn lib() -> &'static Lib {
    match LIB.get() {
        Some(Ok(l)) => l,
        _ => panic!("libfabric called before kvxfer_fabric::load succeeded"),
    }
}

/// `fi_getinfo`.
///
/// # Safety
/// As libfabric's; [`load`] has succeeded.
pub unsafe fn fi_getinfo(
    version: u32,
    node: *const c_char,
    service: *const c_char,
    flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> c_int {
    // SAFETY: by the caller.
    unsafe { (lib().getinfo)(version, node, service, flags, hints, info) }
}

/// `fi_freeinfo`.
///
/// # Safety
/// As libfabric's; [`load`] has succeeded.
pub unsafe fn fi_freeinfo(info: *mut fi_info) {
    // SAFETY: by the caller.
    unsafe { (lib().freeinfo)(info) }
}

/// `fi_dupinfo`.
///
/// # Safety
/// As libfabric's; [`load`] has succeeded.
pub unsafe fn fi_dupinfo(info: *const fi_info) -> *mut fi_info {
    // SAFETY: by the caller.
    unsafe { (lib().dupinfo)(info) }
}

/// `fi_fabric`.
///
/// # Safety
/// As libfabric's; [`load`] has succeeded.
pub unsafe fn fi_fabric(
    attr: *mut fi_fabric_attr,
    fabric: *mut *mut fid_fabric,
    context: *mut c_void,
) -> c_int {
    // SAFETY: by the caller.
    unsafe { (lib().fabric)(attr, fabric, context) }
}

/// `fi_strerror`.
///
/// # Safety
/// As libfabric's; [`load`] has succeeded.
pub unsafe fn fi_strerror(errnum: c_int) -> *const c_char {
    // SAFETY: by the caller.
    unsafe { (lib().strerror)(errnum) }
}

/// `fi_version`: the version of the libfabric loaded.
///
/// # Safety
/// [`load`] has succeeded.
pub unsafe fn fi_version() -> u32 {
    // SAFETY: by the caller.
    unsafe { (lib().version)() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getinfo_finds_an_rdm_provider_with_rma() {
        load().expect("libfabric1 is installed here");
        // SAFETY: plain libfabric calls on memory it allocates, after load.
        unsafe {
            let hints = fi_dupinfo(std::ptr::null());
            (*(*hints).ep_attr).type_ = fi_ep_type_FI_EP_RDM;
            (*hints).caps = (FI_RMA | FI_WRITE | FI_READ | FI_REMOTE_WRITE | FI_REMOTE_READ) as u64;
            let mut info = std::ptr::null_mut();
            let r = fi_getinfo(
                fi_version(),
                std::ptr::null(),
                std::ptr::null(),
                0,
                hints,
                &mut info,
            );
            assert_eq!(r, 0, "fi_getinfo");
            assert!(!info.is_null());
            fi_freeinfo(info);
            fi_freeinfo(hints);
        }
    }

    #[test]
    fn a_missing_library_is_named_and_never_retried_into_a_crash() {
        // In a child process: the outcome of `load` is the process's.
        if std::env::var_os("KVXFER_FABRIC_CHILD").is_some() {
            let e = load().unwrap_err();
            assert!(e.contains("/nonexistent/libfabric.so.1"), "{e}");
            assert_eq!(load().unwrap_err(), e);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::a_missing_library_is_named_and_never_retried_into_a_crash",
            ])
            .env("KVXFER_FABRIC_CHILD", "1")
            .env("KVXFER_LIBFABRIC", "/nonexistent/libfabric.so.1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    }
}
