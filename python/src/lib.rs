//! `syncopate._native`: the extension module behind the `syncopate` Python package.
//!
//! It binds three things of the host crate and nothing else: the worker [`Session`] (the
//! engine's worker machine, driven by the user's training loop), the worker settings read from
//! the `SYNCOPATE_*` environment (the same ones `syncopate worker` takes), and the operator's
//! swap and status. Tensors cross as the tensors themselves, read and written through DLPack
//! only while the GIL is held (`dlpack.rs`); calls that wait on the network do so over memory
//! of their own: a push copies the gradient first (`Staged`), a pull lands in a buffer of
//! the session's and is copied into the caller's tensors once it is back, and an exchange's
//! pull lands shard by shard in buffers the caller copies from as each comes in (`landing.rs`).
//!
//! Every call that waits (joining, pulling, pushing, leaving) releases the GIL and is woken,
//! not polled, when it may have to give up (`Wake`): on the main thread, the Python half
//! points `signal.set_wakeup_fd` at a pipe the call watches, so the byte CPython's signal
//! handler writes there wakes the call at once and it runs the Python handlers (Ctrl-C's
//! `KeyboardInterrupt`), however busy the machine is; on any thread, `Worker.leave` cancels
//! the calls still waiting in the background.

mod dlpack;
mod landing;

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use futures::future::LocalBoxFuture;
use futures::FutureExt;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{create_exception, wrap_pyfunction};
use syncopate::builtin::PolicySpec;
use syncopate::cli::{policy_source, WorkerArgs};
use syncopate::net::pool::TensorPool;
use syncopate::net::tls::ClusterFile;
use syncopate::operator::Operator;
use syncopate::worker::{FedParts, Interrupt, PushFeed, Session, SessionError};
use syncopate::{ErrorKind, NodeError};
use syncopate_engine::worker::StepStats;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use landing::Slots;

/// A pulled iteration as Python sees it: (iteration, batch, local steps).
type Pulled = (u64, u32, u32);

create_exception!(_native, SyncopateError, PyException, "Anything that went wrong in Syncopate.");
create_exception!(
    _native,
    ConfigError,
    SyncopateError,
    "The settings are missing or wrong (no coordinator, an unreadable CA, a bad value)."
);
create_exception!(
    _native,
    ClusterUnreachable,
    SyncopateError,
    "Nothing answered at the coordinator's or a server's address (or its TLS was refused)."
);
create_exception!(_native, TokenRefused, SyncopateError, "The cluster refused our token.");
create_exception!(
    _native,
    ServerLost,
    SyncopateError,
    "A server or the coordinator went away (died, was cut off, or shut down) mid-training."
);
create_exception!(
    _native,
    RequestRefused,
    SyncopateError,
    "The cluster answered but refused the request (a model of another size, a full cluster)."
);
create_exception!(
    _native,
    UsageError,
    SyncopateError,
    "Calls in an order the training loop does not allow (two pulls without a push)."
);
create_exception!(
    _native,
    TensorError,
    SyncopateError,
    "A tensor of the wrong dtype, shape, device or layout."
);

/// The Python exception for a host error.
fn node_err(e: NodeError) -> PyErr {
    let msg = e.to_string();
    match e.kind() {
        ErrorKind::Unreachable => ClusterUnreachable::new_err(msg),
        ErrorKind::Unauthenticated => {
            TokenRefused::new_err(format!("{msg} (the cluster closed the connection: a wrong token)"))
        }
        ErrorKind::Lost => ServerLost::new_err(msg),
        ErrorKind::Refused => RequestRefused::new_err(msg),
        ErrorKind::Other => SyncopateError::new_err(msg),
    }
}

/// The Python exception for a session error; `interrupted` is the signal's own exception
/// (KeyboardInterrupt), raised in its place.
fn session_err(e: SessionError, interrupted: &mut Option<PyErr>) -> PyErr {
    match e {
        SessionError::Node(n) => node_err(n),
        SessionError::Interrupted => {
            interrupted.take().unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err(()))
        }
        SessionError::Usage(m) => UsageError::new_err(m),
    }
}

fn config_err(e: anyhow::Error) -> PyErr {
    ConfigError::new_err(format!("{e:#}"))
}

