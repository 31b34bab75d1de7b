//! The client-facing gRPC service of a metadata node.
//!
//! Writes, linearizable reads, keep-alives and membership changes that reach a follower are
//! forwarded to the leader (once: a forwarded request is never forwarded again). Watches are
//! served by whichever node the client reached, from its applied log.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use tokio::sync::{broadcast, mpsc, watch};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::model::{self, validate_key, validate_prefix, Command, Condition, Op};
use crate::node::{self, NodeCore, NodeError};
use crate::pb::metadata_client::MetadataClient as PbClient;
use crate::pb::{self, metadata_server::Metadata};
use crate::store::Notice;

const FORWARDED: &str = "x-meridian-forwarded";
/// Events per watch message when replaying history (whole revisions are never split).
const WATCH_BATCH_EVENTS: usize = 1_000;

pub struct Api {
    core: Arc<NodeCore>,
    peers: Mutex<HashMap<String, PbClient<Channel>>>,
    message_bytes_max: usize,
    /// Becomes true when the node stops; open watch streams end then.
    stopping: watch::Receiver<bool>,
}

impl Api {
    pub fn new(
        core: Arc<NodeCore>,
        message_bytes_max: usize,
        stopping: watch::Receiver<bool>,
    ) -> Self {
        Self {
            core,
            peers: Mutex::new(HashMap::new()),
            message_bytes_max,
            stopping,
        }
    }

    fn peer(&self, addr: &str) -> Result<PbClient<Channel>, Status> {
        let mut peers = self.peers.lock().expect("peer lock");
        if let Some(c) = peers.get(addr) {
            return Ok(c.clone());
        }
        let channel =
            crate::network::channel(addr, self.core.connect_timeout, self.core.tls.as_deref())
                .map_err(|e| Status::unavailable(format!("leader address {addr}: {e}")))?;
        let client = PbClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(self.message_bytes_max);
        peers.insert(addr.to_string(), client.clone());
        Ok(client)
    }
}

impl Api {
    /// With TLS between roles, a membership change is for admin tools and for member nodes
    /// forwarding one to the leader, not for every client role.
    fn require_membership_role<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(tls) = &self.core.tls else {
            return Ok(());
        };
        let certs = req.peer_certs();
        tls.authorize_peer(
            certs.as_deref().map(Vec::as_slice),
            crate::tls::MEMBERSHIP_ROLES,
            "membership change",
        )
        .and_then(|peer| match peer.role {
            crate::tls::ProcessRole::Metadata => node::known_member(&self.core.raft, &peer)
                .map_err(|e| e.replacen("Raft RPC", "membership change", 1)),
            _ => Ok(()),
        })
        .map_err(|reason| crate::tls::refusal(req, certs.is_none(), reason))
    }
}

/// Keys a bookie's certificate may write: registrations (`/bookies/available/<address>`,
/// the ledger client's `BOOKIES_PREFIX`). Brokers and admin tools write what the site's
/// metadata holds; a key taken from a bookie's host cannot rewrite tenants, policies,
/// ownership or ledger metadata, nor what the admin API keeps for superusers under
/// `/bookies/` (racks, affinity groups, decommissioning).
pub const BOOKIE_WRITABLE_PREFIX: &str = "/bookies/available/";

