//! `meridian-admin`: the admin CLI, a client of the gRPC admin API. Command groups and flags
//! follow `pulsar-admin` (clusters, tenants, namespaces, topics), so that Pulsar operators and
//! their scripts feel at home. Tables for people, `--output json` for scripts.
//!
//! ```text
//! meridian-admin [--admin-url URL] [--token T] [--output table|json] GROUP COMMAND ...
//! ```

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use meridian_tenancy::pb::admin_client::AdminClient;
use meridian_tenancy::pb::*;
use serde_json::{json, Value};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Parser)]
#[command(
    name = "meridian-admin",
    version,
    about = "Administer a Meridian site over its gRPC admin API"
)]
struct Cli {
    /// The admin API, e.g. http://127.0.0.1:6680.
    #[arg(
        long,
        env = "MERIDIAN_ADMIN_URL",
        default_value = "http://127.0.0.1:6680",
        global = true
    )]
    admin_url: String,
    /// A token, sent as `authorization: Bearer TOKEN`.
    #[arg(long, env = "MERIDIAN_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// CA certificates (PEM) to trust for an https:// admin URL (pulsar-admin's name).
    #[arg(long, env = "MERIDIAN_TLS_TRUST_CERT_PATH", global = true)]
    tls_trust_cert_path: Option<String>,
    /// A client certificate (PEM) for mutual TLS: its CN is the role.
    #[arg(
        long,
        env = "MERIDIAN_TLS_CERT_FILE",
        global = true,
        requires = "tls_key_file"
    )]
    tls_cert_file: Option<String>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "MERIDIAN_TLS_KEY_FILE",
        global = true,
        requires = "tls_cert_file"
    )]
    tls_key_file: Option<String>,
    /// Output for people (table) or for scripts (json).
    #[arg(long, value_enum, default_value = "table", global = true)]
    output: Output,
    #[command(subcommand)]
    group: Group,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Group {
    /// The site's clusters (this site's entry; more with geo-replication).
    #[command(subcommand)]
    Clusters(Clusters),
    /// Tenants: admin roles and allowed clusters.
    #[command(subcommand)]
    Tenants(Tenants),
    /// Namespaces and their policies.
    #[command(subcommand)]
    Namespaces(Namespaces),
    /// Topics (and, as in pulsar-admin, their subscriptions).
    #[command(subcommand)]
    Topics(Topics),
    /// The site's brokers.
    #[command(subcommand)]
    Brokers(Brokers),
    /// The site's bookies.
    #[command(subcommand)]
    Bookies(Bookies),
    /// Namespace isolation policies: which brokers may own which namespaces' bundles.
    #[command(subcommand)]
    NsIsolationPolicy(NsIsolation),
    /// Subscriptions of a topic (the same commands as under `topics`).
    #[command(subcommand)]
    Subscriptions(SubsGroup),
    /// Keys and tokens for token authentication (local; no admin API needed).
    #[command(subcommand)]
    Tokens(Tokens),
    /// The site's internal CA and its processes' certificates, for TLS between roles
    /// (`[tls]`; local files, no admin API needed).
    #[command(subcommand)]
    SiteTls(SiteTls),
    /// Geo-replication: the federation's CA and its sites' certificates (local files, no
    /// admin API needed).
    #[command(subcommand)]
    Geo(Geo),
}

#[derive(Subcommand)]
enum Drills {
    /// Every report kept here, oldest first.
    List,
    /// One report, whole.
    Show { id: String },
}

#[derive(Subcommand)]
enum Geo {
    /// A new federation CA, shared by every site of the federation: `ca.crt` (give it to
    /// every site as geo.ca_file) and `ca.key` (keep it where certificates are made; readable
    /// by its owner only).
    CreateCa {
        /// Directory to write ca.crt and ca.key to (created if absent).
        #[arg(long)]
        out_dir: std::path::PathBuf,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// Every replicated topic (of NAMESPACE, or of every namespace) with its replicators:
    /// state, backlog, age of the oldest unreplicated entry; the oldest lag first.
    Status { namespace: Option<String> },
    /// A failover drill from site FROM to site TO over a namespace's topics (or some
    /// topics). With --dry-run it measures what TO would lose if FROM were lost now and
    /// changes nothing: per topic the entries, messages and bytes durable at FROM and not
    /// held at TO and the age of the oldest (RPO), and per replicated subscription the
    /// messages TO would deliver again that FROM's consumers acknowledged. The report is
    /// kept at the site the admin URL names (`geo drills list | show ID`).
    Drill {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        #[arg(long, conflicts_with = "topics", required_unless_present = "topics")]
        namespace: Option<String>,
        /// Topics, comma-separated (instead of a namespace's).
        #[arg(long, value_delimiter = ',')]
        topics: Vec<String>,
        /// How long the cut lasts before the restore.
        #[arg(long, default_value = "30s")]
        hold: String,
        /// Measure the exposure only; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// A real loss of site FROM: site TO serves NS, probed until it does (the RTO). Refused
    /// while FROM's admin API answers, unless --force (then FROM's clients of NS are cut over
    /// to TO, as a drill's cut). Clients with both sites in a multi-host service URL
    /// (`pulsar://east:6650,west:6650`) go to TO by themselves. The report is kept here.
    Failover {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        force: bool,
    },
    /// After a failover from FROM to TO, with FROM back: what TO lacked of FROM's is measured
    /// (the failover's real RPO; it is replicated now), FROM serves NS again (a --force cut
    /// ends, its topics are loaded), TO's clients of NS are sent back, and both catch up.
    Failback {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        #[arg(long)]
        namespace: String,
    },
    /// Failover drills' reports kept at this site.
    #[command(subcommand)]
    Drills(Drills),
    /// A site's certificate, signed by the federation CA, naming the site
    /// (`meridian://site/NAME`): `NAME.crt` and `NAME.key` (geo.cert_file, geo.key_file).
    CreateSiteCert {
        /// The site's name, as its brokers' --cluster.
        name: String,
        /// Directory holding ca.crt and ca.key (`geo create-ca --out-dir`).
        #[arg(long)]
        ca_dir: std::path::PathBuf,
        /// Directory to write the certificate and key to (created if absent).
        #[arg(long)]
        out_dir: std::path::PathBuf,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 825)]
        days: u32,
    },
}

#[derive(Subcommand)]
enum SiteTls {
    /// A new internal CA for a site: `ca.pem` (give it to every process as tls.ca_file) and
    /// `ca.key` (keep it where certificates are made; readable by its owner only).
    CreateCa {
        /// The site's name (1-64 of A-Z a-z 0-9 . _ -).
        #[arg(long)]
        site: String,
        /// Directory to write ca.pem and ca.key to (created if absent).
        #[arg(long)]
        out_dir: std::path::PathBuf,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// A process's certificate, signed by the site CA, naming its role and name:
    /// `<role>-<name>.pem` and `<role>-<name>.key` (tls.cert_file, tls.key_file).
    CreateCert {
        /// metadata (named by its node id), bookie, broker, or admin (tools, admin service).
        #[arg(long)]
        role: String,
        /// The process's name (a metadata node: its node id).
        #[arg(long)]
        name: String,
        /// Directory holding ca.pem and ca.key (`create-ca --out-dir`).
        #[arg(long)]
        ca_dir: std::path::PathBuf,
        /// Directory to write the certificate and key to (created if absent).
        #[arg(long)]
        out_dir: std::path::PathBuf,
        /// IP addresses the process serves on, as peers dial them (repeat or comma-separate).
        #[arg(long, value_delimiter = ',')]
        san_ip: Vec<std::net::IpAddr>,
        /// DNS names the process serves on, as peers dial them.
        #[arg(long, value_delimiter = ',')]
        san_dns: Vec<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 825)]
        days: u32,
    },
}

#[derive(Subcommand)]
enum Tokens {
    /// A new HS256 secret key (32 random bytes), written to --output-file (pulsar's
    /// `--output`; here `--output` is the global table/json switch).
    CreateSecretKey {
        #[arg(long)]
        output_file: std::path::PathBuf,
    },
    /// A new RSA key pair (2048 bits, PEM) for RS256 tokens: the private key signs tokens
    /// (`create --private-key`), the public key goes to the brokers
    /// (`broker.token_public_key_file`).
    CreateKeyPair {
        #[arg(long)]
        output_private_key: std::path::PathBuf,
        #[arg(long)]
        output_public_key: std::path::PathBuf,
    },
    /// A token for a role (its `sub`), signed with a secret key (HS256) or an RSA private key
    /// in PEM (RS256).
    Create {
        #[arg(
            long,
            conflicts_with = "private_key",
            required_unless_present = "private_key"
        )]
        secret_key: Option<std::path::PathBuf>,
        #[arg(long)]
        private_key: Option<std::path::PathBuf>,
        #[arg(long)]
        subject: String,
        /// Validity from now, e.g. 30m, 12h, 365d (none: no expiry).
        #[arg(long)]
        expiry_time: Option<String>,
    },
}

#[derive(Subcommand)]
enum Clusters {
    List,
    Get { cluster: String },
    Create(ClusterArgs),
    Update(ClusterArgs),
    Delete(DeleteArgs),
}

#[derive(Args)]
struct ClusterArgs {
    cluster: String,
    /// The cluster's admin API URL (http://...).
    #[arg(long, default_value = "")]
    url: String,
    /// The cluster's brokers (pulsar://...).
    #[arg(long, default_value = "")]
    broker_url: String,
    /// The cluster's geo link (quic://HOST:PORT), for geo-replication.
    #[arg(long, default_value = "")]
    geo_url: String,
}