/// Worker settings: the `SYNCOPATE_*` environment, overridden by `flags` (`--name value` pairs).
fn worker_args(flags: Vec<String>) -> PyResult<WorkerArgs> {
    WorkerArgs::from_env_and(flags).map_err(|e| {
        ConfigError::new_err(format!(
            "{e:#}\n(each --flag is the SYNCOPATE_FLAG variable or the flag= keyword: give \
             SYNCOPATE_COORDINATOR, SYNCOPATE_TOKEN and SYNCOPATE_CA, or SYNCOPATE_CLUSTER)"
        ))
    })
}

/// A gradient copied out of the caller's tensors (with the GIL held) into a buffer of the
/// session's pool, to be pushed from there while the GIL is released (QUIC sends that buffer
/// without another copy): the caller may free, resize or overwrite its tensors as soon as
/// [`NativeSession::stage`] returns. Pushed once.
#[pyclass(module = "syncopate._native")]
struct Staged {
    values: Mutex<Option<Vec<f32>>>,
}

/// A push fed in pieces while the caller still computes (`NativeSession.feed`, then
/// `NativeSession.exchange` on another thread): each piece is copied out of the caller's
/// tensors with the GIL held, and each shard's part goes as soon as it is whole
/// (`syncopate::worker::feed`). Fed once.
#[pyclass(module = "syncopate._native")]
struct Feed {
    feed: Mutex<PushFeed>,
    /// What the push waits on: taken by `exchange`.
    parts: Mutex<Option<FedParts>>,
    /// Where the exchange's pull lands, and which exchange this feed is for: dropped
    /// unexchanged, it tells the readers that nothing will land.
    landing: (Arc<Slots>, u64),
}

impl Drop for Feed {
    fn drop(&mut self) {
        let unexchanged = self.parts.get_mut().map(|p| p.is_some()).unwrap_or(true);
        if unexchanged {
            self.landing.0.abandon(self.landing.1);
        }
    }
}

fn poisoned<T>(_: T) -> PyErr {
    SyncopateError::new_err("the session is poisoned")
}

#[pymethods]
impl Feed {
    /// Copies `tensors` (anything with `__dlpack__`, float32, contiguous) into the push as
    /// the model's values from `offset` on, in order; returns how many shards' parts that made
    /// whole (and sent). A piece outside the model or over values put already is refused
    /// with a `TensorError`, and nothing of it is put.
    fn put(&self, offset: usize, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<usize> {
        let tensors = dlpack::borrow_all(&tensors, false, "push")?;
        let mut feed = self.feed.lock().map_err(poisoned)?;
        let len = tensors.iter().map(|t| t.len()).sum();
        feed.check(offset, len).map_err(|e| TensorError::new_err(format!("push: {e}")))?;
        let mut sent = 0;
        let mut at = offset;
        for t in &tensors {
            sent += feed.put(at, t.read()).expect("checked as a whole");
            at += t.len();
        }
        Ok(sent)
    }

    /// Puts zeros wherever nothing was put (parameters no gradient reached); returns how many
    /// shards' parts that sent.
    fn fill_rest(&self) -> PyResult<usize> {
        Ok(self.feed.lock().map_err(poisoned)?.fill_rest(0.0))
    }

    /// Whether every value was put.
    #[getter]
    fn complete(&self) -> PyResult<bool> {
        Ok(self.feed.lock().map_err(poisoned)?.is_complete())
    }
}

/// A worker joined to a cluster, driven by the caller's loop (`syncopate.Worker` wraps it).
#[pyclass(module = "syncopate._native")]
struct NativeSession {
    inner: Mutex<Option<Session>>,
    /// Set by [`NativeSession::cancel`]: the calls waiting in the background give up.
    cancel: watch::Sender<bool>,
    /// Where a pull lands before it is copied into the caller's tensors (kept from pull to
    /// pull; locked only while `inner` is).
    pulled: Mutex<Vec<f32>>,
    /// Where an exchange's pull lands, shard by shard (read while it runs: `land_part`).
    slots: Arc<Slots>,
    /// The session's buffers for pushes (shared with it: staging needs no lock of the session).
    pool: TensorPool,
}

/// What a waiting call watches to give up ([`Interrupt`]).
///
/// `wake` is what the Python half passes: the read end of the pipe that CPython's signal
/// handler writes to (`signal.set_wakeup_fd`, set around calls on the main thread); `-1` on the
/// main thread when that is taken by someone else (an asyncio loop's), which makes the call
/// look for signals every [`POLL_SIGNALS`] instead; `None` off the main thread, where no signal
/// handler runs (CPython runs them on the main thread only). Whatever `wake` is, a cancelled
/// session ([`NativeSession::cancel`]) stops the call.
struct Wake<'a> {
    wake: Option<RawFd>,
    /// A duplicate of `wake`, registered with the runtime on the first wait.
    pipe: Option<AsyncFd<OwnedFd>>,
    cancel: Option<watch::Receiver<bool>>,
    /// The exception to raise in place of [`SessionError::Interrupted`].
    raised: &'a mut Option<PyErr>,
}

