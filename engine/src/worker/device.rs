//! The device model: how long a worker's computation takes beyond the real arithmetic, so one
//! machine can stand for a heterogeneous cluster (slow devices, jitter, stalls, emulated compute,
//! or compute times measured on a real cluster, replayed).

use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::Distribution;

/// How a worker's device behaves. The default is a device exactly as fast as the arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Emulated compute time per iteration of the starting batch size, in nanoseconds
    /// (proportional to the samples actually computed). In the simulator, where arithmetic
    /// takes no virtual time, this is the whole compute time.
    pub compute_ns: u64,
    /// Compute times measured on a real device, in nanoseconds per computation of the starting
    /// batch size, replayed in order and from the start again when they run out (a trace of a
    /// real run: `docs/workloads.md`). When set, they replace `compute_ns`, and the real
    /// arithmetic counts towards them.
    pub trace_ns: Option<Arc<[u64]>>,
    /// This device takes `slow_factor` times as long, emulated time included (1: normal).
    pub slow_factor: f32,
    /// When the slowdown applies: from and until these nanoseconds after the worker started
    /// (an iteration whose computation ends in the window is slow); `None`: always.
    pub slow_during: Option<(u64, u64)>,
    /// A random delay after each iteration, normal with this mean and standard deviation in
    /// milliseconds (FluentPS's injection).
    pub jitter_ms: Option<(f64, f64)>,
    /// When the jitter applies, as [`Device::slow_during`]; `None`: always.
    pub jitter_during: Option<(u64, u64)>,
    /// Stall once: `at` nanoseconds after the start, for this many nanoseconds.
    pub stall_ns: Option<(u64, u64)>,
    /// Seed of the jitter's random source (the driver's: the machine has no randomness of its
    /// own).
    pub seed: u64,
    /// Emulated time shorter than this is owed and paid with the next (timers have about a
    /// millisecond's resolution on a real machine; 0 in virtual time).
    pub granularity_ns: u64,
}

impl Default for Device {
    fn default() -> Self {
        Device {
            compute_ns: 0,
            trace_ns: None,
            slow_factor: 1.0,
            slow_during: None,
            jitter_ms: None,
            jitter_during: None,
            stall_ns: None,
            seed: 0,
            granularity_ns: 0,
        }
    }
}

/// A validated device with its random source.
#[derive(Debug)]
pub(crate) struct DeviceState {
    pub device: Device,
    jitter: Option<rand_distr::Normal<f64>>,
    rng: ChaCha8Rng,
    /// Emulated time owed (negative: overslept), in nanoseconds.
    pub debt_ns: i64,
    /// Computations timed so far (where a trace is replayed from).
    computed: usize,
}

impl DeviceState {
    pub fn new(device: Device) -> Result<Self, String> {
        let jitter = match device.jitter_ms {
            Some((mean, sd)) if !(mean.is_finite() && sd.is_finite() && mean >= 0.0 && sd >= 0.0) => {
                return Err(format!(
                    "bad jitter N({mean}, {sd}): mean and deviation must be finite and not negative"
                ));
            }
            Some((mean, sd)) => Some(
                rand_distr::Normal::new(mean * 1e6, sd * 1e6)
                    .map_err(|e| format!("bad jitter N({mean}, {sd}): {e}"))?,
            ),
            None => None,
        };
        if !(device.slow_factor.is_finite() && device.slow_factor > 0.0) {
            return Err(format!("slow factor {} is not a positive number", device.slow_factor));
        }
        for (what, window) in [("slowdown", device.slow_during), ("jitter", device.jitter_during)] {
            if let Some((from, until)) = window.filter(|(from, until)| from >= until) {
                return Err(format!("a {what} from {from} ns until {until} ns: it must end after it starts"));
            }
        }
        if device.trace_ns.as_ref().is_some_and(|t| t.is_empty()) {
            return Err("an empty trace of compute times".into());
        }
        let rng = ChaCha8Rng::seed_from_u64(device.seed);
        Ok(DeviceState { device, jitter, rng, debt_ns: 0, computed: 0 })
    }

    /// The time to add to `compute_ns` (real arithmetic on `samples` samples, of a batch of
    /// `batch`) so that it takes as long as this device would: the emulated compute's share is
    /// `samples / batch`; all of it is stretched by the slow factor while the slowdown applies
    /// (`since_start`: when the computation ended, after the worker started). With a trace, the
    /// next measured time's share is the whole time, the arithmetic included.
    pub fn extra_ns(&mut self, compute_ns: u64, samples: u32, batch: u32, since_start: u64) -> u64 {
        let fraction = f64::from(samples) / f64::from(batch.max(1));
        let paced = match &self.device.trace_ns {
            Some(trace) => {
                let measured = trace[self.computed % trace.len()] as f64 * fraction;
                self.computed += 1;
                measured.max(compute_ns as f64)
            }
            None => compute_ns as f64 + self.device.compute_ns as f64 * fraction,
        };
        let slow_now = within(self.device.slow_during, since_start);
        let stretch = if self.device.slow_factor > 1.0 && slow_now {
            paced * f64::from(self.device.slow_factor - 1.0)
        } else {
            0.0
        };
        (paced - compute_ns as f64 + stretch).round() as u64
    }