#[derive(Args)]
struct DeleteArgs {
    name: String,
    /// List what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args)]
struct ForceDeleteArgs {
    name: String,
    /// List what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Delete what it holds too (a namespace's topics, closing their clients; a tenant's
    /// namespaces).
    #[arg(long, short = 'f')]
    force: bool,
}

#[derive(Args)]
struct TopicDeleteArgs {
    topic: String,
    /// List what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Close connected producers and consumers instead of refusing.
    #[arg(long, short = 'f')]
    force: bool,
}

#[derive(Subcommand)]
enum Bookies {
    /// The registered bookies: address, rack, state, free disk.
    List,
    /// Puts a bookie in a rack (over its --rack); ensembles spread over racks.
    SetRack {
        address: String,
        #[arg(long)]
        rack: String,
    },
    /// Puts a bookie in an affinity group (over its --group); namespaces with
    /// set-bookie-affinity-group keep their new ledgers on their groups' bookies.
    SetGroup {
        address: String,
        #[arg(long)]
        group: String,
    },
    /// Decommissions a bookie: it turns read-only, autorecovery makes its replicas elsewhere;
    /// waits until no ledger names it (then it is safe to remove).
    Decommission {
        address: String,
        /// Mark it and return at once (run it again to see how far it is).
        #[arg(long)]
        no_wait: bool,
        /// Give up waiting after this many seconds (exit code 1).
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// Ledgers marked under-replicated: fragments, the bookies lost, since when.
    UnderReplicated,
}

#[derive(Subcommand)]
enum NsIsolation {
    /// Sets (creates or replaces) a policy: the namespaces it names go on its primary
    /// brokers, and on its secondaries too while fewer than min_limit primaries are alive.
    Set {
        cluster: String,
        name: String,
        /// Regexes over tenant/namespace, comma-separated or repeated.
        #[arg(long, value_delimiter = ',', required = true)]
        namespaces: Vec<String>,
        /// Regexes over broker ids (host:port), comma-separated or repeated.
        #[arg(long, value_delimiter = ',', required = true)]
        primary: Vec<String>,
        #[arg(long, value_delimiter = ',')]
        secondary: Vec<String>,
        /// min_available (the only type).
        #[arg(long, default_value = "min_available")]
        auto_failover_policy_type: String,
        /// min_limit=N (other keys, such as usage_threshold, are accepted and ignored).
        #[arg(long, value_delimiter = ',')]
        auto_failover_policy_params: Vec<String>,
    },
    /// One policy of a cluster.
    Get {
        cluster: String,
        name: String,
    },
    /// Every policy of a cluster.
    List {
        cluster: String,
    },
    Delete {
        cluster: String,
        name: String,
    },
}

#[derive(Subcommand)]
enum Brokers {
    /// The registered brokers, with their load.
    List,
    /// The broker leading the site's load manager.
    Leader,
}

#[derive(Subcommand)]
enum Tenants {
    List,
    Get { tenant: String },
    Create(TenantArgs),
    Update(TenantArgs),
    Delete(ForceDeleteArgs),
}

#[derive(Args)]
struct TenantArgs {
    tenant: String,
    /// Comma-separated roles that administer the tenant.
    #[arg(long, short = 'r', value_delimiter = ',')]
    admin_roles: Vec<String>,
    /// Comma-separated clusters the tenant may use.
    #[arg(long, short = 'c', value_delimiter = ',')]
    allowed_clusters: Vec<String>,
    /// Most bytes the tenant's topics may store together (K, M, G, T: powers of 1024; -1: no
    /// quota); producers are refused past it. On update, left out: unchanged.
    #[arg(long, allow_hyphen_values = true)]
    storage_quota: Option<String>,
}

#[derive(Subcommand)]
enum Namespaces {
    /// The namespaces of a tenant.
    List {
        tenant: String,
    },
    /// A namespace's bundles (hash ranges of its topic names) and the broker owning each.
    Bundles {
        namespace: String,
    },
    /// Unloads the namespace's bundles (or one) at their owners: their topics' clients look
    /// them up again and they are placed anew.
    Unload {
        namespace: String,
        /// One bundle, 0xLO_0xHI (see `namespaces bundles`).
        #[arg(long, short = 'b')]
        bundle: Option<String>,
    },
    /// Splits a bundle in two at its owner (no data moves; the halves' topics stay where they
    /// are unless --unload).
    SplitBundle {
        namespace: String,
        /// The bundle, 0xLO_0xHI (see `namespaces bundles`).
        #[arg(long, short = 'b')]
        bundle: String,
        /// Unload the upper half afterwards: the next lookup places it on the least loaded
        /// broker.
        #[arg(long)]
        unload: bool,
    },
    Create {
        namespace: String,
        /// The sites its topics are replicated between (comma-separated; default: this site
        /// alone).
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
    },
    Delete(ForceDeleteArgs),
    /// Lets a role produce and/or consume in the namespace (with authentication on).
    GrantPermission {
        namespace: String,
        #[arg(long)]
        role: String,
        /// Comma-separated: produce, consume.
        #[arg(long, value_delimiter = ',')]
        actions: Vec<String>,
    },
    RevokePermission {
        namespace: String,
        #[arg(long)]
        role: String,
    },
    /// The roles granted in the namespace and their actions.
    Permissions {
        namespace: String,
    },
    /// The namespace's topics together (on each broker): their publish rate. Producers past
    /// it are slowed, as with set-publish-rate.
    SetPublishRateTotal {
        namespace: String,
        /// Messages per second (-1 or 0: no limit).
        #[arg(long, short = 'm', allow_hyphen_values = true, default_value_t = -1)]
        msg_publish_rate: i64,
        /// Bytes per second (-1 or 0: no limit).
        #[arg(long, short = 'b', allow_hyphen_values = true, default_value_t = -1)]
        byte_publish_rate: i64,
    },
    GetPublishRateTotal {
        namespace: String,
    },
    RemovePublishRateTotal {
        namespace: String,
    },
    /// The namespace's topics together (on each broker): their dispatch rate.
    SetDispatchRateTotal(DispatchRateArgs),
    GetDispatchRateTotal {
        namespace: String,
    },
    RemoveDispatchRateTotal {
        namespace: String,
    },
    #[command(flatten)]
    Policy(PolicyCmd),
}

/// Policies, of a namespace (under `namespaces`) or of one topic, overriding its namespace's
/// (under `topics`, with the topic's full name).
#[derive(Subcommand)]
enum PolicyCmd {
    /// A namespace's policies.
    Policies {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Deduplication of sends by producer name and sequence id.
    SetDeduplication {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long, conflicts_with = "disable", required_unless_present = "disable")]
        enable: bool,
        #[arg(long)]
        disable: bool,
    },
    /// Back to the broker's default (`broker.deduplication_enabled`).
    RemoveDeduplication {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Broker-side dead-letter policy: after N redeliveries a message moves to
    /// `<topic>-<subscription>-DLQ`.
    SetDeadLetter {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long)]
        max_redeliveries: u32,
    },
    RemoveDeadLetter {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// How schemas may evolve: ALWAYS_COMPATIBLE, ALWAYS_INCOMPATIBLE, BACKWARD, FORWARD, FULL,
    /// BACKWARD_TRANSITIVE, FORWARD_TRANSITIVE, FULL_TRANSITIVE.
    SetSchemaCompatibilityStrategy {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long)]
        compatibility: String,
    },
    GetSchemaCompatibilityStrategy {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Messages older than the TTL are acknowledged on every subscription (0: none).
    SetMessageTtl {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Seconds.
        #[arg(long)]
        ttl: u32,
    },
    RemoveMessageTtl {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Most producers on one topic (0: no limit).
    SetMaxProducersPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long, short = 'p')]
        max_producers_per_topic: u32,
    },
    RemoveMaxProducersPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Most consumers on one topic (0: no limit).
    SetMaxConsumersPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long, short = 'c')]
        max_consumers_per_topic: u32,
    },
    RemoveMaxConsumersPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Most subscriptions on one topic (0: no limit).
    SetMaxSubscriptionsPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long, short = 'm')]
        max_subscriptions_per_topic: u32,
    },
    RemoveMaxSubscriptionsPerTopic {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Limits a topic's backlog (its slowest subscription's) by size and/or age; the policy
    /// says what happens when one is passed.
    SetBacklogQuota {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Bytes, or with K, M, G, T (powers of 1024), e.g. 10M.
        #[arg(long)]
        limit_size: Option<String>,
        /// Seconds, or with s, m, h, d, e.g. 1h.
        #[arg(long)]
        limit_time: Option<String>,
        /// producer_request_hold, producer_exception or consumer_backlog_eviction.
        #[arg(long)]
        policy: String,
    },
    GetBacklogQuotas {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Keeps acknowledged data (for readers) up to a size and/or age; -1 is no limit.
    SetRetention {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// -1, or a size with K, M, G, T (powers of 1024), e.g. 10G.
        #[arg(long, allow_hyphen_values = true)]
        size: String,
        /// -1, or a time with s, m, h, d, e.g. 3h.
        #[arg(long, allow_hyphen_values = true)]
        time: String,
    },
    GetRetention {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveRetention {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveBacklogQuota {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Bounds a topic's unreplicated backlog to each remote site by size and/or age (none set:
    /// no bound, nothing unreplicated is ever dropped); the policy says what happens when one
    /// is passed: producers wait, producers are refused, or the oldest unreplicated entries
    /// are not sent to that remote (counted in `topics stats`).
    SetReplicationBacklogQuota {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Bytes, or with K, M, G, T (powers of 1024), e.g. 10G.
        #[arg(long)]
        limit_size: Option<String>,
        /// Seconds, or with s, m, h, d, e.g. 6h.
        #[arg(long)]
        limit_time: Option<String>,
        /// producer_request_hold, producer_exception or drop_oldest.
        #[arg(long)]
        policy: String,
    },
    GetReplicationBacklogQuota {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveReplicationBacklogQuota {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// The recovery-point policy: how far behind any remote site a topic's replication may
    /// fall, as the age of its oldest unreplicated entry (--time) and/or entries (--entries);
    /// past it, by --policy: logged and counted (alert), producers here wait
    /// (producer_request_hold) or are refused (producer_exception) with the remote and its lag
    /// named, until it is back within.
    SetMaxReplicationLag {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Seconds, or with s, m, h, d, e.g. 5s.
        #[arg(long)]
        time: Option<String>,
        #[arg(long)]
        entries: Option<u64>,
        /// alert, producer_request_hold or producer_exception.
        #[arg(long, default_value = "alert")]
        policy: String,
    },
    GetMaxReplicationLag {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveMaxReplicationLag {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    GetMessageTtl {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Compact each topic by itself once more than this much was published since its last
    /// compaction (0: only when asked with `topics compact`).
    SetCompactionThreshold {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Bytes, or with K, M, G, T (powers of 1024), e.g. 100M.
        #[arg(long, short = 't')]
        threshold: String,
    },
    GetCompactionThreshold {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Back to the broker's default (`broker.compaction_threshold_bytes`).
    RemoveCompactionThreshold {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Keeps new ledgers on the bookies of a group (`--group`, `bookies set-group`), and of
    /// the secondary group too once the primary has too few writable bookies.
    SetBookieAffinityGroup {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[arg(long)]
        primary_group: String,
        #[arg(long)]
        secondary_group: Option<String>,
    },
    GetBookieAffinityGroup {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Any bookie again (for ledgers created from now on).
    DeleteBookieAffinityGroup {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// The sites the topics are replicated between (each a known cluster the tenant may
    /// use). Pulsar's `namespaces set-clusters` and `topics set-replication-clusters`.
    #[command(visible_alias = "set-replication-clusters")]
    SetClusters {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Comma-separated cluster names.
        #[arg(long, value_delimiter = ',', required = true)]
        clusters: Vec<String>,
        #[command(flatten)]
        removal: SiteRemoval,
    },
    #[command(visible_alias = "get-replication-clusters")]
    GetClusters {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// This site alone again (a topic: its namespace's clusters again).
    #[command(visible_alias = "remove-replication-clusters")]
    RemoveClusters {
        #[arg(value_name = "TARGET")]
        namespace: String,
        #[command(flatten)]
        removal: SiteRemoval,
    },
    /// Each topic's publish rate: producers past it are slowed, not refused.
    SetPublishRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
        /// Messages per second (-1 or 0: no limit).
        #[arg(long, short = 'm', allow_hyphen_values = true, default_value_t = -1)]
        msg_publish_rate: i64,
        /// Bytes per second (-1 or 0: no limit).
        #[arg(long, short = 'b', allow_hyphen_values = true, default_value_t = -1)]
        byte_publish_rate: i64,
    },
    GetPublishRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemovePublishRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Each topic's dispatch rate, its subscriptions together.
    SetDispatchRate(DispatchRateArgs),
    GetDispatchRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveDispatchRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    /// Each subscription's dispatch rate.
    SetSubscriptionDispatchRate(DispatchRateArgs),
    GetSubscriptionDispatchRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
    RemoveSubscriptionDispatchRate {
        #[arg(value_name = "TARGET")]
        namespace: String,
    },
}

#[derive(Args)]
struct DispatchRateArgs {
    #[arg(value_name = "TARGET")]
    namespace: String,
    /// Messages per period (-1 or 0: no limit).
    #[arg(long, visible_alias = "md", allow_hyphen_values = true, default_value_t = -1)]
    msg_dispatch_rate: i64,
    /// Bytes per period (-1 or 0: no limit).
    #[arg(long, visible_alias = "bd", allow_hyphen_values = true, default_value_t = -1)]
    byte_dispatch_rate: i64,
    /// The period in seconds the rates are given for; stored per second.
    #[arg(long, visible_alias = "dt", default_value_t = 1)]
    dispatch_rate_period: u64,
}

impl DispatchRateArgs {
    fn limit(&self) -> anyhow::Result<RateLimit> {
        rate_limit(
            self.msg_dispatch_rate,
            self.byte_dispatch_rate,
            self.dispatch_rate_period,
        )
    }
}

/// Pulsar's rate flags (-1: no limit) over a period, as a limit per second (0: no limit).
fn rate_limit(msgs: i64, bytes: i64, period_s: u64) -> anyhow::Result<RateLimit> {
    anyhow::ensure!(
        (1..=86_400).contains(&period_s),
        "the rate period {period_s} s is out of range 1..=86400"
    );
    let per_sec = |v: i64| -> u64 {
        match u64::try_from(v) {
            Ok(0) | Err(_) => 0,
            Ok(v) => (v / period_s).max(1),
        }
    };
    Ok(RateLimit {
        msgs_per_sec: per_sec(msgs),
        bytes_per_sec: per_sec(bytes),
    })
}

async fn print_rate(
    c: &mut Client,
    namespace: String,
    topic: bool,
    out: Output,
    pick: fn(NamespacePolicies) -> Option<RateLimit>,
) -> anyhow::Result<()> {
    let p = get_policies(c, namespace, topic)
        .await?
        .policies
        .unwrap_or_default();
    let v = rate_json(pick(p).as_ref());
    print(out, &v, || v.to_string());
    Ok(())
}

/// Changes a namespace's policies and prints the result.
async fn update_and_print(
    c: &mut Client,
    req: UpdatePoliciesRequest,
    topic: bool,
    out: Output,
) -> anyhow::Result<()> {
    let target = req.namespace.clone();
    let p = update_policies(c, req, topic)
        .await?
        .policies
        .unwrap_or_default();
    print(out, &policies_json(&p), || {
        format!("updated the policies of {target}")
    });
    Ok(())
}

/// A change of a namespace's (or topic's) policies: `set` set, `clear` removed.
/// What happens to the sites a change of replication clusters leaves out.
#[derive(clap::Args, Debug, Clone, Default)]
struct SiteRemoval {
    /// Say what the change would do (replication that stops, data that would be deleted);
    /// change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also delete the namespace's topics at the sites left out (their data is kept
    /// otherwise); needs --confirm.
    #[arg(long)]
    delete_remote_data: bool,
    /// Confirms --delete-remote-data.
    #[arg(long)]
    confirm: bool,
}

/// Sets (`Some`) or removes (`None`) replication clusters; sites left out stop getting the
/// topics and keep their data unless `--delete-remote-data --confirm`.
async fn change_clusters(
    c: &mut Client,
    target: String,
    new: Option<Vec<String>>,
    r: SiteRemoval,
    topic: bool,
    out: Output,
) -> anyhow::Result<()> {
    if r.delete_remote_data && topic {
        anyhow::bail!("--delete-remote-data applies to a namespace; delete one topic everywhere with topics delete");
    }
    if r.delete_remote_data && !r.confirm && !r.dry_run {
        anyhow::bail!("--delete-remote-data deletes the namespace's topics at the sites left out: add --confirm (--dry-run shows what would go)");
    }
    let req = match &new {
        Some(names) => policy_update(
            target.clone(),
            NamespacePolicies {
                replication_clusters: Some(ClusterList {
                    names: names.clone(),
                }),
                ..Default::default()
            },
            &[],
        ),
        None => policy_update(
            target.clone(),
            NamespacePolicies::default(),
            &["replication_clusters"],
        ),
    };
    if !r.dry_run && !r.delete_remote_data {
        return update_and_print(c, req, topic, out).await;
    }
    let old = get_policies(c, target.clone(), topic)
        .await?
        .policies
        .unwrap_or_default()
        .replication_clusters
        .map(|c| c.names)
        .unwrap_or_default();
    let kept = new.clone().unwrap_or_default();
    let removed: Vec<String> = old.iter().filter(|s| !kept.contains(s)).cloned().collect();
    let mut lines = vec![format!(
        "replication clusters of {target}: {} -> {}",
        if old.is_empty() {
            "(none)".to_string()
        } else {
            old.join(",")
        },
        new.as_ref()
            .map_or("(none: this site alone)".to_string(), |n| n.join(","))
    )];
    for s in &removed {
        lines.push(if r.delete_remote_data {
            format!("replication to {s} stops, and the topics' copies at {s} are deleted")
        } else {
            format!("replication to {s} stops; the data at {s} is kept (--delete-remote-data --confirm deletes it)")
        });
    }
    let mut deleted = Vec::new();
    if !r.dry_run {
        if r.delete_remote_data && !removed.is_empty() {
            // Refusals (an unknown site, no geo link) come before the clusters change.
            c.delete_remote_data(DeleteRemoteDataRequest {
                namespace: target.clone(),
                sites: removed.clone(),
                dry_run: true,
            })
            .await?;
        }
        update_policies(c, req, topic).await?;
    }
    if r.delete_remote_data && !removed.is_empty() {
        let d = c
            .delete_remote_data(DeleteRemoteDataRequest {
                namespace: target.clone(),
                sites: removed.clone(),
                dry_run: r.dry_run,
            })
            .await?
            .into_inner();
        let verb = if r.dry_run {
            "would delete"
        } else {
            "deleting"
        };
        lines.extend(d.deleted.iter().map(|x| format!("{verb} {x}")));
        deleted = d.deleted;
    }
    let v = json!({"namespace": target, "dry_run": r.dry_run, "removed": removed,
        "deleted": deleted, "lines": lines});
    print(out, &v, || lines.join("\n"));
    Ok(())
}

fn policy_update(target: String, set: NamespacePolicies, clear: &[&str]) -> UpdatePoliciesRequest {
    UpdatePoliciesRequest {
        namespace: target,
        set: Some(set),
        clear: clear.iter().map(|c| c.to_string()).collect(),
    }
}

/// A namespace's policies, or (`topic`) a topic's own.
async fn get_policies(c: &mut Client, target: String, topic: bool) -> anyhow::Result<Namespace> {
    let name = Name { name: target };
    Ok(if topic {
        c.get_topic_policies(name).await?.into_inner()
    } else {
        c.get_namespace(name).await?.into_inner()
    })
}

async fn update_policies(
    c: &mut Client,
    req: UpdatePoliciesRequest,
    topic: bool,
) -> anyhow::Result<Namespace> {
    Ok(if topic {
        c.update_topic_policies(req).await?.into_inner()
    } else {
        c.update_namespace_policies(req).await?.into_inner()
    })
}

fn rate_json(r: Option<&RateLimit>) -> Value {
    r.map_or(
        Value::Null,
        |r| json!({"msgs_per_sec": r.msgs_per_sec, "bytes_per_sec": r.bytes_per_sec}),
    )
}

#[derive(Subcommand)]
enum Topics {
    /// The topics of a namespace.
    List { namespace: String },
    /// Creates a topic; with --partitions N > 0 a partitioned one.
    Create {
        topic: String,
        #[arg(long, short = 'p', default_value_t = 0)]
        partitions: u32,
    },
    /// Creates a partitioned topic (as `pulsar-admin topics create-partitioned-topic`).
    CreatePartitionedTopic {
        topic: String,
        #[arg(long, short = 'p')]
        partitions: u32,
    },
    /// Grows a partitioned topic.
    UpdatePartitionedTopic {
        topic: String,
        #[arg(long, short = 'p')]
        partitions: u32,
    },
    /// Rates, backlog, storage and subscriptions of a topic.
    Stats { topic: String },
    /// The stats of every topic of a namespace (loaded on the broker), as JSON lines or a
    /// table of one line per topic.
    StatsAll { namespace: String },
    /// Ends a topic: no more messages; consumers are told once they have read it all.
    Terminate { topic: String },
    /// The broker serving a topic (its bundle's owner; an unowned one is placed first).
    Lookup { topic: String },
    /// Compacts a topic: compacted readers (`read_compacted`) then get only the latest
    /// message of each key up to where it ran, then everything after.
    Compact { topic: String },
    /// Whether the topic's last compaction on its broker ran, runs, succeeded or failed.
    CompactionStatus {
        topic: String,
        /// Waits until no compaction runs.
        #[arg(long, short = 'w')]
        wait_complete: bool,
    },
    /// A topic's own policies (`set-message-ttl TOPIC --ttl 60`, ...), overriding its
    /// namespace's; a partitioned topic's apply to its partitions.
    #[command(flatten)]
    Policy(PolicyCmd),
    /// Deletes a topic (a partitioned one with all its partitions), its subscriptions, data
    /// and schema. Refused while clients are connected, unless --force.
    Delete(TopicDeleteArgs),
    /// The same, as `pulsar-admin topics delete-partitioned-topic`.
    DeletePartitionedTopic(TopicDeleteArgs),
    /// Closes the topic on its broker; its clients reconnect and it is loaded again.
    Unload { topic: String },
    /// Ledgers and cursors of a topic (of each partition of a partitioned one).
    #[command(visible_alias = "internal-stats")]
    StatsInternal { topic: String },
    #[command(flatten)]
    Subs(Subs),
}

#[derive(Args, Clone)]
struct SubArgs {
    topic: String,
    /// The subscription.
    #[arg(long, short = 's')]
    subscription: String,
}

/// Under `topics`: pulsar-admin's names.
#[derive(Subcommand)]
enum Subs {
    /// The durable subscriptions of a topic.
    Subscriptions { topic: String },
    /// Creates a subscription at a position: earliest, latest (the default) or ledger:entry.
    CreateSubscription {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 'm', default_value = "latest")]
        message_id: String,
    },
    /// Deletes a subscription that has no consumers.
    Unsubscribe {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long)]
        dry_run: bool,
    },
    /// The next messages of a subscription, without moving it.
    PeekMessages {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u32,
    },
    #[command(flatten)]
    Same(SubsSame),
}

type Client = AdminClient<InterceptedService<Channel, Auth>>;

#[derive(Clone)]
struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    match rt.block_on(run(cli)) {
        Ok(()) => {}
        Err(e) => {
            match e.downcast_ref::<tonic::Status>() {
                Some(s) => {
                    // What was being done (the contexts), then the server's answer.
                    let doing: Vec<String> = e
                        .chain()
                        .take_while(|c| c.downcast_ref::<tonic::Status>().is_none())
                        .map(|c| format!("{c}: "))
                        .collect();
                    eprintln!("error: {:?}: {}{}", s.code(), doing.concat(), s.message())
                }
                None => eprintln!("error: {e:#}"),
            }
            std::process::exit(1);
        }
    }
}

fn site_tls(cmd: SiteTls) -> anyhow::Result<()> {
    use meridian_tenancy::site_tls;
    let write_pair = |dir: &std::path::Path, stem: &str, issued: &site_tls::Issued| {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let cert = dir.join(format!("{stem}.pem"));
        let key = dir.join(format!("{stem}.key"));
        write_private(&key, issued.key_pem.as_bytes())?;
        std::fs::write(&cert, &issued.cert_pem)
            .with_context(|| format!("writing {}", cert.display()))?;
        anyhow::Ok((cert, key))
    };
    match cmd {
        SiteTls::CreateCa {
            site,
            out_dir,
            days,
        } => {
            let ca = site_tls::create_ca(&site, days).map_err(anyhow::Error::msg)?;
            let (cert, key) = write_pair(&out_dir, "ca", &ca)?;
            println!(
                "site {site}: CA certificate written to {}, its key to {}",
                cert.display(),
                key.display()
            );
        }
        SiteTls::CreateCert {
            role,
            name,
            ca_dir,
            out_dir,
            san_ip,
            san_dns,
            days,
        } => {
            let role: meridian_metadata::tls::ProcessRole = role
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--role: {e}"))?;
            let read = |f: &str| {
                let p = ca_dir.join(f);
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
            };
            let opts = site_tls::CertOptions {
                ips: san_ip,
                dns_names: san_dns,
                days,
            };
            let issued =
                site_tls::create_cert(&read("ca.pem")?, &read("ca.key")?, role, &name, &opts)
                    .map_err(anyhow::Error::msg)?;
            let (cert, key) = write_pair(&out_dir, &format!("{role}-{name}"), &issued)?;
            println!(
                "{role} {name}: certificate written to {}, its key to {}",
                cert.display(),
                key.display()
            );
        }
    }
    Ok(())
}

/// Writes `stem.crt` and `stem.key` (owner-only, never over an existing file) to `dir`.
fn write_crt_pair(
    dir: &std::path::Path,
    stem: &str,
    issued: &meridian_tenancy::site_tls::Issued,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cert = dir.join(format!("{stem}.crt"));
    let key = dir.join(format!("{stem}.key"));
    write_private(&key, issued.key_pem.as_bytes())?;
    std::fs::write(&cert, &issued.cert_pem)
        .with_context(|| format!("writing {}", cert.display()))?;
    Ok((cert, key))
}

fn geo(cmd: Geo) -> anyhow::Result<()> {
    use meridian_tenancy::geo_pki;
    match cmd {
        Geo::Status { .. }
        | Geo::Drill { .. }
        | Geo::Drills(_)
        | Geo::Failover { .. }
        | Geo::Failback { .. } => {
            anyhow::bail!("geo status and drills are answered by the admin API")
        }
        Geo::CreateCa { out_dir, days } => {
            let ca = geo_pki::create_ca(days).map_err(anyhow::Error::msg)?;
            let (cert, key) = write_crt_pair(&out_dir, "ca", &ca)?;
            println!(
                "federation CA certificate written to {}, its key to {}",
                cert.display(),
                key.display()
            );
        }
        Geo::CreateSiteCert {
            name,
            ca_dir,
            out_dir,
            days,
        } => {
            let read = |f: &str| {
                let p = ca_dir.join(f);
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
            };
            let opts = meridian_tenancy::site_tls::CertOptions {
                days,
                ..Default::default()
            };
            let issued =
                geo_pki::create_site_cert(&read("ca.crt")?, &read("ca.key")?, &name, &opts)
                    .map_err(anyhow::Error::msg)?;
            let (cert, key) = write_crt_pair(&out_dir, &name, &issued)?;
            println!(
                "site {name}: certificate written to {}, its key to {}",
                cert.display(),
                key.display()
            );
        }
    }
    Ok(())
}

fn tokens(cmd: Tokens) -> anyhow::Result<()> {
    use meridian_tenancy::auth;
    match cmd {
        Tokens::CreateSecretKey { output_file } => {
            write_private(&output_file, &auth::create_secret_key())?;
            println!("secret key written to {}", output_file.display());
        }
        Tokens::CreateKeyPair {
            output_private_key,
            output_public_key,
        } => {
            let (private, public) = auth::create_key_pair().map_err(anyhow::Error::msg)?;
            write_private(&output_private_key, private.as_bytes())?;
            std::fs::write(&output_public_key, public)
                .with_context(|| format!("writing {}", output_public_key.display()))?;
            println!(
                "private key written to {}, public key to {}",
                output_private_key.display(),
                output_public_key.display()
            );
        }
        Tokens::Create {
            secret_key,
            private_key,
            subject,
            expiry_time,
        } => {
            let read = |p: &std::path::Path| {
                std::fs::read(p).with_context(|| format!("reading {}", p.display()))
            };
            let secret = secret_key.as_deref().map(read).transpose()?;
            let private = private_key.as_deref().map(read).transpose()?;
            let exp = match expiry_time {
                Some(t) => {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)?
                        .as_secs();
                    Some(now + parse_duration_s(&t)?)
                }
                None => None,
            };
            let token = auth::create_token(secret.as_deref(), private.as_deref(), &subject, exp)
                .map_err(|e| anyhow::anyhow!(e))?;
            println!("{token}");
        }
    }
    Ok(())
}

/// Writes a key readable by its owner only.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {} (it must not exist)", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let cli = match cli.group {
        Group::Tokens(cmd) => return tokens(cmd),
        Group::SiteTls(cmd) => return site_tls(cmd),
        Group::Geo(cmd)
            if !matches!(
                cmd,
                Geo::Status { .. }
                    | Geo::Drill { .. }
                    | Geo::Drills(_)
                    | Geo::Failover { .. }
                    | Geo::Failback { .. }
            ) =>
        {
            return geo(cmd)
        }
        _ => cli,
    };
    let conn = Conn {
        token: cli.token.clone(),
        tls_trust_cert_path: cli.tls_trust_cert_path.clone(),
        tls_cert_file: cli.tls_cert_file.clone(),
        tls_key_file: cli.tls_key_file.clone(),
    };
    let mut c = connect(&conn, &cli.admin_url).await?;
    let out = cli.output;
    match cli.group {
        Group::Clusters(cmd) => clusters(&mut c, cmd, out).await,
        Group::Tenants(cmd) => tenants(&mut c, cmd, out).await,
        Group::Namespaces(cmd) => namespaces(&mut c, cmd, out).await,
        Group::Topics(cmd) => topics(&mut c, cmd, out).await,
        Group::Brokers(cmd) => brokers(&mut c, cmd, out).await,
        Group::Bookies(cmd) => bookies(&mut c, cmd, out).await,
        Group::NsIsolationPolicy(cmd) => ns_isolation(&mut c, cmd, out).await,
        Group::Subscriptions(cmd) => subscriptions(&mut c, cmd.into(), out).await,
        Group::Tokens(cmd) => tokens(cmd),
        Group::SiteTls(cmd) => site_tls(cmd),
        Group::Geo(Geo::Status { namespace }) => geo_status(&mut c, namespace, out).await,
        Group::Geo(Geo::Drill {
            from,
            to,
            namespace,
            topics,
            hold,
            dry_run,
        }) => {
            let d = DrillArgs {
                from,
                to,
                namespace,
                topics,
                hold,
                dry_run,
            };
            geo_drill(&mut c, &conn, d, out).await
        }
        Group::Geo(Geo::Drills(cmd)) => geo_drills(&mut c, cmd, out).await,
        Group::Geo(Geo::Failover {
            from,
            to,
            namespace,
            force,
        }) => geo_failover(&mut c, &conn, from, to, namespace, force, out).await,
        Group::Geo(Geo::Failback {
            from,
            to,
            namespace,
        }) => geo_failback(&mut c, &conn, from, to, namespace, out).await,
        Group::Geo(cmd) => geo(cmd),
    }
}

/// How to reach an admin API: the caller's credentials.
struct Conn {
    token: Option<String>,
    tls_trust_cert_path: Option<String>,
    tls_cert_file: Option<String>,
    tls_key_file: Option<String>,
}

/// A client of the admin API at `url`.
async fn connect(conn: &Conn, url: &str) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(url.to_string())
        .with_context(|| format!("admin URL {url:?} is not a URL"))?;
    if url.starts_with("https://") {
        let read = |p: &str, flag: &str| std::fs::read(p).with_context(|| format!("{flag} {p}"));
        let mut tls = tonic::transport::ClientTlsConfig::new();
        if let Some(ca) = &conn.tls_trust_cert_path {
            tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(read(
                ca,
                "--tls-trust-cert-path",
            )?));
        }
        if let (Some(c), Some(k)) = (&conn.tls_cert_file, &conn.tls_key_file) {
            tls = tls.identity(tonic::transport::Identity::from_pem(
                read(c, "--tls-cert-file")?,
                read(k, "--tls-key-file")?,
            ));
        }
        endpoint = endpoint
            .tls_config(tls)
            .context("the TLS configuration of the admin URL")?;
    }
    let channel = endpoint
        .connect_timeout(std::time::Duration::from_secs(10))
        .timeout(std::time::Duration::from_secs(60))
        .connect()
        .await
        .with_context(|| format!("cannot reach the admin API at {url}"))?;
    let auth = match &conn.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("--token has characters a header cannot carry")?,
        ),
        None => None,
    };
    Ok(AdminClient::with_interceptor(channel, Auth(auth)))
}

