//! The worker's client as a sans-IO machine: what a worker knows and decides about its shards
//! between its [`WorkerMachine`](super::WorkerMachine) and the servers, with no socket, clock
//! or task of its own.
//!
//! One [`ClientMachine`] per worker, for all its shards. It keeps
//! - **the route**: which server holds each shard now, changed only by a move the coordinator
//!   announced, and only to a server the cluster has ([`ClientMachine::moved`]); after every
//!   move heard, the worker joins the shard's new primary before it asks it anything
//!   ([`ClientMachine::rejoin_due`]), or that primary drops it after its rejoin grace;
//! - **the numbering**: per shard, what the shard's numbering of this worker's iterations adds
//!   to the worker's own (set when a late joiner starts, [`super::join::Joining`]; moved when a
//!   promoted shard that had dropped the worker takes it back afresh,
//!   [`ClientMachine::rejoined`]);
//! - **what each push is based on**: the shard version the worker last pulled there;
//! - **what it waits for**: per pull and push, which shards have answered. Answers are counted
//!   once per shard (an answer to a request asked again after a move, which the old primary
//!   had answered already, changes nothing), and the last one gives the whole request's
//!   result ([`Tally::Done`]);
//! - **what a loss means** ([`ClientMachine::after_loss`]): a server that refuses for want of a
//!   lease is asked again after a heartbeat; a lost one is waited out until the coordinator
//!   moves its shards (only with backups: without, it is an error); either is given up
//!   [`MOVE_WAIT_NS`] after the shard's server was first lost, a wait that counts again from the
//!   coordinator's return while it is away ([`ClientMachine::coordinator_away`]);
//! - **what to send again after a move** ([`ClientMachine::awaits_pull`],
//!   [`ClientMachine::awaits_push`]): a pull or push the new primary must see, because its
//!   shard has not answered it.
//!
//! The tokio client (`WorkerClient` in `syncopate worker` and the Python package) and the
//! simulator both drive this machine, so a failover that the fault search passes is one the
//! cluster's client takes the same way. The drivers own the bytes (encoding, QUIC streams),
//! the connections (a driver dials a server whose connection ended again before it asks it) and
//! the waiting; the machine says how long each wait may last, from the time the driver gives it.

use super::join::JoinAnswer;
use crate::shard::RequestError;

/// How long a worker waits for a lost shard to move (or its server to serve again) before it
/// gives up, from the first loss; while the coordinator is away it waits on, and the wait
/// counts again from its return. A coordinator that dies stops the servers' leases at once,
/// but the worker notices only after the peer timeout (10 s by default), so this is longer than
/// that.
pub const MOVE_WAIT_NS: u64 = 20_000_000_000;

/// How many pulls, and how many pushes of each kind, a client keeps count of at once. A
/// worker has one of each in flight; a driver that overlaps a push with the next pull shard by
/// shard has two; a request given up on an error is forgotten after this many newer ones.
const ROUNDS: usize = 4;

/// What a pull returned, across shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullStats {
    /// The longest time any shard deferred the pull, in nanoseconds.
    pub waited_ns: u64,
    /// Shards that deferred it.
    pub deferred_shards: u32,
    /// The fewest optimizer steps of any shard.
    pub min_version: u64,
    /// The local steps to take in this iteration: the most any shard said (0: push a
    /// gradient).
    pub local_steps: u32,
}

impl Default for PullStats {
    fn default() -> Self {
        PullStats { waited_ns: 0, deferred_shards: 0, min_version: u64::MAX, local_steps: 0 }
    }
}

impl PullStats {
    /// Counts one shard's answer in.
    pub fn add(&mut self, shard: ShardPulled) {
        self.local_steps = self.local_steps.max(shard.local_steps);
        self.waited_ns = self.waited_ns.max(shard.waited_ns);
        self.deferred_shards += u32::from(shard.waited_ns > 0);
        self.min_version = self.min_version.min(shard.version);
    }
}

