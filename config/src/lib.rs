//! Typed configuration of every Meridian role.
//!
//! This crate owns the configuration of every role (metadata service, `meta`
//! admin client, standalone): the section types, their defaults, their
//! validation, and the layering of the sources they are read from:
//!
//! 1. built-in defaults (enough to run a single-node standalone with no file),
//! 2. a TOML file,
//! 3. `MERIDIAN_<SECTION>_<KEY>` environment variables,
//! 4. command-line flag overrides given as `(dotted.key, value)` pairs.
//!
//! Unknown keys and out-of-range values are rejected with the key's full
//! dotted path and the accepted range in a one-line message.
//!
//! It does not do anything with the configuration: it runs nothing, opens no
//! sockets, creates no directories and does not parse command lines.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use toml::{Table, Value};

mod geo;
#[cfg(test)]
mod tests;

pub use geo::GeoConfig;

/// Prefix of every environment variable this crate reads.
pub const ENV_PREFIX: &str = "MERIDIAN_";

/// Origin reported for errors in command-line overrides.
const OVERRIDES_ORIGIN: &str = "command-line flags";

/// Everything that can go wrong while loading or validating a configuration.
///
/// Every message is a single line naming where the problem is and what is
/// accepted instead.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The configuration file could not be read.
    #[error("cannot read config file {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A value could not be parsed or has the wrong type. `origin` is the
    /// file path, the environment variable name or the overridden key.
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    /// A section or key that does not exist. `path` is dotted
    /// (`metadata.nod_id`) or a bare top-level name; `known` lists what
    /// exists at that level.
    #[error("{}", unknown_key_message(.path, .origin, .known))]
    UnknownKey {
        path: String,
        origin: String,
        known: Vec<String>,
    },
    /// A number outside its accepted range.
    #[error("{key} = {value} is out of range; accepted {accepted}")]
    OutOfRange {
        key: String,
        value: String,
        accepted: String,
    },
    /// A value of the right type that is still unusable.
    #[error("{key} = {value} is invalid: {reason}")]
    Invalid {
        key: String,
        value: String,
        reason: String,
    },
}

fn unknown_key_message(path: &str, origin: &str, known: &[String]) -> String {
    let known = known.join(", ");
    match path.split_once('.') {
        Some((section, _)) => {
            format!("unknown key {path} in {origin}; known keys in [{section}]: {known}")
        }
        None => format!("unknown top-level key {path} in {origin}; known sections: {known}"),
    }
}

/// The configuration of every role. Each role reads only its sections
/// (see [`Role::sections`]); the others keep their defaults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[log]`: logging of every role.
    pub log: LogConfig,
    /// `[metadata]`: the replicated metadata service.
    pub metadata: MetadataConfig,
    /// `[client]`: how clients reach the metadata service.
    pub client: ClientConfig,
    /// `[bookie]`: a storage node.
    pub bookie: BookieConfig,
    /// `[broker]`: the Pulsar-protocol broker.
    pub broker: BrokerConfig,
    /// `[standalone]`: everything in one process on one data directory.
    pub standalone: StandaloneConfig,
    /// `[tls]`: mutual TLS between a site's roles (metadata nodes, bookies, brokers, tools).
    pub tls: TlsConfig,
    /// `[geo]`: the link between sites (brokers and standalone).
    pub geo: GeoConfig,
}

/// `[tls]` section, the same for every role: this process's certificate and key and the
/// site's internal CA. All three empty (the default) = plaintext between roles. With them, a
/// metadata node and a bookie serve only TLS and require a client certificate issued by
/// `ca_file`; clients present `cert_file` and trust only `ca_file`. The certificate names its
/// site and role in a subject alternative name `meridian://site/<site>/role/<role>/<name>`
/// (`meridian-admin site-tls create-cert`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// This process's certificate chain, PEM. Default empty (no TLS).
    pub cert_file: String,
    /// The private key of `cert_file`, PEM. Default empty.
    pub key_file: String,
    /// The site's internal CA certificate, PEM: the only root peers are checked against.
    /// Default empty.
    pub ca_file: String,
}

impl TlsConfig {
    /// Whether TLS between roles is on (all three files given).
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// Checks the `[tls]` section: the three keys go together. Whether the files can be read
    /// is checked where they are loaded (the message names the key there too).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let keys = [
            ("tls.cert_file", &self.cert_file),
            ("tls.key_file", &self.key_file),
            ("tls.ca_file", &self.ca_file),
        ];
        let set = keys.iter().filter(|(_, v)| !v.trim().is_empty()).count();
        if set == 0 || set == keys.len() {
            return Ok(());
        }
        let (key, value) = keys
            .iter()
            .find(|(_, v)| v.trim().is_empty())
            .expect("one key is empty");
        Err(invalid(
            key,
            value,
            "tls.cert_file, tls.key_file and tls.ca_file go together (all three, or none for plaintext)",
        ))
    }

    /// Checks that every file of an enabled `[tls]` section can be read; the error names the
    /// key and the file.
    pub fn check_readable(&self) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        for (key, path) in [
            ("tls.cert_file", &self.cert_file),
            ("tls.key_file", &self.key_file),
            ("tls.ca_file", &self.ca_file),
        ] {
            if let Err(e) = std::fs::File::open(path) {
                return Err(invalid(key, path, &format!("cannot be read: {e}")));
            }
        }
        Ok(())
    }
}

/// `[log]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Log filter: `error`, `warn`, `info`, `debug`, `trace` or any
    /// EnvFilter-like directive such as `info,meridian_metadata=debug`.
    /// Any non-blank string is accepted. Default `info`.
    pub level: String,
    /// Emit JSON lines instead of human-readable text. Default `false`.
    pub json: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".to_string(),
            json: false,
        }
    }
}

/// `[metadata]` section: one node of the replicated metadata service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetadataConfig {
    /// This node's id, unique in the cluster. Range 1..=1000000, default 1.
    pub node_id: u64,
    /// Socket address to listen on, `IP:PORT`. Default `127.0.0.1:7101`.
    pub listen: String,
    /// Address other nodes and clients use to reach this node, `IP:PORT`;
    /// empty (the default) means the same as `listen`.
    pub advertise: String,
    /// Directory of the node's log and snapshots; non-empty.
    /// Default `data/metadata`.
    pub data_dir: String,
    /// Members to bootstrap a new cluster with, each `ID=IP:PORT` such as
    /// `1=127.0.0.1:7101`, ids unique. Empty (the default) means a
    /// single-node cluster made of this node.
    pub initial_members: Vec<String>,
    /// Leader heartbeat period, milliseconds. Range 10..=10000, default 100.
    pub heartbeat_interval_ms: u64,
    /// Lower bound of the randomized election timeout, milliseconds.
    /// Range 50..=60000 and at least 3 * `heartbeat_interval_ms`; default 400.
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomized election timeout, milliseconds.
    /// Greater than `election_timeout_min_ms`, at most 120000; default 800.
    pub election_timeout_max_ms: u64,
    /// Take a snapshot every this many applied log entries.
    /// Range 100..=10000000, default 10000.
    pub snapshot_every_entries: u64,
    /// Log entries kept after a snapshot, for slow followers.
    /// Range 0..=10000000, default 1000.
    pub log_entries_kept_after_snapshot: u64,
    /// Largest key, bytes. Range 1..=65536, default 1024.
    pub key_bytes_max: u64,
    /// Largest value, bytes. Range 1..=16777216, default 1048576 (1 MiB).
    pub value_bytes_max: u64,
    /// Most operations in one transaction. Range 1..=10000, default 128.
    pub txn_ops_max: u64,
    /// Shortest session TTL a client may ask for, milliseconds.
    /// Range 100..=3600000, default 1000.
    pub session_ttl_ms_min: u64,
    /// Longest session TTL a client may ask for, milliseconds.
    /// Range `session_ttl_ms_min`..=3600000, default 300000.
    pub session_ttl_ms_max: u64,
    /// Change events kept for watches resuming from an old revision.
    /// Range 1000..=100000000, default 100000.
    pub watch_history_events: u64,
    /// Applied batches buffered per node for live watchers; a watcher that falls further
    /// behind is cut off and resumes from the watch history.
    /// Range 16..=1000000, default 4096.
    pub watch_buffer_batches: u64,
    /// Most keys returned by one list request.
    /// Range 1..=1000000, default 10000.
    pub list_limit_max: u64,
    /// Fsync the log before acknowledging writes. Default `true`.
    pub fsync: bool,
}