struct DrillArgs {
    from: String,
    to: String,
    namespace: Option<String>,
    topics: Vec<String>,
    hold: String,
    dry_run: bool,
}

/// The cluster records of two sites (their admin URLs), which must differ.
async fn site_records(c: &mut Client, from: &str, to: &str) -> anyhow::Result<(Cluster, Cluster)> {
    anyhow::ensure!(from != to, "--from and --to name the same site");
    let mut get = async |name: &str| {
        c.get_cluster(Name {
            name: name.to_string(),
        })
        .await
        .map(|r| r.into_inner())
        .with_context(|| format!("site {name}"))
    };
    let a = get(from).await?;
    let b = get(to).await?;
    Ok((a, b))
}

/// The end of a cut: FROM serves NS again and loads its topics (its replicators send what TO
/// lacks), TO unloads NS (its clients of FROM's service URL go back) and loads the topics
/// again (its replicators send back what it took); then until neither has anything of NS
/// left to replicate to the other (10 minutes at most). The time to the restore, and to the
/// catch-up.
async fn restore_and_catch_up(
    at_from: &mut Client,
    at_to: &mut Client,
    (ns, from, to): (&str, &str, &str),
    listed: &[Topic],
) -> anyhow::Result<(std::time::Duration, std::time::Duration)> {
    use std::time::{Duration, Instant};
    let topics: Vec<String> = listed.iter().map(|t| t.name.clone()).collect();
    let restore = Instant::now();
    let end_cut = |to: &str| GeoCutRequest {
        namespace: ns.to_string(),
        to: to.to_string(),
        cut: false,
        topics: topics.clone(),
    };
    at_from
        .geo_cut(end_cut(to))
        .await
        .with_context(|| format!("restoring {ns} at {from}"))?;
    at_to
        .unload_namespace(UnloadNamespaceRequest {
            namespace: ns.to_string(),
            bundle: String::new(),
        })
        .await
        .with_context(|| format!("sending {ns}'s clients back from {to}"))?;
    at_to
        .geo_cut(end_cut(from))
        .await
        .with_context(|| format!("loading {ns}'s topics at {to} again"))?;
    let restored = restore.elapsed();
    let deadline = restore + Duration::from_secs(600);
    let expected = each_partition(listed);
    loop {
        let why = match not_caught_up(at_from, ns, to, &expected).await? {
            Some(w) => Some(format!("at {from}: {w}")),
            None => not_caught_up(at_to, ns, from, &expected)
                .await?
                .map(|w| format!("at {to}: {w}")),
        };
        let Some(why) = why else { break };
        anyhow::ensure!(
            Instant::now() < deadline,
            "{ns} did not catch up between {from} and {to} within 10 minutes of the restore ({why})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((restored, restore.elapsed()))
}

/// How long a drill asks a site again that answers UNAVAILABLE (a topic being unloaded).
const UNAVAILABLE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Each topic's exposure, measured at FROM (its admin API).
async fn measure_exposure(
    at_from: &mut Client,
    topics: &[String],
    to: &str,
) -> anyhow::Result<Vec<meridian_tenancy::drills::TopicExposure>> {
    use meridian_tenancy::drills::{SubExposure, TopicExposure};
    let mut measured = Vec::new();
    for t in topics {
        let request = GeoExposureRequest {
            topic: t.clone(),
            remote: to.to_string(),
        };
        // A topic the cut is unloading answers UNAVAILABLE for a moment: asked again.
        let deadline = std::time::Instant::now() + UNAVAILABLE_WAIT;
        let l = loop {
            match at_from.geo_exposure(request.clone()).await {
                Ok(l) => break l.into_inner(),
                Err(s)
                    if s.code() == tonic::Code::Unavailable
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await
                }
                Err(s) => return Err(anyhow::Error::from(s).context(format!("measuring {t}"))),
            }
        };
        for e in l.topics {
            measured.push(TopicExposure {
                topic: e.topic,
                entries: e.entries,
                messages: e.messages,
                bytes: e.bytes,
                oldest_ms: e.oldest_ms,
                oldest_publish_ms: e.oldest_publish_ms,
                remote_holds: e.remote_holds,
                subscriptions: e
                    .subscriptions
                    .into_iter()
                    .map(|s| SubExposure {
                        name: s.name,
                        entries: s.entries,
                        messages: s.messages,
                    })
                    .collect(),
                error: (!e.error.is_empty()).then_some(e.error),
            });
        }
    }
    Ok(measured)
}

/// Whether every replicated topic of `ns` at the site of `c` has nothing left for `remote`.
/// `None` when each of `topics` (partitions named one by one) is loaded with its replicator
/// to `remote` connected and nothing left to send there; else why not, for the first that is
/// not. Those the broker of `c` serves come in one answer; those another broker of that site
/// serves are asked about one by one (the call goes to their owner, which loads them).
async fn not_caught_up(
    c: &mut Client,
    ns: &str,
    remote: &str,
    topics: &[String],
) -> anyhow::Result<Option<String>> {
    let l = c
        .get_namespace_topic_stats(Name {
            name: ns.to_string(),
        })
        .await?
        .into_inner();
    for name in topics {
        let owned;
        let t = match l.topics.iter().find(|t| &t.topic == name) {
            Some(t) => t,
            None => match c.get_topic_stats(Name { name: name.clone() }).await {
                Ok(s) => {
                    owned = s.into_inner();
                    &owned
                }
                Err(e) => return Ok(Some(format!("{name}: {}", e.message()))),
            },
        };
        let Some(r) = t.replication.iter().find(|r| r.remote == remote) else {
            return Ok(Some(format!("{name} has no replicator to {remote}")));
        };
        if r.backlog_entries > 0 || r.state != "connected" {
            return Ok(Some(format!(
                "{name} to {remote}: {}, {} entries left",
                r.state, r.backlog_entries
            )));
        }
    }
    Ok(None)
}

/// A namespace's topics as listed, each partition of a partitioned one named.
fn each_partition(topics: &[Topic]) -> Vec<String> {
    topics
        .iter()
        .flat_map(|t| {
            if t.partitions == 0 {
                vec![t.name.clone()]
            } else {
                (0..t.partitions)
                    .map(|i| format!("{}-partition-{i}", t.name))
                    .collect()
            }
        })
        .collect()
}

/// `geo drill`: at FROM (its admin API, from its cluster record) the exposure measured; with
/// a cut, the namespace cut over to TO, measured, TO probed until it serves every topic, held,
/// restored, and caught up; the report kept here and printed.
async fn geo_drill(c: &mut Client, conn: &Conn, d: DrillArgs, out: Output) -> anyhow::Result<()> {
    use meridian_tenancy::drills::{Drill, Phases};
    use std::time::{Duration, Instant};
    let hold = Duration::from_secs(parse_duration_s(&d.hold).context("--hold")?);
    let (from, to) = site_records(c, &d.from, &d.to).await?;
    let mut at_from = connect(conn, &from.admin_url).await?;
    let listed: Vec<Topic> = match &d.namespace {
        Some(ns) => {
            at_from
                .list_topics(Name { name: ns.clone() })
                .await?
                .into_inner()
                .topics
        }
        None => Vec::new(),
    };
    let topics: Vec<String> = match &d.namespace {
        Some(_) => listed.iter().map(|t| t.name.clone()).collect(),
        None => d.topics.clone(),
    };
    let started_ms = now_ms();
    if d.dry_run {
        let measured = measure_exposure(&mut at_from, &topics, &d.to).await?;
        let report = Drill::dry_run(
            &d.from,
            &d.to,
            d.namespace.as_deref(),
            started_ms,
            now_ms(),
            measured,
        );
        c.put_drill_report(report.to_pb()).await?;
        print(out, &report.json(), || report.table());
        return Ok(());
    }
    let Some(ns) = d.namespace.clone() else {
        anyhow::bail!("a drill that cuts takes --namespace (a namespace is cut over whole)");
    };
    let mut at_to = connect(conn, &to.admin_url).await?;
    // The probe clients look each partition up, as the stock clients do.
    let parts = each_partition(&listed);
    let start = Instant::now();
    let mut phases = Phases::default();
    // Cut: FROM's clients of the namespace go to TO, nothing of it goes there from FROM.
    at_from
        .geo_cut(GeoCutRequest {
            namespace: ns.clone(),
            to: d.to.clone(),
            cut: true,
            topics: Vec::new(),
        })
        .await
        .with_context(|| format!("cutting {ns} at {}", d.from))?;
    let cut = Instant::now();
    let cut_ms = now_ms();
    phases.cut_ms = start.elapsed().as_millis() as u64;
    // What TO lacks, measured until two measures agree (frames in flight at the cut land);
    // meanwhile TO is probed until it serves every topic (the RTO).
    let measuring = async {
        let mut measured = measure_exposure(&mut at_from, &topics, &d.to).await?;
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let again = measure_exposure(&mut at_from, &topics, &d.to).await?;
            // Ages grow with time; the counts are what settles.
            let counts = |m: &[meridian_tenancy::drills::TopicExposure]| -> Vec<_> {
                m.iter()
                    .map(|t| {
                        (
                            t.topic.clone(),
                            t.entries,
                            t.messages,
                            t.bytes,
                            t.subscriptions.clone(),
                        )
                    })
                    .collect()
            };
            let same = counts(&again) == counts(&measured);
            measured = again;
            if same {
                break;
            }
        }
        anyhow::Ok((measured, cut.elapsed()))
    };
    let probing = async {
        let limit = Duration::from_secs(120);
        until_served(&mut at_to, &topics, &d.to, limit).await?;
        until_clients_served(&to.service_url, &parts, conn.token.as_deref(), &d.to, limit).await?;
        let rto = cut.elapsed();
        until_subscriptions_applied(&mut at_to, &topics, &d.to, limit).await?;
        anyhow::Ok((rto, cut.elapsed()))
    };
    let (m, rto) = tokio::join!(measuring, probing);
    let (measured, measured_after, (rto, subs)) = match (m, rto) {
        (Ok((m, after)), Ok(rto)) => (m, after, rto),
        (Err(e), _) | (_, Err(e)) => {
            // The cut is not left in place by a drill that failed.
            let ended = at_from
                .geo_cut(GeoCutRequest {
                    namespace: ns.clone(),
                    to: d.to.clone(),
                    cut: false,
                    topics: topics.clone(),
                })
                .await;
            return Err(e.context(match ended {
                Ok(_) => format!("the drill failed; {ns}'s cut at {} was ended", d.from),
                Err(r) => format!(
                    "the drill failed and ending {ns}'s cut at {} failed too ({r}): it stays",
                    d.from
                ),
            }));
        }
    };
    phases.measured_ms = measured_after.as_millis() as u64;
    phases.rto_ms = rto.as_millis() as u64;
    phases.subscriptions_ms = subs.as_millis() as u64;
    if let Some(left) = hold.checked_sub(cut.elapsed()) {
        tokio::time::sleep(left).await;
    }
    // Once more at the hold's end: sends that were in flight at the cut and that their
    // clients sent again to TO meanwhile are held there (deduplicated by their producers'
    // ids) and not lost. The subscriptions' figures stay those of the cut.
    let mut measured = measured;
    if let Ok(late) = measure_exposure(&mut at_from, &topics, &d.to).await {
        for t in measured.iter_mut() {
            if let Some(l) = late
                .iter()
                .find(|l| l.topic == t.topic && l.error.is_none())
            {
                t.entries = l.entries;
                t.messages = l.messages;
                t.bytes = l.bytes;
                t.oldest_ms = l.oldest_ms;
                t.oldest_publish_ms = l.oldest_publish_ms;
                t.remote_holds = l.remote_holds.clone();
            }
        }
    }
    phases.hold_ms = cut.elapsed().as_millis() as u64;
    // Restore: FROM serves and replicates again; TO's clients of the namespace reconnect
    // (those of FROM's service URL are served at FROM again).
    let (restored, caught_up) =
        restore_and_catch_up(&mut at_from, &mut at_to, (&ns, &d.from, &d.to), &listed).await?;
    phases.restore_ms = restored.as_millis() as u64;
    phases.caught_up_ms = caught_up.as_millis() as u64;
    let report = Drill::cut(
        &d.from,
        &d.to,
        &ns,
        (started_ms, cut_ms, now_ms()),
        measured,
        phases,
    );
    c.put_drill_report(report.to_pb()).await?;
    print(out, &report.json(), || report.table());
    Ok(())
}

