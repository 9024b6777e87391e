//! The coordinator machine's decisions, driven by hand.

use super::*;
use crate::lease::{LeaseError, FAILOVER_MS, FIRST_HEARTBEAT_MS};

const MS: u64 = 1_000_000;

/// Server `x`'s address in these tests.
fn at(x: u32) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7000 + x as u16))
}

fn machine(servers: u32, shards: u32, replicas: u32) -> CoordinatorMachine {
    CoordinatorMachine::new(CoordinatorConfig {
        servers,
        shards,
        replicas,
        max_workers: 4,
        peer_timeout_ms: 10_000,
        start: (3, 60_000),
    })
}

fn drain(m: &mut CoordinatorMachine) -> Vec<CoordOutput> {
    std::iter::from_fn(|| m.poll_output()).collect()
}

/// Carries out every command with `ok`, collecting what else came out.
fn settle(m: &mut CoordinatorMachine, ok: impl Fn(u32, Command) -> bool) -> Vec<CoordOutput> {
    let mut seen = Vec::new();
    while let Some(out) = m.poll_output() {
        if let CoordOutput::Command { id, server, command } = out {
            let r = if ok(server, command) {
                Ok(Answer::Done)
            } else {
                Err(ServerError::Prepare("refused".into()).into())
            };
            m.command_done(id, r);
        }
        seen.push(out);
    }
    seen
}

/// Two servers' holdings: each the primary of its own shard (at term 0, 10 values) and the
/// backup of the other's.
fn both_held() -> Vec<Held> {
    (0..2)
        .map(|s| Held {
            server: s,
            primaries: vec![(s, 0, 10)],
            backups: vec![(1 - s, 0, 10)],
            ..Held::default()
        })
        .collect()
}

/// Registers every server and attaches the initial backups.
fn started(servers: u32, shards: u32) -> CoordinatorMachine {
    let mut m = machine(servers, shards, 1);
    for s in 0..servers {
        assert_eq!(m.register_server(0, at(s)), Ok(s));
    }
    assert_eq!(m.register_server(0, at(servers)), Err(Refusal::ServersFull(servers)));
    for _ in 0..servers {
        assert!(!m.is_replicated());
        m.server_answered();
    }
    let out = settle(&mut m, |_, _| true);
    assert_eq!(out.last(), Some(&CoordOutput::Replicated));
    assert!(m.is_replicated());
    m
}

#[test]
fn backups_are_attached_before_workers_are_welcomed() {
    let mut m = machine(2, 2, 1);
    m.register_server(0, at(0)).unwrap();
    m.register_server(0, at(1)).unwrap();
    m.server_answered();
    assert!(drain(&mut m).is_empty());
    m.server_answered();
    let out = drain(&mut m);
    assert_eq!(
        out,
        vec![
            CoordOutput::Command { id: 0, server: 0, command: Command::AttachBackup { shard: 0, backup: 1 } },
            CoordOutput::Command { id: 1, server: 1, command: Command::AttachBackup { shard: 1, backup: 0 } },
        ]
    );
    m.command_done(0, Ok(Answer::Done));
    assert!(!m.is_replicated());
    // A backup that could not be attached leaves its shard without one; the cluster starts.
    m.command_done(1, Err(CommandError::Unanswered(10_000)));
    assert_eq!(drain(&mut m), vec![CoordOutput::Replicated]);
    assert_eq!(m.places()[0].backup, Some(1));
    assert_eq!(m.places()[1].backup, None);
}

