//! The simulator's event queue, its events, and the mailbox that holds messages in flight.

use syncopate_policy_sdk::abi::{Applied, IterationReport};

use syncopate_engine::coordinator::Command;

use crate::shard::{Handover, PushHeader};

/// A message without tensors, on its way to a shard.
#[derive(Clone, Copy, Debug)]
pub(super) enum ToShard {
    Handover(Handover),
    Applied(Applied),
    Finished(IterationReport),
    Skip(u64),
    Goodbye,
    /// [`Action::Waiting`](syncopate_engine::worker::Action::Waiting): its pull of this
    /// iteration waits (`true`), or was answered everywhere.
    Waiting(u64, bool),
}

/// A worker's message that a shard's primary took, as it will reach that primary again (a
/// duplicate, [`SimFaults::duplicate`](super::SimFaults::duplicate)), numbered as the shard
/// numbered the original.
#[derive(Clone, Debug)]
pub(super) enum Copied {
    Pull { iteration: u64 },
    Push { push: PushHeader, grad: Vec<f32> },
    Note(ToShard),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Ev {
    /// A worker machine's timer.
    Wake(u32),
    PullArrive(u32, u32, u64),
    /// The last of a worker's pull replies arrives.
    PullDone(u32),
    /// A push's bytes reach the shard (`true`: tasks computed for another worker).
    PushArrive(u32, u32, bool),
    /// The last shard's acknowledgement of a push arrives (`true`: of moved tasks).
    AckArrive(u32, bool),
    /// Message `i` of the `ToShard` mailbox from a worker reaches a shard.
    ToShard(u32, u32, usize),
    /// Copy `i` of the copies' mailbox (of a message from worker `w` that shard `s`'s primary
    /// took) reaches it again.
    Again(u32, u32, usize),
    /// Control message `i` of the mailbox reaches a worker.
    Control(u32, usize),
    Timer(u32),
    Watch,
    /// Op `i` of the replication mailbox reaches shard `s`'s backup.
    Replicate(u32, usize),
    /// Shard `s`'s backup confirms, to the primary of epoch `e`, every op up to `seq`.
    Confirm(u32, u32, u64),
    /// The servers' connections to dead worker `w` time out.
    WorkerLost(u32),
    /// Server `x` asks the coordinator to renew its lease (every `HEARTBEAT_MS`).
    Heartbeat(u32),
    /// Server `x`'s renewal, asked at the time given, reaches the coordinator.
    Renew(u32, u64),
    /// The coordinator's answer to server `x`'s renewal asked at the time given reaches it.
    Renewed(u32, u64),
    /// Server `x` hears it was failed over, and stops.
    Stop(u32),
    /// The partition between server `x` and the coordinator heals.
    Heal(u32),
    /// The coordinator checks its leases.
    CoordTimer,
    /// Command `id` of the coordinator's incarnation `i` reaches server `x`.
    Command(u32, u64, u32, Command),
    /// The result of command `id` of the coordinator's incarnation `i` reaches the coordinator
    /// (dropped if it restarted since); what it is waits in `SimCoordinator::answers`.
    CommandDone(u32, u64),
    /// The crashed coordinator starts again ([`SimFaults::coordinator_crash`](super::SimFaults::coordinator_crash)).
    CoordRestart,
    /// Server `x` rejoins the restarted coordinator, which asks it what it holds.
    Rejoin(u32),
    /// The restarted coordinator (incarnation `i`) stops waiting for the servers to rejoin.
    RebuildDue(u32),
    /// Dead server `x` is started again: a new, empty process under its id
    /// ([`SimFaults::server_restarts`](super::SimFaults::server_restarts)).
    ServerRestart(u32),
    /// Server `x` dies ([`SimRestart::then_kill`](super::SimRestart::then_kill)).
    ServerKill(u32),
    /// Nothing: a fault drawn at a time comes then.
    Tick,
    /// Worker `w` hears that shard `s` moved.
    Moved(u32, u32),
    /// The wait worker `w`'s client machine allowed for shard `s` to move is over.
    WaitOver(u32, u32),
    /// The workers notice that the coordinator crashed.
    CoordinatorAway,
    /// The cluster policy looks at the cluster.
    Pilot,
}

impl Ev {
    /// Whether the event only keeps time (lease renewals, lease checks, observations): a run
    /// with nothing but these has stalled.
    pub(super) fn is_clockwork(&self) -> bool {
        matches!(
            self,
            Ev::Heartbeat(_)
                | Ev::Renew(..)
                | Ev::Renewed(..)
                | Ev::CoordTimer
                | Ev::Watch
                | Ev::Tick
                | Ev::Pilot
        )
    }
}

/// The events to come, by time; events due at the same time come out in the order they were
/// scheduled.
///
/// A radix heap (Ahuja, Mehlhorn, Orlin and Tarjan, 1990) over the key `(time, sequence)`: the
/// simulator never schedules before the event it is handling, so keys only grow, and a radix
/// heap exploits that. An event sits in the bucket of the highest bit in which its key differs
/// from the last key popped; popping empties bucket 0 or redistributes the lowest non-empty
/// bucket around its minimum, and each event moves down at most a few times. Everything lives in
/// 129 vectors that keep their capacity: no allocation per event, no tree to rebalance (a binary
/// heap of every event was half of a large run's time; a B-tree of time buckets, a quarter).
pub(super) struct Queue {
    /// The last key popped; every key in the queue is larger.
    last: u128,
    buckets: [Vec<(u128, Ev)>; 129],
    /// Bit `i - 1` is set iff bucket `i` (1..=128) holds events: finding the lowest is one
    /// instruction, not a scan of 128 vectors on every pop.
    occupied: u128,
    len: usize,
    /// Scheduling order, the key's tie-break.
    seq: u64,
    /// Every event popped, with its key (time and scheduling order), hashed in order.
    trace: Fnv,
}

/// FNV-1a, 64 bits: the same value in every process and build on a machine, unlike std's
/// `DefaultHasher` (whose algorithm may change between releases) or a `HashMap`'s (seeded per
/// process).
#[derive(Clone, Copy, Debug)]
pub(super) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Queue {
    fn default() -> Self {
        // Sequence numbers start at 1: the first key, at time 0, must be above `last`.
        Queue {
            last: 0,
            buckets: std::array::from_fn(|_| Vec::new()),
            occupied: 0,
            len: 0,
            seq: 1,
            trace: Fnv::default(),
        }
    }
}

impl Queue {
    /// The largest capacity (in events) a bucket keeps once redistributed.
    const KEEP: usize = 1 << 14;

