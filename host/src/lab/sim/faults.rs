//! The faults the simulator injects into workers' traffic and membership, beside the control
//! plane's (`control.rs`): messages a shard takes twice
//! ([`SimFaults::duplicate`](super::SimFaults::duplicate)), bad requests from a buggy or hostile
//! peer ([`SimFaults::bad_inputs`](super::SimFaults::bad_inputs)), and workers that join late
//! ([`SimFaults::late_join`](super::SimFaults::late_join)), which join as `WorkerClient::join`
//! does.

use rand::Rng as _;
use syncopate_engine::worker::join::{JoinAnswer, JoinStep, Joining};
use syncopate_engine::worker::{WorkerConfig, WorkerMachine};

use super::events::{Copied, Ev};
use super::{sim_shard, Req, Sim, SimError, DUPLICATE_WITHIN_NS};
use crate::shard::{PushHeader, Quiet};

impl Sim {
    /// Worker `w`, a late joiner, joins every shard whose primary it can reach (those on a
    /// dead server it joins once it hears where they moved).
    pub(super) fn late_join(&mut self, w: u32) -> Result<(), SimError> {
        let shards = self.shards.nodes.len();
        let wk = &mut self.workers[w as usize];
        if wk.dead {
            return Ok(());
        }
        wk.absent = false;
        wk.joining = Some(Joining::new(shards));
        tracing::debug!(worker = w, t_ns = self.now, "a late joiner joins");
        for s in 0..shards as u32 {
            // It asks the coordinator where the shards are: it knows every move so far.
            let to = self.shards.server_of[s as usize];
            self.workers[w as usize]
                .client
                .moved(s, to)
                .expect("the simulator moves shards to its own servers");
            if !self.down(s) {
                let token = self.token(Req::Join { w, s, again: None });
                let init = std::mem::take(&mut self.shards.inits[s as usize]);
                self.shards.nodes[s as usize].join(self.now, token, w, init, &mut Quiet);
                self.drain(s)?;
            }
        }
        Ok(())
    }

    /// Late joiner `w` heard from shard `s` where it stands there (a join's answer), and
    /// takes the step its [`Joining`] decides once every shard has answered, as `WorkerClient`
    /// does: every shard is asked again (a member's join says where it stands and changes
    /// nothing), since a hot swap's levelling may have raised its clock meanwhile on the shards
    /// it had joined; the worker starts once such a check finds its clocks level, each shard
    /// numbering its iterations from its own next one; if they are not, the shards where its
    /// clock is below the largest are told to skip it up to there, and it checks again. A shard
    /// that moves meanwhile answers the worker's join of its new primary, which counts as its
    /// answer. (A late joiner had no predecessor under its id, so no shard holds a push of its
    /// own: a member's answer, from a promoted backup that knew its join, is levelled as a fresh
    /// one is; the caller passes every answer as a fresh one.)
    pub(super) fn joined_late(&mut self, w: u32, s: u32, answer: JoinAnswer) -> Result<(), SimError> {
        let Some(j) = self.workers[w as usize].joining.as_mut() else { return Ok(()) };
        let step = j.joined(s as usize, answer);
        self.join_step(w, step)
    }

    /// Late joiner `w`'s skip on shard `s` was answered.
    pub(super) fn skipped_late(&mut self, w: u32, s: u32) -> Result<(), SimError> {
        let Some(j) = self.workers[w as usize].joining.as_mut() else { return Ok(()) };
        let step = j.skipped(s as usize);
        self.join_step(w, step)
    }