#[test]
fn a_lapsed_lease_fails_the_server_over_and_re_replicates() {
    let mut m = started(3, 3);
    let t = FIRST_HEARTBEAT_MS * MS;
    m.renew(t, 0).unwrap();
    m.renew(t, 1).unwrap();
    // Server 2 renews no more: it lapses first.
    assert_eq!(m.poll_timeout(), Some(t + FAILOVER_MS * MS + 1));
    m.handle_timeout(t + FAILOVER_MS * MS);
    assert!(drain(&mut m).is_empty());
    m.renew(t + FAILOVER_MS * MS, 0).unwrap();
    m.renew(t + FAILOVER_MS * MS, 1).unwrap();
    m.handle_timeout(t + FAILOVER_MS * MS + 1);
    let out = settle(&mut m, |_, _| true);
    assert_eq!(
        out,
        vec![
            CoordOutput::ServerLost { server: 2 },
            // Shard 1's backup was on 2; shard 2's primary was, its backup on 0.
            CoordOutput::Command { id: 3, server: 1, command: Command::DropBackup { shard: 1 } },
            CoordOutput::Command { id: 4, server: 0, command: Command::Promote { shard: 2 } },
            CoordOutput::Moved { shard: 2, server: 0 },
            CoordOutput::Command { id: 5, server: 1, command: Command::AttachBackup { shard: 1, backup: 0 } },
            CoordOutput::Command { id: 6, server: 0, command: Command::AttachBackup { shard: 2, backup: 1 } },
            CoordOutput::NewBackup { shard: 1, primary: 1, backup: 0 },
            CoordOutput::NewBackup { shard: 2, primary: 0, backup: 1 },
            CoordOutput::FailoverDone { server: 2 },
        ]
    );
    assert_eq!(m.renew(t + 2 * FAILOVER_MS * MS, 2), Err(LeaseError::FailedOver));
    assert_eq!(m.places()[2], Place { primary: 0, backup: Some(1) });
    assert_eq!(m.live(), vec![true, true, false]);
}

#[test]
fn a_second_lapse_waits_for_the_first_failover_and_a_shard_without_copies_is_lost() {
    let mut m = started(3, 3);
    let t = FIRST_HEARTBEAT_MS * MS + FAILOVER_MS * MS + 1;
    m.renew(t, 0).unwrap();
    m.handle_timeout(t);
    // Servers 1 and 2 lapse together: 1 is failed over first, and its promotion of shard 1's
    // backup on 2 cannot happen.
    let out = drain(&mut m);
    assert_eq!(out[..2], [CoordOutput::ServerLost { server: 1 }, CoordOutput::ServerLost { server: 2 }]);
    assert!(out.contains(&CoordOutput::ShardLost { shard: 1, server: 1 }));
    assert!(!out.iter().any(|o| matches!(o, CoordOutput::FailoverDone { server: 2 })));
    let done: Vec<CommandId> = out
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    for id in done {
        m.command_done(id, Ok(Answer::Done));
    }
    let rest = settle(&mut m, |_, _| true);
    assert!(rest.contains(&CoordOutput::FailoverDone { server: 1 }));
    assert_eq!(rest.last(), Some(&CoordOutput::FailoverDone { server: 2 }));
    // One server left: nowhere for a backup.
    assert!(rest.contains(&CoordOutput::NoBackupPlace { shard: 0 }));
}

#[test]
fn without_backups_nothing_is_failed_over() {
    let mut m = machine(2, 2, 0);
    m.register_server(0, at(0)).unwrap();
    m.register_server(0, at(1)).unwrap();
    m.server_answered();
    m.server_answered();
    assert_eq!(drain(&mut m), vec![CoordOutput::Replicated]);
    assert_eq!(m.poll_timeout(), None);
    m.handle_timeout(u64::MAX / 2);
    assert!(drain(&mut m).is_empty());
}