impl Default for MetadataConfig {
    fn default() -> Self {
        MetadataConfig {
            node_id: 1,
            listen: "127.0.0.1:7101".to_string(),
            advertise: String::new(),
            data_dir: "data/metadata".to_string(),
            initial_members: Vec::new(),
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 400,
            election_timeout_max_ms: 800,
            snapshot_every_entries: 10_000,
            log_entries_kept_after_snapshot: 1_000,
            key_bytes_max: 1024,
            value_bytes_max: 1_048_576,
            txn_ops_max: 128,
            session_ttl_ms_min: 1_000,
            session_ttl_ms_max: 300_000,
            watch_history_events: 100_000,
            watch_buffer_batches: 4_096,
            list_limit_max: 10_000,
            fsync: true,
        }
    }
}

/// `[bookie]` section: a storage node (journal, entry logs, index).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BookieConfig {
    /// Socket address to listen on, `IP:PORT`. Default `127.0.0.1:3181`.
    pub listen: String,
    /// Address writers and readers use to reach this bookie, `IP:PORT`; empty (the default)
    /// means the same as `listen`. It is the bookie's identity in ledger metadata.
    pub advertise: String,
    /// Address of the bookie's `/metrics` (Prometheus text: journal write and fdatasync
    /// latency, batch sizes, entry-log flushes) and `/health`, `IP:PORT`; empty (the
    /// default) serves neither (in `meridian standalone` the broker's `/metrics` has them).
    pub http_listen: String,
    /// Connections `bookie.http_listen` keeps open at once; one more is answered 503 and
    /// closed. Range 1..=100000, default 512.
    pub http_connections_max: u64,
    /// Directory of the journal; non-empty. Default `data/bookie/journal`. Put it on its own
    /// disk so reads never slow down journal writes.
    pub journal_dir: String,
    /// Directory of entry logs and the index; non-empty. Default `data/bookie/ledgers`.
    pub ledger_dir: String,
    /// The rack the bookie stands in, `/NAME[/NAME...]`: ensembles spread over racks (as
    /// BookKeeper's rack-aware placement). Default `/default-rack`.
    pub rack: String,
    /// The bookie affinity group it belongs to (`NAME`, letters, digits, `.`, `_`, `-`; empty:
    /// none): a namespace with `namespaces set-bookie-affinity-group` keeps its ledgers on
    /// its groups' bookies. Default empty.
    pub group: String,
    /// Flush the journal once this many bytes wait. Range 4096..=67108864, default 1048576.
    pub journal_batch_bytes_max: u64,
    /// Flush the journal once the oldest waiting record has waited this long, microseconds;
    /// 0 flushes as soon as nothing more is queued. Range 0..=1000000, default 0.
    pub journal_flush_delay_us: u64,
    /// Start a new journal file after this many bytes. Range 1048576..=17179869184,
    /// default 536870912 (512 MiB).
    pub journal_file_bytes_max: u64,
    /// Reserve journal file space in steps of this many bytes.
    /// Range 0..=1073741824, default 16777216 (16 MiB).
    pub journal_preallocate_bytes: u64,
    /// Write the journal into pre-filled files: checkpointed journal files recycled whole, or
    /// zero-filled ahead (a fresh bookie zero-fills its first file, `journal_file_bytes_max`,
    /// before it starts). An fdatasync that overwrites blocks need not commit file metadata:
    /// on this machine's disk a 4 KiB write and fdatasync took 0.11-0.14 ms against
    /// 0.15-0.20 ms growing the file. Default `true`.
    pub journal_prefill: bool,
    /// Write each entry once: journal files stay where they are as the entries' store (the
    /// index points into them; garbage collection removes them, or copies what is still live
    /// out of mostly dead ones into entry logs), instead of copying every entry from the
    /// journal into an entry log. Halves what a shared journal and ledger disk writes.
    /// `false`: BookKeeper's way. It does not apply where `journal_dir` and `ledger_dir` are
    /// on different file systems (a journal disk of its own is sized for a journal). An older
    /// Meridian opening such a bookie finds no checkpoint it knows and replays every journal
    /// file into its entry logs (slow, nothing lost). Default `true`.
    pub single_write: bool,
    /// Records queued for the journal before writers wait. Range 1..=1000000, default 100000.
    pub journal_queue_records_max: u64,
    /// Entries held in memory between the journal and entry logs, bytes; adds wait while it
    /// is full. While a flush writes one cache-full out, the next one fills, so the memory
    /// they take reaches twice this under load (kept for reuse, given back after 30 s idle).
    /// Range 1048576..=68719476736, default 268435456 (256 MiB).
    pub write_cache_bytes_max: u64,
    /// Entries read from entry logs kept in memory, bytes.
    /// Range 0..=68719476736, default 67108864 (64 MiB).
    pub read_cache_bytes_max: u64,
    /// Start a new entry log after this many bytes.
    /// Range 1048576..=68719476736, default 1073741824 (1 GiB).
    pub entry_log_bytes_max: u64,
    /// Move the write cache to entry logs at least this often, milliseconds (also whenever it
    /// is half full). Journal files are removed once flushed. Small, frequent flushes keep the
    /// journal's fsyncs from waiting behind a large one on a shared disk (publish p99 at
    /// 10,000 msg/s: about 2.5 ms at 250 against about 5 ms at 10000); a flush with nothing
    /// new costs nothing. Range 10..=600000, default 250.
    pub flush_interval_ms: u64,
    /// Do the flusher's routine write-cache flushes and garbage collection in the idle I/O
    /// class, so the journal's fdatasyncs do not queue behind them where the disk's scheduler
    /// honours classes (mq-deadline, bfq); a flush of a half-full cache and spare journal
    /// files stay in the default class. Default `true`.
    pub flusher_io_idle: bool,
    /// Look for entry logs to remove or compact this often, milliseconds.
    /// Range 100..=86400000, default 60000.
    pub gc_interval_ms: u64,
    /// Compact an entry log once less than this share of it is live, percent.
    /// Range 0..=100, default 50.
    pub compaction_live_percent_min: u64,
    /// Turn read-only above this share of the journal's or the ledgers' disk used, percent.
    /// Range 1..=100, default 95.
    pub disk_usage_percent_max: u64,
    /// Largest protocol frame, bytes. Range 1024..=268435456, default 5243904 (5 MiB + 1 KiB).
    pub frame_bytes_max: u64,
    /// Requests one connection may have in flight. Range 1..=1000000, default 10000.
    pub requests_in_flight_max: u64,
    /// A connection whose peer takes no byte of its responses this long (a frozen broker) is
    /// closed, and the responses queued for it let go, milliseconds.
    /// Range 1000..=3600000, default 30000.
    pub write_stall_ms: u64,
    /// TTL of the registration session in the metadata store, milliseconds: a bookie that
    /// stops is unregistered this long after. Range 1000..=300000, default 10000.
    pub session_ttl_ms: u64,
    /// Fsync the journal before acknowledging adds. Default `true`.
    pub fsync: bool,
    /// Autorecovery (in brokers and `meridian autorecovery`): a bookie unregistered this long
    /// is lost and every ledger with a replica on it is re-replicated elsewhere, milliseconds.
    /// Long enough for a restart not to start copies. Range 0..=86400000, default 60000.
    pub lost_grace_ms: u64,
    /// Autorecovery: while a bookie is lost or decommissioned, every ledger is audited again
    /// this often (writers moving off it leave new fragments behind), milliseconds.
    /// Range 1000..=3600000, default 10000.
    pub audit_interval_ms: u64,
}

