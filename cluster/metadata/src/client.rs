//! The Rust client of the metadata store.
//!
//! - An endpoint list; the client prefers the leader it discovers and moves to the next endpoint
//!   when one fails.
//! - Retries with exponential back-off, only where a retry cannot do a write twice: reads always
//!   retry on transport errors; writes retry only when the server said it did nothing
//!   (`x-meridian-not-executed`) or the connection was never made. Otherwise a write whose outcome
//!   is unknown fails with [`ClientError::Indeterminate`].
//! - A deadline on every call (`client.request_timeout_ms`), covering all its retries.
//! - Watches resume after a broken stream from the revision after the last one delivered, so
//!   the caller sees no missed and no repeated events.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use meridian_config::ClientConfig;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::model::{Event, EventKind, KeyValue};
use crate::node::NOT_EXECUTED;
use crate::pb::{self, metadata_client::MetadataClient as PbClient};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No node could serve the call before its deadline. Nothing was done (or, for reads, it
    /// does not matter).
    #[error("metadata store unavailable after {attempts} attempt(s) in {elapsed_ms} ms: {last}")]
    Unavailable {
        attempts: u32,
        elapsed_ms: u64,
        last: String,
    },
    /// A write may or may not have been applied (the connection broke after sending it).
    #[error("outcome unknown (the write may have been applied): {0}")]
    Indeterminate(String),
    /// Compare-and-set failed.
    #[error("version conflict on {key}: expected version {expected}, current version {current}")]
    Conflict {
        key: String,
        expected: u64,
        current: u64,
    },
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// A watch asked for revisions no node still has.
    #[error("{0}")]
    Compacted(String),
    /// The store refused this process (TLS between roles: its certificate's role may not do
    /// this). Retrying will not help.
    #[error("refused by the metadata store: {0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Other(String),
}

impl ClientError {
    /// Whether a write that failed with this was certainly not applied (a version conflict,
    /// a store that did nothing, a refused request); `false` when it may have been (the reply
    /// was lost, or the error says nothing of it).
    pub fn write_not_applied(&self) -> bool {
        matches!(
            self,
            ClientError::Conflict { .. }
                | ClientError::Unavailable { .. }
                | ClientError::InvalidArgument(_)
                | ClientError::FailedPrecondition(_)
                | ClientError::PermissionDenied(_)
        )
    }
}

/// Options of a put.
#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    /// Compare-and-set: the key's current version must be this (0: the key must be absent).
    pub expected_version: Option<u64>,
    /// Bind the key to a session: it disappears when the session ends.
    pub session: u64,
    /// Append a monotonic 20-digit suffix to the key.
    pub sequential: bool,
}

/// The outcome of a successful put.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutResult {
    /// The key written (with its suffix if sequential).
    pub key: String,
    pub version: u64,
}

/// One page of a listing.
#[derive(Clone, Debug, Default)]
pub struct ListPage {
    pub kvs: Vec<KeyValue>,
    pub children: Vec<String>,
    pub more: bool,
    pub revision: u64,
}

struct Inner {
    endpoints: Vec<String>,
    clients: Vec<PbClient<Channel>>,
    current: AtomicUsize,
    request_timeout: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
}

/// A cheap-to-clone handle to the metadata store.
#[derive(Clone)]
pub struct MetadataClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MetadataClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataClient")
            .field("endpoints", &self.inner.endpoints)
            .finish()
    }
}

fn kv_from_pb(kv: pb::KeyValue) -> KeyValue {
    KeyValue {
        key: kv.key,
        value: kv.value,
        mod_revision: kv.version,
        create_revision: kv.create_revision,
        session: kv.session,
    }
}

fn event_from_pb(ev: pb::Event) -> Event {
    Event {
        revision: ev.revision,
        kind: if ev.kind == pb::event::Kind::Delete as i32 {
            EventKind::Delete
        } else {
            EventKind::Put
        },
        kv: kv_from_pb(ev.kv.unwrap_or_default()),
    }
}

/// What a failed attempt means for the next one.
enum Verdict {
    /// Return this error now.
    Fail(ClientError),
    /// Nothing was executed: retry (elsewhere).
    Retry(String),
    /// Maybe executed: retry only if the call is idempotent.
    Ambiguous(String),
}

