//! What a cluster policy sees: each shard's sample, and the window between two samples turned
//! into the cluster's [`Figures`].
//!
//! A [`ShardSample`] is taken from a [`Shard`] the same way by the host's servers (it travels in
//! their status) and by the simulator; [`Sampler`] keeps the previous samples and makes the
//! per-window numbers (iterations, compute time, waiting) from the counters' differences. A
//! shard that failed over or restarted starts its counters again: a counter that went back is
//! read as a fresh start (the window counts from zero).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::WorkerId;
use syncopate_policy_sdk::cluster::{Figures, ShardFigures, WorkerFigures};

use crate::shard::Shard;

/// One worker's work as a shard counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerWork {
    /// The worker.
    pub worker: WorkerId,
    /// Its clock here.
    pub clock: u64,
    /// The compute time its pushes here reported, summed ([`Signals::step_ns`]).
    ///
    /// [`Signals::step_ns`]: syncopate_policy_sdk::abi::Signals
    pub step_ns: u64,
    /// Its pushes that reported one.
    pub pushes: u64,
    /// The last loss it reported.
    pub loss: Option<f32>,
    /// Nanoseconds its pulls have spent deferred here.
    pub waited_ns: u64,
}

/// One shard at one moment: the counters a cluster policy's figures are made of.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardSample {
    /// The shard.
    pub shard: u32,
    /// Its policy's name.
    pub policy: String,
    /// Its policy's configuration.
    pub config: Vec<(String, String)>,
    /// Live workers' clocks and work here, by id.
    pub work: Vec<WorkerWork>,
    /// Pulls parked now.
    pub parked: u32,
    /// Pushes held now.
    pub held: u32,
    /// Pushes admitted so far.
    pub pushes: u64,
    /// Failures of the policy running now.
    pub failures: u64,
    /// Whether it is quarantined.
    pub quarantined: bool,
    /// The policy's metrics, last values.
    pub metrics: Vec<(String, f64)>,
}

impl ShardSample {
    /// The sample of `shard`, which serves shard number `id`.
    pub fn of(id: u32, shard: &Shard) -> Self {
        ShardSample {
            shard: id,
            policy: shard.policy().info().name.clone(),
            config: shard.policy_config().to_vec(),
            work: shard.worker_work(),
            parked: shard.parked_pulls() as u32,
            held: shard.held_pushes() as u32,
            pushes: shard.stats().pushes_admitted,
            failures: shard.module_failures(),
            quarantined: shard.is_quarantined(),
            metrics: shard.metrics().iter().map(|m| (m.name.clone(), m.last)).collect(),
        }
    }
}

/// Turns samples into figures over the window since the previous ones.
#[derive(Debug, Default)]
pub struct Sampler {
    last: Option<(u64, BTreeMap<u32, ShardSample>)>,
}

impl Sampler {
    /// A sampler with no previous samples.
    pub fn new() -> Self {
        Sampler::default()
    }

