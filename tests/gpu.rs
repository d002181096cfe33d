//! The VRAM suite against the real CUDA driver. Without one (no
//! `libcuda.so`, as on CI), each test prints a SKIPPED line and the one
//! test that needs no driver checks that registering VRAM then fails
//! typed; the same suite runs on every host against a stand-in driver in
//! `tests/gpu_fake.rs`, and for real on a GPU machine (`ci/gpu-check.sh`).

#[path = "gpu/suite.rs"]
#[macro_use]
mod suite;

use kvxfer::gpu::{self, GpuError};
use kvxfer::{Backend, Error, MemoryDesc, MemoryDescs, MemoryType};

/// Whether a driver is here (else prints SKIPPED for `test`).
fn ready(test: &str) -> bool {
    match gpu::probe() {
        Ok(p) if !p.devices.is_empty() => true,
        Ok(_) => {
            println!("SKIPPED {test}: the CUDA driver sees no device");
            false
        }
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            false
        }
    }
}

gpu_suite!(ready);

#[test]
fn without_a_driver_vram_registration_fails_typed() {
    if gpu::probe().is_ok() {
        println!(
            "SKIPPED without_a_driver_vram_registration_fails_typed: a CUDA driver is present \
             (the case runs on hosts without one, CI included)"
        );
        return;
    }
    let a = suite::agent(Backend::InProcess, "a");
    let d = MemoryDescs::new(
        MemoryType::Vram,
        vec![MemoryDesc::new(0x7000_0000, 4096, 0)],
    );
    // SAFETY: refused, so nothing is registered.
    let e = unsafe { a.register_memory(&d) }.unwrap_err();
    assert!(matches!(e, Error::Gpu(GpuError::NoDriver(_))), "{e:?}");
    assert!(matches!(
        gpu::DeviceBuffer::new(0, 1),
        Err(GpuError::NoDriver(_))
    ));
}

/// The probe's findings, for the GPU check's summary.
#[test]
fn probe_prints_what_the_driver_offers() {
    match gpu::probe() {
        Ok(p) => println!("GPU-PROBE {p:?}"),
        Err(e) => println!("SKIPPED probe_prints_what_the_driver_offers: {e}"),
    }
}
