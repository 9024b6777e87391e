//! A restarted coordinator's rebuild of the cluster from what its servers hold.
//!
//! The coordinator's state is a map (which server is each shard's primary and backup), the
//! policy with its swap count, and the servers' leases. The servers hold all of it too: each
//! keeps its shards with their terms (a shard's term counts its promotions) and the policy it
//! runs. So a coordinator that comes back while its servers ran on asks each rejoining server
//! what it holds ([`Held`]) and rebuilds from the answers
//! ([`CoordinatorMachine::rebuild`](super::CoordinatorMachine::rebuild)):
//! - each shard's primary is the holder of its highest term ([`resolve`]); a server claiming a
//!   lower term was failed over before the old coordinator died, and is refused (it stops, as
//!   it would have); a shard whose primary did not come back has its backup promoted;
//! - a term is known from the copies that came back, and also from what every server heard:
//!   each lease renewal's answer tells a server every shard's term ([`Held::known`]). A shard
//!   whose newest term some server heard of but whose copies at that term all died is lost,
//!   not served from an older copy, which lacks the pushes acknowledged since. The terms the old
//!   coordinator recorded, if its driver kept them (on disk), count the same way; without them
//!   a term no surviving server heard of escapes this (with two servers, one cut off and failed
//!   over and the other dead, nobody knows better than the stale copy).
//! - a swap that some servers committed and others had only prepared is finished on the others,
//!   with the levelling the committed ones applied;
//! - once those commands are done, shards left without a backup get a new one.
//!
//! Nothing acknowledged is lost: a push was acknowledged only once on a primary and its backup,
//! and a primary survives here unless it was failed over, in which case its backup, which holds
//! every acknowledged push, is the higher term. Two drivers run it: the tokio coordinator
//! (`host/src/coordinator/rebuild.rs`, which gathers the answers over QUIC) and the simulator
//! (`host/src/lab/sim/control.rs`, which crashes and restarts the coordinator in virtual time).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::placement::Place;
use crate::shard::ClockRaise;

/// How long a restarted coordinator waits, after the first server rejoined, for the others
/// before it rebuilds the cluster without them (10 s).
pub const REJOIN_WAIT_MS: u64 = 10_000;

/// What a rejoining server says it holds (on the wire, inside the host's `Holdings`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// Its id.
    pub server: u32,
    /// Swaps committed on it so far.
    pub swaps: u64,
    /// What the newest swap it knows of (committed, or run by a copy: `copies`) raised the
    /// workers' clocks by.
    pub levelled: Vec<ClockRaise>,
    /// Shards it is primary for: `(shard, term, parameters)`, 0 parameters before the shard's
    /// creation.
    pub primaries: Vec<(u32, u64, u64)>,
    /// Shards it keeps backups of: `(shard, the term of the primary it follows, parameters)`.
    pub backups: Vec<(u32, u64, u64)>,
    /// Per shard, the newest term it heard of from the coordinator (each lease renewal's answer
    /// says every shard's term), whether it holds the shard or not: empty if it heard none.
    pub known: Vec<u64>,
    /// The newest swap any copy it holds runs (a backup runs a swap its primary committed and
    /// streamed, which this server may not have committed yet: it has prepared it).
    pub copies: u64,
}

impl Held {
    /// The newest swap it knows of: committed, or run by one of its copies.
    pub fn newest_swap(&self) -> u64 {
        self.swaps.max(self.copies)
    }
}

/// What the holdings say about the map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// Per shard: its place, or `None` when no server holds it any more (lost).
    pub places: Vec<Option<Place>>,
    /// Backups to promote, `(shard, server)`: their primaries did not come back.
    pub promote: Vec<(u32, u32)>,
    /// Servers that claim a shard at a stale term (failed over before the restart), with the
    /// shard that shows it.
    pub stale: BTreeMap<u32, u32>,
    /// Shards lost because only older copies came back: `(the newest term a server heard of,
    /// the newest held)`. Serving the older copy would drop the pushes acknowledged since.
    pub outdated: BTreeMap<u32, (u64, u64)>,
}

impl Resolution {
    /// The model's length: every shard's parameters on its primary (a promoted one reported
    /// them as a backup). `None` before every shard was created, that is before training began.
    pub fn model_len(&self, held: &[Held]) -> Option<u64> {
        let len = |k: u32, place: &Option<Place>| {
            let primary = place.as_ref()?.primary;
            let h = held.iter().find(|h| h.server == primary)?;
            let all = h.primaries.iter().chain(&h.backups);
            all.filter(|c| c.0 == k).map(|c| c.2).find(|&l| l > 0)
        };
        self.places.iter().enumerate().map(|(k, p)| len(k as u32, p)).sum()
    }
}