#[test]
fn worker_ids_are_bounded_and_refusals_change_nothing() {
    let mut m = started(2, 2);
    assert_eq!(
        m.admit_worker(Some(4_000_000_000), 10),
        Err(Refusal::IdOutOfRange { id: 4_000_000_000, max: 4 })
    );
    assert_eq!(m.admit_worker(None, 0), Err(Refusal::EmptyModel));
    assert!(m.workers().is_empty());
    assert_eq!(m.model_len(), None);
    assert_eq!(m.admit_worker(Some(2), 10), Ok(2));
    assert_eq!(m.admit_worker(Some(2), 10), Err(Refusal::IdTaken(2)));
    assert_eq!(m.admit_worker(None, 11), Err(Refusal::ModelLength { cluster: 10, worker: 11 }));
    assert_eq!(m.admit_worker(None, 10), Ok(0));
    assert_eq!(m.admit_worker(None, 10), Ok(1));
    assert_eq!(m.admit_worker(None, 10), Ok(3));
    assert_eq!(m.admit_worker(None, 10), Err(Refusal::WorkersFull(4)));
    // A worker that went away may come back under its id; a lost one is told from a finished one.
    m.worker_finished(2);
    assert!(!m.worker_disconnected(2));
    assert!(m.worker_disconnected(3));
    assert_eq!(m.admit_worker(Some(2), 10), Ok(2));
    assert_eq!(
        Refusal::IdOutOfRange { id: 9, max: 4 }.to_string(),
        "worker id 9 is out of range: this cluster admits ids 0 to 3 (its --max-workers is 4)"
    );
}

#[test]
fn a_swap_commits_only_once_every_live_server_has_prepared_it() {
    let mut m = started(3, 3);
    assert_eq!(m.begin_swap(), Ok(1));
    assert_eq!(m.begin_swap(), Err(SwapError::Busy(1)));
    // Server 1 cannot load the module: everyone aborts, nobody switches.
    let out = settle(&mut m, |server, _| server != 1);
    let prepares = out
        .iter()
        .filter(|o| matches!(o, CoordOutput::Command { command: Command::Prepare { swap: 1 }, .. }));
    assert_eq!(prepares.count(), 3);
    assert!(!out.iter().any(|o| matches!(o, CoordOutput::Command { command: Command::Commit { .. }, .. })));
    let aborts =
        out.iter().filter(|o| matches!(o, CoordOutput::Command { command: Command::Abort { swap: 1 }, .. }));
    assert_eq!(aborts.count(), 3);
    assert!(out.contains(&CoordOutput::SwapDone {
        swap: 1,
        outcome: SwapOutcome::Refused(vec![(1, ServerError::Prepare("refused".into()).into())])
    }));
    assert_eq!(m.swaps(), 0);
    // The next try commits everywhere.
    assert_eq!(m.begin_swap(), Ok(1));
    let out = settle(&mut m, |_, _| true);
    let commits =
        out.iter().filter(|o| matches!(o, CoordOutput::Command { command: Command::Commit { swap: 1 }, .. }));
    assert_eq!(commits.count(), 3);
    assert_eq!(out.last(), Some(&CoordOutput::SwapDone { swap: 1, outcome: SwapOutcome::Committed }));
    assert_eq!(m.swaps(), 1);
    // A commit that fails on one server: the others switched.
    assert_eq!(m.begin_swap(), Ok(2));
    let out = settle(&mut m, |server, c| !(server == 2 && matches!(c, Command::Commit { .. })));
    assert_eq!(
        out.last(),
        Some(&CoordOutput::SwapDone {
            swap: 2,
            outcome: SwapOutcome::Partial(vec![(2, ServerError::Prepare("refused".into()).into())])
        })
    );
    assert_eq!(m.swaps(), 2);
}