impl Api {
    /// With TLS between roles, a bookie may only write under [`BOOKIE_WRITABLE_PREFIX`] (every
    /// put and delete of both branches of the transaction). Checked where the client
    /// connected: a forwarded request comes from a metadata node.
    fn require_write_scope(&self, req: &Request<pb::TxnRequest>) -> Result<(), Status> {
        let Some(tls) = &self.core.tls else {
            return Ok(());
        };
        let certs = req.peer_certs();
        let Ok(peer) = tls.peer_identity(certs.as_deref().map(Vec::as_slice)) else {
            // The interceptor admitted the connection; without an identity nothing is scoped.
            return Ok(());
        };
        if peer.role != crate::tls::ProcessRole::Bookie {
            return Ok(());
        }
        let t = req.get_ref();
        for op in t.success.iter().chain(&t.failure) {
            let (key, prefix) = match &op.op {
                Some(pb::op::Op::Put(p)) => (&p.key, false),
                Some(pb::op::Op::Delete(d)) => (&d.key, d.prefix),
                None => continue,
            };
            // A deletion by prefix would take other bookies' registrations with it.
            if prefix {
                let reason = format!(
                    "a bookie's certificate ({}) deletes keys one by one, not by prefix ({key:?})",
                    peer.name
                );
                return Err(crate::tls::refusal(req, false, reason));
            }
            if !key.starts_with(BOOKIE_WRITABLE_PREFIX) {
                let reason = format!(
                    "a bookie's certificate ({}) writes only under {BOOKIE_WRITABLE_PREFIX}, not {key:?}",
                    peer.name
                );
                return Err(crate::tls::refusal(req, false, reason));
            }
        }
        Ok(())
    }
}

fn forwarded<T>(req: &Request<T>) -> bool {
    req.metadata().contains_key(FORWARDED)
}

fn forward_request<T>(inner: T) -> Request<T> {
    let mut r = Request::new(inner);
    r.metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    r.set_timeout(Duration::from_secs(30));
    r
}

/// Runs `$local` here; if this node does not lead, sends the same request to the leader.
macro_rules! forwarding {
    ($self:ident, $req:ident, $local:expr, $method:ident) => {{
        let was_forwarded = forwarded(&$req);
        let inner = $req.into_inner();
        match $local(&inner).await {
            Err(NodeError::ForwardTo { addr, .. }) if !was_forwarded => {
                let mut client = $self.peer(&addr)?;
                client.$method(forward_request(inner)).await
            }
            Err(NodeError::ForwardTo { leader, .. }) => Err(Status::unavailable(format!(
                "node {} was sent a forwarded request but node {leader} leads now; retry",
                $self.core.id
            ))),
            other => other.map(Response::new).map_err(Status::from),
        }
    }};
}

fn kv_to_pb(kv: &model::KeyValue, keys_only: bool) -> pb::KeyValue {
    pb::KeyValue {
        key: kv.key.clone(),
        value: if keys_only {
            Vec::new()
        } else {
            kv.value.clone()
        },
        version: kv.mod_revision,
        create_revision: kv.create_revision,
        session: kv.session,
    }
}

fn event_to_pb(ev: &model::Event) -> pb::Event {
    pb::Event {
        kind: match ev.kind {
            model::EventKind::Put => pb::event::Kind::Put as i32,
            model::EventKind::Delete => pb::event::Kind::Delete as i32,
        },
        kv: Some(kv_to_pb(&ev.kv, false)),
        revision: ev.revision,
    }
}

impl Api {
    fn invalid(msg: String) -> NodeError {
        NodeError::Invalid(msg)
    }

    fn check_key(&self, key: &str) -> Result<(), NodeError> {
        validate_key(key, self.core.limits.key_bytes_max).map_err(Self::invalid)
    }

    async fn local_get(&self, req: &pb::GetRequest) -> Result<pb::GetResponse, NodeError> {
        self.check_key(&req.key)?;
        self.core.linearize().await?;
        let st = self.core.shared.state.read().expect("state lock");
        Ok(pb::GetResponse {
            kv: st.kv.get(&req.key).map(|kv| kv_to_pb(kv, false)),
            revision: st.kv.revision,
        })
    }

    async fn local_list(&self, req: &pb::ListRequest) -> Result<pb::ListResponse, NodeError> {
        validate_prefix(&req.prefix, self.core.limits.key_bytes_max).map_err(Self::invalid)?;
        let max = self.core.limits.list_limit_max;
        let limit = match req.limit as usize {
            0 => max,
            n if n > max => {
                return Err(Self::invalid(format!(
                    "limit {n} is above metadata.list_limit_max ({max})"
                )))
            }
            n => n,
        };
        self.core.linearize().await?;
        let st = self.core.shared.state.read().expect("state lock");
        if req.children {
            let (children, more) = st.kv.children(&req.prefix, &req.start_after, limit);
            Ok(pb::ListResponse {
                kvs: Vec::new(),
                children,
                more,
                revision: st.kv.revision,
            })
        } else {
            let (kvs, more) = st.kv.range(&req.prefix, &req.start_after, limit);
            Ok(pb::ListResponse {
                kvs: kvs
                    .into_iter()
                    .map(|kv| kv_to_pb(kv, req.keys_only))
                    .collect(),
                children: Vec::new(),
                more,
                revision: st.kv.revision,
            })
        }
    }

