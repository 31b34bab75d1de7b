//! Metadata nodes inside the test process (real RocksDB, real gRPC on loopback port 0): the
//! client API, snapshots and log compaction, watch history, restarts.

use std::time::{Duration, Instant};

use meridian_config::{ClientConfig, MetadataConfig};
use meridian_metadata::client::PutOptions;
use meridian_metadata::embedded::EmbeddedStore;
use meridian_metadata::model::EventKind;
use meridian_metadata::node::{MetadataNode, RunningNode};
use meridian_metadata::pb;
use meridian_metadata::{ClientError, MetadataClient};

fn config(dir: &std::path::Path, id: u64) -> MetadataConfig {
    MetadataConfig {
        node_id: id,
        listen: "127.0.0.1:0".into(),
        data_dir: dir.join(format!("n{id}")).display().to_string(),
        ..MetadataConfig::default()
    }
}

async fn start_plain(cfg: &MetadataConfig) -> RunningNode {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    MetadataNode::start(cfg, listener).await.unwrap()
}

fn put_op(key: &str, value: &str) -> pb::Op {
    pb::Op {
        op: Some(pb::op::Op::Put(pb::PutOp {
            key: key.into(),
            value: value.into(),
            session: 0,
            sequential: false,
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_store_then_cas_txn_listing_and_sequential_keys_work() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::start(config(dir.path(), 1)).await.unwrap();
    let c = &store.client;

    let v1 = c.create("/t/a", "1").await.unwrap();
    let err = c.create("/t/a", "2").await.unwrap_err();
    assert!(
        matches!(err, ClientError::Conflict { current, .. } if current == v1),
        "{err}"
    );
    let opts = PutOptions {
        expected_version: Some(v1),
        ..Default::default()
    };
    let v2 = c.put_with("/t/a", "2", opts.clone()).await.unwrap().version;
    assert!(v2 > v1);
    // The same expected version again is stale now.
    assert!(matches!(
        c.put_with("/t/a", "3", opts).await,
        Err(ClientError::Conflict { .. })
    ));

    // All or nothing: one failed condition, the failure branch runs instead.
    let resp = c
        .txn(pb::TxnRequest {
            conditions: vec![
                pb::Condition {
                    key: "/t/a".into(),
                    expected_version: v2,
                },
                pb::Condition {
                    key: "/t/b".into(),
                    expected_version: 5,
                },
            ],
            success: vec![put_op("/t/a", "S"), put_op("/t/b", "S")],
            failure: vec![put_op("/t/failed", "F")],
        })
        .await
        .unwrap();
    assert!(!resp.succeeded);
    assert_eq!(
        resp.current[1].expected_version, 0,
        "reports /t/b as absent"
    );
    assert_eq!(c.get("/t/a").await.unwrap().unwrap().value, b"2");
    assert!(c.get("/t/b").await.unwrap().is_none());
    assert!(c.get("/t/failed").await.unwrap().is_some());

    for i in 0..25 {
        c.put(&format!("/t/list/{i:02}"), "v").await.unwrap();
    }
    let mut after = String::new();
    let mut all = Vec::new();
    loop {
        let page = c.list("/t/list/", &after, 10).await.unwrap();
        all.extend(page.kvs.iter().map(|kv| kv.key.clone()));
        after = page.kvs.last().unwrap().key.clone();
        if !page.more {
            break;
        }
    }
    let expected: Vec<String> = (0..25).map(|i| format!("/t/list/{i:02}")).collect();
    assert_eq!(all, expected);
    let children = c.children("/t", "", 0).await.unwrap().children;
    assert_eq!(children, ["a", "failed", "list"]);

    let seq = PutOptions {
        sequential: true,
        ..Default::default()
    };
    let a = c.put_with("/ids/l-", "", seq.clone()).await.unwrap().key;
    let b = c.put_with("/ids/l-", "", seq).await.unwrap().key;
    assert!(
        a < b && a.len() == b.len() && a.starts_with("/ids/l-"),
        "{a} {b}"
    );

    // Limits are refused with the key's name and change nothing.
    let big = vec![0u8; 1_048_577];
    let err = c.put("/t/big", big).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::InvalidArgument(m) if m.contains("metadata.value_bytes_max")),
        "{err}"
    );
    assert!(c.get("/t/big").await.unwrap().is_none());
    let err = c.session(10).await.unwrap_err();
    assert!(
        err.to_string().contains("ttl_ms 10 is out of range"),
        "{err}"
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_watch_from_old_revision_then_history_then_live_events_arrive_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::start(config(dir.path(), 1)).await.unwrap();
    let c = &store.client;
    let first = c.put("/w/1", "a").await.unwrap();
    c.put("/other", "x").await.unwrap();
    c.put("/w/2", "b").await.unwrap();

    let mut w = c.watch("/w/", true, first).await.unwrap();
    c.put("/w/3", "c").await.unwrap();
    c.txn(pb::TxnRequest {
        conditions: vec![],
        success: vec![pb::Op {
            op: Some(pb::op::Op::Delete(pb::DeleteOp {
                key: "/w/".into(),
                prefix: true,
            })),
        }],
        failure: vec![],
    })
    .await
    .unwrap();
    let mut got = Vec::new();
    while got.len() < 6 {
        let batch = tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .expect("events in time")
            .unwrap()
            .unwrap();
        got.extend(batch);
    }
    let summary: Vec<(EventKind, String)> =
        got.iter().map(|e| (e.kind, e.kv.key.clone())).collect();
    assert_eq!(
        summary,
        vec![
            (EventKind::Put, "/w/1".into()),
            (EventKind::Put, "/w/2".into()),
            (EventKind::Put, "/w/3".into()),
            (EventKind::Delete, "/w/1".into()),
            (EventKind::Delete, "/w/2".into()),
            (EventKind::Delete, "/w/3".into()),
        ]
    );
    // One prefix delete is one revision.
    assert_eq!(got[3].revision, got[5].revision);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), w.next())
            .await
            .is_err(),
        "no extra events"
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_restart_then_keys_revisions_and_sessions_survive() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let store = EmbeddedStore::start(cfg.clone()).await.unwrap();
    let v = store.client.put("/r/k", "before").await.unwrap();
    let session = store.client.session(60_000).await.unwrap();
    let sid = session.id;
    store
        .client
        .put_with(
            "/r/eph",
            "e",
            PutOptions {
                session: sid,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    drop(session);
    store.shutdown().await;

    let store = EmbeddedStore::start(cfg).await.unwrap();
    let kv = store.client.get("/r/k").await.unwrap().unwrap();
    assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"before"[..], v));
    // The session survived the restart (a new leader gives it a full TTL).
    assert!(store.client.keep_alive(sid).await.is_ok());
    assert_eq!(store.client.close_session(sid).await.unwrap(), 1);
    assert!(store.client.get("/r/eph").await.unwrap().is_none());
    let v2 = store.client.put("/r/k", "after").await.unwrap();
    assert!(v2 > v, "revisions continue after a restart");
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_purged_log_when_node_restarts_then_it_starts_and_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 1);
    cfg.snapshot_every_entries = 100;
    cfg.log_entries_kept_after_snapshot = 10;
    let store = EmbeddedStore::start(cfg.clone()).await.unwrap();
    for i in 0..350 {
        store
            .client
            .put(&format!("/p/{i:03}"), format!("v{i}"))
            .await
            .unwrap();
    }
    let raft = store.node.core.raft.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = raft.metrics().borrow().clone();
        if m.purged.is_some_and(|p| p.index >= 200) {
            break;
        }
        assert!(Instant::now() < deadline, "no purge: {m:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    store.shutdown().await;
    // Start again on the purged log: the purge point must read back as written.
    let store = EmbeddedStore::start(cfg)
        .await
        .expect("restart after a log purge");
    assert_eq!(
        store.client.get("/p/349").await.unwrap().unwrap().value,
        b"v349"
    );
    store.client.put("/p/after", "x").await.unwrap();
    let purged = store.node.core.raft.metrics().borrow().purged;
    assert!(
        purged.is_some_and(|p| p.index >= 200 && p.index < 1_000),
        "{purged:?}"
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_compacted_log_when_node_joins_then_it_catches_up_by_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg1 = config(dir.path(), 1);
    cfg1.snapshot_every_entries = 100;
    cfg1.log_entries_kept_after_snapshot = 0;
    let store = EmbeddedStore::start(cfg1).await.unwrap();
    let c = store.client.clone();
    for i in 0..300 {
        c.put(&format!("/s/{i:03}"), format!("v{i}")).await.unwrap();
    }
    let raft = store.node.core.raft.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = raft.metrics().borrow().clone();
        if m.purged.is_some_and(|p| p.index >= 100) && m.snapshot.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "no snapshot/purge: {m:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let cfg2 = config(dir.path(), 2);
    let node2 = start_plain(&cfg2).await;
    c.add_member(2, &node2.addr.to_string(), false)
        .await
        .unwrap();
    let shared = node2.core.shared.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared.state.read().unwrap().kv.kvs.len() < 300 {
        assert!(Instant::now() < deadline, "node 2 did not catch up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    {
        let st = shared.state.read().unwrap();
        assert_eq!(st.kv.kvs["/s/299"].value, b"v299");
        assert!(st.history_floor > 1, "node 2 started from a snapshot");
    }

    // Node 2 has no history before its snapshot; a watch from revision 1 moves to node 1.
    let only2 = MetadataClient::new(&ClientConfig {
        endpoints: vec![node2.addr.to_string()],
        ..ClientConfig::default()
    })
    .unwrap();
    let err = only2.watch("/s/", true, 1).await.expect_err("compacted");
    assert!(matches!(err, ClientError::Compacted(_)), "{err}");
    let both = MetadataClient::new(&ClientConfig {
        endpoints: vec![node2.addr.to_string(), store.node.addr.to_string()],
        ..ClientConfig::default()
    })
    .unwrap();
    let mut w = both.watch("/s/", true, 1).await.unwrap();
    let mut n = 0;
    while n < 300 {
        n += w.next().await.unwrap().unwrap().len();
    }
    assert_eq!(n, 300);
    node2.shutdown().await;
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bounded_history_when_exceeded_then_old_revisions_are_refused_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 1);
    cfg.watch_history_events = 1_000;
    let store = EmbeddedStore::start(cfg).await.unwrap();
    let c = &store.client;
    for i in 0..1_200 {
        c.put(&format!("/h/{}", i % 10), "v").await.unwrap();
    }
    let err = c.watch("/h/", true, 1).await.expect_err("compacted");
    assert!(
        matches!(&err, ClientError::Compacted(m) if m.contains("oldest revision")),
        "{err}"
    );
    // Recent history is still there.
    let mut w = c.watch("/h/", true, 1_100).await.unwrap();
    let batch = w.next().await.unwrap().unwrap();
    assert_eq!(batch[0].revision, 1_100);
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_malformed_raft_payloads_then_they_are_refused_and_the_node_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::start(config(dir.path(), 1)).await.unwrap();
    let mut raft = pb::raft_client::RaftClient::connect(format!("http://{}", store.node.addr))
        .await
        .unwrap();
    // Garbage, an empty payload, and a length prefix claiming ~2^62 entries.
    let mut forged = vec![0u8; 16];
    forged.extend_from_slice(&(1u64 << 62).to_le_bytes());
    for data in [vec![0xFF; 64], Vec::new(), forged] {
        let status = raft
            .append_entries(pb::RaftPayload { data: data.clone() })
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
        let status = raft
            .vote(pb::RaftPayload { data: data.clone() })
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
        // On the AppendEntries stream: the stream ends with the refusal.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut answers = raft
            .append_entries_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        tx.send(pb::RaftPayload { data }).await.unwrap();
        let status = answers.message().await.expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    }
    // Still serving.
    store.client.put("/after", "ok").await.unwrap();
    assert!(store.client.get("/after").await.unwrap().is_some());
    store.shutdown().await;
}

/// A leader keeps its AppendEntries stream to a follower open; a stopping node must end it
/// rather than wait for it (a graceful server shutdown waits for open streams, up to the grace
/// period, 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_open_append_entries_stream_when_the_node_stops_then_the_stream_ends() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::start(config(dir.path(), 1)).await.unwrap();
    let mut raft = pb::raft_client::RaftClient::connect(format!("http://{}", store.node.addr))
        .await
        .unwrap();
    let (_requests, rx) = tokio::sync::mpsc::channel::<pb::RaftPayload>(1);
    let mut answers = raft
        .append_entries_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let stopping = tokio::spawn(store.shutdown());
    // Well inside the grace period: the node ended the stream, it was not cut at the end.
    // (No request was sent, so the stream can only end, with or without an error status.)
    let _ended = tokio::time::timeout(Duration::from_secs(2), answers.message())
        .await
        .expect("the stream ends when the node stops");
    stopping.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_watcher_that_falls_behind_then_it_resumes_from_history_without_gaps() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 1);
    cfg.watch_buffer_batches = 16;
    let store = EmbeddedStore::start(cfg).await.unwrap();
    let c = &store.client;
    let mut w = c.watch("/lag/", true, 0).await.unwrap();
    // Far more applied batches than every buffer between the node and this reader holds
    // (16 notices, the HTTP/2 windows and send buffer, the client's queue: large values fill
    // them fast), while nobody reads: the server-side watch lags, ends its stream, and the
    // client resumes from the node's history.
    let n = 1_000u64;
    let value = vec![b'v'; 10_000];
    for i in 0..n {
        c.put(&format!("/lag/{i:05}"), value.clone()).await.unwrap();
    }
    let mut got = Vec::new();
    while (got.len() as u64) < n {
        let batch = tokio::time::timeout(Duration::from_secs(20), w.next())
            .await
            .expect("events in time")
            .unwrap()
            .unwrap();
        got.extend(batch);
    }
    assert_eq!(got.len() as u64, n, "no duplicates");
    assert!(got.windows(2).all(|p| p[0].revision < p[1].revision));
    let keys: Vec<String> = got.iter().map(|e| e.kv.key.clone()).collect();
    let expected: Vec<String> = (0..n).map(|i| format!("/lag/{i:05}")).collect();
    assert_eq!(keys, expected);
    store.shutdown().await;
}