    fn bucket(&self, key: u128) -> usize {
        (128 - (key ^ self.last).leading_zeros()) as usize
    }

    fn put(&mut self, key: u128, ev: Ev) {
        let b = self.bucket(key);
        self.buckets[b].push((key, ev));
        if b > 0 {
            self.occupied |= 1 << (b - 1);
        }
    }

    /// Schedules `ev` at `t`, which must not be before the last event popped.
    pub(super) fn push(&mut self, t: u64, ev: Ev) {
        let key = (u128::from(t) << 64) | u128::from(self.seq);
        self.seq += 1;
        assert!(key > self.last, "an event scheduled at {t} ns, before the event being handled");
        self.put(key, ev);
        self.len += 1;
    }

    /// The next event and its time.
    pub(super) fn pop(&mut self) -> Option<(u64, Ev)> {
        if self.len == 0 {
            return None;
        }
        if self.buckets[0].is_empty() {
            let i = self.occupied.trailing_zeros() as usize + 1;
            self.occupied &= !(1 << (i - 1));
            let mut items = std::mem::take(&mut self.buckets[i]);
            self.last = items.iter().map(|&(key, _)| key).min().expect("an occupied bucket");
            for (key, ev) in items.drain(..) {
                self.put(key, ev);
            }
            // A burst's capacity is given back: kept, every bucket would hold its peak forever.
            if items.capacity() <= Self::KEEP {
                self.buckets[i] = items;
            }
        }
        let (key, ev) = self.buckets[0].pop().expect("the minimum is in bucket 0");
        self.len -= 1;
        std::hash::Hash::hash(&(key, ev), &mut self.trace);
        Some(((key >> 64) as u64, ev))
    }

