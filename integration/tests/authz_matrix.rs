//! The full authorization matrix (issue 23): every identity against every operation a site
//! serves (the Pulsar protocol, every RPC of the admin API, HTTP, the metadata store, the
//! bookie, the geo link), for a target in tenant `ta` and one in tenant `tb`.
//!
//! One site "east" of separate processes (a metadata node, a bookie and a broker) with TLS
//! between them; the broker with token authentication and a geo link. What each identity may do is data below: the class of each operation ([`OPS`],
//! [`ADMIN_RPCS`]) and the classes each identity holds in each tenant ([`HOLDS`]). The test
//! tries every cell, prints the table, and fails on any cell that differs: an escape (allowed,
//! expected refused), a refusal expected allowed, or an answer that is neither. Every RPC of
//! `admin.proto` must have its row, so a new one cannot be left out.
//!
//! A cell is "admitted" when the answer comes from behind the check: success, or a refusal of
//! the request itself (not found, already exists, a bad argument, a failed precondition). A
//! refusal must be the one the identity's kind gets: an authentication or authorization error
//! for a token, no TLS connection for a peer without a certificate of the site's CA, a denial
//! by role for one with such a certificate; any other answer is a wrong cell. The requests
//! are chosen so that what an admitted call does cannot change what later cells see: a
//! deletion names something that does not exist, a creation something that does, and the
//! metadata keys the probes write are removed after each cell (a subscription, a schema, a
//! drill report and a geo tombstone do stay).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meridian_geo::frame::{Frame, RefusalCode, PROTOCOL_VERSION};
use meridian_geo::link::{read_frame, write_frame};
use meridian_integration::access::{
    bookie_add_probe, cell, site_cert, try_bookie, try_membership, try_metadata_api,
    try_metadata_put, try_pulsar, try_raft, Peer, PulsarOp, ADMITTED, DENIED, HANDSHAKE,
};
use meridian_integration::geo_sites::admin_ok;
use meridian_integration::{
    free_udp_port, http_get_with, run_admin, step, BookieProc, BrokerProc, MetaNode,
};
use meridian_metadata::tls::{rustls, SiteTls};
use meridian_storage::proto::Request;
use meridian_tenancy::pb;
use meridian_tenancy::pb::admin_client::AdminClient;
use tonic::transport::Channel;

/// What an operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Everyone, even unauthenticated.
    Open,
    /// Any valid token.
    Authenticated,
    Superuser,
    /// An admin role of the target's tenant (or a superuser).
    TenantAdmin,
    /// A tenant admin, or a role granted produce or consume on the target's namespace.
    Reader,
    /// A tenant admin, or a role granted produce on the namespace.
    Producer,
    /// A tenant admin, or a role granted consume on the namespace.
    Consumer,
    /// The metadata store's client API (reads).
    MetadataApi,
    /// A put of any key in the metadata store.
    MetadataWrite,
    /// A put under `/bookies/available/` (a bookie's registration).
    BookieRegistration,
    /// Adding or removing metadata members.
    Membership,
    /// Raft RPCs between metadata nodes.
    Raft,
    /// Reading a bookie's entries.
    BookieRead,
    /// Adding, fencing or deleting in a bookie.
    BookieWrite,
    /// A geo link from a site the registry knows.
    GeoLink,
    /// Replicating into the target: its namespace lists the peer's site.
    GeoReplicate,
}

use Class::*;

/// Does an operation concern a tenant (tried for `ta` and for `tb`) or the site (tried once)?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Site,
    Tenant,
}

/// Every identity, and the classes it holds: (name, in tenant ta, in tenant tb). Site-wide
/// operations are checked against the first list.
const HOLDS: &[(&str, &[Class], &[Class])] = &[
    ("anonymous", &[Open], &[Open]),
    ("bad token", &[Open], &[Open]),
    ("expired token", &[Open], &[Open]),
    (
        "producer of ta/ns1",
        &[Open, Authenticated, Reader, Producer],
        &[Open, Authenticated],
    ),
    (
        "consumer of ta/ns1",
        &[Open, Authenticated, Reader, Consumer],
        &[Open, Authenticated],
    ),
    (
        "admin of ta",
        &[Open, Authenticated, TenantAdmin, Reader, Producer, Consumer],
        &[Open, Authenticated],
    ),
    (
        "admin of tb",
        &[Open, Authenticated],
        &[Open, Authenticated, TenantAdmin, Reader, Producer, Consumer],
    ),
    (
        "superuser",
        &[
            Open,
            Authenticated,
            Superuser,
            TenantAdmin,
            Reader,
            Producer,
            Consumer,
        ],
        &[
            Open,
            Authenticated,
            Superuser,
            TenantAdmin,
            Reader,
            Producer,
            Consumer,
        ],
    ),
    // ta/g lists west; tb/g does not.
    (
        "site west",
        &[Open, GeoLink, GeoReplicate],
        &[Open, GeoLink],
    ),
    ("site north (not registered)", &[Open], &[Open]),
    ("site west saying it is east", &[Open], &[Open]),
    (
        "metadata node 1",
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            Membership,
            Raft,
        ],
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            Membership,
            Raft,
        ],
    ),
    (
        "metadata node 9 (no member)",
        &[Open, MetadataApi, MetadataWrite, BookieRegistration],
        &[Open, MetadataApi, MetadataWrite, BookieRegistration],
    ),
    (
        "bookie",
        &[Open, MetadataApi, BookieRegistration, BookieRead],
        &[Open, MetadataApi, BookieRegistration, BookieRead],
    ),
    (
        "broker",
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            BookieRead,
            BookieWrite,
        ],
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            BookieRead,
            BookieWrite,
        ],
    ),
    (
        "admin tool",
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            Membership,
            BookieRead,
        ],
        &[
            Open,
            MetadataApi,
            MetadataWrite,
            BookieRegistration,
            Membership,
            BookieRead,
        ],
    ),
    ("broker of west's CA", &[Open], &[Open]),
];