/// The commit raises each worker by what its largest clock on any server lacks to the largest of
/// all: one amount for every shard, whichever moment each commits at.
#[test]
fn a_swap_levels_the_workers_by_one_raise_each_on_every_server() {
    let mut m = started(2, 2);
    assert_eq!(m.begin_swap(), Ok(1));
    let wc = |worker, clock| WorkerClock { worker, clock };
    let prepares: Vec<(CommandId, u32)> = drain(&mut m)
        .into_iter()
        .filter_map(|o| match o {
            CoordOutput::Command { id, server, command: Command::Prepare { .. } } => Some((id, server)),
            _ => None,
        })
        .collect();
    assert_eq!(prepares.len(), 2);
    // Worker 1's push 9 reached server 0's shard, not yet server 1's.
    m.command_done(prepares[0].0, Ok(Answer::Clocks(vec![wc(0, 4), wc(1, 9), wc(2, 6)])));
    assert!(m.levelling(1).is_empty(), "not committing before every server prepared");
    m.command_done(prepares[1].0, Ok(Answer::Clocks(vec![wc(0, 5), wc(1, 8), wc(2, 6)])));
    let commits: Vec<CommandId> = drain(&mut m)
        .into_iter()
        .filter_map(|o| match o {
            CoordOutput::Command { id, command: Command::Commit { swap: 1 }, .. } => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(commits.len(), 2);
    assert_eq!(m.levelling(1), [ClockRaise { worker: 0, by: 4 }, ClockRaise { worker: 2, by: 3 }]);
    assert!(m.levelling(2).is_empty());
    for id in commits {
        m.command_done(id, Ok(Answer::Done));
    }
    assert_eq!(drain(&mut m), vec![CoordOutput::SwapDone { swap: 1, outcome: SwapOutcome::Committed }]);
    assert!(m.levelling(1).is_empty(), "the swap is over");
}

#[test]
fn a_swap_involves_the_servers_not_failed_over_and_waits_for_all_to_register() {
    let mut m = machine(2, 2, 1);
    m.register_server(0, at(0)).unwrap();
    assert_eq!(m.begin_swap(), Err(SwapError::Registering { registered: 1, servers: 2 }));
    let mut m = started(3, 3);
    let t = FIRST_HEARTBEAT_MS * MS + FAILOVER_MS * MS + 1;
    m.renew(t, 0).unwrap();
    m.renew(t, 1).unwrap();
    m.handle_timeout(t);
    settle(&mut m, |_, _| true);
    assert_eq!(m.begin_swap(), Ok(1));
    let out = settle(&mut m, |_, _| true);
    let servers: Vec<u32> = out
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { server, command: Command::Prepare { .. }, .. } => Some(*server),
            _ => None,
        })
        .collect();
    assert_eq!(servers, vec![0, 1], "server 2 was failed over");
}

#[test]
fn a_restarted_coordinator_rebuilds_from_the_holdings_then_re_replicates() {
    // Three servers, three shards (k on server k, its backup on k + 1). Server 0 was cut off
    // and failed over before the crash: shard 0's backup on server 1 is its primary at term 1.
    // Server 2 had committed swap 3 (raising worker 1 by 2); server 1 had not. Server 0 claims
    // shard 0 at term 0 (stale); nobody else came back.
    let raise = vec![ClockRaise { worker: 1, by: 2 }];
    let held = [
        Held { server: 0, primaries: vec![(0, 0, 5)], backups: vec![(2, 0, 5)], ..Held::default() },
        Held {
            server: 1,
            swaps: 2,
            primaries: vec![(0, 1, 5), (1, 0, 5)],
            backups: vec![],
            ..Held::default()
        },
        Held {
            server: 2,
            swaps: 3,
            levelled: raise.clone(),
            primaries: vec![(2, 0, 5)],
            backups: vec![(1, 0, 5)],
            known: vec![1, 0, 0],
            copies: 3,
        },
        // An id outside the cluster is ignored.
        Held { server: 9, swaps: 7, primaries: vec![(0, 9, 5)], ..Held::default() },
    ];
    let mut m = machine(3, 3, 1);
    let now = 5_000 * MS;
    let r = m.rebuild(now, &held, &Record::default(), &BTreeMap::new());
    assert_eq!(r.resolution.stale, BTreeMap::from([(0, 0)]));
    assert_eq!(r.missing, Vec::<u32>::new());
    assert_eq!(r.newest, Some(2));
    assert_eq!(m.swaps(), 3);
    assert_eq!(m.model_len(), Some(15));
    assert_eq!(m.live(), vec![false, true, true], "the stale server gets no lease");
    assert_eq!(m.terms(), [1, 0, 0]);
    assert!(m.is_replicated());
    // Shard 0 lost its backup with server 0; shard 2's backup was there too. Server 1 commits
    // the swap server 2 had, with the same levelling.
    let out = drain(&mut m);
    let commands: Vec<(u32, Command)> = out
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { server, command, .. } => Some((*server, *command)),
            _ => None,
        })
        .collect();
    assert_eq!(
        commands,
        vec![
            (1, Command::DropBackup { shard: 0 }),
            (2, Command::DropBackup { shard: 2 }),
            (1, Command::Commit { swap: 3 })
        ]
    );
    assert_eq!(m.levelling(3), raise.as_slice());
    assert!(!out.contains(&CoordOutput::Rebuilt), "not before its commands are done");
    let ids: Vec<CommandId> = out
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    for id in ids {
        m.command_done(id, Ok(Answer::Done));
    }
    // Then new backups: shard 0's and shard 2's, on the other live server.
    let out = drain(&mut m);
    assert_eq!(out[0], CoordOutput::Rebuilt);
    let attach: Vec<Command> = out[1..]
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { command, .. } => Some(*command),
            _ => None,
        })
        .collect();
    assert_eq!(
        attach,
        vec![Command::AttachBackup { shard: 0, backup: 2 }, Command::AttachBackup { shard: 2, backup: 1 }]
    );
    assert!(m.levelling(3).is_empty(), "the finished swap is over");
    // The leases run from the next renewal.
    assert_eq!(m.renew(now + MS, 0), Err(LeaseError::FailedOver));
    assert_eq!(m.renew(now + MS, 1), Ok(()));
}

