//! A worker's connections to the servers, by server id.
//!
//! They are dialed when the worker connects. When a server's connection has ended, it is dialed
//! again the next time a request goes there: the server may have been restarted in a lost one's
//! place, at the same address. The coordinator gives a restarted server its id back only a peer
//! timeout after the loss, so by then the connection to the old process has timed out here too.
//! A server that is still down just fails the new dial, and the request takes the usual path for
//! a lost server: it waits for the shard to move.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::net::{self, proto::ControlMessage, proto::Hello};

/// How long a new dial to a server whose connection ended may take.
const REDIAL_WITHIN: Duration = Duration::from_secs(2);

/// The connections, by server id, and what it takes to dial one again.
#[derive(Debug)]
pub(super) struct ServerLinks {
    conns: Vec<Mutex<quinn::Connection>>,
    addrs: Vec<SocketAddr>,
    /// The hello the worker sends a server (its id and ticket).
    hello: Hello,
    server_name: String,
    /// Where a new connection's control messages go (as the first ones' do).
    controls: mpsc::UnboundedSender<ControlMessage>,
    /// One dial at a time.
    dialing: tokio::sync::Mutex<()>,
    /// Bytes sent and received on connections that were replaced.
    retired: Mutex<(u64, u64)>,
}

impl ServerLinks {
    pub(super) fn new(
        conns: Vec<quinn::Connection>,
        addrs: Vec<SocketAddr>,
        hello: Hello,
        server_name: String,
        controls: mpsc::UnboundedSender<ControlMessage>,
    ) -> Self {
        ServerLinks {
            conns: conns.into_iter().map(Mutex::new).collect(),
            addrs,
            hello,
            server_name,
            controls,
            dialing: tokio::sync::Mutex::new(()),
            retired: Mutex::new((0, 0)),
        }
    }

    /// Server `server`'s connection as it is.
    pub(super) fn get(&self, server: u32) -> quinn::Connection {
        self.conns[server as usize].lock().expect("not poisoned").clone()
    }

    /// Every server's connection.
    pub(super) fn all(&self) -> Vec<quinn::Connection> {
        (0..self.conns.len() as u32).map(|s| self.get(s)).collect()
    }

    /// Bytes sent and received on the connections replaced so far.
    pub(super) fn retired_bytes(&self) -> (u64, u64) {
        *self.retired.lock().expect("not poisoned")
    }

    /// Server `server`'s connection, dialed again if it has ended (a restarted server). If the
    /// new dial fails, the ended one is returned: a request on it fails at once, as on a lost
    /// server.
    pub(super) async fn live(&self, endpoint: &quinn::Endpoint, server: u32) -> quinn::Connection {
        let conn = self.get(server);
        if conn.close_reason().is_none() {
            return conn;
        }
        let _one = self.dialing.lock().await;
        let conn = self.get(server);
        if conn.close_reason().is_none() {
            return conn;
        }
        let addr = self.addrs[server as usize];
        let dialed = async {
            let c = net::dial(endpoint, addr, &self.server_name, Some(REDIAL_WITHIN)).await?;
            net::greet(&c, &self.hello, &net::wire::Limits::default()).await?;
            Ok::<_, net::NetError>(c)
        };
        match tokio::time::timeout(REDIAL_WITHIN * 2, dialed).await {
            Ok(Ok(new)) => {
                tokio::spawn(super::client::read_controls(new.clone(), self.controls.clone()));
                let s = conn.stats();
                let mut retired = self.retired.lock().expect("not poisoned");
                *retired = (retired.0 + s.udp_tx.bytes, retired.1 + s.udp_rx.bytes);
                *self.conns[server as usize].lock().expect("not poisoned") = new.clone();
                tracing::warn!(server, %addr, "connected again to a server whose connection had ended (restarted)");
                new
            }
            Ok(Err(e)) => {
                tracing::debug!(server, %addr, "no new connection: {e}");
                conn
            }
            Err(_) => {
                tracing::debug!(server, %addr, "no new connection within {:?}", REDIAL_WITHIN * 2);
                conn
            }
        }
    }
}
