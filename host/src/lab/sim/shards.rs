//! The shards' drivers: what each primary's node outputs is carried out (replies to the
//! requests by token, ops streamed to its backup over the servers' link, control messages to
//! workers), its timers are scheduled, and an op reaching a backup is applied there (or, from a
//! deposed primary, must be ignored), as the servers' shard tasks do.

use super::*;

impl Sim {
    /// Carries out what shard `s`'s primary said.
    pub(super) fn drain(&mut self, s: u32) -> Result<(), SimError> {
        while let Some(out) = self.shards.nodes[s as usize].poll_output() {
            match out {
                NodeOutput::Reply { token, reply } => {
                    let Some(req) = self.requests.remove(&token) else { continue };
                    if let (Req::Join { w, .. }, Reply::Joined(Ok(_))) = (&req, &reply) {
                        // The membership is the worker's connection to this server's; one that
                        // ended while the join waited leaves the worker nobody would end.
                        let x = self.shards.server_of[s as usize] as usize;
                        if self.servers.state[x].joined(*w, s, *w as usize).is_some() {
                            self.shards.nodes[s as usize].leave(
                                self.now,
                                None,
                                *w,
                                LeaveReason::Failed,
                                &mut Quiet,
                            );
                        }
                    }
                    match (req, reply) {
                        (Req::Ignore { .. }, _) => {}
                        (Req::Bad { s, what }, reply) => {
                            let accepted = match reply {
                                Reply::Joined(r) => r.is_ok(),
                                // A push the shard already has is acknowledged as the
                                // duplicate it is, whatever it holds: nothing is applied.
                                Reply::Pushed(r) => r.is_ok_and(|o| o != PushOutcome::Duplicate),
                                Reply::Pulled(r) => r.is_ok(),
                                Reply::Done(r) => r.is_ok(),
                            };
                            if accepted {
                                return Err(SimError::AcceptedBad(s, what));
                            }
                        }
                        (Req::Pull { w, iteration, .. }, Reply::Pulled(Ok(served))) => {
                            self.served(s, w, iteration, served)
                        }
                        (Req::Join { w, .. }, Reply::Joined(Ok(joined)))
                            if self.workers[w as usize].joining.is_some() =>
                        {
                            let (next, clock) = match joined {
                                Joined::Fresh { clock, .. } => (clock, clock),
                                Joined::Rejoined { next, clock } => (next, clock),
                            };
                            self.joined_late(w, s, JoinAnswer { next, clock, member: false })?;
                        }
                        (Req::LateSkip { .. }, Reply::Done(Err(e))) => {
                            return Err(SimError::Refused(s, e.to_string()))
                        }
                        (Req::LateSkip { w, s }, Reply::Done(Ok(()))) => self.skipped_late(w, s)?,
                        (Req::Join { w, again, .. }, Reply::Joined(Ok(joined))) => {
                            if let Some(ticket) = again {
                                // A join after a move: the machine hears how the new primary
                                // took it (afresh, if it had dropped the worker: its numbering
                                // there moves).
                                let answer = match joined {
                                    Joined::Fresh { clock, next } => {
                                        JoinAnswer { next, clock, member: false }
                                    }
                                    Joined::Rejoined { next, clock } => {
                                        JoinAnswer { next, clock, member: true }
                                    }
                                };
                                let client = &mut self.workers[w as usize].client;
                                if client.rejoined(s as usize, ticket, answer).is_some() {
                                    tracing::debug!(worker = w, shard = s, ?answer, "taken back afresh");
                                }
                            }
                            self.workers[w as usize].joins += 1;
                            if !self.starting
                                && self.workers[w as usize].joins == self.shards.nodes.len() as u32
                            {
                                self.ready(w)?;
                            }
                        }
                        // The worker left while its pull waited: nobody is left to answer.
                        (Req::Pull { .. }, Reply::Pulled(Err(RequestError::Left(..)))) => {}
                        // A pull it gave up at a stop, overtaken by its goodbye (messages
                        // arrive out of order): refused as a stranger's, and nobody waits for
                        // the answer (on a cluster, it goes to a dropped future).
                        (Req::Pull { w, .. }, Reply::Pulled(Err(e))) if self.left_already(w, &e) => {
                            self.found.late_refusals += 1;
                        }
                        (Req::Push { w, help, iteration, whole, .. }, Reply::Pushed(r)) => {
                            self.pushed(s, w, help, iteration, whole, r)?
                        }
                        (_, Reply::Pulled(Err(e)) | Reply::Joined(Err(e))) => {
                            return Err(SimError::Refused(s, e.to_string()))
                        }
                        _ => {}
                    }
                }
                NodeOutput::Replicate { stamped, payload } => self.replicate(s, stamped, payload),
                NodeOutput::Control { worker, msg } => {
                    let i = self.mail.controls.post(msg, 1);
                    let t = self.net.after_latency(self.now, self.server_node(s), worker as usize);
                    self.at(t, Ev::Control(worker, i));
                }
                NodeOutput::Confirm { .. } | NodeOutput::Left { .. } => {}
            }
        }
        self.arm_timer(s);
        Ok(())
    }