    /// A hash of every event popped so far, in order, with its time and scheduling order: two
    /// runs of one case that differ in any event, or in the order of any two, differ here.
    pub(super) fn trace(&self) -> u64 {
        std::hash::Hasher::finish(&self.trace)
    }
}

/// Messages in flight, each stored once however many recipients it has (an iteration report
/// goes to every shard), and freed when the last copy is delivered. Events carry a slot index, so
/// the queue stays small; freed slots are reused, so memory follows the messages in flight, not
/// every message ever sent (a 10,000-worker run sends tens of millions).
pub(super) struct Mailbox<T> {
    slots: Vec<Option<(T, u32)>>,
    free: Vec<usize>,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Mailbox { slots: Vec::new(), free: Vec::new() }
    }
}

impl<T: Clone> Mailbox<T> {
    /// Stores `msg` for `copies` deliveries (at least one); returns its slot.
    pub(super) fn post(&mut self, msg: T, copies: u32) -> usize {
        let entry = Some((msg, copies.max(1)));
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = entry;
                i
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        }
    }

    /// Delivers one copy of the message in slot `i`, freeing the slot with the last.
    ///
    /// # Panics
    /// If the slot holds no message (delivered more often than posted: a simulator bug).
    pub(super) fn deliver(&mut self, i: usize) -> T {
        let slot = &mut self.slots[i];
        let (msg, left) = slot.as_mut().expect("a message is delivered at most as often as posted");
        *left -= 1;
        if *left > 0 {
            return msg.clone();
        }
        self.free.push(i);
        slot.take().expect("checked above").0
    }

    /// Messages not yet delivered to every recipient.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a sort by (time, scheduling order), over a long pseudo-random schedule in which
    /// each popped event schedules up to three more at or after its own time.
    #[test]
    fn the_radix_heap_pops_in_time_then_scheduling_order() {
        let mut q = Queue::default();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let (mut seq, mut now, mut popped) = (0u32, 0u64, Vec::new());
        for _ in 0..50 {
            q.push(next(1000), Ev::Wake(seq));
            seq += 1;
        }
        while let Some((t, ev)) = q.pop() {
            assert!(t >= now, "time went back from {now} to {t}");
            now = t;
            popped.push((t, ev));
            if seq < 20_000 {
                for _ in 0..next(4) {
                    // Many ties: a third of the new events are due at once.
                    let bits = next(40) + 1;
                    let at = if next(3) == 0 { now } else { now + next(1 << bits) };
                    q.push(at, Ev::Wake(seq));
                    seq += 1;
                }
            }
        }
        assert_eq!(popped.len() as u32, seq);
        // Events due together keep their scheduling order: within one time, ids increase.
        for pair in popped.windows(2) {
            if let [(t0, Ev::Wake(a)), (t1, Ev::Wake(b))] = pair {
                assert!(t0 < t1 || (t0 == t1 && a < b), "{pair:?}");
            }
        }
        assert!(seq >= 20_000, "the schedule ran its length");
    }

    #[test]
    fn a_message_lives_until_its_last_copy_is_delivered_and_its_slot_is_reused() {
        let mut mail = Mailbox::default();
        let a = mail.post("report", 3);
        let b = mail.post("control", 1);
        assert_eq!(mail.in_flight(), 2);
        assert_eq!(mail.deliver(b), "control");
        assert_eq!((mail.deliver(a), mail.deliver(a)), ("report", "report"));
        assert_eq!(mail.in_flight(), 1);
        assert_eq!(mail.deliver(a), "report");
        assert_eq!(mail.in_flight(), 0);
        let c = mail.post("next", 2);
        assert!(c == a || c == b, "a freed slot is reused");
        assert_eq!(mail.slots.len(), 2);
    }

    #[test]
    fn events_due_together_come_out_in_the_order_they_were_scheduled() {
        let mut q = Queue::default();
        q.push(5, Ev::Timer(2));
        q.push(3, Ev::Watch);
        q.push(5, Ev::Timer(1));
        assert_eq!(q.pop(), Some((3, Ev::Watch)));
        assert_eq!(q.pop(), Some((5, Ev::Timer(2))));
        q.push(5, Ev::Timer(3));
        q.push(5, Ev::Timer(4));
        assert_eq!(q.pop(), Some((5, Ev::Timer(1))));
        assert_eq!(q.pop(), Some((5, Ev::Timer(3))));
        q.push(9, Ev::Wake(0));
        assert_eq!(q.pop(), Some((5, Ev::Timer(4))));
        assert_eq!(q.pop(), Some((9, Ev::Wake(0))));
        assert_eq!(q.pop(), None);
    }
}
