//! Spinning before sleeping: a node's runtime that runs out of work keeps polling its QUIC
//! sockets for a short while before it puts its thread to sleep.
//!
//! On virtual machines a sleeping core is a halted virtual CPU, and waking it (the other side's
//! packet arrives, the kernel sends an inter-processor interrupt, the hypervisor resumes the
//! vCPU) takes tens of microseconds. A request and its answer cost two such wake-ups, which on
//! this project's 2-core test machines made a 1 KiB round trip take about 120 µs of which the
//! work was under 40 µs (measured: 35-39 µs with the guest kernel's halt-polling switched on,
//! 42-57 µs with both processes pinned to one core). A thread that is still polling when the
//! packet arrives needs no wake-up. So each runtime thread, when it is about to sleep, first
//! polls the process's QUIC sockets with a zero timeout until one is readable or its spin budget
//! has passed; then it sleeps as usual (and finds the packet at once).
//!
//! The budget adapts per thread, by the rule Linux's guest halt-polling uses (cpuidle-haltpoll):
//! an idle spell that ended within the maximum but after the budget doubles the budget (from
//! [`GROW_START`]); one longer than the maximum halves it (below [`GROW_START`] it is 0, no
//! spinning). So a node trading small messages spins up to the maximum and never sleeps
//! between them, while one that waits for long (a worker computing, a shard holding a pull)
//! soon stops spinning and costs nothing. Other wake-ups (timers, other threads) are not
//! watched and may wait up to the budget. `--spin-us 0` turns spinning off.
//!
//! Sockets register themselves with [`watch`] when an endpoint binds them
//! ([`super::udp::CappedGso`] holds the registration and drops it with the socket).

use std::time::Duration;

/// The most a thread spins before it sleeps, unless told otherwise: enough for a small
/// request's round trip on loopback or a data-centre link.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

/// The smallest budget a thread spins with; an adapted budget below it becomes 0.
pub const GROW_START: Duration = Duration::from_micros(25);

/// A tokio runtime builder whose threads spin for up to `max_spin` before they sleep (see the
/// module documentation; zero never spins). `threads == 0` gives a current-thread runtime
/// (everything on the calling thread), otherwise a multi-thread runtime with that many workers.
/// I/O and timers are enabled.
pub fn runtime_builder(threads: usize, max_spin: Duration) -> tokio::runtime::Builder {
    let mut b = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.enable_all();
    #[cfg(target_os = "linux")]
    if !max_spin.is_zero() {
        b.on_thread_park(move || imp::before_sleep(max_spin));
        b.on_thread_unpark(move || imp::after_wake(max_spin));
    }
    #[cfg(not(target_os = "linux"))]
    let _ = max_spin;
    b
}

/// The next budget after an idle spell of `idle` with budget `budget` and maximum `max`.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn adapt(budget: Duration, idle: Duration, max: Duration) -> Duration {
    let start = GROW_START.min(max);
    if idle > max {
        let half = budget / 2;
        if half < start {
            Duration::ZERO
        } else {
            half
        }
    } else if idle > budget {
        (budget * 2).max(start).min(max)
    } else {
        budget
    }
}

/// Keeps a socket watched while alive.
#[derive(Debug)]
pub struct Watch {
    #[cfg(target_os = "linux")]
    fd: i32,
}

/// Watches `socket` for readability while the runtime spins; stops when the returned guard drops.
#[cfg(target_os = "linux")]
pub fn watch(socket: &impl std::os::fd::AsRawFd) -> Watch {
    let fd = socket.as_raw_fd();
    imp::add(fd);
    Watch { fd }
}

/// Watches `socket` (no spinning on this platform: does nothing).
#[cfg(not(target_os = "linux"))]
pub fn watch<S>(_socket: &S) -> Watch {
    Watch {}
}

#[cfg(target_os = "linux")]
impl Drop for Watch {
    fn drop(&mut self) {
        imp::remove(self.fd);
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::cell::{Cell, RefCell};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// The watched sockets, and a generation that changes with them so each thread refreshes
    /// its own copy only when needed (the spin itself takes no lock and allocates nothing).
    static WATCHED: Mutex<Vec<i32>> = Mutex::new(Vec::new());
    static GENERATION: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// This thread's copy of the watched sockets, and the generation it was taken at.
        static LOCAL: RefCell<(u64, Vec<libc::pollfd>)> = const { RefCell::new((u64::MAX, Vec::new())) };
        /// This thread's spin budget (`None`: not adapted yet, start at the maximum) and when
        /// it last went idle.
        static BUDGET: Cell<(Option<Duration>, Option<Instant>)> = const { Cell::new((None, None)) };
    }