#[test]
fn a_rebuild_promotes_the_backups_of_a_primary_that_did_not_rejoin() {
    // Server 0 never came back: shard 0's backup on server 1 is promoted. A promotion that
    // fails loses the shard.
    let held = [Held { server: 1, primaries: vec![(1, 0, 4)], backups: vec![(0, 0, 4)], ..Held::default() }];
    // Done, a promotion takes the shard to the next term; failed, it loses the shard.
    for ok in [true, false] {
        let mut m = machine(2, 2, 1);
        let r = m.rebuild(0, &held, &Record::default(), &BTreeMap::new());
        assert_eq!(r.missing, vec![0]);
        assert_eq!(r.resolution.promote, vec![(0, 1)]);
        let out = drain(&mut m);
        let [CoordOutput::Command { id, server: 1, command: Command::Promote { shard: 0 } }, CoordOutput::Command { server: 1, command: Command::DropBackup { shard: 1 }, .. }] =
            out[..]
        else {
            panic!("{out:?}")
        };
        match ok {
            true => {
                m.command_done(id, Ok(Answer::Done));
                assert_eq!(m.terms(), [1, 0]);
            }
            false => {
                m.command_done(id, Err(CommandError::Transport("connection lost".into())));
                assert_eq!(drain(&mut m), vec![CoordOutput::ShardLost { shard: 0, server: 1 }]);
                assert_eq!(m.terms(), [0, 0]);
            }
        }
    }
}