    /// The injected delay after an iteration that ends `since_start` nanoseconds after the
    /// worker started: a jitter draw, plus the stall if it is due (once).
    pub fn delay_ns(&mut self, since_start: u64) -> u64 {
        let mut delay = match &self.jitter {
            // Drawn in the window only: outside it the random source does not move.
            Some(n) if within(self.device.jitter_during, since_start) => {
                n.sample(&mut self.rng).max(0.0) as u64
            }
            _ => 0,
        };
        if let Some((at, length)) = self.device.stall_ns {
            if since_start >= at {
                tracing::info!(length_ms = length / 1_000_000, "stalling, as asked");
                delay += length;
                self.device.stall_ns = None;
            }
        }
        delay
    }
}

/// Whether `t` lies in `window` (`None`: always).
fn within(window: Option<(u64, u64)>, t: u64) -> bool {
    window.is_none_or(|(from, until)| (from..until).contains(&t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slowdown and a jitter with a window apply only inside it.
    #[test]
    fn a_slowdown_and_a_jitter_apply_only_in_their_windows() {
        let device = Device {
            compute_ns: 10,
            slow_factor: 3.0,
            slow_during: Some((100, 200)),
            jitter_ms: Some((1.0, 0.0)),
            jitter_during: Some((150, 300)),
            ..Device::default()
        };
        let mut d = DeviceState::new(device.clone()).unwrap();
        let extra: Vec<u64> = [0, 99, 100, 199, 200].iter().map(|t| d.extra_ns(0, 32, 32, *t)).collect();
        assert_eq!(extra, [10, 10, 30, 30, 10]);
        let delays: Vec<u64> = [149, 150, 299, 300].iter().map(|t| d.delay_ns(*t)).collect();
        assert_eq!(delays, [0, 1_000_000, 1_000_000, 0]);
        let backwards = Device { slow_during: Some((5, 5)), ..device };
        assert!(DeviceState::new(backwards).unwrap_err().contains("must end after it starts"));
    }

    #[test]
    fn a_slow_device_stretches_compute_and_emulated_time() {
        let mut d =
            DeviceState::new(Device { compute_ns: 10_000_000, slow_factor: 3.0, ..Device::default() })
                .unwrap();
        // Half a batch: 5 ms emulated + 2 ms real, all of it 3x: 21 ms, of which 19 ms extra.
        assert_eq!(d.extra_ns(2_000_000, 16, 32, 0), 19_000_000);
        let mut plain = DeviceState::new(Device::default()).unwrap();
        assert_eq!(plain.extra_ns(2_000_000, 32, 32, 0), 0);
        assert!(DeviceState::new(Device { jitter_ms: Some((1.0, -1.0)), ..Device::default() }).is_err());
    }

    /// A trace's times are replayed in order, cycled, each scaled to the samples computed; the
    /// real arithmetic counts towards them.
    #[test]
    fn a_trace_is_replayed_in_order_and_cycled() {
        let trace: Arc<[u64]> = Arc::from(vec![10, 20, 30]);
        let mut d =
            DeviceState::new(Device { trace_ns: Some(trace), compute_ns: 999, ..Device::default() }).unwrap();
        let got: Vec<u64> = (0..5).map(|_| d.extra_ns(0, 32, 32, 0)).collect();
        assert_eq!(got, [10, 20, 30, 10, 20]);
        assert_eq!(d.extra_ns(4, 16, 32, 0), 11, "half of 30 is 15, 4 of them real arithmetic");
        assert_eq!(d.extra_ns(50, 32, 32, 0), 0, "arithmetic slower than the trace is not undone");
        assert!(DeviceState::new(Device { trace_ns: Some(Arc::from(vec![])), ..Device::default() }).is_err());
    }

    #[test]
    fn the_stall_comes_once_when_due() {
        let mut d = DeviceState::new(Device { stall_ns: Some((100, 50)), ..Device::default() }).unwrap();
        assert_eq!(d.delay_ns(99), 0);
        assert_eq!(d.delay_ns(100), 50);
        assert_eq!(d.delay_ns(200), 0);
    }
}
