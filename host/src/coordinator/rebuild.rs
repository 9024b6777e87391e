//! A coordinator restarted while its servers ran on rebuilds the cluster from them: this file
//! gathers what they hold over QUIC; what to make of it is the coordinator machine's
//! ([`syncopate_engine::coordinator::rebuild`], which the simulator drives too).
//!
//! When the coordinator comes back at the same address:
//! 1. every server that lost it rejoins under its old id; the coordinator asks each for its
//!    [`Holdings`] and keeps the answer back;
//! 2. once every server has rejoined, or [`REJOIN_WAIT_MS`] after the first did (the engine's
//!    [`Gathering`] decides, as in the simulator), the machine rebuilds the map from the
//!    holdings ([`CoordinatorMachine::rebuild`]): a server claiming a
//!    stale term is refused (it stops, as it would have), backups whose primary did not come
//!    back are promoted, a swap some servers committed is finished on the others;
//! 3. the newest policy a live server runs becomes the cluster's; once the machine's commands
//!    are done ([`CoordOutput::Rebuilt`](syncopate_engine::coordinator::CoordOutput::Rebuilt))
//!    the servers are answered, and their leases start again;
//! 4. workers rejoin under their ids and get the map; shards left without a backup get a new one.
//!
//! Until step 3, servers with backups serve nothing (their leases lapsed) and workers wait.
//!
//! [`CoordinatorMachine::rebuild`]: syncopate_engine::coordinator::CoordinatorMachine::rebuild

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use syncopate_engine::coordinator::{Gathered, Gathering, Held, Reconnect, Record};

use super::{command_reply, Coordinator, PolicySource};
use crate::net::proto::{
    AdmissionKey, Holdings, PolicyBlob, RejoinRefused, ServerCommand, ServerReply, Setting, REJOIN_WAIT_MS,
};

/// The servers rejoining a restarted coordinator, until it has rebuilt the cluster.
pub(super) struct Rebuild {
    /// What they hold, and when the rebuild begins: the engine's decision, as in the simulator.
    gathering: Gathering,
    /// By server id: where each is, and what else it said.
    reports: BTreeMap<u32, Rejoined>,
    /// Once rebuilt: the servers refused, and why.
    refused: BTreeMap<u32, RejoinRefused>,
}

impl Rebuild {
    fn new(servers: u32) -> Self {
        Rebuild { gathering: Gathering::new(servers), reports: BTreeMap::new(), refused: BTreeMap::new() }
    }
}

/// A server that rejoined.
struct Rejoined {
    /// Where workers reach it.
    addr: SocketAddr,
    /// The connection it rejoined on.
    conn: quinn::Connection,
    /// The policy its shards run (what it holds is the gathering's).
    policy: PolicyBlob,
    /// The module its shards run.
    wasm: Vec<u8>,
}

/// The file in the checkpoint directory where the coordinator records the shards' terms at
/// each promotion, and the servers' addresses, so that a restarted one knows a term no
/// surviving server heard of, and where a server lost before the restart listened.
pub(super) const TERMS_FILE: &str = "terms.json";

/// The coordinator's record ([`Record`]) as written, with the cluster it belongs to. A file
/// written before the servers' addresses were recorded reads with none.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct RecordedTerms {
    /// SHA-256 of the cluster's admission key (the key itself stays secret): a file left by
    /// another cluster in the same directory is ignored.
    cluster: [u8; 32],
    /// The shards' terms and the servers' addresses.
    #[serde(flatten)]
    record: Record,
}

fn cluster_of(key: AdmissionKey) -> [u8; 32] {
    Sha256::digest(key.0).into()
}