fn classify(status: &tonic::Status) -> Verdict {
    use tonic::Code;
    let msg = status.message().to_string();
    match status.code() {
        Code::InvalidArgument => Verdict::Fail(ClientError::InvalidArgument(msg)),
        Code::FailedPrecondition | Code::AlreadyExists | Code::NotFound => {
            Verdict::Fail(ClientError::FailedPrecondition(msg))
        }
        Code::OutOfRange => Verdict::Fail(ClientError::Compacted(msg)),
        Code::PermissionDenied | Code::Unauthenticated => {
            Verdict::Fail(ClientError::PermissionDenied(msg))
        }
        Code::Unavailable if status.metadata().contains_key(NOT_EXECUTED) => Verdict::Retry(msg),
        _ => {
            let detail = format!("{status:?}");
            // The request never left: the connection could not be made.
            if detail.contains("tcp connect error")
                || detail.contains("Connection refused")
                || detail.contains("error trying to connect")
            {
                Verdict::Retry(format!("{}: {msg}", status.code()))
            } else {
                Verdict::Ambiguous(format!("{}: {msg}", status.code()))
            }
        }
    }
}

impl MetadataClient {
    /// A client of the nodes in `cfg.endpoints`. Connections are made on first use.
    pub fn new(cfg: &ClientConfig) -> Result<Self, ClientError> {
        Self::with_tls(cfg, None)
    }

    /// As [`MetadataClient::new`], over TLS presenting this process's certificate when `tls`
    /// is given (`[tls]`; see [`crate::tls`]).
    pub fn with_tls(
        cfg: &ClientConfig,
        tls: Option<Arc<crate::tls::SiteTls>>,
    ) -> Result<Self, ClientError> {
        if cfg.endpoints.is_empty() {
            return Err(ClientError::InvalidArgument(
                "client.endpoints is empty".into(),
            ));
        }
        let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms);
        let clients = cfg
            .endpoints
            .iter()
            .map(|e| {
                crate::network::channel(e, connect_timeout, tls.as_deref())
                    .map(|ch| {
                        PbClient::new(ch)
                            .max_decoding_message_size(usize::MAX)
                            .max_encoding_message_size(usize::MAX)
                    })
                    .map_err(|err| ClientError::InvalidArgument(format!("endpoint {e}: {err}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            inner: Arc::new(Inner {
                endpoints: cfg.endpoints.clone(),
                clients,
                current: AtomicUsize::new(0),
                request_timeout: Duration::from_millis(cfg.request_timeout_ms),
                backoff_initial: Duration::from_millis(cfg.retry_backoff_initial_ms),
                backoff_max: Duration::from_millis(cfg.retry_backoff_max_ms),
            }),
        })
    }

