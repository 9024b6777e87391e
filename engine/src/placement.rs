//! Where shards live, and what the coordinator decides when a server dies: which backups are
//! promoted, which primaries go on without a backup, and where new backups go. Pure decisions
//! over the shard map: the coordinator (`host/src/coordinator`) carries them out with commands
//! to the servers, and the simulator (`host/src/lab/sim`) carries them out on its nodes, so a
//! simulated failover, re-replication included, is decided exactly as a cluster's.

/// Where one shard lives now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// The server holding its primary.
    pub primary: u32,
    /// The server holding its backup, if it has one.
    pub backup: Option<u32>,
}

/// Where shard `shard`'s backup starts, with `servers` servers and `replicas` backups per
/// shard: on the next server, if there is another.
pub fn backup_server(shard: u32, servers: u32, replicas: u32) -> Option<u32> {
    (replicas > 0 && servers > 1).then_some((shard + 1) % servers)
}

/// The map a cluster starts with: shard `k` on server `k % servers`, its backup on the next.
pub fn initial(shards: u32, servers: u32, replicas: u32) -> Vec<Place> {
    (0..shards).map(|k| Place { primary: k % servers, backup: backup_server(k, servers, replicas) }).collect()
}

/// One change to the map that a server's death calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failover {
    /// The shard's primary died: its backup, on `to`, becomes the primary (and the workers are
    /// told the shard moved).
    Promote {
        /// The shard.
        shard: u32,
        /// The server of its backup.
        to: u32,
    },
    /// The shard's backup died: its primary, on `primary`, goes on without one.
    DropBackup {
        /// The shard.
        shard: u32,
        /// The server of its primary.
        primary: u32,
    },
    /// The shard died with its primary: it had no backup.
    Lost {
        /// The shard.
        shard: u32,
    },
}

/// What server `dead`'s death changes, shard by shard, in shard order.
pub fn fail_over(places: &[Place], dead: u32) -> Vec<Failover> {
    let mut moves = Vec::new();
    for (k, place) in places.iter().enumerate() {
        let shard = k as u32;
        if place.primary == dead {
            moves.push(match place.backup {
                Some(to) if to != dead => Failover::Promote { shard, to },
                _ => Failover::Lost { shard },
            });
        } else if place.backup == Some(dead) {
            moves.push(Failover::DropBackup { shard, primary: place.primary });
        }
    }
    moves
}

/// Applies a failover move to the map (once the servers have carried it out).
pub fn apply(places: &mut [Place], m: Failover) {
    match m {
        Failover::Promote { shard, to } => places[shard as usize] = Place { primary: to, backup: None },
        Failover::DropBackup { shard, .. } => places[shard as usize].backup = None,
        Failover::Lost { .. } => {}
    }
}

/// A new backup for each shard without one whose primary lives (`live[server]`), on the next
/// live server after the primary's, where there is one: `(shard, primary, backup)`. Nothing
/// with `replicas` 0.
pub fn new_backups(places: &[Place], live: &[bool], replicas: u32) -> Vec<(u32, u32, u32)> {
    if replicas == 0 {
        return Vec::new();
    }
    let n = live.len() as u32;
    let alive = |s: u32| live.get(s as usize).copied().unwrap_or(false);
    places
        .iter()
        .enumerate()
        .filter(|(_, p)| p.backup.is_none() && alive(p.primary))
        .filter_map(|(k, p)| {
            let b = (1..n).map(|d| (p.primary + d) % n).find(|s| alive(*s))?;
            Some((k as u32, p.primary, b))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_servers_shards_move_to_their_backups_and_get_new_ones_on_live_servers() {
        let mut places = initial(4, 3, 1);
        assert_eq!(places[0], Place { primary: 0, backup: Some(1) });
        assert_eq!(places[2], Place { primary: 2, backup: Some(0) });
        let moves = fail_over(&places, 0);
        assert_eq!(
            moves,
            vec![
                Failover::Promote { shard: 0, to: 1 },
                Failover::DropBackup { shard: 2, primary: 2 },
                Failover::Promote { shard: 3, to: 1 },
            ]
        );
        for m in moves {
            apply(&mut places, m);
        }
        let live = [false, true, true];
        assert_eq!(new_backups(&places, &live, 1), vec![(0, 1, 2), (2, 2, 1), (3, 1, 2)]);
        assert_eq!(new_backups(&places, &live, 0), vec![]);
        // With one server left, there is nowhere to put a backup; a shard without one dies
        // with its server.
        let one = [false, true, false];
        assert_eq!(new_backups(&places, &one, 1), vec![]);
        assert_eq!(
            fail_over(&places, 1),
            vec![
                Failover::Lost { shard: 0 },
                Failover::Promote { shard: 1, to: 2 },
                Failover::Lost { shard: 3 }
            ]
        );
    }
}