impl Default for BookieConfig {
    fn default() -> Self {
        BookieConfig {
            listen: "127.0.0.1:3181".to_string(),
            advertise: String::new(),
            http_listen: String::new(),
            http_connections_max: 512,
            journal_dir: "data/bookie/journal".to_string(),
            ledger_dir: "data/bookie/ledgers".to_string(),
            rack: "/default-rack".to_string(),
            group: String::new(),
            journal_batch_bytes_max: 1 << 20,
            journal_flush_delay_us: 0,
            journal_file_bytes_max: 512 << 20,
            journal_preallocate_bytes: 16 << 20,
            journal_prefill: true,
            single_write: true,
            journal_queue_records_max: 100_000,
            write_cache_bytes_max: 256 << 20,
            read_cache_bytes_max: 64 << 20,
            entry_log_bytes_max: 1 << 30,
            flush_interval_ms: 250,
            flusher_io_idle: true,
            gc_interval_ms: 60_000,
            compaction_live_percent_min: 50,
            disk_usage_percent_max: 95,
            frame_bytes_max: (5 << 20) + 1024,
            requests_in_flight_max: 10_000,
            write_stall_ms: 30_000,
            session_ttl_ms: 10_000,
            fsync: true,
            lost_grace_ms: 60_000,
            audit_interval_ms: 10_000,
        }
    }
}

impl BookieConfig {
    /// `advertise`, or `listen` when `advertise` is empty.
    pub fn advertise_addr(&self) -> &str {
        if self.advertise.is_empty() {
            &self.listen
        } else {
            &self.advertise
        }
    }

    /// Checks the `[bookie]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        socket_addr("bookie.listen", &self.listen)?;
        if !self.rack.starts_with('/')
            || self.rack.len() < 2
            || self.rack.split('/').skip(1).any(str::is_empty)
            || self.rack.chars().any(char::is_whitespace)
        {
            return Err(invalid(
                "bookie.rack",
                &self.rack,
                "must be /NAME or /NAME/NAME..., without spaces",
            ));
        }
        if !self.advertise.is_empty() {
            socket_addr("bookie.advertise", &self.advertise)?;
        }
        if !self.http_listen.is_empty() {
            socket_addr("bookie.http_listen", &self.http_listen)?;
        }
        if !self
            .group
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(invalid(
                "bookie.group",
                &self.group,
                "must be empty or letters, digits, '.', '_' and '-'",
            ));
        }
        for (key, dir) in [
            ("bookie.journal_dir", &self.journal_dir),
            ("bookie.ledger_dir", &self.ledger_dir),
        ] {
            if dir.trim().is_empty() {
                return Err(invalid(key, dir, "must not be empty"));
            }
        }
        let b = self;
        #[rustfmt::skip]
        let bounds = [
            ("bookie.http_connections_max", b.http_connections_max, 1, 100_000, ""),
            ("bookie.journal_batch_bytes_max", b.journal_batch_bytes_max, 4_096, 67_108_864, ""),
            ("bookie.journal_flush_delay_us", b.journal_flush_delay_us, 0, 1_000_000, ""),
            ("bookie.journal_file_bytes_max", b.journal_file_bytes_max, 1_048_576, 17_179_869_184, ""),
            ("bookie.journal_preallocate_bytes", b.journal_preallocate_bytes, 0, 1_073_741_824, ""),
            ("bookie.journal_queue_records_max", b.journal_queue_records_max, 1, 1_000_000, ""),
            ("bookie.write_cache_bytes_max", b.write_cache_bytes_max, 1_048_576, 68_719_476_736, ""),
            ("bookie.read_cache_bytes_max", b.read_cache_bytes_max, 0, 68_719_476_736, ""),
            ("bookie.entry_log_bytes_max", b.entry_log_bytes_max, 1_048_576, 68_719_476_736, ""),
            ("bookie.flush_interval_ms", b.flush_interval_ms, 10, 600_000, ""),
            ("bookie.gc_interval_ms", b.gc_interval_ms, 100, 86_400_000, ""),
            ("bookie.compaction_live_percent_min", b.compaction_live_percent_min, 0, 100, ""),
            ("bookie.disk_usage_percent_max", b.disk_usage_percent_max, 1, 100, ""),
            ("bookie.frame_bytes_max", b.frame_bytes_max, 1_024, 268_435_456, ""),
            ("bookie.requests_in_flight_max", b.requests_in_flight_max, 1, 1_000_000, ""),
            ("bookie.write_stall_ms", b.write_stall_ms, 1_000, 3_600_000, ""),
            ("bookie.session_ttl_ms", b.session_ttl_ms, 1_000, 300_000, ""),
            ("bookie.lost_grace_ms", b.lost_grace_ms, 0, 86_400_000, ""),
            ("bookie.audit_interval_ms", b.audit_interval_ms, 1_000, 3_600_000, ""),
        ];
        ranges(&bounds)
    }
}