/// What one shard's answer to a pull said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardPulled {
    /// How long the shard deferred the pull, in nanoseconds.
    pub waited_ns: u64,
    /// The shard's optimizer steps.
    pub version: u64,
    /// The local steps it asks for.
    pub local_steps: u32,
}

/// Whose push: the worker's own iteration (whole, or its own tasks), or tasks moved to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushSlot {
    /// The worker's own.
    Own,
    /// Another worker's tasks, computed here.
    Help,
}

/// What one shard's answer did to a request across shards.
#[derive(Clone, Debug, PartialEq)]
pub enum Tally<T> {
    /// It answered a request nobody waits for any more, or that this shard had answered
    /// already: nothing changes.
    Stale,
    /// Counted; other shards have yet to answer.
    Counted,
    /// Counted, and it was the last: the request's result.
    Done(T),
}

/// Why a request to a shard's server got no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// The server refused for want of a lease: it may serve again in a moment, if the
    /// coordinator does not fail it over.
    Unleased,
    /// The server is gone or no longer the shard's primary (connection lost, timed out, a
    /// move noticed).
    Lost,
}

/// What a driver does after a [`Loss`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Ask the same server again after this long, unless the shard moves meanwhile.
    AskAgain {
        /// The pause, in nanoseconds.
        after_ns: u64,
    },
    /// Wait up to this long for the coordinator to move the shard, then rejoin it on its new
    /// primary ([`ClientMachine::rejoined`]) and send what it still waits for again.
    AwaitMove {
        /// The longest wait, in nanoseconds.
        within_ns: u64,
    },
    /// Give up: the request fails (no backup to move to).
    Fail,
}

/// A bad map or move from the coordinator: every shard and server a peer names is checked
/// before anything indexes by it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// A shard this worker does not have.
    #[error("shard {shard} is not one of this worker's {shards} shards")]
    NoSuchShard {
        /// The shard named.
        shard: u32,
        /// How many there are.
        shards: usize,
    },
    /// A server the cluster does not have.
    #[error("server {server} is not one of the cluster's {servers} servers")]
    NoSuchServer {
        /// The server named.
        server: u32,
        /// How many there are.
        servers: u32,
    },
}

/// What the client knows of one shard.
#[derive(Clone, Copy, Debug)]
struct Link {
    /// The server holding its primary.
    server: u32,
    /// What the shard's numbering of this worker's iterations adds to the worker's own.
    offset: i64,
    /// The version of the parameters last pulled from it.
    based_on: Option<u64>,
    /// When a request to its server was first lost since the server last answered or the shard
    /// last moved, in the driver's nanoseconds: the move wait counts from then.
    lost_since: Option<u64>,
    /// The moves heard of so far.
    moves: u64,
    /// The moves heard of when the worker last joined the shard's primary: while fewer than
    /// `moves`, it must join the new primary before it asks it anything.
    joined_after: u64,
}

/// A pull across shards: its iteration, which shards answered, and what they said.
#[derive(Clone, Debug)]
struct PullRound {
    iteration: u64,
    answered: Vec<bool>,
    left: usize,
    stats: PullStats,
}

/// A push across shards: whose, of which iteration, which shards acknowledged it, how many
/// dropped it, and the first refusal.
#[derive(Clone, Debug)]
struct PushRound {
    slot: PushSlot,
    iteration: u64,
    acked: Vec<bool>,
    left: usize,
    dropped: u32,
    refused: Option<RequestError>,
}

/// One worker's client; see the module docs.
#[derive(Clone, Debug)]
pub struct ClientMachine {
    /// Whether shards have backups: only then is a lost server worth waiting out.
    replicated: bool,
    servers: u32,
    links: Vec<Link>,
    /// Pulls being counted, oldest first.
    pulls: Vec<PullRound>,
    /// Pushes being counted, oldest first.
    pushes: Vec<PushRound>,
    /// Whether the worker's link to the coordinator ended and no new one began: no move can
    /// come meanwhile, so no wait for one is given up.
    coordinator_away: bool,
}

