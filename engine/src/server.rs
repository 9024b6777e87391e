//! A server's own state, beside its shards: what it holds and at which term, what the
//! coordinator told it of every shard's term, which workers' connections ended, and which
//! connection each worker's memberships came in on. One owner, no I/O: the tokio server keeps
//! one [`ServerState`] behind one lock, so each change below happens whole, and no two of them
//! interleave halfway.
//!
//! What it decides:
//! - **Promotion sees every worker gone** ([`ServerState::promoted`]): a backup becomes a
//!   primary and learns, in the same step, every worker whose connection here ended; a
//!   connection that ends ([`ServerState::connection_ended`]) marks its worker gone and names
//!   every primary to tell, in one step too. Whichever comes first, the promoted shard hears of
//!   the worker once: it never waits for a worker that will not come back until the promoted
//!   shard's backstop. (With two locks, a promotion that read the workers gone before it became
//!   a primary could miss a connection that ended in between, and wait out the backstop.)
//! - **A connection's end takes only its own memberships**: a restarted worker may connect and
//!   join again before its old connection is seen to end; that ending leaves the shards only
//!   where the old connection was the last to join, and marks the worker gone only if no newer
//!   connection came ([`ServerState::connection_ended`]).
//! - **Every membership has a connection to end it**: a join answered after its connection
//!   ended (the answer waits for the shard's backup) goes to the worker's newest connection, or,
//!   with none left, makes the worker leave at once ([`ServerState::joined`]).
//! - **Terms**: a primary's term is the one it started or was promoted at (each promotion adds
//!   one), a backup's is its primary's (told when the primary's stream opens); the newest term
//!   the coordinator told of each shard only grows, and is bounded by the cluster's shards. A
//!   restarted coordinator reads them ([`ServerState::term`], [`ServerState::known_terms`]).
//!
//! The handle `H` is the driver's way to reach a shard (a channel to its task in the tokio
//! server); the state only stores and returns it.

use std::collections::{BTreeMap, BTreeSet};

use syncopate_policy_sdk::abi::WorkerId;

/// A connection, as the driver names it (QUIC's `stable_id`).
pub type ConnId = usize;

/// What a connection's end means ([`ServerState::connection_ended`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended<H> {
    /// The primaries the worker leaves: those this connection was the last to join (shard,
    /// handle).
    pub leave: Vec<(u32, H)>,
    /// Every primary to tell that the worker is gone (promoted shards may await it still: it
    /// joined them on their old primary); empty when a newer connection of the worker came.
    pub lost: Vec<(u32, H)>,
}

/// One server's own state; see the module docs.
#[derive(Clone, Debug)]
pub struct ServerState<H> {
    /// The cluster's shards: every shard id and length from a peer is bounded by it.
    shards: u32,
    primaries: BTreeMap<u32, H>,
    backups: BTreeMap<u32, H>,
    /// Per shard held here (or held once: a deposed primary keeps its term).
    terms: BTreeMap<u32, u64>,
    /// Per shard, the newest term the coordinator told of.
    known: Vec<u64>,
    /// Workers whose connection here ended and who have not connected again.
    gone: BTreeSet<WorkerId>,
    /// The connection each worker came in on last.
    newest: BTreeMap<WorkerId, ConnId>,
    /// Every worker's connection that has not ended.
    live: BTreeSet<(WorkerId, ConnId)>,
    /// The connection that joined each (worker, shard) membership.
    joined_by: BTreeMap<(WorkerId, u32), ConnId>,
}

impl<H: Clone> ServerState<H> {
    /// A server of a cluster of `shards` shards, holding nothing yet.
    pub fn new(shards: u32) -> ServerState<H> {
        ServerState {
            shards,
            primaries: BTreeMap::new(),
            backups: BTreeMap::new(),
            terms: BTreeMap::new(),
            known: Vec::new(),
            gone: BTreeSet::new(),
            newest: BTreeMap::new(),
            live: BTreeSet::new(),
            joined_by: BTreeMap::new(),
        }
    }

    /// It holds `shard`'s primary (from its start, or restored), at term 0 unless it held it
    /// before.
    pub fn hold_primary(&mut self, shard: u32, handle: H) {
        self.primaries.insert(shard, handle);
        self.terms.entry(shard).or_insert(0);
    }

    /// It keeps a backup of `shard`, replacing any older one; at term 0 until its primary's
    /// stream says.
    pub fn hold_backup(&mut self, shard: u32, handle: H) {
        self.backups.insert(shard, handle);
        self.terms.entry(shard).or_insert(0);
    }

    /// The primary of `shard` here, if it holds it.
    pub fn primary(&self, shard: u32) -> Option<&H> {
        self.primaries.get(&shard)
    }

