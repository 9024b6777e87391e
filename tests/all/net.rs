//! The transport under attack: wrong tokens, peers that skip the hello, and malformed,
//! truncated, oversized or unknown messages, each sent to a real server of a running cluster.
//! Each bad peer gets a clear close reason and nothing else; the cluster keeps training and
//! its result is still exact. Plus property tests of the frame decoder (the fuzz target's
//! function, in CI).

use std::time::Duration;

use proptest::prelude::*;
use syncopate::net::proto::{
    CoordError, DataError, DataRequest, DataResponse, Hello, Role, Welcome, PROTOCOL_VERSION,
};
use syncopate::net::tls::{ClusterAccess, ClusterFile, Token};
use syncopate::net::wire::{self, Limits, WireError};
use syncopate::net::{self, close};
use syncopate::operator::Operator;
use syncopate::worker::WorkerClient;

use crate::cli::syncopate_bin;
use crate::cluster::{run_dir, LocalRun};
use syncopate_suite::ProcessCluster;

fn hello(token: &str) -> Hello {
    Hello { protocol: PROTOCOL_VERSION, token: token.into(), role: Role::Operator }
}

/// Connects as an authenticated reader and sends `bytes` as one request; returns the close
/// reason the server gave.
async fn send_raw(
    ep: &quinn::Endpoint,
    access: &ClusterAccess,
    server: std::net::SocketAddr,
    bytes: &[u8],
) -> String {
    let (conn, welcome) = net::connect(ep, server, &access.tls.server_name, &hello(access.token.secret()))
        .await
        .expect("reader connects");
    assert_eq!(welcome, Welcome::Accepted);
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(bytes).await.unwrap();
    let _ = send.finish();
    let _ = recv.read_to_end(1 << 20).await;
    match tokio::time::timeout(Duration::from_secs(10), conn.closed()).await.expect("the server closes") {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, close::MALFORMED.into());
            String::from_utf8_lossy(&c.reason).into_owned()
        }
        other => panic!("unexpected close: {other}"),
    }
}