/// How often a call on the main thread looks for signals when it has no wakeup pipe.
const POLL_SIGNALS: std::time::Duration = std::time::Duration::from_millis(50);

/// The wakeup pipe's read end, duplicated (the Python half keeps its own) and registered with
/// the runtime.
fn register(fd: RawFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the Python half keeps `fd` open for the whole call, which outlives this borrow.
    let owned = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
    // SAFETY: the duplicate is ours, and stays open as long as the `AsyncFd` that owns it.
    unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }.map_err(Into::into)
}

/// Reads what is waiting in the (non-blocking) pipe, so it is not readable again until the
/// next signal.
fn drain(fd: RawFd) {
    let mut buf = [0u8; 64];
    // SAFETY: reads into a local buffer of the length given, from a descriptor the Python half
    // keeps open for the call's duration.
    while unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
}

impl Interrupt for Wake<'_> {
    fn woken(&mut self) -> LocalBoxFuture<'_, ()> {
        let Wake { wake, pipe, cancel, .. } = self;
        async move {
            let cancelled = async {
                // Resolves at once if already cancelled; never if the session is gone.
                let done = match cancel {
                    Some(rx) => rx.wait_for(|c| *c).await.is_ok(),
                    None => false,
                };
                if !done {
                    std::future::pending::<()>().await
                }
            };
            let signalled = async {
                match *wake {
                    Some(fd) if fd >= 0 => {
                        if pipe.is_none() {
                            match register(fd) {
                                Ok(p) => *pipe = Some(p),
                                // Not pollable: look every so often instead.
                                Err(_) => return tokio::time::sleep(POLL_SIGNALS).await,
                            }
                        }
                        let p = pipe.as_ref().expect("registered above");
                        if let Ok(mut ready) = p.readable().await {
                            drain(p.get_ref().as_raw_fd());
                            ready.clear_ready();
                        }
                    }
                    Some(_) => tokio::time::sleep(POLL_SIGNALS).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = cancelled => {}
                () = signalled => {}
            }
        }
        .boxed_local()
    }

    fn stop(&mut self) -> bool {
        if self.cancel.as_ref().is_some_and(|rx| *rx.borrow()) {
            *self.raised = Some(UsageError::new_err("the worker left the cluster while this call waited"));
            return true;
        }
        if self.wake.is_none() {
            return false;
        }
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *self.raised = Some(e);
                true
            }
        })
    }
}

