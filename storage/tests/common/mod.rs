//! What the storage tests share: an embedded metadata store and bookies on loopback port 0
//! with real journals, entry logs and RocksDB indexes in temporary directories.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use meridian_metadata::embedded::EmbeddedStore;
use meridian_metadata::MetadataClient;
use meridian_storage::bookie::ledger_storage::StorageOptions;
use meridian_storage::bookie::{self, BookieOptions, RunningBookie};
use meridian_storage::journal::JournalOptions;
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};
use tokio::sync::watch;

pub fn step(s: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,meridian_storage=info".into()),
        )
        .with_test_writer()
        .try_init();
    tracing::info!("--- {s}");
}

pub fn bookie_opts(dir: &Path) -> BookieOptions {
    BookieOptions {
        journal: JournalOptions {
            dir: dir.join("journal"),
            batch_bytes_max: 1 << 20,
            flush_delay_us: 0,
            file_bytes_max: 8 << 20,
            preallocate_bytes: 4 << 20,
            queue_records_max: 10_000,
            fsync: true,
            prefill: true,
            // As with `bookie.single_write` (the default).
            drop_synced_pages: true,
        },
        storage: StorageOptions {
            ledger_dir: dir.join("ledgers"),
            write_cache_bytes_max: 16 << 20,
            read_cache_bytes_max: 4 << 20,
            entry_log_bytes_max: 1 << 20,
            compaction_live_ratio_min: 0.5,
            fsync: true,
            journal_dir: None,
            journal_spare_bytes: None,
            // As `bookie.single_write` (the default): journal files are the store.
            single_write: true,
        },
        flush_interval_ms: 200,
        gc_interval_ms: 200,
        frame_bytes_max: 5 << 20,
        requests_in_flight_max: 10_000,
        write_stall: std::time::Duration::from_secs(30),
        disk_usage_percent_max: 100,
        flusher_io_idle: true,
    }
}

pub struct TestBookie {
    pub dir: PathBuf,
    pub addr: String,
    pub running: Option<RunningBookie>,
    pub stop_reg: Option<watch::Sender<bool>>,
}

pub async fn start_bookie(meta: &MetadataClient, dir: PathBuf, addr: Option<String>) -> TestBookie {
    start_bookie_with(meta, dir, addr, |_| {}).await
}

pub async fn start_bookie_with(
    meta: &MetadataClient,
    dir: PathBuf,
    addr: Option<String>,
    adjust: impl FnOnce(&mut BookieOptions),
) -> TestBookie {
    let listen = addr.clone().unwrap_or_else(|| "127.0.0.1:0".into());
    let listener = tokio::net::TcpListener::bind(&listen).await.expect("bind");
    let mut opts = bookie_opts(&dir);
    adjust(&mut opts);
    let running = bookie::start(opts, listener).await.expect("bookie starts");
    let addr = running.addr.to_string();
    let (stop_reg, stop_rx) = watch::channel(false);
    tokio::spawn(bookie::register(
        std::sync::Arc::clone(&running.core),
        meta.clone(),
        addr.clone(),
        meridian_storage::placement::DEFAULT_RACK.to_string(),
        2_000,
        Duration::from_millis(200),
        stop_rx,
    ));
    TestBookie {
        dir,
        addr,
        running: Some(running),
        stop_reg: Some(stop_reg),
    }
}

impl TestBookie {
    pub async fn stop(&mut self, meta: &MetadataClient) {
        if let Some(s) = self.stop_reg.take() {
            let _ = s.send(true);
        }
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
        // Gone from the registry once its session is closed.
        let key = format!("/bookies/available/{}", self.addr);
        for _ in 0..100 {
            if meta.get(&key).await.expect("get").is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("bookie {} still registered", self.addr);
    }
}

pub async fn wait_for_bookies(client: &LedgerClient, n: usize) {
    for _ in 0..100 {
        if client.bookies().await.expect("bookies").len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fewer than {n} bookies registered");
}

pub fn payload(i: u64) -> Bytes {
    Bytes::from(format!("entry-{i:08}-").repeat(8))
}

pub async fn setup(
    n: usize,
) -> (
    tempfile::TempDir,
    EmbeddedStore,
    Vec<TestBookie>,
    LedgerClient,
) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedStore::start(meridian_config::MetadataConfig {
        listen: "127.0.0.1:0".into(),
        data_dir: tmp.path().join("meta").display().to_string(),
        ..Default::default()
    })
    .await
    .expect("metadata store");
    let mut bookies = Vec::new();
    for i in 0..n {
        bookies
            .push(start_bookie(&store.client, tmp.path().join(format!("bookie{i}")), None).await);
    }
    let client = LedgerClient::new(
        store.client.clone(),
        LedgerClientOptions {
            request_timeout: Duration::from_secs(2),
            ..Default::default()
        },
    );
    wait_for_bookies(&client, n).await;
    (tmp, store, bookies, client)
}