/// `[broker]` section: the broker serving the Pulsar protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BrokerConfig {
    /// Socket address of the Pulsar protocol, `IP:PORT`. Default `127.0.0.1:6650`.
    pub listen: String,
    /// Address clients are told to connect to (lookup answers), `HOST:PORT`; empty (the
    /// default) means the address actually bound.
    pub advertise: String,
    /// Socket address of the HTTP endpoint (`/metrics`, `/health`), `IP:PORT`.
    /// Default `127.0.0.1:8080`.
    pub http_listen: String,
    /// Connections `broker.http_listen` keeps open at once (Pulsar's
    /// `maxHttpServerConnections`); one more is answered 503 and closed. Range 1..=100000,
    /// default 512.
    pub http_connections_max: u64,
    /// Pulsar-protocol connections (both ports together) the broker keeps open at once
    /// (Pulsar's `brokerMaxConnections`); one more is sent an `Error` (NotAllowedError) and
    /// closed. 0 (the default): no bound. Range 0..=1000000.
    pub connections_max: u64,
    /// ... from one client address (Pulsar's `brokerMaxConnectionsPerIp`). 0 (the default):
    /// no bound. Range 0..=1000000.
    pub connections_per_ip_max: u64,
    /// Socket address of the gRPC admin API (`meridian-admin`), `IP:PORT`.
    /// Default `127.0.0.1:6680`.
    pub admin_listen: String,
    /// This site's name, used in generated producer names. Non-empty, default `standalone`.
    pub cluster_name: String,
    /// Create topics when a producer or consumer first names them. Default `true`.
    pub allow_auto_topic_creation: bool,
    /// What auto-creation creates: `non-partitioned` (the default) or `partitioned` (with
    /// `broker.default_num_partitions` partitions, created at the first lookup of the name).
    pub allow_auto_topic_creation_type: String,
    /// Partitions of an auto-created partitioned topic. Range 1..=`broker.partitions_max`,
    /// default 1.
    pub default_num_partitions: u64,
    /// Most partitions a partitioned topic may have. Range 1..=100000, default 10000.
    pub partitions_max: u64,
    /// Deduplicate sends by producer name and sequence id in namespaces whose policies do
    /// not say otherwise. Default `false` (as Pulsar's `brokerDeduplicationEnabled`).
    pub deduplication_enabled: bool,
    /// Require a token (JWT) from Pulsar clients (CONNECT, method `token`) and on the admin
    /// API (bearer). Default `false`. Needs `broker.token_secret_key_file` or
    /// `broker.token_public_key_file`.
    pub authentication_enabled: bool,
    /// HS256 secret key (raw bytes, as `meridian-admin tokens create-secret-key` writes it).
    pub token_secret_key_file: String,
    /// RS256 public key (PEM).
    pub token_public_key_file: String,
    /// Roles (tokens' `sub`) that may administer everything, comma-separated. With
    /// authentication on, everyone else administers only the tenants that list them.
    pub superuser_roles: String,
    /// Socket address of the Pulsar protocol over TLS (`pulsar+ssl://`), `IP:PORT`; served
    /// only when `broker.tls_cert_file` is set. Default `127.0.0.1:6651`.
    pub tls_listen: String,
    /// The server's certificate chain (PEM) for the TLS port and, with `broker.admin_tls`,
    /// the admin API. Empty (the default): no TLS.
    pub tls_cert_file: String,
    /// The private key (PEM, PKCS#8, PKCS#1 or SEC1) of `broker.tls_cert_file`.
    pub tls_key_file: String,
    /// CA certificates (PEM) that client certificates are checked against (mutual TLS; the
    /// certificate's subject CN is the client's role), and that other brokers' https admin
    /// APIs are checked against when admin calls are forwarded to them. Empty: client
    /// certificates are not asked for, and https admin APIs are not forwarded to.
    pub tls_trust_certs_file: String,
    /// Serve the admin API over TLS only (`https://`). Default `false`. Needs
    /// `broker.tls_cert_file`.
    pub admin_tls: bool,
    /// Re-read namespace policies and apply message TTLs this often, milliseconds.
    /// Range 100..=60000, default 1000.
    pub policy_refresh_interval_ms: u64,
    /// Entries between two snapshots of a topic's deduplication state; a restart replays at
    /// most this many entries to rebuild it. Range 1..=1000000, default 1000.
    pub deduplication_snapshot_entries: u64,
    /// Largest message a client may send (advertised as max_message_size), bytes.
    /// Range 1024..=104857600, default 5242880 (5 MiB).
    pub message_bytes_max: u64,
    /// Sends of one producer waiting for their receipts; more are refused.
    /// Range 1..=1000000, default 10000.
    pub producer_pending_sends_max: u64,
    /// Producers plus consumers one connection may hold. Range 1..=1000000, default 10000.
    pub connection_handles_max: u64,
    /// Frames queued for one connection's socket, bytes. A consumer whose connection holds
    /// this much is given nothing more until it drains (a client that stops reading stalls
    /// only itself); one frame may cross the bound. Range 65536..=1073741824, default
    /// 8388608 (8 MiB).
    pub connection_write_queue_bytes_max: u64,
    /// Unacknowledged messages one consumer may hold (Pulsar's
    /// `maxUnackedMessagesPerConsumer`); at the limit it is given nothing more until its
    /// acknowledgements bring it under half. 0: no limit. Range 0..=100000000, default 50000.
    pub consumer_unacked_messages_max: u64,
    /// A gauge of /metrics (a topic's, subscription's or tenant's) not set for this long is
    /// dropped: its topic was unloaded or deleted. At least the policy refresh interval.
    /// Seconds, range 10..=3600, default 90.
    pub metrics_series_idle_s: u64,
    /// Deduplication forgets a producer name that has not sent or attached for this long
    /// (Pulsar's `brokerDeduplicationProducerInactivityTimeoutMinutes`, 6 h): a client
    /// that comes back later with the same name starts afresh. Seconds, range
    /// 10..=2592000, default 21600.
    pub dedup_producer_inactivity_s: u64,
    /// A loaded topic with no producer and no consumer for this long is unloaded (its log
    /// closed, its memory freed; the next client loads it again), or deleted as
    /// `broker.inactive_topic_delete_mode` says. Checked every 5 s. 0: never. Seconds,
    /// range 0..=31536000, default 600.
    pub inactive_topic_ttl_s: u64,
    /// What happens to an inactive topic (Pulsar's `brokerDeleteInactiveTopicsMode`): `keep`
    /// (the default: unloaded, its data kept), `delete_when_no_subscriptions` or
    /// `delete_when_subscriptions_caught_up` (deleted with its data; partitions of a
    /// partitioned topic are only unloaded).
    pub inactive_topic_delete_mode: String,
    /// Unacknowledged messages of all a subscription's consumers together (Pulsar's
    /// `maxUnackedMessagesPerSubscription`), with the same rule. 0: no limit.
    /// Range 0..=100000000, default 200000.
    pub subscription_unacked_messages_max: u64,
    /// Ping an idle client this often, and drop it after a whole interval without a byte from
    /// it, or with its socket taking no byte of what is to be written, milliseconds. The admin
    /// API's connections too: pinged (HTTP/2) this often, closed when a ping is not answered
    /// within it or nothing comes for twice it. Range 1000..=3600000, default 30000.
    pub keepalive_interval_ms: u64,
    /// Bookies per ledger of a topic. Range 1..=64, default 1.
    pub ensemble: u64,
    /// Bookies each entry is written to. Range 1..=`ensemble`, default 1.
    pub write_quorum: u64,
    /// Bookies that must fsync an entry before it is acknowledged.
    /// Range 1..=`write_quorum`, default 1.
    pub ack_quorum: u64,
    /// Start a new ledger of a topic after this many entries. Range 1..=100000000, default 50000.
    pub ledger_rollover_entries_max: u64,
    /// ... but not before the ledger is this old, milliseconds (a roll-over pauses the topic's
    /// appends briefly). Range 0..=86400000, default 600000 (10 minutes, as Pulsar).
    pub ledger_rollover_min_age_ms: u64,
    /// How long a send that needs a new ledger waits for enough writable bookies before it
    /// is refused (a bookie restarting or between two registrations), milliseconds; the wait
    /// is shared by a topic's sends, and once it has run out they are refused at once until a
    /// ledger is made. Range 0..=60000, default 5000.
    pub ledger_create_wait_ms: u64,
    /// Recently written entries kept in memory per topic for tailing consumers, bytes.
    /// Range 0..=17179869184, default 16777216 (16 MiB).
    pub tail_cache_bytes_max: u64,
    /// ... and by all topics of the broker together, bytes.
    /// Range 0..=68719476736, default 268435456 (256 MiB).
    pub tail_cache_total_bytes_max: u64,
    /// Persist a subscription's acknowledgements at most this often, milliseconds (they are
    /// also persisted when its consumers leave and at shutdown); 0 persists every ack.
    /// Range 0..=60000, default 100.
    pub cursor_persist_interval_ms: u64,
    /// Entries a dispatcher reads at once. Range 1..=10000, default 100.
    pub dispatch_batch_entries_max: u64,
    /// Compact a topic by itself once more than this many bytes were published since its
    /// last compaction, unless its namespace or topic policy says otherwise (Pulsar's
    /// `brokerServiceCompactionThresholdInBytes`); checked every policy refresh. 0 (the
    /// default): only when asked. Range 0..=1125899906842624 (1 PiB).
    pub compaction_threshold_bytes: u64,
    /// Distinct keys one compaction may hold in memory; a topic with more fails its
    /// compaction with an error saying so (its view stays as it was). Range
    /// 1..=100000000, default 10000000.
    pub compaction_keys_max: u64,
    /// The broker's metadata session: its registration and its bundles' ownership are
    /// ephemeral keys of it, gone this long after its last keep-alive (sent every third of
    /// it). A broker that could not renew it stops serving its bundles before that. Range
    /// 1000..=300000, default 5000.
    pub session_ttl_ms: u64,
    /// Bundles (hash ranges of topic names) a namespace is cut into when its first topic is
    /// looked up (Pulsar's `defaultNumberOfNamespaceBundles`). Range 1..=1024, default 4.
    pub default_bundles: u64,
    /// Refresh the broker's load report (CPU, rates, topics, connections, memory) in its
    /// registration this often, milliseconds. Range 500..=60000, default 3000.
    pub load_report_interval_ms: u64,
    /// The leading broker moves a bundle from the broker owning the most bundles to the one
    /// owning the fewest when they differ by 2 or more, one bundle per this interval,
    /// milliseconds. Range 1000..=3600000, default 60000.
    pub load_shed_interval_ms: u64,
    /// A bundle moved is not moved again for this long, milliseconds. Range 0..=86400000,
    /// default 300000.
    pub load_shed_grace_ms: u64,
    /// Shedding by usage (as Pulsar's ThresholdShedder): a broker whose usage (the larger of
    /// its CPU over its cores and its message rate over `load_msg_rate_capacity`) is this
    /// many percentage points above the site's average sheds a bundle with traffic to the
    /// least used broker, before bundle counts are compared. Range 1..=100, default 10.
    pub load_shed_threshold_percent: u64,
    /// Messages per second in and out that count as a broker's full usage. Range
    /// 1..=100000000, default 200000.
    pub load_msg_rate_capacity: u64,
    /// Shed bundles at all (placement of unowned bundles happens regardless). Default `true`.
    pub load_balancer_enabled: bool,
    /// A bundle's owner splits it in two (and unloads the upper half, which the next lookup
    /// places on the least loaded broker) when it holds more topics than
    /// `bundle_split_topics_max` or more messages per second in and out than
    /// `bundle_split_msg_rate_max`, while the namespace has fewer than
    /// `namespace_bundles_max` bundles. Default `true` (with `load_balancer_enabled`).
    pub bundle_split_enabled: bool,
    /// Range 1..=1000000, default 1000 (Pulsar's `loadBalancerNamespaceBundleMaxTopics`).
    pub bundle_split_topics_max: u64,
    /// Messages per second in and out. Range 1..=100000000, default 30000 (Pulsar's
    /// `loadBalancerNamespaceBundleMaxMsgRate`).
    pub bundle_split_msg_rate_max: u64,
    /// Range 1..=65536, default 128 (Pulsar's `loadBalancerNamespaceMaximumBundles`).
    pub namespace_bundles_max: u64,
    /// Run bookie autorecovery in this broker (the auditor election and a replication
    /// worker; settings `bookie.lost_grace_ms`, `bookie.audit_interval_ms`). Default `true`.
    pub autorecovery_enabled: bool,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            listen: "127.0.0.1:6650".to_string(),
            advertise: String::new(),
            http_listen: "127.0.0.1:8080".to_string(),
            http_connections_max: 512,
            connections_max: 0,
            connections_per_ip_max: 0,
            admin_listen: "127.0.0.1:6680".to_string(),
            cluster_name: "standalone".to_string(),
            allow_auto_topic_creation: true,
            allow_auto_topic_creation_type: "non-partitioned".to_string(),
            default_num_partitions: 1,
            partitions_max: 10_000,
            deduplication_enabled: false,
            deduplication_snapshot_entries: 1_000,
            policy_refresh_interval_ms: 1_000,
            authentication_enabled: false,
            token_secret_key_file: String::new(),
            token_public_key_file: String::new(),
            superuser_roles: String::new(),
            tls_listen: "127.0.0.1:6651".to_string(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_trust_certs_file: String::new(),
            admin_tls: false,
            message_bytes_max: 5 << 20,
            producer_pending_sends_max: 10_000,
            connection_handles_max: 10_000,
            connection_write_queue_bytes_max: 8 << 20,
            consumer_unacked_messages_max: 50_000,
            metrics_series_idle_s: 90,
            dedup_producer_inactivity_s: 21_600,
            inactive_topic_ttl_s: 600,
            inactive_topic_delete_mode: "keep".to_string(),
            subscription_unacked_messages_max: 200_000,
            keepalive_interval_ms: 30_000,
            ensemble: 1,
            write_quorum: 1,
            ack_quorum: 1,
            ledger_rollover_entries_max: 50_000,
            ledger_rollover_min_age_ms: 600_000,
            ledger_create_wait_ms: 5_000,
            tail_cache_bytes_max: 16 << 20,
            tail_cache_total_bytes_max: 256 << 20,
            cursor_persist_interval_ms: 100,
            dispatch_batch_entries_max: 100,
            compaction_threshold_bytes: 0,
            compaction_keys_max: 10_000_000,
            session_ttl_ms: 5_000,
            default_bundles: 4,
            load_report_interval_ms: 3_000,
            load_shed_interval_ms: 60_000,
            load_shed_grace_ms: 300_000,
            load_shed_threshold_percent: 10,
            load_msg_rate_capacity: 200_000,
            load_balancer_enabled: true,
            bundle_split_enabled: true,
            bundle_split_topics_max: 1_000,
            bundle_split_msg_rate_max: 30_000,
            namespace_bundles_max: 128,
            autorecovery_enabled: true,
        }
    }
}

