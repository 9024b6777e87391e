//! The live dashboard: a web page the coordinator serves (`--dashboard ADDR`; `syncopate local
//! --dashboard`) that shows the cluster as it trains and lets an operator hot-swap its policy.
//!
//! - [`board`]: the pure machine that folds each reading of the cluster's status into what the
//!   page shows, sized for a browser at any number of workers.
//! - This module is its driver: a task reads the cluster's status every
//!   [`DashboardOptions::every`], and an axum server sends the page, its assets (uPlot, vendored
//!   with its licence, no CDN), the view as JSON, and every new view to each open page as
//!   server-sent events. `POST /api/swap` swaps a built-in or uploaded policy in, guarded by the
//!   operator token; an uploaded module gets the check `policy swap` gives it first.
//!
//! Routes: `GET /` (the page), `GET /assets/NAME`, `GET /api/view`, `GET /api/history`,
//! `GET /api/events` (server-sent events, one `view` event per reading), `GET
//! /api/worker/ID`, `GET /api/policies`, `POST /api/swap?policy=SPEC` (the module's bytes as
//! the body for an upload; `Authorization: Bearer TOKEN`).

pub mod board;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::coordinator::PolicySource;
use crate::http::Listener;
use crate::net::proto::ClusterStatus;
use crate::node::NodeError;
use board::Board;

/// The largest module the page may upload.
pub const MAX_UPLOAD: usize = 32 << 20;

/// Where and how often the dashboard runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DashboardOptions {
    /// The address to listen at (port 0: any).
    pub listen: SocketAddr,
    /// Where to write the address bound.
    pub addr_file: Option<PathBuf>,
    /// Time between readings of the cluster.
    pub every: Duration,
}

/// The default of [`DashboardOptions::every`].
pub const DEFAULT_EVERY: Duration = Duration::from_secs(1);

/// A boxed future, as [`Control`]'s methods return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the dashboard needs of the coordinator.
pub trait Control: Send + Sync + 'static {
    /// The cluster's status, every server asked.
    fn status(&self) -> BoxFuture<'_, Result<ClusterStatus, String>>;
    /// Swaps `source` in on every shard.
    fn swap(&self, source: PolicySource) -> BoxFuture<'_, SwapAnswer>;
    /// Whether `presented` is the operator token.
    fn authorized(&self, presented: &str) -> bool;
}

/// How a swap asked from the page went.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SwapAnswer {
    /// Every shard runs it.
    Done {
        /// The swap's number.
        swap: u64,
        /// Shards switched.
        shards: u32,
        /// The policy's label.
        policy: String,
    },
    /// Committed, but some server could not switch.
    Partly {
        /// The swap's number.
        swap: u64,
        /// The policy's label.
        policy: String,
        /// The servers that did not, and why.
        failed: String,
    },
    /// Not swapped in.
    Refused {
        /// Why.
        reason: String,
    },
}

struct Shared {
    board: Mutex<Board>,
    control: Arc<dyn Control>,
    /// The latest view, as JSON, for every open page.
    ticks: tokio::sync::watch::Sender<Option<Arc<str>>>,
}

impl Shared {
    fn board(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Binds the dashboard's socket ([`Listener::bind`]).
pub async fn bind(opts: &DashboardOptions) -> Result<Listener, NodeError> {
    let listener = Listener::bind("the dashboard", opts.listen, opts.addr_file.as_deref()).await?;
    let addr = listener.addr();
    tracing::info!(%addr, "dashboard at http://{addr}/");
    Ok(listener)
}

/// A running dashboard; [`abort`](Self::abort) stops it.
#[derive(Debug)]
pub struct Running {
    server: tokio::task::JoinHandle<()>,
    reader: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops serving and reading.
    pub fn abort(&self) {
        self.server.abort();
        self.reader.abort();
    }
}

/// Serves the dashboard on `listener`, reading the cluster through `control` every `every`.
pub fn serve(listener: Listener, control: Arc<dyn Control>, every: Duration) -> Running {
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (ticks, _) = tokio::sync::watch::channel(None);
    let shared = Arc::new(Shared { board: Mutex::new(Board::new(started_unix_ms)), control, ticks });
    let reader = tokio::spawn(read(shared.clone(), every));
    let app = axum::Router::new()
        .route("/", get(page))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/assets/{name}", get(asset))
        .route("/api/view", get(view))
        .route("/api/history", get(history))
        .route("/api/events", get(events))
        .route("/api/worker/{id}", get(worker))
        .route("/api/policies", get(policies))
        .route("/api/swap", post(swap))
        .layer(DefaultBodyLimit::max(MAX_UPLOAD))
        .with_state(shared);
    Running { server: listener.serve("dashboard", app), reader }
}

/// Reads the cluster every `every` (a reading slower than that delays the next) and tells the
/// open pages.
async fn read(shared: Arc<Shared>, every: Duration) {
    let t0 = Instant::now();
    let limit = (every * 5).max(Duration::from_secs(5));
    loop {
        let asked = Instant::now();
        let status = tokio::time::timeout(limit, shared.control.status()).await;
        let t_s = t0.elapsed().as_secs_f64();
        let json = {
            let mut board = shared.board();
            match status {
                Ok(Ok(s)) => board.observe(t_s, &s),
                Ok(Err(e)) => board.failed(t_s, &e),
                Err(_) => board.failed(t_s, &format!("the cluster did not answer within {limit:?}")),
            }
            board.view().and_then(|v| serde_json::to_string(v).ok())
        };
        if let Some(json) = json {
            shared.ticks.send_replace(Some(json.into()));
        }
        tokio::time::sleep(every.saturating_sub(asked.elapsed())).await;
    }
}

fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    json_response(status, serde_json::json!({ "error": message.to_string() }).to_string())
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("page/index.html")).into_response()
}

