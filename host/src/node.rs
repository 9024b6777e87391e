//! The error a node (coordinator, server, worker, `local`) stops with.

use crate::net::tls::TlsError;
use crate::net::NetError;
use crate::runtime::PolicyError;

/// Why a node stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A network failure.
    #[error(transparent)]
    Net(#[from] NetError),
    /// A TLS or endpoint set-up failure.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A policy module failure.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A peer broke the protocol, or the cluster refused us.
    #[error("{0}")]
    Protocol(String),
    /// A worker could not go on (a push refused, tasks it cannot compute).
    #[error(transparent)]
    Worker(#[from] syncopate_engine::worker::WorkerError),
    /// A peer we depend on went away.
    #[error("{0}")]
    Lost(String),
    /// A local file or process failure.
    #[error("{what}: {source}")]
    Io {
        /// What we were doing.
        what: String,
        /// What happened.
        source: std::io::Error,
    },
}

/// Compiles a policy module on tokio's blocking pool, so the reactor keeps serving meanwhile
/// (compiling takes tens of milliseconds).
pub(crate) async fn compile(
    runtime: &crate::runtime::PolicyRuntime,
    label: String,
    wasm: Vec<u8>,
) -> Result<crate::runtime::PolicyModule, PolicyError> {
    let rt = runtime.clone();
    tokio::task::spawn_blocking(move || rt.compile(&label, &wasm))
        .await
        .map_err(|e| PolicyError::Host(format!("compile task failed: {e}")))?
}
