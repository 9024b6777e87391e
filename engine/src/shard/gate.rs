//! The primary's half of replication, as a value: an [`AckGate`] numbers the ops a primary
//! applies and holds each push's acknowledgement until the backup has confirmed the op that
//! admitted it, so that an acknowledged push survives the primary. The server's shard task and
//! the simulator both replicate through it; what travels to the backup ([`super::Stamped`]) and
//! how confirmations come back are their drivers' business.

use std::collections::VecDeque;

/// Op numbering and acknowledgements held for the backup. `T` is whatever the driver sends a
/// worker to acknowledge a push.
#[derive(Debug)]
pub struct AckGate<T> {
    /// The sequence number of the op being applied (or last applied).
    seq: u64,
    /// The last op the backup confirmed; `None`: no backup, so acknowledgements go out at once.
    confirmed: Option<u64>,
    /// Acknowledgements waiting for the backup, each with the op that admitted it.
    held: VecDeque<(u64, T)>,
}

impl<T> Default for AckGate<T> {
    fn default() -> Self {
        AckGate { seq: 0, confirmed: None, held: VecDeque::new() }
    }
}

impl<T> AckGate<T> {
    /// Numbers the next op (1, 2, 3...): acknowledgements given from now on wait for it.
    pub fn stamp(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// The last op numbered.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// A backup takes its primary's numbering: it has applied op `seq`.
    pub fn follow(&mut self, seq: u64) {
        self.seq = seq;
    }

    /// The last op the backup confirmed (`None`: no backup).
    pub fn confirmed(&self) -> Option<u64> {
        self.confirmed
    }

    /// Acknowledgements held, waiting for the backup.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// An acknowledgement of a push admitted by the op being applied: returned if it may go
    /// out now (no backup, or the backup has the op), held otherwise.
    #[must_use]
    pub fn ack(&mut self, ack: T) -> Option<T> {
        match self.confirmed {
            Some(c) if c < self.seq => {
                self.held.push_back((self.seq, ack));
                None
            }
            _ => Some(ack),
        }
    }

    /// A backup is attached that already holds every op up to `seq`.
    pub fn attach(&mut self, seq: u64) {
        self.confirmed = Some(seq);
    }

    /// The backup has every op up to `seq`: the acknowledgements those ops admitted go out.
    pub fn confirm(&mut self, seq: u64, mut release: impl FnMut(T)) {
        if let Some(c) = self.confirmed.as_mut() {
            *c = (*c).max(seq);
        }
        while self.held.front().is_some_and(|h| self.confirmed.is_none_or(|c| h.0 <= c)) {
            release(self.held.pop_front().expect("checked").1);
        }
    }

    /// The backup is gone: nothing waits for it any more, and what was held goes out.
    pub fn detach(&mut self, release: impl FnMut(T)) {
        self.confirmed = None;
        self.confirm(u64::MAX, release);
    }

    /// This primary is lost: what it held never goes out (the workers ask the new primary).
    pub fn lose(&mut self) {
        self.held.clear();
        self.confirmed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledgement_waits_for_the_op_that_admitted_it() {
        let mut g = AckGate::default();
        g.stamp();
        assert_eq!(g.ack("free"), Some("free"), "no backup: at once");
        g.attach(1);
        g.stamp();
        assert_eq!(g.ack("a"), None);
        g.stamp();
        assert_eq!(g.ack("b"), None);
        let mut out = Vec::new();
        g.confirm(2, |a| out.push(a));
        assert_eq!(out, ["a"]);
        g.confirm(1, |a| out.push(a));
        assert_eq!(out, ["a"], "a late, lower confirmation changes nothing");
        g.detach(|a| out.push(a));
        assert_eq!(out, ["a", "b"]);
        g.attach(3);
        g.stamp();
        assert_eq!(g.ack("c"), None);
        g.lose();
        g.confirm(u64::MAX, |a| out.push(a));
        assert_eq!(out, ["a", "b"], "a lost primary's held acknowledgements never go out");
    }
}