impl NativeSession {
    /// Locks the session without holding the GIL while waiting: a call in flight on another
    /// thread looks for signals with the GIL now and then, and must not wait for us while we
    /// wait for it.
    fn lock(&self, py: Python<'_>) -> PyResult<std::sync::MutexGuard<'_, Option<Session>>> {
        loop {
            match self.inner.try_lock() {
                Ok(g) => return Ok(g),
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| std::thread::sleep(std::time::Duration::from_millis(1)))
                }
                Err(std::sync::TryLockError::Poisoned(_)) => {
                    return Err(SyncopateError::new_err("the session is poisoned"))
                }
            }
        }
    }

    /// Pulls the next iteration into `pulled` (when one comes: then `land` it).
    fn pull_buffered(
        &self,
        py: Python<'_>,
        s: &mut Session,
        wake: Option<RawFd>,
        cancel: watch::Receiver<bool>,
    ) -> PyResult<Option<Pulled>> {
        let mut pulled = self.pulled.lock().map_err(poisoned)?;
        pulled.resize(s.model_len(), 0.0);
        let into = &mut pulled[..];
        let step = detached(py, wake, Some(cancel), move |stop| s.pull(&mut [into], stop))?;
        Ok(step.map(|step| (step.iteration, step.batch, step.local_steps)))
    }

    /// Copies the model the last pull brought (into `pulled`) into `out` (the model's
    /// tensors).
    fn land(&self, out: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        // The GIL was released while the pull waited: the tensors are borrowed as they are now.
        let mut targets = dlpack::borrow_all(&out, true, "pull")?;
        let pulled = self.pulled.lock().map_err(poisoned)?;
        let n: usize = targets.iter().map(|t| t.len()).sum();
        if n != pulled.len() {
            return Err(TensorError::new_err(format!(
                "pull: the tensors hold {n} values, the model pulled {}; it was not written (a tensor \
                 changed size while the pull waited?)",
                pulled.len()
            )));
        }
        let mut at = 0;
        for t in &mut targets {
            let n = t.len();
            t.write().copy_from_slice(&pulled[at..at + n]);
            at += n;
        }
        Ok(())
    }

    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&mut Session) -> PyResult<R>) -> PyResult<R> {
        let mut g = self.lock(py)?;
        let s = g.as_mut().ok_or_else(|| UsageError::new_err("this worker has left the cluster"))?;
        f(s)
    }
}

/// Runs `f` without the GIL, woken to give up by `wake` (see [`Wake`]) or by `cancel`; the
/// exception that stopped it (the signal handler's, Ctrl-C's `KeyboardInterrupt`) is raised.
fn detached<R: Send>(
    py: Python<'_>,
    wake: Option<RawFd>,
    cancel: Option<watch::Receiver<bool>>,
    f: impl FnOnce(&mut dyn Interrupt) -> Result<R, SessionError> + Send,
) -> PyResult<R> {
    let mut raised: Option<PyErr> = None;
    let slot = &mut raised;
    let r = py.detach(move || f(&mut Wake { wake, pipe: None, cancel, raised: slot }));
    r.map_err(|e| session_err(e, &mut raised))
}

#[pymethods]
impl NativeSession {
    /// Joins the cluster. `init`: the model's tensors (anything with `__dlpack__`: numpy
    /// arrays, torch tensors), copied; `flags`: settings over the environment's; `threads`:
    /// the I/O runtime's threads; `wake`: see [`Wake`].
    #[new]
    #[pyo3(signature = (init, flags, threads, wake=None))]
    fn new(
        py: Python<'_>,
        init: Vec<Bound<'_, PyAny>>,
        flags: Vec<String>,
        threads: usize,
        wake: Option<RawFd>,
    ) -> PyResult<Self> {
        let args = worker_args(flags)?;
        let mut opts = args.options().map_err(config_err)?;
        // The script's own loop ends training unless the settings give a budget.
        if args.iterations.is_none() {
            opts.iterations = u64::MAX / 4;
        }
        let init: Vec<f32> =
            dlpack::borrow_all(&init, false, "join")?.iter().flat_map(|t| t.read()).copied().collect();
        let session =
            detached(py, wake, None, move |stop| Session::connect(opts, &[&init[..]], threads, stop))?;
        Ok(NativeSession {
            pool: session.buffer_pool(),
            inner: Mutex::new(Some(session)),
            cancel: watch::Sender::new(false),
            pulled: Mutex::new(Vec::new()),
            slots: Arc::default(),
        })
    }