/// Resolves the map of `shards` shards from the servers' holdings and the terms the old
/// coordinator recorded (`recorded`, by shard; empty if none were kept). See the module's doc.
pub fn resolve(shards: u32, held: &[Held], recorded: &[u64]) -> Resolution {
    let mut stale: BTreeMap<u32, u32> = BTreeMap::new();
    // (Found outdated in one pass, a shard stays so: the next only leaves its stale claimants out.)
    let mut outdated = BTreeMap::new();
    // A stale server stops, so whatever else it holds is resolved again without it.
    loop {
        let live: Vec<&Held> = held.iter().filter(|h| !stale.contains_key(&h.server)).collect();
        let mut places = Vec::with_capacity(shards as usize);
        let mut promote = Vec::new();
        let mut found = BTreeMap::new();
        for k in 0..shards {
            // Every rejoined server's word counts here, a stale one's too: it heard of the term
            // before it was cut off.
            let heard = held.iter().filter_map(|h| h.known.get(k as usize).copied());
            let known = heard.chain(recorded.get(k as usize).copied()).max().unwrap_or(0);
            let of = |list: fn(&Held) -> &[(u32, u64, u64)]| -> Vec<(u32, u64)> {
                live.iter()
                    .flat_map(|h| list(h).iter().filter(|c| c.0 == k).map(|c| (h.server, c.1)))
                    .collect()
            };
            let primaries = of(|h| &h.primaries);
            let backups = of(|h| &h.backups);
            let Some(newest_held) = primaries.iter().chain(&backups).map(|c| c.1).max() else {
                places.push(None);
                continue;
            };
            let top = newest_held.max(known);
            for &(server, term) in &primaries {
                if term < top {
                    found.entry(server).or_insert(k);
                }
            }
            if newest_held < top {
                // Its newest copies did not come back.
                outdated.insert(k, (top, newest_held));
                places.push(None);
                continue;
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
            return Resolution { places, promote, stale, outdated };
        }
        stale.extend(found);
    }
}

/// What a rebuild decided, for its driver: whom to refuse and whose policy is the cluster's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebuilt {
    /// The resolved map and what it takes.
    pub resolution: Resolution,
    /// Servers that did not rejoin: their shards went to their backups.
    pub missing: Vec<u32>,
    /// The rejoined, not stale, server whose policy is the newest (the most swaps): the cluster's
    /// policy. `None` if none rejoined.
    pub newest: Option<u32>,
}

/// A restarted coordinator gathering what the servers that rejoin it hold, until it rebuilds:
/// once every server has rejoined, or [`REJOIN_WAIT_MS`] after the first did, whichever comes
/// first. A server that comes after the rebuild began is refused (it stops); one that rejoins
/// twice is refused the second time. Both drivers gather with it: the tokio coordinator
/// (`host/src/coordinator/rebuild.rs`, over QUIC) and the simulator.
#[derive(Clone, Debug, PartialEq)]
pub struct Gathering {
    servers: u32,
    held: BTreeMap<u32, Held>,
    /// When the rebuild is due (after the first report).
    due_ns: Option<u64>,
    begun: bool,
}

/// A rejoining server's report, counted ([`Gathering::rejoined`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gathered {
    /// The rebuild begins at `due_ns` unless every server rejoins first; `first`: this was the
    /// first report, and the driver arms its timer for then.
    Waiting {
        /// When the rebuild is due.
        due_ns: u64,
        /// Whether this report was the first.
        first: bool,
    },
    /// Every server has rejoined: rebuild now ([`Gathering::begin`]).
    Complete,
}

/// Why a rejoining server's report is refused (on the wire as it is).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum GatherError {
    /// The rebuild has begun without it: it stops.
    #[error("the cluster was rebuilt without this server (it came back too late)")]
    TooLate,
    /// It has rejoined already.
    #[error("server {0} has already rejoined")]
    Again(u32),
    /// Not one of the cluster's server ids.
    #[error("server id {server} is not one of this cluster's {servers} servers")]
    NoSuchServer {
        /// The id it gave.
        server: u32,
        /// Servers the cluster has.
        servers: u32,
    },
}

impl Gathering {
    /// A gathering for a cluster of `servers` servers, nobody rejoined yet.
    pub fn new(servers: u32) -> Self {
        Gathering { servers, held: BTreeMap::new(), due_ns: None, begun: false }
    }

    /// A server rejoins at `now_ns` holding `held` (its id is `held.server`).
    pub fn rejoined(&mut self, now_ns: u64, held: Held) -> Result<Gathered, GatherError> {
        let server = held.server;
        if server >= self.servers {
            return Err(GatherError::NoSuchServer { server, servers: self.servers });
        }
        if self.begun {
            return Err(GatherError::TooLate);
        }
        if self.held.contains_key(&server) {
            return Err(GatherError::Again(server));
        }
        self.held.insert(server, held);
        let first = self.due_ns.is_none();
        let due_ns = *self.due_ns.get_or_insert(now_ns.saturating_add(REJOIN_WAIT_MS * 1_000_000));
        if self.held.len() as u32 == self.servers {
            return Ok(Gathered::Complete);
        }
        Ok(Gathered::Waiting { due_ns, first })
    }