/// The snapshot commands among `out`: `(server, round, shard)`.
fn snapshots(out: &[CoordOutput]) -> Vec<(u32, u64, u32)> {
    out.iter()
        .filter_map(|o| match o {
            CoordOutput::Command { server, command: Command::Snapshot { round, shard }, .. } => {
                Some((*server, *round, *shard))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_checkpoint_round_asks_each_shards_primary_and_is_taken_once_all_have_written() {
    let mut m = started(3, 3);
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::NotStarted));
    m.admit_worker(None, 30).unwrap();
    assert_eq!(m.begin_checkpoint(), Ok(1));
    let out = settle(&mut m, |_, _| true);
    // Shard k's primary is server k.
    assert_eq!(snapshots(&out), vec![(0, 1, 0), (1, 1, 1), (2, 1, 2)]);
    assert_eq!(
        out.last(),
        Some(&CoordOutput::CheckpointDone { round: 1, outcome: CheckpointOutcome::Taken })
    );
    // The next round follows it, and a resumed cluster goes on past the rounds on disk.
    assert_eq!(m.begin_checkpoint(), Ok(2));
    settle(&mut m, |_, _| true);
    m.set_next_round(7);
    assert_eq!(m.begin_checkpoint(), Ok(7));
}

#[test]
fn a_round_missing_a_shard_is_abandoned_and_names_it() {
    let mut m = started(3, 3);
    m.admit_worker(None, 30).unwrap();
    m.begin_checkpoint().unwrap();
    let out = settle(&mut m, |_, c| c != Command::Snapshot { round: 1, shard: 1 });
    assert_eq!(
        out.last(),
        Some(&CoordOutput::CheckpointDone {
            round: 1,
            outcome: CheckpointOutcome::Abandoned(vec![(1, ServerError::Prepare("refused".into()).into())])
        })
    );
    assert_eq!(m.begin_checkpoint(), Ok(2), "an abandoned round does not block the next");
}

#[test]
fn rounds_swaps_and_failovers_never_overlap_and_a_round_follows_the_moved_map() {
    let mut m = machine(2, 2, 1);
    m.register_server(0, at(0)).unwrap();
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::Registering { registered: 1, servers: 2 }));
    let mut m = started(3, 3);
    m.admit_worker(None, 30).unwrap();
    // A round under way holds off a swap and another round.
    assert_eq!(m.begin_checkpoint(), Ok(1));
    assert_eq!(m.begin_swap(), Err(SwapError::Checkpointing(1)));
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::Busy(1)));
    settle(&mut m, |_, _| true);
    // A swap under way holds off a round.
    assert_eq!(m.begin_swap(), Ok(1));
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::Swapping(1)));
    settle(&mut m, |_, _| true);
    // A failover under way holds off a round; after it, the round goes to the new primaries.
    let t = FIRST_HEARTBEAT_MS * MS + FAILOVER_MS * MS + 1;
    m.renew(t, 0).unwrap();
    m.renew(t, 1).unwrap();
    m.handle_timeout(t);
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::FailingOver(2)));
    settle(&mut m, |_, _| true);
    assert_eq!(m.begin_checkpoint(), Ok(2));
    let out = settle(&mut m, |_, _| true);
    // Shard 2's backup on server 0 was promoted.
    assert_eq!(snapshots(&out), vec![(0, 2, 0), (1, 2, 1), (0, 2, 2)]);
    assert_eq!(
        out.last(),
        Some(&CoordOutput::CheckpointDone { round: 2, outcome: CheckpointOutcome::Taken })
    );
}

#[test]
fn a_rebuild_under_way_holds_off_a_round() {
    let mut m = machine(2, 2, 1);
    let held = both_held();
    m.rebuild(0, &held, &Record::default(), &BTreeMap::new());
    // Nothing to promote, drop or commit: rebuilt at once.
    assert_eq!(drain(&mut m), vec![CoordOutput::Rebuilt]);
    assert_eq!(m.begin_checkpoint(), Ok(1));

    // One server missing: its shard's backup is promoted first.
    let mut m = machine(2, 2, 1);
    m.rebuild(0, &held[..1], &Record::default(), &BTreeMap::new());
    assert_eq!(m.begin_checkpoint(), Err(CheckpointError::Rebuilding));
    settle(&mut m, |_, _| true);
    assert_eq!(m.begin_checkpoint(), Ok(1));
}

/// A server that lost its connection to a coordinator that ran on renews its lease under its
/// id from its own address; from another while its id is live, it is refused (another
/// process holds the id); once failed over, its lease says so.
#[test]
fn a_server_reconnects_under_its_id_from_its_address_or_while_the_id_is_not_live() {
    let mut m = started(2, 2);
    let t = FIRST_HEARTBEAT_MS * MS;
    assert_eq!(m.reconnect_server(t, 1, at(1)), Ok(()));
    assert_eq!(m.reconnect_server(t, 1, at(0)), Err(Reconnect::NotRegistered { server: 1 }));
    assert_eq!(m.reconnect_server(t, 2, at(2)), Err(Reconnect::NotRegistered { server: 2 }));
    let t = t + FAILOVER_MS * MS + 1;
    m.renew(t, 0).unwrap();
    m.handle_timeout(t);
    settle(&mut m, |_, _| true);
    assert_eq!(m.reconnect_server(t, 1, at(9)), Err(Reconnect::Lease(LeaseError::FailedOver)));
}