impl ClientMachine {
    /// A worker's client whose shard `i` is on server `routes[i]`, in a cluster of `servers`
    /// servers (`replicated`: shards have backups).
    pub fn new(routes: &[u32], servers: u32, replicated: bool) -> Result<ClientMachine, RouteError> {
        if let Some(&server) = routes.iter().find(|s| **s >= servers) {
            return Err(RouteError::NoSuchServer { server, servers });
        }
        let links = routes
            .iter()
            .map(|&server| Link {
                server,
                offset: 0,
                based_on: None,
                lost_since: None,
                moves: 0,
                joined_after: 0,
            })
            .collect();
        Ok(ClientMachine {
            replicated,
            servers,
            links,
            pulls: Vec::new(),
            pushes: Vec::new(),
            coordinator_away: false,
        })
    }

    /// Whether shards have backups.
    pub fn replicated(&self) -> bool {
        self.replicated
    }

    /// The server holding shard `i` now.
    ///
    /// # Panics
    /// If `i` is not a shard's index (the drivers index by their own map, checked by
    /// [`new`](Self::new)).
    pub fn server(&self, i: usize) -> u32 {
        self.links[i].server
    }

    /// The coordinator says shard `shard` is on server `server` now (a notice of a move, or its
    /// map when the worker rejoins it). Returns whether the server is another than the one the
    /// client had. Either way the shard's primary may be a new one (promoted on the same server,
    /// or by a rebuild), which takes the worker back only if it joins again within its rejoin
    /// grace: the worker must join it before it asks it anything ([`rejoin_due`](Self::rejoin_due)).
    pub fn moved(&mut self, shard: u32, server: u32) -> Result<bool, RouteError> {
        let shards = self.links.len();
        let link = self.links.get_mut(shard as usize).ok_or(RouteError::NoSuchShard { shard, shards })?;
        if server >= self.servers {
            return Err(RouteError::NoSuchServer { server, servers: self.servers });
        }
        link.moves += 1;
        let moved = std::mem::replace(&mut link.server, server) != server;
        if moved {
            link.lost_since = None;
        }
        Ok(moved)
    }

    /// Whether the worker must join shard `i`'s primary again before it asks it anything (a
    /// move was heard since it last did), and if so the ticket its join's answer is given back
    /// with ([`rejoined`](Self::rejoined)). A driver joins before its next request there, or at
    /// once.
    pub fn rejoin_due(&self, i: usize) -> Option<u64> {
        let link = &self.links[i];
        (link.joined_after < link.moves).then_some(link.moves)
    }

    /// The worker starts with shard `i` numbering its iterations `offsets[i]` on from its own
    /// (what [`super::join::JoinStep::Start`] said).
    ///
    /// # Panics
    /// If there is not an offset per shard.
    pub fn start(&mut self, offsets: &[i64]) {
        assert_eq!(offsets.len(), self.links.len(), "an offset per shard");
        for (link, &o) in self.links.iter_mut().zip(offsets) {
            link.offset = o;
        }
    }

    /// How shard `i` numbers this worker's iteration `iteration`.
    pub fn numbered(&self, i: usize, iteration: u64) -> u64 {
        iteration.saturating_add_signed(self.links[i].offset)
    }

    /// Whether every shard numbers this worker's iterations as it does (always, unless a
    /// promoted shard dropped the worker and took it back renumbered, or a late joiner's
    /// clocks were levelled unevenly): only then can its tasks move and can it skip ahead.
    pub fn numbering_shared(&self) -> bool {
        self.links.iter().all(|l| l.offset == 0)
    }

    /// The shard version the model last pulled from shard `i` had (`None` before any pull):
    /// what a push says it was computed from.
    pub fn based_on(&self, i: usize) -> Option<u64> {
        self.links[i].based_on
    }

