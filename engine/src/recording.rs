//! Recordings of what a shard's policy saw and decided, for `syncopate policy replay`.
//!
//! A recording is one file per shard: the magic bytes [`MAGIC`], then entries, each a
//! little-endian `u32` length and a postcard [`Entry`]. An entry is a policy starting (the first,
//! one swapped in, or a restart after a failure) or one policy call: the event exactly as the
//! policy received it (its [`Envelope`] bytes, with the host's time, random value and clocks)
//! and the decisions it answered with, or its failure. The shard reports these through
//! [`Observer::policy_started`](crate::shard::Observer::policy_started) and
//! [`Observer::policy_called`](crate::shard::Observer::policy_called); a driver that records
//! writes them with a [`Writer`]; [`read`] gives them back and [`crate::replay`] feeds them to
//! any module.

use std::io::Write;

use serde::{Deserialize, Serialize};
use syncopate_policy_sdk::abi::{Envelope, WorkerClock, ENVELOPE_LEN};

use crate::runtime::PolicyModule;

/// The first bytes of every recording (format version 3: ABI v3's 128-byte envelopes, and the
/// workers handed over at each swap). [`read`] also reads format 2 (`SYNCREC2`: ABI v2's
/// 88-byte envelopes, whose pushes carry no signals), whose entries are otherwise the same.
pub const MAGIC: &[u8; 8] = b"SYNCREC3";

/// The first bytes of a format-2 recording, which [`read`] still reads.
pub const MAGIC_V2: &[u8; 8] = b"SYNCREC2";

/// Why a policy instance started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StartKind {
    /// The shard's first policy.
    First,
    /// Swapped in by an operator.
    Swap,
    /// Restarted from its last checkpoint after a failure.
    Restart,
}

/// One recorded item.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Entry<'a> {
    /// A policy instance started.
    Started {
        /// Why.
        kind: StartKind,
        /// Where the module came from (`builtin:ssp`, a file path).
        source: &'a str,
        /// Its name and version.
        policy: &'a str,
        /// Its SHA-256.
        sha256: [u8; 32],
        /// Its configuration.
        #[serde(borrow)]
        config: Vec<(&'a str, &'a str)>,
        /// The shard and the number of shards.
        shard: u32,
        /// How many shards the model is split into.
        shards: u32,
        /// Host time.
        now_ns: u64,
        /// The start-up decisions (postcard `Decision`s, back to back).
        decisions: &'a [u8],
    },
    /// One policy call.
    Called {
        /// The event as the policy received it ([`Envelope::to_bytes`]).
        envelope: &'a [u8],
        /// The decisions (postcard `Decision`s, back to back), or the failure.
        answer: Result<&'a [u8], &'a str>,
    },
    /// The live workers and their clocks handed to the policy swapped in next (the
    /// [`Handoff`](syncopate_policy_sdk::abi::Handoff)'s), written just before its
    /// [`Entry::Started`], so that a replay can hand its own state over as the host did.
    /// (Last of the variants: recordings from before it read as they did.)
    Handoff {
        /// The workers, at their clocks after the swap's levelling.
        workers: Vec<WorkerClock>,
    },
}

impl Entry<'_> {
    /// The envelope of a [`Entry::Called`], decoded.
    pub fn envelope(&self) -> Option<Envelope> {
        match self {
            Entry::Called { envelope, .. } => Envelope::from_bytes(envelope).ok(),
            Entry::Started { .. } | Entry::Handoff { .. } => None,
        }
    }
}

/// A policy instance starting, as the shard reports it to its sink.
#[derive(Clone, Copy, Debug)]
pub struct PolicyStart<'a> {
    /// Why.
    pub kind: StartKind,
    /// The module.
    pub module: &'a PolicyModule,
    /// Its configuration.
    pub config: &'a [(String, String)],
    /// The shard.
    pub shard: u32,
    /// How many shards the model is split into.
    pub shards: u32,
    /// Host time.
    pub now_ns: u64,
    /// The start-up decisions (empty for a restart: those of the first start stay in force).
    pub decisions: &'a [u8],
    /// The workers handed over to a policy swapped in (empty for the others).
    pub workers: &'a [WorkerClock],
}

/// A recording that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("not a readable recording: {0}")]
pub struct RecordingError(pub String);

/// Writes entries to `W` (a buffered file, usually).
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    buf: Vec<u8>,
}

impl<W: Write> Writer<W> {
    /// Starts a recording on `out`.
    pub fn new(mut out: W) -> std::io::Result<Self> {
        out.write_all(MAGIC)?;
        Ok(Writer { out, buf: Vec::with_capacity(256) })
    }