/// The page's files: its own script and style, and uPlot (vendored; `vendor/README.md`).
const ASSETS: &[(&str, &str, &str)] = &[
    ("dashboard.js", "text/javascript; charset=utf-8", include_str!("page/dashboard.js")),
    ("dashboard.css", "text/css; charset=utf-8", include_str!("page/dashboard.css")),
    ("uPlot.iife.min.js", "text/javascript; charset=utf-8", include_str!("vendor/uPlot.iife.min.js")),
    ("uPlot.min.css", "text/css; charset=utf-8", include_str!("vendor/uPlot.min.css")),
    ("uPlot-LICENSE.txt", "text/plain; charset=utf-8", include_str!("vendor/uPlot-LICENSE.txt")),
];

async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.0 == name) {
        Some((_, kind, body)) => ([(header::CONTENT_TYPE, *kind)], *body).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no asset `{name}`")),
    }
}

async fn view(State(shared): State<Arc<Shared>>) -> Response {
    match shared.ticks.borrow().clone() {
        Some(json) => json_response(StatusCode::OK, json.to_string()),
        None => error(StatusCode::SERVICE_UNAVAILABLE, "no reading of the cluster yet"),
    }
}

async fn history(State(shared): State<Arc<Shared>>) -> Response {
    let json = serde_json::to_string(shared.board().history()).unwrap_or_default();
    json_response(StatusCode::OK, json)
}

async fn worker(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u32>() else {
        return error(StatusCode::BAD_REQUEST, format!("`{id}` is not a worker id"));
    };
    let detail = shared.board().worker(id);
    match detail {
        Some(d) => json_response(StatusCode::OK, serde_json::to_string(&d).unwrap_or_default()),
        None => error(StatusCode::NOT_FOUND, format!("no worker {id} seen")),
    }
}

async fn policies() -> Response {
    let names: Vec<&str> = crate::builtin::names().collect();
    json_response(StatusCode::OK, serde_json::to_string(&names).unwrap_or_default())
}

/// Each new view as a `view` event, from the latest one on.
async fn events(
    State(shared): State<Arc<Shared>>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let mut rx = shared.ticks.subscribe();
    rx.mark_changed();
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        loop {
            rx.changed().await.ok()?;
            let json = rx.borrow_and_update().clone();
            if let Some(json) = json {
                return Some((Ok(Event::default().event("view").data(&*json)), rx));
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `POST /api/swap`'s query.
#[derive(Debug, Deserialize)]
struct SwapQuery {
    /// `NAME[:k=v,...]`: a built-in, or the uploaded module's file name with its configuration.
    policy: String,
}

async fn swap(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<SwapQuery>,
    body: axum::body::Bytes,
) -> Response {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(token) if shared.control.authorized(token) => {}
        Some(_) => {
            tracing::warn!("dashboard: a swap refused, the token presented is not the operator token");
            return unauthorized("the token is not the operator token");
        }
        None => return unauthorized("a swap needs the operator token (Authorization: Bearer TOKEN)"),
    }
    let spec: crate::builtin::PolicySpec = match q.policy.parse() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let (label, wasm) = if body.is_empty() {
        match crate::builtin::wasm(&spec.source) {
            Some(bytes) => (format!("builtin:{}", spec.source), bytes.to_vec()),
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "no built-in shard policy `{}` (built-ins: {}); upload a module to swap in your own",
                        spec.source,
                        crate::builtin::names().collect::<Vec<_>>().join(", ")
                    ),
                )
            }
        }
    } else {
        let (label, wasm, config) = (spec.source.clone(), body.to_vec(), spec.config.clone());
        let checked = tokio::task::spawn_blocking(move || {
            let rt = crate::runtime::PolicyRuntime::new().map_err(|e| e.to_string())?;
            crate::cli::quick_check_module(&rt, &label, &wasm, &config).map_err(|e| format!("{e:#}"))?;
            Ok::<_, String>((label, wasm))
        })
        .await;
        match checked {
            Ok(Ok(module)) => module,
            Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("not swapped in: {e}")),
            Err(e) => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, format!("the check did not finish: {e}"))
            }
        }
    };
    tracing::info!(policy = %spec, "dashboard: swap asked");
    let source = PolicySource { label, wasm, config: spec.config, overrides: Vec::new() };
    let answer = shared.control.swap(source).await;
    let status = match answer {
        SwapAnswer::Done { .. } | SwapAnswer::Partly { .. } => StatusCode::OK,
        SwapAnswer::Refused { .. } => StatusCode::CONFLICT,
    };
    json_response(status, serde_json::to_string(&answer).unwrap_or_default())
}

fn unauthorized(why: &str) -> Response {
    let mut r = error(StatusCode::UNAUTHORIZED, why);
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    r
}
