//! A coordinator restarted while its servers ran on rebuilds the cluster from them.
//!
//! The coordinator's state is a map (which server is each shard's primary and backup), the
//! policy with its swap count, and the servers' leases. The servers hold all of it too: each
//! keeps its shards, with their terms (promotions, see [`Holdings`]), and the policy it runs.
//! So when the coordinator comes back at the same address:
//!
//! 1. every server that lost it rejoins under its old id; the coordinator asks each for its
//!    [`Holdings`] and keeps the answer back;
//! 2. once every server has rejoined, or [`REJOIN_WAIT_MS`] after the first did, it resolves
//!    the map ([`resolve`]): each shard's primary is the holder of its highest term; a server
//!    claiming a lower term was failed over before the old coordinator died, and is refused (it
//!    stops, as it would have); a shard whose primary did not come back has its backup
//!    promoted;
//! 3. it finishes a swap that some servers committed and others had only prepared, takes the
//!    newest policy as the cluster's, and answers the servers, whose leases start again;
//! 4. workers rejoin under their ids and get the map; shards left without a backup get a new one.
//!
//! Until step 3, servers with backups serve nothing (their leases lapsed) and workers wait.
//! Nothing acknowledged is lost: a push was acknowledged only once on a primary and its backup,
//! and a primary survives here unless it was failed over, in which case its backup, which holds
//! every acknowledged push, is the higher term.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{command, command_reply, command_server, Coordinator, Place, PolicySource};
use crate::net::proto::{Holdings, ServerCommand, ServerReply, REJOIN_WAIT_MS};

/// The servers rejoining a restarted coordinator, until it has rebuilt the cluster.
#[derive(Default)]
pub(super) struct Rebuild {
    /// By server id.
    reports: BTreeMap<u32, Rejoined>,
    /// The rebuild has begun: no more reports.
    begun: bool,
    /// Once rebuilt: the servers refused, and why.
    refused: BTreeMap<u32, String>,
}

/// A server that rejoined.
struct Rejoined {
    /// Where workers reach it.
    addr: SocketAddr,
    /// The connection it rejoined on.
    conn: quinn::Connection,
    /// What it holds.
    holdings: Holdings,
    /// The module its shards run.
    wasm: Vec<u8>,
}

/// What the holdings say about the map.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Resolution {
    /// Per shard: its place, or `None` when no server holds it any more (lost).
    pub places: Vec<Option<Place>>,
    /// Backups to promote, `(shard, server)`: their primaries did not come back.
    pub promote: Vec<(u32, u32)>,
    /// Servers that claim a shard at a stale term (failed over before the restart), with the
    /// shard that shows it.
    pub stale: BTreeMap<u32, u32>,
}

impl Resolution {
    /// The model's length: every shard's parameters on its primary (a promoted one reported
    /// them as a backup). `None` before every shard was created, that is before training began.
    pub fn model_len(&self, holdings: &[&Holdings]) -> Option<u64> {
        let len = |k: u32, place: &Option<Place>| {
            let primary = place.as_ref()?.primary;
            let h = holdings.iter().find(|h| h.server == primary)?;
            let held = h.primaries.iter().chain(&h.backups);
            held.filter(|c| c.0 == k).map(|c| c.2).find(|&l| l > 0)
        };
        self.places.iter().enumerate().map(|(k, p)| len(k as u32, p)).sum()
    }
}