    /// The backup of `shard` here, if it keeps one.
    pub fn backup(&self, shard: u32) -> Option<&H> {
        self.backups.get(&shard)
    }

    /// Every primary here, by shard.
    pub fn primaries(&self) -> Vec<(u32, H)> {
        self.primaries.iter().map(|(s, h)| (*s, h.clone())).collect()
    }

    /// Every backup here, by shard.
    pub fn backups(&self) -> Vec<(u32, H)> {
        self.backups.iter().map(|(s, h)| (*s, h.clone())).collect()
    }

    /// The term of `shard` here (0 if it holds nothing of it).
    pub fn term(&self, shard: u32) -> u64 {
        self.terms.get(&shard).copied().unwrap_or(0)
    }

    /// `shard`'s primary opened its stream to the backup here at `term`: the backup follows it.
    /// Returns the backup's handle, or `None` if it keeps none (or the shard does not exist).
    pub fn stream_opened(&mut self, shard: u32, term: u64) -> Option<H> {
        if shard >= self.shards {
            return None;
        }
        self.terms.insert(shard, term);
        self.backups.get(&shard).cloned()
    }

    /// The backup of `shard` is to be promoted: it is taken from the backups (the driver
    /// promotes it, then calls [`promoted`](Self::promoted)). `None`: it keeps no backup of it.
    pub fn take_backup(&mut self, shard: u32) -> Option<H> {
        self.backups.remove(&shard)
    }

    /// `shard`'s backup was promoted: it is a primary here now, one term on, and must hear of
    /// every worker whose connection here ended (returned), in the same step.
    pub fn promoted(&mut self, shard: u32, handle: H) -> Vec<WorkerId> {
        self.primaries.insert(shard, handle);
        *self.terms.entry(shard).or_default() += 1;
        self.gone.iter().copied().collect()
    }

    /// The coordinator's lease answer told every shard's term: the newest each shard was told
    /// of is kept (only the cluster's shards).
    pub fn renewed(&mut self, terms: &[u64]) {
        let n = terms.len().min(self.shards as usize);
        if self.known.len() < n {
            self.known.resize(n, 0);
        }
        for (k, t) in self.known.iter_mut().zip(terms) {
            *k = (*k).max(*t);
        }
    }

    /// The newest term the coordinator told of each shard, by shard.
    pub fn known_terms(&self) -> &[u64] {
        &self.known
    }

    /// Worker `worker` connected on `conn`: it is not gone, and its memberships are this
    /// connection's once it joins.
    pub fn connected(&mut self, worker: WorkerId, conn: ConnId) {
        self.gone.remove(&worker);
        self.newest.insert(worker, conn);
        self.live.insert((worker, conn));
    }

    /// Worker `worker`'s join of `shard` on `conn` was answered: the membership is that
    /// connection's, or, if it ended meanwhile (a join's answer waits for the shard's backup,
    /// which may take as long as a failover), the worker's newest connection's. If the worker
    /// has no connection left here, nothing would ever end the membership: the primary to make
    /// it leave now is returned.
    pub fn joined(&mut self, worker: WorkerId, shard: u32, conn: ConnId) -> Option<H> {
        let owner = match self.live.contains(&(worker, conn)) {
            true => conn,
            false => match self.newest.get(&worker) {
                Some(&newer) => newer,
                None => return self.primaries.get(&shard).cloned(),
            },
        };
        self.joined_by.insert((worker, shard), owner);
        None
    }

    /// Worker `worker` left `shard` on `conn` (its goodbye): the membership goes if `conn` was
    /// the one that joined.
    pub fn left(&mut self, worker: WorkerId, shard: u32, conn: ConnId) {
        if self.joined_by.get(&(worker, shard)) == Some(&conn) {
            self.joined_by.remove(&(worker, shard));
        }
    }

    /// Worker `worker`'s connection `conn` ended: the primaries it leaves (the memberships this
    /// connection was the last to join), and, unless a newer connection of the worker came,
    /// every primary to tell it is gone (it is marked gone in the same step).
    pub fn connection_ended(&mut self, worker: WorkerId, conn: ConnId) -> Ended<H> {
        self.live.remove(&(worker, conn));
        let mine: Vec<u32> = self
            .joined_by
            .range((worker, 0)..=(worker, u32::MAX))
            .filter(|(_, c)| **c == conn)
            .map(|((_, shard), _)| *shard)
            .collect();
        let mut leave = Vec::new();
        for shard in mine {
            self.joined_by.remove(&(worker, shard));
            if let Some(h) = self.primaries.get(&shard) {
                leave.push((shard, h.clone()));
            }
        }
        if self.newest.get(&worker) != Some(&conn) {
            return Ended { leave, lost: Vec::new() };
        }
        self.newest.remove(&worker);
        self.gone.insert(worker);
        Ended { leave, lost: self.primaries() }
    }

