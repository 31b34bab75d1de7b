//! Raft RPCs between metadata nodes over tonic gRPC.
//!
//! The payloads are openraft's own request and response types, bincode-encoded inside a
//! `RaftPayload` message; a response carries `Result<Response, RaftError>` so the remote node's
//! refusal reaches openraft as a [`RemoteError`], distinct from an unreachable peer.
//!
//! AppendEntries, the RPC of every replication round, goes over one long-lived bidirectional
//! stream per follower (`AppendEntriesStream`): openraft's replication task for a follower sends
//! one request at a time and waits for its answer, so answers come back in order, one for each
//! request. That spares each round a unary call's request and response headers, trailers and
//! HTTP/2 stream set-up. Any failure or timeout drops the stream (a request whose answer was not
//! read never leaves an answer behind for the next one) and the next round opens a new one; a
//! round that fails on a stream opened earlier is tried once more on a new one. A
//! peer that does not know the stream (`Unimplemented`) gets unary calls from then on. A
//! stopping node ends the streams it serves (its server's graceful shutdown would otherwise
//! wait for them).

use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::{de::DeserializeOwned, Serialize};
use tonic::transport::{Channel, Endpoint};

use crate::pb::raft_client::RaftClient;
use crate::pb::RaftPayload;
use crate::tls::SiteTls;
use crate::{NodeId, Raft, TypeConfig};

/// A lazily connecting channel to `addr` (`host:port`); over TLS presenting this process's
/// certificate when `tls` is given (the server's must then name `addr`'s host and come from
/// the site CA).
pub fn channel(
    addr: &str,
    connect_timeout: Duration,
    tls: Option<&SiteTls>,
) -> Result<Channel, tonic::transport::Error> {
    let endpoint = match tls {
        Some(t) => Endpoint::from_shared(format!("https://{addr}"))?
            .tls_config_with_verifier(t.tonic_client(), t.metadata_verifier())?,
        None => Endpoint::from_shared(format!("http://{addr}"))?,
    };
    Ok(endpoint
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy())
}

fn encode<T: Serialize>(v: &T) -> RaftPayload {
    RaftPayload {
        data: bincode::serialize(v).expect("bincode serialization of a Raft message"),
    }
}

/// Decodes a payload from the network. The limit keeps a forged length prefix from making the
/// node allocate more than the payload itself could hold (it would otherwise abort the process).
fn decode<T: DeserializeOwned>(p: &RaftPayload) -> Result<T, bincode::Error> {
    use bincode::Options;
    bincode::options()
        .with_fixint_encoding()
        .with_limit(p.data.len() as u64)
        .deserialize(&p.data)
}

/// Creates one [`Network`] per peer.
#[derive(Clone)]
pub struct NetworkFactory {
    pub connect_timeout: Duration,
    /// This node's certificate, presented to its peers; `None` = plaintext.
    pub tls: Option<std::sync::Arc<SiteTls>>,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = Network;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Network {
        Network {
            target,
            target_node: node.clone(),
            client: channel(&node.addr, self.connect_timeout, self.tls.as_deref())
                .map(RaftClient::new)
                .map_err(|e| e.to_string()),
            stream: None,
            unary_only: false,
        }
    }
}

pub struct Network {
    target: NodeId,
    target_node: BasicNode,
    client: Result<RaftClient<Channel>, String>,
    /// The open AppendEntries stream, between rounds (taken out during one).
    stream: Option<AppendStream>,
    /// The peer answered the stream with `Unimplemented`: unary AppendEntries only.
    unary_only: bool,
}

struct AppendStream {
    requests: tokio::sync::mpsc::Sender<RaftPayload>,
    answers: tonic::Streaming<RaftPayload>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

/// One of the three Raft RPCs of the generated client.
type RpcFn =
    fn(
        RaftClient<Channel>,
        tonic::Request<RaftPayload>,
    )
        -> futures::future::BoxFuture<'static, Result<tonic::Response<RaftPayload>, tonic::Status>>;

impl Network {
    fn client(&self) -> Result<RaftClient<Channel>, tonic::Status> {
        self.client
            .clone()
            .map_err(|e| tonic::Status::unavailable(format!("no channel: {e}")))
    }