/// Resolves the map of `shards` shards from the servers' holdings (see the module's doc).
pub(super) fn resolve(shards: u32, holdings: &[&Holdings]) -> Resolution {
    let mut stale: BTreeMap<u32, u32> = BTreeMap::new();
    // A stale server stops, so whatever else it holds is resolved again without it.
    loop {
        let live: Vec<&&Holdings> = holdings.iter().filter(|h| !stale.contains_key(&h.server)).collect();
        let mut places = Vec::with_capacity(shards as usize);
        let mut promote = Vec::new();
        let mut found = BTreeMap::new();
        for k in 0..shards {
            let primaries: Vec<(u32, u64)> = live
                .iter()
                .flat_map(|h| h.primaries.iter().filter(|p| p.0 == k).map(|p| (h.server, p.1)))
                .collect();
            let backups: Vec<(u32, u64)> = live
                .iter()
                .flat_map(|h| h.backups.iter().filter(|b| b.0 == k).map(|b| (h.server, b.1)))
                .collect();
            let Some(top) = primaries.iter().chain(&backups).map(|c| c.1).max() else {
                places.push(None);
                continue;
            };
            for &(server, term) in &primaries {
                if term < top {
                    found.entry(server).or_insert(k);
                }
            }
            let current = |c: &&(u32, u64)| c.1 == top;
            match primaries.iter().filter(current).map(|c| c.0).min() {
                Some(primary) => {
                    let backup = backups.iter().filter(current).map(|c| c.0).find(|&b| b != primary);
                    places.push(Some(Place { primary, backup }));
                }
                None => {
                    let b = backups.iter().filter(current).map(|c| c.0).min().expect("the top term is held");
                    promote.push((k, b));
                    places.push(Some(Place { primary: b, backup: None }));
                }
            }
        }
        if found.is_empty() {
            return Resolution { places, promote, stale };
        }
        stale.extend(found);
    }
}

/// Whether a rejoining server belongs to the cluster this coordinator was started for.
fn same_cluster(
    ours: &crate::net::proto::ClusterSettings,
    theirs: &crate::net::proto::ClusterSettings,
) -> Result<(), String> {
    let differs = |what: &str, a: String, b: String| {
        Err(format!(
            "it was started with {what} {b}, this coordinator with {a}: restart the coordinator with the flags it had"
        ))
    };
    if ours.shards != theirs.shards {
        return differs("--shards", ours.shards.to_string(), theirs.shards.to_string());
    }
    if ours.servers != theirs.servers {
        return differs("--servers", ours.servers.to_string(), theirs.servers.to_string());
    }
    if ours.replicas != theirs.replicas {
        return differs("--replicas", ours.replicas.to_string(), theirs.replicas.to_string());
    }
    if ours.max_workers != theirs.max_workers {
        return differs("--max-workers", ours.max_workers.to_string(), theirs.max_workers.to_string());
    }
    if ours.optimizer != theirs.optimizer
        || ours.push_weight != theirs.push_weight
        || ours.seed != theirs.seed
    {
        return differs(
            "the training settings",
            format!("{:?} {:?} seed {}", ours.optimizer, ours.push_weight, ours.seed),
            format!("{:?} {:?} seed {}", theirs.optimizer, theirs.push_weight, theirs.seed),
        );
    }
    Ok(())
}

/// Asks a server what it holds; its policy module comes as the payload.
async fn ask_holdings(conn: &quinn::Connection) -> Result<(Holdings, Vec<u8>), String> {
    match command_reply(conn, &ServerCommand::Holdings, &[]).await? {
        (ServerReply::Holdings(h), wasm) => Ok((*h, wasm)),
        (other, _) => Err(format!("it answered {other:?} when asked what it holds")),
    }
}