    /// This worker's id.
    #[getter]
    fn rank(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, |s| Ok(s.id()))
    }

    /// Workers the cluster expects.
    #[getter]
    fn size(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, |s| Ok(s.workers()))
    }

    /// The servers' optimizer: (learning rate, momentum, weight decay).
    #[getter]
    fn server_optimizer(&self, py: Python<'_>) -> PyResult<(f32, f32, f32)> {
        self.with(py, |s| {
            let o = s.server_optimizer();
            Ok((o.lr, o.momentum, o.weight_decay))
        })
    }

    /// Parameters in the whole model.
    #[getter]
    fn model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.model_len()))
    }

    /// Whether training is over.
    #[getter]
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| Ok(s.is_done()))
    }

    /// Pulls into `out` (the model's tensors, written in place once the pull is back); returns
    /// (iteration, batch, local steps), or None once training is over.
    #[pyo3(signature = (out, wake=None))]
    fn pull(
        &self,
        py: Python<'_>,
        out: Vec<Bound<'_, PyAny>>,
        wake: Option<RawFd>,
    ) -> PyResult<Option<Pulled>> {
        let cancel = self.cancel.subscribe();
        // Checked before anything is pulled, so that a wrong tensor costs nothing.
        let lens: usize = dlpack::borrow_all(&out, true, "pull")?.iter().map(|t| t.len()).sum();
        let step = self.with(py, |s| {
            if lens != s.model_len() {
                return Err(UsageError::new_err(format!(
                    "pull: the tensors hold {lens} values, the model {} (the tensors given when joining)",
                    s.model_len()
                )));
            }
            self.pull_buffered(py, s, wake, cancel)
        })?;
        if step.is_some() {
            self.land(out)?;
        }
        Ok(step)
    }

    /// A push to feed in pieces ([`Feed`]) while the caller computes, for
    /// [`exchange`](Self::exchange). The model the last exchange pulled is forgotten: land it
    /// first.
    fn feed(&self, py: Python<'_>) -> PyResult<Feed> {
        self.with(py, |s| {
            let (feed, parts) = s.feed();
            let exchange = self.slots.begin(&s.shard_ranges());
            Ok(Feed {
                feed: Mutex::new(feed),
                parts: Mutex::new(Some(parts)),
                landing: (Arc::clone(&self.slots), exchange),
            })
        })
    }

    /// Pushes what `feed` is fed, each shard's part as soon as it is whole, and pulls the next
    /// iteration into the session's buffers, each shard's part as soon as it acknowledged the
    /// push (`Session::exchange`; [`land_part`](Self::land_part) copies it into the tensors,
    /// shard by shard while this still runs once [`planned`](Self::planned) says the pull
    /// goes early). Meant for another thread than the one feeding: it returns once the push is
    /// acknowledged and the pull is back. Returns (shards that dropped the push, or None if it
    /// was not pushed; the pulled iteration as `pull` returns it, or None once training is
    /// over).
    #[pyo3(signature = (feed, samples, local_steps=0, wake=None))]
    fn exchange(
        &self,
        py: Python<'_>,
        feed: &Feed,
        samples: u32,
        local_steps: u32,
        wake: Option<RawFd>,
    ) -> PyResult<(Option<u32>, Option<Pulled>)> {
        let cancel = self.cancel.subscribe();
        let parts = feed.parts.lock().map_err(poisoned)?.take();
        let parts = parts.ok_or_else(|| UsageError::new_err("this feed was pushed already"))?;
        let _ending = self.slots.ending();
        self.with(py, |s| {
            let slots = &*self.slots;
            let (dropped, step) = detached(py, wake, Some(cancel), move |stop| {
                s.exchange(parts, samples, local_steps, slots, stop)
            })?;
            Ok((dropped, step.map(|step| (step.iteration, step.batch, step.local_steps))))
        })
    }

    /// Waits until the exchange in flight knows how it pulls: returns the iteration it pulls
    /// early (each shard's part lands as soon as that shard acknowledged the push, and
    /// [`land_part`](Self::land_part) may take it at once), or None when the pull waits for
    /// the whole push, the exchange is over, or its feed was dropped unexchanged (wait for the
    /// exchange then). While a feed is alive and not yet exchanged, this waits for it.
    fn planned(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        loop {
            let (plan, settled) = py.detach(|| {
                let (g, known) = self.slots.wait_a_while(|s| s.plan.is_some());
                (g.plan, known || g.over)
            });
            if settled {
                return Ok(plan.flatten());
            }
            py.check_signals()?;
        }
    }

    /// Copies the values from `offset` on of the model the last exchange pulled into
    /// `tensors` (anything with `__dlpack__`, float32, contiguous, writable), waiting for the
    /// shards that hold them to land. Returns False, and writes nothing, when the exchange
    /// will not land them (it ended without them, failed or found training over, and its
    /// result says which; or its feed was dropped unexchanged).
    fn land_part(&self, py: Python<'_>, offset: usize, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
        // Checked before waiting, so that a wrong tensor costs nothing.
        let len: usize = dlpack::borrow_all(&tensors, true, "pull")?.iter().map(|t| t.len()).sum();
        let shards = self
            .slots
            .lock()
            .shards_over(offset, len)
            .map_err(|e| TensorError::new_err(format!("pull: {e}")))?;
        let landed = |s: &landing::SlotState| shards.clone().all(|i| s.landed[i]);
        loop {
            let done = py.detach(|| {
                let (g, ok) = self.slots.wait_a_while(landed);
                ok || g.over
            });
            if done {
                break;
            }
            py.check_signals()?;
        }
        // Borrowed again: signal handlers (Python code) may have run while we waited. The copy
        // holds both the GIL and the slots.
        let mut targets = dlpack::borrow_all(&tensors, true, "pull")?;
        if targets.iter().map(|t| t.len()).sum::<usize>() != len {
            return Err(TensorError::new_err(
                "pull: a tensor changed size while its part of the model landed; it was not written",
            ));
        }
        let s = self.slots.lock();
        if !landed(&s) {
            return Ok(false);
        }
        let mut at = offset;
        let mut shard = shards.start;
        for t in &mut targets {
            let out = t.write();
            let mut done = 0;
            while done < out.len() {
                while s.starts[shard + 1] <= at {
                    shard += 1;
                }
                let local = at - s.starts[shard];
                let take = (out.len() - done).min(s.starts[shard + 1] - at);
                out[done..done + take].copy_from_slice(&s.bufs[shard][local..local + take]);
                done += take;
                at += take;
            }
        }
        Ok(true)
    }

    /// Sets the loss of the iteration last pushed by [`exchange`](Self::exchange) (known only
    /// once its push had started).
    fn record_loss(&self, py: Python<'_>, loss: f32) -> PyResult<()> {
        self.with(py, |s| {
            s.record_loss(loss);
            Ok(())
        })
    }

    /// Copies a gradient out of `grad` (the model's tensors) for [`push`](Self::push).
    fn stage(&self, grad: Vec<Bound<'_, PyAny>>) -> PyResult<Staged> {
        let tensors = dlpack::borrow_all(&grad, false, "push")?;
        let mut values = self.pool.take(tensors.iter().map(|t| t.len()).sum());
        let mut at = 0;
        for t in &tensors {
            values[at..at + t.len()].copy_from_slice(t.read());
            at += t.len();
        }
        Ok(Staged { values: Mutex::new(Some(values)) })
    }

    /// Pushes a staged gradient (a pseudo-gradient of `local_steps` steps if above 0) with the
    /// loss and tokens its iteration reports to the policies; returns how many shards dropped
    /// it, or None if it was not pushed.
    #[pyo3(signature = (grad, samples, loss, local_steps=0, wake=None, tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        py: Python<'_>,
        grad: &Staged,
        samples: u32,
        loss: f32,
        local_steps: u32,
        wake: Option<RawFd>,
        tokens: u64,
    ) -> PyResult<Option<u32>> {
        let cancel = self.cancel.subscribe();
        let values = grad.values.lock().ok().and_then(|mut v| v.take());
        let values = values.ok_or_else(|| UsageError::new_err("this staged gradient was pushed already"))?;
        self.with(py, |s| {
            detached(py, wake, Some(cancel), move |stop| {
                s.report_tokens(tokens)?;
                s.push_buffer(values, StepStats { samples, loss }, local_steps, stop)
            })
        })
    }

    /// Makes every call still waiting, and every later pull or push, give up with a
    /// `UsageError`: `Worker.leave` calls it before waiting for its background calls.
    fn cancel(&self) {
        self.cancel.send_replace(true);
    }

    /// Control messages since the last call, as JSON.
    fn controls(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |s| {
            let msgs: Vec<serde_json::Value> = s
                .take_controls()
                .into_iter()
                .map(|m| serde_json::json!({ "shard": m.shard, "control": m.control }))
                .collect();
            Ok(serde_json::Value::Array(msgs).to_string())
        })
    }

    /// Reports the model's score on held-out data to the cluster (the launcher's watcher).
    #[pyo3(signature = (accuracy, loss=None))]
    fn score(&self, py: Python<'_>, accuracy: f32, loss: Option<f32>) -> PyResult<()> {
        self.with(py, |s| detached(py, None, None, move |_| s.score(accuracy, loss)))
    }

    /// The worker's report so far, as JSON.
    fn report(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |s| Ok(serde_json::to_string(&s.report()).expect("reports serialize")))
    }

    /// Leaves the cluster (idempotent); returns the final report as JSON, or None if already
    /// left. Not stopped by [`cancel`](Self::cancel) (it follows it), only by a signal.
    #[pyo3(signature = (wake=None))]
    fn leave(&self, py: Python<'_>, wake: Option<RawFd>) -> PyResult<Option<String>> {
        let taken = self.lock(py)?.take();
        let Some(session) = taken else { return Ok(None) };
        let report = detached(py, wake, None, move |stop| session.leave(stop))?;
        Ok(Some(serde_json::to_string(&report).expect("reports serialize")))
    }
}