    /// A client with default timings for the given endpoints.
    pub fn connect_to(endpoints: &[String]) -> Result<Self, ClientError> {
        Self::new(&ClientConfig {
            endpoints: endpoints.to_vec(),
            ..ClientConfig::default()
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// Points the client at the leader, if the leader is one of its endpoints. Best effort.
    pub async fn discover_leader(&self) {
        let n = self.inner.clients.len();
        for i in 0..n {
            let mut c = self.inner.clients[i].clone();
            let mut req = tonic::Request::new(pb::MembersRequest {});
            req.set_timeout(Duration::from_millis(500));
            if let Ok(resp) = c.members(req).await {
                let resp = resp.into_inner();
                if let Some(leader) = resp.members.iter().find(|m| m.id == resp.leader) {
                    if let Some(idx) = self.inner.endpoints.iter().position(|e| *e == leader.addr) {
                        self.inner.current.store(idx, Ordering::Relaxed);
                    }
                }
                return;
            }
        }
    }

    /// Runs `f` against endpoints until it succeeds, fails for good, or the deadline passes.
    async fn call<T, F, Fut>(&self, idempotent: bool, f: F) -> Result<T, ClientError>
    where
        F: Fn(PbClient<Channel>, Duration) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let t = self.inner.request_timeout;
        self.call_within(idempotent, t, t, f).await
    }

    /// [`call`](Self::call) with its own deadline, and at most `attempt` per endpoint tried
    /// (an endpoint that does not answer costs that, then the next is tried; idempotent
    /// calls only).
    async fn call_within<T, F, Fut>(
        &self,
        idempotent: bool,
        total: Duration,
        attempt: Duration,
        f: F,
    ) -> Result<T, ClientError>
    where
        F: Fn(PbClient<Channel>, Duration) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let inner = &self.inner;
        let started = Instant::now();
        let deadline = started + total;
        let mut backoff = inner.backoff_initial;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let idx = inner.current.load(Ordering::Relaxed) % inner.clients.len();
            let remaining = deadline.saturating_duration_since(Instant::now());
            let remaining = if idempotent {
                remaining.min(attempt)
            } else {
                remaining
            };
            let result =
                tokio::time::timeout(remaining, f(inner.clients[idx].clone(), remaining)).await;
            let last = match result {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(status)) => match classify(&status) {
                    Verdict::Fail(e) => return Err(e),
                    Verdict::Retry(m) => m,
                    Verdict::Ambiguous(m) if idempotent => m,
                    Verdict::Ambiguous(m) => {
                        return Err(ClientError::Indeterminate(format!(
                            "{}: {m}",
                            inner.endpoints[idx]
                        )))
                    }
                },
                Err(_) if idempotent => "deadline passed".to_string(),
                Err(_) => {
                    return Err(ClientError::Indeterminate(format!(
                        "{}: no answer before the deadline ({} ms)",
                        inner.endpoints[idx],
                        inner.request_timeout.as_millis()
                    )))
                }
            };
            let last = format!("{}: {last}", inner.endpoints[idx]);
            // Move on to the next endpoint.
            let _ = inner.current.compare_exchange(
                idx,
                (idx + 1) % inner.clients.len(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            let now = Instant::now();
            if now + backoff >= deadline {
                return Err(ClientError::Unavailable {
                    attempts,
                    elapsed_ms: now.duration_since(started).as_millis() as u64,
                    last,
                });
            }
            tracing::debug!(attempts, %last, "metadata call failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(inner.backoff_max);
        }
    }

    /// The key's current value and version, linearizably.
    pub async fn get(&self, key: &str) -> Result<Option<KeyValue>, ClientError> {
        let resp = self
            .call(true, |mut c, t| {
                let mut r = tonic::Request::new(pb::GetRequest { key: key.into() });
                r.set_timeout(t);
                async move { c.get(r).await }
            })
            .await?;
        Ok(resp.into_inner().kv.map(kv_from_pb))
    }

    /// Puts `value` at `key`; returns the new version.
    pub async fn put(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<u64, ClientError> {
        Ok(self
            .put_with(key, value, PutOptions::default())
            .await?
            .version)
    }

    /// Creates `key` only if it is absent; `Conflict` if it exists.
    pub async fn create(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<u64, ClientError> {
        let opts = PutOptions {
            expected_version: Some(0),
            ..PutOptions::default()
        };
        Ok(self.put_with(key, value, opts).await?.version)
    }

    pub async fn put_with(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        opts: PutOptions,
    ) -> Result<PutResult, ClientError> {
        let op = pb::Op {
            op: Some(pb::op::Op::Put(pb::PutOp {
                key: key.into(),
                value: value.into(),
                session: opts.session,
                sequential: opts.sequential,
            })),
        };
        let conditions = opts
            .expected_version
            .map(|v| pb::Condition {
                key: key.into(),
                expected_version: v,
            })
            .into_iter()
            .collect();
        let resp = self
            .txn(pb::TxnRequest {
                conditions,
                success: vec![op],
                failure: vec![],
            })
            .await?;
        if !resp.succeeded {
            return Err(ClientError::Conflict {
                key: key.into(),
                expected: opts.expected_version.unwrap_or(0),
                current: resp.current.first().map_or(0, |c| c.expected_version),
            });
        }
        let r = resp.results.into_iter().next().unwrap_or_default();
        Ok(PutResult {
            key: r.key,
            version: r.version,
        })
    }

    /// Deletes `key` (if `expected_version` is given, only at that version). Returns whether a
    /// key was deleted.
    pub async fn delete(
        &self,
        key: &str,
        expected_version: Option<u64>,
    ) -> Result<bool, ClientError> {
        let conditions: Vec<pb::Condition> = expected_version
            .map(|v| pb::Condition {
                key: key.into(),
                expected_version: v,
            })
            .into_iter()
            .collect();
        let resp = self
            .txn(pb::TxnRequest {
                conditions,
                success: vec![pb::Op {
                    op: Some(pb::op::Op::Delete(pb::DeleteOp {
                        key: key.into(),
                        prefix: false,
                    })),
                }],
                failure: vec![],
            })
            .await?;
        if !resp.succeeded {
            return Err(ClientError::Conflict {
                key: key.into(),
                expected: expected_version.unwrap_or(0),
                current: resp.current.first().map_or(0, |c| c.expected_version),
            });
        }
        Ok(resp.results.first().is_some_and(|r| r.deleted > 0))
    }

    /// A multi-operation transaction, applied all or nothing.
    pub async fn txn(&self, req: pb::TxnRequest) -> Result<pb::TxnResponse, ClientError> {
        let resp = self
            .call(false, |mut c, t| {
                let mut r = tonic::Request::new(req.clone());
                r.set_timeout(t);
                async move { c.txn(r).await }
            })
            .await?;
        Ok(resp.into_inner())
    }

    /// Keys starting with `prefix` (in key order), after `start_after`, at most `limit`
    /// (0: the server's maximum).
    pub async fn list(
        &self,
        prefix: &str,
        start_after: &str,
        limit: u32,
    ) -> Result<ListPage, ClientError> {
        self.list_inner(prefix, false, start_after, limit).await
    }

    /// Every key starting with `prefix`, in key order, however many pages that takes.
    pub async fn list_all(&self, prefix: &str) -> Result<Vec<KeyValue>, ClientError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.list(prefix, &after, 0).await?;
            let next = page.kvs.last().map(|kv| kv.key.clone());
            out.extend(page.kvs);
            match next {
                Some(last) if page.more => after = last,
                _ => return Ok(out),
            }
        }
    }

    /// Names of every direct child of `parent`, however many pages that takes.
    pub async fn children_all(&self, parent: &str) -> Result<Vec<String>, ClientError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.children(parent, &after, 0).await?;
            let next = page.children.last().map(|c| format!("{parent}{c}"));
            out.extend(page.children);
            match next {
                Some(last) if page.more => after = last,
                _ => return Ok(out),
            }
        }
    }

