//! Bookie autorecovery in one process: an embedded metadata store, four bookies on loopback,
//! the auditor and a replication worker (`autorecovery::run`) as brokers run them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use meridian_storage::autorecovery::{self, Options};
use meridian_storage::bookie;
use meridian_storage::ledger::{LedgerClient, LedgerState};
use meridian_storage::proto::{self, Request, Response, Status};
use tokio::sync::watch;

mod common;
use common::*;

fn options(id: &str) -> Options {
    Options {
        id: id.to_string(),
        session_ttl_ms: 2_000,
        lost_grace_ms: 500,
        audit_interval: Duration::from_millis(1_000),
        poll: Duration::from_millis(200),
        window: 16,
    }
}

/// Every entry `0..=last` of ledger `id` is on every bookie of its write set, verified.
async fn assert_fully_replicated(client: &LedgerClient, id: u64, last: u64) {
    let (m, _) = client.metadata(id).await.expect("metadata");
    let q = m.quorums().expect("quorums");
    for entry in 0..=last {
        let frag = m.fragment_of(entry);
        for i in q.write_set(entry) {
            let addr = &frag.ensemble[i];
            let conn = client.connection(addr).await.expect("connect");
            let r = conn
                .call(
                    Request::Read {
                        ledger_id: id,
                        entry_id: entry,
                    },
                    Duration::from_secs(5),
                )
                .await
                .expect("read");
            let Response::Read {
                status: Status::Ok,
                entry: bytes,
                ..
            } = r
            else {
                panic!("ledger {id} entry {entry} missing on {addr}: {r:?}");
            };
            let e = proto::open(&bytes).expect("verifies");
            assert_eq!((e.ledger_id, e.entry_id), (id, entry));
            assert_eq!(
                e.payload,
                payload(entry),
                "ledger {id} entry {entry} on {addr}"
            );
        }
    }
}