impl BrokerConfig {
    /// Checks the `[broker]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        socket_addr("broker.listen", &self.listen)?;
        socket_addr("broker.http_listen", &self.http_listen)?;
        socket_addr("broker.admin_listen", &self.admin_listen)?;
        if !self.advertise.is_empty() {
            host_port(&self.advertise)
                .map_err(|reason| invalid("broker.advertise", &self.advertise, reason))?;
        }
        if self.cluster_name.trim().is_empty() || self.cluster_name.contains('/') {
            return Err(invalid(
                "broker.cluster_name",
                &self.cluster_name,
                "must be non-empty and without `/`",
            ));
        }
        socket_addr("broker.tls_listen", &self.tls_listen)?;
        if !self.token_secret_key_file.is_empty() && !self.token_public_key_file.is_empty() {
            return Err(invalid(
                "broker.token_public_key_file",
                &self.token_public_key_file,
                "give broker.token_secret_key_file or broker.token_public_key_file, not both",
            ));
        }
        let token_key =
            !self.token_secret_key_file.is_empty() || !self.token_public_key_file.is_empty();
        if self.authentication_enabled && !token_key && self.tls_trust_certs_file.is_empty() {
            return Err(invalid(
                "broker.authentication_enabled",
                &self.authentication_enabled,
                "needs a token key (broker.token_secret_key_file or broker.token_public_key_file) or client certificates (broker.tls_trust_certs_file)",
            ));
        }
        if self.tls_cert_file.is_empty() != self.tls_key_file.is_empty() {
            return Err(invalid(
                "broker.tls_key_file",
                &self.tls_key_file,
                "broker.tls_cert_file and broker.tls_key_file go together",
            ));
        }
        if self.tls_cert_file.is_empty() && !self.tls_trust_certs_file.is_empty() {
            return Err(invalid(
                "broker.tls_trust_certs_file",
                &self.tls_trust_certs_file,
                "needs broker.tls_cert_file (client certificates come over TLS)",
            ));
        }
        if self.admin_tls && self.tls_cert_file.is_empty() {
            return Err(invalid(
                "broker.admin_tls",
                &self.admin_tls,
                "needs broker.tls_cert_file and broker.tls_key_file",
            ));
        }
        if !["non-partitioned", "partitioned"]
            .contains(&self.allow_auto_topic_creation_type.as_str())
        {
            return Err(invalid(
                "broker.allow_auto_topic_creation_type",
                &self.allow_auto_topic_creation_type,
                "expected one of non-partitioned, partitioned",
            ));
        }
        if ![
            "keep",
            "delete_when_no_subscriptions",
            "delete_when_subscriptions_caught_up",
        ]
        .contains(&self.inactive_topic_delete_mode.as_str())
        {
            return Err(invalid(
                "broker.inactive_topic_delete_mode",
                &self.inactive_topic_delete_mode,
                "expected one of keep, delete_when_no_subscriptions, delete_when_subscriptions_caught_up",
            ));
        }
        let b = self;
        #[rustfmt::skip]
        let bounds = [
            ("broker.partitions_max", b.partitions_max, 1, 100_000, ""),
            ("broker.default_num_partitions", b.default_num_partitions, 1, b.partitions_max, " (at most broker.partitions_max)"),
            ("broker.deduplication_snapshot_entries", b.deduplication_snapshot_entries, 1, 1_000_000, ""),
            ("broker.policy_refresh_interval_ms", b.policy_refresh_interval_ms, 100, 60_000, ""),
            ("broker.message_bytes_max", b.message_bytes_max, 1_024, 104_857_600, ""),
            ("broker.producer_pending_sends_max", b.producer_pending_sends_max, 1, 1_000_000, ""),
            ("broker.connection_handles_max", b.connection_handles_max, 1, 1_000_000, ""),
            ("broker.http_connections_max", b.http_connections_max, 1, 100_000, ""),
            ("broker.connections_max", b.connections_max, 0, 1_000_000, ""),
            ("broker.connections_per_ip_max", b.connections_per_ip_max, 0, 1_000_000, ""),
            ("broker.connection_write_queue_bytes_max", b.connection_write_queue_bytes_max, 65_536, 1_073_741_824, ""),
            ("broker.consumer_unacked_messages_max", b.consumer_unacked_messages_max, 0, 100_000_000, ""),
            ("broker.metrics_series_idle_s", b.metrics_series_idle_s, 10, 3_600, ""),
            ("broker.dedup_producer_inactivity_s", b.dedup_producer_inactivity_s, 10, 2_592_000, ""),
            ("broker.inactive_topic_ttl_s", b.inactive_topic_ttl_s, 0, 31_536_000, ""),
            ("broker.subscription_unacked_messages_max", b.subscription_unacked_messages_max, 0, 100_000_000, ""),
            ("broker.keepalive_interval_ms", b.keepalive_interval_ms, 1_000, 3_600_000, ""),
            ("broker.ensemble", b.ensemble, 1, 64, ""),
            ("broker.write_quorum", b.write_quorum, 1, b.ensemble, " (at most broker.ensemble)"),
            ("broker.ack_quorum", b.ack_quorum, 1, b.write_quorum, " (at most broker.write_quorum)"),
            ("broker.ledger_rollover_entries_max", b.ledger_rollover_entries_max, 1, 100_000_000, ""),
            ("broker.ledger_rollover_min_age_ms", b.ledger_rollover_min_age_ms, 0, 86_400_000, ""),
            ("broker.ledger_create_wait_ms", b.ledger_create_wait_ms, 0, 60_000, ""),
            ("broker.tail_cache_bytes_max", b.tail_cache_bytes_max, 0, 17_179_869_184, ""),
            ("broker.tail_cache_total_bytes_max", b.tail_cache_total_bytes_max, 0, 68_719_476_736, ""),
            ("broker.cursor_persist_interval_ms", b.cursor_persist_interval_ms, 0, 60_000, ""),
            ("broker.dispatch_batch_entries_max", b.dispatch_batch_entries_max, 1, 10_000, ""),
            ("broker.compaction_threshold_bytes", b.compaction_threshold_bytes, 0, 1 << 50, ""),
            ("broker.compaction_keys_max", b.compaction_keys_max, 1, 100_000_000, ""),
            ("broker.session_ttl_ms", b.session_ttl_ms, 1_000, 300_000, ""),
            ("broker.default_bundles", b.default_bundles, 1, 1_024, ""),
            ("broker.load_report_interval_ms", b.load_report_interval_ms, 500, 60_000, ""),
            ("broker.load_shed_interval_ms", b.load_shed_interval_ms, 1_000, 3_600_000, ""),
            ("broker.load_shed_grace_ms", b.load_shed_grace_ms, 0, 86_400_000, ""),
            ("broker.load_shed_threshold_percent", b.load_shed_threshold_percent, 1, 100, ""),
            ("broker.load_msg_rate_capacity", b.load_msg_rate_capacity, 1, 100_000_000, ""),
            ("broker.bundle_split_topics_max", b.bundle_split_topics_max, 1, 1_000_000, ""),
            ("broker.bundle_split_msg_rate_max", b.bundle_split_msg_rate_max, 1, 100_000_000, ""),
            ("broker.namespace_bundles_max", b.namespace_bundles_max, 1, 65_536, ""),
        ];
        ranges(&bounds)
    }

    /// Largest frame accepted: a message plus room for its command and metadata.
    pub fn frame_bytes_max(&self) -> usize {
        self.message_bytes_max as usize + 10 * 1024
    }
}