    /// Shard `i`'s new primary answered the worker's join after a move. A primary that had
    /// dropped the worker (it stayed away past the promoted shard's backstop) took it as a new
    /// member: from its old numbering's end (`next`) on, it numbers the worker's iterations
    /// from the clock it joined at, and those before were all applied there, so a push asked
    /// again is applied once or acknowledged as the duplicate it is. Returns by how much the
    /// numbering moved (`None`: the shard still counted the worker, nothing changes).
    ///
    /// `ticket` is what [`rejoin_due`](Self::rejoin_due) said when the join was sent: a move
    /// heard since then makes the worker join again.
    pub fn rejoined(&mut self, i: usize, ticket: u64, answer: JoinAnswer) -> Option<i64> {
        let link = &mut self.links[i];
        link.joined_after = link.joined_after.max(ticket);
        if answer.member {
            return None;
        }
        let by = answer.clock as i64 - answer.next as i64;
        link.offset += by;
        Some(by)
    }

    /// What the driver does after a request to shard `i`'s server was lost this way, at
    /// `now_ns` (the driver's clock). Without backups the request fails at once. With them,
    /// the worker waits for the server to serve again or for the shard to move, until
    /// [`MOVE_WAIT_NS`] after the shard's server was first lost (since it last answered,
    /// [`reached`](Self::reached), or the shard last moved); while the coordinator is away
    /// there is no end.
    ///
    /// # Panics
    /// If `i` is not a shard's index.
    pub fn after_loss(&mut self, now_ns: u64, i: usize, loss: Loss) -> Retry {
        if !self.replicated {
            return Retry::Fail;
        }
        let since = *self.links[i].lost_since.get_or_insert(now_ns);
        let left = match self.coordinator_away {
            true => MOVE_WAIT_NS,
            false => (since.saturating_add(MOVE_WAIT_NS)).saturating_sub(now_ns),
        };
        match loss {
            _ if left == 0 => Retry::Fail,
            Loss::Unleased => Retry::AskAgain { after_ns: crate::lease::HEARTBEAT_MS * 1_000_000 },
            Loss::Lost => Retry::AwaitMove { within_ns: left },
        }
    }

    /// Shard `i`'s server answered a request (whatever it said): a later loss is waited out
    /// from then.
    pub fn reached(&mut self, i: usize) {
        self.links[i].lost_since = None;
    }

    /// The worker's link to the coordinator ended (it may be restarting): no move can come
    /// until it is back, so waits for one are not given up meanwhile.
    pub fn coordinator_away(&mut self) {
        self.coordinator_away = true;
    }

    /// The worker is linked to the coordinator again, at `now_ns` (and has its map): the wait
    /// for a lost server counts from now (a server renews its lease with the new coordinator
    /// only after the workers may have rejoined it).
    pub fn coordinator_back(&mut self, now_ns: u64) {
        self.coordinator_away = false;
        for link in &mut self.links {
            if link.lost_since.is_some() {
                link.lost_since = Some(now_ns);
            }
        }
    }

    /// A pull of `iteration` goes out (to every shard, at once or one by one).
    pub fn pull_begun(&mut self, iteration: u64) {
        let shards = self.links.len();
        if !self.pulls.iter().any(|r| r.iteration == iteration) {
            if self.pulls.len() == ROUNDS {
                self.pulls.remove(0);
            }
            let stats = PullStats::default();
            self.pulls.push(PullRound { iteration, answered: vec![false; shards], left: shards, stats });
        }
    }

    /// Shard `i` answered the pull of `iteration`. Once every shard has, the pull's result.
    pub fn pulled(&mut self, i: usize, iteration: u64, answer: ShardPulled) -> Tally<PullStats> {
        let Some(at) = self.pulls.iter().position(|r| r.iteration == iteration) else { return Tally::Stale };
        let round = &mut self.pulls[at];
        if std::mem::replace(&mut round.answered[i], true) {
            return Tally::Stale;
        }
        self.links[i].based_on = Some(answer.version);
        self.links[i].lost_since = None;
        round.stats.add(answer);
        round.left -= 1;
        if round.left > 0 {
            return Tally::Counted;
        }
        Tally::Done(self.pulls.remove(at).stats)
    }

