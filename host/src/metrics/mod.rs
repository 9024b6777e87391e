//! Prometheus metrics: the coordinator and every server serve `GET /metrics` over HTTP
//! (`--metrics-listen ADDR`; `syncopate local` turns it on, on loopback, and names the addresses
//! in `cluster.json`).
//!
//! - [`exposition`]: what each exposes, made at scrape time from the status the process keeps
//!   anyway, so a push costs nothing more with metrics on (`docs/metrics.md` lists the names).
//! - [`MetricsListener`]: the listening socket, bound at start (its address is known, and
//!   written to a file, before the node has registered), served once the node can answer.

pub mod exposition;

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use crate::node::NodeError;

/// Makes one scrape's text.
pub type Render = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync>;

/// A bound `/metrics` socket, not yet served: connections wait in its backlog until
/// [`serve`](Self::serve).
#[derive(Debug)]
pub struct MetricsListener {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl MetricsListener {
    /// Binds `addr` (port 0: any free port) and, given `addr_file`, writes the bound address
    /// there (whole or not at all) for whoever scrapes it.
    pub async fn bind(addr: SocketAddr, addr_file: Option<&Path>) -> Result<Self, NodeError> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| NodeError::Io {
            what: format!("cannot listen for metrics at {addr}"),
            source,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|source| NodeError::Io { what: "the metrics address".into(), source })?;
        if let Some(path) = addr_file {
            crate::checkpoint::write_file(path, format!("{addr}\n").as_bytes()).map_err(|source| {
                NodeError::Io { what: format!("cannot write {}", path.display()), source }
            })?;
        }
        tracing::info!(%addr, "metrics at http://{addr}/metrics");
        Ok(MetricsListener { listener, addr })
    }

    /// The address it listens at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `GET /metrics` with `render`'s text until the task is aborted (the node's end).
    pub fn serve(self, render: Render) -> tokio::task::JoinHandle<()> {
        let route = axum::routing::get(move || {
            let render = render.clone();
            async move {
                let text = render().await;
                ([(axum::http::header::CONTENT_TYPE, exposition::CONTENT_TYPE)], text)
            }
        });
        let app = axum::Router::new().route("/metrics", route);
        tokio::spawn(async move {
            if let Err(e) = axum::serve(self.listener, app).await {
                tracing::warn!("metrics server stopped: {e}");
            }
        })
    }
}

/// Reads a metrics address file [`MetricsListener::bind`] wrote.
pub fn read_addr(path: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// One scrape of `addr`'s `/metrics`: the body, or why not. An HTTP/1.0 GET, so the answer is
/// the body whole, ended by the close (the launcher's one scrape at the end of a run).
pub async fn scrape(addr: SocketAddr) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("cannot connect: {e}"))?;
    let ask = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    conn.write_all(ask.as_bytes()).await.map_err(|e| format!("cannot ask: {e}"))?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.map_err(|e| format!("cannot read: {e}"))?;
    let answer = String::from_utf8(answer).map_err(|_| "not text".to_string())?;
    let (head, body) = answer.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    match head.split_whitespace().nth(1) {
        Some("200") => Ok(body.to_string()),
        _ => Err(format!("answered {}", head.lines().next().unwrap_or_default())),
    }
}

/// Where a node serves its metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsOptions {
    /// The address to listen at (port 0: any).
    pub listen: SocketAddr,
    /// Where to write the address bound.
    pub addr_file: Option<std::path::PathBuf>,
}
