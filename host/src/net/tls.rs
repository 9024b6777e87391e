//! TLS and QUIC endpoint set-up: certificates (generated for a local cluster, or given for a
//! real one), the cluster token, and the transport tuning every node shares.
//!
//! Servers present a certificate; clients verify it against the cluster's CA file and the
//! server name (`syncopate` unless told otherwise). Peers are then authenticated by the cluster
//! token in their [`super::proto::Hello`]: TLS keeps the token secret on the wire.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

/// The name servers' certificates are issued for and clients check by default.
pub const DEFAULT_SERVER_NAME: &str = "syncopate";

/// A TLS or endpoint set-up problem.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What happened.
        source: std::io::Error,
    },
    /// A PEM file holds no usable certificate or key.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
    /// The UDP socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What happened.
        source: std::io::Error,
    },
}

/// Where a node finds its certificate, key, and the CA it trusts.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// This node's certificate chain (PEM), presented when it listens.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA certificate (PEM) that servers' certificates chain to.
    pub ca: PathBuf,
    /// The name servers' certificates are checked against.
    pub server_name: String,
}

impl TlsFiles {
    /// The files `generate` writes in `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            ca: dir.join("cert.pem"),
            server_name: DEFAULT_SERVER_NAME.to_string(),
        }
    }

    /// Generates a self-signed certificate for `syncopate` and `localhost` into `dir`: enough
    /// for a cluster on one machine (the certificate is its own CA). The key file is written
    /// readable by its owner only.
    pub fn generate(dir: &Path) -> Result<Self, TlsError> {
        fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
            move |source| TlsError::Io { path: path.to_path_buf(), source }
        }
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let names = vec![DEFAULT_SERVER_NAME.to_string(), "localhost".to_string()];
        let ck = rcgen::generate_simple_self_signed(names).map_err(config_error)?;
        let files = Self::in_dir(dir);
        std::fs::write(&files.cert, ck.cert.pem()).map_err(io(&files.cert))?;
        write_private(&files.key, ck.key_pair.serialize_pem().as_bytes()).map_err(io(&files.key))?;
        Ok(files)
    }

    fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let certs: Vec<_> = CertificateDer::pem_file_iter(path)
            .map_err(|e| pem_error(path, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| pem_error(path, e))?;
        if certs.is_empty() {
            return Err(TlsError::Pem {
                path: path.to_path_buf(),
                what: "no certificate in the file".into(),
            });
        }
        Ok(certs)
    }

    /// The QUIC server configuration for a listening node, whose incoming connections start
    /// with a receive window of `window` bytes (see [`transport`]).
    pub fn server_config(&self, timeout: Duration, window: u64) -> Result<quinn::ServerConfig, TlsError> {
        let certs = Self::certs(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| pem_error(&self.key, e))?;
        let tls = rustls::ServerConfig::builder_with_provider(crypto())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_error)?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(config_error)?;
        let quic = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(config_error)?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quic));
        cfg.transport_config(Arc::new(transport(timeout, window)));
        Ok(cfg)
    }

    /// The QUIC client configuration for a dialing node.
    pub fn client_config(&self, timeout: Duration) -> Result<quinn::ClientConfig, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in Self::certs(&self.ca)? {
            roots.add(cert).map_err(|e| TlsError::Config(format!("{}: {e}", self.ca.display())))?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(crypto())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_error)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(config_error)?;
        let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
        cfg.transport_config(Arc::new(transport(timeout, super::window::receive_budget())));
        Ok(cfg)
    }
}

/// The TLS cryptography every node uses: *ring*'s, with AES-128-GCM preferred. Every tensor
/// byte is sealed and opened once, and AES-128 (10 rounds) costs less per byte than the default
/// first choice AES-256 (14 rounds); both are TLS 1.3 suites QUIC requires or allows.
fn crypto() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites =
        vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
    Arc::new(provider)
}

/// A TLS set-up failure, as the error nodes report.
fn config_error(e: impl std::fmt::Display) -> TlsError {
    TlsError::Config(e.to_string())
}

fn pem_error(path: &Path, e: rustls::pki_types::pem::Error) -> TlsError {
    TlsError::Pem { path: path.to_path_buf(), what: e.to_string() }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    opts.open(path)?.write_all(bytes)
}

/// The largest UDP payload an endpoint accepts and MTU discovery may probe for. quinn's default
/// (1,472 bytes, Ethernet's) also caps what the peer may send, so discovery never went further;
/// loopback carries 64 KB and jumbo-frame links 9 KB, and every packet costs a system call, an
/// encryption set-up and an acknowledgement whatever its size.
pub const MAX_UDP_PAYLOAD: u16 = 65_000;