    /// Names of the direct children of `parent`.
    pub async fn children(
        &self,
        parent: &str,
        start_after: &str,
        limit: u32,
    ) -> Result<ListPage, ClientError> {
        self.list_inner(parent, true, start_after, limit).await
    }

    async fn list_inner(
        &self,
        prefix: &str,
        children: bool,
        start_after: &str,
        limit: u32,
    ) -> Result<ListPage, ClientError> {
        let req = pb::ListRequest {
            prefix: prefix.into(),
            children,
            start_after: start_after.into(),
            limit,
            keys_only: false,
        };
        let resp = self
            .call(true, |mut c, t| {
                let mut r = tonic::Request::new(req.clone());
                r.set_timeout(t);
                async move { c.list(r).await }
            })
            .await?
            .into_inner();
        Ok(ListPage {
            kvs: resp.kvs.into_iter().map(kv_from_pb).collect(),
            children: resp.children,
            more: resp.more,
            revision: resp.revision,
        })
    }

    /// Starts a session with a lease of `ttl_ms` and keeps it alive in the background.
    pub async fn session(&self, ttl_ms: u64) -> Result<SessionHandle, ClientError> {
        let asked = tokio::time::Instant::now();
        let resp = self
            .call(false, |mut c, t| {
                let mut r = tonic::Request::new(pb::SessionCreateRequest { ttl_ms });
                r.set_timeout(t);
                async move { c.session_create(r).await }
            })
            .await?
            .into_inner();
        let id = resp.session;
        let (lost_tx, lost_rx) = tokio::sync::watch::channel(None::<String>);
        let ttl = Duration::from_millis(resp.ttl_ms);
        let (valid_tx, valid_rx) = tokio::sync::watch::channel(asked + ttl);
        let client = self.clone();
        let period = Duration::from_millis((resp.ttl_ms / 3).max(1));
        // After a round that failed, the next one starts this soon, not a period later: a
        // store electing a leader for a second or two (a round's worth) would otherwise cost
        // the lease, the round after it starting just as the lease ran out.
        let retry = (period / 10).clamp(Duration::from_millis(1), Duration::from_millis(100));
        let keeper = tokio::spawn(async move {
            let mut wait = period;
            loop {
                tokio::time::sleep(wait).await;
                let sent = tokio::time::Instant::now();
                // Within the period, a third of it per endpoint: one node that does not answer
                // must not cost the lease.
                match client.keep_alive_within(id, period, period / 3).await {
                    // The store renewed the lease when the request reached it, after `sent`.
                    Ok(_) => {
                        valid_tx.send_modify(|v| *v = (*v).max(sent + ttl));
                        wait = period;
                    }
                    Err(ClientError::FailedPrecondition(m)) => {
                        let _ = lost_tx.send(Some(m));
                        return;
                    }
                    // No node answered (an election, nodes paused or cut off): at once.
                    Err(e @ (ClientError::Unavailable { .. } | ClientError::Indeterminate(_))) => {
                        tracing::warn!(session = id, error = %e, "keep-alive failed; trying again");
                        wait = retry;
                    }
                    Err(e) => {
                        tracing::warn!(session = id, error = %e, "keep-alive failed");
                        wait = period;
                    }
                }
            }
        });
        Ok(SessionHandle {
            id,
            ttl_ms: resp.ttl_ms,
            client: self.clone(),
            keeper: Some(keeper),
            lost: lost_rx,
            valid_until: valid_rx,
        })
    }

