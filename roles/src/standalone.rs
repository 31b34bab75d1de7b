//! `meridian standalone`: a single-node metadata store, a bookie and a broker in one process,
//! on one data directory, through the same code paths as a cluster (the store and the bookie
//! listen on loopback ports of their own and are reached over their protocols).
//!
//! ```text
//!  DATA_DIR/
//!    metadata/            Raft log and state (RocksDB)
//!    bookie/journal/      journal files
//!    bookie/ledgers/      entry logs and index
//!    addresses.json       the store's and the bookie's ports: the bookie's address is its
//!                         identity in ledger metadata, so a restart must reuse it
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use meridian_config::Config;
use meridian_metadata::embedded::EmbeddedStore;
use meridian_storage::bookie::{self, BookieOptions, RunningBookie};
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use meridian_broker::broker::Broker;
use meridian_broker::http::RunningHttp;
use meridian_broker::server::RunningServer;

#[derive(Debug, Serialize, Deserialize)]
struct Addresses {
    metadata: String,
    bookie: String,
}

pub struct Standalone {
    pub broker: Arc<Broker>,
    pub pulsar_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The Pulsar protocol over TLS, when `broker.tls_cert_file` is set.
    pub pulsar_tls_addr: Option<SocketAddr>,
    /// The geo link, when `geo.listen` is set.
    pub geo: Option<Arc<meridian_geo::GeoLink>>,
    pub data_dir: PathBuf,
    server: RunningServer,
    tls_server: Option<RunningServer>,
    admin: meridian_tenancy::service::RunningAdmin,
    http: RunningHttp,
    bookie: RunningBookie,
    store: EmbeddedStore,
    stop_bg: watch::Sender<bool>,
    background: Vec<JoinHandle<()>>,
}

async fn bind(addr: &str, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("{what}: cannot listen on {addr}"))
}