    /// The runtime is about to sleep: spin first, within this thread's budget.
    pub(super) fn before_sleep(max: Duration) {
        let (budget, _) = BUDGET.get();
        let budget = budget.unwrap_or(max);
        BUDGET.set((Some(budget), Some(Instant::now())));
        if !budget.is_zero() {
            spin(budget);
        }
    }

    /// The runtime woke up: adapt the budget to how long it was idle.
    pub(super) fn after_wake(max: Duration) {
        if let (Some(budget), Some(since)) = BUDGET.get() {
            BUDGET.set((Some(super::adapt(budget, since.elapsed(), max)), None));
        }
    }

    pub(super) fn add(fd: i32) {
        WATCHED.lock().expect("spin registry not poisoned").push(fd);
        GENERATION.fetch_add(1, Ordering::Release);
    }

    pub(super) fn remove(fd: i32) {
        let mut watched = WATCHED.lock().expect("spin registry not poisoned");
        if let Some(i) = watched.iter().position(|&f| f == fd) {
            watched.swap_remove(i);
        }
        GENERATION.fetch_add(1, Ordering::Release);
    }

    /// Polls the watched sockets until one is readable or `budget` has passed.
    fn spin(budget: Duration) {
        LOCAL.with(|local| {
            let mut local = local.borrow_mut();
            let (seen, fds) = &mut *local;
            let generation = GENERATION.load(Ordering::Acquire);
            if *seen != generation {
                let watched = WATCHED.lock().expect("spin registry not poisoned");
                fds.clear();
                fds.extend(watched.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }));
                *seen = generation;
            }
            poll_until_readable(fds, budget);
        });
    }

    /// Polls `fds` until one is readable (true) or `budget` has passed (false). Returns false at
    /// once when there is nothing to poll.
    pub(super) fn poll_until_readable(fds: &mut [libc::pollfd], budget: Duration) -> bool {
        if fds.is_empty() {
            return false;
        }
        let start = Instant::now();
        loop {
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs; a zero timeout never
            // blocks. A closed descriptor reports POLLNVAL, which ends the spin.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
            if ready != 0 {
                return true;
            }
            if start.elapsed() >= budget {
                return false;
            }
            // Let any other thread that wants this core have it: spinning only uses time the
            // core would otherwise spend halted, never a busy neighbour's.
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
        }
    }

    #[cfg(test)]
    pub(super) fn watched() -> Vec<i32> {
        WATCHED.lock().expect("spin registry not poisoned").clone()
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Instant;

    #[test]
    fn a_spin_ends_when_a_socket_is_readable_or_the_budget_is_spent() {
        let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut fds = [libc::pollfd { fd: a.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // Nothing to read: the whole budget is spent.
        let t = Instant::now();
        assert!(!imp::poll_until_readable(&mut fds, Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
        // A datagram waiting: the spin ends at once, not after the 10 s budget.
        b.send_to(b"x", a.local_addr().unwrap()).unwrap();
        let t = Instant::now();
        assert!(imp::poll_until_readable(&mut fds, Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        // Nothing watched: no spin at all.
        assert!(!imp::poll_until_readable(&mut [], Duration::from_secs(10)));
    }

    #[test]
    fn budgets_grow_on_short_idle_spells_and_shrink_to_nothing_on_long_ones() {
        let us = Duration::from_micros;
        let max = us(100);
        // Caught by the spin: unchanged.
        assert_eq!(adapt(us(50), us(30), max), us(50));
        // Would have been caught by a longer spin: doubled, up to the maximum.
        assert_eq!(adapt(us(50), us(80), max), us(100));
        assert_eq!(adapt(us(100), us(100), max), us(100));
        // From nothing, a short spell starts spinning again.
        assert_eq!(adapt(Duration::ZERO, us(10), max), GROW_START);
        // Long spells halve it, and below the start it is off.
        assert_eq!(adapt(us(100), us(5000), max), us(50));
        assert_eq!(adapt(us(40), us(5000), max), Duration::ZERO);
        assert_eq!(adapt(Duration::ZERO, us(5000), max), Duration::ZERO);
        // A maximum under the start: spins stay within it.
        assert_eq!(adapt(Duration::ZERO, us(5), us(10)), us(10));
    }

    #[test]
    fn sockets_are_watched_while_their_guard_lives() {
        let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let guard = watch(&a);
        assert!(imp::watched().contains(&a.as_raw_fd()));
        drop(guard);
        assert!(!imp::watched().contains(&a.as_raw_fd()));
    }
}