/// Whether a rejoining server belongs to the cluster this coordinator was started for.
fn same_cluster(
    ours: &crate::net::proto::ClusterSettings,
    theirs: &crate::net::proto::ClusterSettings,
) -> Result<(), RejoinRefused> {
    let differs =
        |setting, ours: String, theirs: String| Err(RejoinRefused::OtherSettings { setting, ours, theirs });
    if ours.shards != theirs.shards {
        return differs(Setting::Shards, ours.shards.to_string(), theirs.shards.to_string());
    }
    if ours.servers != theirs.servers {
        return differs(Setting::Servers, ours.servers.to_string(), theirs.servers.to_string());
    }
    if ours.replicas != theirs.replicas {
        return differs(Setting::Replicas, ours.replicas.to_string(), theirs.replicas.to_string());
    }
    if ours.max_workers != theirs.max_workers {
        return differs(Setting::MaxWorkers, ours.max_workers.to_string(), theirs.max_workers.to_string());
    }
    if ours.optimizer != theirs.optimizer
        || ours.push_weight != theirs.push_weight
        || ours.seed != theirs.seed
    {
        return differs(
            Setting::Training,
            format!("{:?} {:?} seed {}", ours.optimizer, ours.push_weight, ours.seed),
            format!("{:?} {:?} seed {}", theirs.optimizer, theirs.push_weight, theirs.seed),
        );
    }
    Ok(())
}

/// Asks a server what it holds; its policy module comes as the payload.
async fn ask_holdings(conn: &quinn::Connection) -> Result<(Holdings, Vec<u8>), RejoinRefused> {
    match command_reply(conn, &ServerCommand::Holdings, &[])
        .await
        .map_err(|e| RejoinRefused::NoHoldings(e.to_string()))?
    {
        (ServerReply::Holdings(h), wasm) => Ok((*h, wasm)),
        (other, _) => Err(RejoinRefused::NoHoldings(format!("it answered {other:?}"))),
    }
}

impl Coordinator {
    /// Records the shards' terms and the servers' addresses in the checkpoint directory, if
    /// there is one (crash-safe; a failure is logged, and the restart's rebuild then has the
    /// servers' word only).
    pub(super) async fn record(&self, record: Record, key: AdmissionKey) {
        let Some(dir) = self.opts.checkpoint_dir.clone() else { return };
        let file = RecordedTerms { cluster: cluster_of(key), record };
        let bytes = serde_json::to_vec(&file).expect("terms serialize");
        let written = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            crate::checkpoint::write_atomic(&dir.join(TERMS_FILE), &bytes).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        match written {
            Ok(()) => self.lock().recorded = file.record,
            Err(e) => tracing::warn!("cannot record the shards' terms: {e}"),
        }
    }

    /// The terms the coordinator before this one recorded for this cluster, if any.
    async fn recorded(&self, key: AdmissionKey) -> Record {
        let Some(path) = self.opts.checkpoint_dir.as_ref().map(|d| d.join(TERMS_FILE)) else {
            return Record::default();
        };
        let read = tokio::task::spawn_blocking(move || std::fs::read(&path)).await;
        let Ok(Ok(bytes)) = read else { return Record::default() };
        match serde_json::from_slice::<RecordedTerms>(&bytes) {
            Ok(RecordedTerms { cluster, record })
                if cluster == cluster_of(key)
                    && record.terms.len() == self.opts.shards as usize
                    && record.servers.len() <= self.opts.servers as usize =>
            {
                record
            }
            Ok(_) => {
                tracing::warn!("ignoring {TERMS_FILE}: it belongs to another cluster");
                Record::default()
            }
            Err(e) => {
                tracing::warn!("ignoring {TERMS_FILE}: {e}");
                Record::default()
            }
        }
    }

