//! Riding out a coordinator restart: the server keeps its shards while the coordinator is away,
//! and rejoins it, under the id it had, once it is back at the same address.
//!
//! The restarted coordinator has lost its memory of the cluster. On the rejoining connection it
//! asks for this server's [`Holdings`] (which shards it is primary or backup for, at which
//! term, the policy and the swap count), and answers the hello only once it has rebuilt the
//! cluster from every server's: with a welcome under the old id, or a refusal when this server
//! was failed over before the old coordinator died (then it stops, as it would have).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::{coordinator_loop, statuses, Shared};
use crate::net::proto::{Held, Hello, Holdings, Role, Welcome, COORDINATOR_WAIT_MS, PROTOCOL_VERSION};
use crate::net::wire::Limits;
use crate::net::{self, NetError};
use crate::NodeError;

/// Between two attempts to reach the coordinator.
const RETRY: Duration = Duration::from_millis(250);
/// One attempt's handshake: a coordinator that is down never answers, and QUIC would wait for
/// its idle timeout.
const ATTEMPT: Duration = Duration::from_secs(1);

/// What this server holds, for a restarted coordinator.
pub(super) async fn holdings(shared: &Shared) -> Holdings {
    let (swaps, policy, _) = shared.policy.lock().expect("not poisoned").clone();
    let primaries = shared.primaries();
    let backups = shared.backups();
    let lens: std::collections::HashMap<u32, u64> =
        statuses(primaries.iter().chain(&backups).cloned().collect())
            .await
            .into_iter()
            .map(|s| (s.shard, s.len))
            .collect();
    let held = |shard: u32| (shard, shared.term(shard), lens.get(&shard).copied().unwrap_or(0));
    let primaries = primaries.iter().map(|(shard, _)| held(*shard)).collect();
    let backups = backups.iter().map(|(shard, _)| held(*shard)).collect();
    let mut levelled = shared.levelled.lock().expect("not poisoned").clone();
    let known_terms = shared.state().known_terms().to_vec();
    // The newest swap a copy here runs: a backup takes a swap its primary committed and streamed
    // before this server has committed it (it has prepared it, with its module).
    let mut copies = 0;
    let mut policy = policy;
    let kept = shared.backups();
    for (_, tx) in shared.primaries().iter().chain(&kept) {
        let (reply, rx) = tokio::sync::oneshot::channel();
        if tx.send(super::ShardCmd::Swapped { reply }).await.is_err() {
            continue;
        }
        if let Ok(Some((swap, raise))) = rx.await {
            if swap > copies {
                copies = swap;
                if swap > swaps {
                    levelled = raise;
                }
            }
        }
    }
    if copies > swaps {
        if let Some((_, blob, _)) = shared.prepared.lock().expect("not poisoned").get(&copies) {
            policy = blob.clone();
        }
    }
    Holdings {
        settings: shared.settings.clone(),
        policy,
        held: Held { server: shared.id, swaps, levelled, primaries, backups, known: known_terms, copies },
    }
}

/// Reaches the coordinator again, for up to [`COORDINATOR_WAIT_MS`], and rejoins it: the new
/// connection, with the task serving its commands. A refusal (this server was failed over, or
/// the coordinator runs another cluster) is final.
pub(super) async fn rejoin(shared: &Arc<Shared>) -> Result<(quinn::Connection, JoinHandle<()>), NodeError> {
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        token: shared.token.secret().to_string(),
        role: Role::Server { data_addr: shared.addr, rejoin: Some(shared.id) },
    };
    let started = Instant::now();
    let wait = Duration::from_millis(COORDINATOR_WAIT_MS);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let last = match attempt(shared, &hello).await {
            Ok(joined) => {
                tracing::warn!(
                    server = shared.id,
                    ms = started.elapsed().as_millis() as u64,
                    attempts,
                    "rejoined the coordinator"
                );
                return Ok(joined);
            }
            Err(NetError::Refused { reason, .. }) => {
                return Err(NodeError::Protocol(format!(
                    "the coordinator would not take this server back: {reason}"
                )));
            }
            Err(e) => e,
        };
        if started.elapsed() >= wait {
            return Err(NodeError::Lost(format!(
                "the coordinator went away and was not back within {} s (last attempt: {last})",
                wait.as_secs()
            )));
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// One attempt: connect, serve the coordinator's commands (it asks for our holdings before it
/// answers), and say hello.
async fn attempt(
    shared: &Arc<Shared>,
    hello: &Hello,
) -> Result<(quinn::Connection, JoinHandle<()>), NetError> {
    let addr = shared.coordinator;
    let conn = net::dial(&shared.endpoint, addr, &shared.server_name, Some(ATTEMPT)).await?;
    let commands = tokio::spawn(coordinator_loop(conn.clone(), shared.clone()));
    let refused = match net::greet(&conn, hello, &Limits::default()).await {
        Ok((Welcome::Server { server, .. }, _)) if server == shared.id => return Ok((conn, commands)),
        Ok((other, _)) => NetError::Unexpected { addr, what: format!("{other:?}") },
        Err(e) => e,
    };
    commands.abort();
    conn.close(net::close::DONE.into(), b"rejoin failed");
    Err(refused)
}
