//! Receive windows that fit the socket buffer.
//!
//! Every connection of an endpoint delivers into the one UDP socket's receive buffer
//! ([`super::udp::SOCKET_BUFFER`]). QUIC's flow control lets each peer send as much as its
//! connection's receive window allows, and CUBIC, a loss-based congestion controller, grows
//! until something drops. On loopback nothing else drops, so with windows of hundreds of
//! megabytes the socket buffer overflowed: 16 MiB pushes lost about 0.1% of their packets from
//! one worker and 3% from eight at once, each loss halving a congestion window. TCP cannot
//! overrun its receiver this way: each connection has a buffer of its own, and its window is
//! that buffer's free space.
//!
//! So a server divides its receive buffer among the connections that send it bulk data (its
//! workers, and primaries replicating to it): each gets [`share`] of [`receive_budget`],
//! re-divided as they come and go ([`WindowShare`]). The windows then add up to what the buffer
//! holds, and a burst from all of them at once fits. Connections start at [`MIN_WINDOW`]
//! ([`super::tls::transport`]), since a window, once granted, cannot be taken back: eight
//! workers that joined with 16 MiB each under a first window of the whole budget still
//! overflowed it. Measured in three alternating rounds of the transport benchmark on loopback
//! (1 and 16 MiB, both directions, synchronous and eight in flight): the kernel's receive-buffer
//! drops fell from 17,800-21,500 per run to none, and throughput stayed within 0.92-1.03x of
//! the build before (256 MiB windows, and a 4 MiB buffer under this machine's cap where it now
//! takes 16 MiB, [`super::udp::bind`]). The lowest, 16 MiB synchronous pushes, has one worker
//! pushing while seven idle ones hold their shares. Where the system caps the buffer and the
//! process may not exceed the cap, the floor times the workers can exceed the budget, and a
//! burst from all of them can drop again; the node warns at start-up.

use std::sync::{Arc, Mutex};

/// The smallest window a connection gets, however many share the buffer. Below about this, a
/// window caps one connection's throughput on a cluster link (a window is at most one round
/// trip's worth of bytes in flight).
pub const MIN_WINDOW: u64 = 1 << 20;

/// The bytes of payload the windows may add up to: half of what the kernel charges packets
/// against, since each packet costs the buffer more than its payload (a 64 KB datagram is
/// charged its buffers' whole size).
pub fn receive_budget() -> u64 {
    match super::udp::granted_receive_buffer() {
        0 => super::udp::SOCKET_BUFFER as u64,
        b => b / 2,
    }
}

/// One connection's window when `connections` share a `budget`: an equal part, at least
/// [`MIN_WINDOW`].
pub fn share(budget: u64, connections: usize) -> u64 {
    (budget / connections.max(1) as u64).max(MIN_WINDOW)
}

/// The connections that share an endpoint's receive buffer.
#[derive(Debug, Default)]
pub struct WindowShare {
    conns: Mutex<Vec<quinn::Connection>>,
}

impl WindowShare {
    /// Counts `conn` among the sharers until the returned guard drops, re-dividing the buffer
    /// now and then.
    pub fn join(self: &Arc<Self>, conn: &quinn::Connection) -> Sharing {
        let mut conns = self.conns.lock().expect("not poisoned");
        conns.push(conn.clone());
        rebalance(&conns);
        Sharing { share: self.clone(), id: conn.stable_id() }
    }
}

/// A connection's place in a [`WindowShare`]; dropping it gives the place up.
#[derive(Debug)]
pub struct Sharing {
    share: Arc<WindowShare>,
    id: usize,
}

impl Drop for Sharing {
    fn drop(&mut self) {
        let mut conns = self.share.conns.lock().expect("not poisoned");
        conns.retain(|c| c.stable_id() != self.id);
        rebalance(&conns);
    }
}

/// Gives every connection in `conns` its [`share`] of [`receive_budget`].
fn rebalance(conns: &[quinn::Connection]) {
    let window = share(receive_budget(), conns.len());
    let window = quinn::VarInt::from_u64(window).unwrap_or(quinn::VarInt::MAX);
    for c in conns {
        c.set_receive_window(window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_windows_add_up_to_the_budget_until_the_floor() {
        let budget = 16 << 20;
        assert_eq!(share(budget, 1), budget, "one sender keeps it all");
        assert_eq!(share(budget, 0), budget);
        assert_eq!(8 * share(budget, 8), budget);
        assert_eq!(share(budget, 64), MIN_WINDOW, "many senders: the floor");
    }
}