    fn convert_ops(&self, ops: &[pb::Op]) -> Result<Vec<Op>, NodeError> {
        let limits = &self.core.limits;
        ops.iter()
            .map(|op| match &op.op {
                Some(pb::op::Op::Put(p)) => {
                    self.check_key(&p.key)?;
                    if p.value.len() > limits.value_bytes_max {
                        return Err(Self::invalid(format!(
                            "value for {} is {} bytes; the limit (metadata.value_bytes_max) is {}",
                            p.key,
                            p.value.len(),
                            limits.value_bytes_max
                        )));
                    }
                    if p.sequential
                        && p.key.len() + model::SEQUENTIAL_SUFFIX_DIGITS > limits.key_bytes_max
                    {
                        return Err(Self::invalid(format!(
                            "sequential key {} with its {}-digit suffix exceeds metadata.key_bytes_max ({})",
                            p.key,
                            model::SEQUENTIAL_SUFFIX_DIGITS,
                            limits.key_bytes_max
                        )));
                    }
                    Ok(Op::Put {
                        key: p.key.clone(),
                        value: p.value.clone(),
                        session: p.session,
                        sequential: p.sequential,
                    })
                }
                Some(pb::op::Op::Delete(d)) => {
                    if d.prefix {
                        validate_prefix(&d.key, limits.key_bytes_max).map_err(Self::invalid)?;
                    } else {
                        self.check_key(&d.key)?;
                    }
                    Ok(Op::Delete {
                        key: d.key.clone(),
                        prefix: d.prefix,
                    })
                }
                None => Err(Self::invalid("an op has neither put nor delete".into())),
            })
            .collect()
    }

    async fn local_txn(&self, req: &pb::TxnRequest) -> Result<pb::TxnResponse, NodeError> {
        let max = self.core.limits.txn_ops_max;
        let n = req.conditions.len() + req.success.len().max(req.failure.len());
        if n > max {
            return Err(Self::invalid(format!(
                "transaction has {n} conditions and ops; the limit (metadata.txn_ops_max) is {max}"
            )));
        }
        let mut conditions = Vec::with_capacity(req.conditions.len());
        for c in &req.conditions {
            self.check_key(&c.key)?;
            conditions.push(Condition {
                key: c.key.clone(),
                expected_version: c.expected_version,
            });
        }
        let cmd = Command::Txn {
            conditions,
            success: self.convert_ops(&req.success)?,
            failure: self.convert_ops(&req.failure)?,
        };
        match self.core.write(cmd).await? {
            model::Response::Txn {
                succeeded,
                results,
                revision,
                current,
            } => Ok(pb::TxnResponse {
                succeeded,
                results: results
                    .into_iter()
                    .map(|r| pb::OpResult {
                        key: r.key,
                        version: r.version,
                        deleted: r.deleted,
                    })
                    .collect(),
                revision,
                current: current
                    .into_iter()
                    .map(|c| pb::Condition {
                        key: c.key,
                        expected_version: c.expected_version,
                    })
                    .collect(),
            }),
            other => Err(NodeError::Fatal(format!("unexpected response {other:?}"))),
        }
    }

    async fn local_session_create(
        &self,
        req: &pb::SessionCreateRequest,
    ) -> Result<pb::SessionCreateResponse, NodeError> {
        let l = &self.core.limits;
        if req.ttl_ms < l.session_ttl_ms_min || req.ttl_ms > l.session_ttl_ms_max {
            return Err(Self::invalid(format!(
                "session ttl_ms {} is out of range; accepted {}..={} (metadata.session_ttl_ms_min/max)",
                req.ttl_ms, l.session_ttl_ms_min, l.session_ttl_ms_max
            )));
        }
        match self
            .core
            .write(Command::CreateSession { ttl_ms: req.ttl_ms })
            .await?
        {
            model::Response::SessionCreated { id, ttl_ms } => Ok(pb::SessionCreateResponse {
                session: id,
                ttl_ms,
            }),
            other => Err(NodeError::Fatal(format!("unexpected response {other:?}"))),
        }
    }

