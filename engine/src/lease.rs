//! Leases: the rule that keeps a shard from having two primaries, both sides of it.
//!
//! A replicated server may accept pushes only while it holds a lease from the coordinator. It
//! asks for a renewal every [`HEARTBEAT_MS`]; a renewal it gets an answer to runs
//! [`LEASE_MS`] from when it **asked** ([`ServerLease`]). The coordinator counts from when it
//! **answered** ([`LeaseTable`]) and fails a server over only [`FAILOVER_MS`] after that, a
//! margin past the lease. Since the answer follows the question, the server's lease has lapsed
//! on its own clock before the coordinator promotes its backups, however the messages between
//! them were delayed or lost (one-way partitions included): a server cut off from the
//! coordinator stops accepting pushes first, and only then does another server take its shards.
//!
//! Both sides are plain state over the driver's nanoseconds: the tokio coordinator and server
//! hold them with a clock they read, the simulator with its virtual one.

/// How often a server renews its lease, in milliseconds.
pub const HEARTBEAT_MS: u64 = 200;

/// How long a renewed lease lasts, counted by the server from when it asked, in milliseconds.
pub const LEASE_MS: u64 = 1000;

/// How long after a server's last renewal the coordinator fails it over: its lease
/// ([`LEASE_MS`], counted on the server from when it asked) has surely lapsed by then, so no
/// two primaries ever serve one shard.
pub const FAILOVER_MS: u64 = LEASE_MS + 300;

/// How long the coordinator waits for a new server's first heartbeat before failing it over. A
/// server's lease starts with that heartbeat, which it sends once it has compiled the policy and
/// restored its shards: seconds, in a debug build on a loaded machine. Until then it serves
/// nothing, so nothing is at risk while the coordinator waits.
pub const FIRST_HEARTBEAT_MS: u64 = 30_000;

const MS: u64 = 1_000_000;

/// A server's own view of its lease: until when it may accept pushes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLease {
    until_ns: u64,
}

impl ServerLease {
    /// A lease that starts at `now_ns` (a server that was just welcomed: its first renewal
    /// follows at once).
    pub fn new(now_ns: u64) -> Self {
        ServerLease { until_ns: now_ns + LEASE_MS * MS }
    }

    /// The coordinator answered the renewal asked at `asked_ns`.
    pub fn renewed(&mut self, asked_ns: u64) {
        self.until_ns = self.until_ns.max(asked_ns + LEASE_MS * MS);
    }

    /// Whether the server may accept pushes at `now_ns`.
    pub fn valid(&self, now_ns: u64) -> bool {
        now_ns <= self.until_ns
    }
}

/// The coordinator's leases, by server id: when each was last renewed, or that it was failed
/// over (lost).
#[derive(Clone, Debug, Default)]
pub struct LeaseTable {
    /// By server: when its lease was last renewed (in the future for a server that has until
    /// then to send its first heartbeat), or `None` once it is lost.
    renewed: Vec<Option<u64>>,
}

/// A renewal the coordinator refuses (on the wire as it is).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum LeaseError {
    /// The server's lease lapsed and it was failed over: its shards have other primaries.
    #[error("this server was failed over")]
    FailedOver,
    /// No server has this id.
    #[error("server {0} is not registered here")]
    Unknown(u32),
}

impl LeaseTable {
    /// A server registered at `now_ns`: it gets its id, and [`FIRST_HEARTBEAT_MS`] to send its
    /// first renewal.
    pub fn add(&mut self, now_ns: u64) -> u32 {
        self.renewed.push(Some(now_ns + FIRST_HEARTBEAT_MS * MS));
        self.renewed.len() as u32 - 1
    }

    /// Replaces the table (a restarted coordinator rebuilding its cluster): the servers in
    /// `live` get until `first_ns` to renew, the others are lost.
    pub fn reset(&mut self, live: &[bool], first_ns: u64) {
        self.renewed = live.iter().map(|l| l.then_some(first_ns)).collect();
    }

    /// Server `server` renews at `now_ns`.
    pub fn renew(&mut self, now_ns: u64, server: u32) -> Result<(), LeaseError> {
        match self.renewed.get_mut(server as usize) {
            // A first heartbeat brings the allowance for it (in the future) back to now.
            Some(Some(t)) => {
                *t = now_ns;
                Ok(())
            }
            Some(None) => Err(LeaseError::FailedOver),
            None => Err(LeaseError::Unknown(server)),
        }
    }

