//! The device model: how long a worker's computation takes beyond the real arithmetic, so one
//! machine can stand for a heterogeneous cluster (slow devices, jitter, stalls, emulated compute).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::Distribution;

/// How a worker's device behaves. The default is a device exactly as fast as the arithmetic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Device {
    /// Emulated compute time per iteration of the starting batch size, in nanoseconds
    /// (proportional to the samples actually computed). In the simulator, where arithmetic
    /// takes no virtual time, this is the whole compute time.
    pub compute_ns: u64,
    /// This device takes `slow_factor` times as long, emulated time included (1: normal).
    pub slow_factor: f32,
    /// A random delay after each iteration, normal with this mean and standard deviation in
    /// milliseconds (FluentPS's injection).
    pub jitter_ms: Option<(f64, f64)>,
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
            slow_factor: 1.0,
            jitter_ms: None,
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
        Ok(DeviceState { device, jitter, rng: ChaCha8Rng::seed_from_u64(device.seed), debt_ns: 0 })
    }

    /// The time to add to `compute_ns` (real arithmetic on `samples` samples, of a batch of
    /// `batch`) so that it takes as long as this device would: the emulated compute's share is
    /// `samples / batch`; all of it is stretched by the slow factor.
    pub fn extra_ns(&self, compute_ns: u64, samples: u32, batch: u32) -> u64 {
        let fraction = f64::from(samples) / f64::from(batch.max(1));
        let paced = compute_ns as f64 + self.device.compute_ns as f64 * fraction;
        let stretch = if self.device.slow_factor > 1.0 {
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
            Some(n) => n.sample(&mut self.rng).max(0.0) as u64,
            None => 0,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_device_stretches_compute_and_emulated_time() {
        let d = DeviceState::new(Device { compute_ns: 10_000_000, slow_factor: 3.0, ..Device::default() })
            .unwrap();
        // Half a batch: 5 ms emulated + 2 ms real, all of it 3x: 21 ms, of which 19 ms extra.
        assert_eq!(d.extra_ns(2_000_000, 16, 32), 19_000_000);
        let plain = DeviceState::new(Device::default()).unwrap();
        assert_eq!(plain.extra_ns(2_000_000, 32, 32), 0);
        assert!(DeviceState::new(Device { jitter_ms: Some((1.0, -1.0)), ..Device::default() }).is_err());
    }

    #[test]
    fn the_stall_comes_once_when_due() {
        let mut d = DeviceState::new(Device { stall_ns: Some((100, 50)), ..Device::default() }).unwrap();
        assert_eq!(d.delay_ns(99), 0);
        assert_eq!(d.delay_ns(100), 50);
        assert_eq!(d.delay_ns(200), 0);
    }
}
