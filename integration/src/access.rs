//! Attempts on a site's internal ports (the metadata store's client API and Raft RPCs, a
//! bookie's requests) as a given peer, and the verdict each shows: no connection at all (the
//! TLS handshake failed), denied by role, or admitted (an answer from the service behind the
//! check). The authorization tests (`tests/roles_tls.rs`, `tests/authz_matrix.rs`) are made
//! of them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use meridian_metadata::pb;
use meridian_metadata::tls::{rustls, SiteTls};
use meridian_storage::proto::{self, Frame, Request, Response, Status};
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Makes the certificate of `role` `name` of the site CA in `ca_dir` (made by `meridian-admin
/// site-tls create-ca`) in `dir`, for 127.0.0.1: its certificate and key files.
pub fn site_cert(
    dir: &Path,
    ca_dir: &Path,
    role: &str,
    name: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (code, out, err) = crate::run_admin(&[
        "site-tls",
        "create-cert",
        "--role",
        role,
        "--name",
        name,
        "--ca-dir",
        ca_dir.to_str().unwrap(),
        "--out-dir",
        dir.to_str().unwrap(),
        "--san-ip",
        "127.0.0.1",
    ])
    .expect("meridian-admin runs");
    assert_eq!(code, 0, "site-tls create-cert {role} {name}: {out}{err}");
    (
        dir.join(format!("{role}-{name}.pem")),
        dir.join(format!("{role}-{name}.key")),
    )
}

/// How a peer tries a port.
#[derive(Clone)]
pub enum Peer {
    Plaintext,
    /// TLS trusting the site CA, presenting no certificate.
    NoCertificate,
    /// TLS presenting this certificate (and trusting the site CA).
    Certificate(Arc<SiteTls>),
}

pub const HANDSHAKE: &str = "no connection";
pub const DENIED: &str = "denied";
pub const ADMITTED: &str = "admitted";

/// The first word of a verdict: the cell of a matrix.
pub fn cell(verdict: &str) -> &str {
    verdict.split(':').next().unwrap_or(verdict)
}

/// A gRPC channel to `addr` as `peer`.
pub fn grpc_channel(addr: &str, peer: &Peer, site_ca: &Path) -> tonic::transport::Channel {
    let timeout = Duration::from_secs(5);
    match peer {
        Peer::Plaintext => meridian_metadata::network::channel(addr, timeout, None).unwrap(),
        Peer::Certificate(tls) => {
            meridian_metadata::network::channel(addr, timeout, Some(tls)).unwrap()
        }
        Peer::NoCertificate => {
            let ca = tonic::transport::Certificate::from_pem(std::fs::read(site_ca).unwrap());
            tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(ca))
                .unwrap()
                .connect_timeout(timeout)
                .connect_lazy()
        }
    }
}

/// What a gRPC answer says about the peer: denied by role, no connection at all, or admitted
/// (an answer, or one of `admitted_codes`, from the service behind the check).
pub fn grpc_verdict<T>(r: Result<T, tonic::Status>, admitted_codes: &[tonic::Code]) -> String {
    match r {
        Ok(_) => ADMITTED.to_string(),
        Err(s) if admitted_codes.contains(&s.code()) => ADMITTED.to_string(),
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
            ) =>
        {
            format!("{DENIED}: {}", s.message())
        }
        Err(s) => format!("{HANDSHAKE}: {:?} {}", s.code(), s.message()),
    }
}

fn metadata_client(
    addr: &str,
    peer: &Peer,
    ca: &Path,
) -> pb::metadata_client::MetadataClient<tonic::transport::Channel> {
    pb::metadata_client::MetadataClient::new(grpc_channel(addr, peer, ca))
}

fn timed<T>(message: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.set_timeout(Duration::from_secs(5));
    req
}

/// The metadata store's client API: the members (a read).
pub async fn try_metadata_api(addr: &str, peer: &Peer, ca: &Path) -> String {
    let r = metadata_client(addr, peer, ca)
        .members(timed(pb::MembersRequest {}))
        .await;
    grpc_verdict(r, &[])
}

/// A put of `key` (a transaction of one put).
pub async fn try_metadata_put(addr: &str, peer: &Peer, ca: &Path, key: &str) -> String {
    let txn = pb::TxnRequest {
        conditions: Vec::new(),
        success: vec![pb::Op {
            op: Some(pb::op::Op::Put(pb::PutOp {
                key: key.to_string(),
                value: b"probe".to_vec(),
                ..Default::default()
            })),
        }],
        failure: Vec::new(),
    };
    grpc_verdict(metadata_client(addr, peer, ca).txn(timed(txn)).await, &[])
}