#[test]
fn bad_peers_are_refused_and_the_cluster_keeps_training() {
    let mut run = LocalRun::start(
        "net",
        &["--workers", "2", "--servers", "1", "--iterations", "150", "--delay-ms", "20", "--params", "64"],
    );
    let file = ClusterFile::read(&run.cluster_file()).unwrap();
    let access = file.access();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async {
        // Wrong token: as an operator and as a worker. The peer learns only that it failed.
        let wrong = ClusterAccess { token: Token::new("not-the-token"), ..access.clone() };
        let err = Operator::connect(&wrong).await.expect_err("wrong token refused").to_string();
        assert!(err.contains("authentication failed"), "{err}");
        let err = WorkerClient::connect(&wrong, None, 64).await.expect_err("wrong token refused").to_string();
        assert!(err.contains("authentication failed"), "{err}");

        let op = Operator::connect(&access).await.expect("the right token works");
        // cluster.json is written once the servers are started, not registered: wait for one.
        let mut server = None;
        for _ in 0..300 {
            server = op.status().await.unwrap().servers.first().map(|s| s.addr);
            if server.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let server = server.expect("a server registers within 30 s");
        let ep =
            net::tls::dial_only(access.tls.client_config(Duration::from_secs(10)).unwrap(), server).unwrap();

        // A peer that skips the hello and sends a request straight away.
        let conn = ep.connect(server, &access.tls.server_name).unwrap().await.unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        send.write_all(&wire::encode_frame(&DataRequest::Read { shard: 0 }, &[])).await.unwrap();
        let _ = send.finish();
        let reason = tokio::time::timeout(Duration::from_secs(15), conn.closed()).await.unwrap();
        assert!(reason.to_string().contains("malformed hello"), "{reason}");

        // Malformed frames from an authenticated peer.
        let good = wire::encode_frame(&DataRequest::Read { shard: 0 }, &[]);
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        let truncated = &good[..good.len() - 1];
        let mut oversized = good.clone();
        oversized[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut unknown = good.clone();
        unknown[12] = 200; // no such DataRequest variant
        let misaligned = wire::encode_frame(
            &DataRequest::Push {
                shard: 0,
                iteration: 0,
                samples: 1,
                based_on: None,
                local_steps: 0,
                codec: syncopate::codec::Codec::None,
                signals: Default::default(),
            },
            &[1, 2, 3],
        );
        for (bytes, expect) in [
            (&bad_magic[..], "not a Syncopate frame"),
            (truncated, "truncated"),
            (&oversized[..], "exceeds the limit"),
            (&unknown[..], "malformed DataRequest header"),
            (&misaligned[..], "not a whole number of f32"),
            (b"\x00".as_slice(), "truncated"),
        ] {
            let reason = send_raw(&ep, &access, server, bytes).await;
            assert!(reason.contains("malformed message") && reason.contains(expect), "{expect}: {reason}");
        }

        // Good peers are still served.
        let (model, _) = op.read_model().await.expect("a good reader is served");
        assert_eq!(model.len(), 64);
    });
    let (status, run) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{}", run.output());
    let expected = -(1.0 + 2.0) * 150.0;
    assert!(run.model().iter().all(|v| *v == expected), "training was not disturbed");
    let logs = run.log("coordinator") + &run.log("server-0");
    assert!(logs.contains("rejected a peer with a wrong token"), "the rejection is logged");
    assert!(logs.contains("closing a connection that sent a bad frame"), "bad frames are logged");
}

/// Large tensors travel in large QUIC packets and arrive bit for bit: MTU discovery grows past
/// Ethernet's 1,472 bytes on loopback, the segmentation-offload batches of such packets are
/// split to what the kernel accepts (before, each batch was dropped whole and every transfer
/// crawled through loss recovery), and a 4 MiB gradient pushed with lr 1 comes back exactly
/// negated, pull after pull, whether pushed by reference (`push`) or handed to QUIC without a
/// copy (`push_buffer`), split over three shards. A coordinator and a server run as processes;
/// the worker is the client library in this process.
#[test]
fn large_tensors_cross_in_large_packets_bit_for_bit() {
    let dir = run_dir("large-tensors");
    std::fs::create_dir_all(&dir).unwrap();
    // Three shards: a whole-model push is cut into slices at offsets no packet size divides.
    let cluster = ProcessCluster::start(&syncopate_bin(), &dir, 1, 3, 1.0, &[]);
    let access = &cluster.access;
    let floats = 1 << 20;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut w = WorkerClient::connect(access, None, floats).await.unwrap();
        w.join(&vec![0.0; floats]).await.unwrap();
        w.ready().await.unwrap();
        // Values repeat only every 65,521 (a prime) positions and are exact in f32, so a byte or
        // a chunk of any power-of-two size out of place shows.
        let grad: Vec<f32> = (0..floats).map(|i| (i % 65_521) as f32 - 30_000.0).collect();
        let mut model = vec![0.0f32; floats];
        for it in 0..6u64 {
            if it % 2 == 0 {
                w.push(it, &grad, 1).await.unwrap();
            } else {
                // The buffer QUIC sends without a copy; a reused one still holds an old gradient.
                let mut buffer = w.gradient_buffer();
                buffer.copy_from_slice(&grad);
                w.push_buffer(it, buffer, 1).await.unwrap();
            }
            w.pull(it + 1, &mut model).await.unwrap();
            let want = |i: usize| -grad[i] * (it + 1) as f32;
            let wrong = (0..floats).filter(|&i| model[i] != want(i)).count();
            assert_eq!(
                wrong,
                0,
                "after push {it}: {wrong} values differ (first at {:?})",
                (0..floats).find(|&i| model[i] != want(i))
            );
        }
        for (server, st) in w.connection_stats() {
            let path = st.path;
            eprintln!(
                "{server}: MTU {} B, lost {} of {} packets",
                path.current_mtu, path.lost_packets, path.sent_packets
            );
            assert!(
                path.current_mtu > 1472,
                "{server}: MTU discovery stopped at {} bytes on loopback",
                path.current_mtu
            );
        }
    });
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shard's refusals reach the worker typed as the shard made them: a gradient with a NaN,
/// an iteration that skips ahead. A worker can tell one from another
/// (the Python package and a driver decide on them), and after each the worker goes on: the
/// connection stays open and a good push is applied once. What a server or the coordinator
/// refuses itself arrives as a code too (protocol 16).
#[test]
fn a_shards_refusals_reach_the_worker_typed() {
    use syncopate::net::NetError;
    use syncopate::shard::{RequestError, ShardError};
    use syncopate::NodeError;

    let dir = run_dir("typed-refusals");
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = ProcessCluster::start(&syncopate_bin(), &dir, 1, 2, 1.0, &[]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut w = WorkerClient::connect(&cluster.access, None, 8).await.unwrap();
        w.join(&[0.0; 8]).await.unwrap();
        w.ready().await.unwrap();
        let refusal = |e: NodeError| match e {
            NodeError::Net(NetError::RefusedByShard { error, .. }) => error,
            other => panic!("expected a shard's typed refusal, got {other:?}"),
        };
        // A NaN in each shard's part (a shard judges its own part: one without would apply it).
        let mut nan = [1.0f32; 8];
        nan[1] = f32::NAN;
        nan[6] = f32::NAN;
        let e = refusal(w.push(0, &nan, 1).await.expect_err("a NaN is refused"));
        assert!(matches!(e, RequestError::Shard(ShardError::NonFinite(_, 0))), "{e}");
        let e = refusal(w.push(5, &[1.0; 8], 1).await.expect_err("skipping ahead is refused"));
        assert!(
            matches!(e, RequestError::Shard(ShardError::OutOfOrder { iteration: 5, expected: 0, .. })),
            "{e}"
        );
        // Nothing of the refused pushes was applied; the good one is, once.
        w.push(0, &[1.0; 8], 1).await.unwrap();
        let mut model = [0.0f32; 8];
        w.pull(1, &mut model).await.unwrap();
        assert_eq!(model, [-1.0; 8]);
        // What the server refuses itself is typed too (protocol 16): a reader's push, and a
        // shard it does not hold (in a cluster without backups, where the shard has no other
        // home; with backups it answers `Unavailable`, and a worker asks where it went).
        let server = w.connection_stats()[0].0;
        let ep =
            net::tls::dial_only(cluster.access.tls.client_config(Duration::from_secs(10)).unwrap(), server)
                .unwrap();
        let (conn, _) =
            net::connect(&ep, server, &cluster.access.tls.server_name, &hello(cluster.access.token.secret()))
                .await
                .unwrap();
        let ask = |req: DataRequest| {
            let conn = conn.clone();
            async move {
                let (r, _) =
                    net::request::<_, DataResponse>(&conn, &req, wire::Payload::EMPTY, &Limits::default())
                        .await
                        .unwrap();
                r
            }
        };
        let push = DataRequest::Push {
            shard: 0,
            iteration: 1,
            samples: 1,
            based_on: None,
            local_steps: 0,
            codec: syncopate::codec::Codec::None,
            signals: Default::default(),
        };
        assert_eq!(ask(push).await, DataResponse::Error(DataError::ReadOnly));
        assert_eq!(
            ask(DataRequest::Pull { shard: 9, iteration: 0 }).await,
            DataResponse::Error(DataError::NotHere { shard: 9, server: 0 })
        );
        // And the worker's pushes still land, once each.
        w.push(1, &[1.0; 8], 1).await.unwrap();
        w.pull(2, &mut model).await.unwrap();
        assert_eq!(model, [-2.0; 8]);
        // The coordinator's refusals are codes as well: a rollback before any swap.
        let operator = Operator::connect(&cluster.access).await.unwrap();
        match operator.rollback().await.expect_err("nothing to roll back") {
            NodeError::Net(NetError::RefusedByCoordinator { error: CoordError::NoSwapYet, .. }) => {}
            other => panic!("expected the coordinator's typed refusal, got {other:?}"),
        }
    });
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_decoder_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = wire::decode_frame::<DataRequest>(&bytes, &Limits::default());
    }

    #[test]
    fn frames_round_trip_and_every_damage_is_an_error(
        shard in any::<u32>(), iteration in any::<u64>(), samples in any::<u32>(),
        values in proptest::collection::vec(any::<f32>(), 0..64),
        cut in any::<prop::sample::Index>(), flip in any::<prop::sample::Index>(),
    ) {
        let signals = syncopate_policy_sdk::abi::Signals {
            loss: Some(iteration as f32 / 3.0),
            norm: None,
            tokens: u64::from(samples) * 64,
            step_ns: iteration,
        };
        let req = DataRequest::Push { shard, iteration, samples, based_on: Some(iteration ^ 7), local_steps: 0, codec: syncopate::codec::Codec::None, signals };
        let frame = wire::encode_frame(&req, wire::f32_bytes(&values));
        let (back, payload) = wire::decode_frame::<DataRequest>(&frame, &Limits::default()).unwrap();
        prop_assert_eq!(back, req);
        prop_assert_eq!(payload, wire::f32_bytes(&values));
        let n = cut.index(frame.len());
        let truncated = wire::decode_frame::<DataRequest>(&frame[..n], &Limits::default());
        prop_assert!(matches!(truncated, Err(WireError::Truncated { .. })), "cut at {}: {:?}", n, truncated);
        let mut damaged = frame.clone();
        let i = flip.index(12);
        damaged[i] ^= 0xff;
        prop_assert!(i == 3 || wire::decode_frame::<DataRequest>(&damaged, &Limits::default()).is_err());
    }
}