/// A rebuilt coordinator knows the rejoined servers' addresses, and no address for one that
/// did not come back: a replacement for it is told so.
#[test]
fn a_rebuild_learns_the_rejoined_servers_addresses() {
    let held = [Held { server: 0, primaries: vec![(0, 0, 10)], ..Held::default() }];
    let mut m = machine(2, 2, 1);
    m.rebuild(0, &held, &Record::default(), &BTreeMap::from([(0, at(0))]));
    assert_eq!(m.server_addrs(), &[at(0), UNKNOWN_ADDR]);
    let unknown = Replacement::NotAtLostAddress { lost: vec![(1, UNKNOWN_ADDR)] };
    assert_eq!(m.replace_server_at(10_000 * MS, at(1)), Err(unknown));
    // With the old coordinator's record, the lost server keeps its address, and a process
    // restarted there takes its id back (once a peer timeout has passed since the rebuild);
    // a rejoined server's own address wins over the record's.
    let mut m = machine(2, 2, 1);
    let recorded = Record { terms: vec![0, 0], servers: vec![at(7), at(1)] };
    m.rebuild(0, &held, &recorded, &BTreeMap::from([(0, at(0))]));
    assert_eq!(m.server_addrs(), &[at(0), at(1)]);
    assert_eq!(m.record().servers, vec![at(0), at(1)]);
    settle(&mut m, |_, _| true);
    assert_eq!(m.replace_server_at(10_000 * MS, at(1)), Ok(1));
}

#[test]
fn a_lost_server_restarted_takes_its_id_back_empty_and_keeps_the_backups_no_one_could() {
    let mut m = started(2, 2);
    let not_yet = |r| matches!(r, Err(Replacement::Refused(Refusal::NotYet { server: 1, .. })));
    // Only at a lost server's address: none is lost yet.
    assert_eq!(m.replace_server_at(0, at(2)), Err(Replacement::NotAtLostAddress { lost: vec![] }));
    assert!(not_yet(m.replace_server_at(0, at(1))), "still live");
    // Server 1 lapses: shard 1 moves to server 0, and no shard has a backup any more.
    let t = FIRST_HEARTBEAT_MS * MS + FAILOVER_MS * MS + 1;
    m.renew(t, 0).unwrap();
    m.handle_timeout(t);
    assert!(not_yet(m.replace_server_at(t, at(1))), "being failed over");
    let out = settle(&mut m, |_, _| true);
    assert!(out.contains(&CoordOutput::NoBackupPlace { shard: 0 }), "{out:?}");
    assert_eq!(m.places(), &[Place { primary: 0, backup: None }, Place { primary: 0, backup: None }]);
    assert_eq!(m.live(), vec![true, false]);
    // The old process is refused for good; a new one under its id takes it back, empty, once
    // every connection to the old one has timed out (a peer timeout after the loss).
    assert_eq!(m.renew(t + MS, 1), Err(LeaseError::FailedOver));
    let quiet = t + 10_000 * MS;
    assert!(not_yet(m.replace_server_at(quiet - 1, at(1))), "too soon");
    let t = quiet;
    m.renew(t, 0).unwrap();
    // Elsewhere it is refused, told where the lost server listened.
    let lost = Replacement::NotAtLostAddress { lost: vec![(1, at(1))] };
    assert_eq!(m.replace_server_at(t + MS, at(5)), Err(lost));
    assert_eq!(m.replace_server_at(t + MS, at(1)), Ok(1));
    let out = settle(&mut m, |_, _| true);
    assert_eq!(
        out,
        vec![
            CoordOutput::Command { id: 4, server: 0, command: Command::AttachBackup { shard: 0, backup: 1 } },
            CoordOutput::Command { id: 5, server: 0, command: Command::AttachBackup { shard: 1, backup: 1 } },
            CoordOutput::NewBackup { shard: 0, primary: 0, backup: 1 },
            CoordOutput::NewBackup { shard: 1, primary: 0, backup: 1 },
        ]
    );
    assert_eq!(m.live(), vec![true, true]);
    assert_eq!(m.renew(t + 2 * MS, 1), Ok(()));
    assert!(not_yet(m.replace_server_at(t + 2 * MS, at(1))), "live again");
    // A second death now loses nothing: server 0's shards move to the restarted server.
    let t2 = t + 2 * MS + FAILOVER_MS * MS + 1;
    m.renew(t2, 1).unwrap();
    m.handle_timeout(t2);
    let out = settle(&mut m, |_, _| true);
    assert!(!out.iter().any(|o| matches!(o, CoordOutput::ShardLost { .. })), "{out:?}");
    assert_eq!(m.places(), &[Place { primary: 1, backup: None }, Place { primary: 1, backup: None }]);
}