    /// The driver did not run for `stalled_ns` (a starved or paused process): renewals may be
    /// waiting, unread, in its sockets, so that time is not counted against the servers.
    /// Crediting it only ever delays a failover, which keeps the lease rule safe.
    pub fn credit(&mut self, now_ns: u64, stalled_ns: u64) {
        for t in self.renewed.iter_mut().flatten().filter(|t| **t < now_ns) {
            *t = (*t + stalled_ns).min(now_ns);
        }
    }

    /// The live servers whose lease has lapsed at `now_ns`, in id order.
    pub fn lapsed(&self, now_ns: u64) -> Vec<u32> {
        (0..self.renewed.len() as u32).filter(|&s| self.lapses_at(s).is_some_and(|t| now_ns >= t)).collect()
    }

    /// When server `server`'s lease lapses for the coordinator, if it is live.
    pub fn lapses_at(&self, server: u32) -> Option<u64> {
        self.renewed.get(server as usize).copied().flatten().map(|t| t + FAILOVER_MS * MS + 1)
    }

    /// The earliest time a live server's lease lapses.
    pub fn next_lapse(&self) -> Option<u64> {
        (0..self.renewed.len() as u32).filter_map(|s| self.lapses_at(s)).min()
    }

    /// A server restarted in the place of lost server `server` (a new process under its id):
    /// live again, with until [`FIRST_HEARTBEAT_MS`] after `now_ns` for its first heartbeat.
    pub fn revive(&mut self, now_ns: u64, server: u32) {
        if let Some(r) = self.renewed.get_mut(server as usize) {
            *r = Some(now_ns + FIRST_HEARTBEAT_MS * MS);
        }
    }

    /// Marks `server` lost (it is being failed over).
    pub fn lose(&mut self, server: u32) {
        if let Some(r) = self.renewed.get_mut(server as usize) {
            *r = None;
        }
    }

    /// Whether `server` is registered and not lost.
    pub fn is_live(&self, server: u32) -> bool {
        self.renewed.get(server as usize).is_some_and(Option::is_some)
    }

    /// Per server: whether it is live.
    pub fn live(&self) -> Vec<bool> {
        self.renewed.iter().map(Option::is_some).collect()
    }

    /// Servers registered (lost ones included).
    pub fn len(&self) -> usize {
        self.renewed.len()
    }

    /// Whether no server has registered.
    pub fn is_empty(&self) -> bool {
        self.renewed.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However late the answer and however the coordinator's renewal is timed, the server's
    /// lease has lapsed by the time the coordinator fails it over.
    #[test]
    fn a_server_stops_before_the_coordinator_fails_it_over() {
        for delay_ms in [0, 1, 250, 999, 1000, 5000] {
            let asked = 7 * MS;
            let answered = asked + delay_ms * MS;
            let mut table = LeaseTable::default();
            let s = table.add(0);
            table.renew(answered, s).unwrap();
            let mut lease = ServerLease::new(0);
            lease.renewed(asked);
            let failover = table.lapses_at(s).unwrap();
            assert!(!lease.valid(failover), "delay {delay_ms} ms");
            assert!(table.lapsed(failover - 1).is_empty());
            assert_eq!(table.lapsed(failover), vec![s]);
        }
    }

    #[test]
    fn a_lost_server_cannot_renew_and_a_stall_is_credited() {
        let mut table = LeaseTable::default();
        let (a, b) = (table.add(0), table.add(0));
        let start = FIRST_HEARTBEAT_MS * MS;
        assert_eq!(table.next_lapse(), Some(start + FAILOVER_MS * MS + 1));
        // The first renewal ends the first heartbeat's allowance.
        table.renew(10 * MS, a).unwrap();
        assert_eq!(table.next_lapse(), Some(10 * MS + FAILOVER_MS * MS + 1));
        table.renew(start + 10 * MS, a).unwrap();
        table.lose(b);
        assert_eq!(table.renew(start + 20 * MS, b), Err(LeaseError::FailedOver));
        assert_eq!(table.renew(0, 9), Err(LeaseError::Unknown(9)));
        let late = start + 10 * MS + FAILOVER_MS * MS + 1;
        assert_eq!(table.lapsed(late), vec![a]);
        table.credit(late, 500 * MS);
        assert!(table.lapsed(late).is_empty());
        assert_eq!(table.live(), vec![true, false]);
    }
}
