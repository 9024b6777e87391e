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

/// What kind of failure a [`NodeError`] is, for callers that react differently to each (the
/// Python package raises one exception class per kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The peer could not be reached at all (nothing listening, wrong address, TLS refused).
    Unreachable,
    /// The peer closed the connection because we did not authenticate (a wrong token).
    Unauthenticated,
    /// An established connection was lost (the peer died, was cut off or shut down).
    Lost,
    /// The peer answered but refused the request (a wrong model length, a cluster full).
    Refused,
    /// Anything else: protocol breaks, policy failures, local files.
    Other,
}

impl NodeError {
    /// Which kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            NodeError::Net(NetError::Connect { .. } | NetError::Timeout { .. }) => ErrorKind::Unreachable,
            NodeError::Net(NetError::Lost { reason, .. }) => match reason {
                quinn::ConnectionError::ApplicationClosed(c)
                    if c.error_code == quinn::VarInt::from_u32(crate::net::close::UNAUTHENTICATED) =>
                {
                    ErrorKind::Unauthenticated
                }
                _ => ErrorKind::Lost,
            },
            NodeError::Net(
                NetError::Refused { .. }
                | NetError::RefusedByShard { .. }
                | NetError::RefusedByServer { .. }
                | NetError::RefusedByCoordinator { .. },
            ) => ErrorKind::Refused,
            NodeError::Lost(_) => ErrorKind::Lost,
            _ => ErrorKind::Other,
        }
    }
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
