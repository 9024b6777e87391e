//! The transport: QUIC (quinn) with TLS, one stream per request, postcard headers and raw
//! tensor payloads.
//!
//! - [`wire`]: framing, limits and the message decoder;
//! - [`pool`]: reused tensor buffers, and tensors lent to QUIC without a copy;
//! - [`proto`]: every message type;
//! - [`tls`]: certificates, tokens and endpoint configuration;
//! - [`udp`]: the UDP socket under each endpoint (buffers, segmentation offload);
//! - [`spin`]: runtimes that poll their sockets briefly before they sleep;
//! - [`window`]: receive windows that share the socket buffer among a server's workers;
//! - this module: the connection handshake (hello with the cluster token) and request helpers
//!   the coordinator, servers and workers share.

pub mod pool;
pub mod proto;
pub mod spin;
pub mod tls;
pub mod udp;
pub mod window;
pub mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};

use proto::{Hello, Welcome, PROTOCOL_VERSION};
use wire::{Limits, WireError};

/// Application close codes.
pub mod close {
    /// Normal shutdown.
    pub const DONE: u32 = 0;
    /// The peer did not authenticate.
    pub const UNAUTHENTICATED: u32 = 1;
    /// The peer sent a frame that could not be read.
    pub const MALFORMED: u32 = 2;
    /// The peer broke the protocol (wrong role, wrong version).
    pub const PROTOCOL: u32 = 3;
    /// The node is shutting down.
    pub const SHUTDOWN: u32 = 4;
    /// The peer stopped answering, so the connection is given up and made afresh: a server's
    /// lease renewals went unanswered for a whole lease, or a worker's request to the
    /// coordinator went unanswered (the coordinator may have restarted).
    pub const SILENT: u32 = 5;
}

/// How long a peer has to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A networking failure, as a node reports it.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The connection could not be set up.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The peer.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The connection was lost or closed.
    #[error("connection to {addr} lost: {reason}")]
    Lost {
        /// The peer.
        addr: SocketAddr,
        /// quinn's account.
        reason: quinn::ConnectionError,
    },
    /// A frame could not be read or written.
    #[error("{addr}: {error}")]
    Wire {
        /// The peer.
        addr: SocketAddr,
        /// What was wrong.
        error: WireError,
    },
    /// The peer answered with an error or refused us.
    #[error("{addr} refused: {reason}")]
    Refused {
        /// The peer.
        addr: SocketAddr,
        /// Its reason.
        reason: proto::Unwelcome,
    },
    /// A shard refused the request, for a reason typed as the shard made it (an iteration out
    /// of order, a gradient with a NaN, an id it does not admit, ...).
    #[error("{addr} refused: {error}")]
    RefusedByShard {
        /// The server holding the shard.
        addr: SocketAddr,
        /// Why.
        error: crate::shard::RequestError,
    },
    /// The server itself refused the request (a shard it does not hold in a cluster without
    /// backups, a push that does not decode, ...), typed as it made it.
    #[error("{addr} refused: {error}")]
    RefusedByServer {
        /// The server.
        addr: SocketAddr,
        /// Why.
        error: proto::DataError,
    },
    /// The coordinator refused the request, typed as it made it (a rollback with nothing to
    /// roll back to, a swap no server switched to, ...).
    #[error("{addr} refused: {error}")]
    RefusedByCoordinator {
        /// The coordinator.
        addr: SocketAddr,
        /// Why.
        error: proto::CoordError,
    },
    /// The peer answered with a message that makes no sense here.
    #[error("{addr} answered out of protocol: {what}")]
    Unexpected {
        /// The peer.
        addr: SocketAddr,
        /// What came.
        what: String,
    },
    /// The server no longer holds the shard as its primary (it lost its lease, or the shard
    /// moved): ask the coordinator where it is now.
    #[error("{addr} cannot serve the shard now: {why}")]
    Unavailable {
        /// The peer.
        addr: SocketAddr,
        /// Why.
        why: proto::NotServing,
    },
    /// The coordinator moved the shard to another server while a request to it was under way:
    /// ask the new one.
    #[error("shard {shard} moved away from {addr}")]
    Moved {
        /// The server the request went to.
        addr: SocketAddr,
        /// The shard.
        shard: u32,
    },
    /// No answer in time.
    #[error("{addr} did not answer within {after:?}")]
    Timeout {
        /// The peer.
        addr: SocketAddr,
        /// How long we waited.
        after: Duration,
    },
}

/// Opens a connection to `addr`, sends `hello` and returns the connection with the answer.
pub async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    hello: &Hello,
) -> Result<(quinn::Connection, Welcome), NetError> {
    let conn = dial(endpoint, addr, server_name, None).await?;
    let (welcome, _) = greet(&conn, hello, &Limits::default()).await?;
    Ok((conn, welcome))
}

/// Opens a connection to `addr`. With `within`, a handshake not done in that time fails: a peer
/// that is down (a coordinator restarting, say) never answers, and QUIC would otherwise wait
/// for its idle timeout.
pub async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    within: Option<Duration>,
) -> Result<quinn::Connection, NetError> {
    let connecting =
        endpoint.connect(addr, server_name).map_err(|e| NetError::Connect { addr, reason: e.to_string() })?;
    let connected = match within {
        Some(after) => {
            tokio::time::timeout(after, connecting).await.map_err(|_| NetError::Timeout { addr, after })?
        }
        None => connecting.await,
    };
    connected.map_err(|e| NetError::Connect { addr, reason: e.to_string() })
}

