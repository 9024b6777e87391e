//! Reused tensor buffers, and tensors lent to QUIC without a copy.
//!
//! On a server, every push brings a gradient as large as its shard, and a pull sends the
//! shard's parameters without copying them (QUIC holds them, shared; the shard copies them
//! before its next step if a pull still holds them then). On a worker, a gradient pushed with
//! [`crate::worker::WorkerClient::push_buffer`] goes to QUIC the same way. Allocating such
//! buffers fresh costs a zero-fill or fresh pages from the kernel, which on a 16 MiB tensor is
//! several percent of a request's time. Buffers nobody needs any more (applied gradients,
//! tensors QUIC has sent and the peer acknowledged) come back here and serve the next request.

use std::sync::{Arc, Mutex};

/// Spare buffers kept at most: enough for the requests usually in flight on a server (a push
/// and a pull per worker and shard in steady state cycle through far fewer). What is kept is
/// at most what was in use at once before.
const KEEP: usize = 8;

/// A shared stack of spare `f32` buffers. Cloning shares the stack.
#[derive(Clone, Debug, Default)]
pub struct TensorPool {
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
}

impl TensorPool {
    /// A buffer of exactly `len` values, reused when one of that size is spare. Its contents
    /// are unspecified: the caller overwrites them.
    pub fn take(&self, len: usize) -> Vec<f32> {
        let reused = {
            let mut spare = self.spare.lock().expect("pool lock not poisoned");
            spare.iter().rposition(|v| v.len() == len).map(|i| spare.swap_remove(i))
        };
        reused.unwrap_or_else(|| vec![0.0; len])
    }

    /// Hands a buffer back for reuse (dropped when enough are spare).
    pub fn give(&self, buffer: Vec<f32>) {
        if buffer.is_empty() {
            return;
        }
        let mut spare = self.spare.lock().expect("pool lock not poisoned");
        if spare.len() < KEEP {
            spare.push(buffer);
        }
    }

    /// Bytes of a shared tensor (a shard's parameters as a pull served them, a worker's
    /// gradient) that QUIC sends without a copy. When QUIC is done with them and nobody else
    /// holds the tensor (a shard has moved on to a copy), its buffer comes back to this pool.
    pub fn send_shared(&self, values: Arc<Vec<f32>>) -> bytes::Bytes {
        bytes::Bytes::from_owner(Lent { values: Some(values), pool: self.clone() })
    }
}

/// A tensor lent to QUIC; returns to its pool when QUIC drops it, if it was the last holder.
struct Lent {
    values: Option<Arc<Vec<f32>>>,
    pool: TensorPool,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        crate::net::wire::f32_bytes(self.values.as_deref().map_or(&[], |v| v.as_slice()))
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        // into_inner, not try_unwrap: of two last holders dropping at once, one gets it.
        if let Some(buffer) = self.values.take().and_then(Arc::into_inner) {
            self.pool.give(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_of_the_right_size_come_back() {
        let pool = TensorPool::default();
        let mut a = pool.take(1000);
        a[0] = 7.0;
        let ptr = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.take(999).len(), 999, "another size is a fresh buffer");
        let b = pool.take(1000);
        assert_eq!(b.as_ptr(), ptr, "the spare buffer is reused");
        let shared = Arc::new(b);
        let bytes = pool.send_shared(Arc::clone(&shared));
        assert_eq!(bytes.len(), 4000);
        assert_eq!(bytes[..4], 7.0f32.to_le_bytes(), "the tensor's own bytes, not a copy");
        drop(bytes);
        assert!(pool.spare.lock().unwrap().is_empty(), "still held elsewhere: not reused");
        let bytes = pool.send_shared(shared);
        drop(bytes);
        let c = pool.take(1000);
        assert_eq!(c.as_ptr(), ptr, "sent bytes come back once their last holder drops");
    }

    #[test]
    fn the_pool_keeps_a_bounded_number() {
        let pool = TensorPool::default();
        for _ in 0..100 {
            pool.give(vec![0.0; 10]);
        }
        assert_eq!(pool.spare.lock().unwrap().len(), KEEP);
    }
}