    /// The driver put the values of shard `i`'s answer that [`pulled`](Self::pulled) did not
    /// count (a pull its caller asked again after it was answered) into the model: the next
    /// push is based on them.
    pub fn landed(&mut self, i: usize, version: u64) {
        self.links[i].based_on = Some(version);
    }

    /// Whether the pull of `iteration` still waits for shard `i`: if it was lost in a move, the
    /// new primary must be asked.
    pub fn awaits_pull(&self, i: usize, iteration: u64) -> bool {
        self.pulls.iter().any(|r| r.iteration == iteration && !r.answered[i])
    }

    /// A push of `slot` for `iteration` (whole, or tasks) goes out (to every shard, at once or
    /// one by one).
    pub fn push_begun(&mut self, slot: PushSlot, iteration: u64) {
        let shards = self.links.len();
        if !self.pushes.iter().any(|r| r.slot == slot && r.iteration == iteration) {
            if self.pushes.iter().filter(|r| r.slot == slot).count() == ROUNDS {
                let oldest = self.pushes.iter().position(|r| r.slot == slot).expect("ROUNDS > 0");
                self.pushes.remove(oldest);
            }
            self.pushes.push(PushRound {
                slot,
                iteration,
                acked: vec![false; shards],
                left: shards,
                dropped: 0,
                refused: None,
            });
        }
    }

    /// Shard `i` answered the push of `slot` for `iteration`: acknowledged (`Ok(dropped)`:
    /// whether its policy dropped it) or refused. Once every shard has, the push's result: how
    /// many dropped it, or the first refusal.
    pub fn push_answered(
        &mut self,
        slot: PushSlot,
        i: usize,
        iteration: u64,
        answer: Result<bool, RequestError>,
    ) -> Tally<Result<u32, RequestError>> {
        let Some(at) = self.pushes.iter().position(|r| r.slot == slot && r.iteration == iteration) else {
            return Tally::Stale;
        };
        let round = &mut self.pushes[at];
        if std::mem::replace(&mut round.acked[i], true) {
            return Tally::Stale;
        }
        self.links[i].lost_since = None;
        match answer {
            Ok(dropped) => round.dropped += u32::from(dropped),
            Err(e) => {
                round.refused.get_or_insert(e);
            }
        }
        round.left -= 1;
        if round.left > 0 {
            return Tally::Counted;
        }
        let round = self.pushes.remove(at);
        Tally::Done(round.refused.map_or(Ok(round.dropped), Err))
    }

