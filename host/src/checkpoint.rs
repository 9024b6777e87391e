//! Checkpoints on disk: rounds of shard snapshots, written crash-safely, and the search for the
//! newest one that is whole.
//!
//! A checkpoint directory holds one folder per round, `ckpt-000042/`:
//! - `shard-K.snap`: shard `K`'s [`ShardSnapshot`], framed with its length and SHA-256, written
//!   by the server that holds the shard;
//! - `policy.wasm`: the module every shard ran when the round was taken (after any hot swap);
//! - `pilot.json`: the cluster policy's state, if the coordinator runs one ([`write_pilot`]),
//!   with its module's SHA-256: a coordinator that resumes with the same module restores it;
//! - `manifest.json`: written by the coordinator last, once every server has confirmed its
//!   shards; a round without it is incomplete and never read.
//!
//! Every file is written to a temporary name, synced, renamed into place, and the folder synced
//! (the write, sync, rename of every trusted store), so a crash leaves either the old file or the
//! new one, never half of one. [`latest`] takes the newest round whose manifest and shard files
//! all check out; a torn or corrupt round is reported (a `tracing` warning naming the file and
//! what is wrong) and the round before it is used. The coordinator keeps the last
//! [`KEEP_ROUNDS`] complete rounds.
//!
//! Each shard's snapshot is consistent in itself; the shards of one round are taken one after
//! the other, not at one instant. That is enough for exactly-once: a worker that comes back joins
//! each shard where that shard's snapshot left it, restarts at the earliest of those iterations,
//! and the shards already past an iteration acknowledge its push as a duplicate without applying
//! it again ([`crate::server`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::shard::{ShardSnapshot, SnapshotError};

/// The manifest format this build writes and reads.
pub const MANIFEST_FORMAT: u32 = 1;

/// Complete rounds kept; older ones are deleted once a newer round is complete.
pub const KEEP_ROUNDS: usize = 2;

/// What went wrong with a checkpoint directory.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// No round in the directory is complete and intact.
    #[error("no usable checkpoint in {dir}{}", if .problems.is_empty() { String::new() } else { format!(": {}", .problems.join("; ")) })]
    NoneUsable {
        /// The directory.
        dir: PathBuf,
        /// Why each round there was passed over.
        problems: Vec<String>,
    },
}

/// What the coordinator writes last in a round: what the round holds and how to run it again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// The round.
    pub round: u64,
    /// When it was taken, in milliseconds since the Unix epoch.
    pub taken_unix_ms: u64,
    /// The policy's label (file name or built-in name).
    pub policy: String,
    /// SHA-256 of `policy.wasm`, hex.
    pub policy_sha256: String,
    /// The policy's configuration.
    pub config: Vec<(String, String)>,
    /// Per-shard configuration overrides.
    pub overrides: Vec<(u32, String, String)>,
    /// Hot swaps done before the round.
    pub swaps: u64,
    /// Shards (one file each).
    pub shards: u32,
    /// Parameters in the whole model.
    pub model_len: u64,
}

/// A round that checked out.
#[derive(Debug)]
pub struct Round {
    /// Its folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The policy module's bytes.
    pub wasm: Vec<u8>,
}

/// The cluster policy's state in a round (`pilot.json`).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct PilotFile {
    /// SHA-256 of its module, hex: the state is only for the same module.
    module_sha256: String,
    /// What the module exported.
    state: Vec<u8>,
}

/// Writes the cluster policy's `state` (its module's SHA-256 `sha256`) into round folder
/// `folder`, crash-safely.
pub fn write_pilot(folder: &Path, sha256: &str, state: &[u8]) -> Result<(), CheckpointError> {
    let file = PilotFile { module_sha256: sha256.to_owned(), state: state.to_vec() };
    let json = serde_json::to_vec(&file).map_err(|e| CheckpointError::Io {
        what: "encoding the cluster policy's state".into(),
        source: std::io::Error::other(e),
    })?;
    write_atomic(&folder.join("pilot.json"), &json)
}