    /// The workers connected here now (each by its newest connection).
    pub fn connected_workers(&self) -> BTreeSet<WorkerId> {
        self.newest.keys().copied().collect()
    }

    /// Whether `worker` is gone (its last connection here ended).
    pub fn is_gone(&self, worker: WorkerId) -> bool {
        self.gone.contains(&worker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server with shard 0's primary and shard 1's backup; worker 7 joined shard 0 on
    /// connection 70.
    fn server() -> ServerState<&'static str> {
        let mut s = ServerState::new(2);
        s.hold_primary(0, "p0");
        s.hold_backup(1, "b1");
        s.connected(7, 70);
        assert_eq!(s.joined(7, 0, 70), None);
        s
    }

    /// The interleaving that once left a promoted shard waiting for its backstop: worker 7's
    /// connection ends while shard 1's backup is being promoted. Whichever step comes first,
    /// the promoted shard hears that the worker is gone, from one or the other.
    #[test]
    fn a_promotion_and_a_connections_end_in_either_order_tell_the_promoted_shard() {
        // The connection ends first: the promotion finds the worker gone.
        let mut s = server();
        let b = s.take_backup(1).unwrap();
        let ended = s.connection_ended(7, 70);
        assert_eq!(ended.leave, vec![(0, "p0")]);
        assert_eq!(ended.lost, vec![(0, "p0")]);
        assert_eq!(s.promoted(1, b), vec![7]);
        // The promotion first: the connection's end names the promoted shard among the
        // primaries to tell.
        let mut s = server();
        let b = s.take_backup(1).unwrap();
        assert_eq!(s.promoted(1, b), Vec::<WorkerId>::new());
        let ended = s.connection_ended(7, 70);
        assert_eq!(ended.lost, vec![(0, "p0"), (1, "b1")]);
        assert_eq!((s.term(1), s.primary(1)), (1, Some(&"b1")));
        assert!(s.backup(1).is_none());
    }

    /// A restarted worker connected and joined again before its old connection was seen to end:
    /// that end takes none of the new connection's memberships and does not mark it gone.
    #[test]
    fn an_old_connections_end_leaves_a_newer_ones_memberships_alone() {
        let mut s = server();
        s.connected(7, 71);
        assert_eq!(s.joined(7, 0, 71), None);
        assert_eq!(s.connection_ended(7, 70), Ended { leave: vec![], lost: vec![] });
        assert!(!s.is_gone(7));
        let ended = s.connection_ended(7, 71);
        assert_eq!((ended.leave.len(), ended.lost.len()), (1, 1));
        assert!(s.is_gone(7));
        // It comes back: gone no more.
        s.connected(7, 72);
        assert!(!s.is_gone(7));
    }

    /// A join's answer waited (for the shard's backup) while the joining connection ended:
    /// the membership is the worker's newest connection's, and with none left the worker
    /// leaves at once, or it would stay a member nobody ends (soak seed 45605: a late joiner
    /// died while its join waited out a dead backup, and the shards waited for it for ever).
    #[test]
    fn a_join_answered_after_its_connection_ended_goes_to_the_newest_or_leaves() {
        let mut s = server();
        s.connected(7, 71);
        assert_eq!(s.connection_ended(7, 70).leave, vec![(0, "p0")]);
        // Connection 70's join of a shard, answered now: connection 71 owns it.
        assert_eq!(s.joined(7, 0, 70), None);
        assert_eq!(s.connection_ended(7, 71).leave, vec![(0, "p0")]);
        // No connection left: the answer comes to nobody, and the worker leaves.
        assert_eq!(s.joined(7, 0, 71), Some("p0"));
        assert_eq!(s.connection_ended(7, 71), Ended { leave: vec![], lost: vec![] });
        // A shard not a primary here has nobody to tell.
        assert_eq!(s.joined(7, 1, 71), None);
    }

    #[test]
    fn a_goodbye_on_an_old_connection_keeps_the_newer_membership() {
        let mut s = server();
        s.connected(7, 71);
        assert_eq!(s.joined(7, 0, 71), None);
        s.left(7, 0, 70);
        assert_eq!(s.connection_ended(7, 71).leave, vec![(0, "p0")]);
    }

    #[test]
    fn terms_follow_streams_and_promotions_and_known_terms_only_grow_within_the_shards() {
        let mut s = server();
        assert_eq!(s.stream_opened(1, 4), Some("b1"));
        assert_eq!(s.stream_opened(9, 4), None);
        assert_eq!(s.term(9), 0);
        let b = s.take_backup(1).unwrap();
        s.promoted(1, b);
        assert_eq!(s.term(1), 5);
        s.renewed(&[2, 6, 9, 9]);
        s.renewed(&[1, 7]);
        assert_eq!(s.known_terms(), &[2, 7]);
    }
}