    /// Whether the push of `slot` for `iteration` still waits for shard `i`'s acknowledgement:
    /// if it was lost in a move, the new primary must get it (it applies it once, or
    /// acknowledges the duplicate it is).
    pub fn awaits_push(&self, slot: PushSlot, i: usize, iteration: u64) -> bool {
        self.pushes.iter().any(|r| r.slot == slot && r.iteration == iteration && !r.acked[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> ClientMachine {
        ClientMachine::new(&[0, 1], 3, true).unwrap()
    }

    #[test]
    fn a_map_or_move_naming_what_the_cluster_lacks_is_refused_and_changes_nothing() {
        assert_eq!(
            ClientMachine::new(&[0, 5], 2, true).unwrap_err(),
            RouteError::NoSuchServer { server: 5, servers: 2 }
        );
        let mut c = client();
        assert_eq!(c.moved(2, 0), Err(RouteError::NoSuchShard { shard: 2, shards: 2 }));
        assert_eq!(c.moved(1, 3), Err(RouteError::NoSuchServer { server: 3, servers: 3 }));
        assert_eq!((c.server(0), c.server(1)), (0, 1));
        assert_eq!(c.moved(1, 2), Ok(true));
        assert_eq!(c.moved(1, 2), Ok(false));
        assert_eq!(c.server(1), 2);
    }

    #[test]
    fn a_pull_is_done_once_every_shard_answered_once() {
        let mut c = client();
        c.pull_begun(7);
        c.pull_begun(7);
        let a = ShardPulled { waited_ns: 5, version: 10, local_steps: 0 };
        let b = ShardPulled { waited_ns: 0, version: 8, local_steps: 4 };
        assert_eq!(c.pulled(0, 7, a), Tally::Counted);
        assert!(!c.awaits_pull(0, 7) && c.awaits_pull(1, 7));
        // The old primary's answer to the pull asked again after a move counts nothing.
        assert_eq!(c.pulled(0, 7, b), Tally::Stale);
        let done = PullStats { waited_ns: 5, deferred_shards: 1, min_version: 8, local_steps: 4 };
        assert_eq!(c.pulled(1, 7, b), Tally::Done(done));
        assert_eq!(c.pulled(1, 7, b), Tally::Stale);
        assert!(!c.awaits_pull(1, 7));
        assert_eq!((c.based_on(0), c.based_on(1)), (Some(10), Some(8)));
    }

    #[test]
    fn a_push_is_done_once_every_shard_acknowledged_it_and_says_what_was_dropped_or_refused() {
        let mut c = client();
        c.push_begun(PushSlot::Own, 4);
        c.push_begun(PushSlot::Help, 4);
        assert_eq!(c.push_answered(PushSlot::Own, 1, 4, Ok(true)), Tally::Counted);
        assert!(c.awaits_push(PushSlot::Own, 0, 4) && !c.awaits_push(PushSlot::Own, 1, 4));
        assert!(c.awaits_push(PushSlot::Help, 1, 4));
        assert_eq!(c.push_answered(PushSlot::Own, 1, 4, Ok(false)), Tally::Stale);
        assert_eq!(c.push_answered(PushSlot::Own, 0, 3, Ok(false)), Tally::Stale);
        assert_eq!(c.push_answered(PushSlot::Own, 0, 4, Ok(false)), Tally::Done(Ok(1)));
        let refused = RequestError::Left(9, 0);
        assert_eq!(c.push_answered(PushSlot::Help, 0, 4, Err(refused.clone())), Tally::Counted);
        assert_eq!(c.push_answered(PushSlot::Help, 1, 4, Ok(false)), Tally::Done(Err(refused)));
        assert!(!c.awaits_push(PushSlot::Help, 0, 4));
    }

    #[test]
    fn a_primary_that_took_the_worker_back_afresh_moves_its_numbering_there_only() {
        let mut c = client();
        c.start(&[0, -2]);
        assert_eq!((c.numbered(0, 10), c.numbered(1, 10)), (10, 8));
        assert!(!c.numbering_shared());
        assert_eq!(c.rejoined(0, 0, JoinAnswer { next: 12, clock: 15, member: true }), None);
        assert_eq!(c.rejoined(0, 0, JoinAnswer { next: 12, clock: 15, member: false }), Some(3));
        assert_eq!((c.numbered(0, 10), c.numbered(1, 10)), (13, 8));
    }

    #[test]
    fn every_move_heard_makes_the_worker_join_the_new_primary_before_it_asks_it_anything() {
        let mut c = client();
        assert_eq!((c.rejoin_due(0), c.rejoin_due(1)), (None, None));
        // A move to another server, or a new primary on the same one (a rebuild, or a
        // promotion back to a server restarted since): a join is due either way.
        assert_eq!(c.moved(0, 2), Ok(true));
        assert_eq!(c.moved(1, 1), Ok(false));
        let (t0, t1) = (c.rejoin_due(0).unwrap(), c.rejoin_due(1).unwrap());
        c.rejoined(1, t1, JoinAnswer { next: 3, clock: 3, member: true });
        assert_eq!(c.rejoin_due(1), None);
        // A move heard while the join was on its way: the worker joins again.
        assert_eq!(c.moved(0, 1), Ok(true));
        c.rejoined(0, t0, JoinAnswer { next: 3, clock: 3, member: true });
        let again = c.rejoin_due(0).expect("the later move's join is still due");
        // An older ticket's answer, late, changes nothing.
        c.rejoined(0, t0, JoinAnswer { next: 3, clock: 3, member: true });
        assert_eq!(c.rejoin_due(0), Some(again));
        c.rejoined(0, again, JoinAnswer { next: 3, clock: 3, member: true });
        assert_eq!(c.rejoin_due(0), None);
    }

    #[test]
    fn a_loss_is_waited_out_only_with_backups() {
        let mut c = client();
        assert_eq!(c.after_loss(0, 0, Loss::Unleased), Retry::AskAgain { after_ns: 200_000_000 });
        assert_eq!(c.after_loss(0, 1, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        let mut alone = ClientMachine::new(&[0], 1, false).unwrap();
        assert_eq!(alone.after_loss(0, 0, Loss::Lost), Retry::Fail);
        assert_eq!(alone.after_loss(0, 0, Loss::Unleased), Retry::Fail);
    }

    #[test]
    fn a_lost_server_is_waited_for_from_its_first_loss_until_an_answer_or_a_move() {
        let mut c = client();
        let s = 1_000_000_000;
        // The wait counts from the first loss, whatever the losses in between.
        assert_eq!(c.after_loss(s, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        assert_eq!(c.after_loss(5 * s, 0, Loss::Unleased), Retry::AskAgain { after_ns: 200_000_000 });
        assert_eq!(
            c.after_loss(15 * s, 0, Loss::Lost),
            Retry::AwaitMove { within_ns: MOVE_WAIT_NS - 14 * s }
        );
        assert_eq!(c.after_loss(s + MOVE_WAIT_NS, 0, Loss::Lost), Retry::Fail);
        assert_eq!(c.after_loss(s + MOVE_WAIT_NS, 0, Loss::Unleased), Retry::Fail);
        // The other shard's server was not lost.
        assert_eq!(
            c.after_loss(s + MOVE_WAIT_NS, 1, Loss::Lost),
            Retry::AwaitMove { within_ns: MOVE_WAIT_NS }
        );
        // An answer from the server, or a move, starts the next wait afresh.
        c.reached(0);
        assert_eq!(c.after_loss(30 * s, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        assert_eq!(c.moved(0, 2), Ok(true));
        assert_eq!(c.after_loss(60 * s, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        // A counted answer is an answer.
        c.pull_begun(7);
        c.pulled(0, 7, ShardPulled::default());
        assert_eq!(c.after_loss(90 * s, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
    }

    #[test]
    fn while_the_coordinator_is_away_no_wait_is_given_up_and_it_counts_again_from_its_return() {
        let mut c = client();
        let s = 1_000_000_000;
        assert_eq!(c.after_loss(0, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        c.coordinator_away();
        assert_eq!(c.after_loss(100 * s, 0, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
        assert_eq!(c.after_loss(100 * s, 0, Loss::Unleased), Retry::AskAgain { after_ns: 200_000_000 });
        c.coordinator_back(120 * s);
        assert_eq!(
            c.after_loss(130 * s, 0, Loss::Lost),
            Retry::AwaitMove { within_ns: MOVE_WAIT_NS - 10 * s }
        );
        assert_eq!(c.after_loss(120 * s + MOVE_WAIT_NS, 0, Loss::Lost), Retry::Fail);
        // A shard whose server was not lost keeps no wait from the return.
        assert_eq!(c.after_loss(200 * s, 1, Loss::Lost), Retry::AwaitMove { within_ns: MOVE_WAIT_NS });
    }

    #[test]
    fn requests_given_up_are_forgotten_after_a_few_newer_ones() {
        let mut c = client();
        for it in 0..(ROUNDS as u64 + 2) {
            c.pull_begun(it);
            c.push_begun(PushSlot::Own, it);
        }
        assert!(!c.awaits_pull(1, 0) && !c.awaits_push(PushSlot::Own, 1, 1));
        assert!(c.awaits_pull(1, ROUNDS as u64 + 1) && c.awaits_push(PushSlot::Own, 1, 2));
    }
}