    /// Server `id` at `addr` comes back on `conn`: to this coordinator after its restart (the
    /// cluster is rebuilt first), or after losing its connection to it. `Ok` once it may be
    /// welcomed under its id; `Err` says why not.
    pub(super) async fn rejoin_server(
        self: Arc<Self>,
        id: u32,
        addr: SocketAddr,
        conn: &quinn::Connection,
    ) -> Result<(), RejoinRefused> {
        if id >= self.opts.servers {
            return Err(RejoinRefused::NoSuchServer { server: id, servers: self.opts.servers });
        }
        // Checked before anything changes here: a server of another cluster (or one welcomed
        // with other flags) leaves this coordinator as it was.
        let (holdings, wasm) = ask_holdings(conn).await?;
        if holdings.held.server != id {
            return Err(RejoinRefused::HoldsAnother { said: id, holds: holdings.held.server });
        }
        same_cluster(&self.settings(&self.lock()), &holdings.settings)?;
        let complete = {
            let mut st = self.lock();
            if st.rebuild.is_none() {
                if !st.conns.is_empty() {
                    // Not a restart: this coordinator has run all along, and the server lost its
                    // connection to it.
                    return match st.machine.reconnect_server(self.now_ns(), id, addr) {
                        Ok(()) => {
                            st.conns[id as usize] = Some(conn.clone());
                            tracing::warn!(server = id, %addr, "server reconnected");
                            Ok(())
                        }
                        Err(Reconnect::Lease(e)) => Err(RejoinRefused::Lease(e)),
                        Err(Reconnect::NotRegistered { .. }) => {
                            Err(RejoinRefused::NotRegistered { server: id, addr })
                        }
                    };
                }
                st.rebuild = Some(Rebuild::new(self.opts.servers));
                // The workers hold tickets issued under the old coordinator's key: keep it.
                st.admission_key = holdings.settings.admission_key;
                tracing::warn!(
                    server = id,
                    "a server rejoins: this coordinator restarted while the cluster ran on; rebuilding it \
                     from the servers (waiting up to {} ms for all {})",
                    REJOIN_WAIT_MS,
                    self.opts.servers
                );
            }
            if holdings.settings.admission_key != st.admission_key {
                return Err(RejoinRefused::OtherCluster(id));
            }
            let now_ns = self.now_ns();
            let rebuild = st.rebuild.as_mut().expect("made above");
            let Holdings { policy, held, .. } = holdings;
            let gathered = rebuild.gathering.rejoined(now_ns, held).map_err(RejoinRefused::Gather)?;
            rebuild.reports.insert(id, Rejoined { addr, conn: conn.clone(), policy, wasm });
            match gathered {
                Gathered::Complete => true,
                Gathered::Waiting { due_ns, first } => {
                    if first {
                        let me = self.clone();
                        let wait = Duration::from_nanos(due_ns.saturating_sub(now_ns));
                        tokio::spawn(async move {
                            tokio::time::sleep(wait).await;
                            me.begin_rebuild();
                        });
                    }
                    false
                }
            }
        };
        if complete {
            self.begin_rebuild();
        }
        let _ = self.rebuilt.subscribe().wait_for(|r| *r).await;
        match self.lock().rebuild.as_ref().and_then(|r| r.refused.get(&id).cloned()) {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    /// Starts the rebuild, once (the wait after the first server and the last server's report
    /// may both ask).
    fn begin_rebuild(self: &Arc<Self>) {
        let held = match self.lock().rebuild.as_mut().and_then(|r| r.gathering.begin()) {
            Some(held) => held,
            None => return,
        };
        tokio::spawn(self.clone().rebuild(held));
    }

    /// Rebuilds the cluster from the rejoined servers' holdings (the module's doc).
    async fn rebuild(self: Arc<Self>, held: BTreeMap<u32, Held>) {
        let t = Instant::now();
        let reports = std::mem::take(&mut self.lock().rebuild.as_mut().expect("rebuilding").reports);
        let holdings: Vec<Held> = held.into_values().collect();
        let n = self.opts.servers;
        let key = self.lock().admission_key;
        let recorded = self.recorded(key).await;
        let rebuilt = {
            let mut st = self.lock();
            let now_ns = self.now_ns();
            let addrs = reports.iter().map(|(&i, r)| (i, r.addr)).collect();
            let rebuilt = st.machine.rebuild(now_ns, &holdings, &recorded, &addrs);
            st.recorded = recorded;
            let stale = &rebuilt.resolution.stale;
            st.conns = (0..n)
                .map(|i| reports.get(&i).filter(|_| !stale.contains_key(&i)).map(|r| r.conn.clone()))
                .collect();
            // The newest policy a live server runs: the others were prepared for it, if a swap's
            // commit was under way when the old coordinator died (the machine finishes it).
            if let Some(r) = rebuilt.newest.and_then(|x| reports.get(&x)) {
                st.policy = PolicySource::from_blob(&r.policy, r.wasm.clone());
                st.history.clear();
            }
            if st.restore.take().is_some() {
                tracing::warn!(
                    "--resume ignored: the servers that ran on hold newer state than any checkpoint"
                );
            }
            if let Some(dir) = &self.opts.checkpoint_dir {
                st.machine
                    .set_next_round(crate::checkpoint::rounds(dir).into_iter().max().map_or(1, |r| r + 1));
            }
            st.rebuild.as_mut().expect("rebuilding").refused = rebuilt
                .resolution
                .stale
                .iter()
                .map(|(&server, &shard)| {
                    tracing::error!(
                        server,
                        shard,
                        "a rejoining server was failed over before the restart; it stops"
                    );
                    (server, RejoinRefused::FailedOver { shard })
                })
                .collect();
            rebuilt
        };
        for (k, place) in rebuilt.resolution.places.iter().enumerate() {
            match rebuilt.resolution.outdated.get(&(k as u32)) {
                _ if place.is_some() => {}
                Some((newest, held)) => tracing::error!(
                    shard = k,
                    newest,
                    held,
                    "shard lost: no server holding its newest term came back, and the older copies that \
                     did lack the pushes acknowledged since; they are not served"
                ),
                None => tracing::error!(shard = k, "shard lost: no rejoining server holds it"),
            }
        }
        for &(shard, to) in &rebuilt.resolution.promote {
            tracing::warn!(shard, to, "failover: promoting a backup (its primary did not rejoin)");
        }
        for server in &rebuilt.missing {
            tracing::error!(server, "server did not rejoin; its shards went to their backups");
        }
        tracing::warn!(
            rejoined = reports.len(),
            missing = ?rebuilt.missing,
            promoted = rebuilt.resolution.promote.len(),
            ms = t.elapsed().as_millis() as u64,
            "cluster rebuilt from the servers' holdings"
        );
        // The machine's commands (promotions, dropped backups, an interrupted swap's commit),
        // then `CoordOutput::Rebuilt` (`rebuilt_out`), then new backups.
        self.drive().await;
    }

    /// The machine carried out a rebuild's commands: the cluster serves again, and the servers
    /// and workers waiting for it are answered.
    pub(super) fn rebuilt_out(&self) {
        if self.lock().machine.has_started() {
            // Training was under way: its start barrier had opened.
            self.started.send_replace(true);
        }
        self.replicated.send_replace(true);
        self.registered.send_replace(self.opts.servers);
        self.rebuilt.send_replace(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `terms.json` as this build writes it, and as builds before the servers' addresses were
    /// recorded wrote it (read with none): the file's format, pinned.
    #[test]
    fn the_recorded_terms_file_reads_as_written_and_without_addresses_as_before() {
        let servers = vec![SocketAddr::from(([127, 0, 0, 1], 7071))];
        let file = RecordedTerms { cluster: [7; 32], record: Record { terms: vec![0, 2], servers } };
        let json = serde_json::to_string(&file).expect("serializes");
        let cluster = format!("[{}]", ["7"; 32].join(","));
        assert_eq!(json, format!(r#"{{"cluster":{cluster},"terms":[0,2],"servers":["127.0.0.1:7071"]}}"#));
        assert_eq!(serde_json::from_str::<RecordedTerms>(&json).expect("reads"), file);
        let before = format!(r#"{{"cluster":{cluster},"terms":[0,2]}}"#);
        let read = serde_json::from_str::<RecordedTerms>(&before).expect("reads");
        assert_eq!(read.record, Record { terms: vec![0, 2], servers: vec![] });
    }
}