/// The cluster policy's state that round folder `folder` keeps for the module of SHA-256
/// `sha256`, if it keeps one (for another module, or unreadable: none, with a warning).
pub fn read_pilot(folder: &Path, sha256: &str) -> Option<Vec<u8>> {
    let path = folder.join("pilot.json");
    let bytes = std::fs::read(&path).ok()?;
    match serde_json::from_slice::<PilotFile>(&bytes) {
        Ok(f) if f.module_sha256 == sha256 => Some(f.state),
        Ok(_) => {
            tracing::warn!(file = %path.display(), "the cluster policy kept there is another module: it starts afresh");
            None
        }
        Err(e) => {
            tracing::warn!(file = %path.display(), "the cluster policy's state does not read ({e}): it starts afresh");
            None
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let what = what.into();
    move |source| CheckpointError::Io { what, source }
}

/// The folder of round `round` in `dir`.
pub fn round_dir(dir: &Path, round: u64) -> PathBuf {
    dir.join(format!("ckpt-{round:06}"))
}

/// The file of shard `shard` in a round's folder.
pub fn shard_file(round: &Path, shard: u32) -> PathBuf {
    round.join(format!("shard-{shard}.snap"))
}

/// Writes `bytes` to `path` crash-safely: a temporary file, synced, renamed over `path`, and the
/// folder synced.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_file(path, bytes).map_err(io(format!("cannot write {}", path.display())))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Writes `bytes` to `path` whole or not at all: into `path`'s `.tmp` sibling, synced, then
/// renamed over `path`. On any failure (a full disk, say) the `.tmp` file is removed and `path`
/// is left as it was: never a file cut short, or an empty one.
pub fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(format!("cannot sync {}", dir.display())))
}

/// The rounds present in `dir` (complete or not), newest first.
pub fn rounds(dir: &Path) -> Vec<u64> {
    let mut found: Vec<u64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ckpt-")?.parse().ok())
        .collect();
    found.sort_unstable_by(|a, b| b.cmp(a));
    found
}

/// Checks one round: its manifest, its module against the manifest's hash, and every shard file
/// (length, checksum, that it decodes, that it is the shard it says). Returns the round, or why
/// it cannot be used.
pub fn check_round(dir: &Path, round: u64) -> Result<Round, String> {
    let folder = round_dir(dir, round);
    let manifest_path = folder.join("manifest.json");
    let bytes = std::fs::read(&manifest_path)
        .map_err(|e| format!("round {round} is incomplete ({}: {e})", manifest_path.display()))?;
    let manifest: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| format!("{} is corrupt: {e}", manifest_path.display()))?;
    if manifest.format != MANIFEST_FORMAT {
        return Err(format!(
            "{}: format {}, this build reads {MANIFEST_FORMAT}",
            manifest_path.display(),
            manifest.format
        ));
    }
    let wasm_path = folder.join("policy.wasm");
    let wasm = std::fs::read(&wasm_path).map_err(|e| format!("{}: {e}", wasm_path.display()))?;
    let digest: String =
        <sha2::Sha256 as sha2::Digest>::digest(&wasm).iter().map(|b| format!("{b:02x}")).collect();
    if digest != manifest.policy_sha256 {
        return Err(format!("{} does not match the manifest's SHA-256", wasm_path.display()));
    }
    for shard in 0..manifest.shards {
        let path = shard_file(&folder, shard);
        let snap = read_snapshot(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if snap.shard() != shard || snap.shards() != manifest.shards {
            return Err(format!("{} holds shard {} of {}", path.display(), snap.shard(), snap.shards()));
        }
    }
    Ok(Round { dir: folder, manifest, wasm })
}

/// Reads and checks one shard file.
pub fn read_snapshot(path: &Path) -> Result<ShardSnapshot, SnapshotError> {
    let bytes = std::fs::read(path).map_err(|e| SnapshotError::NotASnapshot(e.to_string()))?;
    ShardSnapshot::decode(&bytes)
}