/// Removing a node that is not a member: a peer the check admits gets FAILED_PRECONDITION
/// ("not a member"), so nothing changes either way. From a follower, the request is forwarded
/// to the leader under the follower's own certificate.
pub async fn try_membership(addr: &str, peer: &Peer, ca: &Path) -> String {
    let r = metadata_client(addr, peer, ca)
        .remove_member(timed(pb::RemoveMemberRequest { id: 99 }))
        .await;
    grpc_verdict(r, &[tonic::Code::FailedPrecondition])
}

/// A Vote whose payload is not a vote: a peer the check admits gets the Raft service's
/// INVALID_ARGUMENT (nothing reaches Raft, the cluster is not disturbed).
pub async fn try_raft(addr: &str, peer: &Peer, ca: &Path) -> String {
    let mut c = pb::raft_client::RaftClient::new(grpc_channel(addr, peer, ca));
    let r = c
        .vote(timed(pb::RaftPayload {
            data: vec![0xff; 3],
        }))
        .await;
    grpc_verdict(r, &[tonic::Code::InvalidArgument])
}

/// An add whose entry is not an envelope (a peer the check admits gets a checksum refusal:
/// nothing is stored).
pub fn bookie_add_probe(ledger_id: u64) -> Request {
    Request::Add {
        ledger_id,
        entry_id: 0,
        flags: 0,
        master_key: Bytes::from_static(b"probe"),
        entry: Bytes::from_static(&[0u8; 40]),
    }
}

/// One request on a raw connection to the bookie at `addr`, as `peer`.
pub async fn try_bookie(addr: &str, peer: &Peer, ca: &Path, request: Request) -> String {
    let tcp = match tokio::net::TcpStream::connect(addr).await {
        Ok(t) => t,
        Err(e) => return format!("{HANDSHAKE}: {e}"),
    };
    let config = match peer {
        Peer::Plaintext => return bookie_exchange(tcp, request).await,
        Peer::Certificate(tls) => return bookie_tls(tls.connector(), tcp, request).await,
        Peer::NoCertificate => {
            let mut roots = rustls::RootCertStore::empty();
            for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(c.unwrap()).unwrap();
            }
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth()
        }
    };
    bookie_tls(
        tokio_rustls::TlsConnector::from(Arc::new(config)),
        tcp,
        request,
    )
    .await
}

async fn bookie_tls(
    connector: tokio_rustls::TlsConnector,
    tcp: tokio::net::TcpStream,
    request: Request,
) -> String {
    let name = meridian_metadata::tls::server_name("127.0.0.1:1").unwrap();
    match connector.connect(name, tcp).await {
        Ok(stream) => bookie_exchange(stream, request).await,
        Err(e) => format!("{HANDSHAKE}: {e}"),
    }
}

