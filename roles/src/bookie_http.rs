//! `meridian bookie`'s HTTP endpoint (`bookie.http_listen`): `/metrics` (Prometheus text: the
//! journal's write and fdatasync latency and batch sizes, entry-log flushes) and
//! `/health` (writable, or read-only and why). Nothing here names a tenant's topic, so unlike
//! the broker's pages it needs no token.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use meridian_storage::bookie::BookieCore;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

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

pub struct BookieHttp {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Serves the pages on `listener` until [`BookieHttp::shutdown`].
pub fn serve(
    core: Arc<BookieCore>,
    metrics: PrometheusHandle,
    listener: TcpListener,
) -> std::io::Result<BookieHttp> {
    let addr = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health", get(health))
        .with_state(Ctx { core, metrics });
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.changed().await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "bookie HTTP server stopped");
        }
    });
    Ok(BookieHttp { addr, stop, task })
}

impl BookieHttp {
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}