async fn names(client: &LedgerClient, id: u64, addr: &str) -> bool {
    let (m, _) = client.metadata(id).await.expect("metadata");
    m.fragments
        .iter()
        .any(|f| f.ensemble.iter().any(|b| b == addr))
}

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_lost_bookie_then_closed_idle_and_busy_ledgers_are_back_to_their_write_quorum() {
    step("4 bookies; E3 Qw2 Qa2: a closed ledger, an idle open one, one being written");
    let (_tmp, store, mut bookies, client) = setup(4).await;
    let closed = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    for i in 0..200 {
        closed.add(payload(i)).await.expect("add");
    }
    let closed_id = closed.id();
    closed.close().await.expect("close");
    let idle = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    for i in 0..100 {
        idle.add(payload(i)).await.expect("add");
    }
    let busy = std::sync::Arc::new(
        client
            .create(3, 2, 2, BTreeMap::new())
            .await
            .expect("create"),
    );
    let (stop_busy, mut busy_stop) = watch::channel(false);
    let writer = {
        let busy = std::sync::Arc::clone(&busy);
        tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                busy.add(payload(n)).await.expect("busy add");
                n += 1;
                tokio::select! {
                    _ = busy_stop.changed() => return n,
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    step("autorecovery runs; a bookie of the closed ledger's ensemble is lost for good");
    let (stop, stop_rx) = watch::channel(false);
    let ar = tokio::spawn(autorecovery::run(client.clone(), options("t"), stop_rx));
    let (cm, _) = client.metadata(closed_id).await.expect("metadata");
    let lost = cm.fragments[0].ensemble[0].clone();
    let idx = bookies.iter().position(|b| b.addr == lost).expect("ours");
    bookies[idx].stop(&store.client).await;

    step("every ledger stops naming it, and no record is left");
    let ids = [closed_id, idle.id(), busy.id()];
    wait_until("re-replication", Duration::from_secs(60), || {
        let client = client.clone();
        let lost = lost.clone();
        async move {
            for id in ids {
                if names(&client, id, &lost).await {
                    return false;
                }
            }
            autorecovery::under_replicated(client.metadata_client())
                .await
                .expect("records")
                .is_empty()
        }
    })
    .await;
    let _ = stop_busy.send(true);
    let written = writer.await.expect("writer");
    assert!(written > 0);

    step("entry by entry, every replica is where the metadata says, verified");
    assert_fully_replicated(&client, closed_id, 199).await;
    assert_fully_replicated(&client, idle.id(), 99).await;
    assert_fully_replicated(&client, busy.id(), written - 1).await;

    step("the writers go on and close over the changed metadata");
    idle.add(payload(100))
        .await
        .expect("idle add after the swap");
    let idle_id = idle.id();
    assert_eq!(idle.close().await.expect("close"), Some(100));
    let busy = std::sync::Arc::try_unwrap(busy).ok().expect("sole owner");
    assert_eq!(busy.close().await.expect("close"), Some(written - 1));
    let (m, _) = client.metadata(idle_id).await.expect("metadata");
    assert_eq!(m.state, LedgerState::Closed);
    assert_fully_replicated(&client, idle_id, 100).await;

    let _ = stop.send(true);
    ar.await.expect("autorecovery ends");
    for b in &mut bookies {
        if b.running.is_some() {
            b.stop(&store.client).await;
        }
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_decommissioned_bookie_then_its_ledgers_move_and_it_empties() {
    let (_tmp, store, mut bookies, client) = setup(4).await;
    let w = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    for i in 0..150 {
        w.add(payload(i)).await.expect("add");
    }
    let id = w.id();
    w.close().await.expect("close");
    let (m, _) = client.metadata(id).await.expect("metadata");
    let target = m.fragments[0].ensemble[1].clone();
    let idx = bookies.iter().position(|b| b.addr == target).expect("ours");

    step("decommission: the bookie turns read-only, its replicas are made elsewhere");
    let (stop, stop_rx) = watch::channel(false);
    let ar = tokio::spawn(autorecovery::run(client.clone(), options("t"), stop_rx));
    autorecovery::decommission(client.metadata_client(), &target)
        .await
        .expect("mark");
    wait_until("the decommission", Duration::from_secs(60), || {
        let client = client.clone();
        let target = target.clone();
        async move {
            autorecovery::ledgers_on(&client, &target)
                .await
                .expect("scan")
                .is_empty()
        }
    })
    .await;
    assert_fully_replicated(&client, id, 149).await;
    let core = std::sync::Arc::clone(&bookies[idx].running.as_ref().expect("running").core);
    step("the bookie sees its mark within its registration refresh: read-only, unwritable");
    wait_until(
        "the bookie's read-only registration",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            let target = target.clone();
            async move {
                client
                    .bookies()
                    .await
                    .expect("bookies")
                    .iter()
                    .any(|b| b.address == target && !b.writable)
            }
        },
    )
    .await;
    assert!(core.is_read_only());
    assert_eq!(core.read_only_reason().as_deref(), Some("decommissioned"));

    step("new ledgers avoid it; its orphan scan deletes what moved away");
    for _ in 0..5 {
        let w = client
            .create(3, 2, 2, BTreeMap::new())
            .await
            .expect("create");
        assert!(!names(&client, w.id(), &target).await);
        w.close().await.expect("close");
    }
    assert!(core.storage().ledgers().iter().any(|(l, _)| *l == id));
    let first = bookie::delete_orphans(&core, client.metadata_client()).await;
    assert!(first.is_empty(), "deleted on the first sight: {first:?}");
    let deleted = bookie::delete_orphans(&core, client.metadata_client()).await;
    assert!(deleted.contains(&id), "{deleted:?}");
    assert!(core.storage().ledgers().is_empty());

    let _ = stop.send(true);
    ar.await.expect("autorecovery ends");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_every_replica_of_some_entries_lost_then_the_ledger_stays_marked_and_unchanged() {
    let (_tmp, store, mut bookies, client) = setup(4).await;
    let w = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    for i in 0..30 {
        w.add(payload(i)).await.expect("add");
    }
    let id = w.id();
    w.close().await.expect("close");
    let (before, _) = client.metadata(id).await.expect("metadata");

    step("two bookies of one write set are lost: entries 0, 3, 6, ... have no replica left");
    let lost: BTreeSet<String> = before.fragments[0].ensemble[..2].iter().cloned().collect();
    for b in bookies.iter_mut().filter(|b| lost.contains(&b.addr)) {
        b.stop(&store.client).await;
    }
    let (stop, stop_rx) = watch::channel(false);
    let ar = tokio::spawn(autorecovery::run(client.clone(), options("t"), stop_rx));
    wait_until("the mark", Duration::from_secs(20), || {
        let client = client.clone();
        async move {
            autorecovery::under_replicated(client.metadata_client())
                .await
                .expect("records")
                .iter()
                .any(|r| r.ledger == id)
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (after, _) = client.metadata(id).await.expect("metadata");
    assert_eq!(
        after.fragments, before.fragments,
        "no ensemble swap without every entry copied"
    );
    let records = autorecovery::under_replicated(client.metadata_client())
        .await
        .expect("records");
    let r = records
        .iter()
        .find(|r| r.ledger == id)
        .expect("still marked");
    assert_eq!(
        r.fragments[0]
            .bookies
            .iter()
            .cloned()
            .collect::<BTreeSet<_>>(),
        lost
    );
    assert!(r.attempts >= 1, "the worker tried: {r:?}");
    assert!(
        r.last_error.contains("no replica gave a verified copy"),
        "{r:?}"
    );
    assert!(r.last_attempt_ms > 0);

    let _ = stop.send(true);
    ar.await.expect("autorecovery ends");
    for b in &mut bookies {
        if b.running.is_some() {
            b.stop(&store.client).await;
        }
    }
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_two_bookies_of_one_ensemble_decommissioned_then_each_slot_gets_its_own_replacement()
{
    let (_tmp, store, mut bookies, client) = setup(5).await;
    let w = client
        .create(3, 2, 2, BTreeMap::new())
        .await
        .expect("create");
    for i in 0..90 {
        w.add(payload(i)).await.expect("add");
    }
    let id = w.id();
    w.close().await.expect("close");
    let (m, _) = client.metadata(id).await.expect("metadata");
    let targets: Vec<String> = m.fragments[0].ensemble[..2].to_vec();

    step("two of the three bookies of the ensemble are decommissioned at once");
    let (stop, stop_rx) = watch::channel(false);
    let ar = tokio::spawn(autorecovery::run(client.clone(), options("t"), stop_rx));
    for t in &targets {
        autorecovery::decommission(client.metadata_client(), t)
            .await
            .expect("mark");
    }
    wait_until("both decommissions", Duration::from_secs(60), || {
        let client = client.clone();
        let targets = targets.clone();
        async move {
            for t in &targets {
                if !autorecovery::ledgers_on(&client, t)
                    .await
                    .expect("scan")
                    .is_empty()
                {
                    return false;
                }
            }
            true
        }
    })
    .await;
    let (after, _) = client.metadata(id).await.expect("metadata");
    let ensemble: BTreeSet<&String> = after.fragments[0].ensemble.iter().collect();
    assert_eq!(ensemble.len(), 3, "one bookie in two slots: {after:?}");
    assert_fully_replicated(&client, id, 89).await;

    let _ = stop.send(true);
    ar.await.expect("autorecovery ends");
    for b in &mut bookies {
        b.stop(&store.client).await;
    }
    store.shutdown().await;
}
