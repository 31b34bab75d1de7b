//! Bookies and the ledger client in one process: an embedded metadata store, bookies on
//! loopback port 0 with real journals, entry logs and RocksDB indexes in temporary directories.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use meridian_storage::bookie;
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions, LedgerError, LedgerState};

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_ensemble_when_a_bookie_stops_mid_stream_then_writes_go_on_and_every_entry_reads_back(
) {
    writes_go_on_when_an_ensemble_bookie_fails(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bookies_serving_in_process_when_one_crashes_mid_stream_then_writes_go_on_and_every_entry_reads_back(
) {
    writes_go_on_when_an_ensemble_bookie_fails(true).await;
}

/// E=3 Qw=2 Qa=2, 3,000 entries (every third one 70 KB, kept by the bookies without a copy),
/// an ensemble bookie failing at entry 1,000: over TCP it stops after the first 1,000 are
/// acknowledged; in-process it crashes with adds in flight.
async fn writes_go_on_when_an_ensemble_bookie_fails(in_process: bool) {
    let (_tmp, store, mut bookies, client) = setup(4).await;
    if in_process {
        for b in &bookies {
            b.running.as_ref().expect("running").serve_in_process();
        }
    }
    step("create E=3 Qw=2 Qa=2; in-process connections only where the bookies serve them");
    let writer = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    let (meta0, _) = client.metadata(id).await.expect("metadata");
    for a in &meta0.fragments[0].ensemble {
        let conn = client.connection(a).await.expect("connection");
        assert_eq!(conn.is_local(), in_process, "{a}");
    }
    step("write 3,000 entries, failing an ensemble bookie at 1,000");
    let victim = meta0.fragments[0].ensemble[1].clone();
    let entry = |i: u64| -> Bytes {
        if i % 3 == 0 {
            Bytes::from(vec![(i % 251) as u8; 70_000 + i as usize])
        } else {
            payload(i)
        }
    };
    let mut acks: Vec<tokio::sync::oneshot::Receiver<Result<u64, LedgerError>>> = Vec::new();
    let mut acked = 0u64;
    for i in 0..3000u64 {
        if i == 1000 {
            let b = bookies
                .iter_mut()
                .find(|b| b.addr == victim)
                .expect("victim");
            if in_process {
                // Adds in flight, but some acknowledged first: a crash before the first
                // acknowledgement (a loaded machine) makes the new ensemble replace the first
                // one from entry 0, and there is no ensemble change to see.
                for rx in acks.drain(..100) {
                    assert_eq!(rx.await.expect("answer").expect("acknowledged"), acked);
                    acked += 1;
                }
                if let Some(s) = b.stop_reg.take() {
                    let _ = s.send(true);
                }
                b.running.take().expect("running").crash().await;
            } else {
                // The first 1,000 are acknowledged; the next ones go to the new ensemble.
                for rx in acks.drain(..) {
                    assert_eq!(rx.await.expect("answer").expect("acknowledged"), acked);
                    acked += 1;
                }
                b.stop(&store.client).await;
            }
        }
        acks.push(writer.add_queued(entry(i)).await);
    }
    for rx in acks {
        assert_eq!(rx.await.expect("answer").expect("acknowledged"), acked);
        acked += 1;
    }
    assert_eq!(writer.close().await.expect("close"), Some(2999));
    step("the metadata records the ensemble change; the failed bookie is unreachable");
    let (meta, _) = client.metadata(id).await.expect("metadata");
    assert_eq!(meta.state, LedgerState::Closed);
    assert_eq!(meta.last_entry, Some(2999));
    assert!(meta.fragments.len() >= 2, "{meta:?}");
    assert!(!meta
        .fragments
        .last()
        .expect("fragment")
        .ensemble
        .contains(&victim));
    assert!(client.connection(&victim).await.is_err());
    step("every acknowledged entry reads back, checksum verified");
    let reader = client.open(id).await.expect("open");
    for i in 0..3000u64 {
        assert_eq!(reader.read(i).await.expect("read"), entry(i), "entry {i}");
    }
    assert!(matches!(
        reader.read(3000).await,
        Err(LedgerError::NoSuchEntry { .. })
    ));
    step("range reads of the striped ledger: entry by entry, at most 64 a call, the same bytes");
    let mut next = 0u64;
    while next < 3000 {
        let got = reader.read_range(next, 3000 - next).await.expect("range");
        assert!((1..=64).contains(&got.len()), "{} from {next}", got.len());
        for bytes in got {
            assert_eq!(bytes, entry(next), "entry {next}");
            next += 1;
        }
    }
    for b in &mut bookies {
        if b.running.is_some() {
            b.stop(&store.client).await;
        }
    }
    store.shutdown().await;
}

/// E=Qw=2: every replica holds every entry, so a range read takes many entries with one
/// request to one replica (the one the first entry's write set starts with); a replica that
/// lost the ledger, or that does not answer, is passed over: the other one is asked for the
/// same range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_replicas_holding_every_entry_then_a_range_read_is_one_request_and_a_replica_without_the_ledger_or_not_answering_is_passed_over(
) {
    let (_tmp, store, mut bookies, client) = setup(2).await;
    step("E=2 Qw=2 Qa=2: 600 entries, closed");
    let writer = client
        .create(2, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    let mut acks = Vec::new();
    for i in 0..600u64 {
        acks.push(writer.add_queued(payload(i)).await);
    }
    for (i, rx) in acks.into_iter().enumerate() {
        assert_eq!(rx.await.expect("answer").expect("acknowledged"), i as u64);
    }
    assert_eq!(writer.close().await.expect("close"), Some(599));
    let reader = client.open(id).await.expect("open");
    step("one call brings all 600, in order");
    let all = reader.read_range(0, 600).await.expect("range");
    assert_eq!(all.len(), 600);
    for (i, bytes) in all.iter().enumerate() {
        assert_eq!(*bytes, payload(i as u64), "entry {i}");
    }
    step("a call from 590 for 100 brings the 10 the closed ledger holds");
    let tail = reader.read_range(590, 100).await.expect("range");
    assert_eq!(tail, (590..600).map(payload).collect::<Vec<_>>());
    step("the replica entry 0's range starts on loses the ledger");
    let (meta, _) = client.metadata(id).await.expect("metadata");
    let first = meta.fragments[0].ensemble[0].clone();
    let conn = client.connection(&first).await.expect("connection");
    let deleted = conn
        .call(
            meridian_storage::proto::Request::Delete { ledger_id: id },
            Duration::from_secs(2),
        )
        .await
        .expect("delete");
    assert!(
        matches!(
            deleted,
            meridian_storage::proto::Response::Delete {
                status: meridian_storage::proto::Status::Ok,
                ..
            }
        ),
        "{deleted:?}"
    );
    step("the same call is answered by the other replica, all 600");
    let again = reader.read_range(0, 600).await.expect("range");
    assert_eq!(again, all);
    step("that replica stops; in its place a listener that takes connections and never answers");
    let at = bookies
        .iter()
        .position(|b| b.addr == first)
        .expect("the replica");
    bookies[at].stop(&store.client).await;
    let hung = std::net::TcpListener::bind(&first).expect("bind the stopped bookie's address");
    let _held = std::thread::spawn(move || {
        // Holds what it accepts, reading nothing, until the test ends.
        let mut conns = Vec::new();
        while let Ok((c, _)) = hung.accept() {
            conns.push(c);
        }
    });
    step("a reader whose requests time out after 30 s: the other replica answers the range after the speculative delay, all 600");
    let patient = LedgerClient::new(
        store.client.clone(),
        LedgerClientOptions {
            request_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    );
    let reader = patient.open(id).await.expect("open");
    let asked = std::time::Instant::now();
    let got = reader.read_range(0, 600).await.expect("range");
    assert_eq!(got, all);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "answered after {:?}: the request to the silent replica was waited out",
        asked.elapsed()
    );
    let silent = patient.connection(&first).await.expect("connection");
    assert_eq!(
        silent.requests_waiting(),
        0,
        "the request to the silent replica was given up, not left waiting"
    );
    step("past the closed ledger's end nothing is read");
    assert!(matches!(
        reader.read_range(600, 10).await,
        Err(LedgerError::NoSuchEntry { entry: 600, .. })
    ));
    for (i, b) in bookies.iter_mut().enumerate() {
        if i != at {
            b.stop(&store.client).await;
        }
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_in_process_adds_over_the_wire_limits_then_they_are_refused_and_the_bookie_stays_writable(
) {
    use meridian_storage::proto::{self, Response, Status};
    let (_tmp, store, mut bookies, client) = setup(1).await;
    bookies[0]
        .running
        .as_ref()
        .expect("running")
        .serve_in_process();
    let conn = client
        .connection(&bookies[0].addr)
        .await
        .expect("connection");
    assert!(conn.is_local());
    let add = |entry: u64, key: Vec<u8>, payload: Bytes| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sealed = proto::seal_parts(77, entry, proto::NONE, payload);
        conn.send_add(
            77,
            entry,
            &key,
            &sealed,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx
    };
    let status = |r: Result<Response, _>| match r.expect("answered") {
        Response::Add { status, .. } => status,
        other => panic!("{other:?}"),
    };
    step("a master key longer than a frame may carry, an entry over bookie.frame_bytes_max");
    let long_key = add(
        0,
        vec![1; proto::MASTER_KEY_BYTES_MAX + 1],
        Bytes::from_static(b"x"),
    );
    assert_eq!(status(long_key.await.expect("reply")), Status::BadRequest);
    let huge = add(0, b"key".to_vec(), Bytes::from(vec![0u8; 6 << 20]));
    assert_eq!(status(huge.await.expect("reply")), Status::BadRequest);
    step("the same add within the limits is journaled, and the bookie takes more");
    let ok = add(0, b"key".to_vec(), Bytes::from(vec![5u8; 100_000]));
    assert_eq!(status(ok.await.expect("reply")), Status::Ok);
    assert!(!bookies[0]
        .running
        .as_ref()
        .expect("running")
        .core
        .is_read_only());
    bookies[0].stop(&store.client).await;
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_abandoned_writer_when_another_client_recovers_then_ledger_closes_after_acked_and_old_writer_is_refused(
) {
    let (_tmp, store, mut bookies, client) = setup(3).await;
    let writer = client
        .create(3, 3, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    for i in 0..200u64 {
        writer.add(payload(i)).await.expect("add");
    }
    step("recover from a second client while the writer still holds the ledger");
    let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
    let reader = other.open_recover(id).await.expect("recover");
    let last = reader.last_entry().expect("entries recovered");
    assert!(
        last >= 199,
        "closed at {last}, before the last acknowledged entry 199"
    );
    for i in 0..=last {
        assert_eq!(reader.read(i).await.expect("read"), payload(i));
    }
    step("the old writer's next add is refused");
    let err = writer.add(payload(999)).await.expect_err("fenced");
    assert!(matches!(err, LedgerError::Fenced(_)), "{err}");
    let (meta, _) = client.metadata(id).await.expect("metadata");
    assert_eq!(meta.state, LedgerState::Closed);
    step("recovering again is a no-op on a closed ledger");
    assert_eq!(
        other.open_recover(id).await.expect("again").last_entry(),
        Some(last)
    );
    step("restart every bookie: the fence is still there for a writer with the old key");
    let key = meta.key_bytes();
    for b in bookies.iter_mut() {
        let (dir, addr) = (b.dir.clone(), b.addr.clone());
        b.stop(&store.client).await;
        *b = start_bookie(&store.client, dir, Some(addr)).await;
    }
    for b in &bookies {
        let conn =
            meridian_storage::client::BookieConn::connect(&b.addr, Duration::from_secs(2), 5 << 20)
                .await
                .expect("connect");
        let entry = last + 1;
        let r = conn
            .call(
                meridian_storage::proto::Request::Add {
                    ledger_id: id,
                    entry_id: entry,
                    flags: 0,
                    master_key: key.clone(),
                    entry: meridian_storage::proto::seal(id, entry, last, b"late"),
                },
                Duration::from_secs(5),
            )
            .await
            .expect("answer");
        assert!(
            matches!(
                r,
                meridian_storage::proto::Response::Add {
                    status: meridian_storage::proto::Status::Fenced,
                    ..
                }
            ),
            "{}: {r:?}",
            b.addr
        );
    }
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

/// Recovery rewrites every entry past the fenced LAC to its whole write set; with Qw = Qa a
/// bookie of that set that is down made the rewrite, and so the recovery, fail until it came
/// back (the fault-schedule runner saw a subscription's cursor ledger, which every load
/// recovers, refuse its consumer for about 19 s after a bookie's kill). Now the bookie is
/// replaced from that entry on, as a writer's ensemble change would, recorded with the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bookie_of_the_last_entrys_write_set_down_then_recovery_replaces_it_and_every_entry_reads_back(
) {
    let (_tmp, store, mut bookies, client) = setup(4).await;
    wait_for_bookies(&client, 4).await;
    let writer = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    for i in 0..100u64 {
        writer.add(payload(i)).await.expect("add");
    }
    let (meta, _) = client.metadata(id).await.expect("metadata");
    let ensemble = meta.fragments.last().expect("fragment").ensemble.clone();
    let q = meta.quorums().expect("quorums");
    let down = ensemble[q.write_set(99).next().expect("write set")].clone();
    step(&format!(
        "bookie {down} of entry 99's write set stops; another client recovers"
    ));
    let b = bookies
        .iter_mut()
        .find(|b| b.addr == down)
        .expect("the bookie");
    b.stop(&store.client).await;
    let other = LedgerClient::new(
        store.client.clone(),
        LedgerClientOptions {
            request_timeout: Duration::from_secs(2),
            ..Default::default()
        },
    );
    let reader = other.open_recover(id).await.expect("recover");
    assert_eq!(reader.last_entry(), Some(99));
    let (meta, _) = client.metadata(id).await.expect("metadata");
    assert_eq!(meta.state, LedgerState::Closed);
    let now = &meta.fragments.last().expect("fragment").ensemble;
    assert!(
        !now.contains(&down),
        "{down} still in the last fragment: {meta:?}"
    );
    step("every entry reads back, from a client that reads the closed ledger's metadata");
    let fresh = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
    let reader = fresh.open(id).await.expect("open");
    for i in 0..100u64 {
        assert_eq!(reader.read(i).await.expect("read"), payload(i), "entry {i}");
    }
    step("the old writer is fenced");
    let err = writer.add(payload(100)).await.expect_err("fenced");
    assert!(matches!(err, LedgerError::Fenced(_)), "{err}");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

/// The same bookie down, but the idle writer moved off it first (a fragment from entry 100,
/// after its LAC): the fenced LAC is 98 (entry 99 carries it), so recovery rewrites entry 99
/// in the earlier fragment, where it was acknowledged before the move; the rewrite cannot
/// reach the bookie, and recovery goes on (before: it failed until the bookie came back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_idle_writer_moved_off_a_bookie_that_is_down_then_recovery_closes_after_its_last_entry(
) {
    let (_tmp, store, mut bookies, client) = setup(4).await;
    wait_for_bookies(&client, 4).await;
    let writer = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    for i in 0..100u64 {
        writer.add(payload(i)).await.expect("add");
    }
    let (meta, _) = client.metadata(id).await.expect("metadata");
    let q = meta.quorums().expect("quorums");
    let down = meta.fragments[0].ensemble[q.write_set(99).next().expect("write set")].clone();
    step(&format!(
        "bookie {down} stops; the idle writer moves off it"
    ));
    bookies
        .iter_mut()
        .find(|b| b.addr == down)
        .expect("the bookie")
        .stop(&store.client)
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (meta, _) = client.metadata(id).await.expect("metadata");
        if meta.fragments.len() > 1 {
            assert_eq!(meta.fragments[1].first_entry, 100, "{meta:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the writer did not move: {meta:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    step("another client recovers: closed at entry 99, every entry reads back");
    let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
    let reader = other.open_recover(id).await.expect("recover");
    assert_eq!(reader.last_entry(), Some(99));
    for i in 0..100u64 {
        assert_eq!(reader.read(i).await.expect("read"), payload(i), "entry {i}");
    }
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

/// A writer that had hundreds of adds on the bookies but none confirmed (its LAC never
/// reached them) leaves them all to recovery. Recovery used to read and rewrite them one at a
/// time, so each rewrite waited for its own journal fdatasync: hundreds of syncs per bookie
/// (the fault-schedule runner saw a log of 734 such entries take over 40 s and be started
/// over). Now a window of entries goes at once and the rewrites share syncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_hundreds_of_entries_past_the_fenced_lac_then_recovery_rewrites_them_together_sharing_journal_syncs(
) {
    use meridian_storage::proto::{self, Request, Response, Status, NONE};
    let (_tmp, store, mut bookies, client) = setup(3).await;
    let writer = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    let (meta, _) = client.metadata(id).await.expect("metadata");
    let q = meta.quorums().expect("quorums");
    let ensemble = meta.fragments[0].ensemble.clone();
    const ENTRIES: u64 = 600;
    step("600 entries reach their write sets, none with a LAC (as if the writer died first)");
    let mut conns = Vec::new();
    for addr in &ensemble {
        conns.push(
            meridian_storage::client::BookieConn::connect(addr, Duration::from_secs(2), 5 << 20)
                .await
                .expect("connect"),
        );
    }
    let adds = (0..ENTRIES).flat_map(|e| {
        let set: Vec<usize> = q.write_set(e).collect();
        let conns = &conns;
        let key = meta.key_bytes();
        set.into_iter().map(move |i| {
            let request = Request::Add {
                ledger_id: id,
                entry_id: e,
                flags: 0,
                master_key: key.clone(),
                entry: proto::seal(id, e, NONE, &payload(e)),
            };
            async move { conns[i].call(request, Duration::from_secs(10)).await }
        })
    });
    for r in futures::future::join_all(adds).await {
        assert!(
            matches!(
                r,
                Ok(Response::Add {
                    status: Status::Ok,
                    ..
                })
            ),
            "{r:?}"
        );
    }
    let syncs = |bookies: &[TestBookie]| -> Vec<(String, u64)> {
        bookies
            .iter()
            .map(|b| {
                let core = &b.running.as_ref().expect("running").core;
                (b.addr.clone(), core.journal_syncs())
            })
            .collect()
    };
    let before = syncs(&bookies);
    step("another client recovers them all");
    let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
    let reader = other.open_recover(id).await.expect("recover");
    assert_eq!(reader.last_entry(), Some(ENTRIES - 1));
    let after = syncs(&bookies);
    for ((addr, b), (_, a)) in before.iter().zip(&after) {
        let i = ensemble
            .iter()
            .position(|x| x == addr)
            .expect("in the ensemble");
        let rewrites = (0..ENTRIES)
            .filter(|&e| q.write_set(e).any(|j| j == i))
            .count() as u64;
        let used = a - b;
        step(&format!(
            "{addr}: {rewrites} rewrites, {used} journal syncs"
        ));
        assert!(
            used * 4 < rewrites,
            "{addr}: {used} journal syncs for {rewrites} rewrites: rewritten one at a time?"
        );
    }
    for e in 0..ENTRIES {
        assert_eq!(reader.read(e).await.expect("read"), payload(e), "entry {e}");
    }
    let err = writer.add(payload(ENTRIES)).await.expect_err("fenced");
    assert!(matches!(err, LedgerError::Fenced(_)), "{err}");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

/// A bookie binds its port before it replays its journal; a connection made meanwhile waited
/// in the listen queue, unanswered, for its client's whole request timeout (5 s: before an
/// add's ensemble change, or at each step of a recovery). Now it is closed at once. The fail
/// point holds the opening 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bookie_still_replaying_its_journal_then_a_request_fails_at_once_and_is_served_after(
) {
    use meridian_storage::client::BookieConn;
    use meridian_storage::proto::{Request, Response};
    let tmp = tempfile::tempdir().expect("tempdir");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let opts = bookie_opts(&tmp.path().join("bookie"));
    meridian_storage::failpoint::arm(&format!(
        "bookie:open_pause_2s:{}",
        opts.journal.dir.display()
    ));
    let starting = tokio::spawn(bookie::start(opts, listener));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let read = Request::Read {
        ledger_id: 1,
        entry_id: 0,
    };
    let asked = std::time::Instant::now();
    let r = match BookieConn::connect(&addr, Duration::from_secs(2), 5 << 20).await {
        Ok(c) => c
            .call(read.clone(), Duration::from_secs(5))
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    let took = asked.elapsed();
    assert!(r.is_err(), "answered while opening");
    assert!(
        took < Duration::from_secs(1),
        "the request waited {took:?} for a bookie still opening"
    );
    assert!(
        !starting.is_finished(),
        "the bookie opened before the request"
    );
    let running = starting.await.expect("task").expect("the bookie starts");
    let c = BookieConn::connect(&addr, Duration::from_secs(2), 5 << 20)
        .await
        .expect("connect");
    let r = c
        .call(read, Duration::from_secs(5))
        .await
        .expect("answered");
    assert!(matches!(r, Response::Read { .. }), "{r:?}");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bookies_restarted_then_entries_survive_and_deleted_ledger_space_is_reclaimed() {
    let (tmp, store, mut bookies, client) = setup(2).await;
    let writer = client
        .create(2, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let id = writer.id();
    for i in 0..500u64 {
        writer.add(payload(i)).await.expect("add");
    }
    writer.close().await.expect("close");
    let doomed = client
        .create(2, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let doomed_id = doomed.id();
    let big = Bytes::from(vec![7u8; 64 << 10]);
    for _ in 0..64 {
        doomed.add(big.clone()).await.expect("add");
    }
    doomed.close().await.expect("close");
    step("restart both bookies on the same directories and addresses");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    let mut restarted = Vec::new();
    for b in &bookies {
        restarted.push(start_bookie(&store.client, b.dir.clone(), Some(b.addr.clone())).await);
    }
    wait_for_bookies(&client, 2).await;
    let reader = client.open(id).await.expect("open");
    for i in 0..500u64 {
        assert_eq!(
            reader.read(i).await.expect("read after restart"),
            payload(i)
        );
    }
    step("delete the 4 MiB ledger; garbage collection removes (or compacts) the files holding it");
    // Entry logs and the journal files kept as the store (`bookie.single_write`).
    let size = |dir: &Path| -> u64 {
        let mut files: Vec<_> = std::fs::read_dir(dir.join("ledgers/entrylogs"))
            .expect("entry logs")
            .collect();
        files.extend(
            std::fs::read_dir(dir.join("journal"))
                .expect("journal")
                .filter(|e| {
                    let name = e.as_ref().expect("entry").file_name();
                    name.to_string_lossy().starts_with("journal-0")
                }),
        );
        files
            .into_iter()
            .map(|e| e.expect("entry").metadata().expect("stat").len())
            .sum()
    };
    // Let the flusher index everything first (the checkpoint passes the files of before the
    // restart).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before: u64 = restarted.iter().map(|b| size(&b.dir)).sum();
    client.delete(doomed_id).await.expect("delete");
    assert!(matches!(
        client.metadata(doomed_id).await,
        Err(LedgerError::NoSuchLedger(_))
    ));
    let mut after = before;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = restarted.iter().map(|b| size(&b.dir)).sum();
        if before - after.min(before) > 6 << 20 {
            break;
        }
    }
    assert!(
        before - after.min(before) > 6 << 20,
        "entry logs and journal files {before} -> {after} bytes"
    );
    step("the other ledger is intact after collection and compaction");
    for i in 0..500u64 {
        assert_eq!(reader.read(i).await.expect("read after gc"), payload(i));
    }
    for b in &mut restarted {
        b.stop(&store.client).await;
    }
    drop(tmp);
    store.shutdown().await;
}

mod managed {
    use super::*;
    use meridian_storage::managed_ledger::{
        ManagedLedger, ManagedLedgerError, ManagedLedgerOptions, Position,
    };

    fn opts() -> ManagedLedgerOptions {
        ManagedLedgerOptions {
            ensemble: 2,
            write_quorum: 2,
            ack_quorum: 2,
            rollover_entries_max: 100,
            tail_cache_bytes_max: 16 << 10,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_roll_over_whose_close_fails_then_the_ledger_is_recorded_closed_and_appends_go_on(
    ) {
        let (tmp, store, mut bookies, client) = setup(1).await;
        let ml = ManagedLedger::open(
            client.clone(),
            "acme/orders/close-fails",
            ManagedLedgerOptions {
                ensemble: 1,
                write_quorum: 1,
                ack_quorum: 1,
                rollover_entries_max: 3,
                rollover_min_age_ms: 0,
                ..Default::default()
            },
        )
        .await
        .expect("open");
        let mut acked = Vec::new();
        for i in 0..2u64 {
            acked.push((ml.append(payload(i)).await.expect("append"), i));
        }
        let first = acked[0].0.ledger_id;
        step("the only bookie stops under a third append, whose failure nobody has seen yet");
        let (first_dir, first_addr) = (bookies[0].dir.clone(), bookies[0].addr.clone());
        bookies[0].stop(&store.client).await;
        let unseen = ml.append_queued(payload(2)).await.expect("queued");
        assert_eq!(unseen.ledger_id(), first);
        // The writer gives up on its own (no bookie to replace the one gone).
        tokio::time::sleep(Duration::from_secs(2)).await;
        step("another bookie: the next append rolls over; closing the failed ledger fails");
        bookies.push(start_bookie(&store.client, tmp.path().join("second"), None).await);
        wait_for_bookies(&client, 1).await;
        let mut next = None;
        for _ in 0..50 {
            match ml.append(payload(3)).await {
                Ok(p) => {
                    next = Some(p);
                    break;
                }
                Err(e) => {
                    println!("retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let next = next.expect("appends go on");
        assert_ne!(next.ledger_id, first, "in the next ledger");
        assert!(unseen.wait().await.is_err(), "the third append failed");
        let ledgers = ml.ledgers().await;
        assert_eq!(
            ledgers[0].entries,
            Some(2),
            "recorded closed at its last add confirmed: {ledgers:?}"
        );
        assert_eq!(ledgers.len(), 2, "{ledgers:?}");
        step("the first bookie back: every acknowledged entry reads, also after opening again");
        bookies[0] = start_bookie(&store.client, first_dir, Some(first_addr)).await;
        drop(ml);
        let ml = ManagedLedger::open(client.clone(), "acme/orders/close-fails", opts())
            .await
            .expect("open again");
        let ledgers = ml.ledgers().await;
        assert_eq!(ledgers[0].entries, Some(2), "{ledgers:?}");
        assert_eq!(ml.size().await.0, 3);
        for (p, i) in &acked {
            assert_eq!(ml.read(*p).await.expect("read"), payload(*i));
        }
        assert_eq!(ml.read(next).await.expect("read"), payload(3));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_the_reply_to_recording_a_new_ledger_is_lost_then_it_is_kept_and_the_log_opens_again(
    ) {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let name = "acme/orders/reply-lost";
        let one_per_ledger = || ManagedLedgerOptions {
            ensemble: 1,
            write_quorum: 1,
            ack_quorum: 1,
            rollover_entries_max: 1,
            rollover_min_age_ms: 0,
            ..Default::default()
        };
        let ml = ManagedLedger::open(client.clone(), name, one_per_ledger())
            .await
            .expect("open");
        let first = ml.append(payload(0)).await.expect("append");
        step("the roll-over records the next ledger, and the store's reply is lost");
        meridian_storage::failpoint::arm(&format!("managed_ledger:reply_lost:{name}"));
        let err = ml.append(payload(1)).await.expect_err("outcome unknown");
        assert!(err.to_string().contains("outcome unknown"), "{err}");
        let ledgers = {
            let kv = store
                .client
                .get(&meridian_storage::managed_ledger::managed_ledger_key(name))
                .await
                .unwrap()
                .expect("the log's record");
            serde_json::from_slice::<serde_json::Value>(&kv.value).unwrap()["ledgers"].clone()
        };
        let named = ledgers[1]["ledger_id"]
            .as_u64()
            .expect("the new ledger is named");
        assert!(
            client.metadata(named).await.is_ok(),
            "ledger {named}, named by the log, was kept"
        );
        step("the log opens again (the new ledger recovered empty), reads and takes appends");
        drop(ml);
        let ml = ManagedLedger::open(client.clone(), name, one_per_ledger())
            .await
            .expect("open again");
        assert_eq!(ml.read(first).await.expect("read"), payload(0));
        let next = ml.append(payload(2)).await.expect("append after");
        assert_eq!(ml.read(next).await.expect("read"), payload(2));
        assert_eq!(ml.size().await.0, 2);
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_appends_in_flight_in_a_ledger_then_more_go_there_only_while_it_stays_open() {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let ml = ManagedLedger::open(
            client.clone(),
            "acme/orders/runs",
            ManagedLedgerOptions {
                ensemble: 1,
                write_quorum: 1,
                ack_quorum: 1,
                rollover_entries_max: 3,
                rollover_min_age_ms: 0,
                ..Default::default()
            },
        )
        .await
        .expect("open");
        let a = ml.append_queued(payload(0)).await.expect("queued");
        let l = a.ledger_id();
        let b = ml.append_queued_in(payload(1), l).await.expect("queued");
        let c = ml.append_queued_in(payload(2), l).await.expect("queued");
        assert!(b.is_some() && c.is_some(), "the ledger of those in flight");
        assert!(
            ml.append_queued_in(payload(3), l)
                .await
                .expect("asked")
                .is_none(),
            "a roll-over is due: not there"
        );
        for p in [Some(a), b, c].into_iter().flatten() {
            p.wait().await.expect("durable");
        }
        let d = ml.append_queued(payload(3)).await.expect("queued");
        let l2 = d.ledger_id();
        assert_ne!(l2, l, "rolled over once those in flight landed");
        d.wait().await.expect("durable");
        step("the only bookie stops: the append in flight fails, and nothing goes to that ledger after it");
        bookies[0].stop(&store.client).await;
        let e = ml
            .append_queued_in(payload(4), l2)
            .await
            .expect("queued")
            .expect("still open");
        assert!(e.wait().await.is_err(), "no bookie");
        assert!(
            ml.append_queued_in(payload(5), l2)
                .await
                .expect("asked")
                .is_none(),
            "a failed ledger takes no more"
        );
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_the_only_bookie_fails_then_appends_fail_and_resume_in_a_new_ledger_when_one_returns(
    ) {
        let (tmp, store, mut bookies, client) = setup(1).await;
        let ml = ManagedLedger::open(
            client.clone(),
            "acme/orders/broken",
            ManagedLedgerOptions {
                ensemble: 1,
                write_quorum: 1,
                ack_quorum: 1,
                ..Default::default()
            },
        )
        .await
        .expect("open");
        let mut acked = Vec::new();
        for i in 0..10u64 {
            acked.push((ml.append(payload(i)).await.expect("append"), i));
        }
        step("the only bookie stops: with no replacement, appends fail (the writer gives up)");
        let first_dir = bookies[0].dir.clone();
        let first_addr = bookies[0].addr.clone();
        bookies[0].stop(&store.client).await;
        let err = ml.append(payload(10)).await.expect_err("no bookie");
        println!("append without a bookie: {err}");
        step("another bookie registers: the next append abandons the failed ledger and goes on");
        bookies.push(start_bookie(&store.client, tmp.path().join("second"), None).await);
        wait_for_bookies(&client, 1).await;
        let mut resumed = None;
        for _ in 0..50 {
            match ml.append(payload(11)).await {
                Ok(p) => {
                    resumed = Some(p);
                    break;
                }
                Err(e) => {
                    println!("retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let resumed = resumed.expect("appends resume");
        let ledgers = ml.ledgers().await;
        assert!(ledgers.len() >= 2, "{ledgers:?}");
        assert_eq!(
            ledgers[0].entries,
            Some(10),
            "closed at the last acknowledged entry"
        );
        assert_ne!(resumed.ledger_id, acked[0].0.ledger_id);
        step("the first bookie comes back: every acknowledged entry reads back");
        bookies[0] = start_bookie(&store.client, first_dir, Some(first_addr)).await;
        for (p, i) in &acked {
            assert_eq!(ml.read(*p).await.expect("read"), payload(*i));
        }
        assert_eq!(ml.read(resumed).await.expect("read"), payload(11));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_too_few_writable_bookies_for_a_new_ledger_then_appends_wait_for_one_within_the_log_s_create_wait(
    ) {
        let (tmp, store, mut bookies, client) = setup(1).await;
        let two = |create_wait_ms| ManagedLedgerOptions {
            ensemble: 2,
            write_quorum: 2,
            ack_quorum: 2,
            create_wait_ms,
            ..Default::default()
        };
        // A fresh log's first append with one bookie registered: how long until it failed.
        let fails_after = |name: &'static str, create_wait_ms| {
            let client = client.clone();
            async move {
                let ml = ManagedLedger::open(client, name, two(create_wait_ms))
                    .await
                    .expect("open");
                let started = std::time::Instant::now();
                let err = ml.append(payload(0)).await.expect_err("one bookie");
                assert!(
                    matches!(
                        err,
                        ManagedLedgerError::Ledger(LedgerError::NotEnoughBookies { .. })
                    ),
                    "{err}"
                );
                (started.elapsed(), ml)
            }
        };
        step("one bookie of the two a ledger needs; no wait: the append fails at once");
        let (took, _) = fails_after("acme/orders/no-wait", 0).await;
        assert!(took < Duration::from_secs(2), "{took:?}");
        step("with a wait of 20 s: the append is queued once a second bookie registers, 1 s on");
        let ml = ManagedLedger::open(client.clone(), "acme/orders/waits", two(20_000))
            .await
            .expect("open");
        let started = std::time::Instant::now();
        let waiting = tokio::spawn({
            let ml = std::sync::Arc::clone(&ml);
            async move { ml.append(payload(1)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "the append waits");
        bookies.push(start_bookie(&store.client, tmp.path().join("second"), None).await);
        let pos = waiting.await.expect("task").expect("appended");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(ml.read(pos).await.expect("read"), payload(1));
        step("a bookie short again, with a wait of 1 s: the append fails after it");
        // (Its registration is gone once `stop` returns.)
        bookies.pop().expect("second").stop(&store.client).await;
        let (took, ml) = fails_after("acme/orders/short-wait", 1_000).await;
        assert!(took >= Duration::from_millis(750), "{took:?}");
        step("the wait is the log's: once it ran out, the next append fails at once");
        let started = std::time::Instant::now();
        ml.append(payload(3)).await.expect_err("still one bookie");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_log_that_needs_a_new_ledger_then_queue_in_open_leaves_it_and_make_writable_makes_it_within_the_wait(
    ) {
        use meridian_storage::managed_ledger::Queued;
        let (tmp, store, mut bookies, client) = setup(1).await;
        let opts = ManagedLedgerOptions {
            ensemble: 2,
            write_quorum: 2,
            ack_quorum: 2,
            create_wait_ms: 20_000,
            ..Default::default()
        };
        let ml = ManagedLedger::open(client.clone(), "acme/orders/ready", opts)
            .await
            .expect("open");
        step("no ledger yet, one bookie of two: queuing into the open ledger does nothing");
        let started = std::time::Instant::now();
        let q = ml.queue_in_open(payload(0), None).await.expect("queue");
        assert!(matches!(q, Queued::NeedsLedger));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(ml.ledgers().await.is_empty(), "a ledger was made");
        step("make_writable waits for a second bookie, then the open ledger takes appends");
        let waiting = tokio::spawn({
            let ml = std::sync::Arc::clone(&ml);
            async move { ml.make_writable(None).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "make_writable waits");
        bookies.push(start_bookie(&store.client, tmp.path().join("second"), None).await);
        assert!(waiting.await.expect("task").expect("made"), "ready");
        let ledgers = ml.ledgers().await;
        assert_eq!(ledgers.len(), 1, "{ledgers:?}");
        let Queued::Appended(pa) = ml.queue_in_open(payload(1), None).await.expect("queue") else {
            panic!("not appended into the ledger just made")
        };
        let pos = pa.wait().await.expect("durable");
        assert_eq!(pos.ledger_id, ledgers[0].ledger_id);
        assert_eq!(ml.read(pos).await.expect("read"), payload(1));
        step("only into another ledger: neither queues nor makes one");
        let other = ledgers[0].ledger_id + 1_000;
        let q = ml
            .queue_in_open(payload(2), Some(other))
            .await
            .expect("queue");
        assert!(matches!(q, Queued::NotThere));
        assert!(!ml.make_writable(Some(other)).await.expect("answer"));
        assert_eq!(ml.ledgers().await.len(), 1);
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_shared_cache_budget_then_tail_caches_together_stay_within_it() {
        use meridian_storage::managed_ledger::CacheBudget;
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let budget = CacheBudget::new(32 << 10);
        let opts = ManagedLedgerOptions {
            tail_cache_bytes_max: 1 << 20,
            tail_cache_budget: Some(std::sync::Arc::clone(&budget)),
            ..Default::default()
        };
        let a = ManagedLedger::open(client.clone(), "acme/cache/a", opts.clone())
            .await
            .expect("open");
        let b = ManagedLedger::open(client.clone(), "acme/cache/b", opts)
            .await
            .expect("open");
        let mut first = Vec::new();
        for i in 0..200u64 {
            let pa = a.append(payload(i)).await.expect("append");
            let pb = b.append(payload(i)).await.expect("append");
            if i == 0 {
                first = vec![pa, pb];
            }
            assert!(
                budget.used() <= (32 << 10) + payload(i).len(),
                "{} bytes cached",
                budget.used()
            );
        }
        assert!(budget.used() > 0, "recent entries are still cached");
        step("evicted entries read from the bookies");
        assert_eq!(a.read(first[0]).await.expect("read"), payload(0));
        assert_eq!(b.read(first[1]).await.expect("read"), payload(0));
        a.close().await.expect("close");
        b.close().await.expect("close");
        drop((a, b));
        assert_eq!(
            budget.used(),
            0,
            "closed and dropped logs give their bytes back"
        );
        for bk in &mut bookies {
            bk.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_appends_past_the_rollover_then_ledgers_chain_and_reads_cross_them_in_order() {
        let (_tmp, store, mut bookies, client) = setup(2).await;
        step("append 250 entries with a roll-over every 100");
        let ml = ManagedLedger::open(client.clone(), "acme/orders/p0", opts())
            .await
            .expect("open");
        let mut positions = Vec::new();
        for i in 0..250u64 {
            positions.push(ml.append(payload(i)).await.expect("append"));
        }
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "positions increase"
        );
        let ledgers = ml.ledgers().await;
        assert_eq!(ledgers.len(), 3, "{ledgers:?}");
        assert_eq!(ledgers[0].entries, Some(100));
        step("with a minimum ledger age, a full ledger is not rolled over before it");
        let young = ManagedLedger::open(
            client.clone(),
            "acme/orders/young",
            ManagedLedgerOptions {
                rollover_min_age_ms: 600_000,
                ..opts()
            },
        )
        .await
        .expect("open");
        for i in 0..250u64 {
            young.append(payload(i)).await.expect("append");
        }
        assert_eq!(young.ledgers().await.len(), 1);
        assert_eq!(ml.last_confirmed(), Some(*positions.last().expect("one")));
        step("read everything back from the first position, across ledger boundaries");
        let first = ml.first_position().await.expect("first");
        assert_eq!(first, positions[0]);
        let all = ml.read_range(first, 1000).await.expect("read range");
        assert_eq!(all.len(), 250);
        for (i, (p, data)) in all.iter().enumerate() {
            assert_eq!(*p, positions[i]);
            assert_eq!(*data, payload(i as u64));
        }
        let missing = Position::new(positions[249].ledger_id, positions[249].entry_id + 1);
        assert!(matches!(
            ml.read(missing).await,
            Err(ManagedLedgerError::NoEntry { .. })
        ));
        step("trim before the third ledger: the first two go; retention keeps them otherwise");
        let keep = ManagedLedger::open(
            client.clone(),
            "acme/orders/p1",
            ManagedLedgerOptions {
                retention_bytes: 1 << 30,
                ..opts()
            },
        )
        .await
        .expect("open p1");
        for i in 0..250u64 {
            keep.append(payload(i)).await.expect("append");
        }
        let third = keep.ledgers().await[2].ledger_id;
        assert!(
            keep.trim(Position::new(third, 0))
                .await
                .expect("trim")
                .is_empty(),
            "retention keeps them"
        );
        step("a reader left in the first ledger goes on from the first entry kept after the trim");
        let mut reader = meridian_storage::cursor::ManagedCursor::non_durable(
            std::sync::Arc::clone(&ml),
            meridian_storage::cursor::InitialPosition::Earliest,
        )
        .await;
        let read = reader.read_entries(10).await.expect("read");
        assert_eq!(read.last().expect("ten").0, positions[9]);
        let deleted = ml.trim(positions[200]).await.expect("trim");
        assert_eq!(deleted, vec![ledgers[0].ledger_id, ledgers[1].ledger_id]);
        let after: Vec<Position> = reader
            .read_entries(1000)
            .await
            .expect("read after the trim")
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(
            after,
            positions[200..].to_vec(),
            "a stalled reader reads nothing"
        );
        assert_eq!(ml.ledgers().await.len(), 1);
        assert!(matches!(
            client.metadata(ledgers[0].ledger_id).await,
            Err(LedgerError::NoSuchLedger(_))
        ));
        assert_eq!(
            ml.read(positions[249]).await.expect("still readable"),
            payload(249)
        );
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_owner_gone_when_a_new_owner_opens_then_last_ledger_is_recovered_and_old_owner_is_fenced(
    ) {
        let (_tmp, store, mut bookies, client) = setup(2).await;
        let old = ManagedLedger::open(client.clone(), "acme/payments/p0", opts())
            .await
            .expect("open");
        let mut positions = Vec::new();
        for i in 0..150u64 {
            positions.push(old.append(payload(i)).await.expect("append"));
        }
        step("a new owner opens it while the old owner's ledger is still open");
        let other_client = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
        let new = ManagedLedger::open(other_client, "acme/payments/p0", opts())
            .await
            .expect("take over");
        let ledgers = new.ledgers().await;
        assert_eq!(
            ledgers[1].entries,
            Some(50),
            "recovered ledger closed at the last acknowledged entry: {ledgers:?}"
        );
        assert_eq!(new.last_confirmed(), Some(positions[149]));
        step("the old owner can append no more");
        let err = old.append(payload(999)).await.expect_err("fenced");
        assert!(matches!(err, ManagedLedgerError::Fenced { .. }), "{err}");
        step("the new owner appends after everything acknowledged before");
        let p = new.append(payload(150)).await.expect("append");
        assert!(p > positions[149]);
        let all = new.read_range(positions[0], 1000).await.expect("read");
        assert_eq!(all.len(), 151);
        assert_eq!(all[150].1, payload(150));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }
}

mod cursors {
    use super::*;
    use meridian_storage::cursor::{InitialPosition, ManagedCursor};
    use meridian_storage::managed_ledger::{ManagedLedger, ManagedLedgerOptions, Position};
    use std::sync::Arc;

    /// A log `name` with three entries, and their positions.
    async fn log_of_three(
        client: &LedgerClient,
        name: &str,
    ) -> (Arc<ManagedLedger>, Vec<Position>) {
        let ml = ManagedLedger::open(client.clone(), name, Default::default())
            .await
            .expect("open");
        let mut pos = Vec::new();
        for i in 0..3u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        (ml, pos)
    }

    /// The cursor under test, `sub-a` from the earliest entry, opened the same way each time.
    async fn open_sub_a(
        client: &LedgerClient,
        ml: &Arc<ManagedLedger>,
    ) -> Result<ManagedCursor, meridian_storage::cursor::CursorError> {
        ManagedCursor::open(
            client.clone(),
            Arc::clone(ml),
            "sub-a",
            InitialPosition::Earliest,
        )
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_few_unacknowledged_entries_around_a_large_acknowledged_range_then_reading_passes_over_the_range(
    ) {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        // No tail cache: every entry read is asked of the bookie.
        let ml = ManagedLedger::open(
            client.clone(),
            "acme/events/gap",
            ManagedLedgerOptions {
                tail_cache_bytes_max: 0,
                ..Default::default()
            },
        )
        .await
        .expect("open");
        let mut pos = Vec::new();
        for i in 0..600u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        let mut c = open_sub_a(&client, &ml).await.expect("cursor");
        step("entries 10-589 acknowledged individually; 0-9 and 590-599 not");
        c.ack_between(Some(pos[9]), pos[590]).await;
        let before = ml.entries_read_from_bookies();
        let read = c.read_entries(100).await.expect("read");
        let got: Vec<Position> = read.iter().map(|(p, _)| *p).collect();
        let want: Vec<Position> = pos[..10].iter().chain(&pos[590..]).copied().collect();
        assert_eq!(got, want);
        let asked = ml.entries_read_from_bookies() - before;
        // Entries 0-9, then 590-599: the range is neither read nor read into. Reading
        // through it asked for all 600.
        assert_eq!(asked, 20, "entries read from the bookie");
        step("another cursor: 10-589 acknowledged, then 0-9: the mark-delete position passes the read position");
        let mut b = ManagedCursor::open(
            client.clone(),
            Arc::clone(&ml),
            "sub-b",
            InitialPosition::Earliest,
        )
        .await
        .expect("cursor");
        b.ack_between(Some(pos[9]), pos[590]).await;
        for p in &pos[..10] {
            b.ack(*p).await.expect("ack");
        }
        let before = ml.entries_read_from_bookies();
        let read = b.read_entries(100).await.expect("read");
        let got: Vec<Position> = read.iter().map(|(p, _)| *p).collect();
        assert_eq!(got, pos[590..].to_vec());
        assert_eq!(ml.entries_read_from_bookies() - before, 10);

        step("a long acknowledged range at the start of the next ledger is not read into either");
        let ml = ManagedLedger::open(
            client.clone(),
            "acme/events/gap-next",
            ManagedLedgerOptions {
                tail_cache_bytes_max: 0,
                rollover_entries_max: 100,
                rollover_min_age_ms: 0,
                ..Default::default()
            },
        )
        .await
        .expect("open");
        let mut pos = Vec::new();
        for i in 0..200u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        assert_ne!(pos[99].ledger_id, pos[100].ledger_id, "rolled over at 100");
        assert_eq!(pos[100].entry_id, 0);
        let mut c = open_sub_a(&client, &ml).await.expect("cursor");
        c.ack_between(None, pos[95]).await;
        c.ack_between(Some(pos[99]), pos[190]).await;
        let before = ml.entries_read_from_bookies();
        let read = c.read_entries(100).await.expect("read");
        let got: Vec<Position> = read.iter().map(|(p, _)| *p).collect();
        let want: Vec<Position> = pos[95..100].iter().chain(&pos[190..]).copied().collect();
        assert_eq!(got, want);
        // 95-99, then 190-199; reading into the range asked for 100 in the first read.
        assert_eq!(ml.entries_read_from_bookies() - before, 15);
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_the_reply_to_recording_a_new_cursor_ledger_is_lost_then_the_cursor_opens_again()
    {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let (ml, pos) = log_of_three(&client, "acme/events/lost").await;
        let open_cursor = || open_sub_a(&client, &ml);
        let mut c = open_cursor().await.expect("cursor");
        step("the first ack starts the cursor's ledger; the store's reply to recording it is lost");
        meridian_storage::failpoint::arm("cursor:reply_lost:acme/events/lost/sub-a");
        let err = c.ack(pos[0]).await.expect_err("outcome unknown");
        assert!(err.to_string().contains("outcome unknown"), "{err}");
        let kv = store
            .client
            .get("/managed-cursors/acme/events/lost/sub-a")
            .await
            .unwrap()
            .expect("recorded");
        let named = serde_json::from_slice::<serde_json::Value>(&kv.value).unwrap()
            ["cursor_ledger"]
            .as_u64()
            .expect("the record names the new ledger");
        assert!(
            client.metadata(named).await.is_ok(),
            "cursor ledger {named}, named by the record, was kept"
        );
        step(
            "the same cursor goes on: its next ack (past the retry interval) finds the kept ledger recorded, and replaces it",
        );
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        c.ack(pos[1]).await.expect("ack after the lost reply");
        assert!(
            client.metadata(named).await.is_err(),
            "the kept ledger {named} was replaced and deleted"
        );
        step("the cursor opens again with that state, and goes on");
        drop(c);
        let mut c = open_cursor().await.expect("the cursor opens again");
        assert_eq!(c.mark_delete(), Some(pos[1]));
        c.ack(pos[2]).await.expect("ack");
        drop(c);
        let c = open_cursor().await.expect("and again");
        assert_eq!(c.mark_delete(), Some(pos[2]));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    /// After a failed persist, changes within the retry interval stay in memory (the flush,
    /// or a change once it has passed, persists them): an acknowledgement of many messages
    /// while the store is out tries once, not once per message. With no persist interval
    /// at all (every change persisted), too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_failed_persist_then_changes_within_the_retry_interval_stay_in_memory_until_the_flush(
    ) {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let (ml, pos) = log_of_three(&client, "acme/events/retry").await;
        let mut c = open_sub_a(&client, &ml).await.expect("cursor");
        meridian_storage::failpoint::arm("cursor:reply_lost:acme/events/retry/sub-a");
        c.ack(pos[0]).await.expect_err("outcome unknown");
        c.ack(pos[1]).await.expect("taken in memory");
        assert!(
            c.is_dirty(),
            "the next change, right after the failure, was not tried"
        );
        c.flush().await.expect("the flush persists");
        assert!(!c.is_dirty());
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        c.ack(pos[2]).await.expect("persisted");
        assert!(!c.is_dirty(), "past the retry interval, a change persists");
        drop(c);
        let c = open_sub_a(&client, &ml).await.expect("opens again");
        assert_eq!(c.mark_delete(), Some(pos[2]));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    /// A cursor closed cleanly (an unload) closes its ledger, so the next opening reads the
    /// last snapshot from any replica. Before, only its state was flushed: the next opening
    /// recovered the ledger, whose rewrite of the last snapshot needs every bookie of its
    /// write set (Qw = Qa), and so failed while one was down (the fault-schedule runner saw a
    /// subscription refused for about 19 s after a bookie's kill).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_cursor_closed_cleanly_then_it_opens_again_while_a_bookie_of_its_ledger_is_down(
    ) {
        let (_tmp, store, mut bookies, client) = setup(2).await;
        wait_for_bookies(&client, 2).await;
        let opts = ManagedLedgerOptions {
            ensemble: 2,
            write_quorum: 2,
            ack_quorum: 2,
            ..Default::default()
        };
        let ml = ManagedLedger::open(client.clone(), "acme/events/closed", opts)
            .await
            .expect("open");
        let mut pos = Vec::new();
        for i in 0..3u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        let mut c = open_sub_a(&client, &ml).await.expect("cursor");
        c.ack(pos[0]).await.expect("ack");
        c.ack(pos[1]).await.expect("ack");
        let ledger = c.cursor_ledger().expect("a cursor ledger");
        step("the cursor is closed cleanly: its ledger is closed, and it takes no more changes");
        c.close().await.expect("close");
        let (meta, _) = client.metadata(ledger).await.expect("metadata");
        assert_eq!(meta.state, LedgerState::Closed, "{meta:?}");
        let err = c.ack(pos[2]).await.expect_err("closed");
        assert!(
            matches!(err, meridian_storage::cursor::CursorError::Closed(_)),
            "{err}"
        );
        assert_eq!(
            c.cursor_ledger(),
            Some(ledger),
            "no ledger of its own started"
        );
        drop(c);
        step("one of the two bookies stops; the cursor opens again with its state");
        bookies[1].stop(&store.client).await;
        let mut c = open_sub_a(&client, &ml)
            .await
            .expect("opens with one bookie of its ledger down");
        assert_eq!(c.mark_delete(), Some(pos[1]));
        step("the bookie is back: the next ack starts a new ledger and the closed one goes");
        let (dir, addr) = (bookies[1].dir.clone(), bookies[1].addr.clone());
        bookies[1] = start_bookie(&store.client, dir, Some(addr)).await;
        wait_for_bookies(&client, 2).await;
        c.ack(pos[2]).await.expect("ack");
        assert_ne!(c.cursor_ledger(), Some(ledger));
        assert!(
            client.metadata(ledger).await.is_err(),
            "the closed ledger {ledger} was replaced and deleted"
        );
        drop(c);
        let c = open_sub_a(&client, &ml).await.expect("and again");
        assert_eq!(c.mark_delete(), Some(pos[2]));
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    /// A cursor whose ledger could not be started (no bookie at its first change) was
    /// silently no longer durable: every later acknowledgement was answered as persisted and
    /// none was, until the topic was loaded again. Now the failure leaves it durable, and the
    /// next change starts its ledger.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_cursor_ledger_that_could_not_be_started_then_the_next_ack_starts_it_and_is_durable(
    ) {
        let (tmp, store, mut bookies, client) = setup(1).await;
        let (ml, pos) = log_of_three(&client, "acme/events/unstarted").await;
        let open_cursor = || open_sub_a(&client, &ml);
        let mut c = open_cursor().await.expect("cursor");
        step("no bookie: the first ack cannot start the cursor's ledger, and says so");
        bookies[0].stop(&store.client).await;
        c.ack(pos[0])
            .await
            .expect_err("no bookie to start the ledger on");
        assert!(
            c.is_dirty(),
            "the state not persisted is still to be persisted"
        );
        c.flush().await.expect_err("still no bookie");
        step("a bookie again: the next ack starts the ledger");
        let mut again = start_bookie(&store.client, tmp.path().join("bookie-again"), None).await;
        wait_for_bookies(&client, 1).await;
        // After a failed persist, a change within 100 ms stays in memory (the retry
        // interval): past it, each of these tries to persist (CI saw one answered from memory).
        let past_retry = || tokio::time::sleep(Duration::from_millis(150));
        past_retry().await;
        c.ack(pos[1]).await.expect("ack");
        step("its bookie goes: an ack fails to be added; with a bookie again, a flush starts a new ledger");
        again.stop(&store.client).await;
        c.ack(pos[2]).await.expect_err("no bookie to add to");
        let mut third = start_bookie(&store.client, tmp.path().join("bookie-third"), None).await;
        wait_for_bookies(&client, 1).await;
        past_retry().await;
        c.flush().await.expect("flush");
        drop(c);
        let c = open_cursor().await.expect("the cursor opens again");
        assert_eq!(c.mark_delete(), Some(pos[2]));
        third.stop(&store.client).await;
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_acks_in_any_order_then_mark_delete_folds_and_state_survives_reopening() {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let opts = ManagedLedgerOptions {
            rollover_entries_max: 100,
            ..Default::default()
        };
        let ml = ManagedLedger::open(client.clone(), "acme/events/p0", opts)
            .await
            .expect("open");
        let mut pos = Vec::new();
        for i in 0..250u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        step("a durable cursor from the earliest entry reads 120 (across a ledger boundary)");
        let mut c = ManagedCursor::open(
            client.clone(),
            Arc::clone(&ml),
            "sub-a",
            InitialPosition::Earliest,
        )
        .await
        .expect("cursor");
        let info = |kv: Option<meridian_metadata::KeyValue>| -> serde_json::Value {
            serde_json::from_slice(&kv.expect("cursor recorded").value).expect("json")
        };
        let key = "/managed-cursors/acme/events/p0/sub-a";
        let recorded = info(store.client.get(key).await.expect("get"));
        assert!(
            recorded["cursor_ledger"].is_null(),
            "no ledger before the first change: {recorded}"
        );
        let read = c.read_entries(120).await.expect("read");
        assert_eq!(read.len(), 120);
        assert_eq!(read[0], (pos[0], payload(0)));
        assert_eq!(read[119].0, pos[119]);
        assert_eq!(c.backlog().await.entries, 250);
        step("acks out of order: 2, 3, then 0 and 1 fold into the mark-delete position");
        for i in [2usize, 3, 7] {
            c.ack(pos[i]).await.expect("ack");
        }
        assert_eq!(c.mark_delete(), None);
        c.ack(pos[0]).await.expect("ack");
        c.ack(pos[1]).await.expect("ack");
        assert_eq!(c.mark_delete(), Some(pos[3]));
        assert_eq!(c.acknowledged_ranges(), vec![(pos[7], pos[7])]);
        let recorded = info(store.client.get(key).await.expect("get"));
        assert!(
            recorded["cursor_ledger"].is_u64(),
            "the first change started the cursor ledger: {recorded}"
        );
        step("a cumulative ack to entry 98, then 99 and 100 individually cross into ledger 2");
        c.ack_cumulative(pos[98]).await.expect("ack");
        c.ack(pos[100]).await.expect("ack");
        c.ack(pos[99]).await.expect("ack");
        assert_eq!(c.mark_delete(), Some(pos[100]));
        c.ack(pos[105]).await.expect("ack");
        let backlog = c.backlog().await;
        assert_eq!(backlog.entries, 250 - 101 - 1);
        assert!(backlog.bytes > 0);
        step("batch-index acks: messages 0 and 3 of the batch in entry 110 acknowledged (bits = left)");
        assert!(!c.ack_batch_index(pos[110], &[0b1110]).await.expect("ack"));
        assert!(!c.ack_batch_index(pos[110], &[0b0111]).await.expect("ack"));
        assert_eq!(c.batch_ack_set(pos[110]), Some(&[0b0110u64][..]));
        assert!(!c.is_acknowledged(pos[110]));
        step(
            "restart the bookie, reopen the cursor from another client: the same state comes back",
        );
        drop(c);
        let (dir, addr) = (bookies[0].dir.clone(), bookies[0].addr.clone());
        bookies[0].stop(&store.client).await;
        bookies[0] = start_bookie(&store.client, dir, Some(addr)).await;
        wait_for_bookies(&client, 1).await;
        let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
        let mut c = ManagedCursor::open(other, Arc::clone(&ml), "sub-a", InitialPosition::Latest)
            .await
            .expect("reopen");
        assert_eq!(c.mark_delete(), Some(pos[100]));
        assert_eq!(c.acknowledged_ranges(), vec![(pos[105], pos[105])]);
        assert_eq!(
            c.batch_ack_set(pos[110]),
            Some(&[0b0110u64][..]),
            "partial batch acks survive reopening"
        );
        assert!(c.ack_batch_index(pos[110], &[0]).await.expect("ack"));
        assert!(c.is_acknowledged(pos[110]));
        assert_eq!(c.batch_ack_set(pos[110]), None);
        let next = c.read_entries(5).await.expect("read");
        let got: Vec<Position> = next.iter().map(|(p, _)| *p).collect();
        assert_eq!(
            got,
            vec![pos[101], pos[102], pos[103], pos[104], pos[106]],
            "acked 105 skipped"
        );
        step("reset to a position, to a publish time, to latest and earliest");
        c.reset_to_position(pos[200]).await.expect("reset");
        assert_eq!(c.read_entries(1).await.expect("read")[0].0, pos[200]);
        // The payload's number stands in for a publish time.
        let time_of = |b: &Bytes| -> u64 {
            std::str::from_utf8(&b[6..14])
                .expect("utf8")
                .parse()
                .expect("number")
        };
        c.reset_to_time(170, time_of).await.expect("reset by time");
        assert_eq!(c.read_entries(1).await.expect("read")[0].0, pos[170]);
        assert_eq!(c.backlog().await.entries, 80);
        c.reset(InitialPosition::Latest).await.expect("latest");
        assert_eq!(c.backlog().await.entries, 0);
        assert!(c.read_entries(10).await.expect("read").is_empty());
        let p = ml.append(payload(250)).await.expect("append");
        assert_eq!(
            c.read_entries(10).await.expect("read"),
            vec![(p, payload(250))]
        );
        c.reset(InitialPosition::Earliest).await.expect("earliest");
        assert_eq!(c.backlog().await.entries, 251);
        step("rate-limited persistence: acks in between are kept by flush");
        c.set_persist_interval(Duration::from_secs(3600));
        c.ack(pos[0])
            .await
            .expect("ack persisted: the first under the limit");
        c.ack(pos[1]).await.expect("ack kept in memory");
        c.flush().await.expect("flush");
        drop(c);
        let again = ManagedCursor::open(
            LedgerClient::new(store.client.clone(), LedgerClientOptions::default()),
            Arc::clone(&ml),
            "sub-a",
            InitialPosition::Latest,
        )
        .await
        .expect("reopen");
        assert_eq!(again.mark_delete(), Some(pos[1]));
        step("a non-durable reader from latest sees only what comes next");
        let mut r = ManagedCursor::non_durable(Arc::clone(&ml), InitialPosition::Latest).await;
        assert!(r.read_entries(10).await.expect("read").is_empty());
        let p = ml.append(payload(251)).await.expect("append");
        assert_eq!(
            r.read_entries(10).await.expect("read"),
            vec![(p, payload(251))]
        );
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_trimmed_log_then_positions_before_it_fold_skipped_ranges_ack_and_seeks_land_right(
    ) {
        let (_tmp, store, mut bookies, client) = setup(1).await;
        let opts = ManagedLedgerOptions {
            rollover_entries_max: 100,
            ..Default::default()
        };
        let ml = ManagedLedger::open(client.clone(), "acme/view/p0", opts)
            .await
            .expect("open");
        let mut pos = Vec::new();
        for i in 0..250u64 {
            pos.push(ml.append(payload(i)).await.expect("append"));
        }
        ml.trim(pos[200]).await.expect("trim");
        assert_eq!(ml.first_position().await, Some(pos[200]));
        step("an acknowledgement of a trimmed position (a compacted view's) moves mark-delete");
        let mut c = ManagedCursor::non_durable(Arc::clone(&ml), InitialPosition::Earliest).await;
        c.ack(pos[50]).await.expect("ack");
        assert_eq!(c.mark_delete(), Some(pos[50]));
        step("entries a compacted view skipped are acknowledged, across a trimmed ledger");
        c.ack_between(Some(pos[50]), pos[210]).await;
        assert_eq!(c.mark_delete(), Some(pos[209]));
        assert_eq!(c.backlog().await.entries, 40);
        c.ack(pos[230]).await.expect("ack");
        c.ack_between(
            Some(pos[230]),
            Position::new(pos[249].ledger_id, pos[249].entry_id + 1),
        )
        .await;
        assert_eq!(
            c.mark_delete(),
            Some(pos[209]),
            "210..=229 are not acknowledged"
        );
        assert_eq!(c.backlog().await.entries, 20);
        c.ack_between(Some(pos[209]), pos[230]).await;
        assert_eq!(c.mark_delete(), Some(pos[249]));
        assert_eq!(c.backlog().await.entries, 0);
        step("a reset to a trimmed position reads from the first entry kept");
        c.reset_to_position(pos[30]).await.expect("reset");
        let read = c.read_entries(5).await.expect("read");
        assert_eq!(read.first().map(|e| e.0), Some(pos[200]));
        assert_eq!(c.backlog().await.entries, 50);
        step("a reset past the end reads what is appended next, and nothing before");
        let beyond = Position::new(pos[249].ledger_id + 7, 3);
        c.reset_to_position(beyond).await.expect("reset");
        assert_eq!(c.mark_delete(), Some(pos[249]));
        assert!(c.read_entries(5).await.expect("read").is_empty());
        let p = ml.append(payload(250)).await.expect("append");
        assert_eq!(
            c.read_entries(5).await.expect("read"),
            vec![(p, payload(250))]
        );
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }
}

mod disk_full {
    use super::*;

    /// Unmounts on drop, so a failing test leaves no mount behind.
    struct Mount(PathBuf);

    impl Drop for Mount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_disk_above_threshold_then_bookie_turns_read_only_and_is_not_chosen() {
        let (tmp, store, mut bookies, client) = setup(0).await;
        step("a bookie whose disk is above bookie.disk_usage_percent_max = 1");
        let b = start_bookie_with(&store.client, tmp.path().join("full"), None, |o| {
            o.disk_usage_percent_max = 1;
        })
        .await;
        bookies.push(b);
        let mut writable = true;
        for _ in 0..100 {
            let infos = client.bookies().await.expect("bookies");
            if infos.len() == 1 && !infos[0].writable {
                writable = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!writable, "registration still says writable");
        let core = &bookies[0].running.as_ref().expect("running").core;
        let reason = core.read_only_reason().expect("read-only");
        assert!(
            reason.contains("bookie.disk_usage_percent_max = 1"),
            "{reason}"
        );
        let err = client
            .create(1, 1, 1, BTreeMap::new())
            .await
            .err()
            .expect("no writable bookie");
        assert!(
            matches!(
                err,
                LedgerError::NotEnoughBookies {
                    needed: 1,
                    available: 0,
                    ..
                }
            ),
            "{err}"
        );
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_bookie_read_only_for_a_full_disk_then_recovery_still_rewrites_and_closes_its_ledger(
    ) {
        let (tmp, store, mut bookies, client) = setup(0).await;
        let dir = tmp.path().join("b");
        bookies.push(start_bookie(&store.client, dir.clone(), None).await);
        wait_for_bookies(&client, 1).await;
        let writer = client
            .create(1, 1, 1, BTreeMap::new())
            .await
            .expect("create");
        let id = writer.id();
        for i in 0..10u64 {
            writer.add(payload(i)).await.expect("add");
        }
        step(
            "the bookie comes back read-only: its disk is above bookie.disk_usage_percent_max = 1",
        );
        let addr = bookies[0].addr.clone();
        bookies[0].stop(&store.client).await;
        bookies[0] = start_bookie_with(&store.client, dir, Some(addr), |o| {
            o.disk_usage_percent_max = 1;
        })
        .await;
        let core = std::sync::Arc::clone(&bookies[0].running.as_ref().expect("running").core);
        for _ in 0..100 {
            if core.is_read_only() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let reason = core.read_only_reason().expect("read-only");
        assert!(reason.contains("disk_usage_percent_max"), "{reason}");
        step(
            "another client recovers the writer's open ledger: the rewrite of its last entry lands",
        );
        let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
        let reader = other.open_recover(id).await.expect("recovered");
        assert_eq!(reader.last_entry(), Some(9));
        for i in 0..10u64 {
            assert_eq!(reader.read(i).await.expect("read"), payload(i));
        }
        let (meta, _) = client.metadata(id).await.expect("metadata");
        assert_eq!(meta.state, LedgerState::Closed);
        step("it takes no other write: no ledger can be made on it");
        for _ in 0..100 {
            let infos = client.bookies().await.expect("bookies");
            if infos.iter().all(|b| !b.writable) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let err = client
            .create(1, 1, 1, BTreeMap::new())
            .await
            .err()
            .expect("no writable bookie");
        assert!(
            matches!(err, LedgerError::NotEnoughBookies { available: 0, .. }),
            "{err}"
        );
        drop(core);
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_journal_disk_fills_then_bookie_turns_read_only_keeps_serving_reads_and_loses_nothing(
    ) {
        if rustix::process::geteuid().as_raw() != 0 {
            eprintln!("skipped: mounting a small tmpfs needs root");
            return;
        }
        let (tmp, store, mut bookies, client) = setup(0).await;
        let small = tmp.path().join("small");
        std::fs::create_dir_all(&small).expect("mkdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
            .arg(&small)
            .status()
            .expect("mount");
        assert!(status.success(), "mount -t tmpfs failed");
        let _mount = Mount(small.clone());
        step("a bookie whose journal sits on a 6 MiB file system");
        let b = start_bookie_with(&store.client, tmp.path().join("b"), None, |o| {
            o.journal.dir = small.join("journal");
            o.journal.preallocate_bytes = 1 << 20;
        })
        .await;
        bookies.push(b);
        wait_for_bookies(&client, 1).await;
        let writer = client
            .create(1, 1, 1, BTreeMap::new())
            .await
            .expect("create");
        let id = writer.id();
        let mut acked = 0u64;
        let mut failure = None;
        for i in 0..20_000u64 {
            match writer.add(Bytes::from(vec![(i % 251) as u8; 1024])).await {
                Ok(e) => acked = e + 1,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let failure = failure.expect("the journal filled up");
        step(&format!("adds stopped after {acked} entries: {failure}"));
        let core = &bookies[0].running.as_ref().expect("running").core;
        let reason = core.read_only_reason().expect("read-only");
        assert!(reason.contains("journal"), "{reason}");
        step("read-only after an error, it takes neither a fence nor a recovery add");
        let other = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
        let err = other
            .open_recover(id)
            .await
            .err()
            .expect("recovery is refused");
        let why = err.to_string();
        assert!(
            why.contains("ReadOnly") || why.contains("could not rewrite"),
            "{why}"
        );
        step("the bookie still serves every acknowledged entry");
        let reader = client.open(id).await.expect("open");
        for e in 0..acked {
            assert_eq!(
                reader.read(e).await.expect("read"),
                Bytes::from(vec![(e % 251) as u8; 1024])
            );
        }
        for b in &mut bookies {
            b.stop(&store.client).await;
        }
        store.shutdown().await;
    }
}

/// Entry `i` of ledger `w` (0, 1, 2) of [`write_three_interleaved`]: 16 KiB.
fn interleaved_blob(w: usize, i: u64) -> Bytes {
    Bytes::from(vec![(w as u8) * 50 + (i % 50) as u8; 16 << 10])
}

/// Three ledgers (E1 Qw1), 150 entries each written in turn, closed: their ids.
async fn write_three_interleaved(client: &LedgerClient) -> Vec<u64> {
    let writers = [
        client.create(1, 1, 1, BTreeMap::new()).await.expect("a"),
        client.create(1, 1, 1, BTreeMap::new()).await.expect("b"),
        client.create(1, 1, 1, BTreeMap::new()).await.expect("c"),
    ];
    for i in 0..150u64 {
        for (w, writer) in writers.iter().enumerate() {
            writer.add(interleaved_blob(w, i)).await.expect("add");
        }
    }
    let ids: Vec<u64> = writers.iter().map(|w| w.id()).collect();
    for w in writers {
        w.close().await.expect("close");
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_entry_logs_mostly_dead_then_compaction_moves_live_entries_and_frees_space() {
    let (tmp, store, mut bookies, client) = setup(0).await;
    // A write cache of six entries: every flush holds a few consecutive entries of each ledger,
    // so each 1 MiB entry log is about one third each (a flush writes its entries sorted by
    // ledger; with large flushes a log could be mostly one ledger and stay live).
    let b = start_bookie_with(&store.client, tmp.path().join("compaction"), None, |o| {
        o.storage.write_cache_bytes_max = 96 << 10;
        // Entries copied into entry logs (BookKeeper's way); the journal-as-store case is
        // the next test.
        o.storage.single_write = false;
    })
    .await;
    bookies.push(b);
    wait_for_bookies(&client, 1).await;
    step("three ledgers written interleaved, so every entry log holds all three");
    let ids = write_three_interleaved(&client).await;
    let logs_dir = bookies[0].dir.join("ledgers/entrylogs");
    // (file name, bytes) of every entry log; names sort by log id, the last is being written.
    let logs = || -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = std::fs::read_dir(&logs_dir)
            .expect("entry logs")
            .map(|e| {
                let e = e.expect("entry");
                let len = e.metadata().expect("stat").len();
                (e.file_name().to_string_lossy().into_owned(), len)
            })
            .collect();
        v.sort();
        v
    };
    let size = || -> u64 { logs().iter().map(|(_, len)| len).sum() };
    // Let the flusher move everything to entry logs.
    let mut before = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        before = size();
        if before >= 3 * 150 * (16 << 10) {
            break;
        }
    }
    assert!(
        before >= 3 * 150 * (16 << 10),
        "entry logs hold {before} bytes"
    );
    let before_logs = logs();
    let current = before_logs.last().expect("an entry log").1;
    step("delete two of them: each log is one third live, under compaction_live_percent_min 50");
    client.delete(ids[0]).await.expect("delete a");
    client.delete(ids[1]).await.expect("delete b");
    // Every log but the one being written is compacted, freeing its two dead thirds; asking
    // for half of those logs' bytes leaves room for uneven thirds.
    let must_free = (before - current) / 2;
    let mut after = before;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = size();
        if before.saturating_sub(after) >= must_free {
            break;
        }
    }
    assert!(
        before.saturating_sub(after) >= must_free,
        "entry logs {before} -> {after} bytes, expected at least {must_free} freed; before: {before_logs:?}; after: {:?}",
        logs()
    );
    step(&format!(
        "entry logs {before} -> {after} bytes (at least {must_free} had to be freed)"
    ));
    step("the live ledger reads back from its new location");
    let reader = client.open(ids[2]).await.expect("open");
    for i in 0..150u64 {
        assert_eq!(
            reader.read(i).await.expect("read"),
            interleaved_blob(2, i),
            "entry {i}"
        );
    }
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

/// `bookie.single_write`: entries stay in the journal files (nothing is copied into entry
/// logs); deleting most of what a journal file holds makes garbage collection move the rest
/// into an entry log and retire the file (the first one becomes the journal's spare, which the
/// next file is made from); everything live reads back, before and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_single_write_then_entries_stay_in_journal_files_until_compaction_moves_the_live_ones(
) {
    let (tmp, store, mut bookies, client) = setup(0).await;
    let dir = tmp.path().join("single");
    let b = start_bookie_with(&store.client, dir.clone(), None, |o| {
        o.journal.file_bytes_max = 1 << 20;
        o.journal.preallocate_bytes = 256 << 10;
        assert!(o.storage.single_write, "the default");
    })
    .await;
    bookies.push(b);
    wait_for_bookies(&client, 1).await;
    step("three ledgers written interleaved across about seven 1 MiB journal files");
    let ids = write_three_interleaved(&client).await;
    let sum = |sub: &str, prefix: &str| -> (usize, u64) {
        let files: Vec<u64> = std::fs::read_dir(dir.join(sub))
            .expect("dir")
            .map(|e| e.expect("entry"))
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .map(|e| e.metadata().expect("stat").len())
            .collect();
        (files.len(), files.iter().sum())
    };
    // Flushes index the entries where the journal wrote them.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (journal_files, journal_before) = sum("journal", "journal-0");
    let (_, logs_before) = sum("ledgers/entrylogs", "entrylog-");
    assert!(journal_files >= 5, "{journal_files} journal files");
    assert!(
        journal_before >= 3 * 150 * (16 << 10),
        "journal files hold {journal_before} bytes"
    );
    assert!(
        logs_before < 64 << 10,
        "nothing is copied into entry logs: they hold {logs_before} bytes"
    );
    step("delete two of the ledgers: each journal file is one third live");
    client.delete(ids[0]).await.expect("delete a");
    client.delete(ids[1]).await.expect("delete b");
    // The files before the current one are compacted (the current one may still be written).
    let must_free = journal_before / 2;
    let must_move = 100 * (16 << 10);
    let mut after = journal_before;
    // Until both: the files are compacted one by one, so half the bytes can be freed before
    // the last of them has moved its live entries (CI saw 1,396,736 bytes moved by then).
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = sum("journal", "journal-0").1;
        if journal_before.saturating_sub(after) >= must_free
            && sum("ledgers/entrylogs", "entrylog-").1 >= must_move
        {
            break;
        }
    }
    assert!(
        journal_before.saturating_sub(after) >= must_free,
        "journal files {journal_before} -> {after} bytes, expected at least {must_free} freed"
    );
    let (_, logs_after) = sum("ledgers/entrylogs", "entrylog-");
    assert!(
        logs_after >= must_move,
        "the live ledger's entries moved into entry logs: {logs_after} bytes"
    );
    step(&format!(
        "journal files {journal_before} -> {after} bytes, entry logs {logs_before} -> {logs_after}"
    ));
    let spare = dir.join("journal/journal-spare.log");
    let spare_len = std::fs::metadata(&spare).map_or(0, |m| m.len());
    assert!(
        spare_len >= 512 << 10,
        "a collected journal file is kept as the spare: {spare_len} bytes"
    );
    step("a fourth ledger fills the current journal file: the next one is the spare");
    let fourth = client.create(1, 1, 1, BTreeMap::new()).await.expect("d");
    for i in 0..100u64 {
        fourth.add(interleaved_blob(3, i)).await.expect("add");
    }
    let fourth_id = fourth.id();
    fourth.close().await.expect("close");
    assert!(!spare.exists(), "the journal took the spare");
    step("the live ledgers read back, and again after a restart");
    let check = |reader: meridian_storage::ledger::LedgerReader, w: usize, n: u64| async move {
        for i in 0..n {
            assert_eq!(
                reader.read(i).await.expect("read"),
                interleaved_blob(w, i),
                "entry {i} of ledger {w}"
            );
        }
    };
    check(client.open(ids[2]).await.expect("open"), 2, 150).await;
    check(client.open(fourth_id).await.expect("open"), 3, 100).await;
    let addr = bookies[0].addr.clone();
    bookies[0].stop(&store.client).await;
    bookies[0] = start_bookie(&store.client, dir.clone(), Some(addr)).await;
    wait_for_bookies(&client, 1).await;
    // After a flush: read through the index, not from what replay put in the write cache.
    tokio::time::sleep(Duration::from_millis(800)).await;
    check(client.open(ids[2]).await.expect("open"), 2, 150).await;
    check(client.open(fourth_id).await.expect("open"), 3, 100).await;
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_malformed_frames_then_only_that_connection_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_tmp, store, mut bookies, client) = setup(1).await;
    let writer = client
        .create(1, 1, 1, BTreeMap::new())
        .await
        .expect("create");
    writer.add(payload(0)).await.expect("add");
    let addr = bookies[0].addr.clone();
    let cases: [(&str, Vec<u8>); 4] = [
        (
            "unknown version",
            vec![0, 0, 0, 10, 9, 1, 0, 0, 0, 0, 0, 0, 0, 1],
        ),
        (
            "unknown op",
            vec![0, 0, 0, 10, 1, 0x33, 0, 0, 0, 0, 0, 0, 0, 1],
        ),
        ("over frame_bytes_max", vec![0x7f, 0xff, 0xff, 0xff, 1, 1]),
        (
            "truncated fields",
            vec![0, 0, 0, 12, 1, 4, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
        ),
    ];
    for (what, bytes) in cases {
        step(&format!(
            "a client sends a frame with {what}: its connection is closed"
        ));
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(&bytes).await.expect("write");
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed in time")
            .unwrap_or(0);
        assert_eq!(n, 0, "{what}: the bookie answered instead of closing");
    }
    step("the other connection and the bookie work on");
    writer.add(payload(1)).await.expect("add after bad clients");
    let reader = client.open(writer.id()).await.expect("open");
    assert_eq!(reader.read(1).await.expect("read"), payload(1));
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_peer_that_takes_none_of_its_responses_then_its_connection_is_given_up_after_the_stall_bound(
) {
    use meridian_storage::proto::{self, Frame, Request};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tmp, store, _none, client) = setup(0).await;
    let mut b = start_bookie_with(&store.client, tmp.path().join("stall"), None, |o| {
        o.write_stall = Duration::from_secs(1);
    })
    .await;
    wait_for_bookies(&client, 1).await;
    let writer = client
        .create(1, 1, 1, BTreeMap::new())
        .await
        .expect("create");
    let big = Bytes::from(vec![7u8; 256 << 10]);
    writer.add(big.clone()).await.expect("add");

    step("a peer asks for 200 reads of a 256 KiB entry (50 MiB) and reads none of it");
    let mut s = tokio::net::TcpStream::connect(&b.addr)
        .await
        .expect("connect");
    let mut out = Vec::new();
    for id in 0..200u64 {
        proto::encode(
            &Frame::Request {
                id,
                request: Request::Read {
                    ledger_id: writer.id(),
                    entry_id: 0,
                },
            },
            &mut out,
        );
    }
    s.write_all(&out).await.expect("write");
    // Past the bound: the bookie's writer has made no progress for a second by then.
    tokio::time::sleep(Duration::from_secs(3)).await;

    step("it reads now: what was in the sockets' buffers, then the end (before: all 50 MiB, then nothing)");
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got += n,
            Err(_) => panic!("the connection is still open, {got} bytes read"),
        }
    }
    assert!(got > 0, "closed before answering anything");
    assert!(got < 200 * (256 << 10), "every response came: {got} bytes");

    step("the bookie serves other connections on");
    writer.add(big.clone()).await.expect("add after");
    let reader = client.open(writer.id()).await.expect("open");
    assert_eq!(reader.read(1).await.expect("read"), big);
    b.stop(&store.client).await;
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_write_cache_smaller_than_the_data_then_adds_wait_for_flushes_and_all_land() {
    let (tmp, store, mut bookies, client) = setup(0).await;
    let b = start_bookie_with(&store.client, tmp.path().join("small-cache"), None, |o| {
        o.storage.write_cache_bytes_max = 1 << 20;
        o.flush_interval_ms = 60_000;
    })
    .await;
    bookies.push(b);
    wait_for_bookies(&client, 1).await;
    step("8 MiB through a 1 MiB write cache");
    let writer = client
        .create(1, 1, 1, BTreeMap::new())
        .await
        .expect("create");
    let blob = |i: u64| Bytes::from(vec![(i % 253) as u8; 8 << 10]);
    let mut acks = Vec::new();
    for i in 0..1024u64 {
        acks.push(writer.add_queued(blob(i)).await);
    }
    for (i, rx) in acks.into_iter().enumerate() {
        assert_eq!(rx.await.expect("answer").expect("acknowledged"), i as u64);
    }
    let cache = bookies[0]
        .running
        .as_ref()
        .expect("running")
        .core
        .storage()
        .write_cache_bytes();
    assert!(cache <= 1 << 20, "write cache holds {cache} bytes");
    let reader = client.open(writer.id()).await.expect("open");
    for i in [0u64, 511, 1023] {
        assert_eq!(reader.read(i).await.expect("read"), blob(i));
    }
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_ledger_deleted_while_a_bookie_was_down_then_its_orphan_copy_is_removed() {
    let (_tmp, store, mut bookies, client) = setup(2).await;
    let writer = client
        .create(2, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    let (doomed, kept) = (
        writer.id(),
        client
            .create(2, 2, 2, BTreeMap::new())
            .await
            .expect("create"),
    );
    writer.add(payload(0)).await.expect("add");
    kept.add(payload(0)).await.expect("add");
    writer.close().await.expect("close");
    step("one bookie is down while the ledger is deleted");
    let (dir, addr) = (bookies[1].dir.clone(), bookies[1].addr.clone());
    bookies[1].stop(&store.client).await;
    client.delete(doomed).await.expect("delete");
    bookies[1] = start_bookie(&store.client, dir, Some(addr)).await;
    let core = std::sync::Arc::clone(&bookies[1].running.as_ref().expect("running").core);
    let has = |id: u64| core.storage().ledgers().iter().any(|(l, _)| *l == id);
    assert!(
        has(doomed),
        "the restarted bookie still has the deleted ledger"
    );
    step("the orphan scan removes it and keeps the live one");
    let deleted = bookie::delete_orphans(&core, &store.client).await;
    assert_eq!(deleted, vec![doomed]);
    assert!(!has(doomed) && has(kept.id()));
    kept.add(payload(1))
        .await
        .expect("the live ledger still takes adds");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}