/// `[standalone]` section: a metadata node, a bookie and a broker in one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StandaloneConfig {
    /// Directory holding all of the process's data (metadata, journal, ledgers); non-empty.
    /// Default `data/standalone`.
    pub data_dir: String,
}

impl Default for StandaloneConfig {
    fn default() -> Self {
        StandaloneConfig {
            data_dir: "data/standalone".to_string(),
        }
    }
}

impl StandaloneConfig {
    /// Checks the `[standalone]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.data_dir.trim().is_empty() {
            return Err(invalid(
                "standalone.data_dir",
                &self.data_dir,
                "must not be empty",
            ));
        }
        Ok(())
    }
}

/// `[client]` section: how a client reaches the metadata service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Metadata service addresses, each `HOST:PORT` (host names allowed);
    /// non-empty. Default `["127.0.0.1:7101"]`.
    pub endpoints: Vec<String>,
    /// Deadline of one request, milliseconds. Range 10..=600000, default 5000.
    pub request_timeout_ms: u64,
    /// Deadline of one connection attempt, milliseconds.
    /// Range 10..=60000, default 1000.
    pub connect_timeout_ms: u64,
    /// First delay between retries, milliseconds. Range 1..=10000, default 20.
    pub retry_backoff_initial_ms: u64,
    /// Largest delay between retries, milliseconds.
    /// Range `retry_backoff_initial_ms`..=60000, default 1000.
    pub retry_backoff_max_ms: u64,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            endpoints: vec!["127.0.0.1:7101".to_string()],
            request_timeout_ms: 5_000,
            connect_timeout_ms: 1_000,
            retry_backoff_initial_ms: 20,
            retry_backoff_max_ms: 1_000,
        }
    }
}

/// A Meridian process kind, deciding which sections it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// A node of the metadata service.
    Metadata,
    /// The `meta` admin client of the metadata service.
    Meta,
    /// Everything in one process.
    Standalone,
    /// A storage node.
    Bookie,
    /// A broker (Pulsar protocol).
    Broker,
}

impl Role {
    /// Every role, in declaration order.
    pub const ALL: [Role; 5] = [
        Role::Metadata,
        Role::Meta,
        Role::Standalone,
        Role::Bookie,
        Role::Broker,
    ];

    /// The name used on command lines and in messages.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Metadata => "metadata",
            Role::Meta => "meta",
            Role::Standalone => "standalone",
            Role::Bookie => "bookie",
            Role::Broker => "broker",
        }
    }

    /// The configuration sections this role reads.
    pub fn sections(&self) -> &'static [&'static str] {
        match self {
            Role::Metadata => &["log", "metadata", "tls"],
            Role::Standalone => &[
                "log",
                "standalone",
                "broker",
                "bookie",
                "metadata",
                "tls",
                "geo",
            ],
            Role::Broker => &["log", "broker", "client", "tls", "geo"],
            Role::Meta => &["log", "client", "tls"],
            Role::Bookie => &["log", "bookie", "client", "tls"],
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|role| role.as_str() == s)
            .ok_or_else(|| ConfigError::Invalid {
                key: "role".to_string(),
                value: format!("{s:?}"),
                reason: "expected one of metadata, meta, standalone, bookie".to_string(),
            })
    }
}

/// Where a configuration comes from, lowest precedence first: defaults,
/// `file`, `env`, `overrides`.
#[derive(Debug, Clone, Default)]
pub struct Sources<'a> {
    /// TOML file to read, if any.
    pub file: Option<&'a Path>,
    /// Environment variables as `(name, value)`; only `MERIDIAN_*` ones are
    /// looked at.
    pub env: Vec<(String, String)>,
    /// Command-line overrides as `(dotted.key, value)`, applied in order.
    pub overrides: Vec<(String, String)>,
}

