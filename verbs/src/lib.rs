//! Verbs layer: the one crate of kvxfer that talks to `sideway` (RDMA verbs). Device
//! selection, protection domain, memory regions, reliable-connected queue
//! pairs and completion polling, with one typed error per verb.
//!
//! The agent's RDMA path (`engine/rdma/`) is built on it. Hosts without an RDMA-capable kernel get
//! [`VerbsError::NoDevice`] from [`Device::open`], never a crash: the verbs
//! library is loaded at run time.
//!
//! # Resource cleanup
//! Every resource holds an `Arc` to its parents (sideway's design), so a
//! protection domain outlives its memory regions and queue pairs, and a
//! device context outlives all of them. Within [`RcQueuePair`] the queue
//! pair is declared before its completion queues, so it is destroyed first.

use std::io;
use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::completion::{
    CompletionChannel, CompletionQueue, GenericCompletionQueue, PollCompletionQueueError,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SendOperationFlags, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

/// Errors of the verbs layer: one variant per verb, with the OS error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No usable RDMA device: the kernel has no RDMA support, no device
    /// exists, or none has an active port.
    #[error("no usable RDMA device: {0}")]
    NoDevice(String),
    /// The operation is not supported by this device or provider.
    #[error("{what} is not supported by this RDMA device")]
    Unsupported {
        /// The operation.
        what: &'static str,
    },
    /// A verb failed.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The verb (`ibv_reg_mr`, `ibv_modify_qp(RTR)`, ...).
        verb: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A work request completed with an error status.
    #[error(
        "work request {wr_id} completed with {status_name} (status {status}, vendor error {vendor_err:#x})"
    )]
    WorkCompletion {
        /// The request's id.
        wr_id: u64,
        /// `ibv_wc_status` value.
        status: u32,
        /// Its name (`IBV_WC_REM_ACCESS_ERR`, ...).
        status_name: &'static str,
        /// Vendor error code.
        vendor_err: u32,
    },
}

pub(crate) fn verb(verb: &'static str) -> impl FnOnce(io::Error) -> VerbsError {
    move |source| {
        if source.raw_os_error() == Some(libc::EOPNOTSUPP) {
            VerbsError::Unsupported { what: verb }
        } else {
            VerbsError::Verb { verb, source }
        }
    }
}

pub(crate) fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// The name of an `ibv_wc_status` value.
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_UNKNOWN")
}

/// Names of the RDMA devices present (empty, or `NoDevice`, without RDMA).
///
/// # Errors
/// [`VerbsError::NoDevice`] when the device list cannot be read (no kernel
/// support: ENOSYS).
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let list =
        DeviceList::new().map_err(|e| VerbsError::NoDevice(format!("ibv_get_device_list: {e}")))?;
    Ok(list.iter().map(|d| d.name()).collect())
}

mod completion;
mod device;
mod post;
mod queue_pair;
mod srq;

use completion::*;
pub use completion::{CqEvents, CqPoller, WorkCompletion};
use device::*;
pub use device::{Device, QpInfo, Registered};
pub use post::SharedPoster;
use post::*;
use queue_pair::*;
pub use queue_pair::{DEFAULT_ACK_TIMEOUT, MAX_INLINE, Post, PostOp, RcQueuePair, Sge};
pub use srq::{SharedReceiveQueue, SrqQueuePair};
