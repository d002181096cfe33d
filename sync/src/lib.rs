//! kvxfer's lock-free primitives, apart from the library so that their
//! `loom` models build alone:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kvxfer-sync
//! ```
//!
//! - [`Window`]: the RDMA send window, a ring of the sizes of the posted
//!   work requests and their sum (one taker, one releaser).
//! - [`Lane`]: the express lane's ownership protocol, one slot handed
//!   between a submitter and a finisher by an atomic state.
//!
//! Every other piece of shared state in kvxfer is behind a lock.

mod lane;
mod window;

pub use lane::{Claim, Lane};
pub use window::Window;