    /// Whether nobody has rejoined yet.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Begins the rebuild: what the servers that rejoined hold, by server id. `None` if it has
    /// begun already (a timer and the last report can both ask).
    pub fn begin(&mut self) -> Option<BTreeMap<u32, Held>> {
        if std::mem::replace(&mut self.begun, true) {
            return None;
        }
        Some(std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
mod gathering {
    use super::*;

    const MS: u64 = 1_000_000;

    fn held(server: u32) -> Held {
        Held { server, ..Held::default() }
    }

    /// The rebuild waits for every server, but no longer than the wait after the first; it
    /// begins once, and a server that comes after it began, or twice, is refused.
    #[test]
    fn a_rebuild_begins_when_all_rejoined_or_the_wait_after_the_first_is_over_and_only_once() {
        let mut g = Gathering::new(3);
        let due = 5 * MS + REJOIN_WAIT_MS * MS;
        assert_eq!(g.rejoined(5 * MS, held(1)), Ok(Gathered::Waiting { due_ns: due, first: true }));
        assert_eq!(g.rejoined(7 * MS, held(1)), Err(GatherError::Again(1)));
        assert_eq!(g.rejoined(7 * MS, held(0)), Ok(Gathered::Waiting { due_ns: due, first: false }));
        assert_eq!(g.rejoined(7 * MS, held(3)), Err(GatherError::NoSuchServer { server: 3, servers: 3 }));
        let got = g.begin().expect("begins");
        assert_eq!(got.keys().copied().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(g.begin(), None, "once");
        assert_eq!(g.rejoined(due + 1, held(2)), Err(GatherError::TooLate));

        let mut all = Gathering::new(2);
        assert!(matches!(all.rejoined(0, held(1)), Ok(Gathered::Waiting { first: true, .. })));
        assert_eq!(all.rejoined(1, held(0)), Ok(Gathered::Complete));
        assert_eq!(all.begin().map(|h| h.len()), Some(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(server: u32, primaries: &[(u32, u64)], backups: &[(u32, u64)]) -> Held {
        Held {
            server,
            primaries: primaries.iter().map(|&(k, t)| (k, t, 10)).collect(),
            backups: backups.iter().map(|&(k, t)| (k, t, 10)).collect(),
            ..Held::default()
        }
    }

    fn place(primary: u32, backup: Option<u32>) -> Option<Place> {
        Some(Place { primary, backup })
    }

    #[test]
    fn an_undisturbed_cluster_is_rebuilt_as_it_was() {
        let hs =
            [held(0, &[(0, 0)], &[(2, 0)]), held(1, &[(1, 0)], &[(0, 0)]), held(2, &[(2, 0)], &[(1, 0)])];
        let r = resolve(3, &hs, &[]);
        assert_eq!(r.places, vec![place(0, Some(1)), place(1, Some(2)), place(2, Some(0))]);
        assert!(r.promote.is_empty() && r.stale.is_empty());
        assert_eq!(r.model_len(&hs), Some(30));
    }

    #[test]
    fn a_primary_that_did_not_rejoin_has_its_backup_promoted() {
        let hs = [held(1, &[(1, 0)], &[(0, 0)]), held(2, &[(2, 0)], &[(1, 0)])];
        let r = resolve(3, &hs, &[]);
        assert_eq!(r.places, vec![place(1, None), place(1, Some(2)), place(2, None)]);
        assert_eq!(r.promote, vec![(0, 1)]);
        assert!(r.stale.is_empty());
        // Shard 0's parameters come from its promoted backup's report.
        assert_eq!(r.model_len(&hs), Some(30));
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
        let r = resolve(3, &hs, &[]);
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
        let r = resolve(1, &hs, &[]);
        assert_eq!(r.stale, BTreeMap::from([(0, 0)]));
        assert_eq!(r.places, vec![place(2, None)]);
        assert_eq!(r.promote, vec![(0, 2)]);
    }

    #[test]
    fn a_shard_whose_newest_copies_died_is_lost_not_served_stale() {
        // Server 0 was cut off and failed over: shard 0 went to server 1 at term 1, and every
        // server that renewed heard so. Server 1 died before the restart; server 0 comes back
        // claiming shard 0 at term 0 and server 2, which heard of term 1, comes back too.
        let mut hs = [held(0, &[(0, 0)], &[]), held(2, &[(2, 0)], &[])];
        hs[1].known = vec![1, 0, 0];
        let r = resolve(3, &hs, &[]);
        assert_eq!(r.places[0], None);
        assert_eq!(r.outdated, BTreeMap::from([(0, (1, 0))]));
        assert_eq!(r.stale, BTreeMap::from([(0, 0)]), "the failed-over server stops");
        // Without server 2's word, the stale copy is all the servers know of (the limit
        // above), unless the old coordinator's recorded terms say better.
        let r = resolve(3, &hs[..1], &[]);
        assert_eq!(r.places[0], place(0, None));
        assert!(r.outdated.is_empty());
        let r = resolve(3, &hs[..1], &[1, 0, 0]);
        assert_eq!(r.places[0], None);
        assert_eq!(r.outdated, BTreeMap::from([(0, (1, 0))]));
    }

    #[test]
    fn a_shard_nobody_holds_is_lost() {
        let hs = [held(1, &[(1, 0)], &[])];
        let r = resolve(2, &hs, &[]);
        assert_eq!(r.places, vec![None, place(1, None)]);
        assert_eq!(r.model_len(&hs), None, "a lost shard's length is unknown");
    }
}