impl Coordinator {
    /// Server `id` at `addr` comes back on `conn`: to this coordinator after its restart (the
    /// cluster is rebuilt first), or after losing its connection to it. `Ok` once it may be
    /// welcomed under its id; `Err` says why not.
    pub(super) async fn rejoin_server(
        self: Arc<Self>,
        id: u32,
        addr: SocketAddr,
        conn: &quinn::Connection,
    ) -> Result<(), String> {
        if id >= self.opts.servers {
            return Err(format!("server id {id} is not one of this cluster's {} servers", self.opts.servers));
        }
        // Checked before anything changes here: a server of another cluster (or one welcomed
        // with other flags) leaves this coordinator as it was.
        let (holdings, wasm) = ask_holdings(conn).await?;
        if holdings.server != id {
            return Err(format!("it says it is server {id}, but holds server {}'s shards", holdings.server));
        }
        same_cluster(&self.settings(&self.lock()), &holdings.settings)?;
        let complete = {
            let mut st = self.lock();
            if st.rebuild.is_none() {
                if !st.servers.is_empty() {
                    // Not a restart: this coordinator has run all along, and the server lost its
                    // connection to it.
                    let now_ns = self.now_ns();
                    return match st.servers.get(id as usize) {
                        Some((a, _)) if *a == addr || !st.machine.is_live(id) => {
                            st.machine.renew(now_ns, id).map_err(|e| e.to_string())?;
                            st.servers[id as usize].1 = Some(conn.clone());
                            tracing::warn!(server = id, %addr, "server reconnected");
                            Ok(())
                        }
                        _ => Err(format!("server {id} at {addr} is not registered here")),
                    };
                }
                st.rebuild = Some(Rebuild::default());
                // The workers hold tickets issued under the old coordinator's key: keep it.
                st.admission_key = holdings.settings.admission_key;
                tracing::warn!(
                    server = id,
                    "a server rejoins: this coordinator restarted while the cluster ran on; rebuilding it \
                     from the servers (waiting up to {} ms for all {})",
                    REJOIN_WAIT_MS,
                    self.opts.servers
                );
                let me = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(REJOIN_WAIT_MS)).await;
                    me.begin_rebuild();
                });
            }
            if holdings.settings.admission_key != st.admission_key {
                return Err(format!(
                    "server {id} was admitted by another coordinator than the servers that rejoined first \
                     (its admission key differs): it belongs to another cluster"
                ));
            }
            let Some(rebuild) = st.rebuild.as_mut().filter(|r| !r.begun) else {
                return Err("the cluster was rebuilt without this server (it came back too late)".into());
            };
            if rebuild.reports.contains_key(&id) {
                return Err(format!("server {id} has already rejoined"));
            }
            rebuild.reports.insert(id, Rejoined { addr, conn: conn.clone(), holdings, wasm });
            rebuild.reports.len() as u32 == self.opts.servers
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

    /// Starts the rebuild, once.
    fn begin_rebuild(self: &Arc<Self>) {
        {
            let mut st = self.lock();
            match st.rebuild.as_mut() {
                Some(r) if !r.begun => r.begun = true,
                _ => return,
            }
        }
        tokio::spawn(self.clone().rebuild());
    }

    /// Rebuilds the cluster from the rejoined servers' holdings (the module's doc).
    async fn rebuild(self: Arc<Self>) {
        let t = Instant::now();
        let reports = std::mem::take(&mut self.lock().rebuild.as_mut().expect("rebuilding").reports);
        let holdings: Vec<&Holdings> = reports.values().map(|r| &r.holdings).collect();
        let resolution = resolve(self.opts.shards, &holdings);
        let n = self.opts.servers;
        let missing: Vec<u32> = (0..n).filter(|i| !reports.contains_key(i)).collect();
        let refused: BTreeMap<u32, String> = resolution
            .stale
            .iter()
            .map(|(&server, &shard)| {
                tracing::error!(server, shard, "a rejoining server was failed over before the restart; it stops");
                (server, format!("this server was failed over before the coordinator restarted (shard {shard} has a newer primary)"))
            })
            .collect();
        // The newest policy a live server runs: the others were prepared for it, if a swap's
        // commit was under way when the old coordinator died.
        let live: Vec<(&u32, &Rejoined)> = reports.iter().filter(|(s, _)| !refused.contains_key(s)).collect();
        let newest = live.iter().max_by_key(|(_, r)| r.holdings.swaps).map(|(_, r)| {
            (r.holdings.swaps, r.holdings.policy.clone(), r.wasm.clone(), r.holdings.levelled.clone())
        });
        {
            let mut st = self.lock();
            let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
            st.servers = (0..n)
                .map(|i| match reports.get(&i) {
                    Some(r) if !refused.contains_key(&i) => (r.addr, Some(r.conn.clone())),
                    Some(r) => (r.addr, None),
                    None => (unspecified, None),
                })
                .collect();
            // A rejoined server's lease starts again with its next renewal, which follows the
            // welcome at once; the first heartbeat's allowance covers a slow one.
            let first = self.now_ns() + crate::net::proto::LEASE_MS * 1_000_000;
            let live: Vec<bool> = st.servers.iter().map(|(_, c)| c.is_some()).collect();
            let places = resolution
                .places
                .iter()
                .enumerate()
                .map(|(k, p)| p.unwrap_or(Place { primary: k as u32 % n, backup: None }))
                .collect();
            st.machine.rebuilt(places, &live, first, resolution.model_len(&holdings));
            if let Some((swaps, blob, wasm, _)) = &newest {
                st.machine.set_swaps(*swaps);
                st.policy = PolicySource::from_blob(blob, wasm.clone());
                st.previous = None;
            }
            if st.restore.take().is_some() {
                tracing::warn!(
                    "--resume ignored: the servers that ran on hold newer state than any checkpoint"
                );
            }
            if let Some(dir) = &self.opts.checkpoint_dir {
                st.next_round = crate::checkpoint::rounds(dir).into_iter().max().map_or(1, |r| r + 1);
            }
        }
        for (k, place) in resolution.places.iter().enumerate() {
            if place.is_none() {
                tracing::error!(shard = k, "shard lost: no rejoining server holds it");
            }
        }
        let servers = self.lock().servers.clone();
        for &(shard, server) in &resolution.promote {
            match command_server(&servers, server, &ServerCommand::Promote { shard }, &[]).await {
                Ok(_) => tracing::warn!(
                    shard,
                    to = server,
                    "failover: backup promoted (its primary did not rejoin)"
                ),
                Err(e) => tracing::error!(shard, "the backup on server {server} could not take over: {e}"),
            }
        }
        // Primaries whose backup did not come back stop waiting for it.
        for (k, place) in resolution.places.iter().enumerate() {
            if let Some(Place { primary, backup: None }) = place {
                let _ =
                    command_server(&servers, *primary, &ServerCommand::DropBackup { shard: k as u32 }, &[])
                        .await;
            }
        }
        if let Some((swaps, blob, _, levelled)) = &newest {
            for (&server, r) in &live {
                if r.holdings.swaps < *swaps {
                    // The same levelling as the servers that committed: raised alike everywhere.
                    let commit = ServerCommand::Commit { swap: *swaps, raise: levelled.clone() };
                    match command(&r.conn, &commit, &[]).await {
                        Ok(_) => {
                            tracing::warn!(server, swap = swaps, policy = %blob.label, "finished a swap the old coordinator began")
                        }
                        Err(e) => tracing::error!(
                            server,
                            swap = swaps,
                            "cannot finish the swap the old coordinator began: {e}"
                        ),
                    }
                }
            }
        }
        if self.lock().machine.model_len().is_some() {
            // Training was under way: its start barrier had opened.
            self.ready.send_replace(self.opts.workers.max(1));
        }
        self.lock().rebuild.as_mut().expect("rebuilding").refused = refused;
        self.replicated.send_replace(true);
        self.registered.send_replace(n);
        self.rebuilt.send_replace(true);
        tracing::warn!(
            rejoined = reports.len(),
            missing = ?missing,
            promoted = resolution.promote.len(),
            ms = t.elapsed().as_millis() as u64,
            "cluster rebuilt from the servers' holdings"
        );
        for server in missing {
            tracing::error!(server, "server did not rejoin; its shards went to their backups");
        }
        self.lock().machine.re_replicate();
        self.drive().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::proto::{ClusterSettings, PolicyBlob};
    use crate::shard::{OptimizerConfig, PushWeight};

    fn held(server: u32, primaries: &[(u32, u64)], backups: &[(u32, u64)]) -> Holdings {
        Holdings {
            server,
            settings: ClusterSettings {
                shards: 3,
                servers: 3,
                optimizer: OptimizerConfig::default(),
                local_sgd: crate::shard::LocalSgdConfig::default(),
                pull_codec: crate::shard::Codec::None,
                push_weight: PushWeight::default(),
                seed: 0,
                peer_timeout_ms: 1000,
                restore: None,
                replicas: 1,
                max_workers: 16,
                admission_key: crate::net::proto::AdmissionKey([7; 32]),
            },
            policy: PolicyBlob { label: "bsp".into(), sha256: [0; 32], config: vec![], overrides: vec![] },
            levelled: vec![],
            swaps: 0,
            primaries: primaries.iter().map(|&(k, t)| (k, t, 10)).collect(),
            backups: backups.iter().map(|&(k, t)| (k, t, 10)).collect(),
        }
    }

    fn place(primary: u32, backup: Option<u32>) -> Option<Place> {
        Some(Place { primary, backup })
    }

    #[test]
    fn an_undisturbed_cluster_is_rebuilt_as_it_was() {
        let hs =
            [held(0, &[(0, 0)], &[(2, 0)]), held(1, &[(1, 0)], &[(0, 0)]), held(2, &[(2, 0)], &[(1, 0)])];
        let r = resolve(3, &hs.iter().collect::<Vec<_>>());
        assert_eq!(r.places, vec![place(0, Some(1)), place(1, Some(2)), place(2, Some(0))]);
        assert!(r.promote.is_empty() && r.stale.is_empty());
        assert_eq!(r.model_len(&hs.iter().collect::<Vec<_>>()), Some(30));
    }

    #[test]
    fn a_primary_that_did_not_rejoin_has_its_backup_promoted() {
        let hs = [held(1, &[(1, 0)], &[(0, 0)]), held(2, &[(2, 0)], &[(1, 0)])];
        let r = resolve(3, &hs.iter().collect::<Vec<_>>());
        assert_eq!(r.places, vec![place(1, None), place(1, Some(2)), place(2, None)]);
        assert_eq!(r.promote, vec![(0, 1)]);
        assert!(r.stale.is_empty());
        // Shard 0's parameters come from its promoted backup's report.
        assert_eq!(r.model_len(&hs.iter().collect::<Vec<_>>()), Some(30));
    }

    #[test]
    fn a_primary_failed_over_before_the_restart_is_stale_and_all_it_holds_is_resolved_without_it() {
        // Server 0 was cut off; the old coordinator promoted shard 0's backup on server 1
        // (term 1) and re-replicated it to server 2, then died before server 0 heard.
        let hs = [
            held(0, &[(0, 0)], &[(2, 0)]),
            held(1, &[(0, 1), (1, 0)], &[]),
            held(2, &[(2, 0)], &[(0, 1), (1, 0)]),
        ];
        let r = resolve(3, &hs.iter().collect::<Vec<_>>());
        assert_eq!(r.stale, BTreeMap::from([(0, 0)]));
        // Shard 2's backup was on the stale server: it goes on without one.
        assert_eq!(r.places, vec![place(1, Some(2)), place(1, Some(2)), place(2, None)]);
        assert!(r.promote.is_empty());
    }

    #[test]
    fn a_backup_at_a_newer_term_than_any_primary_that_rejoined_is_promoted() {
        // Shard 0's promoted primary (server 1, term 1) did not rejoin, but its new backup did;
        // the old primary (term 0) is stale.
        let hs = [held(0, &[(0, 0)], &[]), held(2, &[], &[(0, 1)])];
        let r = resolve(1, &hs.iter().collect::<Vec<_>>());
        assert_eq!(r.stale, BTreeMap::from([(0, 0)]));
        assert_eq!(r.places, vec![place(2, None)]);
        assert_eq!(r.promote, vec![(0, 2)]);
    }

    #[test]
    fn a_shard_nobody_holds_is_lost() {
        let hs = [held(1, &[(1, 0)], &[])];
        let r = resolve(2, &hs.iter().collect::<Vec<_>>());
        assert_eq!(r.places, vec![None, place(1, None)]);
        assert_eq!(r.model_len(&hs.iter().collect::<Vec<_>>()), None, "a lost shard's length is unknown");
    }
}