/// The settings a worker would join with (environment and flags), as JSON: for checking them
/// before joining (`syncopate.init`).
#[pyfunction]
fn settings(flags: Vec<String>) -> PyResult<String> {
    let a = worker_args(flags)?;
    let access = a.access().map_err(config_err)?;
    Ok(serde_json::json!({
        "coordinator": access.coordinator.to_string(),
        "ca": access.tls.ca,
        "server_name": access.tls.server_name,
        "id": a.id,
        "part": [a.part.0, a.part.1],
        "iterations": a.iterations,
        "batch": a.batch,
        "seed": a.seed,
        "data": a.data,
        "slow_factor": a.slow_factor,
        "report": a.report,
    })
    .to_string())
}

fn operator_runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| SyncopateError::new_err(format!("cannot start the async runtime: {e}")))
}

fn operator_access(cluster: &str) -> PyResult<syncopate::net::tls::ClusterAccess> {
    Ok(ClusterFile::read(std::path::Path::new(cluster))
        .map_err(|e| ConfigError::new_err(e.to_string()))?
        .access())
}

/// Swaps the cluster's policy (`"ssp:s=3"`, a built-in name or a .wasm path); returns
/// (swap number, shards).
#[pyfunction]
fn swap(py: Python<'_>, cluster: &str, policy: &str) -> PyResult<(u64, u32)> {
    let spec: PolicySpec =
        policy.parse().map_err(|e| ConfigError::new_err(format!("policy `{policy}`: {e}")))?;
    let source = policy_source(&spec, Vec::new()).map_err(config_err)?;
    let access = operator_access(cluster)?;
    let rt = operator_runtime()?;
    let swapped = py
        .detach(|| {
            rt.block_on(async {
                let op = Operator::connect(&access).await?;
                op.swap(&source).await
            })
        })
        .map_err(node_err)?;
    match swapped {
        syncopate::operator::Swapped::Whole { swap, shards } => Ok((swap, shards)),
        syncopate::operator::Swapped::Partly { swap, failed } => Err(SyncopateError::new_err(format!(
            "swap {swap} was committed, but not on every shard: {failed}"
        ))),
    }
}