    /// [`keep_alive`](Self::keep_alive) within `total`, at most `attempt` per endpoint.
    pub async fn keep_alive_within(
        &self,
        session: u64,
        total: Duration,
        attempt: Duration,
    ) -> Result<u64, ClientError> {
        Ok(self
            .call_within(
                true,
                total,
                attempt.max(Duration::from_millis(50)),
                |mut c, t| {
                    let mut r = tonic::Request::new(pb::SessionKeepAliveRequest { session });
                    r.set_timeout(t);
                    async move { c.session_keep_alive(r).await }
                },
            )
            .await?
            .into_inner()
            .ttl_ms)
    }

    /// Renews a session's lease. `FailedPrecondition` once the session has ended.
    pub async fn keep_alive(&self, session: u64) -> Result<u64, ClientError> {
        let t = self.inner.request_timeout;
        self.keep_alive_within(session, t, t).await
    }

    /// Ends a session now; its ephemeral keys are deleted. Returns how many.
    pub async fn close_session(&self, session: u64) -> Result<u64, ClientError> {
        Ok(self
            .call(false, |mut c, t| {
                let mut r = tonic::Request::new(pb::SessionCloseRequest { session });
                r.set_timeout(t);
                async move { c.session_close(r).await }
            })
            .await?
            .into_inner()
            .deleted_keys)
    }

    pub async fn members(&self) -> Result<pb::MembersResponse, ClientError> {
        Ok(self
            .call(true, |mut c, t| {
                let mut r = tonic::Request::new(pb::MembersRequest {});
                r.set_timeout(t);
                async move { c.members(r).await }
            })
            .await?
            .into_inner())
    }

    /// Adds a node: as a learner first (it catches up), then as a voter unless `learner_only`.
    pub async fn add_member(
        &self,
        id: u64,
        addr: &str,
        learner_only: bool,
    ) -> Result<pb::MembersResponse, ClientError> {
        let req = pb::AddMemberRequest {
            id,
            addr: addr.into(),
            learner_only,
        };
        Ok(self
            .call(false, |mut c, t| {
                let mut r = tonic::Request::new(req.clone());
                r.set_timeout(t);
                async move { c.add_member(r).await }
            })
            .await?
            .into_inner())
    }

    pub async fn remove_member(&self, id: u64) -> Result<pb::MembersResponse, ClientError> {
        Ok(self
            .call(false, |mut c, t| {
                let mut r = tonic::Request::new(pb::RemoveMemberRequest { id });
                r.set_timeout(t);
                async move { c.remove_member(r).await }
            })
            .await?
            .into_inner())
    }

    /// Watches `key` (or every key under it if `prefix`) from `start_revision` (0: from now).
    /// Returns once the watch is established, so any write after this call is seen.
    pub async fn watch(
        &self,
        key: &str,
        prefix: bool,
        start_revision: u64,
    ) -> Result<WatchStream, ClientError> {
        let (tx, rx) = mpsc::channel(256);
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(watch_loop(
            self.clone(),
            key.to_string(),
            prefix,
            start_revision,
            tx,
            ready_tx,
        ));
        match ready_rx.await {
            Ok(Ok(revision)) => Ok(WatchStream { rx, task, revision }),
            Ok(Err(e)) => {
                task.abort();
                Err(e)
            }
            Err(_) => Err(ClientError::Other("watch task ended".into())),
        }
    }
}