/// The newest complete, intact round in `dir`. Each round passed over is logged with the reason,
/// so an operator sees that round 12 was torn and round 11 was used.
pub fn latest(dir: &Path) -> Result<Round, CheckpointError> {
    let mut problems = Vec::new();
    for round in rounds(dir) {
        match check_round(dir, round) {
            Ok(r) => {
                if !problems.is_empty() {
                    tracing::warn!("using checkpoint round {round} instead: {}", problems.join("; "));
                }
                return Ok(r);
            }
            Err(reason) => {
                tracing::warn!("checkpoint round {round} cannot be used: {reason}");
                problems.push(reason);
            }
        }
    }
    Err(CheckpointError::NoneUsable { dir: dir.to_path_buf(), problems })
}

/// Deletes every round but the [`KEEP_ROUNDS`] newest complete ones (and rounds newer than
/// those, which are still being written).
pub fn prune(dir: &Path) {
    let all = rounds(dir);
    let complete: Vec<u64> =
        all.iter().copied().filter(|r| round_dir(dir, *r).join("manifest.json").exists()).collect();
    let Some(&newest) = complete.first() else { return };
    let kept = &complete[..complete.len().min(KEEP_ROUNDS)];
    // Rounds newer than the newest complete one are being written: not ours to touch.
    for r in all.into_iter().filter(|r| *r < newest && !kept.contains(r)) {
        if let Err(e) = std::fs::remove_dir_all(round_dir(dir, r)) {
            tracing::warn!("cannot delete old checkpoint round {r}: {e}");
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cluster policy's state comes back for its own module only; a torn or foreign file
    /// is none (the policy then starts afresh), not an error that stops a resume.
    #[test]
    fn a_rounds_cluster_policy_state_is_read_back_for_its_module_only() {
        let dir = std::env::temp_dir().join(format!("syncopate-pilot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(read_pilot(&dir, "ab"), None, "no file");
        write_pilot(&dir, "ab", &[1, 2, 3]).unwrap();
        assert_eq!(read_pilot(&dir, "ab"), Some(vec![1, 2, 3]));
        assert_eq!(read_pilot(&dir, "cd"), None, "another module's");
        std::fs::write(dir.join("pilot.json"), b"{torn").unwrap();
        assert_eq!(read_pilot(&dir, "ab"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write that fails after its `.tmp` file was written (here the rename, over a directory;
    /// a full disk fails the same way, earlier) leaves no `.tmp` file and the target as it was.
    #[test]
    fn a_failed_write_leaves_neither_a_tmp_file_nor_a_torn_target() {
        let dir = std::env::temp_dir().join(format!("syncopate-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("target.json")).unwrap();
        assert!(write_file(&dir.join("target.json"), b"{}").is_err());
        assert!(!dir.join("target.tmp").exists(), "the .tmp file is removed");
        assert!(dir.join("target.json").is_dir(), "the target is as it was");
        // And one that succeeds replaces the file whole.
        write_file(&dir.join("kept.json"), b"old").unwrap();
        write_file(&dir.join("kept.json"), b"new").unwrap();
        assert_eq!(std::fs::read(dir.join("kept.json")).unwrap(), b"new");
        assert!(!dir.join("kept.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prune_keeps_the_newest_complete_rounds_and_the_one_being_written() {
        let dir = std::env::temp_dir().join(format!("syncopate-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (round, complete) in [(1, true), (2, false), (3, true), (4, true), (5, false)] {
            let folder = round_dir(&dir, round);
            std::fs::create_dir_all(&folder).unwrap();
            if complete {
                write_atomic(&folder.join("manifest.json"), b"{}").unwrap();
            }
        }
        prune(&dir);
        assert_eq!(rounds(&dir), [5, 4, 3], "4 and 3 are the newest complete; 5 is being written");
        // A manifest that does not parse is reported, and no round is usable.
        let err = latest(&dir).unwrap_err().to_string();
        assert!(err.contains("no usable checkpoint") && err.contains("round 5 is incomplete"), "{err}");
        assert!(err.contains("manifest.json is corrupt"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
