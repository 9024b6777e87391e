//! Where an exchange's pull lands (`NativeSession.exchange`), shard by shard: the session's
//! [`Landing`], whose buffers the Python half reads a shard at a time while the exchange still
//! runs on another thread (`NativeSession.land_part`, from the next forward pass's hooks).
//!
//! Each shard's buffer is owned by whoever holds it: lent to the exchange for its shard's pull
//! (moved out of [`Slots`]), or back in the slots, where readers copy from it with the lock held.
//! A reader waits, with the GIL released, until the shards it needs are landed or the exchange
//! is over; nothing is read while the exchange may still write it.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use syncopate::worker::Landing;

/// How long a reader waits without the GIL before it looks for signals (Ctrl-C).
const LOOK_FOR_SIGNALS: Duration = Duration::from_millis(50);

/// What the slots hold between and during exchanges.
#[derive(Default)]
pub(crate) struct SlotState {
    /// Each shard's buffer (empty while lent).
    pub(crate) bufs: Vec<Vec<f32>>,
    /// Whether each shard's buffer holds its part of the model last pulled.
    pub(crate) landed: Vec<bool>,
    /// Each shard's first value in the model, and the model's length at the end.
    pub(crate) starts: Vec<usize>,
    /// What the exchange in flight said of its pull: not yet (`None`), early (`Some(Some(it))`)
    /// or at its end (`Some(None)`).
    pub(crate) plan: Option<Option<u64>>,
    /// Whether the last exchange begun has returned or will not run (then nothing more lands
    /// until the next).
    pub(crate) over: bool,
    /// How many exchanges have begun (a feed names the one it was made for).
    pub(crate) exchange: u64,
}

impl SlotState {
    /// The shards whose key ranges meet `offset..offset + len` (the model's, checked).
    pub(crate) fn shards_over(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>, String> {
        let Some(&model) = self.starts.last() else {
            return Err("no exchange has pulled anything yet".into());
        };
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= model)
            .ok_or_else(|| format!("values {offset} to {offset}+{len} are outside the model's {model}"))?;
        let shards = self.starts.len().saturating_sub(1);
        if len == 0 {
            let at = self.starts[..shards].partition_point(|&s| s <= offset);
            return Ok(at..at);
        }
        // The shard holding `offset`, and every one after it that starts before `end`.
        let first = self.starts[..shards].partition_point(|&s| s <= offset).saturating_sub(1);
        let last = self.starts[..shards].partition_point(|&s| s < end);
        Ok(first..last)
    }
}

/// The session's buffers for exchanges' pulls, one per shard.
#[derive(Default)]
pub(crate) struct Slots {
    state: Mutex<SlotState>,
    changed: Condvar,
}

impl Slots {
    /// Locks the state (a poisoned lock still holds consistent buffers: nothing panics while
    /// it holds them half-written).
    pub(crate) fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Readies the slots for an exchange over shards of these key ranges (a feed was made for
    /// it): nothing is landed or planned yet, and readers wait for it until it returns or the
    /// feed is dropped unexchanged ([`abandon`](Self::abandon)). Returns the exchange's number.
    pub(crate) fn begin(&self, ranges: &[std::ops::Range<usize>]) -> u64 {
        let mut s = self.lock();
        s.exchange += 1;
        s.bufs.resize_with(ranges.len(), Vec::new);
        s.landed.clear();
        s.landed.resize(ranges.len(), false);
        s.starts.clear();
        s.starts.extend(ranges.iter().map(|r| r.start).chain(ranges.last().map(|r| r.end)));
        s.plan = None;
        s.over = false;
        s.exchange
    }

    /// Exchange `exchange` will not run (its feed was dropped unexchanged): nothing waits for
    /// it. Nothing changes if a later one has begun.
    pub(crate) fn abandon(&self, exchange: u64) {
        let mut s = self.lock();
        if s.exchange == exchange {
            s.over = true;
            drop(s);
            self.changed.notify_all();
        }
    }

    /// Marks the exchange over when the guard is dropped (however it returns): every reader
    /// wakes.
    pub(crate) fn ending(&self) -> Ending<'_> {
        Ending(self)
    }

    /// Waits until `ready` holds or the exchange is over, at most [`LOOK_FOR_SIGNALS`]; returns
    /// the state, locked, and whether `ready` held.
    pub(crate) fn wait_a_while(
        &self,
        ready: impl Fn(&SlotState) -> bool,
    ) -> (MutexGuard<'_, SlotState>, bool) {
        let g = self.lock();
        let (g, _) = self
            .changed
            .wait_timeout_while(g, LOOK_FOR_SIGNALS, |s| !ready(s) && !s.over)
            .unwrap_or_else(|e| e.into_inner());
        let ok = ready(&g);
        (g, ok)
    }
}

/// An exchange in flight: over when dropped ([`Slots::ending`]).
pub(crate) struct Ending<'a>(&'a Slots);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.lock().over = true;
        self.0.changed.notify_all();
    }
}

impl Landing for Slots {
    fn lend(&self, shard: usize, len: usize) -> Vec<f32> {
        let mut s = self.lock();
        s.landed[shard] = false;
        let mut values = std::mem::take(&mut s.bufs[shard]);
        values.resize(len, 0.0);
        values
    }

    fn give_back(&self, shard: usize, values: Vec<f32>, landed: bool) {
        let mut s = self.lock();
        s.bufs[shard] = values;
        s.landed[shard] = landed;
        drop(s);
        self.changed.notify_all();
    }

    fn planned(&self, early: Option<u64>) {
        self.lock().plan = Some(early);
        self.changed.notify_all();
    }
}