/// Keeps one logical watch alive across broken streams and endpoint changes.
async fn watch_loop(
    client: MetadataClient,
    key: String,
    prefix: bool,
    start_revision: u64,
    tx: mpsc::Sender<Result<Vec<Event>, ClientError>>,
    ready: tokio::sync::oneshot::Sender<Result<u64, ClientError>>,
) {
    let mut ready = Some(ready);
    // Next revision to ask for; 0 until the first stream told us where "now" is.
    let mut next = start_revision;
    let mut compacted_on = 0usize;
    loop {
        let req = pb::WatchRequest {
            key: key.clone(),
            prefix,
            start_revision: next,
        };
        let opened = client
            .call(true, |mut c, t| {
                let req = req.clone();
                async move {
                    let mut stream = c.watch(tonic::Request::new(req)).await?.into_inner();
                    // The opening message: the watch is established.
                    match tokio::time::timeout(t, stream.message()).await {
                        Ok(Ok(Some(first))) => Ok((stream, first.revision)),
                        Ok(Ok(None)) => Err(tonic::Status::unavailable("watch stream closed")),
                        Ok(Err(s)) => Err(s),
                        Err(_) => Err(tonic::Status::deadline_exceeded("watch did not open")),
                    }
                }
            })
            .await;
        let (mut stream, opened_at) = match opened {
            Ok(v) => v,
            Err(ClientError::Compacted(m)) if compacted_on + 1 < client.inner.clients.len() => {
                // Another node may still have the history.
                compacted_on += 1;
                let n = client.inner.clients.len();
                let cur = client.inner.current.load(Ordering::Relaxed);
                client.inner.current.store((cur + 1) % n, Ordering::Relaxed);
                tracing::debug!(%m, "watch history compacted here; trying another node");
                continue;
            }
            Err(e) => {
                match ready.take() {
                    Some(r) => {
                        let _ = r.send(Err(e));
                        return;
                    }
                    // An established watch outlives outages: keep trying until the caller
                    // drops it or the history it needs is gone everywhere.
                    None if matches!(e, ClientError::Unavailable { .. }) && !tx.is_closed() => {
                        tracing::debug!(error = %e, "watch cannot resume yet");
                        continue;
                    }
                    None => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        };
        compacted_on = 0;
        if next == 0 {
            next = opened_at + 1;
        }
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(opened_at));
        }
        loop {
            match stream.message().await {
                Ok(Some(msg)) => {
                    if msg.events.is_empty() {
                        continue;
                    }
                    let events: Vec<Event> = msg
                        .events
                        .into_iter()
                        .map(event_from_pb)
                        .filter(|e| e.revision >= next)
                        .collect();
                    if let Some(last) = events.last() {
                        next = last.revision + 1;
                    }
                    if !events.is_empty() && tx.send(Ok(events)).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(%status, next, "watch stream broke; resuming");
                    break;
                }
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(client.inner.backoff_initial).await;
    }
}

/// Events of a watch, in revision order, each exactly once.
#[derive(Debug)]
pub struct WatchStream {
    rx: mpsc::Receiver<Result<Vec<Event>, ClientError>>,
    task: tokio::task::JoinHandle<()>,
    /// The store's revision when the watch was established.
    pub revision: u64,
}

impl WatchStream {
    /// The next batch of events (one or more whole revisions). `None` when the watch ended.
    pub async fn next(&mut self) -> Option<Result<Vec<Event>, ClientError>> {
        self.rx.recv().await
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A live session. Keep-alives run in the background until [`SessionHandle::close`], drop, or
/// [`SessionHandle::stop_keep_alive`].
pub struct SessionHandle {
    pub id: u64,
    pub ttl_ms: u64,
    client: MetadataClient,
    keeper: Option<tokio::task::JoinHandle<()>>,
    lost: tokio::sync::watch::Receiver<Option<String>>,
    valid_until: tokio::sync::watch::Receiver<tokio::time::Instant>,
}

impl std::fmt::Debug for SessionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHandle")
            .field("id", &self.id)
            .field("ttl_ms", &self.ttl_ms)
            .finish()
    }
}

impl SessionHandle {
    /// Stops sending keep-alives; the session expires after its TTL.
    pub fn stop_keep_alive(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }

    /// Why the session ended, once the keep-alive learned it did.
    pub fn lost(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    /// Until when the session surely lives: the TTL after the last keep-alive (or the
    /// creation) that succeeded, counted from when it was sent. The store cannot expire it
    /// before, so ephemeral keys of this session are this process's until then.
    pub fn valid_until(&self) -> tokio::time::Instant {
        *self.valid_until.borrow()
    }

    /// Watches [`valid_until`](Self::valid_until).
    pub fn validity(&self) -> tokio::sync::watch::Receiver<tokio::time::Instant> {
        self.valid_until.clone()
    }

    /// Ends the session; its ephemeral keys are deleted.
    pub async fn close(mut self) -> Result<u64, ClientError> {
        self.stop_keep_alive();
        self.client.close_session(self.id).await
    }
}

impl Drop for SessionHandle {
    fn drop(&mut self) {
        self.stop_keep_alive();
    }
}
