//! A worker driven step by step from outside: the training loop is the user's (a Python
//! script), not ours. [`Session`] is the third driver of the engine's [`WorkerMachine`], beside
//! `syncopate worker` ([`super::run`]) and the simulator: the machine still decides every step
//! (which iteration comes next, pauses, batch sizes, skips, the emulated device's delays, what
//! the report counts), and the user's loop answers its `Compute` actions with a gradient.
//!
//! The loop is blocking: [`Session::pull`] returns when the model is in the caller's buffers and
//! the machine wants a gradient; [`Session::push`] returns when every shard has acknowledged the
//! gradient and the machine has moved on to the next pull (which waits for the next call). A
//! tokio runtime with its own threads keeps the connections alive while the caller computes,
//! and carries out what the policies ask meanwhile (acknowledging control messages) while a
//! pull or push is in flight. Every wait (joining, pulling, pushing, leaving) also waits on the
//! caller's [`Interrupt`], which wakes it when the caller may want to give up (a signal
//! arrived): Ctrl-C ends a wait at once, however busy the machine, and the caller can still
//! leave cleanly.
//!
//! [`Session::exchange`] is the loop's other shape, for a push overlapped with the caller's
//! backward pass: the caller feeds the gradient in pieces from its hooks ([`super::feed`]) while
//! the exchange, on another thread, pushes each shard's part once whole and pulls each shard's
//! part of the next iteration once that shard has acknowledged its push. Every shard still sees
//! the worker's push, its report and its next pull in that order.
//!
//! A session's workload cannot split an iteration into tasks: when a policy that moves tasks
//! (EPSP) asks for some of its iteration, it answers that none could be handed over. Tasks of
//! a worker that can split (a built-in Rust workload) moved *to* a session stop it with
//! [`WorkerError::CannotSplit`](syncopate_engine::worker::WorkerError::CannotSplit): EPSP over
//! a mix of Rust and Python workers is not supported.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::time::Duration;

use futures::future::LocalBoxFuture;
use futures::FutureExt;
use syncopate_engine::tasks::ControlMessage;
use syncopate_engine::worker::{Action, Input, JobKind, StepStats, WorkerMachine, WorkerReport};
use syncopate_policy_sdk::abi::Signals;
use tokio::sync::mpsc;

use super::client::{ShardPulled, WorkerClient};
use super::clock::Clock;
use super::feed::{FedParts, PushFeed};
use super::run::WorkerOptions;
use crate::net::proto::ModelScore;
use crate::NodeError;

/// How a blocking call learns that its caller wants it to give up (Ctrl-C) while it waits.
///
/// The call waits on [`woken`](Interrupt::woken) beside its own work, and asks
/// [`stop`](Interrupt::stop) each time that resolves. A driver makes `woken` resolve when
/// something happened (a signal arrived, another thread cancelled the call), so noticing
/// costs nothing while nothing happens, and nothing but being scheduled once it does.
pub trait Interrupt {
    /// Resolves when the caller may want to stop. It is dropped and made again while the
    /// call waits, so it must be cancel-safe (lose nothing when dropped unfinished).
    fn woken(&mut self) -> LocalBoxFuture<'_, ()>;
    /// Whether to give up now; `false` lets the call wait on.
    fn stop(&mut self) -> bool;
}

/// Runs `work` unless `interrupt` stops it first.
async fn unless_stopped<T>(
    work: impl std::future::Future<Output = Result<T, SessionError>>,
    interrupt: &mut dyn Interrupt,
) -> Result<T, SessionError> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            r = &mut work => return r,
            () = interrupt.woken() => {
                if interrupt.stop() {
                    return Err(SessionError::Interrupted);
                }
            }
        }
    }
}

/// Why a session call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The cluster failed us, or the worker cannot go on.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The caller's `interrupt` asked to stop waiting.
    #[error("interrupted")]
    Interrupted,
    /// The calls came in an order the loop does not allow (two pulls without a push, a push
    /// before any pull).
    #[error("{0}")]
    Usage(String),
}

impl From<syncopate_engine::worker::WorkerError> for SessionError {
    fn from(e: syncopate_engine::worker::WorkerError) -> Self {
        SessionError::Node(e.into())
    }
}

