//! Where a worker that joins a running cluster starts, decided from the shards' answers to its
//! joins: pure arithmetic, asked by the tokio client (`syncopate worker`, the Python package)
//! and by the simulator, so both start a joiner the same way.
//!
//! Each shard answers a join with the next iteration it expects from the worker, the worker's
//! clock there, and whether it counted the worker as a member already (a process restarted
//! under its id, a shard restored from a checkpoint) or took it afresh at the slowest live
//! worker's clock. Two cases:
//! - **Every shard knew it**: it starts at the earliest iteration any shard expects; the shards
//!   already past acknowledge those pushes as the duplicates they are (their first copies were
//!   applied there).
//! - **Otherwise** (a late joiner, or a process restarted while some shards had dropped its
//!   predecessor and others not yet) its clocks must be made level: it asks every shard again
//!   where it stands (a member's join changes nothing), the shards where its clock is below the
//!   largest skip it up to there, and it asks again, until they are level; each shard then
//!   numbers its iterations from its own next one. Level clocks matter twice: two late joiners
//!   whose clocks cross (each ahead where the other is behind) would wait for each other under
//!   BSP, and a shard that took the worker afresh at clock `c` counts a push numbered below `c`
//!   as a duplicate, acknowledged and never applied.

/// One shard's answer to a worker's join (or to a check of where it stands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinAnswer {
    /// The next iteration the shard expects from the worker, in its numbering.
    pub next: u64,
    /// The worker's clock there.
    pub clock: u64,
    /// Whether the shard already counted the worker as a member.
    pub member: bool,
}

/// What a joining worker does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JoinStep {
    /// It starts at iteration `at`; shard `i` numbers its iteration `k` as `k + offsets[i]`.
    Start {
        /// The worker's first iteration.
        at: u64,
        /// Per shard, what to add to the worker's iteration to get the shard's numbering.
        offsets: Vec<i64>,
    },
    /// It asks every shard again where it stands.
    Check,
    /// It tells these shards (by index) to skip it up to the iteration given, then checks again.
    Skip(Vec<(usize, u64)>),
}

/// The step after the first answers, one per shard.
pub fn after_joins(answers: &[JoinAnswer]) -> JoinStep {
    let zeros = || vec![0; answers.len()];
    if !answers.is_empty() && answers.iter().all(|a| a.member) {
        let at = answers.iter().map(|a| a.next).min().unwrap_or(0);
        return JoinStep::Start { at, offsets: zeros() };
    }
    // Nobody has pushed anywhere (and no swap raised a clock): it starts with everyone.
    if answers.iter().all(|a| a.clock == 0) {
        return JoinStep::Start { at: 0, offsets: zeros() };
    }
    JoinStep::Check
}

/// The step after a check's answers, one per shard: start once the clocks are level, else skip
/// the shards behind up to the largest clock.
pub fn after_check(answers: &[JoinAnswer]) -> JoinStep {
    let top = answers.iter().map(|a| a.clock).max().unwrap_or(0);
    let behind: Vec<(usize, u64)> = answers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.clock < top)
        .map(|(i, a)| (i, a.next + (top - a.clock)))
        .collect();
    if behind.is_empty() {
        let offsets = answers.iter().map(|a| a.next as i64 - top as i64).collect();
        return JoinStep::Start { at: top, offsets };
    }
    JoinStep::Skip(behind)
}

/// A joining worker's progress through [`after_joins`] and [`after_check`], answer by answer:
/// what the tokio client and the simulator feed their shards' answers to, so that both take
/// the same steps. The driver first asks every shard to join; each time a step asks every
/// shard again ([`JoinStep::Check`]) it joins every shard again; each time it asks some to skip
/// ([`JoinStep::Skip`]), it tells them and reports each one taken ([`Joining::skipped`]), after
/// which every shard is checked again.
#[derive(Clone, Debug)]
pub struct Joining {
    answers: Vec<Option<JoinAnswer>>,
    /// Whether the answers awaited are a check's.
    checked: bool,
    /// The shards told to skip that have not yet taken it.
    skipping: Vec<bool>,
}

impl Joining {
    /// A worker about to join `shards` shards.
    pub fn new(shards: usize) -> Joining {
        Joining { answers: vec![None; shards], checked: false, skipping: vec![false; shards] }
    }

    /// Shard `i` answered a join (the first, a check, or the join of a new primary after a
    /// move, which counts as its answer, or as its skip if it was told one: the check that
    /// follows sees where it stands). Once every shard has answered, the next step; a step that
    /// asks again ([`JoinStep::Check`]) clears the answers, and one that skips waits for the
    /// skips.
    pub fn joined(&mut self, i: usize, answer: JoinAnswer) -> Option<JoinStep> {
        if self.skipping[i] {
            return self.skipped(i);
        }
        if self.skipping.iter().any(|s| *s) {
            return None;
        }
        self.answers[i] = Some(answer);
        let answers = self.answers.iter().copied().collect::<Option<Vec<_>>>()?;
        let step = if self.checked { after_check(&answers) } else { after_joins(&answers) };
        match &step {
            JoinStep::Start { .. } => {}
            JoinStep::Check => self.check(),
            JoinStep::Skip(behind) => {
                for &(x, _) in behind {
                    self.skipping[x] = true;
                }
            }
        }
        Some(step)
    }

