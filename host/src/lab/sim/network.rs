//! The modelled network: every node (the workers first, then the servers) has one link each way
//! of the scenario's bandwidth, and every message takes the scenario's latency. A transfer holds
//! the sender's uplink and the receiver's downlink for `bytes / bandwidth`, so concurrent
//! transfers through one link queue behind each other; messages without tensors take the latency
//! alone. A node's link may run slower for a while (the scenario's `[[link]]`): a transfer
//! that starts inside the window goes at the slower of its two ends' rates, and holds the
//! faster end only for its bytes at that end's rate. A cut link ([`SimLinkCut`](super::SimLinkCut)) holds what is sent on it until it heals,
//! in order, and holds up no other link.

use std::collections::BTreeMap;

/// One link direction: busy until `free_ns`.
#[derive(Clone, Copy, Default)]
struct Link {
    free_ns: u64,
    bytes: u64,
}

/// The links between the simulated nodes, and their cuts.
pub(super) struct Network {
    /// Uplink and downlink of each node.
    up: Vec<Link>,
    down: Vec<Link>,
    bytes_per_ns: f64,
    /// Every message's latency.
    pub(super) latency_ns: u64,
    /// Per pair of nodes (the lower index first): until when the link is cut.
    cut_links: BTreeMap<(usize, usize), u64>,
    /// Per direction of a link that was cut: when what was sent on it last leaves, so that
    /// what waited for the heal goes in order.
    pipes: BTreeMap<(usize, usize), u64>,
    /// Slower links for a while: (node, from, until, bytes per ns meanwhile).
    slow: Vec<(usize, u64, u64, f64)>,
}

impl Network {
    /// `nodes` nodes with links of `mbit` Mbit/s each way and `latency_ns` per message.
    pub(super) fn new(nodes: usize, mbit: f64, latency_ns: u64) -> Self {
        Network {
            up: vec![Link::default(); nodes],
            down: vec![Link::default(); nodes],
            bytes_per_ns: mbit * 1e6 / 8.0 / 1e9,
            latency_ns,
            cut_links: BTreeMap::new(),
            pipes: BTreeMap::new(),
            slow: Vec::new(),
        }
    }

    /// Node `node`'s link runs at `mbit` Mbit/s from `from` until `until` (virtual ns).
    pub(super) fn slow_link(&mut self, node: usize, from: u64, until: u64, mbit: f64) {
        self.slow.push((node, from, until, mbit * 1e6 / 8.0 / 1e9));
    }

    /// Node `node`'s link rate at `at`, in bytes per ns.
    fn rate(&self, at: u64, node: usize) -> f64 {
        self.slow
            .iter()
            .filter(|s| s.0 == node && (s.1..s.2).contains(&at))
            .map(|s| s.3)
            .fold(self.bytes_per_ns, f64::min)
    }

    /// Cuts the link between nodes `a` and `b` until `until` (or longer, if it is cut longer).
    pub(super) fn cut(&mut self, a: usize, b: usize, until: u64) {
        let heal = self.cut_links.entry((a.min(b), a.max(b))).or_default();
        *heal = (*heal).max(until);
    }

    /// A transfer of `bytes` from node `from` to node `to` starting at `now`; returns its
    /// arrival (held until a cut link heals).
    pub(super) fn transfer(&mut self, now: u64, from: usize, to: usize, bytes: u64) -> u64 {
        let start = now.max(self.up[from].free_ns).max(self.down[to].free_ns);
        let (up, down) = (self.rate(start, from), self.rate(start, to));
        let takes = (bytes as f64 / up.min(down)) as u64;
        let end = start + takes;
        // Each end is held for what the transfer takes of it: the slower end all the way, the
        // faster only for the bytes at its own rate (the rest of it is free for others), so a
        // slow link slows its own transfers, not the others' through the node at its far end.
        // At equal rates (every link but a slowed one) both are held until `end`.
        let (up_end, down_end) = if up == down {
            (end, end)
        } else {
            (start + (bytes as f64 / up) as u64, start + (bytes as f64 / down) as u64)
        };
        self.up[from].free_ns = up_end;
        self.down[to].free_ns = down_end;
        self.up[from].bytes += bytes;
        self.down[to].bytes += bytes;
        self.through_cut(from, to, end, takes) + self.latency_ns
    }

    /// When a message without tensors sent at `now` from node `from` reaches node `to`.
    pub(super) fn after_latency(&mut self, now: u64, from: usize, to: usize) -> u64 {
        self.through_cut(from, to, now, 0) + self.latency_ns
    }

    /// When a message that would leave node `from` for node `to` at `end` (taking `takes` on the
    /// wire) leaves it, if their link was ever cut: not before the link heals, and after what
    /// was sent on it before.
    fn through_cut(&mut self, from: usize, to: usize, end: u64, takes: u64) -> u64 {
        if self.cut_links.is_empty() {
            return end;
        }
        let Some(&until) = self.cut_links.get(&(from.min(to), from.max(to))) else { return end };
        let pipe = self.pipes.entry((from, to)).or_default();
        let out = end.max(until + takes).max(*pipe + takes);
        *pipe = out;
        out
    }

    /// Bytes node `node` sent and received.
    pub(super) fn bytes(&self, node: usize) -> (u64, u64) {
        (self.up[node].bytes, self.down[node].bytes)
    }
}