/// Where an [`Session::exchange`] lands the next iteration's model: one buffer per shard,
/// lent to the exchange for its shard's pull and given back, from the exchange's thread.
///
/// A caller that reads a buffer as soon as it is given back landed, while the exchange still
/// runs, reads the model the early pull brought; if the machine then abandons that pull (a
/// stop or a skip came in meanwhile), every buffer is lent again for the pull that replaces it.
pub trait Landing: Sync {
    /// Lends shard `shard`'s buffer, `len` values long (its contents are overwritten); it is
    /// no longer landed until given back.
    fn lend(&self, shard: usize, len: usize) -> Vec<f32>;
    /// Gives `values` back: `landed` when they are the shard's part of the next iteration's
    /// model, otherwise their contents mean nothing.
    fn give_back(&self, shard: usize, values: Vec<f32>, landed: bool);
    /// Told once per exchange, as soon as the machine knows: the iteration pulled early, shard
    /// by shard as each acknowledges its push, or `None` when the pull waits for the whole push
    /// (then every buffer is given back at the end).
    fn planned(&self, early: Option<u64>);
}

/// A shard's buffer lent by a [`Landing`]: given back unlanded when dropped (a pull abandoned
/// or failed midway).
struct Lent<'a> {
    landing: &'a dyn Landing,
    shard: usize,
    values: Option<Vec<f32>>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if let Some(values) = self.values.take() {
            self.landing.give_back(self.shard, values, false);
        }
    }
}

/// The iteration the caller computes next, as [`Session::pull`] returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The iteration (the cluster's numbering: a late joiner starts with the slowest worker,
    /// and a policy may skip iterations).
    pub iteration: u64,
    /// Samples to compute it on: the batch size in force (a policy may change it).
    pub batch: u32,
    /// The local steps the shards ask this iteration to take (0: one gradient). The caller
    /// decides what it takes and says so when it pushes ([`Session::push`]).
    pub local_steps: u32,
}

/// What the machine wants next from the caller.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Next {
    /// A pull of this iteration, made when the caller asks for the model.
    Pull(u64),
    /// A gradient for this iteration.
    Compute(Step),
    /// The gradient computed for this iteration, pushed now.
    Push { iteration: u64, samples: u32, local_steps: u32, signals: Signals },
    /// Training is over.
    Leave,
}

/// Where the caller's loop stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the caller's pull of this iteration.
    Pull(u64),
    /// The caller computes `step`; its pull returned at `since` (driver time).
    Computing { step: Step, since: u64 },
    /// Training is over (the session can only leave).
    Done,
}

/// A worker whose training loop is the caller's; see the module docs.
#[derive(Debug)]
pub struct Session {
    rt: tokio::runtime::Runtime,
    client: Option<WorkerClient>,
    driver: Driver,
    phase: Phase,
    report_path: Option<PathBuf>,
}

/// The machine and what feeds it, apart from the client (which the operations in flight borrow).
#[derive(Debug)]
struct Driver {
    machine: WorkerMachine,
    controls: mpsc::UnboundedReceiver<ControlMessage>,
    clock: Clock,
    /// Control messages that arrived since the caller last took them.
    seen: Vec<ControlMessage>,
    stop_seen: bool,
    /// The iteration whose report the shards were told one by one (an exchange's early
    /// pulls), which the machine's [`Action::Finished`] then does not tell again.
    reported: Option<u64>,
}

