//! Prometheus metrics: the coordinator and every server serve `GET /metrics` over HTTP
//! (`--metrics-listen ADDR`; `syncopate local` turns it on, on loopback, and names the addresses
//! in `cluster.json`).
//!
//! - [`exposition`]: what each exposes, made at scrape time from the status the process keeps
//!   anyway, so a push costs nothing more with metrics on (`docs/observability.md` lists the names).
//! - [`bind`] and [`serve`]: the listening socket ([`crate::http::Listener`]), bound at start
//!   (its address is known, and written to a file, before the node has registered), served once
//!   the node can answer.

pub mod exposition;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use crate::http::Listener;
use crate::node::NodeError;

/// Makes one scrape's text.
pub type Render = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync>;

/// Serves `GET /metrics` on `listener` with `render`'s text until the task is aborted (the
/// node's end).
pub fn serve(listener: Listener, render: Render) -> tokio::task::JoinHandle<()> {
    let route = axum::routing::get(move || {
        let render = render.clone();
        async move {
            let text = render().await;
            ([(axum::http::header::CONTENT_TYPE, exposition::CONTENT_TYPE)], text)
        }
    });
    listener.serve("metrics", axum::Router::new().route("/metrics", route))
}

/// Binds the metrics socket `opts` name ([`crate::http::Listener::bind`]).
pub async fn bind(opts: &MetricsOptions) -> Result<Listener, NodeError> {
    let listener = Listener::bind("metrics", opts.listen, opts.addr_file.as_deref()).await?;
    let addr = listener.addr();
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    Ok(listener)
}

pub use crate::http::read_addr;

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