    /// Appends one entry.
    pub fn write(&mut self, entry: &Entry<'_>) -> std::io::Result<()> {
        self.buf.clear();
        self.buf.extend_from_slice(&[0; 4]);
        let mut buf = postcard::to_extend(entry, std::mem::take(&mut self.buf))
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let len = u32::try_from(buf.len() - 4).map_err(|_| std::io::Error::other("entry too large"))?;
        buf[..4].copy_from_slice(&len.to_le_bytes());
        let res = self.out.write_all(&buf);
        self.buf = buf;
        res
    }

    /// Appends a policy start.
    pub fn started(&mut self, s: &PolicyStart<'_>) -> std::io::Result<()> {
        if s.kind == StartKind::Swap {
            self.write(&Entry::Handoff { workers: s.workers.to_vec() })?;
        }
        let info = s.module.info();
        let policy = format!("{} {}", info.name, info.version);
        self.write(&Entry::Started {
            kind: s.kind,
            source: s.module.label(),
            policy: &policy,
            sha256: s.module.sha256(),
            config: s.config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
            shard: s.shard,
            shards: s.shards,
            now_ns: s.now_ns,
            decisions: s.decisions,
        })
    }

    /// Appends a policy call.
    pub fn called(&mut self, env: &Envelope, answer: Result<&[u8], &str>) -> std::io::Result<()> {
        let envelope: [u8; ENVELOPE_LEN] = env.to_bytes();
        self.write(&Entry::Called { envelope: &envelope, answer })
    }

    /// Flushes what is buffered.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The entries of a recording's bytes, in order. A recording cut short (its writer killed) ends
/// at its last whole entry.
pub fn read(bytes: &[u8]) -> Result<Vec<Entry<'_>>, RecordingError> {
    if bytes.starts_with(b"SYNCREC1") {
        return Err(RecordingError(
            "a recording of an older Syncopate (format 1: its events are 72-byte envelopes, ABI v2's are 88); \
             record the run again"
                .into(),
        ));
    }
    let mut rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .or_else(|| bytes.strip_prefix(MAGIC_V2.as_slice()))
        .ok_or_else(|| RecordingError("it does not start with SYNCREC3 (or SYNCREC2)".into()))?;
    let mut entries = Vec::new();
    while rest.len() >= 4 {
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let Some(body) = rest.get(4..4 + len) else { break };
        let entry: Entry<'_> = postcard::from_bytes(body)
            .map_err(|e| RecordingError(format!("entry {}: {e}", entries.len())))?;
        entries.push(entry);
        rest = &rest[4 + len..];
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::abi::{Event, ShardView};

    #[test]
    fn entries_round_trip_and_a_cut_recording_ends_at_its_last_whole_entry() {
        let mut w = Writer::new(Vec::new()).unwrap();
        let start = Entry::Started {
            kind: StartKind::First,
            source: "builtin:ssp",
            policy: "ssp 0.1.0",
            sha256: [7; 32],
            config: vec![("s", "3")],
            shard: 1,
            shards: 2,
            now_ns: 0,
            decisions: &[1, 2],
        };
        w.write(&start).unwrap();
        let env = Envelope {
            now_ns: 5,
            random: 9,
            view: ShardView { min_clock: 1, max_clock: 2, workers: 2 },
            event: Event::Timer { timer: 4 },
        };
        w.called(&env, Ok(&[3])).unwrap();
        w.called(&env, Err("it panicked")).unwrap();
        let bytes = w.out.clone();
        let entries = read(&bytes).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0], start);
        assert_eq!(entries[1].envelope(), Some(env));
        assert!(matches!(entries[2], Entry::Called { answer: Err("it panicked"), .. }));
        assert_eq!(read(&bytes[..bytes.len() - 3]).unwrap().len(), 2);
        assert!(read(b"not a recording").is_err());
    }

    /// A recording made before ABI v3 (format 2: 88-byte envelopes) still reads, its pushes
    /// without signals.
    #[test]
    fn a_format_2_recording_still_reads() {
        let push = syncopate_policy_sdk::abi::Push {
            id: 3,
            worker: 1,
            iteration: 2,
            clock: 2,
            samples: 8,
            staleness: 0,
            version: 5,
            signals: Default::default(),
        };
        let env = Envelope { now_ns: 5, random: 9, view: ShardView::default(), event: Event::Push(push) };
        let v2 = &env.to_bytes()[..syncopate_policy_sdk::abi::ENVELOPE_LEN_V2];
        let mut bytes = MAGIC_V2.to_vec();
        let body = postcard::to_allocvec(&Entry::Called { envelope: v2, answer: Ok(&[1]) }).unwrap();
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&body);
        let entries = read(&bytes).unwrap();
        assert_eq!(entries[0].envelope(), Some(env));
    }
}
