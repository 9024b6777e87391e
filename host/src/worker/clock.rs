//! The worker drivers' clock.

use std::time::{Duration, Instant};

/// The driver's clock: Unix time in nanoseconds, read from a monotonic clock (so a report's
/// times line up with other processes' and never go backwards).
#[derive(Debug)]
pub(crate) struct Clock {
    origin: Instant,
    unix_ns: u64,
}

impl Clock {
    pub(crate) fn new() -> Self {
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Clock { origin: Instant::now(), unix_ns: unix.as_nanos() as u64 }
    }

    pub(crate) fn now(&self) -> u64 {
        self.unix_ns + self.origin.elapsed().as_nanos() as u64
    }

    pub(crate) fn instant(&self, at_ns: u64) -> tokio::time::Instant {
        (self.origin + Duration::from_nanos(at_ns.saturating_sub(self.unix_ns))).into()
    }
}
