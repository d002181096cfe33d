//! Where the application's completion callbacks run
//! ([`TransferStatus::on_complete`](crate::TransferStatus::on_complete),
//! and the C API's `kvxfer_status_on_complete`): one thread of the
//! process, in the order their outcomes came in, never on a thread of the
//! library. A callback that panics is caught, logged and counted
//! (`kvxfer_callback_panics_total`); one that blocks holds up the
//! callbacks after it, not the transfers.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::Sender;

/// A callback with its outcome, ready to run.
pub(crate) type Call = Box<dyn FnOnce() + Send>;

static RUNNER: OnceLock<Option<Sender<Call>>> = OnceLock::new();
static PANICS: AtomicU64 = AtomicU64::new(0);

/// Callbacks of this process that panicked (caught) so far.
pub(crate) fn panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

/// Runs `call` on the callback thread (started on first use). Where that
/// thread cannot be started, `call` runs here, still caught.
pub(crate) fn run(call: Call) {
    let runner = RUNNER.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<Call>();
        let started = std::thread::Builder::new()
            .name("kvxfer-callbacks".into())
            .spawn(move || {
                for call in rx {
                    guarded(call);
                }
            });
        match started {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::error!(%e, "cannot start the callback thread; callbacks run where transfers complete");
                None
            }
        }
    });
    match runner {
        Some(tx) => {
            if let Err(e) = tx.send(call) {
                guarded(e.into_inner());
            }
        }
        None => guarded(call),
    }
}

/// Runs `call`, catching (logging and counting) a panic.
fn guarded(call: Call) {
    if catch_unwind(AssertUnwindSafe(call)).is_err() {
        PANICS.fetch_add(1, Ordering::Relaxed);
        tracing::error!("a completion callback panicked (caught; the library goes on)");
    }
}