    /// The figures at `now_ns` from `samples` (one per shard that answered), against the
    /// previous call's. The first call's window is the run so far.
    pub fn figures(&mut self, now_ns: u64, mut samples: Vec<ShardSample>) -> Figures {
        let empty = BTreeMap::new();
        let (window_ns, before) = match &self.last {
            Some((t, before)) => (now_ns.saturating_sub(*t), before),
            None => (0, &empty),
        };
        // The policy most shards run (the first such, by shard, on a tie): (its first sample,
        // how many run it).
        let mut counts: Vec<(usize, usize)> = Vec::new();
        for (i, s) in samples.iter().enumerate() {
            match counts.iter_mut().find(|c| samples[c.0].policy == s.policy) {
                Some(c) => c.1 += 1,
                None => counts.push((i, 1)),
            }
        }
        let top = counts.iter().fold(None::<(usize, usize)>, |best, &c| match best {
            Some(b) if b.1 >= c.1 => Some(b),
            _ => Some(c),
        });
        let (policy, config) = top.map_or((String::new(), Vec::new()), |c| {
            (samples[c.0].policy.clone(), samples[c.0].config.clone())
        });

        let mut workers: BTreeMap<WorkerId, WorkerFigures> = BTreeMap::new();
        // Per worker: compute time and pushes summed over the shards in the window.
        let mut steps: BTreeMap<WorkerId, (u64, u64)> = BTreeMap::new();
        let mut shards = Vec::with_capacity(samples.len());
        for s in &mut samples {
            // By id, so the previous window's entry is a binary search away (a server sends
            // them in that order; one that did not would only cost the sort).
            s.work.sort_unstable_by_key(|k| k.worker);
        }
        for s in &samples {
            let prev = before.get(&s.shard);
            for k in &s.work {
                let earlier = prev.and_then(|p| {
                    p.work.binary_search_by_key(&k.worker, |x| x.worker).ok().map(|i| &p.work[i])
                });
                let iterations = k.clock.saturating_sub(earlier.map_or(0, |e| e.clock));
                let w = workers.entry(k.worker).or_insert(WorkerFigures {
                    worker: k.worker,
                    clock: k.clock,
                    iterations,
                    step_ns: 0,
                    waited_ns: 0,
                    loss: None,
                });
                w.clock = w.clock.min(k.clock);
                w.iterations = w.iterations.min(iterations);
                let (ns, n, waited) = match earlier {
                    Some(e)
                        if e.pushes <= k.pushes && e.step_ns <= k.step_ns && e.waited_ns <= k.waited_ns =>
                    {
                        (k.step_ns - e.step_ns, k.pushes - e.pushes, k.waited_ns - e.waited_ns)
                    }
                    _ => (k.step_ns, k.pushes, k.waited_ns),
                };
                let sum = steps.entry(k.worker).or_default();
                sum.0 += ns;
                sum.1 += n;
                w.waited_ns = w.waited_ns.max(waited);
                if k.loss.is_some() {
                    w.loss = k.loss;
                }
            }
            let pushes = match prev {
                Some(p) if p.pushes <= s.pushes => s.pushes - p.pushes,
                _ => s.pushes,
            };
            let lo = s.work.iter().map(|k| k.clock).min().unwrap_or(0);
            let hi = s.work.iter().map(|k| k.clock).max().unwrap_or(0);
            shards.push(ShardFigures {
                shard: s.shard,
                policy: s.policy.clone(),
                clocks: (lo, hi),
                parked: s.parked,
                held: s.held,
                pushes,
                failures: s.failures,
                quarantined: s.quarantined,
                metrics: s.metrics.clone(),
            });
        }
        for (worker, (ns, n)) in steps {
            if let (Some(w), true) = (workers.get_mut(&worker), n > 0) {
                w.step_ns = ns / n;
            }
        }
        self.last = Some((now_ns, samples.into_iter().map(|s| (s.shard, s)).collect()));
        Figures { window_ns, policy, config, workers: workers.into_values().collect(), shards }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(shard: u32, policy: &str, work: &[(u32, u64, u64, u64)]) -> ShardSample {
        ShardSample {
            shard,
            policy: policy.into(),
            work: work
                .iter()
                .map(|&(worker, step_ns, pushes, waited_ns)| WorkerWork {
                    worker,
                    clock: pushes,
                    step_ns,
                    pushes,
                    loss: None,
                    waited_ns,
                })
                .collect(),
            pushes: work.iter().map(|w| w.2).sum(),
            ..ShardSample::default()
        }
    }

    #[test]
    fn a_window_counts_the_differences_and_a_restarted_shard_counts_from_zero() {
        let mut s = Sampler::new();
        let first = s.figures(5, vec![sample(0, "bsp", &[(0, 100, 1, 0), (1, 400, 1, 0)])]);
        assert_eq!(first.window_ns, 0);
        assert_eq!((first.workers[0].step_ns, first.workers[1].step_ns), (100, 400));
        // Two shards: worker 1 computed 3 iterations of 500 ns; worker 0 waited 70 on shard 1.
        let f = s.figures(
            1005,
            vec![
                sample(0, "bsp", &[(0, 400, 4, 0), (1, 1900, 4, 0)]),
                sample(1, "ssp", &[(0, 300, 3, 70), (1, 1500, 3, 0)]),
            ],
        );
        assert_eq!(f.window_ns, 1000);
        assert_eq!(f.policy, "bsp");
        assert_eq!(f.workers[1].step_ns, 500, "{f:?}");
        assert_eq!(f.workers[0].step_ns, 100);
        assert_eq!(f.workers[0].waited_ns, 70);
        assert_eq!(f.workers[0].clock, 3, "the least over the shards");
        assert_eq!(f.workers[0].iterations, 3);
        assert_eq!(f.shards[0].pushes, 6);
        // Shard 0 restarted: its counters fell, so they count from zero.
        let f = s.figures(2005, vec![sample(0, "bsp", &[(0, 200, 2, 0), (1, 800, 2, 0)])]);
        assert_eq!((f.workers[0].step_ns, f.workers[1].step_ns), (100, 400));
    }
}