    /// Shard `i` took the skip it was told. Once every shard told has, [`JoinStep::Check`].
    pub fn skipped(&mut self, i: usize) -> Option<JoinStep> {
        if !std::mem::replace(&mut self.skipping[i], false) || self.skipping.iter().any(|s| *s) {
            return None;
        }
        self.check();
        Some(JoinStep::Check)
    }

    fn check(&mut self) {
        self.checked = true;
        self.answers.fill(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(next: u64, clock: u64) -> JoinAnswer {
        JoinAnswer { next, clock, member: true }
    }

    fn fresh(clock: u64) -> JoinAnswer {
        JoinAnswer { next: clock, clock, member: false }
    }

    #[test]
    fn a_worker_every_shard_knew_starts_at_the_earliest_iteration_expected() {
        let step = after_joins(&[member(33, 33), member(34, 34)]);
        assert_eq!(step, JoinStep::Start { at: 33, offsets: vec![0, 0] });
    }

    #[test]
    fn a_worker_that_joins_before_anyone_pushed_starts_at_zero() {
        assert_eq!(after_joins(&[fresh(0), fresh(0)]), JoinStep::Start { at: 0, offsets: vec![0, 0] });
        assert_eq!(after_joins(&[]), JoinStep::Start { at: 0, offsets: vec![] });
    }

    #[test]
    fn a_late_joiner_checks_then_skips_the_shards_behind_up_to_the_largest_clock() {
        assert_eq!(after_joins(&[fresh(5), fresh(7)]), JoinStep::Check);
        assert_eq!(after_check(&[fresh(5), fresh(7)]), JoinStep::Skip(vec![(0, 7)]));
        // A swap raised its clock on shard 1 past its numbering there.
        let raised = JoinAnswer { next: 7, clock: 9, member: true };
        assert_eq!(after_check(&[fresh(9), raised]), JoinStep::Start { at: 9, offsets: vec![0, -2] });
    }

    /// A process restarted under its id while one shard had dropped its predecessor (and took
    /// it afresh at the others' clock, 34) and the other still counted it (next 33): starting at
    /// 33 would have the first shard acknowledge iteration 33 as a duplicate, never applied.
    /// The clocks are levelled instead: the second shard skips it up to 34.
    #[test]
    fn a_restarted_process_some_shards_had_dropped_levels_its_clocks() {
        let first = [fresh(34), member(33, 33)];
        assert_eq!(after_joins(&first), JoinStep::Check);
        assert_eq!(after_check(&first), JoinStep::Skip(vec![(1, 34)]));
        let levelled = [fresh(34), member(34, 34)];
        assert_eq!(after_check(&levelled), JoinStep::Start { at: 34, offsets: vec![0, 0] });
    }

    #[test]
    fn joining_answer_by_answer_checks_skips_checks_again_and_starts_level() {
        let mut j = Joining::new(2);
        assert_eq!(j.joined(1, fresh(7)), None);
        assert_eq!(j.joined(0, fresh(5)), Some(JoinStep::Check));
        assert_eq!(j.joined(0, fresh(5)), None);
        assert_eq!(j.joined(1, fresh(7)), Some(JoinStep::Skip(vec![(0, 7)])));
        // Nothing counts while a skip is out, and a shard not told to skip takes none.
        assert_eq!(j.joined(1, fresh(7)), None);
        assert_eq!(j.skipped(1), None);
        assert_eq!(j.skipped(0), Some(JoinStep::Check));
        assert_eq!(j.skipped(0), None);
        assert_eq!(j.joined(0, member(7, 7)), None);
        assert_eq!(j.joined(1, member(7, 7)), Some(JoinStep::Start { at: 7, offsets: vec![0, 0] }));
    }

    /// A shard told to skip moved before the skip reached it: the join of its new primary
    /// stands for the skip, and the check that follows sees where it is.
    #[test]
    fn a_join_from_a_shard_told_to_skip_counts_as_its_skip() {
        let mut j = Joining::new(2);
        j.joined(0, fresh(5));
        j.joined(1, fresh(7));
        j.joined(0, fresh(5));
        assert_eq!(j.joined(1, fresh(7)), Some(JoinStep::Skip(vec![(0, 7)])));
        assert_eq!(j.joined(0, fresh(5)), Some(JoinStep::Check));
    }

    #[test]
    fn joining_before_anyone_pushed_starts_at_once() {
        let mut j = Joining::new(2);
        assert_eq!(j.joined(0, fresh(0)), None);
        assert_eq!(j.joined(1, fresh(0)), Some(JoinStep::Start { at: 0, offsets: vec![0, 0] }));
    }
}
