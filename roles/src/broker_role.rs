//! `meridian broker`: a broker process against a site's metadata store and bookies: its
//! listeners, registration, background loops and autorecovery worker, and the graceful
//! hand-over of its bundles on SIGTERM.

use anyhow::Context;
use meridian_config::Config;

use crate::shutdown_signal;

pub(crate) async fn run_broker(cfg: Config) -> anyhow::Result<()> {
    use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};
    meridian_broker::http::init_metrics(cfg.broker.metrics_series_idle_s);
    let tls =
        meridian_broker::tls::site(&cfg.tls, Some(meridian_metadata::tls::ProcessRole::Broker))?;
    let meta = meridian_metadata::MetadataClient::with_tls(&cfg.client, tls.clone())
        .context("client.endpoints")?;
    let client = LedgerClient::new(
        meta.clone(),
        LedgerClientOptions {
            tls,
            ..LedgerClientOptions::default()
        },
    );
    let pl = tokio::net::TcpListener::bind(&cfg.broker.listen)
        .await
        .with_context(|| format!("broker.listen {}", cfg.broker.listen))?;
    let addr = pl.local_addr()?;
    let advertise = if cfg.broker.advertise.is_empty() {
        addr.to_string()
    } else {
        cfg.broker.advertise.clone()
    };
    let (stop_recovery, stop_recovery_rx) = tokio::sync::watch::channel(false);
    let autorecovery = cfg.broker.autorecovery_enabled.then(|| {
        tokio::spawn(meridian_storage::autorecovery::run(
            client.clone(),
            meridian_storage::autorecovery::Options::from_config(
                &cfg.bookie,
                format!("broker {advertise}"),
                cfg.broker.session_ttl_ms,
            ),
            stop_recovery_rx,
        ))
    });
    let broker = meridian_broker::broker::Broker::new(
        cfg.broker.clone(),
        meta,
        client,
        format!("pulsar://{advertise}"),
    )?;
    let geo = meridian_broker::geo::start_link(&cfg.geo, &broker).await?;
    let al = tokio::net::TcpListener::bind(&cfg.broker.admin_listen)
        .await
        .with_context(|| format!("broker.admin_listen {}", cfg.broker.admin_listen))?;
    let admin =
        meridian_broker::admin::start(&broker, al, &meridian_broker::geo::geo_url(geo.as_ref()))
            .await?;
    let hl = tokio::net::TcpListener::bind(&cfg.broker.http_listen)
        .await
        .with_context(|| format!("broker.http_listen {}", cfg.broker.http_listen))?;
    let http = meridian_broker::http::serve(std::sync::Arc::clone(&broker), hl)?;
    let tls_server = meridian_broker::tls::start(&broker).await?;
    let scheme = if cfg.broker.admin_tls {
        "https"
    } else {
        "http"
    };
    broker.announce(
        &format!("http://{}", http.addr),
        &format!("{scheme}://{}", admin.addr),
    );
    broker.register().await.context("registering the broker")?;
    let server = meridian_broker::server::serve(std::sync::Arc::clone(&broker), pl)?;
    let ownership = tokio::spawn(std::sync::Arc::clone(&broker).ownership_loop());
    let stats =
        tokio::spawn(std::sync::Arc::clone(&broker).stats_loop(std::time::Duration::from_secs(5)));
    let policies = tokio::spawn(std::sync::Arc::clone(&broker).policy_loop());
    let tls = tls_server
        .as_ref()
        .map(|t| format!(" and pulsar+ssl://{}", t.addr))
        .unwrap_or_default();
    let geo_note = meridian_broker::geo::banner(geo.as_ref(), &cfg.broker.cluster_name);
    println!(
        "meridian broker: Pulsar protocol on pulsar://{addr}{tls}, HTTP on http://{} (/metrics, /health), admin API on {}://{}{geo_note}; metadata {}",
        http.addr,
        if cfg.broker.admin_tls { "https" } else { "http" },
        admin.addr,
        cfg.client.endpoints.join(",")
    );
    shutdown_signal().await;
    tracing::info!("signal received; stopping");
    // Clients move to other brokers bundle by bundle before the listener closes.
    broker.hand_over().await;
    if let Some(g) = &geo {
        g.shutdown().await;
    }
    server.shutdown().await;
    if let Some(t) = tls_server {
        t.shutdown().await;
    }
    admin.stop().await;
    broker.close().await;
    http.shutdown().await;
    stats.abort();
    policies.abort();
    ownership.abort();
    let _ = stop_recovery.send(true);
    if let Some(a) = autorecovery {
        // A copy in progress is not waited for (the ledger stays marked and locked until
        // this session ends; another worker takes it then).
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), a).await;
    }
    Ok(())
}