/// Whether `site`'s admin API answers within a few seconds.
async fn answers(conn: &Conn, url: &str, site: &str) -> Option<Client> {
    let probe = async {
        let mut c = connect(conn, url).await.ok()?;
        c.get_cluster(Name {
            name: site.to_string(),
        })
        .await
        .ok()?;
        Some(c)
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), probe)
        .await
        .ok()
        .flatten()
}

/// Probes `topics` at the site of `at` until each is served; the time it took.
async fn until_served(
    at: &mut Client,
    topics: &[String],
    site: &str,
    limit: std::time::Duration,
) -> anyhow::Result<std::time::Duration> {
    let start = std::time::Instant::now();
    loop {
        let mut all = true;
        for t in topics {
            if at.probe_topic(Name { name: t.clone() }).await.is_err() {
                all = false;
                break;
            }
        }
        if all {
            return Ok(start.elapsed());
        }
        anyhow::ensure!(
            start.elapsed() < limit,
            "{site} did not serve every topic within {limit:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Probes each of `topics` (partitions named one by one) at the site whose service URL is
/// `service_url` with a probe producer and a probe consumer, as stock clients are served
/// (`meridian_tenancy::drill_probe`), all at once, again every 20 ms for those not served,
/// until every one is; the time it took.
async fn until_clients_served(
    service_url: &str,
    topics: &[String],
    token: Option<&str>,
    site: &str,
    limit: std::time::Duration,
) -> anyhow::Result<std::time::Duration> {
    use meridian_tenancy::drill_probe::probe_topic;
    let start = std::time::Instant::now();
    let mut left: Vec<&String> = topics.iter().collect();
    while !left.is_empty() {
        let answers = futures::future::join_all(
            left.iter()
                .map(|t| probe_topic(service_url, t, token, std::time::Duration::from_secs(2))),
        )
        .await;
        let mut why = None;
        left = left
            .into_iter()
            .zip(answers)
            .filter_map(|(t, a)| match a {
                Ok(()) => None,
                Err(e) => {
                    why.get_or_insert(e);
                    Some(t)
                }
            })
            .collect();
        if let Some(why) = why {
            anyhow::ensure!(
                start.elapsed() < limit,
                "{site} did not serve a probe producer and consumer of every topic within {limit:?} ({why})"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    Ok(start.elapsed())
}

/// Probes `topics` at the site of `at` until every replicated subscription of each has
/// applied what it holds of other sites' states (`ProbeSubscriptions`); the time it took.
async fn until_subscriptions_applied(
    at: &mut Client,
    topics: &[String],
    site: &str,
    limit: std::time::Duration,
) -> anyhow::Result<std::time::Duration> {
    let start = std::time::Instant::now();
    let mut from = 0;
    while from < topics.len() {
        match at
            .probe_subscriptions(Name {
                name: topics[from].clone(),
            })
            .await
        {
            Ok(_) => from += 1,
            Err(e) => {
                anyhow::ensure!(
                    start.elapsed() < limit,
                    "the replicated subscriptions at {site} were not in place within {limit:?}: {}",
                    e.message()
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
    Ok(start.elapsed())
}

/// `geo failover`: TO takes NS after FROM was lost (refused while FROM answers, unless
/// --force, which cuts FROM over to TO); the report kept here.
async fn geo_failover(
    c: &mut Client,
    conn: &Conn,
    from: String,
    to: String,
    ns: String,
    force: bool,
    out: Output,
) -> anyhow::Result<()> {
    use meridian_tenancy::drills::{Drill, Phases};
    let (from_rec, to_rec) = site_records(c, &from, &to).await?;
    let started_ms = now_ms();
    let start = std::time::Instant::now();
    let reachable = answers(conn, &from_rec.admin_url, &from).await;
    if reachable.is_some() && !force {
        anyhow::bail!(
            "site {from} answers at {}: a failover is for a site that is lost (rehearse one with `geo drill`, or pass --force to cut {from} over to {to} anyway)",
            from_rec.admin_url
        );
    }
    let mut at_to = connect(conn, &to_rec.admin_url).await?;
    let listed = at_to
        .list_topics(Name { name: ns.clone() })
        .await?
        .into_inner()
        .topics;
    let parts = each_partition(&listed);
    let topics: Vec<String> = listed.into_iter().map(|t| t.name).collect();
    let mut phases = Phases::default();
    let note = if let Some(mut at_from) = reachable {
        at_from
            .geo_cut(GeoCutRequest {
                namespace: ns.clone(),
                to: to.clone(),
                cut: true,
                topics: Vec::new(),
            })
            .await
            .with_context(|| format!("cutting {ns} at {from}"))?;
        phases.cut_ms = start.elapsed().as_millis() as u64;
        format!("{from} answered (--force): its clients of {ns} were cut over to {to}")
    } else {
        format!(
            "{from} did not answer: what it held that {to} lacks is known when it returns (`geo failback` measures it)"
        )
    };
    let limit = std::time::Duration::from_secs(120);
    let served = until_served(&mut at_to, &topics, &to, limit).await?;
    let clients = until_clients_served(
        &to_rec.service_url,
        &parts,
        conn.token.as_deref(),
        &to,
        limit.saturating_sub(served),
    )
    .await?;
    let served = served + clients;
    phases.rto_ms = served.as_millis() as u64 + phases.cut_ms;
    let applied = until_subscriptions_applied(&mut at_to, &topics, &to, limit).await?;
    phases.subscriptions_ms = (served + applied).as_millis() as u64 + phases.cut_ms;
    let mut report = Drill::dry_run(&from, &to, Some(&ns), started_ms, now_ms(), Vec::new());
    report.kind = "failover".into();
    report.id = format!("failover-{started_ms}");
    report.phases = Some(phases);
    report.note = Some(note);
    c.put_drill_report(report.to_pb()).await?;
    print(out, &report.json(), || report.table());
    Ok(())
}

/// `geo failback`: FROM (back) serves NS again after a failover to TO: what TO lacked of
/// FROM's measured, the cut at FROM (if any) ended and its topics loaded, TO's clients of NS
/// sent back, and both caught up; the report kept here.
async fn geo_failback(
    c: &mut Client,
    conn: &Conn,
    from: String,
    to: String,
    ns: String,
    out: Output,
) -> anyhow::Result<()> {
    use meridian_tenancy::drills::{Drill, Phases};
    let (from_rec, to_rec) = site_records(c, &from, &to).await?;
    let Some(mut at_from) = answers(conn, &from_rec.admin_url, &from).await else {
        anyhow::bail!(
            "site {from} does not answer at {}: it must be back before a failback",
            from_rec.admin_url
        );
    };
    let mut at_to = connect(conn, &to_rec.admin_url).await?;
    let listed = at_from
        .list_topics(Name { name: ns.clone() })
        .await?
        .into_inner()
        .topics;
    let topics: Vec<String> = listed.iter().map(|t| t.name.clone()).collect();
    let started_ms = now_ms();
    let mut phases = Phases::default();
    // What FROM held that TO lacks (it goes there now): the failover's actual loss window.
    let measured = measure_exposure(&mut at_from, &topics, &to).await?;
    let (restored, caught_up) =
        restore_and_catch_up(&mut at_from, &mut at_to, (&ns, &from, &to), &listed).await?;
    phases.restore_ms = restored.as_millis() as u64;
    phases.caught_up_ms = caught_up.as_millis() as u64;
    let mut report = Drill::dry_run(&from, &to, Some(&ns), started_ms, now_ms(), measured);
    report.kind = "failback".into();
    report.id = format!("failback-{started_ms}");
    report.phases = Some(phases);
    report.note = Some(format!(
        "the RPO is what {from} held that {to} lacked when {from} came back; it is at {to} now"
    ));
    c.put_drill_report(report.to_pb()).await?;
    print(out, &report.json(), || report.table());
    Ok(())
}

/// `geo drills list | show ID`.
async fn geo_drills(c: &mut Client, cmd: Drills, out: Output) -> anyhow::Result<()> {
    match cmd {
        Drills::List => {
            let l = c.list_drill_reports(Empty {}).await?.into_inner().reports;
            let v: Vec<Value> = l
                .iter()
                .map(|r| json!({"id": r.id, "started_ms": r.started_ms, "summary": r.summary}))
                .collect();
            print(out, &json!(v), || {
                l.iter()
                    .map(|r| format!("{}  {}", r.id, r.summary))
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Drills::Show { id } => {
            let r = c.get_drill_report(Name { name: id }).await?.into_inner();
            let v: Value = serde_json::from_str(&r.json)?;
            let report = meridian_tenancy::drills::Drill::from_json(&v);
            print(out, &v, || match &report {
                Some(rep) => rep.table(),
                None => r.summary.clone(),
            });
        }
    }
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn replication_json(r: &ReplicationStats) -> Value {
    json!({"remote": r.remote, "state": r.state, "reason": r.reason, "since_ms": r.since_ms,
        "backlog_entries": r.backlog_entries,
        "oldest_unreplicated_age_ms": r.oldest_unreplicated_age_ms,
        "last_acked": r.last_acked, "entries_acked": r.entries_acked,
        "dropped_entries": r.dropped_entries})
}

fn replication_line(r: &ReplicationStats) -> String {
    let mut line = format!(
        "replication to {}: {}, backlog {} entries, oldest {:.1} s, last acknowledged {}, {} entries acknowledged",
        r.remote,
        r.state,
        r.backlog_entries,
        r.oldest_unreplicated_age_ms as f64 / 1000.0,
        if r.last_acked.is_empty() { "none" } else { &r.last_acked },
        r.entries_acked
    );
    if r.dropped_entries > 0 {
        line.push_str(&format!(
            ", {} entries dropped by the replication backlog quota",
            r.dropped_entries
        ));
    }
    if !r.reason.is_empty() {
        line.push_str(&format!(" ({})", r.reason));
    }
    line
}

/// `geo status [NS]`: every replicated topic's replicators, the oldest lag first.
async fn geo_status(c: &mut Client, namespace: Option<String>, out: Output) -> anyhow::Result<()> {
    let namespaces = match namespace {
        Some(ns) => vec![ns],
        None => {
            let mut all = Vec::new();
            for t in c.list_tenants(Empty {}).await?.into_inner().names {
                all.extend(
                    c.list_namespaces(Name { name: t })
                        .await?
                        .into_inner()
                        .names,
                );
            }
            all
        }
    };
    let mut rows_out: Vec<(String, ReplicationStats)> = Vec::new();
    for ns in namespaces {
        let l = c
            .get_namespace_topic_stats(Name { name: ns })
            .await?
            .into_inner();
        for s in l.topics {
            for r in s.replication {
                rows_out.push((s.topic.clone(), r));
            }
        }
    }
    rows_out.sort_by(|a, b| {
        b.1.oldest_unreplicated_age_ms
            .cmp(&a.1.oldest_unreplicated_age_ms)
            .then_with(|| a.0.cmp(&b.0))
    });
    let v: Vec<Value> = rows_out
        .iter()
        .map(|(t, r)| {
            let mut j = replication_json(r);
            j["topic"] = json!(t);
            j
        })
        .collect();
    print(out, &json!(v), || {
        rows_out
            .iter()
            .map(|(t, r)| format!("{t}: {}", replication_line(r)))
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}

fn isolation_json(p: &NsIsolationPolicy) -> Value {
    json!({
        "namespaces": p.namespaces,
        "primary": p.primary,
        "secondary": p.secondary,
        "auto_failover_policy_type": p.auto_failover_policy_type,
        "min_limit": p.min_limit,
    })
}

async fn ns_isolation(c: &mut Client, cmd: NsIsolation, out: Output) -> anyhow::Result<()> {
    match cmd {
        NsIsolation::Set {
            cluster,
            name,
            namespaces,
            primary,
            secondary,
            auto_failover_policy_type,
            auto_failover_policy_params,
        } => {
            let mut min_limit = 1u32;
            for kv in &auto_failover_policy_params {
                match kv.split_once('=') {
                    Some(("min_limit", v)) => {
                        min_limit = v.trim().parse().with_context(|| {
                            format!("--auto-failover-policy-params {kv}: min_limit is a number")
                        })?
                    }
                    Some((_, _)) => {}
                    None => anyhow::bail!(
                        "--auto-failover-policy-params {kv}: expected KEY=VALUE (min_limit=1)"
                    ),
                }
            }
            let policy = NsIsolationPolicy {
                namespaces,
                primary,
                secondary,
                auto_failover_policy_type,
                min_limit,
            };
            let v = isolation_json(&policy);
            c.set_ns_isolation_policy(NsIsolationPolicyRequest {
                cluster: cluster.clone(),
                name: name.clone(),
                policy: Some(policy),
            })
            .await?;
            print(out, &v, || {
                format!("isolation policy {name} of {cluster} set")
            });
        }
        NsIsolation::Get { cluster, name } => {
            let all = c
                .get_ns_isolation_policies(Name {
                    name: cluster.clone(),
                })
                .await?
                .into_inner();
            let p = all.policies.get(&name).with_context(|| {
                format!("NotFound: cluster {cluster} has no isolation policy {name}")
            })?;
            let v = isolation_json(p);
            print(out, &v, || v.to_string());
        }
        NsIsolation::List { cluster } => {
            let all = c
                .get_ns_isolation_policies(Name { name: cluster })
                .await?
                .into_inner();
            let v: serde_json::Map<String, Value> = all
                .policies
                .iter()
                .map(|(n, p)| (n.clone(), isolation_json(p)))
                .collect();
            let v = Value::Object(v);
            print(out, &v, || {
                all.policies
                    .iter()
                    .map(|(n, p)| {
                        format!(
                            "{n}: namespaces {:?} primary {:?} secondary {:?} {} min_limit={}",
                            p.namespaces,
                            p.primary,
                            p.secondary,
                            p.auto_failover_policy_type,
                            p.min_limit
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        NsIsolation::Delete { cluster, name } => {
            c.delete_ns_isolation_policy(NsIsolationPolicyName {
                cluster: cluster.clone(),
                name: name.clone(),
            })
            .await?;
            let v = json!({"cluster": cluster, "deleted": name});
            print(out, &v, || {
                format!("isolation policy {name} of {cluster} deleted")
            });
        }
    }
    Ok(())
}

async fn bookies(c: &mut Client, cmd: Bookies, out: Output) -> anyhow::Result<()> {
    match cmd {
        Bookies::List => {
            let r = c.list_bookies(Empty {}).await?.into_inner();
            let v: Vec<Value> = r
                .bookies
                .iter()
                .map(|b| json!({"address": b.address, "rack": b.rack, "group": b.group, "state": b.state, "free_bytes": b.free_bytes}))
                .collect();
            print(out, &Value::Array(v), || {
                r.bookies
                    .iter()
                    .map(|b| {
                        format!(
                            "{}  {}  {}{}  {} GiB free",
                            b.address,
                            b.rack,
                            b.state,
                            if b.group.is_empty() {
                                String::new()
                            } else {
                                format!("  group {}", b.group)
                            },
                            b.free_bytes >> 30
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Bookies::Decommission {
            address,
            no_wait,
            timeout,
        } => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout);
            let mut last = usize::MAX;
            loop {
                let st = c
                    .decommission_bookie(DecommissionBookieRequest {
                        address: address.clone(),
                    })
                    .await?
                    .into_inner();
                if st.done || no_wait || std::time::Instant::now() >= deadline {
                    let v = json!({"address": st.address, "done": st.done, "ledgers": st.ledgers});
                    print(out, &v, || {
                        if st.done {
                            format!(
                                "bookie {} is decommissioned: no ledger names it; safe to remove",
                                st.address
                            )
                        } else {
                            format!(
                                "bookie {} is decommissioned; {} ledger(s) still name it: {:?}",
                                st.address,
                                st.ledgers.len(),
                                st.ledgers
                            )
                        }
                    });
                    if !st.done && !no_wait {
                        anyhow::bail!("timed out after {timeout} s waiting for re-replication");
                    }
                    break;
                }
                if st.ledgers.len() != last && matches!(out, Output::Table) {
                    eprintln!("{} ledger(s) still name {address}", st.ledgers.len());
                    last = st.ledgers.len();
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
        Bookies::UnderReplicated => {
            let r = c.list_under_replicated(Empty {}).await?.into_inner();
            let v: Vec<Value> = r
                .ledgers
                .iter()
                .map(|l| {
                    json!({
                        "ledger": l.ledger,
                        "since_ms": l.since_ms,
                        "attempts": l.attempts,
                        "last_error": l.last_error,
                        "fragments": l.fragments.iter().map(|f| json!({
                            "first_entry": f.first_entry,
                            "last_entry": f.last_entry,
                            "bookies": f.bookies,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            print(out, &Value::Array(v), || {
                if r.ledgers.is_empty() {
                    return "no under-replicated ledgers".to_string();
                }
                r.ledgers
                    .iter()
                    .flat_map(|l| {
                        l.fragments.iter().map(move |f| {
                            format!(
                                "ledger {}  entries {}..={}  lost {}  since {} ms{}",
                                l.ledger,
                                f.first_entry,
                                f.last_entry,
                                f.bookies.join(","),
                                l.since_ms,
                                if l.attempts > 0 {
                                    format!("  {} failed attempts: {}", l.attempts, l.last_error)
                                } else {
                                    String::new()
                                }
                            )
                        })
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Bookies::SetGroup { address, group } => {
            c.set_bookie_group(SetBookieGroupRequest {
                address: address.clone(),
                group: group.clone(),
            })
            .await?;
            let v = json!({"address": address, "group": group});
            print(out, &v, || format!("bookie {address} is in group {group}"));
        }
        Bookies::SetRack { address, rack } => {
            c.set_bookie_rack(SetBookieRackRequest {
                address: address.clone(),
                rack: rack.clone(),
            })
            .await?;
            let v = json!({"address": address, "rack": rack});
            print(out, &v, || format!("bookie {address} is in rack {rack}"));
        }
    }
    Ok(())
}

async fn brokers(c: &mut Client, cmd: Brokers, out: Output) -> anyhow::Result<()> {
    match cmd {
        Brokers::Leader => {
            let b = c.get_leader_broker(Empty {}).await?.into_inner();
            let v = json!({"id": b.id, "service_url": b.service_url, "admin_url": b.admin_url});
            print(out, &v, || format!("{}  {}", b.id, b.service_url));
        }
        Brokers::List => {
            let r = c.list_brokers(Empty {}).await?.into_inner();
            let v: Vec<Value> = r
                .brokers
                .iter()
                .map(|b| {
                    let l = b.load.unwrap_or_default();
                    json!({"id": b.id, "service_url": b.service_url,
                        "service_url_tls": (!b.service_url_tls.is_empty()).then_some(&b.service_url_tls),
                        "http_url": b.http_url, "admin_url": b.admin_url, "started_ms": b.started_ms,
                        "load": {"cpu_percent": l.cpu_percent, "msg_rate_in": l.msg_rate_in,
                            "msg_rate_out": l.msg_rate_out, "bytes_rate_in": l.bytes_rate_in,
                            "bytes_rate_out": l.bytes_rate_out, "topics": l.topics,
                            "bundles": l.bundles, "connections": l.connections,
                            "memory_bytes": l.memory_bytes, "reported_ms": l.reported_ms}})
                })
                .collect();
            print(out, &Value::Array(v), || {
                r.brokers
                    .iter()
                    .map(|b| {
                        let l = b.load.unwrap_or_default();
                        format!(
                            "{}  {}  cpu {:.0}%  in {:.0} msg/s  out {:.0} msg/s  {} topics  {} bundles  {} connections  {} MiB",
                            b.id,
                            b.service_url,
                            l.cpu_percent,
                            l.msg_rate_in,
                            l.msg_rate_out,
                            l.topics,
                            l.bundles,
                            l.connections,
                            l.memory_bytes >> 20
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
    }
    Ok(())
}

/// Prints `v` as JSON, or as `table` rendered for people.
fn print(out: Output, v: &Value, table: impl FnOnce() -> String) {
    match out {
        Output::Json => println!("{}", serde_json::to_string_pretty(v).expect("json")),
        Output::Table => {
            let t = table();
            if !t.is_empty() {
                println!("{t}");
            }
        }
    }
}

fn names(out: Output, n: Names) {
    let v = json!(n.names);
    print(out, &v, || n.names.join("\n"));
}

/// Two columns, aligned.
fn rows(rows: &[(&str, String)]) -> String {
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:<w$}  {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn deleted(out: Output, d: DeleteResponse) {
    let v = json!({"deleted": d.deleted, "dry_run": d.dry_run});
    print(out, &v, || {
        let verb = if d.dry_run { "would delete" } else { "deleted" };
        d.deleted
            .iter()
            .map(|x| format!("{verb} {x}"))
            .collect::<Vec<_>>()
            .join("\n")
    });
}

fn done(out: Output, what: String) {
    print(out, &json!({"ok": what}), || what.clone());
}

async fn clusters(c: &mut Client, cmd: Clusters, out: Output) -> anyhow::Result<()> {
    match cmd {
        Clusters::List => names(out, c.list_clusters(Empty {}).await?.into_inner()),
        Clusters::Get { cluster } => {
            let x = c.get_cluster(Name { name: cluster }).await?.into_inner();
            let v = json!({"name": x.name, "broker_url": x.service_url, "url": x.admin_url,
                "geo_url": x.geo_url});
            print(out, &v, || {
                rows(&[
                    ("name", x.name.clone()),
                    ("broker-url", x.service_url.clone()),
                    ("url", x.admin_url.clone()),
                    ("geo-url", x.geo_url.clone()),
                ])
            });
        }
        Clusters::Create(a) => {
            c.create_cluster(cluster_of(&a)).await?;
            done(out, format!("created cluster {}", a.cluster));
        }
        Clusters::Update(a) => {
            c.update_cluster(cluster_of(&a)).await?;
            done(out, format!("updated cluster {}", a.cluster));
        }
        Clusters::Delete(d) => deleted(
            out,
            c.delete_cluster(DeleteRequest {
                name: d.name,
                dry_run: d.dry_run,
                force: false,
            })
            .await?
            .into_inner(),
        ),
    }
    Ok(())
}

fn cluster_of(a: &ClusterArgs) -> Cluster {
    Cluster {
        name: a.cluster.clone(),
        service_url: a.broker_url.clone(),
        admin_url: a.url.clone(),
        geo_url: a.geo_url.clone(),
    }
}

async fn tenants(c: &mut Client, cmd: Tenants, out: Output) -> anyhow::Result<()> {
    let tenant_of = |a: &TenantArgs| -> anyhow::Result<Tenant> {
        Ok(Tenant {
            name: a.tenant.clone(),
            admin_roles: a.admin_roles.clone(),
            allowed_clusters: a.allowed_clusters.clone(),
            storage_quota_bytes: match a.storage_quota.as_deref() {
                None => None,
                Some("-1") => Some(0),
                Some(s) => Some(parse_size(s)?.max(1)),
            },
        })
    };
    match cmd {
        Tenants::List => names(out, c.list_tenants(Empty {}).await?.into_inner()),
        Tenants::Get { tenant } => {
            let t = c.get_tenant(Name { name: tenant }).await?.into_inner();
            let v = json!({"name": t.name, "admin_roles": t.admin_roles,
                "allowed_clusters": t.allowed_clusters, "storage_quota_bytes": t.storage_quota_bytes});
            print(out, &v, || {
                rows(&[
                    ("name", t.name.clone()),
                    ("admin-roles", t.admin_roles.join(",")),
                    ("allowed-clusters", t.allowed_clusters.join(",")),
                    (
                        "storage-quota-bytes",
                        t.storage_quota_bytes
                            .map_or_else(|| "(none)".to_string(), |q| q.to_string()),
                    ),
                ])
            });
        }
        Tenants::Create(a) => {
            c.create_tenant(tenant_of(&a)?).await?;
            done(out, format!("created tenant {}", a.tenant));
        }
        Tenants::Update(a) => {
            c.update_tenant(tenant_of(&a)?).await?;
            done(out, format!("updated tenant {}", a.tenant));
        }
        Tenants::Delete(d) => deleted(
            out,
            c.delete_tenant(DeleteRequest {
                name: d.name,
                dry_run: d.dry_run,
                force: d.force,
            })
            .await?
            .into_inner(),
        ),
    }
    Ok(())
}

fn policies_json(p: &NamespacePolicies) -> Value {
    json!({
        "deduplication_enabled": p.deduplication_enabled,
        "dead_letter_max_redeliveries": p.dead_letter_max_redeliveries,
        "schema_compatibility_strategy": p.schema_compatibility_strategy,
        "message_ttl_seconds": p.message_ttl_seconds,
        "max_producers_per_topic": p.max_producers_per_topic,
        "max_consumers_per_topic": p.max_consumers_per_topic,
        "max_subscriptions_per_topic": p.max_subscriptions_per_topic,
        "backlog_quota": p.backlog_quota.as_ref().map(quota_json),
        "retention": p.retention.as_ref().map(retention_json),
        "publish_rate": p.publish_rate.as_ref().map(|r| rate_json(Some(r))),
        "dispatch_rate": p.dispatch_rate.as_ref().map(|r| rate_json(Some(r))),
        "subscription_dispatch_rate": p.subscription_dispatch_rate.as_ref().map(|r| rate_json(Some(r))),
        "publish_rate_total": p.publish_rate_total.as_ref().map(|r| rate_json(Some(r))),
        "dispatch_rate_total": p.dispatch_rate_total.as_ref().map(|r| rate_json(Some(r))),
        "compaction_threshold": p.compaction_threshold,
        "bookie_affinity_group": p.bookie_affinity_group.as_ref().map(|g| json!({"primary": g.primary, "secondary": g.secondary})),
        "replication_clusters": p.replication_clusters.as_ref().map(|c| &c.names),
        "replication_backlog_quota": p.replication_backlog_quota.as_ref().map(quota_json),
        "max_replication_lag": p.max_replication_lag.as_ref().map(lag_json),
    })
}

fn lag_json(l: &MaxReplicationLag) -> Value {
    json!({"time_seconds": l.time_seconds, "entries": l.entries, "policy": l.policy})
}

fn show<T: ToString>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "(broker default)".to_string(), T::to_string)
}

async fn namespaces(c: &mut Client, cmd: Namespaces, out: Output) -> anyhow::Result<()> {
    match cmd {
        Namespaces::Unload { namespace, bundle } => {
            let r = c
                .unload_namespace(UnloadNamespaceRequest {
                    namespace: namespace.clone(),
                    bundle: bundle.unwrap_or_default(),
                })
                .await?
                .into_inner();
            let v = json!({"namespace": namespace, "unloaded": r.names});
            print(out, &v, || {
                format!(
                    "unloaded {} bundles of {namespace}: {}",
                    r.names.len(),
                    r.names.join(" ")
                )
            });
            Ok(())
        }
        Namespaces::SplitBundle {
            namespace,
            bundle,
            unload,
        } => {
            let r = c
                .split_namespace_bundle(SplitBundleRequest {
                    namespace: namespace.clone(),
                    bundle: bundle.clone(),
                    unload,
                })
                .await?
                .into_inner();
            let v = json!({"namespace": namespace, "bundle": bundle, "halves": r.names});
            print(out, &v, || {
                format!("split {bundle} of {namespace} into {}", r.names.join(" "))
            });
            Ok(())
        }
        Namespaces::Bundles { namespace } => {
            let r = c.get_bundles(Name { name: namespace }).await?.into_inner();
            let v: Vec<Value> = r
                .bundles
                .iter()
                .map(|b| json!({"range": b.range, "owner": (!b.owner.is_empty()).then_some(&b.owner)}))
                .collect();
            print(out, &Value::Array(v), || {
                r.bundles
                    .iter()
                    .map(|b| {
                        format!(
                            "{}  {}",
                            b.range,
                            if b.owner.is_empty() {
                                "(not owned)"
                            } else {
                                &b.owner
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
            Ok(())
        }
        Namespaces::List { tenant } => {
            names(
                out,
                c.list_namespaces(Name { name: tenant }).await?.into_inner(),
            );
            Ok(())
        }
        Namespaces::GrantPermission {
            namespace,
            role,
            actions,
        } => {
            let p = c
                .grant_permission(PermissionRequest {
                    namespace,
                    role,
                    actions,
                })
                .await?
                .into_inner();
            print_permissions(out, &p);
            Ok(())
        }
        Namespaces::RevokePermission { namespace, role } => {
            let p = c
                .revoke_permission(PermissionRequest {
                    namespace,
                    role,
                    actions: Vec::new(),
                })
                .await?
                .into_inner();
            print_permissions(out, &p);
            Ok(())
        }
        Namespaces::Permissions { namespace } => {
            let p = c
                .get_permissions(Name { name: namespace })
                .await?
                .into_inner();
            print_permissions(out, &p);
            Ok(())
        }
        Namespaces::Create {
            namespace,
            clusters,
        } => {
            c.create_namespace(Namespace {
                name: namespace.clone(),
                policies: (!clusters.is_empty()).then(|| NamespacePolicies {
                    replication_clusters: Some(ClusterList { names: clusters }),
                    ..Default::default()
                }),
            })
            .await?;
            done(out, format!("created namespace {namespace}"));
            Ok(())
        }
        Namespaces::Delete(d) => {
            deleted(
                out,
                c.delete_namespace(DeleteRequest {
                    name: d.name,
                    dry_run: d.dry_run,
                    force: d.force,
                })
                .await?
                .into_inner(),
            );
            Ok(())
        }
        Namespaces::Policy(p) => policy(c, p, out, false).await,
        Namespaces::SetPublishRateTotal {
            namespace,
            msg_publish_rate,
            byte_publish_rate,
        } => {
            let set = NamespacePolicies {
                publish_rate_total: Some(rate_limit(msg_publish_rate, byte_publish_rate, 1)?),
                ..Default::default()
            };
            update_and_print(c, policy_update(namespace, set, &[]), false, out).await
        }
        Namespaces::SetDispatchRateTotal(a) => {
            let set = NamespacePolicies {
                dispatch_rate_total: Some(a.limit()?),
                ..Default::default()
            };
            update_and_print(c, policy_update(a.namespace.clone(), set, &[]), false, out).await
        }
        Namespaces::GetPublishRateTotal { namespace } => {
            print_rate(c, namespace, false, out, |p| p.publish_rate_total).await
        }
        Namespaces::GetDispatchRateTotal { namespace } => {
            print_rate(c, namespace, false, out, |p| p.dispatch_rate_total).await
        }
        Namespaces::RemovePublishRateTotal { namespace } => {
            let req = policy_update(
                namespace,
                NamespacePolicies::default(),
                &["publish_rate_total"],
            );
            update_and_print(c, req, false, out).await
        }
        Namespaces::RemoveDispatchRateTotal { namespace } => {
            let req = policy_update(
                namespace,
                NamespacePolicies::default(),
                &["dispatch_rate_total"],
            );
            update_and_print(c, req, false, out).await
        }
    }
}

/// A policy command on a namespace or (`topic`) on a topic.
async fn policy(c: &mut Client, cmd: PolicyCmd, out: Output, topic: bool) -> anyhow::Result<()> {
    let update =
        |ns: String, set: NamespacePolicies, clear: Vec<&str>| policy_update(ns, set, &clear);
    let req = match cmd {
        PolicyCmd::Policies { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let v = policies_json(&n.policies.unwrap_or_default());
            print(out, &v, || {
                let unset = if topic {
                    "(the namespace's)"
                } else {
                    "(broker default)"
                };
                v.as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, x)| {
                        let shown = if x.is_null() {
                            unset.to_string()
                        } else {
                            x.to_string()
                        };
                        format!("{k:<32}{shown}")
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
            return Ok(());
        }
        PolicyCmd::GetSchemaCompatibilityStrategy { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let s = n
                .policies
                .unwrap_or_default()
                .schema_compatibility_strategy
                .unwrap_or_else(|| "FULL".into());
            print(out, &json!(s), || s.clone());
            return Ok(());
        }
        PolicyCmd::GetMessageTtl { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let t = n.policies.unwrap_or_default().message_ttl_seconds;
            print(out, &json!(t), || show(&t));
            return Ok(());
        }
        PolicyCmd::SetMessageTtl { namespace, ttl } => update(
            namespace,
            NamespacePolicies {
                message_ttl_seconds: Some(ttl),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::SetMaxProducersPerTopic {
            namespace,
            max_producers_per_topic: n,
        } => update(
            namespace,
            NamespacePolicies {
                max_producers_per_topic: Some(n),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::RemoveMaxProducersPerTopic { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["max_producers_per_topic"],
        ),
        PolicyCmd::SetMaxConsumersPerTopic {
            namespace,
            max_consumers_per_topic: n,
        } => update(
            namespace,
            NamespacePolicies {
                max_consumers_per_topic: Some(n),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::RemoveMaxConsumersPerTopic { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["max_consumers_per_topic"],
        ),
        PolicyCmd::SetMaxSubscriptionsPerTopic {
            namespace,
            max_subscriptions_per_topic: n,
        } => update(
            namespace,
            NamespacePolicies {
                max_subscriptions_per_topic: Some(n),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::RemoveMaxSubscriptionsPerTopic { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["max_subscriptions_per_topic"],
        ),
        PolicyCmd::SetBacklogQuota {
            namespace,
            limit_size,
            limit_time,
            policy,
        } => update(
            namespace,
            NamespacePolicies {
                backlog_quota: Some(backlog_quota(limit_size, limit_time, policy)?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetBacklogQuotas { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let q = n.policies.unwrap_or_default().backlog_quota;
            let v = q.as_ref().map_or(Value::Null, quota_json);
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::SetReplicationBacklogQuota {
            namespace,
            limit_size,
            limit_time,
            policy,
        } => update(
            namespace,
            NamespacePolicies {
                replication_backlog_quota: Some(backlog_quota(limit_size, limit_time, policy)?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetReplicationBacklogQuota { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let q = n.policies.unwrap_or_default().replication_backlog_quota;
            let v = q.as_ref().map_or(Value::Null, quota_json);
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::RemoveReplicationBacklogQuota { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["replication_backlog_quota"],
        ),
        PolicyCmd::SetMaxReplicationLag {
            namespace,
            time,
            entries,
            policy,
        } => update(
            namespace,
            NamespacePolicies {
                max_replication_lag: Some(MaxReplicationLag {
                    time_seconds: time
                        .as_deref()
                        .map(parse_duration_s)
                        .transpose()?
                        .unwrap_or(0),
                    entries: entries.unwrap_or(0),
                    policy,
                }),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetMaxReplicationLag { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let l = n.policies.unwrap_or_default().max_replication_lag;
            let v = l.as_ref().map_or(Value::Null, lag_json);
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::RemoveMaxReplicationLag { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["max_replication_lag"],
        ),
        PolicyCmd::SetRetention {
            namespace,
            size,
            time,
        } => {
            let size_mb = match size.as_str() {
                "-1" => -1,
                s => i64::try_from(parse_size(s)? >> 20)?,
            };
            let time_minutes = match time.as_str() {
                "-1" => -1,
                t => i64::try_from(parse_duration_s(t)? / 60)?,
            };
            update(
                namespace,
                NamespacePolicies {
                    retention: Some(Retention {
                        time_minutes,
                        size_mb,
                    }),
                    ..Default::default()
                },
                vec![],
            )
        }
        PolicyCmd::GetRetention { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let r = n.policies.unwrap_or_default().retention;
            let v = r.as_ref().map_or(Value::Null, retention_json);
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::SetCompactionThreshold {
            namespace,
            threshold,
        } => update(
            namespace,
            NamespacePolicies {
                compaction_threshold: Some(parse_size(&threshold)?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetCompactionThreshold { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let t = n.policies.unwrap_or_default().compaction_threshold;
            let v = json!(t);
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::SetBookieAffinityGroup {
            namespace,
            primary_group,
            secondary_group,
        } => update(
            namespace,
            NamespacePolicies {
                bookie_affinity_group: Some(BookieAffinityGroup {
                    primary: primary_group,
                    secondary: secondary_group.unwrap_or_default(),
                }),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetBookieAffinityGroup { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let g = n.policies.unwrap_or_default().bookie_affinity_group;
            let v = g.as_ref().map_or(
                Value::Null,
                |g| json!({"primary": g.primary, "secondary": g.secondary}),
            );
            print(out, &v, || v.to_string());
            return Ok(());
        }
        PolicyCmd::DeleteBookieAffinityGroup { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["bookie_affinity_group"],
        ),
        PolicyCmd::SetClusters {
            namespace,
            clusters,
            removal,
        } => {
            return change_clusters(c, namespace, Some(clusters), removal, topic, out).await;
        }
        PolicyCmd::GetClusters { namespace } => {
            let n = get_policies(c, namespace, topic).await?;
            let names = n
                .policies
                .unwrap_or_default()
                .replication_clusters
                .map(|c| c.names);
            let v = json!(names);
            print(out, &v, || names.map(|n| n.join(",")).unwrap_or_default());
            return Ok(());
        }
        PolicyCmd::RemoveClusters { namespace, removal } => {
            return change_clusters(c, namespace, None, removal, topic, out).await;
        }
        PolicyCmd::RemoveCompactionThreshold { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["compaction_threshold"],
        ),
        PolicyCmd::RemoveRetention { namespace } => {
            update(namespace, NamespacePolicies::default(), vec!["retention"])
        }
        PolicyCmd::RemoveBacklogQuota { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["backlog_quota"],
        ),
        PolicyCmd::SetPublishRate {
            namespace,
            msg_publish_rate,
            byte_publish_rate,
        } => update(
            namespace,
            NamespacePolicies {
                publish_rate: Some(rate_limit(msg_publish_rate, byte_publish_rate, 1)?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::SetDispatchRate(a) => update(
            a.namespace.clone(),
            NamespacePolicies {
                dispatch_rate: Some(a.limit()?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::SetSubscriptionDispatchRate(a) => update(
            a.namespace.clone(),
            NamespacePolicies {
                subscription_dispatch_rate: Some(a.limit()?),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::GetPublishRate { namespace } => {
            return print_rate(c, namespace, topic, out, |p| p.publish_rate).await
        }
        PolicyCmd::GetDispatchRate { namespace } => {
            return print_rate(c, namespace, topic, out, |p| p.dispatch_rate).await
        }
        PolicyCmd::GetSubscriptionDispatchRate { namespace } => {
            return print_rate(c, namespace, topic, out, |p| p.subscription_dispatch_rate).await
        }
        PolicyCmd::RemovePublishRate { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["publish_rate"],
        ),
        PolicyCmd::RemoveDispatchRate { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["dispatch_rate"],
        ),
        PolicyCmd::RemoveSubscriptionDispatchRate { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["subscription_dispatch_rate"],
        ),
        PolicyCmd::RemoveMessageTtl { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["message_ttl_seconds"],
        ),
        PolicyCmd::SetDeduplication {
            namespace, enable, ..
        } => update(
            namespace,
            NamespacePolicies {
                deduplication_enabled: Some(enable),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::RemoveDeduplication { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["deduplication_enabled"],
        ),
        PolicyCmd::SetDeadLetter {
            namespace,
            max_redeliveries,
        } => update(
            namespace,
            NamespacePolicies {
                dead_letter_max_redeliveries: Some(max_redeliveries),
                ..Default::default()
            },
            vec![],
        ),
        PolicyCmd::RemoveDeadLetter { namespace } => update(
            namespace,
            NamespacePolicies::default(),
            vec!["dead_letter_max_redeliveries"],
        ),
        PolicyCmd::SetSchemaCompatibilityStrategy {
            namespace,
            compatibility,
        } => update(
            namespace,
            NamespacePolicies {
                schema_compatibility_strategy: Some(compatibility),
                ..Default::default()
            },
            vec![],
        ),
    };
    update_and_print(c, req, topic, out).await
}

async fn topics(c: &mut Client, cmd: Topics, out: Output) -> anyhow::Result<()> {
    match cmd {
        Topics::List { namespace } => {
            let t = c.list_topics(Name { name: namespace }).await?.into_inner();
            let v: Vec<Value> = t
                .topics
                .iter()
                .map(|t| json!({"name": t.name, "partitions": t.partitions}))
                .collect();
            print(out, &json!(v), || {
                t.topics
                    .iter()
                    .map(|t| match t.partitions {
                        0 => t.name.clone(),
                        n => format!("{}  ({n} partitions)", t.name),
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Topics::Create { topic, partitions }
        | Topics::CreatePartitionedTopic { topic, partitions } => {
            c.create_topic(CreateTopicRequest {
                topic: topic.clone(),
                partitions,
            })
            .await?;
            done(out, format!("created topic {topic}"));
        }
        Topics::UpdatePartitionedTopic { topic, partitions } => {
            c.update_partitions(UpdatePartitionsRequest {
                topic: topic.clone(),
                partitions,
            })
            .await?;
            done(out, format!("{topic} now has {partitions} partitions"));
        }
        Topics::Stats { topic } => {
            let s = c.get_topic_stats(Name { name: topic }).await?.into_inner();
            let subs: Vec<Value> = s
                .subscriptions
                .iter()
                .map(|x| {
                    json!({"name": x.name, "sub_type": x.sub_type, "durable": x.durable,
                        "consumers": x.consumers, "msg_rate_out": x.msg_rate_out,
                        "msgs_out_total": x.msgs_out_total, "backlog_entries": x.backlog_entries,
                        "backlog_bytes": x.backlog_bytes, "unacked_entries": x.unacked_entries,
                        "delayed_entries": x.delayed_entries, "properties": x.properties,
                        "replicated": x.replicated,
                        "sync": x.sync.iter().map(|y| json!({"remote": y.remote,
                            "pending_acks": y.pending_acks, "pending_ms": y.pending_ms,
                            "held": y.held,
                            "error": (!y.error.is_empty()).then_some(&y.error)}))
                            .collect::<Vec<_>>()})
                })
                .collect();
            let v = json!({"topic": s.topic, "msg_rate_in": s.msg_rate_in,
                "msg_rate_out": s.msg_rate_out, "bytes_rate_in": s.bytes_rate_in,
                "bytes_rate_out": s.bytes_rate_out, "msgs_in_total": s.msgs_in_total,
                "msgs_out_total": s.msgs_out_total, "storage_entries": s.storage_entries,
                "storage_bytes": s.storage_bytes, "producers": s.producers,
                "terminated": s.terminated, "subscriptions": subs,
                "backlog_quota_exceeded": (!s.backlog_quota_exceeded.is_empty())
                    .then_some(&s.backlog_quota_exceeded),
                "compaction": s.compaction.as_ref().map(|c| json!({"status": c.status,
                    "last_succeed_ms": c.last_succeed_ms, "last_failed_ms": c.last_failed_ms,
                    "last_duration_ms": c.last_duration_ms,
                    "last_removed_messages": c.last_removed_messages})),
                "replication": s.replication.iter().map(replication_json).collect::<Vec<_>>()});
            print(out, &v, || {
                let mut t = rows(&[
                    ("topic", s.topic.clone()),
                    (
                        "msg rate in / out",
                        format!("{:.1} / {:.1} msg/s", s.msg_rate_in, s.msg_rate_out),
                    ),
                    (
                        "messages in / out",
                        format!("{} / {}", s.msgs_in_total, s.msgs_out_total),
                    ),
                    (
                        "storage",
                        format!("{} entries, {} bytes", s.storage_entries, s.storage_bytes),
                    ),
                    ("producers", s.producers.to_string()),
                    ("terminated", s.terminated.to_string()),
                    (
                        "backlog quota",
                        if s.backlog_quota_exceeded.is_empty() {
                            "within".to_string()
                        } else {
                            format!("exceeded: {}", s.backlog_quota_exceeded)
                        },
                    ),
                ]);
                for r in &s.replication {
                    t.push_str(&format!("\n{}", replication_line(r)));
                }
                for x in &s.subscriptions {
                    t.push_str(&format!(
                        "\nsubscription {} ({}{}): {} consumers, backlog {} entries / {} bytes, {} unacked, {} delayed",
                        x.name,
                        x.sub_type,
                        if x.durable { "" } else { ", non-durable" },
                        x.consumers,
                        x.backlog_entries,
                        x.backlog_bytes,
                        x.unacked_entries,
                        x.delayed_entries
                    ));
                    for y in &x.sync {
                        t.push_str(&format!(
                            "\n  replicated to {}: {} acknowledgements pending ({} ms), {} held there{}",
                            y.remote,
                            y.pending_acks,
                            y.pending_ms,
                            y.held,
                            if y.error.is_empty() {
                                String::new()
                            } else {
                                format!(", last send failed: {}", y.error)
                            }
                        ));
                    }
                }
                t
            });
        }
        Topics::Subs(cmd) => subscriptions(c, cmd, out).await?,
        Topics::StatsAll { namespace } => {
            let l = c
                .get_namespace_topic_stats(Name { name: namespace })
                .await?
                .into_inner();
            let v: Vec<Value> = l
                .topics
                .iter()
                .map(|s| {
                    json!({"topic": s.topic, "msg_rate_in": s.msg_rate_in,
                        "msg_rate_out": s.msg_rate_out, "msgs_in_total": s.msgs_in_total,
                        "storage_entries": s.storage_entries, "storage_bytes": s.storage_bytes,
                        "producers": s.producers, "subscriptions": s.subscriptions.len()})
                })
                .collect();
            print(out, &json!(v), || {
                l.topics
                    .iter()
                    .map(|s| {
                        format!(
                            "{}  in {:.1} msg/s  out {:.1} msg/s  {} entries  {} subscriptions",
                            s.topic,
                            s.msg_rate_in,
                            s.msg_rate_out,
                            s.storage_entries,
                            s.subscriptions.len()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Topics::Delete(d) | Topics::DeletePartitionedTopic(d) => {
            deleted(
                out,
                c.delete_topic(DeleteRequest {
                    name: d.topic,
                    dry_run: d.dry_run,
                    force: d.force,
                })
                .await?
                .into_inner(),
            );
        }
        Topics::Policy(p) => policy(c, p, out, true).await?,
        Topics::Unload { topic } => {
            c.unload_topic(Name {
                name: topic.clone(),
            })
            .await?;
            done(out, format!("unloaded {topic}"));
        }
        Topics::StatsInternal { topic } => {
            let r = c
                .get_topic_internal_stats(Name { name: topic })
                .await?
                .into_inner();
            print_internal_stats(out, &r);
        }
        Topics::Lookup { topic } => {
            let r = c
                .lookup_topic(Name {
                    name: topic.clone(),
                })
                .await?
                .into_inner();
            let v = json!({"topic": r.topic, "bundle": r.bundle,
                "owner": (!r.owner.is_empty()).then_some(&r.owner),
                "service_url": r.service_url,
                "service_url_tls": (!r.service_url_tls.is_empty()).then_some(&r.service_url_tls)});
            print(out, &v, || {
                if r.owner.is_empty() {
                    format!(
                        "{} (not owned yet; its next lookup places it there)",
                        r.service_url
                    )
                } else {
                    r.service_url.clone()
                }
            });
        }
        Topics::Compact { topic } => {
            c.compact_topic(Name {
                name: topic.clone(),
            })
            .await?;
            let v = json!({"topic": topic, "requested": true});
            print(out, &v, || {
                format!("Topic compaction requested for {topic}")
            });
        }
        Topics::CompactionStatus {
            topic,
            wait_complete,
        } => {
            let s = loop {
                let s = c
                    .get_compaction_status(Name {
                        name: topic.clone(),
                    })
                    .await?
                    .into_inner();
                if !wait_complete || s.status != "RUNNING" {
                    break s;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            };
            let v = json!({"status": s.status, "last_error": s.last_error});
            print(out, &v, || match s.status.as_str() {
                "NOT_RUN" => {
                    format!("Compaction has not been run for {topic} since broker startup")
                }
                "RUNNING" => "Compaction is currently running".to_string(),
                "SUCCESS" => "Compaction was a success".to_string(),
                _ => format!("Error in compaction: {}", s.last_error),
            });
            if s.status == "ERROR" {
                std::process::exit(1);
            }
        }
        Topics::Terminate { topic } => {
            let r = c
                .terminate_topic(Name {
                    name: topic.clone(),
                })
                .await?
                .into_inner();
            let v = json!({"topic": topic, "last_message_id": r.last_message_id});
            print(out, &v, || {
                format!("terminated {topic}; last message {}", r.last_message_id)
            });
        }
    }
    Ok(())
}

/// Subscription commands named alike under `topics` and `subscriptions`.
#[derive(Subcommand)]
enum SubsSame {
    /// Acknowledges the next N entries.
    Skip {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 'n')]
        count: u64,
        #[arg(long)]
        dry_run: bool,
    },
    /// Acknowledges the whole backlog.
    ClearBacklog {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long)]
        dry_run: bool,
    },
    /// Acknowledges what was published more than T seconds ago.
    ExpireMessages {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 't')]
        expire_time_seconds: u64,
        #[arg(long)]
        dry_run: bool,
    },
    /// Moves a subscription: to a relative time (-t 10m: what was published in the last ten
    /// minutes comes again) or a message id (-m earliest|latest|ledger:entry).
    ResetCursor {
        #[command(flatten)]
        s: SubArgs,
        #[arg(
            long,
            short = 't',
            conflicts_with = "message_id",
            required_unless_present = "message_id"
        )]
        time: Option<String>,
        #[arg(long, short = 'm')]
        message_id: Option<String>,
    },
    /// Replicates the subscription's acknowledgements to the topic's other sites
    /// (--enable), exactly, or stops (--disable).
    SetReplicatedSubscriptionStatus {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, conflicts_with = "disable", required_unless_present = "disable")]
        enable: bool,
        #[arg(long)]
        disable: bool,
    },
    /// Whether the subscription's acknowledgements are replicated.
    GetReplicatedSubscriptionStatus {
        #[command(flatten)]
        s: SubArgs,
    },
}

/// The `subscriptions` group: short names.
#[derive(Subcommand)]
enum SubsGroup {
    /// The durable subscriptions of a topic.
    List { topic: String },
    /// Creates a subscription at a position: earliest, latest (the default) or ledger:entry.
    Create {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 'm', default_value = "latest")]
        message_id: String,
    },
    /// Deletes a subscription that has no consumers.
    Delete {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long)]
        dry_run: bool,
    },
    /// The next messages of a subscription, without moving it.
    Peek {
        #[command(flatten)]
        s: SubArgs,
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u32,
    },
    #[command(flatten)]
    Same(SubsSame),
}

impl From<SubsGroup> for Subs {
    fn from(g: SubsGroup) -> Subs {
        match g {
            SubsGroup::List { topic } => Subs::Subscriptions { topic },
            SubsGroup::Create { s, message_id } => Subs::CreateSubscription { s, message_id },
            SubsGroup::Delete { s, dry_run } => Subs::Unsubscribe { s, dry_run },
            SubsGroup::Peek { s, count } => Subs::PeekMessages { s, count },
            SubsGroup::Same(x) => Subs::Same(x),
        }
    }
}

fn print_internal_stats(out: Output, r: &InternalStatsList) {
    let v: Vec<Value> = r
        .topics
        .iter()
        .map(|t| {
            json!({
                "topic": t.topic, "managed_ledger": t.managed_ledger, "entries": t.entries,
                "bytes": t.bytes, "last_confirmed": t.last_confirmed, "terminated": t.terminated,
                "ledgers": t.ledgers.iter().map(|l| json!({"ledger_id": l.ledger_id,
                    "entries": l.entries, "bytes": l.bytes, "created_ms": l.created_ms,
                    "closed_ms": l.closed_ms})).collect::<Vec<_>>(),
                "cursors": t.cursors.iter().map(|c| json!({"name": c.name,
                    "durable": c.durable, "mark_delete_position": c.mark_delete_position,
                    "read_position": c.read_position,
                    "individually_deleted": c.individually_deleted,
                    "individually_deleted_ranges": c.individually_deleted_ranges,
                    "cursor_ledger": c.cursor_ledger, "backlog_entries": c.backlog_entries,
                    "unacked_entries": c.unacked_entries, "consumers": c.consumers}))
                    .collect::<Vec<_>>(),
                "compacted_ledger": t.compacted_ledger.as_ref().map(|c| json!({
                    "ledger_id": c.ledger_id, "entries": c.entries, "bytes": c.bytes,
                    "horizon": c.horizon})),
                "replication_origins": t.replication_origins.as_ref().map(|o| json!({
                    "at": o.at, "highest": o.highest})),
            })
        })
        .collect();
    // One topic: its object; a partitioned topic: one per partition.
    let v = match v.as_slice() {
        [one] => one.clone(),
        _ => Value::Array(v),
    };
    print(out, &v, || {
        let mut lines = Vec::new();
        for t in &r.topics {
            lines.push(format!(
                "{}  log {}  {} entries  {} bytes  last {}{}",
                t.topic,
                t.managed_ledger,
                t.entries,
                t.bytes,
                if t.last_confirmed.is_empty() {
                    "-"
                } else {
                    &t.last_confirmed
                },
                if t.terminated { "  terminated" } else { "" }
            ));
            for l in &t.ledgers {
                lines.push(format!(
                    "  ledger {}  {}  {} bytes",
                    l.ledger_id,
                    l.entries
                        .map_or_else(|| "open".to_string(), |n| format!("{n} entries")),
                    l.bytes
                ));
            }
            for c in &t.cursors {
                lines.push(format!(
                    "  cursor {}  mark-delete {}  read {}  {} ranges acked  backlog {}  cursor ledger {}",
                    c.name,
                    if c.mark_delete_position.is_empty() { "-" } else { &c.mark_delete_position },
                    if c.read_position.is_empty() { "-" } else { &c.read_position },
                    c.individually_deleted_ranges,
                    c.backlog_entries,
                    c.cursor_ledger.map_or_else(|| "-".to_string(), |l| l.to_string())
                ));
            }
            if let Some(c) = &t.compacted_ledger {
                lines.push(format!(
                    "  compacted through {}  ledger {}  {} entries  {} bytes",
                    c.horizon,
                    c.ledger_id
                        .map_or_else(|| "-".to_string(), |l| l.to_string()),
                    c.entries,
                    c.bytes
                ));
            }
            if let Some(o) = &t.replication_origins {
                let mut highest: Vec<String> =
                    o.highest.iter().map(|(s, p)| format!("{s} {p}")).collect();
                highest.sort();
                lines.push(format!(
                    "  replication origins through {}  highest: {}",
                    if o.at.is_empty() { "-" } else { &o.at },
                    if highest.is_empty() {
                        "-".to_string()
                    } else {
                        highest.join(", ")
                    }
                ));
            }
        }
        lines.join("\n")
    });
}

fn print_permissions(out: Output, p: &Permissions) {
    let v: serde_json::Map<String, Value> = p
        .roles
        .iter()
        .map(|(r, a)| (r.clone(), json!(a.actions)))
        .collect();
    print(out, &Value::Object(v), || {
        let mut roles: Vec<_> = p.roles.iter().collect();
        roles.sort_by(|a, b| a.0.cmp(b.0));
        roles
            .iter()
            .map(|(r, a)| format!("{r}  {}", a.actions.join(",")))
            .collect::<Vec<_>>()
            .join("\n")
    });
}

fn retention_json(r: &Retention) -> Value {
    json!({"time_minutes": r.time_minutes, "size_mb": r.size_mb})
}

/// A backlog quota from the flags (absent limits are 0: none).
fn backlog_quota(
    limit_size: Option<String>,
    limit_time: Option<String>,
    policy: String,
) -> anyhow::Result<BacklogQuota> {
    Ok(BacklogQuota {
        limit_size_bytes: limit_size
            .as_deref()
            .map(parse_size)
            .transpose()?
            .unwrap_or(0),
        limit_time_seconds: limit_time
            .as_deref()
            .map(parse_duration_s)
            .transpose()?
            .unwrap_or(0),
        policy,
    })
}

fn quota_json(q: &BacklogQuota) -> Value {
    json!({"limit_size_bytes": q.limit_size_bytes, "limit_time_seconds": q.limit_time_seconds,
        "policy": q.policy})
}

/// `1024`, `10K`, `10M`, `1G`, `1T` (powers of 1024) as bytes.
fn parse_size(s: &str) -> anyhow::Result<u64> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a size like 512K, 10M, 1G"))?;
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" => 10,
        "M" | "MB" => 20,
        "G" | "GB" => 30,
        "T" | "TB" => 40,
        other => anyhow::bail!("unknown unit {other:?} in {s:?}; use K, M, G or T"),
    };
    n.checked_mul(1 << shift)
        .with_context(|| format!("{s:?} is too large"))
}

/// `10`, `10s`, `5m`, `2h`, `1d` as seconds.
fn parse_duration_s(s: &str) -> anyhow::Result<u64> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a duration like 30s, 10m, 2h, 1d"))?;
    let unit_s = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => anyhow::bail!("unknown unit {other:?} in {s:?}; use s, m, h or d"),
    };
    Ok(n * unit_s)
}

fn counted(out: Output, what: &str, r: CountResponse) {
    let v = json!({"entries": r.entries, "dry_run": r.dry_run});
    print(out, &v, || {
        if r.dry_run {
            format!("would {what} {} entries", r.entries)
        } else {
            format!("{what}: {} entries", r.entries)
        }
    });
}

async fn subscriptions(c: &mut Client, cmd: Subs, out: Output) -> anyhow::Result<()> {
    let req = |s: SubArgs, dry_run: bool| SubscriptionRequest {
        topic: s.topic,
        subscription: s.subscription,
        dry_run,
    };
    match cmd {
        Subs::Subscriptions { topic } => names(
            out,
            c.list_subscriptions(Name { name: topic })
                .await?
                .into_inner(),
        ),
        Subs::CreateSubscription { s, message_id } => {
            let what = format!("created subscription {} on {}", s.subscription, s.topic);
            c.create_subscription(CreateSubscriptionRequest {
                topic: s.topic,
                subscription: s.subscription,
                position: message_id,
            })
            .await?;
            done(out, what);
        }
        Subs::Unsubscribe { s, dry_run } => deleted(
            out,
            c.delete_subscription(req(s, dry_run)).await?.into_inner(),
        ),
        Subs::PeekMessages { s, count } => {
            let r = c
                .peek_messages(PeekRequest {
                    topic: s.topic,
                    subscription: s.subscription,
                    count,
                })
                .await?
                .into_inner();
            let v: Vec<Value> = r
                .messages
                .iter()
                .map(|m| {
                    json!({"message_id": m.message_id, "publish_time": m.publish_time,
                        "producer_name": m.producer_name, "sequence_id": m.sequence_id,
                        "properties": m.properties, "key": m.key, "messages": m.messages,
                        "payload": String::from_utf8_lossy(&m.payload)})
                })
                .collect();
            print(out, &json!(v), || {
                r.messages
                    .iter()
                    .map(|m| {
                        format!(
                            "{}  {} message(s)  published {}  {:?}",
                            m.message_id,
                            m.messages,
                            m.publish_time,
                            String::from_utf8_lossy(&m.payload)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        Subs::Same(SubsSame::Skip { s, count, dry_run }) => {
            let r = c
                .skip_messages(SkipRequest {
                    topic: s.topic,
                    subscription: s.subscription,
                    count,
                    dry_run,
                })
                .await?
                .into_inner();
            counted(out, "skip", r);
        }
        Subs::Same(SubsSame::ClearBacklog { s, dry_run }) => counted(
            out,
            "clear",
            c.clear_backlog(req(s, dry_run)).await?.into_inner(),
        ),
        Subs::Same(SubsSame::ExpireMessages {
            s,
            expire_time_seconds,
            dry_run,
        }) => {
            let r = c
                .expire_messages(ExpireRequest {
                    topic: s.topic,
                    subscription: s.subscription,
                    expire_seconds: expire_time_seconds,
                    dry_run,
                })
                .await?
                .into_inner();
            counted(out, "expire", r);
        }
        Subs::Same(SubsSame::ResetCursor {
            s,
            time,
            message_id,
        }) => {
            use meridian_tenancy::pb::reset_cursor_request::To;
            let to = match (time, message_id) {
                (Some(t), _) => {
                    let back_ms = parse_duration_s(&t)? * 1000;
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)?
                        .as_millis() as u64;
                    To::PublishTimeMs(now.saturating_sub(back_ms))
                }
                (None, Some(m)) => To::MessageId(m),
                (None, None) => anyhow::bail!("reset-cursor needs -t or -m"),
            };
            let what = format!("reset subscription {} of {}", s.subscription, s.topic);
            c.reset_cursor(ResetCursorRequest {
                topic: s.topic,
                subscription: s.subscription,
                to: Some(to),
            })
            .await?;
            done(out, what);
        }
        Subs::Same(SubsSame::SetReplicatedSubscriptionStatus { s, enable, .. }) => {
            let what = format!(
                "subscription {} of {} is {} replicated",
                s.subscription,
                s.topic,
                if enable { "now" } else { "no longer" }
            );
            c.set_replicated_subscription_status(ReplicatedSubscriptionRequest {
                topic: s.topic,
                subscription: s.subscription,
                enabled: enable,
            })
            .await?;
            done(out, what);
        }
        Subs::Same(SubsSame::GetReplicatedSubscriptionStatus { s }) => {
            let r = c
                .get_replicated_subscription_status(req(s.clone(), false))
                .await?
                .into_inner();
            let v =
                json!({"topic": s.topic, "subscription": s.subscription, "replicated": r.enabled});
            print(out, &v, || r.enabled.to_string());
        }
    }
    Ok(())
}