impl Session {
    /// Joins the cluster `opts.access` names with a model held in pieces `init` (one per tensor,
    /// in order): the shards a first worker creates start from these values, and shards that
    /// exist keep theirs (the first pull brings every worker to them). Waits for the start
    /// barrier, unless `interrupt` stops it. `threads`: the runtime's threads (1 or 2 leave
    /// the cores to the caller's computation).
    pub fn connect(
        opts: WorkerOptions,
        init: &[&[f32]],
        threads: usize,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Session, SessionError> {
        let spin = Duration::ZERO;
        let rt = crate::net::spin::runtime_builder(threads.max(1), spin)
            .thread_name("syncopate-io")
            .build()
            .map_err(|source| NodeError::Io { what: "cannot start the async runtime".into(), source })?;
        let whole: Vec<f32> = init.concat();
        let joining = async {
            let mut client = WorkerClient::connect(&opts.access, opts.id, whole.len()).await?;
            let start = client.join(&whole).await?;
            client.ready().await?;
            Ok::<_, SessionError>((client, start))
        };
        let (client, start) = rt.block_on(unless_stopped(joining, interrupt))?;
        let mut client = client;
        let controls = client.take_controls();
        let id = client.id();
        // A step of the caller's loop cannot be split into tasks.
        let cfg = opts.config(id, start, false, client.numbering_shared());
        let clock = Clock::new();
        let machine = WorkerMachine::new(cfg, clock.now()).map_err(NodeError::from)?;
        let mut driver =
            Driver { machine, controls, clock, seen: Vec::new(), stop_seen: false, reported: None };
        let phase = match driver.drive(&rt, &client, None, interrupt)? {
            Next::Pull(it) => Phase::Pull(it),
            Next::Leave => Phase::Done,
            other => return Err(SessionError::Usage(format!("the worker began with {other:?}"))),
        };
        Ok(Session { rt, client: Some(client), driver, phase, report_path: opts.report.clone() })
    }

    fn client(&self) -> &WorkerClient {
        self.client.as_ref().expect("a session has its client until it leaves")
    }

    /// This worker's id (its rank).
    pub fn id(&self) -> u32 {
        self.client().id()
    }

    /// How many workers the cluster expects.
    pub fn workers(&self) -> u32 {
        self.client().expected_workers()
    }

    /// The servers' optimizer (learning rate, momentum, weight decay).
    pub fn server_optimizer(&self) -> crate::shard::OptimizerConfig {
        self.client().server_optimizer()
    }

    /// The number of parameters of the whole model.
    pub fn model_len(&self) -> usize {
        self.client().model_len()
    }

    /// Whether training is over (the iterations done, or the cluster asked the workers to stop).
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// What the worker has done so far (the same report `syncopate worker` writes).
    pub fn report(&self) -> WorkerReport {
        let mut r = self.driver.machine.report_at(self.driver.clock.now());
        (r.bytes_sent, r.bytes_received) = self.client().bytes();
        r.codec_owed = self.client().codec_owed();
        r
    }

    /// The control messages the shards' policies sent since the last call (each already obeyed:
    /// pauses waited, batch sizes in force from the iteration the machine named).
    pub fn take_controls(&mut self) -> Vec<ControlMessage> {
        std::mem::take(&mut self.driver.seen)
    }

    /// Pulls the model for the next iteration into `out` (the whole model, in pieces), and
    /// returns that iteration; `None` once training is over. Between a pull and the next, the
    /// caller must [`push`](Self::push) the gradient computed on what it pulled.
    pub fn pull(
        &mut self,
        out: &mut [&mut [f32]],
        interrupt: &mut dyn Interrupt,
    ) -> Result<Option<Step>, SessionError> {
        self.check_len(out.iter().map(|s| s.len()).sum(), "pull")?;
        loop {
            let iteration = match self.phase {
                Phase::Pull(it) => it,
                Phase::Done => return Ok(None),
                Phase::Computing { step, .. } => {
                    return Err(SessionError::Usage(format!(
                        "pull called again before the gradient of iteration {} was pushed",
                        step.iteration
                    )))
                }
            };
            let client = self.client.as_ref().expect("a session has its client until it leaves");
            let into = &mut *out;
            let op = async move {
                let r = client.pull_segments(iteration, into).await?;
                Ok(Input::Pulled {
                    deferred: r.deferred_shards > 0,
                    deferred_ns: r.waited_ns,
                    local_steps: r.local_steps,
                })
            }
            .boxed_local();
            // A skip may abandon the pulled iteration: the machine then pulls the next one into
            // the same buffers, and the caller computes on that.
            match self.driver.drive(&self.rt, client, Some(op), interrupt)? {
                Next::Compute(step) => {
                    self.phase = Phase::Computing { step, since: self.driver.clock.now() };
                    return Ok(Some(step));
                }
                Next::Pull(it) => self.phase = Phase::Pull(it),
                Next::Leave => {
                    self.phase = Phase::Done;
                    return Ok(None);
                }
                Next::Push { .. } => {
                    return Err(SessionError::Usage("the worker pushed before computing".into()))
                }
            }
        }
    }

    /// Pushes the gradient of the iteration the last [`pull`](Self::pull) returned (the whole
    /// model, in pieces), computed on `stats.samples` samples with mean loss `stats.loss`; with
    /// `local_steps` above 0, the pseudo-gradient of that many local steps (the model pulled
    /// minus the model they reached), which the shards step with their outer optimizer,
    /// whatever the pull asked for. Returns how many shards' policies dropped it (0: every
    /// shard applied it), or `None` when a policy's skip abandoned the iteration and it was not
    /// pushed.
    pub fn push(
        &mut self,
        grad: &[&[f32]],
        stats: StepStats,
        local_steps: u32,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Option<u32>, SessionError> {
        self.check_len(grad.iter().map(|s| s.len()).sum(), "push")?;
        self.push_grad(Grad::Pieces(grad), stats, local_steps, interrupt)
    }

    /// [`push`](Self::push), taking the whole gradient by value, as a buffer of
    /// [`buffer_pool`](Self::buffer_pool): QUIC sends it without another copy and hands it back
    /// to the pool once every server has acknowledged it.
    pub fn push_buffer(
        &mut self,
        grad: Vec<f32>,
        stats: StepStats,
        local_steps: u32,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Option<u32>, SessionError> {
        self.check_len(grad.len(), "push")?;
        self.push_grad(Grad::Owned(grad), stats, local_steps, interrupt)
    }

    /// Each shard's key range in the model, in shard order: what an
    /// [`exchange`](Self::exchange)'s [`Landing`] lends a buffer for.
    pub fn shard_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.client().shard_ranges()
    }

    /// A push to feed in pieces while the caller computes ([`super::feed`]): fill the
    /// [`PushFeed`] (from any thread), and [`exchange`](Self::exchange) the [`FedParts`].
    pub fn feed(&self) -> (PushFeed, FedParts) {
        PushFeed::new(self.client().shard_ranges(), self.client().pool())
    }

    /// [`push`](Self::push) of a gradient that is still being computed, then
    /// [`pull`](Self::pull) of the next iteration into `landing`'s buffers: each shard's part
    /// of the push is sent as soon as the caller's [`PushFeed`] has made it whole, and, when the
    /// worker is sure to pull the next iteration ([`WorkerMachine::next_pull_if_quiet`]), each
    /// shard's part of that pull as soon as the shard has acknowledged its push. Called as soon
    /// as the backward pass starts (from another thread than the one feeding), it overlaps the
    /// push with the rest of the pass, and the pulls of the last layers' shards with the first
    /// layers' pushes. Every shard sees what [`push`](Self::push) then [`pull`](Self::pull)
    /// send it: one push, then one pull.
    ///
    /// The pull lands shard by shard in buffers the caller lends ([`Landing`]): a caller that
    /// is told the pull goes early ([`Landing::planned`]) may read each shard's part as soon as
    /// it is given back landed, while the exchange still runs (the next forward pass can start
    /// with the layers that are in).
    ///
    /// Returns what `push` returns, and what `pull` returns (every shard's buffer was given
    /// back landed when it is a step). The iteration's loss is known only afterwards:
    /// [`record_loss`](Self::record_loss). The time the caller went on computing after the
    /// push started (until its last part came) is the iteration's overlap in the report's
    /// timeline.
    pub fn exchange(
        &mut self,
        parts: FedParts,
        samples: u32,
        local_steps: u32,
        landing: &dyn Landing,
        interrupt: &mut dyn Interrupt,
    ) -> Result<(Option<u32>, Option<Step>), SessionError> {
        let ranges = self.client().shard_ranges();
        if parts.0.len() != ranges.len() {
            return Err(SessionError::Usage("this feed was made for another shard map".into()));
        }
        syncopate_policy_sdk::rules::check_local_steps(local_steps).map_err(SessionError::Usage)?;
        let Phase::Computing { since, .. } = self.phase else {
            return Err(SessionError::Usage(match self.phase {
                Phase::Done => "push after training ended".into(),
                _ => "push called without a pull first".into(),
            }));
        };
        let started = std::time::Instant::now();
        let now = self.driver.clock.now();
        self.driver.machine.took_local_steps(local_steps);
        let stats = StepStats { samples, loss: 0.0 };
        self.driver
            .machine
            .handle(now, Input::Computed { step: Some(stats), compute_ns: now.saturating_sub(since) })?;
        let client = self.client.as_ref().expect("a session has its client until it leaves");
        let next = self.driver.drive(&self.rt, client, None, interrupt)?;
        let Next::Push { iteration, samples, local_steps, signals } = next else {
            // A skip abandoned the iteration: nothing is pushed, and the pull is a plain one.
            landing.planned(None);
            self.phase = self.phase_after(next)?;
            return Ok((None, self.pull_landing(&ranges, landing, interrupt)?));
        };
        let early = self.driver.machine.next_pull_if_quiet();
        landing.planned(early);
        // Told shard by shard, between its push and its early pull (the order the machine keeps).
        let report = early.and_then(|_| self.driver.machine.report_of_push());
        self.driver.reported = report.map(|r| r.iteration);

        // One future per shard: its push once its part is fed, then (when the next pull is
        // sure) its report and its early pull. They run beside the machine's driving, which
        // waits for the pushes (`pushed`) and then for the pulls (`pulled`).
        let fed_at = Cell::new(None);
        let (arrived, pushes_left, dropped) = (Cell::new(0), Cell::new(ranges.len()), Cell::new(0));
        let results: RefCell<Option<Result<Vec<Option<ShardPulled>>, NodeError>>> = RefCell::new(None);
        let progress = tokio::sync::Notify::new();
        let last = ranges.len();
        let (fed_at_r, arrived, pushes_left, dropped, progress, results) =
            (&fed_at, &arrived, &pushes_left, &dropped, &progress, &results);
        let ranges_r = &ranges;
        let shards = parts.0.into_iter().enumerate().map(|(i, part)| async move {
            let values = part.await.map_err(|_| {
                NodeError::Protocol(format!(
                    "the push of iteration {iteration} lost its feed before shard {i}'s part was whole"
                ))
            })?;
            // Parts arrive one at a time: this runs on one thread.
            arrived.set(arrived.get() + 1);
            if arrived.get() == last {
                fed_at_r.set(Some(std::time::Instant::now()));
            }
            let d = client.push_shard(i, iteration, values, samples, local_steps, signals).await?;
            dropped.set(dropped.get() + d);
            // The report is part of the push here: told before the machine goes on, so that
            // no shard lacks it whatever the machine does next (early pulls may be dropped).
            if let Some(report) = report {
                client.finished_shard(i, report).await?;
            }
            pushes_left.set(pushes_left.get() - 1);
            progress.notify_one();
            let Some(next) = early else { return Ok(None) };
            // Lent for the pull; given back unlanded if this future is dropped first.
            let mut lent = Lent { landing, shard: i, values: Some(landing.lend(i, ranges_r[i].len())) };
            let pulled = {
                let values = lent.values.as_mut().expect("lent until given back");
                client.pull_shard(i, next, &mut [&mut values[..]]).await?
            };
            landing.give_back(i, lent.values.take().expect("lent until given back"), true);
            Ok(Some(pulled))
        });
        let all = futures::future::try_join_all(shards);
        let mut bg = Some(
            async move {
                let r = all.await;
                *results.borrow_mut() = Some(r);
                progress.notify_one();
            }
            .boxed_local(),
        );
        // The push is done once every shard acknowledged it (and was told the report), early
        // pulls in flight or not.
        let pushed = async {
            loop {
                if matches!(&*results.borrow(), Some(Err(_))) {
                    let Some(Err(e)) = results.borrow_mut().take() else { unreachable!("an error") };
                    return Err(e);
                }
                if pushes_left.get() == 0 {
                    return Ok(Input::Pushed { kind: JobKind::Own, result: Ok(dropped.get()) });
                }
                progress.notified().await;
            }
        }
        .boxed_local();
        let next = self.driver.drive_beside(&self.rt, client, Some(pushed), &mut bg, interrupt);
        self.driver.reported = None;
        let next = next?;
        if let Some(at) = fed_at.get() {
            let ns = at.saturating_duration_since(started).as_nanos();
            self.driver.machine.overlapped(u64::try_from(ns).unwrap_or(u64::MAX));
        }
        let pushed = Some(dropped.get());
        let next = match next {
            Next::Pull(it) if Some(it) == early => {
                let pulled = async {
                    loop {
                        if let Some(r) = results.borrow_mut().take() {
                            let mut stats = crate::worker::PullStats::default();
                            for shard in r?.into_iter().flatten() {
                                stats.add(shard);
                            }
                            return Ok(Input::Pulled {
                                deferred: stats.deferred_shards > 0,
                                deferred_ns: stats.waited_ns,
                                local_steps: stats.local_steps,
                            });
                        }
                        progress.notified().await;
                    }
                }
                .boxed_local();
                self.phase = Phase::Pull(it);
                let next = self.driver.drive_beside(&self.rt, client, Some(pulled), &mut bg, interrupt)?;
                if let Next::Compute(step) = next {
                    self.phase = Phase::Computing { step, since: self.driver.clock.now() };
                    return Ok((pushed, Some(step)));
                }
                // A skip abandoned what was pulled: the next iteration is pulled as usual.
                next
            }
            // Not the pull sent early (a stop, a skip, a pause came in): what was pulled early
            // is dropped, as a pull a skip abandons is.
            other => other,
        };
        drop(bg);
        self.phase = self.phase_after(next)?;
        Ok((pushed, self.pull_landing(&ranges, landing, interrupt)?))
    }

    /// A plain [`pull`](Self::pull) into `landing`'s buffers, for an exchange whose early pull
    /// was not sent or was abandoned: every buffer is lent first (what landed early is no longer
    /// landed), and all are given back landed once the pull is a step.
    fn pull_landing(
        &mut self,
        ranges: &[std::ops::Range<usize>],
        landing: &dyn Landing,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Option<Step>, SessionError> {
        let mut lent: Vec<Lent<'_>> = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| Lent { landing, shard: i, values: Some(landing.lend(i, r.len())) })
            .collect();
        let step = {
            let mut outs: Vec<&mut [f32]> =
                lent.iter_mut().map(|l| &mut l.values.as_mut().expect("lent")[..]).collect();
            self.pull(&mut outs, interrupt)?
        };
        if step.is_some() {
            for mut l in lent {
                landing.give_back(l.shard, l.values.take().expect("lent"), true);
            }
        }
        Ok(step)
    }

    /// Where the caller's loop stands after the machine asked for `next` (a pull, or the end).
    fn phase_after(&self, next: Next) -> Result<Phase, SessionError> {
        match next {
            Next::Pull(it) => Ok(Phase::Pull(it)),
            Next::Leave => Ok(Phase::Done),
            other => Err(SessionError::Usage(format!("after a push the worker asked for {other:?}"))),
        }
    }

    /// The mean loss of the iteration last pushed, when it was pushed before its loss was
    /// known ([`exchange`](Self::exchange)): the report's last loss.
    pub fn record_loss(&mut self, loss: f32) {
        self.driver.machine.record_loss(loss);
    }

    /// How many tokens the iteration being computed trained on, reported to the shards'
    /// policies with its push (ABI v3's signals); call before the push. Without it a push
    /// reports no tokens.
    pub fn report_tokens(&mut self, tokens: u64) -> Result<(), SessionError> {
        if tokens > Signals::MAX_TOKENS {
            return Err(SessionError::Usage(format!("{tokens} tokens in one iteration (at most 2^40)")));
        }
        self.driver.machine.took_tokens(tokens);
        Ok(())
    }

    /// Buffers of the model's length, reused once pushes are sent (see
    /// [`push_buffer`](Self::push_buffer)); shared, so a caller may fill one while a call of
    /// this session is in flight.
    pub fn buffer_pool(&self) -> crate::net::pool::TensorPool {
        self.client().pool()
    }

    fn push_grad(
        &mut self,
        grad: Grad<'_>,
        stats: StepStats,
        local_steps: u32,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Option<u32>, SessionError> {
        syncopate_policy_sdk::rules::check_local_steps(local_steps).map_err(SessionError::Usage)?;
        let Phase::Computing { since, .. } = self.phase else {
            return Err(SessionError::Usage(match self.phase {
                Phase::Done => "push after training ended".into(),
                _ => "push called without a pull first".into(),
            }));
        };
        let now = self.driver.clock.now();
        self.driver.machine.took_local_steps(local_steps);
        let computed = Input::Computed { step: Some(stats), compute_ns: now.saturating_sub(since) };
        self.driver.machine.handle(now, computed)?;
        let mut dropped = None;
        let client = self.client.as_ref().expect("a session has its client until it leaves");
        let mut next = self.driver.drive(&self.rt, client, None, interrupt)?;
        if let Next::Push { iteration, samples, local_steps, signals } = next {
            let d = &mut dropped;
            let op = async move {
                let r = match grad {
                    Grad::Pieces(pieces) => {
                        client.push_segments(iteration, pieces, samples, local_steps, signals).await?
                    }
                    Grad::Owned(whole) => {
                        client.push_local(iteration, whole, samples, local_steps, signals).await?
                    }
                };
                *d = Some(r);
                Ok(Input::Pushed { kind: JobKind::Own, result: Ok(r) })
            }
            .boxed_local();
            next = self.driver.drive(&self.rt, client, Some(op), interrupt)?;
        }
        self.phase = match next {
            Next::Pull(it) => Phase::Pull(it),
            Next::Leave => Phase::Done,
            other => return Err(SessionError::Usage(format!("after a push the worker asked for {other:?}"))),
        };
        Ok(dropped)
    }

    fn check_len(&self, got: usize, what: &str) -> Result<(), SessionError> {
        let want = self.model_len();
        if got != want {
            return Err(SessionError::Usage(format!(
                "{what}: the tensors hold {got} values, the model {want} (the tensors given when joining)"
            )));
        }
        Ok(())
    }

    /// Tells the cluster how the model this worker last pulled scores on held-out data (the
    /// caller's own evaluation: accuracy 0 to 1, mean loss where measured). The launcher's
    /// watcher reads the latest score for its target accuracy, plots and report.
    pub fn score(&mut self, accuracy: f32, loss: Option<f32>) -> Result<(), SessionError> {
        if !(0.0..=1.0).contains(&accuracy) || loss.is_some_and(|l| !l.is_finite()) {
            return Err(SessionError::Usage(format!(
                "a score's accuracy must be within 0 and 1 and its loss finite (got {accuracy}, {loss:?})"
            )));
        }
        let iteration = match self.phase {
            Phase::Computing { step, .. } => step.iteration,
            Phase::Pull(next) => next.saturating_sub(1),
            Phase::Done => self.driver.machine.report().iterations,
        };
        let score = ModelScore { iteration, accuracy, loss };
        Ok(self.rt.block_on(self.client().score(score))?)
    }

    /// Writes the report (where the options named), leaves every shard and the coordinator, and
    /// returns the report. Safe at any point: a worker that leaves mid-iteration is dropped from
    /// the clocks, as a dead one would be, without waiting for it to time out. A node already
    /// lost is not an error here (there is no one to tell). If `interrupt` stops it first, the
    /// connections close without a goodbye: the cluster drops the worker after its peer
    /// timeout, as it does a dead one.
    pub fn leave(mut self, interrupt: &mut dyn Interrupt) -> Result<WorkerReport, SessionError> {
        let report = self.report();
        if let Some(path) = &self.report_path {
            let json = serde_json::to_vec_pretty(&report).expect("reports serialize");
            std::fs::write(path, json).map_err(|source| NodeError::Io {
                what: format!("cannot write {}", path.display()),
                source,
            })?;
        }
        let client = self.client.take().expect("a session has its client until it leaves");
        let leaving = async { client.leave().await.map_err(SessionError::from) };
        match self.rt.block_on(unless_stopped(leaving, interrupt)) {
            Ok(()) => Ok(report),
            // A node already gone cannot be told; the others drop us when the connection closes.
            Err(SessionError::Node(e)) if e.kind() == crate::ErrorKind::Lost => {
                tracing::warn!("leaving: {e}");
                Ok(report)
            }
            Err(e) => Err(e),
        }
    }
}

impl Driver {
    /// Runs the machine, carrying out its actions, until it wants something of the caller;
    /// `op` (a pull or push in flight) completes meanwhile and is fed to it.
    fn drive(
        &mut self,
        rt: &tokio::runtime::Runtime,
        client: &WorkerClient,
        op: Option<LocalBoxFuture<'_, Result<Input, NodeError>>>,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Next, SessionError> {
        self.drive_beside(rt, client, op, &mut None, interrupt)
    }

    /// [`drive`](Self::drive), polling `bg` all the while (requests of the caller's in flight
    /// beside the machine's: early pulls, whose answers must be read while the machine's
    /// requests wait, or their bytes would take the connection's flow-control window from
    /// the machine's answers); `bg` is `None` once done.
    fn drive_beside<'b>(
        &mut self,
        rt: &tokio::runtime::Runtime,
        client: &WorkerClient,
        mut op: Option<LocalBoxFuture<'_, Result<Input, NodeError>>>,
        bg: &mut Option<LocalBoxFuture<'b, ()>>,
        interrupt: &mut dyn Interrupt,
    ) -> Result<Next, SessionError> {
        let Driver { machine: m, controls, clock, seen, stop_seen, reported } = self;
        rt.block_on(async {
            loop {
                if !*stop_seen && client.stop_requested() {
                    *stop_seen = true;
                    m.handle(clock.now(), Input::Stop)?;
                }
                while let Ok(msg) = controls.try_recv() {
                    seen.push(msg.clone());
                    m.handle(clock.now(), Input::Control(msg))?;
                }
                if let Some(action) = m.poll_action(clock.now()) {
                    match action {
                        Action::Pull { iteration } => return Ok(Next::Pull(iteration)),
                        Action::Compute(job) => {
                            let (iteration, batch, local_steps) = (job.work.iteration, job.work.batch, job.local_steps);
                            return Ok(Next::Compute(Step { iteration, batch, local_steps }));
                        }
                        Action::Push(job) if job.kind == JobKind::Own && job.tasks.is_none() => {
                            let (iteration, samples, local_steps) = (job.iteration, job.samples, job.local_steps);
                            return Ok(Next::Push { iteration, samples, local_steps, signals: job.signals });
                        }
                        Action::Push(job) => {
                            return Err(SessionError::Usage(format!(
                                "the worker was asked to push tasks ({job:?}), which a session cannot compute"
                            )))
                        }
                        Action::Handover { shard, handover: h } => {
                            let r = beside(client.tasks_yielded(shard, &h), bg).await;
                            if let Err(e) = r {
                                tracing::warn!(worker = client.id(), "task hand-over refused: {e}");
                                m.handle(clock.now(), Input::HandoverRefused { handover: h })?;
                            }
                        }
                        Action::Applied { shard, control, iteration } => {
                            beside(client.control_applied(shard, control, iteration), bg).await?
                        }
                        // Already told shard by shard, before their early pulls.
                        Action::Finished(report) if reported.take_if(|it| *it == report.iteration).is_some() => {}
                        Action::Finished(report) => beside(client.finished(report), bg).await?,
                        Action::Skip { to, .. } => beside(client.skip(to), bg).await?,
                        Action::Waiting { iteration, waiting } => beside(client.waiting(iteration, waiting), bg).await,
                        Action::Leave => return Ok(Next::Leave),
                    }
                    continue;
                }
                let wake = m.poll_timeout().map(|t| clock.instant(t));
                tokio::select! {
                    input = async { op.as_mut().expect("guarded").await }, if op.is_some() => {
                        op = None;
                        m.handle(clock.now(), input?)?;
                    }
                    Some(msg) = controls.recv() => {
                        seen.push(msg.clone());
                        m.handle(clock.now(), Input::Control(msg))?;
                    }
                    // A stop wakes the loop: a request a policy keeps waiting is given up.
                    () = client.stopped(), if !*stop_seen => {
                        *stop_seen = true;
                        m.handle(clock.now(), Input::Stop)?;
                    }
                    () = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {
                        m.handle(clock.now(), Input::Timer)?;
                    }
                    () = async { bg.as_mut().expect("guarded").await }, if bg.is_some() => *bg = None,
                    () = interrupt.woken() => {
                        if interrupt.stop() {
                            return Err(SessionError::Interrupted);
                        }
                    }
                }
            }
        })
    }
}

/// Awaits `work` while polling `bg` too, until that is done (then `None`).
async fn beside<T>(work: impl std::future::Future<Output = T>, bg: &mut Option<LocalBoxFuture<'_, ()>>) -> T {
    tokio::pin!(work);
    loop {
        let Some(b) = bg.as_mut() else { return work.await };
        tokio::select! {
            t = &mut work => return t,
            () = b => {}
        }
        *bg = None;
    }
}

/// A gradient to push: borrowed in pieces (copied into a pooled buffer), or a pooled buffer.
enum Grad<'g> {
    Pieces(&'g [&'g [f32]]),
    Owned(Vec<f32>),
}

impl Drop for Session {
    /// A session dropped without [`leave`](Session::leave) still says goodbye (at most 2 s).
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // The timeout is made inside the runtime: made outside, it finds no timer and panics
            // (a session dropped without leave, in an error path, once did).
            let _ = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(2), client.leave()).await });
        }
    }
}