    async fn local_keep_alive(
        &self,
        req: &pb::SessionKeepAliveRequest,
    ) -> Result<pb::SessionKeepAliveResponse, NodeError> {
        let ttl_ms = self.core.keep_alive(req.session)?;
        Ok(pb::SessionKeepAliveResponse { ttl_ms })
    }

    async fn local_session_close(
        &self,
        req: &pb::SessionCloseRequest,
    ) -> Result<pb::SessionCloseResponse, NodeError> {
        match self
            .core
            .write(Command::CloseSession { id: req.session })
            .await?
        {
            model::Response::SessionEnded { deleted_keys } => {
                Ok(pb::SessionCloseResponse { deleted_keys })
            }
            other => Err(NodeError::Fatal(format!("unexpected response {other:?}"))),
        }
    }

    async fn local_add_member(
        &self,
        req: &pb::AddMemberRequest,
    ) -> Result<pb::MembersResponse, NodeError> {
        if req.id == 0 {
            return Err(Self::invalid("member id must be >= 1".into()));
        }
        if req.addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(Self::invalid(format!(
                "member address {:?} is not HOST:PORT with a numeric host",
                req.addr
            )));
        }
        node::add_member(&self.core, req.id, req.addr.clone(), req.learner_only).await?;
        Ok(node::members_response(&self.core))
    }

    async fn local_remove_member(
        &self,
        req: &pb::RemoveMemberRequest,
    ) -> Result<pb::MembersResponse, NodeError> {
        node::remove_member(&self.core, req.id).await?;
        Ok(node::members_response(&self.core))
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Metadata for Api {
    async fn get(&self, req: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        forwarding!(self, req, |r| self.local_get(r), get)
    }

    async fn list(
        &self,
        req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        forwarding!(self, req, |r| self.local_list(r), list)
    }

    async fn txn(&self, req: Request<pb::TxnRequest>) -> Result<Response<pb::TxnResponse>, Status> {
        self.require_write_scope(&req)?;
        forwarding!(self, req, |r| self.local_txn(r), txn)
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let req = req.into_inner();
        let limits = &self.core.limits;
        if req.prefix {
            validate_prefix(&req.key, limits.key_bytes_max)
        } else {
            validate_key(&req.key, limits.key_bytes_max)
        }
        .map_err(Status::invalid_argument)?;
        self.core.leader().map_err(Status::from)?;
        // Subscribe before reading the revision: every event after it then arrives as a notice.
        let notices = self.core.shared.notices.subscribe();
        let (revision, floor) = {
            let st = self.core.shared.state.read().expect("state lock");
            (st.kv.revision, st.history_floor)
        };
        let start = if req.start_revision == 0 {
            revision + 1
        } else {
            req.start_revision
        };
        if start < floor {
            return Err(Status::out_of_range(format!(
                "revision {start} is compacted on node {}; the oldest revision it still has is {floor}",
                self.core.id
            )));
        }
        let history = if start <= revision {
            self.core
                .shared
                .history(start, revision)
                .map_err(|e| Status::internal(format!("reading watch history: {e}")))?
        } else {
            Vec::new()
        };
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(run_watch(
            req,
            start,
            revision,
            history,
            notices,
            tx,
            self.stopping.clone(),
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn session_create(
        &self,
        req: Request<pb::SessionCreateRequest>,
    ) -> Result<Response<pb::SessionCreateResponse>, Status> {
        forwarding!(self, req, |r| self.local_session_create(r), session_create)
    }

    async fn session_keep_alive(
        &self,
        req: Request<pb::SessionKeepAliveRequest>,
    ) -> Result<Response<pb::SessionKeepAliveResponse>, Status> {
        forwarding!(self, req, |r| self.local_keep_alive(r), session_keep_alive)
    }

    async fn session_close(
        &self,
        req: Request<pb::SessionCloseRequest>,
    ) -> Result<Response<pb::SessionCloseResponse>, Status> {
        forwarding!(self, req, |r| self.local_session_close(r), session_close)
    }

    async fn members(
        &self,
        _req: Request<pb::MembersRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        // Not a member: say so instead of printing an empty list.
        if let Err(e @ NodeError::Unavailable(_)) = self.core.leader() {
            let m = self.core.raft.metrics().borrow().clone();
            if m.membership_config
                .membership()
                .get_node(&self.core.id)
                .is_none()
            {
                return Err(e.into());
            }
        }
        Ok(Response::new(node::members_response(&self.core)))
    }

    async fn add_member(
        &self,
        req: Request<pb::AddMemberRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        self.require_membership_role(&req)?;
        forwarding!(self, req, |r| self.local_add_member(r), add_member)
    }

    async fn remove_member(
        &self,
        req: Request<pb::RemoveMemberRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        self.require_membership_role(&req)?;
        forwarding!(self, req, |r| self.local_remove_member(r), remove_member)
    }
}

/// Sends `events` (already filtered, in order) in messages that never split a revision.
async fn send_events(
    tx: &mpsc::Sender<Result<pb::WatchResponse, Status>>,
    events: &[&model::Event],
) -> Result<(), ()> {
    let mut i = 0;
    while i < events.len() {
        let mut j = (i + WATCH_BATCH_EVENTS).min(events.len());
        while j < events.len() && events[j].revision == events[j - 1].revision {
            j += 1;
        }
        let chunk = &events[i..j];
        let msg = pb::WatchResponse {
            events: chunk.iter().map(|e| event_to_pb(e)).collect(),
            revision: chunk[chunk.len() - 1].revision,
        };
        tx.send(Ok(msg)).await.map_err(|_| ())?;
        i = j;
    }
    Ok(())
}

/// One watch: an opening message with the current revision, the history from `start`, then live
/// events. Events at or below the last revision already covered are skipped, so the hand-over
/// from history to live events neither loses nor repeats one.
async fn run_watch(
    req: pb::WatchRequest,
    start: u64,
    revision: u64,
    history: Vec<model::Event>,
    mut notices: broadcast::Receiver<Notice>,
    tx: mpsc::Sender<Result<pb::WatchResponse, Status>>,
    mut stopping: watch::Receiver<bool>,
) {
    let matches = |e: &&model::Event| model::watch_matches(&req.key, req.prefix, &e.kv.key);
    let opening = pb::WatchResponse {
        events: Vec::new(),
        revision,
    };
    if tx.send(Ok(opening)).await.is_err() {
        return;
    }
    let selected: Vec<&model::Event> = history.iter().filter(matches).collect();
    if send_events(&tx, &selected).await.is_err() {
        return;
    }
    let mut covered = revision.max(start - 1);
    loop {
        tokio::select! {
            notice = notices.recv() => match notice {
                Ok(Notice::Events(events)) => {
                    let selected: Vec<&model::Event> = events
                        .iter()
                        .filter(|e| e.revision > covered)
                        .filter(matches)
                        .collect();
                    if send_events(&tx, &selected).await.is_err() {
                        return;
                    }
                    if let Some(last) = events.last() {
                        covered = covered.max(last.revision);
                    }
                }
                Ok(Notice::Reset { floor }) => {
                    if covered + 1 < floor {
                        let _ = tx.send(Err(Status::out_of_range(format!(
                            "this node installed a snapshot at revision {}; events after {covered} \
                             are not in its history: resume elsewhere or re-read",
                            floor - 1
                        )))).await;
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(Err(Status::aborted(format!(
                        "watch fell behind; resume from revision {}", covered + 1
                    )))).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = tx.closed() => return,
            // The only change ever made is to true.
            _ = stopping.changed() => {
                let _ = tx.send(Err(Status::unavailable("metadata node is stopping"))).await;
                return;
            }
        }
    }
}