/// Transport settings every node uses. A peer silent for `timeout` is dropped; keep-alives go
/// out four times per timeout so only a dead or cut-off peer goes silent. A connection's receive
/// window starts at `window` bytes: what the socket buffer holds ([`super::window`]), or a
/// server's floor, raised as its workers share the buffer. MTU discovery may grow packets up to
/// what the path carries (64 KB on loopback), which cuts per-packet costs for large tensors.
pub fn transport(timeout: Duration, window: u64) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(timeout)
        .unwrap_or_else(|_| quinn::IdleTimeout::from(quinn::VarInt::MAX));
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(timeout / 4));
    t.max_concurrent_bidi_streams(1024u32.into());
    t.max_concurrent_uni_streams(256u32.into());
    // The connection's window binds; a stream may use all of it.
    let budget = super::window::receive_budget().max(window);
    t.stream_receive_window(quinn::VarInt::from_u64(budget).expect("a buffer's size"));
    t.receive_window(quinn::VarInt::from_u64(window).expect("a buffer's size"));
    t.send_window(256 << 20);
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtu));
    t.congestion_controller_factory(Arc::new(initial_window()));
    t
}

/// Congestion control: quinn's CUBIC with an initial window of [`INITIAL_WINDOW`].
///
/// quinn's default initial window (14,720 bytes) is smaller than one MTU probe on a
/// large-packet path, so right after a handshake the window is full of probes. quinn 0.11
/// also holds a CONNECTION_CLOSE back while the window is full (quinn issue #2785, fixed
/// upstream after 0.11.19): a peer refused just after its handshake (a wrong token, no hello)
/// then never heard why and got a stateless reset instead. A window that holds the probes
/// keeps the close on the wire.
fn initial_window() -> quinn::congestion::CubicConfig {
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(INITIAL_WINDOW);
    cubic
}

/// The initial congestion window: ten of the largest packets. Sized for cluster links
/// (loopback, a data-centre fabric), where a first burst of this size is routine; CUBIC adapts
/// from there.
pub const INITIAL_WINDOW: u64 = 10 * MAX_UDP_PAYLOAD as u64;

fn runtime() -> Result<Arc<dyn quinn::Runtime>, TlsError> {
    quinn::default_runtime().ok_or_else(|| TlsError::Config("QUIC endpoints need a tokio runtime".into()))
}

/// An endpoint's socket: bound at `addr`, watched by the spinning runtime, its GSO batches
/// capped.
fn socket(addr: SocketAddr, runtime: &dyn quinn::Runtime) -> Result<Arc<super::udp::CappedGso>, TlsError> {
    let bind = || {
        let socket = super::udp::bind(addr)?;
        let watch = super::spin::watch(&socket);
        Ok::<_, std::io::Error>(super::udp::CappedGso::new(runtime.wrap_udp_socket(socket)?, watch))
    };
    Ok(Arc::new(bind().map_err(|source| TlsError::Bind { addr, source })?))
}

fn endpoint(addr: SocketAddr, server: Option<quinn::ServerConfig>) -> Result<quinn::Endpoint, TlsError> {
    let runtime = runtime()?;
    let socket = socket(addr, &*runtime)?;
    let mut config = quinn::EndpointConfig::default();
    // Let MTU discovery (see [`transport`]) find large packets where the path carries them.
    config.max_udp_payload_size(MAX_UDP_PAYLOAD).expect("within QUIC bounds");
    quinn::Endpoint::new_with_abstract_socket(config, server, socket, runtime)
        .map_err(|source| TlsError::Bind { addr, source })
}

/// A QUIC endpoint that listens at `addr` (and can dial out).
pub fn listen(
    addr: SocketAddr,
    server: quinn::ServerConfig,
    client: quinn::ClientConfig,
) -> Result<quinn::Endpoint, TlsError> {
    let mut ep = endpoint(addr, Some(server))?;
    ep.set_default_client_config(client);
    Ok(ep)
}

/// A QUIC endpoint that only dials out, first to `toward`. Its socket is bound where
/// [`dial_from`] says: on loopback when `toward` is, so a client of a cluster on this machine
/// can be reached from nowhere else; [`reach`] widens it if a later peer is elsewhere.
pub fn dial_only(client: quinn::ClientConfig, toward: SocketAddr) -> Result<quinn::Endpoint, TlsError> {
    let mut ep = endpoint(dial_from(toward), None)?;
    ep.set_default_client_config(client);
    Ok(ep)
}