async fn bookie_exchange<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, request: Request) -> String {
    let mut out = Vec::new();
    proto::encode(&Frame::Request { id: 7, request }, &mut out);
    if let Err(e) = s.write_all(&out).await {
        return format!("{HANDSHAKE}: {e}");
    }
    let _ = s.flush().await;
    let mut buf = BytesMut::new();
    let read = async {
        loop {
            if let Some(frame) = proto::decode(&mut buf, 1 << 20).map_err(|e| e.to_string())? {
                return Ok(frame);
            }
            match s.read_buf(&mut buf).await {
                Ok(0) => return Err("closed".to_string()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Err(_) => format!("{HANDSHAKE}: no answer"),
        Ok(Err(e)) => format!("{HANDSHAKE}: {e}"),
        Ok(Ok(Frame::Response { response, .. })) => {
            let status = match response {
                Response::Add { status, .. }
                | Response::Read { status, .. }
                | Response::ReadRange { status, .. }
                | Response::Lac { status, .. }
                | Response::Delete { status, .. } => status,
            };
            if status == Status::Forbidden {
                DENIED.to_string()
            } else {
                format!("{ADMITTED}: {status:?}")
            }
        }
        Ok(Ok(other)) => panic!("the bookie sent {other:?}"),
    }
}

/// An operation of the Pulsar protocol whose authorization a test tries, on topic `t` of a
/// namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PulsarOp {
    Lookup,
    PartitionedMetadata,
    Produce,
    Consume,
    ListTopics,
    /// GET_OR_CREATE_SCHEMA: registers a schema, as a producer would.
    CreateSchema,
    GetSchema,
}

impl PulsarOp {
    pub const ALL: [PulsarOp; 7] = [
        PulsarOp::Lookup,
        PulsarOp::PartitionedMetadata,
        PulsarOp::Produce,
        PulsarOp::Consume,
        PulsarOp::ListTopics,
        PulsarOp::CreateSchema,
        PulsarOp::GetSchema,
    ];
}

/// Runs one operation of the Pulsar protocol on topic `t` of `ns` over a new connection
/// (authenticated with `token`, if any): Ok, or the refusal.
pub fn try_pulsar(
    url: &str,
    token: Option<&str>,
    ns: &str,
    op: PulsarOp,
) -> Result<(), (meridian_protocol::pb::ServerError, String)> {
    use crate::raw::{cmd, error_of, producer, subscribe, Raw};
    use meridian_protocol::pb::{self, base_command::Type, ServerError};
    let topic = format!("persistent://{ns}/t");
    let mut c = Raw::connect_as(url, token)?;
    let refusal = |e: Option<i32>, m: Option<String>| match e {
        None => Ok(()),
        Some(e) => Err((
            ServerError::try_from(e).unwrap_or(ServerError::UnknownError),
            m.unwrap_or_default(),
        )),
    };
    match op {
        PulsarOp::Lookup => {
            c.send(&cmd(Type::Lookup, |x| {
                x.lookup_topic = Some(pb::CommandLookupTopic {
                    topic: topic.clone(),
                    request_id: 1,
                    ..Default::default()
                })
            }));
            let f = c.expect();
            let r = f.command.lookup_topic_response.expect("LOOKUP_RESPONSE");
            refusal(r.error, r.message)
        }
        PulsarOp::PartitionedMetadata => {
            c.send(&cmd(Type::PartitionedMetadata, |x| {
                x.partition_metadata = Some(pb::CommandPartitionedTopicMetadata {
                    topic: topic.clone(),
                    request_id: 1,
                })
            }));
            let f = c.expect();
            let r = f
                .command
                .partition_metadata_response
                .expect("PARTITIONED_METADATA_RESPONSE");
            refusal(r.error, r.message)
        }
        PulsarOp::Produce | PulsarOp::Consume | PulsarOp::ListTopics => {
            c.send(&match op {
                PulsarOp::Produce => producer(&topic, 1, 1),
                PulsarOp::Consume => subscribe(&topic, "matrix", 1, 1),
                _ => cmd(Type::GetTopicsOfNamespace, |x| {
                    x.get_topics_of_namespace = Some(pb::CommandGetTopicsOfNamespace {
                        request_id: 1,
                        namespace: ns.to_string(),
                        ..Default::default()
                    })
                }),
            });
            let f = c.expect();
            if f.command.error.is_some() {
                Err(error_of(&f))
            } else {
                Ok(())
            }
        }
        PulsarOp::CreateSchema | PulsarOp::GetSchema => {
            c.send(&schema_request(&topic, op == PulsarOp::CreateSchema));
            let f = c.expect();
            if let Some(r) = f.command.get_or_create_schema_response {
                refusal(r.error_code, r.error_message)
            } else if let Some(r) = f.command.get_schema_response {
                refusal(r.error_code, r.error_message)
            } else {
                panic!("expected a schema response, got {:?}", f.command)
            }
        }
    }
}

/// GET_OR_CREATE_SCHEMA of a STRING schema (`create`), or GET_SCHEMA of the latest version.
fn schema_request(topic: &str, create: bool) -> meridian_protocol::pb::BaseCommand {
    use crate::raw::cmd;
    use meridian_protocol::pb::{self, base_command::Type};
    if create {
        cmd(Type::GetOrCreateSchema, |x| {
            x.get_or_create_schema = Some(pb::CommandGetOrCreateSchema {
                request_id: 1,
                topic: topic.to_string(),
                schema: pb::Schema {
                    name: "s".into(),
                    schema_data: Vec::new(),
                    r#type: 1, // STRING
                    properties: Vec::new(),
                },
            })
        })
    } else {
        cmd(Type::GetSchema, |x| {
            x.get_schema = Some(pb::CommandGetSchema {
                request_id: 1,
                topic: topic.to_string(),
                schema_version: None,
            })
        })
    }
}
