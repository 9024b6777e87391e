//! The UDP socket under every QUIC endpoint: larger kernel buffers, and segmentation offload
//! (GSO) batches kept within what the kernel accepts.
//!
//! Two things made large tensors slow over quinn's defaults, both measured on loopback:
//! - the kernel's default socket buffer (about 208 KB) holds few packets, so a multi-megabyte
//!   burst overflowed it and every drop cost a loss recovery ([`SOCKET_BUFFER`]);
//! - quinn batches packets of the path MTU into one GSO send (up to ten in the published crate,
//!   64 in the copy we carry, `third_party/quinn`) without capping the batch's total size.
//!   Once MTU discovery finds a large MTU (64 KB on loopback, 9 KB on jumbo-frame links), such
//!   a batch is over the kernel's 64 KB limit per send, the kernel answers `EMSGSIZE`, and
//!   quinn-udp drops the batch silently (it expects that error only from MTU probes): every
//!   batch became a loss. [`CappedGso`] splits such batches, and asks quinn
//!   for batches no larger than one send once it has sent large packets: a batch of ten 64 KB
//!   packets was encrypted whole before its first packet left, so the receiver sat idle
//!   meanwhile (1 MiB requests 1.04-1.4x faster with batches of one such packet, in alternating
//!   runs of both builds).

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Socket buffer size asked for, both ways. The kernel caps it at `net.core.rmem_max` /
/// `wmem_max` unless the process may override the cap (`CAP_NET_ADMIN`, as root has); what was
/// granted is logged at debug level. The receive buffer bounds the receive windows
/// (`net/window.rs`), so its size is a server's throughput when many workers push at once.
pub const SOCKET_BUFFER: usize = 16 << 20;

/// The receive buffer the kernel granted the last socket bound ([`bind`]), as it reports it:
/// twice the granted size, which is what it charges packets against. 0 before any bind.
static GRANTED: AtomicU64 = AtomicU64::new(0);

/// What the kernel granted the last bound socket's receive buffer (0 before any bind): the
/// flow-control windows ([`super::window`]) divide it among connections.
pub fn granted_receive_buffer() -> u64 {
    GRANTED.load(Ordering::Relaxed)
}

/// The most UDP payload bytes one send may carry: an IPv4 datagram's 65,535 bytes less its
/// IP and UDP headers (IPv6 allows a little more).
pub const MAX_SEND_BYTES: usize = 65_535 - 20 - 8;

/// A UDP socket bound to `addr` with [`SOCKET_BUFFER`]-sized buffers.
pub fn bind(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        // A v6 socket also serves v4-mapped peers where the system allows it.
        let _ = socket.set_only_v6(false);
    }
    // Best effort: a smaller buffer still works, only with more drops under bursts. Past the
    // system's cap where the process may; else up to the cap.
    if !force_buffer(&socket, libc::SO_RCVBUFFORCE) {
        let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    }
    if !force_buffer(&socket, libc::SO_SNDBUFFORCE) {
        let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    }
    socket.bind(&addr.into())?;
    let (recv, send) = (socket.recv_buffer_size().unwrap_or(0), socket.send_buffer_size().unwrap_or(0));
    tracing::debug!(%addr, recv, send, "UDP socket buffers");
    GRANTED.store(recv as u64, Ordering::Relaxed);
    // Linux reports twice the granted size: less than that means the cap bit.
    if recv < 2 * SOCKET_BUFFER {
        tracing::warn!(
            "the UDP receive buffer is {} KiB, not the {} MiB asked for (the system caps it): large \
             tensors will lose packets in bursts and move slower; raise the cap, e.g. \
             `sysctl -w net.core.rmem_max={SOCKET_BUFFER} net.core.wmem_max={SOCKET_BUFFER}`",
            recv / 1024,
            SOCKET_BUFFER >> 20
        );
    }
    Ok(socket.into())
}

/// Sets a socket buffer (`SO_RCVBUFFORCE` or `SO_SNDBUFFORCE`) to [`SOCKET_BUFFER`] past the
/// system's cap; false where the process lacks `CAP_NET_ADMIN`.
fn force_buffer(socket: &socket2::Socket, option: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    let bytes = SOCKET_BUFFER as libc::c_int;
    // SAFETY: the descriptor is open for the call's duration, and the option's value is a
    // c_int whose size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    rc == 0
}

/// A quinn socket whose GSO sends never exceed [`MAX_SEND_BYTES`]: a larger batch goes out as
/// several sends of whole segments. quinn is asked for batches of as many of the largest
/// segments batched so far as fit in one send ([`batch_segments`]). Everything else is the
/// wrapped socket's.
pub struct CappedGso {
    inner: Arc<dyn AsyncUdpSocket>,
    /// The largest segment of a GSO batch sent so far, in bytes ([`batched_segment`]).
    largest: AtomicUsize,
    /// The socket is watched by spinning runtime threads ([`super::spin`]) while it lives.
    _watch: super::spin::Watch,
}

impl CappedGso {
    /// Wraps a runtime's socket; `watch` is the socket's registration for spinning.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, watch: super::spin::Watch) -> Self {
        CappedGso { inner, largest: AtomicUsize::new(0), _watch: watch }
    }
}

impl fmt::Debug for CappedGso {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CappedGso").field("inner", &self.inner).finish()
    }
}