/// The address a dial-only socket binds to reach `peer`: the loopback address of its family
/// when `peer` is on loopback, else the unspecified address of its family (any port).
pub fn dial_from(peer: SocketAddr) -> SocketAddr {
    use std::net::{Ipv4Addr, Ipv6Addr};
    match (peer.ip().is_loopback(), peer.is_ipv6()) {
        (true, false) => (Ipv4Addr::LOCALHOST, 0).into(),
        (true, true) => (Ipv6Addr::LOCALHOST, 0).into(),
        (false, false) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        (false, true) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

/// Makes a dial-only endpoint able to reach `peers`: one bound to loopback (by [`dial_only`],
/// for a loopback coordinator) moves to a socket bound to the unspecified address when a peer
/// is elsewhere (servers that a coordinator on this machine names by another address). Its
/// connections migrate with it. An endpoint that can already reach them is left alone.
pub fn reach(ep: &quinn::Endpoint, peers: &[SocketAddr]) -> Result<(), TlsError> {
    let local =
        ep.local_addr().map_err(|e| TlsError::Config(format!("an endpoint without an address: {e}")))?;
    let Some(far) = peers.iter().find(|p| !p.ip().is_loopback()) else { return Ok(()) };
    if !local.ip().is_loopback() {
        return Ok(());
    }
    let addr = dial_from(*far);
    ep.rebind_abstract(socket(addr, &*runtime()?)?).map_err(|source| TlsError::Bind { addr, source })
}

/// A cluster token: a secret every node presents.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token from its text.
    pub fn new(secret: impl Into<String>) -> Self {
        Token(secret.into())
    }

    /// A fresh random token (256 bits, hex).
    pub fn random() -> Self {
        use rand::RngCore;
        let mut b = [0u8; 32];
        rand::rng().fill_bytes(&mut b);
        Token(b.iter().map(|x| format!("{x:02x}")).collect())
    }

    /// The token's text, to send or store.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token. Compares digests, so the time taken says nothing
    /// about how much of the token matched.
    pub fn matches(&self, presented: &str) -> bool {
        Sha256::digest(self.0.as_bytes()) == Sha256::digest(presented.as_bytes())
    }
}

/// Where a cluster is and how to prove membership: what every client needs.
#[derive(Clone, Debug)]
pub struct ClusterAccess {
    /// The coordinator's address.
    pub coordinator: SocketAddr,
    /// Certificates (clients use the CA and the server name).
    pub tls: TlsFiles,
    /// The cluster token (or the operator token, for operators).
    pub token: Token,
}

/// `cluster.json`, which `syncopate local` writes in its run directory so that operators and
/// tests can reach the cluster: `syncopate policy status --cluster runs/X/cluster.json`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ClusterFile {
    /// The coordinator's address.
    pub coordinator: SocketAddr,
    /// The cluster token.
    pub token: String,
    /// The CA certificate file.
    pub ca: PathBuf,
    /// The name servers' certificates carry.
    pub server_name: String,
    /// Process ids by role and index (`coordinator`, `server-0`, `worker-2`...).
    pub pids: Vec<(String, u32)>,
    /// Where each process serves Prometheus metrics (`http://ADDR/metrics`), by the same names;
    /// absent from files written before metrics existed.
    #[serde(default)]
    pub metrics: Vec<(String, SocketAddr)>,
    /// Where the coordinator serves its live dashboard (`http://ADDR/`), if it does; absent
    /// from files written before the dashboard existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard: Option<SocketAddr>,
}

impl ClusterFile {
    /// Reads a cluster file.
    pub fn read(path: &Path) -> Result<Self, TlsError> {
        let bytes =
            std::fs::read(path).map_err(|source| TlsError::Io { path: path.to_path_buf(), source })?;
        serde_json::from_slice(&bytes)
            .map_err(|e| TlsError::Pem { path: path.to_path_buf(), what: format!("not a cluster file: {e}") })
    }

    /// The access it describes.
    pub fn access(&self) -> ClusterAccess {
        ClusterAccess {
            coordinator: self.coordinator,
            tls: TlsFiles {
                cert: self.ca.clone(),
                key: PathBuf::new(),
                ca: self.ca.clone(),
                server_name: self.server_name.clone(),
            },
            token: Token::new(self.token.clone()),
        }
    }
}
