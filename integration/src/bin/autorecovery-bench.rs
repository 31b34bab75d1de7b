//! Re-replication rate after a bookie loss, against the disk's limit measured in the same run.
//!
//! An embedded metadata store and 4 bookies (in this process, over TCP on loopback, real
//! journals with fsync, entry logs and indexes) in DIR; LEDGERS closed ledgers of MIB MiB each
//! (64 KiB entries, E3 Qw2 Qa2); one bookie is stopped for good, and autorecovery (the auditor
//! and one worker, grace 0) makes its replicas again. Prints the bytes it had to copy, the time
//! from the stop until no ledger names the lost bookie, the rate, and the disk's own
//! 1 MiB write + fdatasync bandwidth in DIR (fio's `--rw=write --bs=1M --fdatasync=1`, done
//! here) beside it.
//!
//! `cargo run --release -p meridian-integration --bin autorecovery-bench -- [DIR] [LEDGERS] [MIB]`
//! (defaults: $TMPDIR, 8, 64).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use meridian_metadata::embedded::EmbeddedStore;
use meridian_storage::autorecovery::{self, Options};
use meridian_storage::bookie::{self, BookieOptions};
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};
use tokio::sync::watch;

const ENTRY: usize = 64 << 10;

/// MB/s of 1 MiB writes each followed by fdatasync, `mib` MiB, in `dir`.
fn disk_limit(dir: &Path, mib: usize) -> anyhow::Result<f64> {
    let path = dir.join("disk-probe");
    let mut f = std::fs::File::create(&path)?;
    let block = vec![0x5au8; 1 << 20];
    let t = Instant::now();
    for _ in 0..mib {
        f.write_all(&block)?;
        f.sync_data()?;
    }
    let secs = t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(mib as f64 * 1.048_576 / secs)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let base = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let ledgers: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(8);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let tmp = tempfile::tempdir_in(&base)?;
    let before = disk_limit(tmp.path(), 256)?;
    println!(
        "disk: 1 MiB write + fdatasync in {}: {before:.0} MB/s",
        base.display()
    );

    let store = EmbeddedStore::start(meridian_config::MetadataConfig {
        listen: "127.0.0.1:0".into(),
        data_dir: tmp.path().join("meta").display().to_string(),
        ..Default::default()
    })
    .await
    .map_err(anyhow::Error::msg)?;
    let mut bookies = Vec::new();
    for i in 0..4 {
        let dir = tmp.path().join(format!("bookie{i}"));
        let cfg = meridian_config::BookieConfig {
            journal_dir: dir.join("journal").display().to_string(),
            ledger_dir: dir.join("ledgers").display().to_string(),
            ..Default::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let running = bookie::start(BookieOptions::from_config(&cfg), listener).await?;
        let addr = running.addr.to_string();
        let (stop, stop_rx) = watch::channel(false);
        let reg = tokio::spawn(bookie::register(
            std::sync::Arc::clone(&running.core),
            store.client.clone(),
            addr.clone(),
            meridian_storage::placement::DEFAULT_RACK.to_string(),
            2_000,
            Duration::from_millis(500),
            stop_rx,
        ));
        bookies.push((addr, Some(running), stop, reg));
    }
    let client = LedgerClient::new(store.client.clone(), LedgerClientOptions::default());
    while client.bookies().await?.len() < 4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let entries = (mib << 20) / ENTRY;
    println!("writing {ledgers} ledgers of {mib} MiB ({entries} entries of 64 KiB), E3 Qw2 Qa2");
    let payload = Bytes::from(vec![0xa5u8; ENTRY]);
    let t = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..ledgers {
        let w = client.create(3, 2, 2, BTreeMap::new()).await?;
        let mut pending = Vec::new();
        for _ in 0..entries {
            pending.push(w.add_queued(payload.clone()).await);
        }
        for p in pending {
            p.await??;
        }
        ids.push(w.id());
        w.close().await?;
    }
    println!(
        "written in {:.1} s ({:.0} MB/s of payload)",
        t.elapsed().as_secs_f64(),
        (ledgers * mib) as f64 * 1.048_576 / t.elapsed().as_secs_f64()
    );

    // The bookie named most: its share is what autorecovery copies.
    let mut share: BTreeMap<String, u64> = BTreeMap::new();
    for id in &ids {
        let (m, _) = client.metadata(*id).await?;
        let q = m.quorums()?;
        for e in 0..entries as u64 {
            for i in q.write_set(e) {
                *share
                    .entry(m.fragment_of(e).ensemble[i].clone())
                    .or_default() += ENTRY as u64;
            }
        }
    }
    // The disk as it is now, after the writes (a virtual disk may be slower under sustained
    // load than fresh).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let loaded = disk_limit(tmp.path(), 256)?;
    println!("disk right before the loss: {loaded:.0} MB/s");
    let (lost, bytes) = share
        .iter()
        .max_by_key(|(_, b)| **b)
        .map(|(a, b)| (a.clone(), *b))
        .expect("a bookie");
    let k = bookies.iter().position(|b| b.0 == lost).expect("ours");
    let (_, running, stop, reg) = &mut bookies[k];
    let _ = stop.send(true);
    let _ = reg.await;
    if let Some(r) = running.take() {
        r.shutdown().await;
    }
    let key = format!("/bookies/available/{lost}");
    while store.client.get(&key).await?.is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    println!(
        "bookie {lost} lost; it held {:.0} MiB of replicas",
        bytes as f64 / 1048576.0
    );
    let t = Instant::now();
    let (stop_ar, stop_rx) = watch::channel(false);
    let ar = tokio::spawn(autorecovery::run(
        client.clone(),
        Options {
            id: "bench".into(),
            session_ttl_ms: 5_000,
            lost_grace_ms: 0,
            audit_interval: Duration::from_secs(10),
            poll: Duration::from_millis(100),
            window: std::env::var("WINDOW")
                .ok()
                .and_then(|w| w.parse().ok())
                .unwrap_or(64),
        },
        stop_rx,
    ));
    let gone: BTreeSet<String> = [lost.clone()].into();
    loop {
        let mut naming = 0;
        for id in &ids {
            let (m, _) = client.metadata(*id).await?;
            if m.fragments
                .iter()
                .any(|f| f.ensemble.iter().any(|b| gone.contains(b)))
            {
                naming += 1;
            }
        }
        if naming == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let rate = bytes as f64 / 1e6 / secs;
    let _ = stop_ar.send(true);
    let _ = ar.await;
    for (_, running, stop, reg) in &mut bookies {
        if let Some(r) = running.take() {
            let _ = stop.send(true);
            let _ = reg.await;
            r.shutdown().await;
        }
    }
    // Once the bookies are stopped (their flushers no longer write).
    let after = disk_limit(tmp.path(), 256)?;
    println!(
        "re-replicated {:.0} MiB in {secs:.2} s: {rate:.0} MB/s; disk 1 MiB+fdatasync: {before:.0} MB/s fresh, {loaded:.0} right before, {after:.0} right after: {:.0}% of fresh, {:.0}% of the mean of before and after",
        bytes as f64 / 1048576.0,
        100.0 * rate / before,
        100.0 * rate / ((loaded + after) / 2.0)
    );
    store.shutdown().await;
    Ok(())
}