/// How many packets quinn may put in one GSO batch, given the largest segment batched so far
/// (0: none yet) and what the socket allows: as many as fit in one send, at least one. More
/// saves no system call (the batch is split into sends anyway) and only delays the first
/// packet of the batch, which waits until all of them are built and encrypted. A socket
/// talking to peers on different paths batches for the largest packets it sends, so peers on
/// small-packet paths then get smaller batches than they could.
pub fn batch_segments(largest: usize, allowed: usize) -> usize {
    match largest {
        0 => allowed,
        _ => (MAX_SEND_BYTES / largest).clamp(1, allowed.max(1)),
    }
}

/// The segment size of a transmit that batches several packets: the path MTU quinn has
/// confirmed. A lone packet says nothing about the path. It may be an MTU probe, and a probe
/// larger than the interface's MTU is refused by the kernel (`EMSGSIZE`), which quinn-udp
/// reports as sent. Counting such probes made every batch one packet long on a 1,500-byte link
/// (one system call per 1,448-byte packet: 270 MB/s where TCP moved 2.9 GB/s).
fn batched_segment(t: &Transmit<'_>) -> Option<usize> {
    t.segment_size.filter(|&s| t.contents.len() > s)
}

/// The sends a transmit becomes: itself when it fits, else runs of whole segments that fit.
fn split<'a>(t: &'a Transmit<'a>) -> impl Iterator<Item = Transmit<'a>> + 'a {
    let run = match t.segment_size {
        Some(segment) if t.contents.len() > MAX_SEND_BYTES => (MAX_SEND_BYTES / segment).max(1) * segment,
        _ => t.contents.len().max(1),
    };
    t.contents.chunks(run).map(move |chunk| Transmit {
        destination: t.destination,
        ecn: t.ecn,
        contents: chunk,
        segment_size: t.segment_size.filter(|&s| chunk.len() > s),
        src_ip: t.src_ip,
    })
}

impl AsyncUdpSocket for CappedGso {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        if let Some(segment) = batched_segment(transmit) {
            self.largest.fetch_max(segment, Ordering::Relaxed);
        }
        if transmit.contents.len() <= MAX_SEND_BYTES || transmit.segment_size.is_none() {
            return self.inner.try_send(transmit);
        }
        for (i, part) in split(transmit).enumerate() {
            match self.inner.try_send(&part) {
                Ok(()) => {}
                // Nothing sent yet: quinn waits for the socket and retries the whole batch.
                Err(e) if i == 0 => return Err(e),
                // Part of the batch is out. Reporting an error would make quinn send that part
                // again; the rest is left to QUIC's loss recovery instead, as a drop would be.
                Err(e) => {
                    tracing::trace!(error = %e, "GSO batch cut short");
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        batch_segments(self.largest.load(Ordering::Relaxed), self.inner.max_transmit_segments())
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transmit(contents: &[u8], segment_size: Option<usize>) -> Transmit<'_> {
        Transmit { destination: ([127, 0, 0, 1], 9).into(), ecn: None, contents, segment_size, src_ip: None }
    }

    #[test]
    fn batches_that_fit_go_out_whole() {
        let bytes = vec![7u8; 10 * 1452];
        let t = transmit(&bytes, Some(1452));
        let parts: Vec<_> = split(&t).collect();
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].contents.len(), bytes.len());
        assert_eq!(parts[0].segment_size, Some(1452));
    }

    #[test]
    fn large_segments_are_sent_one_per_send_and_nothing_is_lost() {
        // Ten 65,000-byte packets, the last one short: what quinn builds on loopback.
        let mut bytes = vec![0u8; 9 * 65_000 + 100];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i / 65_000) as u8;
        }
        let t = transmit(&bytes, Some(65_000));
        let parts: Vec<_> = split(&t).collect();
        assert_eq!(parts.len(), 10);
        assert!(parts.iter().all(|p| p.contents.len() <= MAX_SEND_BYTES && p.segment_size.is_none()));
        let joined: Vec<u8> = parts.iter().flat_map(|p| p.contents.iter().copied()).collect();
        assert_eq!(joined, bytes);
        assert_eq!(parts[9].contents, &[9u8; 100][..]);
    }

    #[test]
    fn batches_hold_what_one_send_carries() {
        assert_eq!(batch_segments(0, 10), 10, "nothing sent yet: what the socket allows");
        assert_eq!(batch_segments(1_452, 10), 10, "Ethernet-sized packets: the socket's limit");
        assert_eq!(batch_segments(8_972, 10), 7, "jumbo frames: seven per send");
        assert_eq!(batch_segments(65_000, 10), 1, "loopback's 64 KB packets: one per send");
        assert_eq!(batch_segments(65_000, 0), 1, "never zero");
    }

    #[test]
    fn only_batches_say_how_large_packets_are() {
        let probe = vec![0u8; 65_000];
        assert_eq!(batched_segment(&transmit(&probe, None)), None, "a lone probe the link may refuse");
        let batch = vec![0u8; 3 * 1_448 + 200];
        assert_eq!(batched_segment(&transmit(&batch, Some(1_448))), Some(1_448));
        assert_eq!(batched_segment(&transmit(&batch[..1_448], Some(1_448))), None, "one packet");
    }

    #[test]
    fn mid_size_segments_are_grouped_in_whole_runs() {
        // Jumbo frames: 8,972-byte packets, seven fit in one send.
        let bytes = vec![1u8; 10 * 8_972];
        let t = transmit(&bytes, Some(8_972));
        let parts: Vec<_> = split(&t).collect();
        assert_eq!(parts.iter().map(|p| p.contents.len() / 8_972).collect::<Vec<_>>(), [7, 3]);
        assert!(parts.iter().all(|p| p.contents.len() <= MAX_SEND_BYTES && p.segment_size == Some(8_972)));
    }
}