/// An operation other than the admin API's.
#[derive(Debug, Clone, Copy)]
enum Op {
    Pulsar(PulsarOp),
    Http(&'static str),
    MetadataMembers,
    MetadataPut(&'static str),
    MetadataRemoveMember,
    RaftVote,
    BookieRead,
    BookieAdd,
    BookieFence,
    BookieDelete,
    GeoHello,
    GeoOpen,
    GeoDelete,
    GeoSubscriptionSync,
}

/// The operations other than the admin API's, with their class and scope.
const OPS: &[(&str, Op, Class, Scope)] = &[
    (
        "pulsar LOOKUP",
        Op::Pulsar(PulsarOp::Lookup),
        Reader,
        Scope::Tenant,
    ),
    (
        "pulsar PARTITIONED_METADATA",
        Op::Pulsar(PulsarOp::PartitionedMetadata),
        Reader,
        Scope::Tenant,
    ),
    (
        "pulsar PRODUCER",
        Op::Pulsar(PulsarOp::Produce),
        Producer,
        Scope::Tenant,
    ),
    (
        "pulsar SUBSCRIBE",
        Op::Pulsar(PulsarOp::Consume),
        Consumer,
        Scope::Tenant,
    ),
    (
        "pulsar GET_TOPICS_OF_NAMESPACE",
        Op::Pulsar(PulsarOp::ListTopics),
        Reader,
        Scope::Tenant,
    ),
    (
        "pulsar GET_OR_CREATE_SCHEMA",
        Op::Pulsar(PulsarOp::CreateSchema),
        Producer,
        Scope::Tenant,
    ),
    (
        "pulsar GET_SCHEMA",
        Op::Pulsar(PulsarOp::GetSchema),
        Reader,
        Scope::Tenant,
    ),
    ("http /stats", Op::Http("/stats"), Superuser, Scope::Site),
    (
        "http /metrics",
        Op::Http("/metrics"),
        Superuser,
        Scope::Site,
    ),
    (
        "http /console",
        Op::Http("/console"),
        Superuser,
        Scope::Site,
    ),
    (
        "http /console/data",
        Op::Http("/console/data"),
        Superuser,
        Scope::Site,
    ),
    ("http /health", Op::Http("/health"), Open, Scope::Site),
    (
        "metadata Members",
        Op::MetadataMembers,
        MetadataApi,
        Scope::Site,
    ),
    (
        "metadata put /matrix/probe",
        Op::MetadataPut("/matrix/probe"),
        MetadataWrite,
        Scope::Site,
    ),
    (
        "metadata put /bookies/available/probe",
        Op::MetadataPut("/bookies/available/probe"),
        BookieRegistration,
        Scope::Site,
    ),
    (
        "metadata put /bookies/decommissioned/probe",
        Op::MetadataPut("/bookies/decommissioned/probe"),
        MetadataWrite,
        Scope::Site,
    ),
    (
        "metadata put /bookies/racks/probe",
        Op::MetadataPut("/bookies/racks/probe"),
        MetadataWrite,
        Scope::Site,
    ),
    (
        "metadata RemoveMember",
        Op::MetadataRemoveMember,
        Membership,
        Scope::Site,
    ),
    ("raft Vote", Op::RaftVote, Raft, Scope::Site),
    ("bookie read", Op::BookieRead, BookieRead, Scope::Site),
    ("bookie add", Op::BookieAdd, BookieWrite, Scope::Site),
    ("bookie fence", Op::BookieFence, BookieWrite, Scope::Site),
    ("bookie delete", Op::BookieDelete, BookieWrite, Scope::Site),
    ("geo link hello", Op::GeoHello, GeoLink, Scope::Site),
    (
        "geo open (replicate into)",
        Op::GeoOpen,
        GeoReplicate,
        Scope::Tenant,
    ),
    ("geo delete", Op::GeoDelete, GeoReplicate, Scope::Tenant),
    (
        "geo subscription sync",
        Op::GeoSubscriptionSync,
        GeoReplicate,
        Scope::Tenant,
    ),
];

/// Every RPC of the admin API, with its class and scope.
const ADMIN_RPCS: &[(&str, Class, Scope)] = &[
    ("ListClusters", Authenticated, Scope::Site),
    ("GetCluster", Authenticated, Scope::Site),
    ("CreateCluster", Superuser, Scope::Site),
    ("UpdateCluster", Superuser, Scope::Site),
    ("DeleteCluster", Superuser, Scope::Site),
    ("ListTenants", Authenticated, Scope::Site),
    ("GetTenant", TenantAdmin, Scope::Tenant),
    ("CreateTenant", Superuser, Scope::Tenant),
    ("UpdateTenant", Superuser, Scope::Tenant),
    ("DeleteTenant", Superuser, Scope::Tenant),
    ("ListNamespaces", TenantAdmin, Scope::Tenant),
    ("GetNamespace", TenantAdmin, Scope::Tenant),
    ("CreateNamespace", TenantAdmin, Scope::Tenant),
    ("UpdateNamespacePolicies", TenantAdmin, Scope::Tenant),
    ("DeleteNamespace", TenantAdmin, Scope::Tenant),
    ("GrantPermission", TenantAdmin, Scope::Tenant),
    ("RevokePermission", TenantAdmin, Scope::Tenant),
    ("GetPermissions", TenantAdmin, Scope::Tenant),
    ("ListTopics", Reader, Scope::Tenant),
    ("CreateTopic", TenantAdmin, Scope::Tenant),
    ("UpdatePartitions", TenantAdmin, Scope::Tenant),
    ("GetTopicStats", Reader, Scope::Tenant),
    ("GetNamespaceTopicStats", Reader, Scope::Tenant),
    ("TerminateTopic", TenantAdmin, Scope::Tenant),
    ("CompactTopic", TenantAdmin, Scope::Tenant),
    ("ListBrokers", Superuser, Scope::Site),
    ("LookupTopic", Reader, Scope::Tenant),
    ("GetBundles", Reader, Scope::Tenant),
    ("UnloadNamespace", TenantAdmin, Scope::Tenant),
    ("SplitNamespaceBundle", TenantAdmin, Scope::Tenant),
    ("GetLeaderBroker", Superuser, Scope::Site),
    ("ListBookies", Superuser, Scope::Site),
    ("SetBookieRack", Superuser, Scope::Site),
    ("SetNsIsolationPolicy", Superuser, Scope::Tenant),
    ("GetNsIsolationPolicies", Superuser, Scope::Site),
    ("DeleteNsIsolationPolicy", Superuser, Scope::Site),
    ("SetBookieGroup", Superuser, Scope::Site),
    ("DecommissionBookie", Superuser, Scope::Site),
    ("ListUnderReplicated", Superuser, Scope::Site),
    ("GetCompactionStatus", Reader, Scope::Tenant),
    ("DeleteTopic", TenantAdmin, Scope::Tenant),
    ("DeleteRemoteData", TenantAdmin, Scope::Tenant),
    ("UnloadTopic", TenantAdmin, Scope::Tenant),
    ("GetTopicInternalStats", Reader, Scope::Tenant),
    ("GetTopicPolicies", TenantAdmin, Scope::Tenant),
    ("UpdateTopicPolicies", TenantAdmin, Scope::Tenant),
    ("ListSubscriptions", Reader, Scope::Tenant),
    ("CreateSubscription", TenantAdmin, Scope::Tenant),
    ("DeleteSubscription", TenantAdmin, Scope::Tenant),
    ("PeekMessages", TenantAdmin, Scope::Tenant),
    ("SkipMessages", TenantAdmin, Scope::Tenant),
    ("ClearBacklog", TenantAdmin, Scope::Tenant),
    ("ExpireMessages", TenantAdmin, Scope::Tenant),
    ("ResetCursor", TenantAdmin, Scope::Tenant),
    (
        "SetReplicatedSubscriptionStatus",
        TenantAdmin,
        Scope::Tenant,
    ),
    (
        "GetReplicatedSubscriptionStatus",
        TenantAdmin,
        Scope::Tenant,
    ),
    ("GeoExposure", TenantAdmin, Scope::Tenant),
    ("GeoCut", TenantAdmin, Scope::Tenant),
    ("ProbeTopic", Reader, Scope::Tenant),
    ("ProbeSubscriptions", Reader, Scope::Tenant),
    ("PutDrillReport", Superuser, Scope::Site),
    ("ListDrillReports", Superuser, Scope::Site),
    ("GetDrillReport", Superuser, Scope::Site),
];

/// An identity: what it presents on each surface.
struct Who {
    name: &'static str,
    /// Its bearer token (Pulsar protocol, admin API, HTTP).
    token: Option<String>,
    /// How it meets the metadata store and the bookie.
    internal: Peer,
    /// Its `internal` certificate is of the site's CA: refused by role there (denied), not at
    /// the TLS handshake.
    of_site_ca: bool,
    /// The certificate and key it presents on the geo link (none: no client certificate),
    /// and the site it says it is in its hello.
    geo: (Option<(PathBuf, PathBuf)>, &'static str),
}

/// A cell's outcome: admitted, refused by the check, or an answer that is neither.
#[derive(Debug, PartialEq)]
enum Verdict {
    Yes,
    No,
    Odd(String),
}

fn verdict_of_grpc(r: Result<(), tonic::Status>) -> (Verdict, String) {
    use tonic::Code;
    match r {
        Ok(()) => (Verdict::Yes, "ok".into()),
        Err(s) => {
            let why = format!("{:?}: {}", s.code(), s.message());
            let v = match s.code() {
                Code::PermissionDenied | Code::Unauthenticated => Verdict::No,
                Code::NotFound
                | Code::AlreadyExists
                | Code::InvalidArgument
                | Code::FailedPrecondition => Verdict::Yes,
                _ => Verdict::Odd(why.clone()),
            };
            (v, why)
        }
    }
}

/// A verdict string of [`meridian_integration::access`] as a [`Verdict`]: a refusal is the
/// kind that `who` must get (a denial by role with a certificate of the site's CA, a failed
/// TLS handshake without one).
fn verdict_of_access(v: &str, who: &Who) -> Verdict {
    match (cell(v), who.of_site_ca) {
        (ADMITTED, _) => Verdict::Yes,
        (DENIED, true) | (HANDSHAKE, false) => Verdict::No,
        _ => Verdict::Odd(v.to_string()),
    }
}

/// Calls admin RPC `rpc` for tenant `t` with `token`. Targets that must not change are
/// named so that an admitted call is refused by the service instead (see the module's note).
async fn admin_call(
    c: &mut AdminClient<Channel>,
    token: Option<&str>,
    rpc: &str,
    t: &str,
) -> Result<(), tonic::Status> {
    fn req<T>(m: T, token: Option<&str>) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        r.set_timeout(Duration::from_secs(20));
        if let Some(tok) = token {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {tok}").parse().unwrap());
        }
        r
    }
    let ns = format!("{t}/ns1");
    let topic = format!("persistent://{t}/ns1/t");
    // In a namespace that does not exist: a tenant admin's call is refused as not found.
    let ghost_ns = format!("{t}/ghost");
    let ghost_topic = format!("persistent://{t}/ghost/t");
    let name = |n: &str| pb::Name { name: n.into() };
    let delete = |n: &str| pb::DeleteRequest {
        name: n.into(),
        dry_run: true,
        force: false,
    };
    let sub = |s: &str| pb::SubscriptionRequest {
        topic: topic.clone(),
        subscription: s.into(),
        dry_run: true,
    };
    macro_rules! call {
        ($m:ident, $arg:expr) => {
            c.$m(req($arg, token)).await.map(|_| ())
        };
    }
    match rpc {
        "ListClusters" => call!(list_clusters, pb::Empty {}),
        "GetCluster" => call!(get_cluster, name("east")),
        "CreateCluster" => call!(
            create_cluster,
            pb::Cluster {
                name: "east".into(),
                service_url: "pulsar://127.0.0.1:1".into(),
                admin_url: "http://127.0.0.1:1".into(),
                geo_url: String::new(),
            }
        ),
        "UpdateCluster" => call!(
            update_cluster,
            pb::Cluster {
                name: "ghost-cluster".into(),
                service_url: "pulsar://127.0.0.1:1".into(),
                admin_url: "http://127.0.0.1:1".into(),
                geo_url: String::new(),
            }
        ),
        "DeleteCluster" => call!(delete_cluster, delete("ghost-cluster")),
        "ListTenants" => call!(list_tenants, pb::Empty {}),
        "GetTenant" => call!(get_tenant, name(t)),
        "CreateTenant" => call!(
            create_tenant,
            pb::Tenant {
                name: t.into(),
                admin_roles: vec!["intruder".into()],
                allowed_clusters: vec!["east".into()],
                storage_quota_bytes: None,
            }
        ),
        "UpdateTenant" => call!(
            update_tenant,
            pb::Tenant {
                name: format!("{t}-ghost"),
                admin_roles: vec!["intruder".into()],
                allowed_clusters: vec!["east".into()],
                storage_quota_bytes: None,
            }
        ),
        "DeleteTenant" => call!(delete_tenant, delete(&format!("{t}-ghost"))),
        "ListNamespaces" => call!(list_namespaces, name(t)),
        "GetNamespace" => call!(get_namespace, name(&ns)),
        "CreateNamespace" => call!(
            create_namespace,
            pb::Namespace {
                name: ns.clone(),
                policies: None,
            }
        ),
        "UpdateNamespacePolicies" => call!(
            update_namespace_policies,
            pb::UpdatePoliciesRequest {
                namespace: ghost_ns.clone(),
                set: Some(pb::NamespacePolicies {
                    message_ttl_seconds: Some(1),
                    ..Default::default()
                }),
                clear: Vec::new(),
            }
        ),
        "DeleteNamespace" => call!(delete_namespace, delete(&ghost_ns)),
        "GrantPermission" | "RevokePermission" => {
            let p = pb::PermissionRequest {
                namespace: ghost_ns.clone(),
                role: "intruder".into(),
                actions: vec!["produce".into()],
            };
            if rpc == "GrantPermission" {
                call!(grant_permission, p)
            } else {
                call!(revoke_permission, p)
            }
        }
        "GetPermissions" => call!(get_permissions, name(&ns)),
        "ListTopics" => call!(list_topics, name(&ns)),
        "CreateTopic" => call!(
            create_topic,
            pb::CreateTopicRequest {
                topic: topic.clone(),
                partitions: 0,
            }
        ),
        "UpdatePartitions" => call!(
            update_partitions,
            pb::UpdatePartitionsRequest {
                topic: ghost_topic.clone(),
                partitions: 4,
            }
        ),
        "GetTopicStats" => call!(get_topic_stats, name(&topic)),
        "GetNamespaceTopicStats" => call!(get_namespace_topic_stats, name(&ns)),
        "TerminateTopic" => call!(terminate_topic, name(&ghost_topic)),
        "CompactTopic" => call!(compact_topic, name(&ghost_topic)),
        "ListBrokers" => call!(list_brokers, pb::Empty {}),
        "LookupTopic" => call!(lookup_topic, name(&topic)),
        "GetBundles" => call!(get_bundles, name(&ns)),
        "UnloadNamespace" => call!(
            unload_namespace,
            pb::UnloadNamespaceRequest {
                namespace: ghost_ns.clone(),
                bundle: String::new(),
            }
        ),
        "SplitNamespaceBundle" => call!(
            split_namespace_bundle,
            pb::SplitBundleRequest {
                namespace: ghost_ns.clone(),
                bundle: "0x00000000_0x40000000".into(),
                unload: false,
            }
        ),
        "GetLeaderBroker" => call!(get_leader_broker, pb::Empty {}),
        "ListBookies" => call!(list_bookies, pb::Empty {}),
        "SetBookieRack" => call!(
            set_bookie_rack,
            pb::SetBookieRackRequest {
                address: "127.0.0.1:1".into(),
                rack: "/matrix".into(),
            }
        ),
        "SetNsIsolationPolicy" => call!(
            set_ns_isolation_policy,
            pb::NsIsolationPolicyRequest {
                cluster: "ghost-cluster".into(),
                name: "matrix".into(),
                policy: Some(pb::NsIsolationPolicy {
                    namespaces: vec![format!("{t}/.*")],
                    primary: vec!["127.0.0.1:1".into()],
                    secondary: Vec::new(),
                    auto_failover_policy_type: "min_available".into(),
                    min_limit: 1,
                }),
            }
        ),
        "GetNsIsolationPolicies" => call!(get_ns_isolation_policies, name("east")),
        "DeleteNsIsolationPolicy" => call!(
            delete_ns_isolation_policy,
            pb::NsIsolationPolicyName {
                cluster: "east".into(),
                name: "ghost".into(),
            }
        ),
        "SetBookieGroup" => call!(
            set_bookie_group,
            pb::SetBookieGroupRequest {
                address: "127.0.0.1:1".into(),
                group: "matrix".into(),
            }
        ),
        "DecommissionBookie" => call!(
            decommission_bookie,
            pb::DecommissionBookieRequest {
                address: "127.0.0.1:1".into(),
            }
        ),
        "ListUnderReplicated" => call!(list_under_replicated, pb::Empty {}),
        "GetCompactionStatus" => call!(get_compaction_status, name(&topic)),
        "DeleteTopic" => call!(delete_topic, delete(&ghost_topic)),
        "DeleteRemoteData" => call!(
            delete_remote_data,
            pb::DeleteRemoteDataRequest {
                namespace: ghost_ns.clone(),
                sites: vec!["west".into()],
                dry_run: true,
            }
        ),
        "UnloadTopic" => call!(unload_topic, name(&ghost_topic)),
        "GetTopicInternalStats" => call!(get_topic_internal_stats, name(&topic)),
        "GetTopicPolicies" => call!(get_topic_policies, name(&topic)),
        "UpdateTopicPolicies" => call!(
            update_topic_policies,
            pb::UpdatePoliciesRequest {
                namespace: ghost_topic.clone(),
                set: Some(pb::NamespacePolicies {
                    message_ttl_seconds: Some(1),
                    ..Default::default()
                }),
                clear: Vec::new(),
            }
        ),
        "ListSubscriptions" => call!(list_subscriptions, name(&topic)),
        "CreateSubscription" => call!(
            create_subscription,
            pb::CreateSubscriptionRequest {
                topic: ghost_topic.clone(),
                subscription: "intruder".into(),
                position: "latest".into(),
            }
        ),
        "DeleteSubscription" => call!(delete_subscription, sub("ghost")),
        "PeekMessages" => call!(
            peek_messages,
            pb::PeekRequest {
                topic: topic.clone(),
                subscription: "ghost".into(),
                count: 1,
            }
        ),
        "SkipMessages" => call!(
            skip_messages,
            pb::SkipRequest {
                topic: topic.clone(),
                subscription: "ghost".into(),
                count: 1,
                dry_run: true,
            }
        ),
        "ClearBacklog" => call!(clear_backlog, sub("ghost")),
        "ExpireMessages" => call!(
            expire_messages,
            pb::ExpireRequest {
                topic: topic.clone(),
                subscription: "ghost".into(),
                expire_seconds: 1,
                dry_run: true,
            }
        ),
        "ResetCursor" => call!(
            reset_cursor,
            pb::ResetCursorRequest {
                topic: topic.clone(),
                subscription: "ghost".into(),
                to: Some(pb::reset_cursor_request::To::PublishTimeMs(0)),
            }
        ),
        "SetReplicatedSubscriptionStatus" => call!(
            set_replicated_subscription_status,
            pb::ReplicatedSubscriptionRequest {
                topic: topic.clone(),
                subscription: "ghost".into(),
                enabled: false,
            }
        ),
        "GetReplicatedSubscriptionStatus" => {
            call!(get_replicated_subscription_status, sub("ghost"))
        }
        "GeoExposure" => call!(
            geo_exposure,
            pb::GeoExposureRequest {
                topic: ghost_topic.clone(),
                remote: "west".into(),
            }
        ),
        "GeoCut" => call!(
            geo_cut,
            pb::GeoCutRequest {
                namespace: ghost_ns.clone(),
                to: "west".into(),
                cut: false,
                topics: Vec::new(),
            }
        ),
        "ProbeTopic" => call!(probe_topic, name(&topic)),
        "ProbeSubscriptions" => call!(probe_subscriptions, name(&topic)),
        "PutDrillReport" => call!(
            put_drill_report,
            pb::DrillReport {
                id: "matrix".into(),
                started_ms: 1,
                summary: "a cell of the authorization matrix".into(),
                json: "{}".into(),
            }
        ),
        "ListDrillReports" => call!(list_drill_reports, pb::Empty {}),
        "GetDrillReport" => call!(get_drill_report, name("ghost")),
        other => panic!("no call for admin RPC {other}: add it to admin_call"),
    }
}

/// A QUIC server certificate verifier that takes any certificate: the matrix tests what the
/// site's geo link admits, not what a peer trusts.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A geo-link connection to `addr` presenting `cert` (or no certificate) and naming itself
/// `site` in its hello; the error says how it was refused.
async fn geo_connect(
    addr: SocketAddr,
    cert: Option<&(PathBuf, PathBuf)>,
    site: &str,
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
    let mut config = match cert {
        None => builder.with_no_client_auth(),
        Some((c, k)) => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(c)
                .unwrap()
                .map(Result::unwrap)
                .collect();
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(k).unwrap())
                .unwrap()
        }
    };
    config.alpn_protocols = vec![meridian_geo::tls::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(config).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let within = Duration::from_secs(10);
    let conn = tokio::time::timeout(
        within,
        endpoint
            .connect(addr, meridian_geo::tls::SERVER_NAME)
            .unwrap(),
    )
    .await
    .map_err(|_| "no handshake within 10 s".to_string())?
    .map_err(|e| format!("handshake: {e}"))?;
    let hello = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        write_frame(
            &mut send,
            &Frame::Hello {
                version: PROTOCOL_VERSION,
                site: site.to_string(),
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        read_frame(&mut recv, 1 << 20)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(within, hello).await {
        Ok(Ok(Some(Frame::Welcome { .. }))) => Ok((endpoint, conn)),
        Ok(Ok(other)) => Err(format!("hello answered with {other:?}")),
        Ok(Err(e)) => Err(format!("hello: {e}")),
        Err(_) => Err("no welcome within 10 s".into()),
    }
}

/// One stream of the geo link that begins with `first`: admitted unless refused as not
/// allowed (a refusal of another kind is an answer from behind the check).
async fn geo_stream(conn: &quinn::Connection, first: Frame) -> (Verdict, String) {
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        write_frame(&mut send, &first)
            .await
            .map_err(|e| e.to_string())?;
        read_frame(&mut recv, 1 << 20)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(20), exchange).await {
        Err(_) => (
            Verdict::Odd("no answer".into()),
            "no answer within 20 s".into(),
        ),
        Ok(Err(e)) => (Verdict::Odd(e.clone()), e),
        Ok(Ok(Some(Frame::Refused { code, reason }))) => {
            let why = format!("{code:?}: {reason}");
            match code {
                RefusalCode::NotAllowed => (Verdict::No, why),
                RefusalCode::Protocol => (Verdict::Yes, why),
                _ => (Verdict::Odd(why.clone()), why),
            }
        }
        Ok(Ok(Some(f))) => (Verdict::Yes, format!("{f:?}").chars().take(80).collect()),
        Ok(Ok(None)) => (Verdict::Odd("stream ended".into()), "stream ended".into()),
    }
}

/// The site under test and where its ports are.
struct Site {
    /// A broker's client of the metadata store: removes what the probes wrote.
    cleanup: meridian_metadata::MetadataClient,
    /// The broker's Pulsar, HTTP and admin addresses.
    url: String,
    http: String,
    admin_url: String,
    metadata: String,
    bookie: String,
    geo: SocketAddr,
    site_ca: PathBuf,
}

/// Tries operation `op` for tenant `t` as `who`.
async fn try_op(site: &Site, who: &Who, op: Op, t: &str) -> (Verdict, String) {
    let (meta, bookie, ca) = (&site.metadata, &site.bookie, &site.site_ca);
    let access = |v: String| (verdict_of_access(&v, who), v);
    match op {
        Op::Pulsar(p) => {
            let (url, token, ns) = (site.url.clone(), who.token.clone(), format!("{t}/ns1"));
            let r = tokio::task::spawn_blocking(move || try_pulsar(&url, token.as_deref(), &ns, p))
                .await
                .unwrap();
            match r {
                Ok(()) => (Verdict::Yes, "ok".into()),
                Err((code, msg)) => {
                    use meridian_protocol::pb::ServerError;
                    let why = format!("{code:?}: {msg}");
                    // A token that does not authenticate is refused at CONNECT; one that does,
                    // by the operation.
                    let authenticated = who.name != "bad token" && who.name != "expired token";
                    match code {
                        ServerError::AuthenticationError
                            if !authenticated || who.token.is_none() =>
                        {
                            (Verdict::No, why)
                        }
                        ServerError::AuthorizationError if authenticated && who.token.is_some() => {
                            (Verdict::No, why)
                        }
                        // GET_SCHEMA of a topic with no schema: "no schema" reads so.
                        ServerError::TopicNotFound if p == PulsarOp::GetSchema => {
                            (Verdict::Yes, why)
                        }
                        _ => (Verdict::Odd(why.clone()), why),
                    }
                }
            }
        }
        Op::Http(path) => {
            let (addr, token) = (site.http.clone(), who.token.clone());
            let page =
                tokio::task::spawn_blocking(move || http_get_with(&addr, path, token.as_deref()))
                    .await
                    .unwrap();
            let status = page.lines().next().unwrap_or_default().to_string();
            let v = if status.contains(" 200") {
                Verdict::Yes
            } else if status.contains(" 401") || status.contains(" 403") {
                Verdict::No
            } else {
                Verdict::Odd(status.clone())
            };
            (v, status)
        }
        Op::MetadataMembers => access(try_metadata_api(meta, &who.internal, ca).await),
        Op::MetadataPut(key) => {
            let out = access(try_metadata_put(meta, &who.internal, ca, key).await);
            // What a probe wrote must not stay (a registration would read as a bookie).
            site.cleanup.delete(key, None).await.unwrap();
            out
        }
        Op::MetadataRemoveMember => access(try_membership(meta, &who.internal, ca).await),
        Op::RaftVote => access(try_raft(meta, &who.internal, ca).await),
        Op::BookieRead | Op::BookieAdd | Op::BookieFence | Op::BookieDelete => {
            let ledger_id = 1 << 40;
            let request = match op {
                Op::BookieRead => Request::Read {
                    ledger_id,
                    entry_id: 0,
                },
                Op::BookieAdd => bookie_add_probe(ledger_id),
                Op::BookieFence => Request::Fence {
                    ledger_id,
                    master_key: bytes::Bytes::from_static(b"probe"),
                },
                _ => Request::Delete { ledger_id },
            };
            access(try_bookie(bookie, &who.internal, ca, request).await)
        }
        Op::GeoHello | Op::GeoOpen | Op::GeoDelete | Op::GeoSubscriptionSync => {
            let (endpoint, conn) = match geo_connect(site.geo, who.geo.0.as_ref(), who.geo.1).await
            {
                Ok(c) => c,
                Err(e) => return (Verdict::No, e),
            };
            let topic = format!("persistent://{t}/g/t");
            let out = match op {
                Op::GeoHello => (Verdict::Yes, "welcome".into()),
                Op::GeoOpen => {
                    geo_stream(
                        &conn,
                        Frame::Open {
                            topic,
                            partitions: 0,
                        },
                    )
                    .await
                }
                Op::GeoDelete => {
                    geo_stream(
                        &conn,
                        Frame::Delete {
                            topic: format!("persistent://{t}/g/ghost"),
                            deleted_at_ms: 1,
                        },
                    )
                    .await
                }
                _ => {
                    geo_stream(
                        &conn,
                        Frame::SubSync {
                            topic,
                            doc: bytes::Bytes::from_static(b"{}"),
                        },
                    )
                    .await
                }
            };
            conn.close(0u32.into(), b"done");
            endpoint.wait_idle().await;
            out
        }
    }
}

fn load_site_tls(ca: &Path, (cert, key): &(PathBuf, PathBuf)) -> Arc<SiteTls> {
    let read = |p: &Path| std::fs::read(p).unwrap();
    Arc::new(SiteTls::from_pem(read(ca), read(cert), read(key)).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_identity_against_every_operation_of_every_surface_in_two_tenants() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();

    step("every admin RPC of admin.proto has its row");
    let proto = include_str!("../../tenancy/proto/admin.proto");
    let declared: Vec<&str> = proto
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rpc "))
        .map(|l| l.split('(').next().unwrap().trim())
        .collect();
    let listed: Vec<&str> = ADMIN_RPCS.iter().map(|r| r.0).collect();
    assert_eq!(
        declared, listed,
        "ADMIN_RPCS must list every RPC of admin.proto, in its order"
    );

    step("tokens: two keys (one the site's), an expired token");
    let key = dir.join("secret.key");
    let other = dir.join("other.key");
    for k in [&key, &other] {
        admin_ok(&[
            "tokens",
            "create-secret-key",
            "--output-file",
            k.to_str().unwrap(),
        ]);
    }
    let token = |k: &Path, role: &str, expiry: Option<&str>| -> String {
        let mut args = vec![
            "tokens",
            "create",
            "--secret-key",
            k.to_str().unwrap(),
            "--subject",
            role,
        ];
        if let Some(e) = expiry {
            args.extend(["--expiry-time", e]);
        }
        admin_ok(&args).trim().to_string()
    };
    let expired = token(&key, "root", Some("1s"));
    let expired_after = Instant::now() + Duration::from_millis(2100);

    step("the site's internal CA and certificates; another site's CA; the federation's CA");
    let (east_ca, west_ca) = (dir.join("east-ca"), dir.join("west-ca"));
    for (site, ca) in [("east", &east_ca), ("west", &west_ca)] {
        admin_ok(&[
            "site-tls",
            "create-ca",
            "--site",
            site,
            "--out-dir",
            ca.to_str().unwrap(),
        ]);
    }
    let certs = dir.join("certs");
    let site_ca = east_ca.join("ca.pem");
    let role_certs: Vec<(&str, (PathBuf, PathBuf))> = vec![
        ("metadata", site_cert(&certs, &east_ca, "metadata", "1")),
        ("metadata9", site_cert(&certs, &east_ca, "metadata", "9")),
        ("bookie", site_cert(&certs, &east_ca, "bookie", "bk1")),
        ("broker", site_cert(&certs, &east_ca, "broker", "b1")),
        ("admin", site_cert(&certs, &east_ca, "admin", "ops")),
        (
            "west",
            site_cert(&dir.join("west"), &west_ca, "broker", "b1"),
        ),
    ];
    let pki = dir.join("pki");
    let p = pki.display().to_string();
    admin_ok(&["geo", "create-ca", "--out-dir", &p]);
    for s in ["east", "west", "north"] {
        admin_ok(&[
            "geo",
            "create-site-cert",
            s,
            "--ca-dir",
            &p,
            "--out-dir",
            &p,
        ]);
    }

    step("site east: a metadata node, a bookie and a broker, TLS between them; the broker with token authentication and a geo link");
    let cert_of = |n: &str| role_certs.iter().find(|(r, _)| *r == n).unwrap().1.clone();
    let tls_env = |role: &str| {
        let (cert, key) = cert_of(role);
        [
            ("MERIDIAN_TLS_CERT_FILE", cert.display().to_string()),
            ("MERIDIAN_TLS_KEY_FILE", key.display().to_string()),
            ("MERIDIAN_TLS_CA_FILE", site_ca.display().to_string()),
        ]
    };
    let mut node = MetaNode::new(1, dir, None);
    node.set_initial_members(format!("1={}", node.addr));
    for (k, v) in tls_env("metadata") {
        node.env(k, &v);
    }
    node.start().unwrap();
    let as_broker = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: vec![node.addr.clone()],
            request_timeout_ms: 20_000,
            ..Default::default()
        },
        Some(load_site_tls(&site_ca, &cert_of("broker"))),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = as_broker.put("/matrix/ready", "yes").await {
        assert!(Instant::now() < deadline, "no metadata store: {e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut bookie = BookieProc::new("bookie", dir, &node.addr);
    for (k, v) in tls_env("bookie") {
        bookie.env(k, &v);
    }
    bookie.start().unwrap();
    meridian_integration::wait_for_bookies(&as_broker, 1, Duration::from_secs(30))
        .await
        .unwrap();
    let geo_listen = format!("127.0.0.1:{}", free_udp_port());
    let mut broker = BrokerProc::new("broker", dir, &node.addr);
    let pki_file = |f: &str| pki.join(f).display().to_string();
    for (k, v) in tls_env("broker").into_iter().chain([
        ("MERIDIAN_BROKER_CLUSTER_NAME", "east".to_string()),
        ("MERIDIAN_BROKER_ENSEMBLE", "1".into()),
        ("MERIDIAN_BROKER_WRITE_QUORUM", "1".into()),
        ("MERIDIAN_BROKER_ACK_QUORUM", "1".into()),
        ("MERIDIAN_BROKER_AUTHENTICATION_ENABLED", "true".into()),
        (
            "MERIDIAN_BROKER_TOKEN_SECRET_KEY_FILE",
            key.display().to_string(),
        ),
        ("MERIDIAN_BROKER_SUPERUSER_ROLES", "root".into()),
        ("MERIDIAN_GEO_LISTEN", geo_listen.clone()),
        ("MERIDIAN_GEO_CERT_FILE", pki_file("east.crt")),
        ("MERIDIAN_GEO_KEY_FILE", pki_file("east.key")),
        ("MERIDIAN_GEO_CA_FILE", pki_file("ca.crt")),
    ]) {
        broker.env(k, &v);
    }
    broker.start().unwrap();
    let root_token = token(&key, "root", None);
    let as_root = |args: &[&str]| {
        let mut all = vec![
            "--admin-url",
            broker.admin_url.as_str(),
            "--token",
            &root_token,
        ];
        all.extend_from_slice(args);
        admin_ok(&all);
    };
    step("tenants ta (admin-a) and tb (admin-b): ns1 with topic t, g replicated (ta/g with west)");
    as_root(&[
        "clusters",
        "create",
        "west",
        "--broker-url",
        "pulsar://127.0.0.1:1",
        "--url",
        "http://127.0.0.1:1",
        "--geo-url",
        "quic://127.0.0.1:1",
    ]);
    for (t, admin, clusters) in [("ta", "admin-a", "east,west"), ("tb", "admin-b", "east")] {
        as_root(&[
            "tenants",
            "create",
            t,
            "--admin-roles",
            admin,
            "--allowed-clusters",
            clusters,
        ]);
        as_root(&["namespaces", "create", &format!("{t}/ns1")]);
        as_root(&["topics", "create", &format!("persistent://{t}/ns1/t")]);
        as_root(&[
            "namespaces",
            "create",
            &format!("{t}/g"),
            "--clusters",
            clusters,
        ]);
    }
    for (role, action) in [("prod-a", "produce"), ("cons-a", "consume")] {
        as_root(&[
            "namespaces",
            "grant-permission",
            "ta/ns1",
            "--role",
            role,
            "--actions",
            action,
        ]);
    }
    let site = Site {
        metadata: node.addr.clone(),
        bookie: bookie.addr.clone(),
        geo: geo_listen.parse().unwrap(),
        site_ca: site_ca.clone(),
        url: broker.url.clone(),
        http: broker.http.clone(),
        admin_url: broker.admin_url.clone(),
        cleanup: as_broker,
    };

    let internal = |n: &str| Peer::Certificate(load_site_tls(&site_ca, &cert_of(n)));
    let geo_cert = |s: &str| Some((pki.join(format!("{s}.crt")), pki.join(format!("{s}.key"))));
    let tok = |role: &str| Some(token(&key, role, None));
    let who: Vec<Who> = vec![
        Who {
            name: "anonymous",
            token: None,
            internal: Peer::Plaintext,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "bad token",
            token: Some(token(&other, "root", None)),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "expired token",
            token: Some(expired),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "producer of ta/ns1",
            token: tok("prod-a"),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "consumer of ta/ns1",
            token: tok("cons-a"),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "admin of ta",
            token: tok("admin-a"),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "admin of tb",
            token: tok("admin-b"),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "superuser",
            token: Some(root_token.clone()),
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (None, "west"),
        },
        Who {
            name: "site west",
            token: None,
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (geo_cert("west"), "west"),
        },
        Who {
            name: "site north (not registered)",
            token: None,
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (geo_cert("north"), "north"),
        },
        Who {
            name: "site west saying it is east",
            token: None,
            internal: Peer::NoCertificate,
            of_site_ca: false,
            geo: (geo_cert("west"), "east"),
        },
        Who {
            name: "metadata node 1",
            token: None,
            internal: internal("metadata"),
            of_site_ca: true,
            geo: (Some(cert_of("metadata")), "west"),
        },
        Who {
            name: "metadata node 9 (no member)",
            token: None,
            internal: internal("metadata9"),
            of_site_ca: true,
            geo: (Some(cert_of("metadata9")), "west"),
        },
        Who {
            name: "bookie",
            token: None,
            internal: internal("bookie"),
            of_site_ca: true,
            geo: (Some(cert_of("bookie")), "west"),
        },
        Who {
            name: "broker",
            token: None,
            internal: internal("broker"),
            of_site_ca: true,
            geo: (Some(cert_of("broker")), "west"),
        },
        Who {
            name: "admin tool",
            token: None,
            internal: internal("admin"),
            of_site_ca: true,
            geo: (Some(cert_of("admin")), "west"),
        },
        Who {
            name: "broker of west's CA",
            token: None,
            internal: Peer::Certificate(load_site_tls(&site_ca, &cert_of("west"))),
            of_site_ca: false,
            geo: (Some(cert_of("west")), "west"),
        },
    ];
    assert_eq!(
        who.iter().map(|w| w.name).collect::<Vec<_>>(),
        HOLDS.iter().map(|h| h.0).collect::<Vec<_>>(),
        "every identity has its classes in HOLDS"
    );
    let holds = |w: usize, t: &str, class: Class| {
        let (_, a, b) = HOLDS[w];
        if t == "tb" { b } else { a }.contains(&class)
    };
    tokio::time::sleep(expired_after.saturating_duration_since(Instant::now())).await;

    step("every cell");
    let admin_channel = tonic::transport::Endpoint::from_shared(site.admin_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Per operation and tenant: its label and one cell per identity.
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut wrong = Vec::new();
    let mut cells = 0;
    let mut admitted = 0;
    let targets = |scope: Scope| match scope {
        Scope::Site => vec!["ta"],
        Scope::Tenant => vec!["ta", "tb"],
    };
    let ops: Vec<(String, Option<Op>, Class, Scope)> = OPS
        .iter()
        .map(|(n, op, c, s)| (n.to_string(), Some(*op), *c, *s))
        .chain(
            ADMIN_RPCS
                .iter()
                .map(|(n, c, s)| (format!("admin {n}"), None, *c, *s)),
        )
        .collect();
    for (name, op, class, scope) in &ops {
        for t in targets(*scope) {
            let label = match scope {
                Scope::Site => format!("{name} (site)"),
                Scope::Tenant => format!("{name} in {t}"),
            };
            let mut line = String::new();
            for (i, w) in who.iter().enumerate() {
                let (v, why) = match op {
                    Some(op) => try_op(&site, w, *op, t).await,
                    None => {
                        let mut c = AdminClient::new(admin_channel.clone());
                        let rpc = name.trim_start_matches("admin ");
                        verdict_of_grpc(admin_call(&mut c, w.token.as_deref(), rpc, t).await)
                    }
                };
                cells += 1;
                let want = holds(i, t, *class);
                line.push_str(match &v {
                    Verdict::Yes => "  Y",
                    Verdict::No => "  -",
                    Verdict::Odd(_) => "  !",
                });
                match (&v, want) {
                    (Verdict::Yes, true) => admitted += 1,
                    (Verdict::No, false) => {}
                    (Verdict::Yes, false) => {
                        wrong.push(format!("ESCAPE: {} did {label} ({class:?}): {why}", w.name))
                    }
                    (Verdict::No, true) => wrong.push(format!(
                        "refused: {} may do {label} ({class:?}): {why}",
                        w.name
                    )),
                    (Verdict::Odd(o), _) => wrong.push(format!("neither: {} {label}: {o}", w.name)),
                }
            }
            rows.push((label, line));
        }
    }
    let mut table = String::from("identities (columns, in order):\n");
    for (i, w) in who.iter().enumerate() {
        table.push_str(&format!("  {:>2} {}\n", i + 1, w.name));
    }
    table.push_str(&format!("{:<48}", "operation"));
    for i in 0..who.len() {
        table.push_str(&format!("{:>3}", i + 1));
    }
    table.push('\n');
    for (label, line) in &rows {
        table.push_str(&format!("{label:<48}{line}\n"));
    }
    eprintln!("{table}");
    eprintln!(
        "{cells} cells: {admitted} admitted as expected, {} refused as expected, {} wrong",
        cells - admitted - wrong.len(),
        wrong.len()
    );
    assert!(
        wrong.is_empty(),
        "cells not as expected:\n{}",
        wrong.join("\n")
    );

    step("the site still serves after all that, and nothing was created by a refused call");
    for t in ["ta", "tb"] {
        let (code, out, err) = run_admin(&[
            "--admin-url",
            &site.admin_url,
            "--token",
            &root_token,
            "namespaces",
            "list",
            t,
        ])
        .unwrap();
        assert_eq!(code, 0, "{err}");
        assert!(!out.contains("ghost"), "{out}");
        let (code, out, err) = run_admin(&[
            "--admin-url",
            &site.admin_url,
            "--token",
            &root_token,
            "tenants",
            "get",
            t,
        ])
        .unwrap();
        assert_eq!(code, 0, "{err}");
        assert!(!out.contains("intruder"), "{out}");
    }
    step("refusals are logged where they happen");
    assert!(node.log_text().contains("request refused"));
    assert!(bookie.log_text().contains("bookie request refused"));
    assert!(broker.log_text().contains("geo link refused"));
    broker.stop().unwrap();
    bookie.stop().unwrap();
    node.stop().unwrap();
}
