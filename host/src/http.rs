//! The HTTP sockets a node serves besides QUIC: Prometheus metrics ([`crate::metrics`]) and the
//! live dashboard ([`crate::dashboard`]). Each is bound at start, so its address is known (and
//! written to a file for launchers that asked for port 0) before the node can answer; requests
//! wait in the backlog until it is served.

use std::net::SocketAddr;
use std::path::Path;

use crate::node::NodeError;

/// A bound HTTP socket, not yet served.
#[derive(Debug)]
pub struct Listener {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl Listener {
    /// Binds `addr` (port 0: any free port) for `what` (for messages) and, given `addr_file`,
    /// writes the bound address there (whole or not at all).
    pub async fn bind(what: &str, addr: SocketAddr, addr_file: Option<&Path>) -> Result<Self, NodeError> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| NodeError::Io {
            what: format!("cannot listen for {what} at {addr}"),
            source,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|source| NodeError::Io { what: format!("the {what} address"), source })?;
        if let Some(path) = addr_file {
            crate::checkpoint::write_file(path, format!("{addr}\n").as_bytes()).map_err(|source| {
                NodeError::Io { what: format!("cannot write {}", path.display()), source }
            })?;
        }
        Ok(Listener { listener, addr })
    }

    /// The address it listens at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `app` until the task is aborted (the node's end).
    pub fn serve(self, what: &'static str, app: axum::Router) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if let Err(e) = axum::serve(self.listener, app).await {
                tracing::warn!("{what} server stopped: {e}");
            }
        })
    }
}

/// Reads an address file [`Listener::bind`] wrote.
pub fn read_addr(path: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
