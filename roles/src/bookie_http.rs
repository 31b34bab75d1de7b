//! `meridian bookie`'s HTTP endpoint (`bookie.http_listen`): `/metrics` (Prometheus text: the
//! journal's write and fdatasync latency and batch sizes, entry-log flushes) and
//! `/health` (writable, or read-only and why). Nothing here names a tenant's topic, so unlike
//! the broker's pages it needs no token.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use meridian_broker::http::RunningHttp;
use meridian_storage::bookie::BookieCore;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

#[derive(Clone)]
struct Ctx {
    core: Arc<BookieCore>,
    metrics: PrometheusHandle,
}

async fn metrics_page(State(c): State<Ctx>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        c.metrics.render(),
    )
}

async fn health(State(c): State<Ctx>) -> impl IntoResponse {
    let (free, used_pct) = c.core.disk_usage();
    let body = match c.core.read_only_reason() {
        None => {
            serde_json::json!({"status": "ok", "disk_free_bytes": free, "disk_used_percent": used_pct})
        }
        Some(why) => serde_json::json!({"status": "read-only", "reason": why,
            "disk_free_bytes": free, "disk_used_percent": used_pct}),
    };
    // A read-only bookie still serves reads: it is up, not healthy for writers.
    let code = if c.core.is_read_only() {
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

/// Serves the pages on `listener` until the returned server's `shutdown`.
pub fn serve(
    core: Arc<BookieCore>,
    metrics: PrometheusHandle,
    listener: TcpListener,
    connections_max: usize,
) -> std::io::Result<RunningHttp> {
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health", get(health))
        .with_state(Ctx { core, metrics });
    meridian_broker::http::serve_router(
        app,
        listener,
        connections_max,
        "bookie.http_connections_max",
    )
}
