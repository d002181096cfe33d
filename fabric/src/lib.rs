//! Raw libfabric bindings (see build.rs).
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getinfo_finds_an_rdm_provider_with_rma() {
        // SAFETY: plain libfabric calls on memory it allocates.
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
}