    /// A failed call as openraft sees it: unreachable (back off and retry) or a network error.
    fn status_error<E: std::error::Error>(
        &self,
        status: tonic::Status,
    ) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        let err = Msg(format!("node {}: {status}", self.target));
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                RPCError::Unreachable(Unreachable::new(&err))
            }
            _ => RPCError::Network(NetworkError::new(&err)),
        }
    }

    /// The remote node's answer: its response, or its refusal as a [`RemoteError`].
    fn answer<Resp, E>(
        &self,
        response: &RaftPayload,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let result: Result<Resp, RaftError<NodeId, E>> =
            decode(response).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.target_node.clone(),
                e,
            ))
        })
    }

    async fn call<Req, Resp, E>(
        &mut self,
        req: &Req,
        option: &RPCOption,
        which: RpcFn,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let client = self.client().map_err(|s| self.status_error(s))?;
        let mut request = tonic::Request::new(encode(req));
        request.set_timeout(option.hard_ttl());
        match which(client, request).await {
            Ok(r) => self.answer(&r.into_inner()),
            Err(status) => Err(self.status_error(status)),
        }
    }

    /// One request and its answer on the AppendEntries stream, opening it first if needed.
    /// The stream is put back only after a whole round, so a round cut short (an error, a
    /// timeout, the future dropped) takes the stream with it.
    async fn stream_round(&mut self, payload: RaftPayload) -> Result<RaftPayload, tonic::Status> {
        let mut stream = match self.stream.take() {
            Some(s) => s,
            None => {
                let (requests, rx) = tokio::sync::mpsc::channel(1);
                let answers = self
                    .client()?
                    .append_entries_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                AppendStream { requests, answers }
            }
        };
        if stream.requests.send(payload).await.is_err() {
            return Err(tonic::Status::unavailable("the AppendEntries stream ended"));
        }
        match stream.answers.message().await? {
            Some(answer) => {
                self.stream = Some(stream);
                Ok(answer)
            }
            None => Err(tonic::Status::unavailable(
                "the follower ended the AppendEntries stream",
            )),
        }
    }
}