    /// Schedules shard `s`'s next timer, unless an earlier one is scheduled.
    pub(super) fn arm_timer(&mut self, s: u32) {
        if let Some(t) = self.shards.nodes[s as usize].poll_timeout() {
            if self.shards.timer_at[s as usize].is_none_or(|at| t < at) {
                self.shards.timer_at[s as usize] = Some(t);
                self.at(t.max(self.now), Ev::Timer(s));
            }
        }
    }

    /// Shard `s`'s primary hands its backup an op: it crosses the servers' link.
    pub(super) fn replicate(&mut self, s: u32, stamped: Stamped, payload: Vec<f32>) {
        let su = s as usize;
        let Some(b) = self.shards.backup_of[su] else { return };
        let bytes = if matches!(stamped.op, Op::Push(_)) { self.shard_bytes(s) } else { 64 };
        let (from, to) = (self.server_node(s), self.workers.len() + b as usize);
        let t = self.net.transfer(self.now, from, to, bytes);
        let i = self.mail.replication.post((self.shards.epoch[su], stamped, payload), 1);
        self.at(t, Ev::Replicate(s, i));
    }

    /// An op from shard `s`'s deposed primary reaches the node it streamed to, now the shard's
    /// primary: it must change nothing and confirm nothing ([`SimError::AcceptedBad`] else).
    pub(super) fn stale_op(&mut self, s: u32, stamped: Stamped, grad: Vec<f32>) -> Result<(), SimError> {
        // (Nothing is pending: every call is drained; this makes sure of it.)
        self.drain(s)?;
        let node = &mut self.shards.nodes[s as usize];
        let (before, version) = (node.replication(), sim_shard(node).version());
        node.replicated(stamped, grad, |_| None, &mut Quiet);
        let answered = std::iter::from_fn(|| node.poll_output()).count();
        if answered > 0 || node.replication() != before || sim_shard(node).version() != version {
            return Err(SimError::AcceptedBad(s, "an op from its deposed primary (a stale term)"));
        }
        self.found.stale_ops += 1;
        Ok(())
    }

    /// Op `i` of the replication mailbox reaches shard `s`'s backup.
    pub(super) fn op_arrives(&mut self, s: u32, i: usize) -> Result<(), SimError> {
        let (epoch, stamped, grad) = self.mail.replication.deliver(i);
        let su = s as usize;
        // The worst case for a death: an op still on its way from a primary that died
        // never arrives (it may still be in the dead process's buffers), and a dead
        // backup applies nothing.
        let on_live =
            self.shards.backup_of[su].is_some_and(|b| !self.servers.dead[b as usize]) && !self.down(s);
        // An op from a primary that was deposed while it lived (a stale term) still
        // reaches the backup it streamed to, promoted since, which must ignore it.
        let deposed_alive = self.shards.zombie_of[su].is_some_and(|x| !self.servers.dead[x as usize]);
        if deposed_alive && self.shards.promoted_epoch[su] == Some(epoch) && !self.down(s) {
            return self.stale_op(s, stamped, grad);
        }
        if self.shards.backups[su].is_none() || !on_live || epoch != self.shards.epoch[su] {
            return Ok(());
        }
        let p = self.opts.faults.duplicate;
        if p > 0.0 && self.rng.random_bool(p) {
            let again = self.now + self.rng.random_range(0..=DUPLICATE_WITHIN_NS);
            let i = self.mail.replication.post((epoch, stamped.clone(), grad.clone()), 1);
            self.at(again, Ev::Replicate(s, i));
        }
        let Some(backup) = self.shards.backups[su].as_mut() else { return Ok(()) };
        self.found.duplicates += u64::from(stamped.seq <= backup.replication().0);
        let modules = &self.modules;
        let find = |sha: &[u8; 32]| modules.iter().find(|m| m.sha256() == *sha).cloned();
        backup.replicated(stamped, grad, find, &mut Quiet);
        // Every time the backup has applied every op its primary has, the two must be
        // equal (the end of the run compares their whole snapshots). Cheap, allocating
        // nothing: version, clocks' view and parameters.
        let primary = &self.shards.nodes[su];
        if self.found.drift.is_none() && backup.replication().0 == primary.replication().0 {
            let (p, q) = (sim_shard(primary), sim_shard(backup));
            if p.version() != q.version() || p.view() != q.view() || !bits_equal(p, q) {
                self.found.drift = Some(format!(
                    "shard {s}: at {} ns, after op {}, its backup is at version {} with members {:?}, its \
                     primary at {} with {:?}{}",
                    self.now,
                    primary.replication().0,
                    q.version(),
                    q.workers(),
                    p.version(),
                    p.workers(),
                    if bits_equal(p, q) { "" } else { ", and their parameters differ" }
                ));
            }
        }
        let mut confirmed = None;
        while let Some(out) = backup.poll_output() {
            if let NodeOutput::Confirm { seq } = out {
                confirmed = Some(seq);
            }
        }
        if let Some(seq) = confirmed {
            let (b, primary) = (self.shards.backup_of[s as usize], self.server_node(s));
            let t = match b {
                Some(b) => self.net.after_latency(self.now, self.node_index(Node::Server(b)), primary),
                None => self.now + self.net.latency_ns,
            };
            self.at(t, Ev::Confirm(s, epoch, seq));
        }
        Ok(())
    }
}