    /// Late joiner `w` takes the step its [`Joining`] decided.
    fn join_step(&mut self, w: u32, step: Option<JoinStep>) -> Result<(), SimError> {
        match step {
            None => Ok(()),
            Some(JoinStep::Start { at, offsets }) => self.begin(w, at, &offsets),
            Some(JoinStep::Check) => {
                for x in 0..self.shards.nodes.len() as u32 {
                    if !self.down(x) {
                        let token = self.token(Req::Join { w, s: x, again: None });
                        self.shards.nodes[x as usize].join(self.now, token, w, Vec::new(), &mut Quiet);
                        self.drain(x)?;
                    }
                }
                Ok(())
            }
            Some(JoinStep::Skip(behind)) => {
                for (x, to) in behind {
                    let x = x as u32;
                    if !self.down(x) {
                        let token = self.token(Req::LateSkip { w, s: x });
                        self.shards.nodes[x as usize].skip(self.now, token, w, to, &mut Quiet);
                        self.drain(x)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Late joiner `w` starts at `start` (its clock on every shard), shard `i` numbering its
    /// iterations `offsets[i]` on from its own (0 on every shard but those a swap raised it on).
    pub(super) fn begin(&mut self, w: u32, start: u64, offsets: &[i64]) -> Result<(), SimError> {
        let wk = &mut self.workers[w as usize];
        wk.client.start(offsets);
        let shared = wk.client.numbering_shared();
        let cfg = WorkerConfig { start, numbering_shared: shared, ..wk.cfg.clone() };
        wk.machine = WorkerMachine::new(cfg, self.now).map_err(|e| SimError::Worker(w, e))?;
        wk.joining = None;
        tracing::debug!(worker = w, start, ?offsets, t_ns = self.now, "the late joiner starts");
        self.ready(w)
    }

    /// With [`SimFaults::duplicate`](super::SimFaults::duplicate)'s chance, the message worker
    /// `w`'s shard `s` just took will reach it again, a little later.
    pub(super) fn duplicate(&mut self, w: u32, s: u32, copy: impl FnOnce() -> Copied) {
        let p = self.opts.faults.duplicate;
        if p <= 0.0 || !self.rng.random_bool(p) {
            return;
        }
        let again = self.now + self.rng.random_range(0..=DUPLICATE_WITHIN_NS);
        let i = self.mail.copies.post((self.shards.term[s as usize], copy()), 1);
        self.at(again, Ev::Again(w, s, i));
    }

    /// With [`SimFaults::bad_inputs`](super::SimFaults::bad_inputs)' chance, a bad request reaches
    /// shard `s`'s primary just before worker `w`'s request for (the shard's numbering of)
    /// `iteration`. It must be refused (see `drain`).
    pub(super) fn stranger(&mut self, w: u32, s: u32, iteration: u64) -> Result<(), SimError> {
        let p = self.opts.faults.bad_inputs;
        if p <= 0.0 || !self.rng.random_bool(p) {
            return Ok(());
        }
        let max = self.shards.node_cfgs[s as usize].shard.max_workers;
        let len = self.shards.ranges[s as usize].1 - self.shards.ranges[s as usize].0;
        let len = if self.opts.gradients { len } else { 1 };
        let never_joined =
            self.workers.len() as u32 + self.rng.random_range(0..max - self.workers.len() as u32);
        let (kind, r) = (self.rng.random_range(0..7u32), self.rng.random_range(1..4u64));
        let now = self.now;
        let what = match kind {
            0 => "a push from an id past max_workers",
            1 => "a push of the wrong length",
            2 => "a push with a NaN",
            3 => "a push that skips iterations",
            4 => "a pull from an id that never joined",
            5 => "a join with a slice of the wrong length",
            _ => "a skip from an impossible id",
        };
        let token = self.token(Req::Bad { s, what });
        let node = &mut self.shards.nodes[s as usize];
        let ones = |n: usize| vec![1.0f32; n];
        match kind {
            0 => node.push(
                now,
                token,
                PushHeader::gradient(max + r as u32, iteration, 1),
                ones(len),
                &mut Quiet,
            ),
            1 => node.push(
                now,
                token,
                PushHeader::gradient(w, iteration, 1),
                ones(len + r as usize),
                &mut Quiet,
            ),
            2 => {
                let mut grad = ones(len);
                grad[0] = f32::NAN;
                node.push(now, token, PushHeader::gradient(w, iteration, 1), grad, &mut Quiet)
            }
            3 => {
                // Past the next push the shard expects (one numbered as that next push would be
                // the worker's own, as far as a shard can tell: the servers authenticate workers).
                let ahead = sim_shard(node).resumes_at(w).max(iteration) + r;
                node.push(now, token, PushHeader::gradient(w, ahead, 1), ones(len), &mut Quiet)
            }
            4 => node.pull(now, token, never_joined, iteration, &mut Quiet),
            5 => node.join(now, token, never_joined, ones(len + r as usize), &mut Quiet),
            _ => node.skip(now, token, u32::MAX, iteration + r, &mut Quiet),
        }
        self.found.bad_inputs += 1;
        self.drain(s)
    }
}