/// Issue 50: the coordinator crashed while a swap's commit was under way, and the server that
/// had committed it died too; the backups it streamed the swap to run the new policy. The
/// rebuilt coordinator records that swap and commits it on the servers that had not, with the
/// raise the copies took: every shard ends on the one policy the coordinator records.
#[test]
fn a_rebuild_finishes_a_swap_that_only_copies_of_a_dead_server_took() {
    let raise = vec![crate::shard::ClockRaise { worker: 0, by: 2 }];
    let held = [Held {
        server: 1,
        swaps: 4,
        copies: 5,
        levelled: raise.clone(),
        primaries: vec![(1, 0, 5)],
        backups: vec![(0, 0, 5)],
        ..Held::default()
    }];
    let mut m = machine(2, 2, 1);
    let r = m.rebuild(5_000 * MS, &held, &Record::default(), &BTreeMap::new());
    assert_eq!(r.newest, Some(1));
    assert_eq!(m.swaps(), 5, "the swap its copies run is recorded");
    let commands: Vec<(u32, Command)> = drain(&mut m)
        .iter()
        .filter_map(|o| match o {
            CoordOutput::Command { server, command, .. } => Some((*server, *command)),
            _ => None,
        })
        .collect();
    assert!(commands.contains(&(1, Command::Commit { swap: 5 })), "{commands:?}");
    assert_eq!(m.levelling(5), raise.as_slice());
}

/// The start barrier opens once the workers it waits for are ready, each counted once (a
/// worker that says so twice is one), or its wait after the first ready runs out; a worker
/// ready after it opened starts at once; a rebuild that finds a model held opens it.
#[test]
fn the_start_barrier_opens_when_all_are_ready_or_its_wait_runs_out() {
    let mut m = started(2, 2);
    assert!(!m.worker_ready(5 * MS, 0));
    assert!(!m.worker_ready(6 * MS, 0), "a worker counts once");
    assert!(!m.worker_ready(7 * MS, 1));
    assert!(drain(&mut m).is_empty());
    assert!(m.worker_ready(8 * MS, 2));
    assert_eq!(drain(&mut m), vec![CoordOutput::Started { ready: 3, want: 3 }]);
    assert!(m.has_started() && m.worker_ready(9 * MS, 3), "a late joiner starts at once");
    assert!(drain(&mut m).is_empty(), "it opens once");

    // Two of three, and the wait runs out a minute after the first.
    let mut m = machine(2, 2, 0);
    assert!(!m.worker_ready(MS, 0));
    assert!(!m.worker_ready(2 * MS, 1));
    assert_eq!(m.poll_timeout(), Some(60_001 * MS), "without backups, the barrier alone");
    m.handle_timeout(60_000 * MS);
    assert!(!m.has_started());
    m.handle_timeout(60_001 * MS);
    assert!(m.has_started());
    assert_eq!(drain(&mut m), vec![CoordOutput::Started { ready: 2, want: 3 }]);
    assert_eq!(m.poll_timeout(), None);

    // Nobody to wait for: the first ready opens it.
    let mut m = CoordinatorMachine::new(CoordinatorConfig { start: (0, 1_000), ..machine(1, 1, 0).config() });
    assert!(m.worker_ready(0, 2));

    // A rebuild finds training under way: started, nobody waits.
    let mut m = machine(2, 2, 1);
    let held = both_held();
    m.rebuild(0, &held, &Record::default(), &BTreeMap::new());
    assert!(m.has_started() && m.worker_ready(0, 1));
}