impl RaftNetwork<TypeConfig> for Network {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        // No timeout of its own: openraft times the call out (`heartbeat_interval`) and drops
        // this future, and the stream with it (an answer never read is never read later). That
        // is `RPCError::Timeout` to openraft, which sends again at once; `Unreachable` would make
        // it pause the follower for its back-off (500 ms, longer than an election timeout).
        if !self.unary_only {
            let reused = self.stream.is_some();
            let mut result = self.stream_round(encode(&rpc)).await;
            if reused && matches!(&result, Err(s) if s.code() != tonic::Code::Unimplemented) {
                // The stream may have died while it waited (the follower restarted, the
                // connection dropped): once more on a new stream. Appending the same entries
                // again is harmless.
                result = self.stream_round(encode(&rpc)).await;
            }
            match result {
                Ok(answer) => return self.answer(&answer),
                Err(status) if status.code() == tonic::Code::Unimplemented => {
                    tracing::info!(
                        target_node = self.target,
                        "peer has no AppendEntries stream; unary calls from now on"
                    );
                    self.unary_only = true;
                }
                Err(status) => return Err(self.status_error(status)),
            }
        }
        self.call(&rpc, &option, |mut c, r| {
            Box::pin(async move { c.append_entries(r).await })
        })
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(&rpc, &option, |mut c, r| {
            Box::pin(async move { c.install_snapshot(r).await })
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(&rpc, &option, |mut c, r| {
            Box::pin(async move { c.vote(r).await })
        })
        .await
    }
}

/// The receiving side: hands each RPC to the local Raft instance.
pub struct RaftService {
    pub raft: Raft,
    /// Becomes true when the node stops: open AppendEntries streams end then (a graceful server
    /// shutdown waits for open streams, and the leader would keep this one open).
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

fn bad_payload(e: bincode::Error) -> tonic::Status {
    tonic::Status::invalid_argument(format!("undecodable Raft payload: {e}"))
}

type AnswerStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<RaftPayload, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl crate::pb::raft_server::Raft for RaftService {
    type AppendEntriesStreamStream = AnswerStream;

    /// Answers each request of the stream in order. An undecodable request ends the stream
    /// with `InvalidArgument` (the leader opens a new one); the connection stays.
    async fn append_entries_stream(
        &self,
        request: tonic::Request<tonic::Streaming<RaftPayload>>,
    ) -> Result<tonic::Response<AnswerStream>, tonic::Status> {
        let start = Some((
            self.raft.clone(),
            request.into_inner(),
            self.stopping.clone(),
        ));
        let answers = futures::stream::unfold(start, |state| async move {
            let (raft, mut requests, mut stopping) = state?;
            let payload = tokio::select! {
                next = requests.message() => next.ok()??,
                _ = stopping.wait_for(|stop| *stop) => return None,
            };
            match decode::<AppendEntriesRequest<TypeConfig>>(&payload) {
                Ok(req) => {
                    let result = raft.append_entries(req).await;
                    Some((Ok(encode(&result)), Some((raft, requests, stopping))))
                }
                Err(e) => Some((Err(bad_payload(e)), None)),
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    async fn append_entries(
        &self,
        request: tonic::Request<RaftPayload>,
    ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let req: AppendEntriesRequest<TypeConfig> =
            decode(request.get_ref()).map_err(bad_payload)?;
        let result = self.raft.append_entries(req).await;
        Ok(tonic::Response::new(encode(&result)))
    }

    async fn vote(
        &self,
        request: tonic::Request<RaftPayload>,
    ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let req: VoteRequest<NodeId> = decode(request.get_ref()).map_err(bad_payload)?;
        let result = self.raft.vote(req).await;
        Ok(tonic::Response::new(encode(&result)))
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<RaftPayload>,
    ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let req: InstallSnapshotRequest<TypeConfig> =
            decode(request.get_ref()).map_err(bad_payload)?;
        let result = self.raft.install_snapshot(req).await;
        Ok(tonic::Response::new(encode(&result)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use openraft::Vote;

    use super::*;

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Mode {
        /// Answers every request of a stream.
        Stream,
        /// Knows no stream (a node from before it): `Unimplemented`.
        NoStream,
        /// Ends each stream after its first answer.
        EndAfterOne,
    }

    /// A peer that answers every AppendEntries with success and counts what it was sent.
    #[derive(Clone)]
    struct Fake {
        mode: Mode,
        opened: Arc<AtomicUsize>,
        streamed: Arc<AtomicUsize>,
        unary: Arc<AtomicUsize>,
    }

    fn success() -> RaftPayload {
        encode(&Ok::<_, RaftError<NodeId>>(
            AppendEntriesResponse::<NodeId>::Success,
        ))
    }

    #[tonic::async_trait]
    impl crate::pb::raft_server::Raft for Fake {
        type AppendEntriesStreamStream = AnswerStream;

        async fn append_entries_stream(
            &self,
            request: tonic::Request<tonic::Streaming<RaftPayload>>,
        ) -> Result<tonic::Response<AnswerStream>, tonic::Status> {
            self.opened.fetch_add(1, Ordering::SeqCst);
            if self.mode == Mode::NoStream {
                return Err(tonic::Status::unimplemented("no such method"));
            }
            let limit = if self.mode == Mode::EndAfterOne {
                1
            } else {
                usize::MAX
            };
            let streamed = Arc::clone(&self.streamed);
            let answers = futures::stream::unfold((request.into_inner(), 0), move |(mut rx, n)| {
                let streamed = Arc::clone(&streamed);
                async move {
                    if n >= limit {
                        return None;
                    }
                    let p = rx.message().await.ok()??;
                    decode::<AppendEntriesRequest<TypeConfig>>(&p).ok()?;
                    streamed.fetch_add(1, Ordering::SeqCst);
                    Some((Ok(success()), (rx, n + 1)))
                }
            });
            Ok(tonic::Response::new(Box::pin(answers)))
        }

        async fn append_entries(
            &self,
            request: tonic::Request<RaftPayload>,
        ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
            decode::<AppendEntriesRequest<TypeConfig>>(request.get_ref()).map_err(bad_payload)?;
            self.unary.fetch_add(1, Ordering::SeqCst);
            Ok(tonic::Response::new(success()))
        }

        async fn vote(
            &self,
            _: tonic::Request<RaftPayload>,
        ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
            Err(tonic::Status::unimplemented("not in this test"))
        }

        async fn install_snapshot(
            &self,
            _: tonic::Request<RaftPayload>,
        ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
            Err(tonic::Status::unimplemented("not in this test"))
        }
    }

    /// Serves `mode` on a loopback port; returns the counters and a network to it.
    async fn peer(mode: Mode) -> (Fake, Network) {
        let fake = Fake {
            mode,
            opened: Arc::default(),
            streamed: Arc::default(),
            unary: Arc::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(crate::pb::raft_server::RaftServer::new(fake.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut factory = NetworkFactory {
            connect_timeout: Duration::from_secs(5),
            tls: None,
        };
        let network = factory
            .new_client(2, &BasicNode::new(addr.to_string()))
            .await;
        (fake, network)
    }

    async fn append(n: &mut Network) -> Result<(), String> {
        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new(1, 1),
            prev_log_id: None,
            entries: vec![],
            leader_commit: None,
        };
        match n
            .append_entries(rpc, RPCOption::new(Duration::from_secs(5)))
            .await
        {
            Ok(AppendEntriesResponse::Success) => Ok(()),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(RPCError::Unreachable(e)) => Err(format!("unreachable: {e}")),
            Err(e) => Err(format!("other error: {e}")),
        }
    }

    #[tokio::test]
    async fn given_a_follower_then_appends_share_one_stream() {
        let (fake, mut n) = peer(Mode::Stream).await;
        for _ in 0..5 {
            append(&mut n).await.unwrap();
        }
        assert_eq!(fake.opened.load(Ordering::SeqCst), 1);
        assert_eq!(fake.streamed.load(Ordering::SeqCst), 5);
        assert_eq!(fake.unary.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn given_a_peer_without_the_stream_then_appends_fall_back_to_unary_calls() {
        let (fake, mut n) = peer(Mode::NoStream).await;
        for _ in 0..3 {
            append(&mut n).await.unwrap();
        }
        assert_eq!(fake.opened.load(Ordering::SeqCst), 1, "asked once");
        assert_eq!(fake.unary.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn given_a_stream_that_ended_then_the_round_is_tried_again_on_a_new_stream() {
        let (fake, mut n) = peer(Mode::EndAfterOne).await;
        // Each stream answers once: every later round finds its stream ended, and succeeds on
        // a new one.
        for _ in 0..3 {
            append(&mut n).await.unwrap();
        }
        assert_eq!(fake.opened.load(Ordering::SeqCst), 3);
        assert_eq!(fake.streamed.load(Ordering::SeqCst), 3);
        assert_eq!(fake.unary.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn given_no_peer_listening_then_appends_fail_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let mut factory = NetworkFactory {
            connect_timeout: Duration::from_secs(5),
            tls: None,
        };
        let mut n = factory
            .new_client(2, &BasicNode::new(addr.to_string()))
            .await;
        for _ in 0..2 {
            let err = append(&mut n).await.unwrap_err();
            assert!(err.starts_with("unreachable"), "{err}");
        }
    }
}
