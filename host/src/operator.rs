//! The operator's client: swap the cluster's policy, ask what runs where, read the model, shut
//! the cluster down. Used by `syncopate policy swap|status`, `syncopate local` and tests.

use std::net::SocketAddr;
use std::time::Duration;

use crate::coordinator::PolicySource;
use crate::net::proto::{
    ClusterStatus, CoordRequest, CoordResponse, DataRequest, DataResponse, Hello, Role, PROTOCOL_VERSION,
};
use crate::net::tls::ClusterAccess;
use crate::net::wire::{self, Limits, Payload};
use crate::net::{self, NetError};
use crate::NodeError;

/// An authenticated operator connection to the coordinator.
#[derive(Debug)]
pub struct Operator {
    endpoint: quinn::Endpoint,
    /// Replaced when it is found closed: the coordinator may have restarted.
    conn: std::sync::Mutex<quinn::Connection>,
    access: ClusterAccess,
}

const LIMITS: Limits = Limits { max_header: 16 << 20, max_payload: 1 << 30 };

impl Operator {
    /// Connects to the coordinator as an operator.
    pub async fn connect(access: &ClusterAccess) -> Result<Self, NodeError> {
        let endpoint =
            net::tls::dial_only(access.tls.client_config(Duration::from_secs(60))?, access.coordinator)?;
        let conn = dial(&endpoint, access, access.coordinator).await?;
        Ok(Operator { endpoint, conn: std::sync::Mutex::new(conn), access: access.clone() })
    }

    /// Gives up the connection to the coordinator (it died, say): the next request connects
    /// afresh, to whatever listens at its address then.
    pub fn reconnect(&self) {
        self.conn.lock().expect("not poisoned").close(net::close::DONE.into(), b"reconnecting");
    }

    /// The connection to the coordinator, made again if it was closed. A request is never sent
    /// twice: one that fails midway is an error, since it may have been carried out.
    async fn connection(&self) -> Result<quinn::Connection, NodeError> {
        let conn = self.conn.lock().expect("not poisoned").clone();
        if conn.close_reason().is_none() {
            return Ok(conn);
        }
        let conn = dial(&self.endpoint, &self.access, self.access.coordinator).await?;
        *self.conn.lock().expect("not poisoned") = conn.clone();
        Ok(conn)
    }

    async fn ask(&self, req: &CoordRequest, payload: &[u8]) -> Result<CoordResponse, NodeError> {
        let conn = self.connection().await?;
        let (answer, _) = net::request::<_, CoordResponse>(&conn, req, payload.into(), &LIMITS).await?;
        match answer {
            CoordResponse::Error(error) => {
                Err(NetError::RefusedByCoordinator { addr: self.access.coordinator, error }.into())
            }
            other => Ok(other),
        }
    }

    /// Swaps the cluster's policy. An error says why no shard switched.
    pub async fn swap(&self, policy: &PolicySource) -> Result<Swapped, NodeError> {
        Swapped::from(self.ask(&CoordRequest::Swap(policy.blob()), &policy.wasm).await?, "a swap")
    }

    /// Swaps back to the last policy that ran before the current one without failing (one that
    /// failed while it ran is never swapped back in).
    pub async fn rollback(&self) -> Result<Swapped, NodeError> {
        Swapped::from(self.ask(&CoordRequest::Rollback, &[]).await?, "a rollback")
    }

    /// What runs where.
    pub async fn status(&self) -> Result<ClusterStatus, NodeError> {
        match self.ask(&CoordRequest::Status, &[]).await? {
            CoordResponse::Status(s) => Ok(*s),
            other => Err(NodeError::Protocol(format!("unexpected answer to status: {other:?}"))),
        }
    }

    /// Reports the score the launcher's evaluator gave the model (for `policy status` and the
    /// dashboard).
    pub async fn report_evaluation(&self, score: crate::net::proto::ModelScore) -> Result<(), NodeError> {
        self.ask(&CoordRequest::Evaluated { score }, &[]).await.map(|_| ())
    }

    /// Asks every worker to finish its iteration and leave.
    pub async fn stop_training(&self) -> Result<(), NodeError> {
        self.ask(&CoordRequest::StopTraining, &[]).await.map(|_| ())
    }

    /// Stops every server and the coordinator.
    pub async fn shutdown(self) -> Result<(), NodeError> {
        self.ask(&CoordRequest::Shutdown, &[]).await?;
        self.conn.lock().expect("not poisoned").close(net::close::DONE.into(), b"operator done");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        Ok(())
    }

    /// Reads the whole model (every shard, in order) without taking part in training. Returns
    /// the parameters and the fewest optimizer steps of any shard.
    pub async fn read_model(&self) -> Result<(Vec<f32>, u64), NodeError> {
        let status = self.status().await?;
        let mut shards: Vec<_> = status
            .servers
            .iter()
            .flat_map(|s| s.shards.iter().map(move |sh| (sh.shard, sh.len, s.addr)))
            .collect();
        shards.sort_unstable_by_key(|s| s.0);
        let mut conns = Vec::new();
        let mut model = Vec::new();
        let mut min_version = u64::MAX;
        for (shard, _, addr) in shards {
            let conn = match conns.iter().find(|(a, _)| *a == addr) {
                Some((_, c)) => c,
                None => {
                    let c = dial(&self.endpoint, &self.access, addr).await?;
                    conns.push((addr, c));
                    &conns.last().expect("just pushed").1
                }
            };
            match net::request::<_, DataResponse>(conn, &DataRequest::Read { shard }, Payload::EMPTY, &LIMITS)
                .await?
            {
                (DataResponse::Values { version }, payload) => {
                    model.extend(
                        wire::f32_from_bytes(&payload).map_err(|e| NetError::Wire { addr, error: e })?,
                    );
                    min_version = min_version.min(version);
                }
                (other, _) => {
                    return Err(NodeError::Protocol(format!("shard {shard} answered a read with {other:?}")))
                }
            }
        }
        for (_, c) in conns {
            c.close(net::close::DONE.into(), b"read done");
        }
        Ok((model, if min_version == u64::MAX { 0 } else { min_version }))
    }
}

/// How a swap that went through ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Swapped {
    /// Every shard switched.
    Whole {
        /// The swap's number.
        swap: u64,
        /// Shards switched.
        shards: u32,
    },
    /// The swap was committed, but some shards could not switch.
    Partly {
        /// The swap's number.
        swap: u64,
        /// What did not switch, and why.
        failed: String,
    },
}

impl Swapped {
    fn from(answer: CoordResponse, what: &str) -> Result<Self, NodeError> {
        match answer {
            CoordResponse::Swapped { swap, shards } => Ok(Swapped::Whole { swap, shards }),
            CoordResponse::SwappedPartly { swap, failed } => {
                Ok(Swapped::Partly { swap, failed: crate::net::proto::listed(&failed) })
            }
            other => Err(NodeError::Protocol(format!("unexpected answer to {what}: {other:?}"))),
        }
    }

    /// The swap's number.
    pub fn swap(&self) -> u64 {
        match self {
            Swapped::Whole { swap, .. } | Swapped::Partly { swap, .. } => *swap,
        }
    }
}

/// Connects to the node at `addr` (the coordinator, or a server) as an operator.
async fn dial(
    endpoint: &quinn::Endpoint,
    access: &ClusterAccess,
    addr: SocketAddr,
) -> Result<quinn::Connection, NetError> {
    let hello =
        Hello { protocol: PROTOCOL_VERSION, token: access.token.secret().to_string(), role: Role::Operator };
    Ok(net::connect(endpoint, addr, &access.tls.server_name, &hello).await?.0)
}