/// The cluster's status (policy per shard, workers, counters), as JSON.
#[pyfunction]
fn status(py: Python<'_>, cluster: &str) -> PyResult<String> {
    let access = operator_access(cluster)?;
    let rt = operator_runtime()?;
    let s = py
        .detach(|| rt.block_on(async { Operator::connect(&access).await?.status().await }))
        .map_err(node_err)?;
    Ok(serde_json::to_string(&s).expect("status serializes"))
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<NativeSession>()?;
    m.add_class::<Staged>()?;
    m.add_class::<Feed>()?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(swap, m)?)?;
    m.add_function(wrap_pyfunction!(status, m)?)?;
    m.add("SyncopateError", py.get_type::<SyncopateError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("ClusterUnreachable", py.get_type::<ClusterUnreachable>())?;
    m.add("TokenRefused", py.get_type::<TokenRefused>())?;
    m.add("ServerLost", py.get_type::<ServerLost>())?;
    m.add("RequestRefused", py.get_type::<RequestRefused>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    m.add("TensorError", py.get_type::<TensorError>())?;
    m.add("PROTOCOL_VERSION", syncopate::net::proto::PROTOCOL_VERSION)?;
    // A benchmark refuses a debug build of the extension (its copies are 10x slower).
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    Ok(())
}
