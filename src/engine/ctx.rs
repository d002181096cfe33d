//! What a transport may use of its agent ([`Ctx`]), instead of the
//! agent's whole state; and another agent of this process as the
//! in-process transport holds it ([`AgentRef`]).

#![forbid(unsafe_code)]

use crate::agent::AgentConfig;
use crate::engine::in_flight::InFlight;
use crate::engine::{Engine, Inner};
use crate::inbox::Inbox;
use crate::registry::Registry;
use std::sync::{Arc, Weak};

/// What a transport may use of its agent: its name and configuration, its
/// instance and host, its registry, inbox, storage, metrics and request
/// ids — handed to every transport method instead of the agent's whole
/// state, which a transport never names (`tests/layering.rs`). The core
/// reaches the state behind it ([`state`](Self::state)); a transport does
/// not.
#[derive(Clone, Copy)]
pub(in crate::engine) struct Ctx<'a>(&'a Inner);

impl<'a> Ctx<'a> {
    /// The context of the agent whose state is `inner`.
    pub(in crate::engine) fn of(inner: &'a Inner) -> Self {
        Self(inner)
    }

    /// The agent's configuration.
    pub(in crate::engine) fn config(self) -> &'a AgentConfig {
        &self.0.config
    }

    /// The agent's name.
    pub(in crate::engine) fn name(self) -> &'a str {
        &self.0.config.name
    }

    /// This agent process's instance (in its descriptor).
    pub(in crate::engine) fn instance(self) -> u64 {
        self.0.instance
    }

    /// This host's id.
    pub(in crate::engine) fn host(self) -> &'a str {
        &self.0.host
    }

    /// The agent's registered memory.
    pub(in crate::engine) fn registry(self) -> &'a Arc<Registry> {
        &self.0.registry
    }

    /// Where sync messages for the application wait.
    pub(in crate::engine) fn inbox(self) -> &'a Arc<Inbox> {
        &self.0.inbox
    }

    /// The agent's storage (files, block devices, objects).
    pub(in crate::engine) fn storage(self) -> &'a crate::storage::Storage {
        &self.0.storage
    }

    /// The agent's metrics.
    pub(in crate::engine) fn metrics(self) -> &'a crate::metrics::Metrics {
        &self.0.metrics
    }

    /// The agent's request ids and requests in flight.
    pub(in crate::engine) fn in_flight(self) -> &'a Arc<InFlight> {
        &self.0.in_flight
    }

    /// Whether the agent is closing.
    pub(in crate::engine) fn closing(self) -> bool {
        self.0.closing.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Closes the agent's door to in-process copies: returns once none into
    /// or out of its memory is under way, and none starts.
    pub(in crate::engine) fn close_door(self) {
        *self.0.door.write().unwrap_or_else(|p| p.into_inner()) = false;
    }

    /// The agent's whole state: for the core's functions that a transport
    /// calls with its context (never called by a transport).
    pub(in crate::engine) fn state(self) -> &'a Inner {
        self.0
    }
}

impl Engine {
    /// The context its transports get.
    pub(in crate::engine) fn ctx(&self) -> Ctx<'_> {
        Ctx(&self.inner)
    }
}

/// An agent of this process as another agent's transport holds it (the
/// in-process one): its context while it lives, and its door.
pub(in crate::engine) struct AgentRef(Weak<Inner>);

/// A live agent of this process, held while used (see [`AgentRef`]).
pub(in crate::engine) struct LiveAgent(Arc<Inner>);

impl AgentRef {
    /// The agent whose state is `inner`.
    pub(in crate::engine) fn to(inner: &Arc<Inner>) -> Self {
        Self(Arc::downgrade(inner))
    }

    /// The agent, while it lives.
    pub(in crate::engine) fn live(&self) -> Option<LiveAgent> {
        self.0.upgrade().map(LiveAgent)
    }

    /// Whether it was dropped.
    pub(in crate::engine) fn gone(&self) -> bool {
        self.0.strong_count() == 0
    }
}

impl LiveAgent {
    /// Its context.
    pub(in crate::engine) fn ctx(&self) -> Ctx<'_> {
        Ctx(&self.0)
    }

    /// Its door, held (shared) while copying into or out of its memory:
    /// `false` once it closed.
    pub(in crate::engine) fn door(&self) -> std::sync::RwLockReadGuard<'_, bool> {
        self.0.door.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A reference to it that does not keep it alive.
    pub(in crate::engine) fn weak(&self) -> AgentRef {
        AgentRef::to(&self.0)
    }
}