impl Config {
    /// Layers defaults < `sources.file` < `sources.env` <
    /// `sources.overrides`, then validates the result.
    pub fn load(sources: &Sources<'_>) -> Result<Config, ConfigError> {
        let file = match sources.file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                Some((text, path.display().to_string()))
            }
            None => None,
        };
        let file = file.as_ref().map(|(t, o)| (t.as_str(), o.as_str()));
        Self::layer(file, &sources.env, &sources.overrides)
    }

    /// Defaults < the TOML `text` (errors name it `origin`), validated; no environment, no
    /// flags. What `load` does with a file's contents.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Self::layer(Some((text, origin)), &[], &[])
    }

    fn layer(
        file: Option<(&str, &str)>,
        env: &[(String, String)],
        overrides: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        // The file is parsed before anything is copied: most refusals are of its syntax.
        let parsed = match file {
            Some((text, origin)) => Some((parse_toml(text, origin)?, origin)),
            None => None,
        };
        let defaults = default_table();
        let mut merged = defaults.clone();
        if let Some((table, origin)) = &parsed {
            merge_file(&mut merged, defaults, table, origin)?;
        }
        apply_env(&mut merged, defaults, env)?;
        apply_overrides(&mut merged, defaults, overrides)?;
        let config: Config =
            merged
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: "configuration".to_string(),
                    message: e.message().replace('\n', " "),
                })?;
        config.validate()?;
        Ok(config)
    }

    /// [`Config::load`] with this process's environment.
    pub fn from_env_and_file(
        file: Option<&Path>,
        overrides: Vec<(String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut env = Vec::new();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str().filter(|n| n.starts_with(ENV_PREFIX)) else {
                continue;
            };
            let value = value.into_string().map_err(|_| ConfigError::Parse {
                origin: name.to_string(),
                message: "value is not valid UTF-8".to_string(),
            })?;
            env.push((name.to_string(), value));
        }
        Config::load(&Sources {
            file,
            env,
            overrides,
        })
    }

    /// Checks every section; returns the first problem found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.log.validate()?;
        self.metadata.validate()?;
        self.client.validate()?;
        self.bookie.validate()?;
        self.broker.validate()?;
        self.standalone.validate()?;
        self.tls.validate()?;
        self.geo.validate()?;
        if self.geo.enabled() {
            meridian_site_name(&self.broker.cluster_name)?;
            // An entry (a message or a batch, up to broker.message_bytes_max) must fit in a
            // frame of the link with its envelope.
            let least = self.broker.message_bytes_max + 65_536;
            ranges(&[(
                "geo.frame_bytes_max",
                self.geo.frame_bytes_max,
                least,
                268_435_456,
                " (at least broker.message_bytes_max + 65536)",
            )])?;
        }
        Ok(())
    }

    /// The sections `role` reads, as TOML text that [`Config::load`] accepts.
    pub fn to_toml_for(&self, role: Role) -> String {
        let mut out = format!("# Meridian configuration of role `{role}`.\n");
        for section in role.sections() {
            let body = match *section {
                "log" => toml::to_string(&self.log),
                "metadata" => toml::to_string(&self.metadata),
                "client" => toml::to_string(&self.client),
                "bookie" => toml::to_string(&self.bookie),
                "broker" => toml::to_string(&self.broker),
                "standalone" => toml::to_string(&self.standalone),
                "tls" => toml::to_string(&self.tls),
                "geo" => toml::to_string(&self.geo),
                _ => continue,
            };
            let body = body.expect("config sections serialize to TOML");
            out.push_str(&format!("\n[{section}]\n{body}"));
        }
        out
    }
}

impl LogConfig {
    /// Checks the `[log]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.level.trim().is_empty() {
            return Err(invalid(
                "log.level",
                &self.level,
                "expected a level such as info or a filter directive",
            ));
        }
        Ok(())
    }
}

impl MetadataConfig {
    /// The address others reach this node at: `advertise`, or `listen` when
    /// `advertise` is empty.
    pub fn advertise_addr(&self) -> &str {
        if self.advertise.is_empty() {
            &self.listen
        } else {
            &self.advertise
        }
    }

    /// `initial_members` as `(id, address)` pairs; see [`parse_members`].
    pub fn parsed_initial_members(&self) -> Result<Vec<(u64, String)>, ConfigError> {
        parse_members(&self.initial_members)
    }

    /// Checks the `[metadata]` section, including the relations between keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        socket_addr("metadata.listen", &self.listen)?;
        if !self.advertise.is_empty() {
            socket_addr("metadata.advertise", &self.advertise)?;
        }
        if self.data_dir.trim().is_empty() {
            return Err(invalid(
                "metadata.data_dir",
                &self.data_dir,
                "must not be empty",
            ));
        }
        self.parsed_initial_members()?;
        let three_beats = self.heartbeat_interval_ms.saturating_mul(3);
        let (election_low, election_why) = if three_beats > 50 {
            (
                three_beats,
                " (at least 3 * metadata.heartbeat_interval_ms)",
            )
        } else {
            (50, "")
        };
        let m = self;
        #[rustfmt::skip]
        let bounds = [
            ("metadata.node_id", m.node_id, 1, 1_000_000, ""),
            ("metadata.heartbeat_interval_ms", m.heartbeat_interval_ms, 10, 10_000, ""),
            ("metadata.election_timeout_min_ms", m.election_timeout_min_ms, election_low, 60_000, election_why),
            ("metadata.election_timeout_max_ms", m.election_timeout_max_ms, m.election_timeout_min_ms.saturating_add(1), 120_000,
                " (greater than metadata.election_timeout_min_ms)"),
            ("metadata.snapshot_every_entries", m.snapshot_every_entries, 100, 10_000_000, ""),
            ("metadata.log_entries_kept_after_snapshot", m.log_entries_kept_after_snapshot, 0, 10_000_000, ""),
            ("metadata.key_bytes_max", m.key_bytes_max, 1, 65_536, ""),
            ("metadata.value_bytes_max", m.value_bytes_max, 1, 16_777_216, ""),
            ("metadata.txn_ops_max", m.txn_ops_max, 1, 10_000, ""),
            ("metadata.session_ttl_ms_min", m.session_ttl_ms_min, 100, 3_600_000, ""),
            ("metadata.session_ttl_ms_max", m.session_ttl_ms_max, m.session_ttl_ms_min, 3_600_000,
                " (at least metadata.session_ttl_ms_min)"),
            ("metadata.watch_history_events", m.watch_history_events, 1_000, 100_000_000, ""),
            ("metadata.watch_buffer_batches", m.watch_buffer_batches, 16, 1_000_000, ""),
            ("metadata.list_limit_max", m.list_limit_max, 1, 1_000_000, ""),
        ];
        ranges(&bounds)
    }
}

impl ClientConfig {
    /// Checks the `[client]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(invalid(
                "client.endpoints",
                &self.endpoints,
                "needs at least one HOST:PORT",
            ));
        }
        for endpoint in &self.endpoints {
            host_port(endpoint).map_err(|reason| invalid("client.endpoints", endpoint, reason))?;
        }
        let c = self;
        #[rustfmt::skip]
        let bounds = [
            ("client.request_timeout_ms", c.request_timeout_ms, 10, 600_000, ""),
            ("client.connect_timeout_ms", c.connect_timeout_ms, 10, 60_000, ""),
            ("client.retry_backoff_initial_ms", c.retry_backoff_initial_ms, 1, 10_000, ""),
            ("client.retry_backoff_max_ms", c.retry_backoff_max_ms, c.retry_backoff_initial_ms, 60_000,
                " (at least client.retry_backoff_initial_ms)"),
        ];
        ranges(&bounds)
    }
}

/// Parses `ID=IP:PORT` member entries (as in `metadata.initial_members`)
/// into `(id, address)` pairs, in order. Ids must be in 1..=1000000 and
/// unique; addresses must be socket addresses.
pub fn parse_members(list: &[String]) -> Result<Vec<(u64, String)>, ConfigError> {
    const KEY: &str = "metadata.initial_members";
    let mut members: Vec<(u64, String)> = Vec::with_capacity(list.len());
    for entry in list {
        let Some((id, addr)) = entry.split_once('=') else {
            return Err(invalid(
                KEY,
                entry,
                "expected ID=HOST:PORT, e.g. 1=127.0.0.1:7101",
            ));
        };
        let id = match id.trim().parse::<u64>() {
            Ok(id @ 1..=1_000_000) => id,
            _ => {
                return Err(invalid(
                    KEY,
                    entry,
                    "the id must be an integer in 1..=1000000",
                ))
            }
        };
        let addr = addr.trim();
        if addr.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                KEY,
                entry,
                "the address must be IP:PORT, e.g. 127.0.0.1:7101",
            ));
        }
        if members.iter().any(|(seen, _)| *seen == id) {
            return Err(invalid(
                KEY,
                entry,
                &format!("id {id} appears more than once"),
            ));
        }
        members.push((id, addr.to_string()));
    }
    Ok(members)
}

