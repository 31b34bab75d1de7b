//! The HTTP endpoint: `/metrics` (Prometheus text), `/health`, and `/stats` (topic and
//! subscription figures as JSON, until the admin API serves them).

use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

use crate::broker::Broker;
pub use crate::http_server::{serve_router, RunningHttp};

/// Seconds after which a gauge nobody set is dropped from /metrics
/// (`broker.metrics_series_idle_s`, given to [`init_metrics`]).
static GAUGE_IDLE_S: OnceLock<u64> = OnceLock::new();

/// Installs the recorder with the configured idle time of gauges (before any other use).
pub fn init_metrics(gauge_idle_s: u64) -> PrometheusHandle {
    let _ = GAUGE_IDLE_S.set(gauge_idle_s);
    metrics_handle()
}

/// The process's Prometheus recorder, installed on first use.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                // From 10 µs: the journal's stages between the fdatasyncs take microseconds.
                .set_buckets(&[
                    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015,
                    0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                ])
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Suffix("_records".to_string()),
                        &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0],
                    )
                })
                .and_then(|b| {
                    // Acknowledgements confirmed by another site: tens of milliseconds.
                    b.set_buckets_for_metric(
                        Matcher::Prefix("meridian_replicated_subscription_sync".to_string()),
                        &[
                            0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                            2.0, 5.0, 10.0,
                        ],
                    )
                })
                .expect("static buckets")
                // Gauges are set at least every stats interval (5 s; a tenant's storage every
                // policy refresh) while their topic, subscription or tenant exists; one not
                // set for longer is of something gone (unloaded, deleted) and leaves /metrics.
                .idle_timeout(
                    metrics_util::MetricKindMask::GAUGE,
                    Some(std::time::Duration::from_secs(
                        GAUGE_IDLE_S.get().copied().unwrap_or(90),
                    )),
                )
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!(
                    "a metrics recorder was already installed; /metrics shows only this one's"
                );
            }
            // Histogram samples wait in the recorder until upkeep folds them into buckets:
            // without it they pile up (one per SEND) whenever nobody scrapes /metrics.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(std::time::Duration::from_secs(5));
                    upkeep.run_upkeep();
                })
                .expect("spawning the metrics upkeep thread");
            handle
        })
        .clone()
}

#[derive(Clone)]
struct Ctx {
    broker: Arc<Broker>,
    metrics: PrometheusHandle,
}

/// With authentication on, pages that name topics (`/metrics`, `/stats`) answer only a
/// superuser's bearer token (Prometheus: `authorization: {credentials: TOKEN}`): topic names
/// are not for every tenant to see. The refusal, if any.
fn superuser_only(c: &Ctx, headers: &axum::http::HeaderMap) -> Option<axum::response::Response> {
    let a = c.broker.auth.as_ref()?;
    let role = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| a.authenticate(t));
    match role {
        Some(Ok(r)) if c.broker.is_superuser(&r) => None,
        Some(Ok(_)) => Some(
            (
                StatusCode::FORBIDDEN,
                "only a superuser may read this page\n",
            )
                .into_response(),
        ),
        _ => Some(
            (
                StatusCode::UNAUTHORIZED,
                "a bearer token of a superuser is required\n",
            )
                .into_response(),
        ),
    }
}

async fn metrics_page(
    State(c): State<Ctx>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    if let Some(refused) = superuser_only(&c, &headers) {
        return refused;
    }
    (
        [("content-type", "text/plain; version=0.0.4")],
        c.metrics.render(),
    )
        .into_response()
}

async fn health(State(c): State<Ctx>) -> impl IntoResponse {
    let body = serde_json::json!({
        "status": if c.broker.is_closing() { "stopping" } else { "ok" },
        "connections": c.broker.connection_count(),
        "topics": c.broker.loaded_topics().len(),
        // Loaded or being loaded: a failed load leaves no entry.
        "topic_entries": c.broker.topics_in_map(),
    });
    let code = if c.broker.is_closing() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
}

/// Every loaded topic's stats, as JSON (`?topic=NAME` for one); superusers only with
/// authentication on.
async fn stats(
    State(c): State<Ctx>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    if let Some(refused) = superuser_only(&c, &headers) {
        return refused;
    }
    let want = q.get("topic").map(|t| {
        crate::topic_name::TopicName::parse(t).map_or_else(|_| t.clone(), |n| n.to_string())
    });
    let mut out = Vec::new();
    for t in c.broker.loaded_topics() {
        if want.as_ref().is_none_or(|w| w == t.full_name()) {
            out.push(t.stats().await);
        }
    }
    out.sort_by(|a, b| a.topic.cmp(&b.topic));
    (
        [("content-type", "application/json")],
        serde_json::to_string(&out).expect("serializable"),
    )
        .into_response()
}

/// The console's page (it reads `/console/data`).
async fn console_page(
    State(c): State<Ctx>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    if let Some(refused) = superuser_only(&c, &headers) {
        return refused;
    }
    (
        [("content-type", "text/html; charset=utf-8")],
        crate::console::PAGE,
    )
        .into_response()
}

/// What the console shows, as JSON; superusers only with authentication on.
async fn console_data(
    State(c): State<Ctx>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    if let Some(refused) = superuser_only(&c, &headers) {
        return refused;
    }
    let d = crate::console::data(&c.broker).await;
    (
        [("content-type", "application/json")],
        serde_json::to_string(&d).expect("serializable"),
    )
        .into_response()
}

pub fn serve(broker: Arc<Broker>, listener: TcpListener) -> std::io::Result<RunningHttp> {
    let max = broker.cfg.http_connections_max as usize;
    let ctx = Ctx {
        broker,
        metrics: metrics_handle(),
    };
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health", get(health))
        .route("/stats", get(stats))
        .route("/console", get(console_page))
        .route("/console/data", get(console_data))
        .with_state(ctx);
    serve_router(app, listener, max, "broker.http_connections_max")
}
