//! The HTTP endpoint: `/metrics` (Prometheus text), `/health`, and `/stats` (topic and
//! subscription figures as JSON, until the admin API serves them).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::broker::Broker;

/// The process's Prometheus recorder, installed on first use.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                ])
                .expect("static buckets")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!(
                    "a metrics recorder was already installed; /metrics shows only this one's"
                );
            }
            handle
        })
        .clone()
}

#[derive(Clone)]
struct Ctx {
    broker: Arc<Broker>,
    metrics: PrometheusHandle,
}

async fn metrics_page(State(c): State<Ctx>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        c.metrics.render(),
    )
}

async fn health(State(c): State<Ctx>) -> impl IntoResponse {
    let body = serde_json::json!({
        "status": if c.broker.is_closing() { "stopping" } else { "ok" },
        "connections": c.broker.connection_count(),
        "topics": c.broker.loaded_topics().len(),
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

/// Every loaded topic's stats, as JSON (`?topic=NAME` for one).
async fn stats(
    State(c): State<Ctx>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> impl IntoResponse {
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
}

pub struct RunningHttp {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

pub fn serve(broker: Arc<Broker>, listener: TcpListener) -> std::io::Result<RunningHttp> {
    let addr = listener.local_addr()?;
    let ctx = Ctx {
        broker,
        metrics: metrics_handle(),
    };
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health", get(health))
        .route("/stats", get(stats))
        .with_state(ctx);
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.changed().await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "HTTP server stopped");
        }
    });
    Ok(RunningHttp { addr, stop, task })
}

impl RunningHttp {
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}