/// A site that runs the link is named in certificates (`meridian://site/<name>`): 1 to 64
/// of `A-Z a-z 0-9 . _ -`.
fn meridian_site_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "broker.cluster_name",
            name,
            "a site on the geo link (geo.listen set) is named by 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-'",
        ))
    }
}

fn invalid(key: &str, value: &(impl fmt::Debug + ?Sized), reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: format!("{value:?}"),
        reason: reason.to_string(),
    }
}

/// `(key, value, low, high, why)`: `value` must be in `low..=high`; `why`
/// explains a bound derived from another key.
type Bound = (&'static str, u64, u64, u64, &'static str);

/// Checks each bound in order; returns the first violation.
fn ranges(bounds: &[Bound]) -> Result<(), ConfigError> {
    for &(key, value, low, high, why) in bounds {
        if !(low..=high).contains(&value) {
            return Err(ConfigError::OutOfRange {
                key: key.to_string(),
                value: value.to_string(),
                accepted: format!("{low}..={high}{why}"),
            });
        }
    }
    Ok(())
}

fn socket_addr(key: &str, value: &str) -> Result<(), ConfigError> {
    match value.parse::<SocketAddr>() {
        Ok(_) => Ok(()),
        Err(_) => Err(invalid(key, value, "expected IP:PORT, e.g. 127.0.0.1:7101")),
    }
}

/// Checks `HOST:PORT` where HOST may be a name; returns why not.
fn host_port(value: &str) -> Result<(), &'static str> {
    let Some((host, port)) = value.rsplit_once(':') else {
        return Err("expected HOST:PORT, e.g. localhost:7101");
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err("the host must be a non-empty name or IP without spaces");
    }
    match port.parse::<u16>() {
        Ok(1..) => Ok(()),
        _ => Err("the port must be an integer in 1..=65535"),
    }
}

/// Parses TOML text, reporting errors on one line with line and column.
fn parse_toml(text: &str, origin: &str) -> Result<Table, ConfigError> {
    text.parse::<Table>().map_err(|e| {
        let at = match e.span() {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                format!("line {line}, column {column}: ")
            }
            None => String::new(),
        };
        ConfigError::Parse {
            origin: origin.to_string(),
            message: format!("{at}{}", e.message().trim().replace('\n', " ")),
        }
    })
}

fn known_names(table: &Table) -> Vec<String> {
    table.keys().cloned().collect()
}

/// The defaults of `section`, or an error naming the known sections.
fn section<'t>(defaults: &'t Table, name: &str, origin: &str) -> Result<&'t Table, ConfigError> {
    match defaults.get(name) {
        Some(Value::Table(known)) => Ok(known),
        _ => Err(ConfigError::UnknownKey {
            path: name.to_string(),
            origin: origin.to_string(),
            known: known_names(defaults),
        }),
    }
}

/// The default value at `section.key`, or an error naming the known keys.
fn default_of<'t>(
    known: &'t Table,
    path: &str,
    key: &str,
    origin: &str,
) -> Result<&'t Value, ConfigError> {
    known.get(key).ok_or_else(|| ConfigError::UnknownKey {
        path: path.to_string(),
        origin: origin.to_string(),
        known: known_names(known),
    })
}

fn set(merged: &mut Table, section: &str, key: &str, value: Value) {
    if let Some(Value::Table(table)) = merged.get_mut(section) {
        table.insert(key.to_string(), value);
    }
}

/// The defaults as a table, serialized once per process (every load starts from them).
fn default_table() -> &'static Table {
    static DEFAULTS: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    DEFAULTS
        .get_or_init(|| Table::try_from(Config::default()).expect("defaults serialize to a table"))
}

/// Merges the file's table into `merged`, checking each key exists and has
/// the default's type.
fn merge_file(
    merged: &mut Table,
    defaults: &Table,
    file: &Table,
    origin: &str,
) -> Result<(), ConfigError> {
    for (name, value) in file {
        let known = section(defaults, name, origin)?;
        let Value::Table(entries) = value else {
            return Err(ConfigError::Parse {
                origin: origin.to_string(),
                message: format!(
                    "{name}: expected a table [{name}], got {} {value}",
                    kind(value)
                ),
            });
        };
        for (key, value) in entries {
            let path = format!("{name}.{key}");
            let default = default_of(known, &path, key, origin)?;
            check_type(&path, default, value).map_err(|message| ConfigError::Parse {
                origin: origin.to_string(),
                message,
            })?;
            set(merged, name, key, value.clone());
        }
    }
    Ok(())
}

/// Applies `MERIDIAN_<SECTION>_<KEY>` variables. Variables of a known section
/// must name a known key; other `MERIDIAN_*` variables are ignored.
fn apply_env(
    merged: &mut Table,
    defaults: &Table,
    env: &[(String, String)],
) -> Result<(), ConfigError> {
    for (name, raw) in env {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        for (section, known) in defaults {
            let Value::Table(known) = known else { continue };
            let Some(key) = rest
                .strip_prefix(section.to_uppercase().as_str())
                .and_then(|r| r.strip_prefix('_'))
            else {
                continue;
            };
            let key = key.to_lowercase();
            let path = format!("{section}.{key}");
            let default = default_of(known, &path, &key, &format!("environment variable {name}"))?;
            set(merged, section, &key, convert(name, default, raw)?);
        }
    }
    Ok(())
}

/// Applies `(dotted.key, value)` overrides from command-line flags.
fn apply_overrides(
    merged: &mut Table,
    defaults: &Table,
    overrides: &[(String, String)],
) -> Result<(), ConfigError> {
    for (path, raw) in overrides {
        let Some((name, key)) = path.split_once('.') else {
            let known = section(defaults, path, OVERRIDES_ORIGIN)?;
            return Err(ConfigError::UnknownKey {
                path: format!("{path}."),
                origin: OVERRIDES_ORIGIN.to_string(),
                known: known_names(known),
            });
        };
        let known = section(defaults, name, OVERRIDES_ORIGIN)?;
        let default = default_of(known, path, key, OVERRIDES_ORIGIN)?;
        let value = convert(&format!("command-line override {path}"), default, raw)?;
        set(merged, name, key, value);
    }
    Ok(())
}

/// Converts a string from the environment or a flag to the type of `default`.
/// Arrays are comma-separated; an empty string is an empty array.
fn convert(origin: &str, default: &Value, raw: &str) -> Result<Value, ConfigError> {
    let fail = |expected: &str| ConfigError::Parse {
        origin: origin.to_string(),
        message: format!("expected {expected}, got {raw:?}"),
    };
    match default {
        Value::Integer(_) => match raw.trim().parse::<i64>() {
            Ok(n) if n >= 0 => Ok(Value::Integer(n)),
            Ok(_) => Err(fail("a non-negative integer")),
            Err(_) => Err(fail("an integer")),
        },
        Value::Boolean(_) => match raw.trim().to_ascii_lowercase().as_str() {
            "true" | "1" => Ok(Value::Boolean(true)),
            "false" | "0" => Ok(Value::Boolean(false)),
            _ => Err(fail("true, false, 1 or 0")),
        },
        Value::Array(_) => Ok(Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(|item| Value::String(item.to_string()))
                .collect(),
        )),
        _ => Ok(Value::String(raw.to_string())),
    }
}

/// Checks a file value has the type of its default; returns the message.
fn check_type(path: &str, default: &Value, value: &Value) -> Result<(), String> {
    let matches = match (default, value) {
        (Value::Integer(_), Value::Integer(n)) if *n < 0 => {
            return Err(format!("{path}: expected a non-negative integer, got {n}"));
        }
        (Value::Array(_), Value::Array(items)) => items.iter().all(Value::is_str),
        (Value::Integer(_), Value::Integer(_))
        | (Value::Boolean(_), Value::Boolean(_))
        | (Value::String(_), Value::String(_)) => true,
        _ => false,
    };
    if matches {
        return Ok(());
    }
    let expected = match default {
        Value::Array(_) => "an array of strings",
        other => kind(other),
    };
    Err(format!(
        "{path}: expected {expected}, got {} {value}",
        kind(value)
    ))
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a date-time",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}
