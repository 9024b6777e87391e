//! Throughput tracking and throughput-proportional shares: the one implementation of "give each
//! worker work in proportion to its speed", used by the R²SP and EPSP policies and open to any
//! policy.
//!
//! Feed it every [`crate::abi::IterationReport`] (samples and compute time) and
//! ask for shares of a total: `share_i = total * v_i / sum_j v_j`, rounded so the shares add up to
//! the total exactly and no live worker gets less than `min_share`.

use alloc::vec::Vec;

use crate::abi::{IterationReport, WorkerId};

/// Smoothed per-worker throughput, in samples per second.
#[derive(Clone, Debug, Default)]
pub struct Throughput {
    rate: Vec<Option<f64>>,
    /// Weight of the newest report in the moving average, in `(0, 1]`.
    alpha: f64,
}

impl Throughput {
    /// An empty tracker whose moving average gives the newest report weight `alpha`
    /// (clamped to `(0, 1]`; 1 keeps only the last report).
    pub fn new(alpha: f64) -> Self {
        Throughput { rate: Vec::new(), alpha: alpha.clamp(f64::MIN_POSITIVE, 1.0) }
    }

    /// Records one finished iteration. Reports with no samples or no time are ignored.
    pub fn record(&mut self, report: &IterationReport) {
        if report.samples == 0 || report.compute_ns == 0 {
            return;
        }
        let v = report.samples as f64 * 1e9 / report.compute_ns as f64;
        let i = report.worker as usize;
        if self.rate.len() <= i {
            self.rate.resize(i + 1, None);
        }
        let alpha = self.alpha;
        self.rate[i] = Some(match self.rate[i] {
            Some(old) => old + alpha * (v - old),
            None => v,
        });
    }

    /// Forgets a worker (it left).
    pub fn forget(&mut self, worker: WorkerId) {
        if let Some(r) = self.rate.get_mut(worker as usize) {
            *r = None;
        }
    }

    /// The worker's smoothed throughput in samples per second, once it has reported.
    pub fn rate(&self, worker: WorkerId) -> Option<f64> {
        self.rate.get(worker as usize).copied().flatten()
    }

    /// Splits `total` among `workers` in proportion to their throughput, each getting at least
    /// `min_share`; the shares add up to `total` (when `total >= min_share * workers`). Returns
    /// `None` until every one of them has reported.
    pub fn shares(&self, workers: &[WorkerId], total: u32, min_share: u32) -> Option<Vec<(WorkerId, u32)>> {
        let rates: Vec<f64> = workers.iter().map(|w| self.rate(*w)).collect::<Option<_>>()?;
        let sum: f64 = rates.iter().sum();
        if workers.is_empty() || sum <= 0.0 {
            return None;
        }
        let spare = total.saturating_sub(min_share * workers.len() as u32);
        let exact: Vec<f64> = rates.iter().map(|r| spare as f64 * r / sum).collect();
        let mut out: Vec<(WorkerId, u32)> =
            workers.iter().zip(&exact).map(|(w, e)| (*w, min_share + *e as u32)).collect();
        // Largest remainders get the units lost to rounding down.
        let mut left = total.saturating_sub(out.iter().map(|s| s.1).sum());
        let mut order: Vec<usize> = (0..out.len()).collect();
        order.sort_by(|a, b| (exact[*b] - exact[*b].floor()).total_cmp(&(exact[*a] - exact[*a].floor())));
        for i in order.into_iter().cycle() {
            if left == 0 {
                break;
            }
            out[i].1 += 1;
            left -= 1;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(worker: WorkerId, samples: u32, compute_ns: u64) -> IterationReport {
        IterationReport { worker, iteration: 0, compute_ns, samples }
    }

    #[test]
    fn shares_follow_throughput_and_add_up() {
        let mut t = Throughput::new(1.0);
        t.record(&report(0, 100, 1_000_000));
        t.record(&report(1, 100, 3_000_000));
        assert!(t.shares(&[0, 1, 2], 64, 1).is_none(), "worker 2 has not reported");
        let s = t.shares(&[0, 1], 64, 1).unwrap();
        assert_eq!(s.iter().map(|x| x.1).sum::<u32>(), 64);
        assert_eq!(s, vec![(0, 48), (1, 16)]);
    }

    #[test]
    fn the_moving_average_smooths() {
        let mut t = Throughput::new(0.5);
        t.record(&report(0, 10, 1_000_000_000));
        t.record(&report(0, 30, 1_000_000_000));
        assert_eq!(t.rate(0), Some(20.0));
        t.forget(0);
        assert_eq!(t.rate(0), None);
    }
}
