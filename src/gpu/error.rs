//! Why GPU memory could not be registered or moved: the agent layer's
//! error names it, so it lives apart from the driver.

#![forbid(unsafe_code)]

/// Why GPU memory could not be registered or moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA driver: the library is absent, or it failed to
    /// initialise, or kvxfer was built without the `cuda` feature.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The range does not start in device memory (host memory, pinned host
    /// memory, or an address the driver does not know).
    #[error("{addr:#x} is not GPU device memory ({detail})")]
    NotDeviceMemory {
        /// The start of the range.
        addr: u64,
        /// What the driver said.
        detail: String,
    },
    /// The range is on another GPU than its descriptor's `device_id`.
    #[error(
        "GPU range {addr:#x}+{len} is on device {actual}, but its descriptor names device {claimed}"
    )]
    WrongDevice {
        /// The start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// The descriptor's `device_id`.
        claimed: u32,
        /// The device the driver reports.
        actual: u32,
    },
    /// The range runs past the end of the allocation it starts in.
    #[error("GPU range {addr:#x}+{len} runs past the end of its allocation {base:#x}+{size}")]
    PastAllocation {
        /// The start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// The allocation's base address.
        base: u64,
        /// The allocation's size.
        size: u64,
    },
    /// Neither GPUDirect RDMA registration worked: the dma-buf export and
    /// `ibv_reg_dmabuf_mr`, then the device pointer given to `ibv_reg_mr`
    /// (the peer-memory module).
    #[error(
        "GPU memory could not be registered with RDMA device {nic}: by dma-buf: {dmabuf}; by peer memory: {peermem}"
    )]
    RdmaRegistration {
        /// The RDMA device.
        nic: String,
        /// Why the dma-buf registration failed.
        dmabuf: String,
        /// Why the peer-memory registration failed.
        peermem: String,
    },
    /// A driver call failed.
    #[error("CUDA {call} failed: {name} ({code})")]
    Driver {
        /// The driver entry point.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
        /// The result's name (`cuGetErrorName`).
        name: String,
    },
}
