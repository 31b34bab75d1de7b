//! Raft RPCs between metadata nodes over tonic gRPC.
//!
//! The payloads are openraft's own request and response types, bincode-encoded inside a
//! `RaftPayload` message; a response carries `Result<Response, RaftError>` so the remote node's
//! refusal reaches openraft as a [`RemoteError`], distinct from an unreachable peer.

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
use crate::{NodeId, Raft, TypeConfig};

/// A lazily connecting channel to `addr` (`host:port`).
pub fn channel(addr: &str, connect_timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
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
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = Network;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Network {
        Network {
            target,
            target_node: node.clone(),
            client: channel(&node.addr, self.connect_timeout)
                .map(RaftClient::new)
                .map_err(|e| e.to_string()),
        }
    }
}

pub struct Network {
    target: NodeId,
    target_node: BasicNode,
    client: Result<RaftClient<Channel>, String>,
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
        let client = match &self.client {
            Ok(c) => c.clone(),
            Err(e) => return Err(RPCError::Unreachable(Unreachable::new(&Msg(e.clone())))),
        };
        let mut request = tonic::Request::new(encode(req));
        request.set_timeout(option.hard_ttl());
        let response = match which(client, request).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                let err = Msg(format!("node {}: {status}", self.target));
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        RPCError::Unreachable(Unreachable::new(&err))
                    }
                    _ => RPCError::Network(NetworkError::new(&err)),
                });
            }
        };
        let result: Result<Resp, RaftError<NodeId, E>> =
            decode(&response).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.target_node.clone(),
                e,
            ))
        })
    }
}

impl RaftNetwork<TypeConfig> for Network {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
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
}

fn bad_payload(e: bincode::Error) -> tonic::Status {
    tonic::Status::invalid_argument(format!("undecodable Raft payload: {e}"))
}

#[tonic::async_trait]
impl crate::pb::raft_server::Raft for RaftService {
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
