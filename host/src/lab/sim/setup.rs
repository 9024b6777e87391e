//! A simulated run set up: the options checked, the workloads and the policy modules loaded,
//! every shard's primary and backup made empty (the first join creates them, as on a cluster),
//! the workers' machines,
//! the coordinator's machine with every server registered, each server's own state, and the
//! control plane started.

use super::*;

/// Swaps drawn for the run: when, the module, its configuration.
pub(super) type Swaps = Vec<(FailAt, PolicyModule, Vec<(String, String)>)>;

/// The run `opts` asks for, ready to start: the simulator, the server failures to inject, and
/// the hot swaps.
pub(super) fn build(
    opts: &SimOptions,
    rt: &PolicyRuntime,
) -> Result<(Sim, Vec<SimFailure>, Swaps), SimError> {
    let (sc, policy) = (&opts.run.scenario, &opts.run.policy);
    if let Some(script) = sc.script.first() {
        return Err(SimError::Script(script.clone()));
    }
    let n = sc.workers;
    let shards_n = opts.run.shards();
    let module = load(policy, rt)?;
    let mut swaps = Vec::new();
    for (at, spec) in &opts.faults.swaps {
        swaps.push((*at, load(spec, rt)?, spec.config.clone()));
    }
    let pilot = match &opts.run.pilot {
        Some(spec) => {
            let m = load(spec, rt)?;
            let p = syncopate_engine::pilot::Pilot::start(&m, &spec.config, shards_n, 0)
                .map_err(|e| SimError::Policy(spec.to_string(), e))?;
            Some((p, rt.clone()))
        }
        None => None,
    };
    let modules: Vec<PolicyModule> =
        std::iter::once(module.clone()).chain(swaps.iter().map(|s| s.1.clone())).collect();
    let wopts = sc.workload_options(opts.data.as_deref());
    let (workloads, evaluator) = if opts.gradients {
        let w = syncopate_workloads::for_parts(&sc.workload, &wopts, n)?;
        (w, Evaluator::for_workload(&sc.workload, &wopts)?)
    } else {
        (Vec::new(), None)
    };
    // Without gradients the shards hold one value each, but transfers keep the model's size.
    let len = syncopate_workloads::param_len(&sc.workload, &wopts)
        .ok_or_else(|| syncopate_workloads::WorkloadError::Unknown(sc.workload.clone()))?;
    let model: Vec<f32> = match workloads.first() {
        Some(w) => w.init_params(sc.seed),
        None => vec![0.0; shards_n as usize],
    };
    let ranges: Vec<(usize, usize)> = (0..shards_n as usize)
        .map(|i| (len * i / shards_n as usize, len * (i + 1) / shards_n as usize))
        .collect();
    let held = |i: usize| if opts.gradients { ranges[i] } else { (i, i + 1) };
    let mut quiet = Quiet;
    // The scenario's rules (replicas 0 or 1, and 1 only with two servers), then the failure's.
    sc.check().map_err(SimError::Options)?;
    let failures: Vec<SimFailure> = match &opts.failures[..] {
        [] => SimFailure::of(sc).into_iter().collect(),
        given => given.to_vec(),
    };
    if let Some((w, _)) = opts.faults.worker_deaths.iter().find(|(w, _)| *w >= n) {
        return Err(SimError::Options(format!("worker {w} does not exist")));
    }
    for c in &opts.faults.link_cuts {
        let exists = |e: Node| match e {
            Node::Worker(w) => w < n,
            Node::Server(x) => x < sc.servers,
        };
        let workers = matches!((c.a, c.b), (Node::Worker(_), Node::Worker(_)));
        if !exists(c.a) || !exists(c.b) || workers || c.a == c.b {
            return Err(SimError::Options(format!("no link between {:?} and {:?}", c.a, c.b)));
        }
        if c.heal_after_ns >= PEER_TIMEOUT_NS {
            return Err(SimError::Options("a cut link heals within the peer timeout (10 s)".into()));
        }
    }
    let struck = failures.iter().map(|f| f.server).chain(opts.faults.partitions.iter().map(|p| p.server));
    let restarts = opts.faults.server_restarts.iter();
    let struck =
        struck.chain(restarts.flat_map(|r| std::iter::once(r.server).chain(r.then_kill.map(|k| k.0))));
    for server in struck {
        if sc.replicas == 0 {
            return Err(SimError::Options("a server failure needs replicas 1".into()));
        }
        if server >= sc.servers {
            return Err(SimError::Options(format!("server {server} does not exist")));
        }
    }
    let backup_of: Vec<Option<u32>> =
        (0..shards_n).map(|s| crate::net::proto::backup_server(s, sc.servers, sc.replicas)).collect();
    let server_of: Vec<u32> = (0..shards_n).map(|s| s % sc.servers).collect();
    let mut backups = Vec::new();
    let mut shards = Vec::new();
    let mut node_cfgs = Vec::new();
    let mut inits = Vec::new();
    for (i, backed) in backup_of.iter().enumerate() {
        let (lo, hi) = held(i);
        let cfg = ShardConfig {
            shard: i as u32,
            shards: shards_n,
            seed: sc.seed,
            optimizer: sc.server_optimizer(),
            local_sgd: sc.local_sgd(),
            pull_codec: sc.codecs().1,
            push_weight: sc.push_weight.unwrap_or_default(),
            max_workers: sc.workers.max(crate::shard::DEFAULT_MAX_WORKERS),
            supervisor: sc.supervisor(),
        };
        let config = opts.run.shard_config(i as u32);
        let node_cfg = NodeConfig { shard: cfg, rejoin_grace_ns: REJOIN_GRACE_NS, quiet: true };
        node_cfgs.push(node_cfg.clone());
        // Empty, as a server's are: the first worker's join creates the shard (its first op),
        // with the parameters the worker sends.
        let start = |backup: bool| ShardNode::new(node_cfg.clone(), module.clone(), config.clone(), backup);
        let mut primary = start(false);
        if backed.is_some() {
            backups.push(Some(start(true)));
            // Attached before the first op (as the coordinator does before it welcomes workers):
            // the backup is created by the primary's first op too.
            primary.attach_backup(0, &mut quiet).map_err(|e| SimError::Options(e.to_string()))?;
        } else {
            backups.push(None);
        }
        shards.push(primary);
        inits.push(model[lo..hi].to_vec());
    }
    let traces: Option<Vec<std::sync::Arc<[u64]>>> = match &sc.trace {
        Some(path) => {
            Some(crate::lab::report::RunReport::load_trace(path)?.into_iter().map(Into::into).collect())
        }
        None => None,
    };
    let mut workloads = workloads.into_iter();
    let mut workers = Vec::new();
    for w in 0..n {
        let mut workload = workloads.next();
        let (mut bufs, can_split) =
            Buffers::for_workload(workload.as_deref_mut().map(|x| x as &mut dyn Workload), w);
        if let Some(o) = sc.worker_optimizer() {
            bufs.place_optimizer(o);
        }
        bufs.set_inner_optimizer(sc.optimizer());
        let device = Device {
            compute_ns: sc.compute_ms.max(1) * 1_000_000,
            trace_ns: traces.as_ref().map(|t| t[w as usize % t.len()].clone()),
            slow_factor: sc.slow.iter().find(|s| s.worker == w).map_or(1.0, |s| s.factor),
            slow_during: match sc.slow.iter().find(|s| s.worker == w) {
                Some(s) => crate::lab::scenario::window_ns(s.from_s, s.until_s).map_err(SimError::Options)?,
                None => None,
            },
            jitter_ms: sc.jitter.iter().find(|j| j.worker == w).map(|j| (j.mean_ms, j.sd_ms)),
            jitter_during: match sc.jitter.iter().find(|j| j.worker == w) {
                Some(j) => crate::lab::scenario::window_ns(j.from_s, j.until_s).map_err(SimError::Options)?,
                None => None,
            },
            stall_ns: sc
                .stall
                .iter()
                .find(|s| s.worker == w)
                .map(|s| ((s.at_s * 1e9) as u64, (s.for_s * 1e9) as u64)),
            seed: sc.seed ^ (u64::from(w) << 40) ^ 0x5eed,
            granularity_ns: 0,
        };
        let cfg = WorkerConfig {
            id: w,
            start: 0,
            iterations: sc.iterations_or_unbounded(),
            batch: sc.batch,
            part: w,
            can_split,
            numbering_shared: true,
            device,
            tokens_per_sample: workload.as_deref().map_or(0, |w| w.tokens_per_sample()),
        };
        let machine = WorkerMachine::new(cfg.clone(), 0).map_err(|e| SimError::Worker(w, e))?;
        let client = ClientMachine::new(&server_of, sc.servers, sc.replicas > 0)
            .map_err(|e| SimError::Options(e.to_string()))?;
        workers.push(SimWorker {
            cfg,
            absent: opts.faults.late_join.iter().any(|l| l.0 == w),
            joining: None,
            machine,
            client,
            bufs,
            workload,
            replies_at: 0,
            pulled: None,
            encoder: PushEncoder::new(w, shards_n as usize, sc.codecs().0),
            encoded: vec![None; shards_n as usize],
            own: None,
            help: None,
            wake_at: None,
            done: false,
            dead: false,
            started: false,
            joins: 0,
            unreachable_ns: 0,
        });
    }
    // The coordinator: every server registers and is answered, and the backups made above are
    // the ones it has attached.
    let mut coord = CoordinatorMachine::new(CoordinatorConfig {
        servers: sc.servers,
        shards: shards_n,
        replicas: sc.replicas,
        max_workers: n.max(crate::shard::DEFAULT_MAX_WORKERS),
        peer_timeout_ms: PEER_TIMEOUT_NS / 1_000_000,
        // The workers there at the start (not the late joiners), and a cluster's default wait.
        start: (workers.iter().filter(|w| !w.absent).count() as u32, START_WAIT_MS),
    });
    for x in 0..sc.servers {
        coord.register_server(0, super::server_addr(x)).map_err(|e| SimError::Options(e.to_string()))?;
        coord.server_answered();
    }
    while let Some(out) = coord.poll_output() {
        if let CoordOutput::Command { id, .. } = out {
            coord.command_done(id, Ok(Answer::Done));
        }
    }
    let places: Vec<Option<u32>> = coord.places().iter().map(|p| p.backup).collect();
    assert_eq!(places, backup_of, "the simulator's backups are where the coordinator puts them");
    // The simulated servers are ready at once: their first renewals are in at time 0 (a cluster's
    // come once each has compiled the policy).
    for x in 0..sc.servers {
        coord.renew(0, x).map_err(|e| SimError::Options(e.to_string()))?;
    }
    for w in 0..n {
        coord.admit_worker(Some(w), len as u64).map_err(|e| SimError::Options(e.to_string()))?;
    }
    let nodes = (n + sc.servers) as usize;
    let mbit = sc.bandwidth_mbit.unwrap_or(10_000.0);
    let servers = (0..sc.servers).map(|x| server_state(x, &server_of, &backup_of, n)).collect();
    let mut sim = Sim {
        opts: opts.clone(),
        found: Found::default(),
        coord: SimCoordinator {
            machine: coord,
            timer_at: None,
            swapping: None,
            swap_modules: BTreeMap::from([(0, (module.clone(), policy.config.clone()))]),
            answers: BTreeMap::new(),
            phase: control::Phase::Up,
            incarnation: 0,
            recorded: Default::default(),
            rounds: BTreeMap::new(),
            pilot,
        },
        servers: SimServers {
            dead: vec![false; sc.servers as usize],
            lost: Vec::new(),
            leases: vec![ServerLease::new(0); sc.servers as usize],
            cut_to: vec![false; sc.servers as usize],
            cut_from: vec![false; sc.servers as usize],
            held: vec![Vec::new(); sc.servers as usize],
            state: servers,
            committed: vec![(0, Vec::new()); sc.servers as usize],
            answer_terms: vec![Vec::new(); sc.servers as usize],
            restarts: opts.faults.server_restarts.iter().map(|&r| (r, false)).collect(),
        },
        shards: SimShards {
            nodes: shards,
            node_cfgs,
            ranges,
            server_of,
            timer_at: vec![None; shards_n as usize],
            backups,
            backup_of,
            epoch: vec![0; shards_n as usize],
            inits,
            term: vec![0; shards_n as usize],
            zombie_of: vec![None; shards_n as usize],
            promoted_epoch: vec![None; shards_n as usize],
        },
        now: 0,
        queue: Queue::default(),
        requests: BTreeMap::new(),
        next_token: 0,
        workers,
        net: Network::new(nodes, mbit, sc.latency_us * 1000),
        done: 0,
        stopping: false,
        mail: SimMail::default(),
        score: SimScore { evaluator, watch: Vec::new(), time_to_target: None },
        at_barrier: Vec::new(),
        starting: true,
        rng: rand::SeedableRng::seed_from_u64(sc.seed ^ 0x0071_ce00_0036),
        modules,
    };
    for l in &sc.link {
        let node = match (l.worker, l.server) {
            (Some(w), _) => w as usize,
            (None, Some(x)) => (n + x) as usize,
            (None, None) => continue,
        };
        let window = crate::lab::scenario::window_ns(l.from_s, l.until_s).map_err(SimError::Options)?;
        let (from, until) = window.unwrap_or((0, u64::MAX));
        sim.net.slow_link(node, from, until, l.mbit);
    }
    sim.start_control();
    Ok((sim, failures, swaps))
}