/// Sends `hello` on `conn` and reads the welcome, with its payload, within `limits`. A refusal
/// is an error.
pub async fn greet(
    conn: &quinn::Connection,
    hello: &Hello,
    limits: &Limits,
) -> Result<(Welcome, Vec<u8>), NetError> {
    let (welcome, payload) = request::<_, Welcome>(conn, hello, wire::Payload::EMPTY, limits).await?;
    if let Welcome::Refused(reason) = welcome {
        return Err(NetError::Refused { addr: conn.remote_address(), reason });
    }
    Ok((welcome, payload))
}

/// Sends one request on a new stream and reads the answer (header and payload bytes).
pub async fn request<Q: Serialize, A: DeserializeOwned>(
    conn: &quinn::Connection,
    req: &Q,
    payload: wire::Payload<'_>,
    limits: &Limits,
) -> Result<(A, Vec<u8>), NetError> {
    request_with_priority(conn, req, payload, limits, 0).await
}

/// [`request`], sent with QUIC stream priority `priority`: while streams of this connection
/// compete for the congestion window, a higher priority's bytes go first (equal ones share).
pub async fn request_with_priority<Q: Serialize, A: DeserializeOwned>(
    conn: &quinn::Connection,
    req: &Q,
    payload: wire::Payload<'_>,
    limits: &Limits,
    priority: i32,
) -> Result<(A, Vec<u8>), NetError> {
    let addr = conn.remote_address();
    let lost = |reason| NetError::Lost { addr, reason };
    let wire = |source| wire_or_lost(conn, source);
    let (mut send, mut recv) = conn.open_bi().await.map_err(lost)?;
    if priority != 0 {
        // Fails only on a stream already closed, which the write below reports.
        let _ = send.set_priority(priority);
    }
    let mut scratch = Vec::new();
    wire::write_frame(&mut send, req, payload, &mut scratch).await.map_err(wire)?;
    wire::read_message::<A>(&mut recv, limits).await.map_err(wire)
}

/// A stream error, reported as the connection's loss when the connection is what failed.
pub fn wire_or_lost(conn: &quinn::Connection, source: WireError) -> NetError {
    let addr = conn.remote_address();
    match conn.close_reason() {
        Some(reason) => NetError::Lost { addr, reason },
        None => NetError::Wire { addr, error: source },
    }
}

/// Accepts a connection's hello. On a bad token or version the connection is closed (and the
/// peer learns nothing else); the caller answers with a [`Welcome`] on the returned stream.
pub async fn accept_hello(
    conn: &quinn::Connection,
    token: &tls::Token,
    operator_token: Option<&tls::Token>,
) -> Option<(Hello, quinn::SendStream)> {
    let addr = conn.remote_address();
    let first = tokio::time::timeout(HELLO_TIMEOUT, async {
        let (send, mut recv) = conn.accept_bi().await.ok()?;
        let limits = Limits { max_header: 4096, max_payload: 0 };
        match wire::read_message::<Hello>(&mut recv, &limits).await {
            Ok((hello, _)) => Some((hello, send)),
            Err(e) => {
                tracing::warn!(%addr, "bad hello: {e}");
                conn.close(close::MALFORMED.into(), format!("malformed hello: {e}").as_bytes());
                None
            }
        }
    })
    .await;
    let Ok(Some((hello, send))) = first else {
        if conn.close_reason().is_none() {
            tracing::warn!(%addr, "no hello within {HELLO_TIMEOUT:?}; closing");
            conn.close(close::UNAUTHENTICATED.into(), b"authentication failed");
        }
        return None;
    };
    let authentic = match hello.role {
        proto::Role::Operator => operator_token.unwrap_or(token).matches(&hello.token),
        _ => token.matches(&hello.token),
    };
    if !authentic {
        tracing::warn!(%addr, role = ?hello.role, "rejected a peer with a wrong token");
        conn.close(close::UNAUTHENTICATED.into(), b"authentication failed");
        return None;
    }
    if hello.protocol != PROTOCOL_VERSION {
        tracing::warn!(%addr, "peer speaks protocol {}, we speak {PROTOCOL_VERSION}", hello.protocol);
        let reason =
            format!("protocol {} is not supported (this node speaks {PROTOCOL_VERSION})", hello.protocol);
        conn.close(close::PROTOCOL.into(), reason.as_bytes());
        return None;
    }
    Some((hello, send))
}

/// Sends a refusal and waits (briefly) until the peer has read it, so that closing the
/// connection afterwards does not swallow the reason.
pub async fn refuse(send: &mut quinn::SendStream, reason: proto::Unwelcome) {
    if answer(send, &Welcome::Refused(reason), &[]).await.is_ok() {
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    }
}

/// Sends a single answer frame on `send` and finishes it.
pub async fn answer<A: Serialize>(
    send: &mut quinn::SendStream,
    msg: &A,
    payload: &[u8],
) -> Result<(), WireError> {
    let mut scratch = Vec::new();
    wire::write_frame(send, msg, payload.into(), &mut scratch).await
}