impl Standalone {
    /// Starts everything and returns once the broker accepts clients.
    pub async fn start(cfg: &Config) -> anyhow::Result<Standalone> {
        let data_dir = PathBuf::from(&cfg.standalone.data_dir);
        meridian_metadata::durable_dir::create_dir_all_synced(&data_dir)
            .with_context(|| format!("standalone.data_dir {}", data_dir.display()))?;
        let addr_file = data_dir.join("addresses.json");
        let previous: Option<Addresses> = match std::fs::read(&addr_file) {
            Ok(b) => Some(serde_json::from_slice(&b).with_context(|| {
                format!(
                    "{} is not valid; it records the ports of this data directory",
                    addr_file.display()
                )
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| addr_file.display().to_string()),
        };

        // Metadata store (one node).
        let mut mcfg = cfg.metadata.clone();
        mcfg.data_dir = data_dir.join("metadata").display().to_string();
        mcfg.listen = previous
            .as_ref()
            .map_or_else(|| "127.0.0.1:0".to_string(), |a| a.metadata.clone());
        // TLS between roles only when `[tls]` is set: then the store's and the bookie's ports
        // take only the site's certificates, as a cluster's do. Plaintext on loopback otherwise.
        let tls = meridian_broker::tls::site(&cfg.tls, None)?;
        let store = EmbeddedStore::start_with_tls(mcfg, tls.clone())
            .await
            .map_err(|e| anyhow::anyhow!("embedded metadata store: {e}"))?;
        let meta_addr = store.node.addr.to_string();

        // Bookie.
        let mut bcfg = cfg.bookie.clone();
        bcfg.journal_dir = data_dir.join("bookie/journal").display().to_string();
        bcfg.ledger_dir = data_dir.join("bookie/ledgers").display().to_string();
        let bookie_listen = previous
            .as_ref()
            .map_or_else(|| "127.0.0.1:0".to_string(), |a| a.bookie.clone());
        let bl = bind(&bookie_listen, "embedded bookie").await?;
        let bookie = bookie::start_with_tls(BookieOptions::from_config(&bcfg), tls.clone(), bl)
            .await
            .context("embedded bookie")?;
        // The broker below writes to this bookie through the same ledger client as to any
        // other, but in-process: no socket, no frames, no kernel copies.
        bookie.serve_in_process();
        let bookie_addr = bookie.addr.to_string();
        if previous.is_none() {
            let a = Addresses {
                metadata: meta_addr.clone(),
                bookie: bookie_addr.clone(),
            };
            write_atomically(&addr_file, &serde_json::to_vec_pretty(&a)?)?;
        }
        let (stop_bg, stop_rx) = watch::channel(false);
        let mut background = vec![
            tokio::spawn(bookie::register(
                Arc::clone(&bookie.core),
                store.client.clone(),
                bookie_addr.clone(),
                bcfg.rack.clone(),
                bcfg.session_ttl_ms,
                Duration::from_millis((bcfg.session_ttl_ms / 3).max(500)),
                stop_rx.clone(),
            )),
            tokio::spawn(bookie::orphan_scanner(
                Arc::clone(&bookie.core),
                store.client.clone(),
                Duration::from_millis(bcfg.gc_interval_ms),
                stop_rx.clone(),
            )),
        ];
        let client = LedgerClient::new(
            store.client.clone(),
            LedgerClientOptions {
                tls,
                ..LedgerClientOptions::default()
            },
        );
        wait_for_bookie(&client, &bookie_addr).await?;

        // Broker.
        let pl = bind(&cfg.broker.listen, "broker.listen").await?;
        let pulsar_addr = pl.local_addr()?;
        let advertise = if cfg.broker.advertise.is_empty() {
            pulsar_addr.to_string()
        } else {
            cfg.broker.advertise.clone()
        };
        let broker = Broker::new(
            cfg.broker.clone(),
            store.client.clone(),
            client,
            format!("pulsar://{advertise}"),
        )?;
        let geo = meridian_broker::geo::start_link(&cfg.geo, &broker).await?;
        let al = bind(&cfg.broker.admin_listen, "broker.admin_listen").await?;
        let admin = meridian_broker::admin::start(
            &broker,
            al,
            &meridian_broker::geo::geo_url(geo.as_ref()),
        )
        .await?;
        let hl = bind(&cfg.broker.http_listen, "broker.http_listen").await?;
        let http = meridian_broker::http::serve(Arc::clone(&broker), hl)?;
        let tls_server = meridian_broker::tls::start(&broker).await?;
        broker.announce(
            &format!("http://{}", http.addr),
            &format!("http://{}", admin.addr),
        );
        broker.ownership.set_sole();
        broker.register().await.context("registering the broker")?;
        let server = meridian_broker::server::serve(Arc::clone(&broker), pl)?;
        background.push(tokio::spawn(Arc::clone(&broker).ownership_loop()));
        background.push(tokio::spawn(
            Arc::clone(&broker).stats_loop(Duration::from_secs(5)),
        ));
        background.push(tokio::spawn(Arc::clone(&broker).policy_loop()));
        Ok(Standalone {
            broker,
            pulsar_addr,
            http_addr: http.addr,
            admin_addr: admin.addr,
            pulsar_tls_addr: tls_server.as_ref().map(|t| t.addr),
            geo,
            data_dir,
            server,
            tls_server,
            admin,
            http,
            bookie,
            store,
            stop_bg,
            background,
        })
    }

    /// Stops accepting, finishes in-flight writes, persists cursors, closes ledgers, then
    /// stops the bookie and the store.
    pub async fn shutdown(self) {
        let started = Instant::now();
        if let Some(g) = &self.geo {
            g.shutdown().await;
        }
        self.server.shutdown().await;
        if let Some(t) = self.tls_server {
            t.shutdown().await;
        }
        self.admin.stop().await;
        self.broker.close().await;
        self.http.shutdown().await;
        let _ = self.stop_bg.send(true);
        for t in self.background {
            t.abort();
            let _ = t.await;
        }
        self.bookie.shutdown().await;
        self.store.shutdown().await;
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "standalone stopped"
        );
    }
}

async fn wait_for_bookie(client: &LedgerClient, addr: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match client.bookies().await {
            Ok(b) if b.iter().any(|b| b.address == addr && b.writable) => return Ok(()),
            Ok(_) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Ok(_) => bail!("the embedded bookie {addr} did not register as writable within 15 s"),
            Err(e) => bail!("the embedded bookie {addr} did not register: {e}"),
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).with_context(|| tmp.display().to_string())?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}
