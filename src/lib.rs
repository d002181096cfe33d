//! # kvxfer
//!
//! Moves LLM KV-cache between serving executors with one-sided transfers
//! straight between registered memory regions: no staging copy, every wait
//! bounded, every failure typed.
//!
//! ```text
//!  initiator agent                                   target agent
//!  ┌─────────────────────────┐                        ┌──────────────────────────┐
//!  │ submit_transfer ──► plan│  data stream(s)        │ serve thread per stream  │
//!  │  (validate, segment)    │ ─────────────────────► │  check range + key       │
//!  │ sender thread: sendmsg  │  hdr|payload|hdr|...   │  readv straight into     │
//!  │  straight from region   │  ...|COMMIT(+sync)     │  the registered region   │
//!  │ reader thread: ACKs,    │ ◄───────────────────── │  all segments done ──►   │
//!  │  READ data into region  │  ACK / READ data       │  deliver sync, then ACK  │
//!  └─────────────────────────┘                        └──────────────────────────┘
//! ```
//!
//! ## Quick start
//! ```
//! use std::time::Duration;
//! use kvxfer::{AgentConfig, Backend, Registration, TransferRequest, make_transfer_agent};
//!
//! let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("gen-0")).unwrap();
//! let initiator = make_transfer_agent(Backend::Tcp, AgentConfig::new("ctx-0")).unwrap();
//! let mut src = vec![7u8; 4096];
//! let mut dst = vec![0u8; 4096];
//! // Registered while the guards live; peers may write them meanwhile.
//! let s = Registration::new(initiator.as_ref(), &mut src).unwrap();
//! let d = Registration::new(target.as_ref(), &mut dst).unwrap();
//! let name = initiator
//!     .load_remote_agent_by_connection(&target.local_connection_info())
//!     .unwrap();
//! let req = TransferRequest::write(s.descs(), d.descs(), name)
//!     .with_sync_message(b"blocks 0..1 ready".to_vec());
//! initiator.submit_transfer(&req).unwrap().wait_success(Duration::from_secs(5)).unwrap();
//! let msgs = target.wait_sync_messages(Duration::from_secs(5));
//! assert_eq!(msgs["ctx-0"], vec![b"blocks 0..1 ready".to_vec()]);
//! drop(d);
//! assert!(dst.iter().all(|&b| b == 7));
//! ```
//!
//! ## Layers
//! - [`memory`]: memory types, descriptors, and the region map that
//!   validates them.
//! - [`desc`]: the agent descriptor exchanged between agents.
//! - [`agent`]: the [`TransferAgent`] contract, requests, statuses, config.
//! - [`registration`]: [`Registration`], a buffer registered without
//!   `unsafe` for as long as a guard lives.
//! - the engine (private; built by [`make_transfer_agent`]): the agent
//!   over TCP streams, plus the intra-node (cross-memory attach, `shm`) and
//!   RDMA data paths, chosen per peer ([`Backend`]).
//! - [`verbs`]: the RDMA verbs layer, the `kvxfer-verbs` crate of the
//!   workspace: the only crate that talks to the RDMA stack (sideway,
//!   rdma-mummy-sys), so no other code can reach it but through its API.
//!
//! ## Thread safety
//! Agents are `Send + Sync`; every method takes `&self`. A
//! [`TransferStatus`] may be cloned and waited on from any thread.
//!
//! ## Resource cleanup
//! Dropping an agent closes its listener and connections, fails its
//! requests in flight with [`Error::Closed`], and joins its threads before
//! returning. A request's local regions stay busy (deregistration is
//! refused) until its status has completed, and a status completes only
//! when no thread of the agent can touch the request's memory any more.

pub mod agent;
pub mod auth;
pub mod cache;
mod callbacks;
pub mod config;
mod cross_memory;
pub mod desc;
mod engine;
pub mod error;
pub mod events;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod gpu;
mod inbox;
pub mod indexed;
mod integrity;
pub mod memory;
pub mod metadata;
pub mod metrics;
pub mod pool;
mod proto;
pub mod registration;
mod registry;
mod small;
pub mod status;
pub mod storage;
/// The RDMA verbs layer (the `kvxfer-verbs` crate).
pub use kvxfer_verbs as verbs;

pub use agent::{
    Backend, DataPath, PreparedTransfer, SyncBatch, SyncMessages, SyncWaker, TimedSyncMessages,
    TransferAgent, TransferOp, TransferRequest, TransferState, TransferStatus, TransportKind,
};
pub use auth::{Credential, CredentialError};
pub use config::{
    AgentConfig, DEFAULT_FABRIC_LANE_REST, DEFAULT_RDMA_MAX_INFLIGHT, FabricConfig, GpuConfig,
    Limits, RdmaConfig, RdmaProgress, SecurityConfig, ShmConfig, TcpConfig,
};
pub use desc::{AgentDesc, DescError, ExportedRegion, RegionKey, TransportOffer};
pub use engine::{kernel_tls_available, make_transfer_agent};
pub use error::{Error, Landed, RejectReason};
pub use events::CompletionQueue;
pub use indexed::{IndexedRequest, PreparedDescList};
pub use memory::{MemoryDesc, MemoryDescs, MemoryError, MemoryType};
pub use metadata::{EtcdConfig, EtcdTls, Metadata};
pub use pool::{PoolAccess, SharedPool};
pub use proto::UnknownTransport;
pub use registration::Registration;
pub use storage::{StorageIo, StorageKind, StorageSpec};
