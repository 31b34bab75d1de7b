//! `meridian`: the one binary of every Meridian role.
//!
//! - `meridian metadata`: run one metadata node.
//! - `meridian meta`: the metadata store's command-line client (etcdctl-like) and benchmark.
//! - `meridian bookie`: run a bookie (storage node).
//! - `meridian ledger list|show|read`: inspect ledgers.
//! - `meridian perf ledger`: write entries to running bookies and print figures.
//! - `meridian standalone`: metadata store, bookie and broker in one process.
//! - `meridian broker`: run a broker against a metadata store and bookies.
//! - `meridian autorecovery`: bookie autorecovery alone (auditor and replication worker).
//! - `meridian site up`: a whole site of separate processes on loopback.
//! - `meridian perf ledger|produce|consume|e2e|admin|geo|disk`: benchmarks against running servers
//!   and the disk.
//! - `meridian config print --role ROLE`: show the effective configuration.
//!
//! This crate only wires roles together; each role's logic lives in its own crate (the broker
//! in `meridian-broker`, bookies and autorecovery in `meridian-storage`, the metadata store in
//! `meridian-metadata`, the admin service in `meridian-tenancy`).

mod admin_perf;
mod bench;
mod bookie_http;
mod broker_role;
mod disk_probe;
mod geo_perf;
mod meta;
mod pulsar_perf;
mod site_up;
mod stage_metrics;
mod standalone;
mod storage_cmds;

/// mimalloc instead of glibc's allocator: the request path allocates per message (gRPC frames,
/// protobuf and bincode buffers), and glibc's malloc/free showed up as ~9% of a metadata
/// leader's CPU under `meridian meta bench`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use meridian_config::{Config, Role};
use meridian_metadata::node::MetadataNode;

#[derive(Parser)]
#[command(
    name = "meridian",
    version,
    about = "Meridian: geo-replicated streaming"
)]
struct Cli {
    /// TOML configuration file (then MERIDIAN_* variables, then flags, override it).
    #[arg(long, global = true, env = "MERIDIAN_CONFIG")]
    config: Option<PathBuf>,
    /// This process's certificate for TLS between roles, PEM (tls.cert_file).
    #[arg(long, global = true)]
    tls_cert_file: Option<String>,
    /// Its private key, PEM (tls.key_file).
    #[arg(long, global = true)]
    tls_key_file: Option<String>,
    /// The site's internal CA certificate, PEM (tls.ca_file).
    #[arg(long, global = true)]
    tls_ca_file: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Run one metadata node.
    Metadata(MetadataArgs),
    /// Client of the metadata store.
    Meta(meta::MetaArgs),
    /// Run a bookie (storage node).
    Bookie(storage_cmds::BookieArgs),
    /// Run bookie autorecovery alone (auditor election and a replication worker); brokers
    /// run it too unless broker.autorecovery_enabled = false.
    Autorecovery(storage_cmds::AutorecoveryArgs),
    /// Inspect ledgers.
    Ledger(storage_cmds::LedgerArgs),
    /// Benchmarks against running servers.
    Perf(storage_cmds::PerfArgs),
    /// Run a whole one-site Meridian in one process: metadata store, bookie, broker.
    Standalone(StandaloneArgs),
    /// Run a broker (Pulsar protocol) against a metadata store and bookies.
    Broker(BrokerArgs),
    /// A whole site of separate processes on loopback, for development and tests.
    #[command(subcommand)]
    Site(SiteCommand),
}

#[derive(Subcommand)]
enum SiteCommand {
    /// Start metadata nodes, bookies and brokers as separate processes (each this binary in
    /// its role); print their addresses; stop them all by PID on SIGINT or SIGTERM.
    Up(site_up::SiteUpArgs),
}

#[derive(clap::Args)]
struct StandaloneArgs {
    /// Directory of all data (standalone.data_dir).
    #[arg(long)]
    data_dir: Option<String>,
    /// Address of the Pulsar protocol (broker.listen).
    #[arg(long)]
    pulsar_listen: Option<String>,
    /// Address of /metrics and /health (broker.http_listen).
    #[arg(long)]
    http_listen: Option<String>,
    /// Address of the gRPC admin API (broker.admin_listen).
    #[arg(long)]
    admin_listen: Option<String>,
    /// Address clients are told to connect to (broker.advertise).
    #[arg(long)]
    advertise: Option<String>,
    /// Address of the Pulsar protocol over TLS (broker.tls_listen; served with
    /// broker.tls_cert_file).
    #[arg(long)]
    pulsar_tls_listen: Option<String>,
    #[command(flatten)]
    geo: GeoArgs,
}

/// The site's name and its geo link, shared by `standalone` and `broker`.
#[derive(clap::Args)]
struct GeoArgs {
    /// This site's name (broker.cluster_name); its geo certificate must name it.
    #[arg(long)]
    cluster: Option<String>,
    /// UDP address of the geo link, IP:PORT (geo.listen).
    #[arg(long)]
    geo_listen: Option<String>,
    /// The site's geo certificate, PEM (geo.cert_file; `meridian-admin geo create-site-cert`).
    #[arg(long)]
    geo_cert: Option<String>,
    /// Its private key, PEM (geo.key_file).
    #[arg(long)]
    geo_key: Option<String>,
    /// The federation's CA certificate, PEM (geo.ca_file).
    #[arg(long)]
    geo_ca: Option<String>,
}

impl GeoArgs {
    fn add_to(&self, o: &mut Vec<(String, String)>) {
        for (k, v) in [
            ("broker.cluster_name", &self.cluster),
            ("geo.listen", &self.geo_listen),
            ("geo.cert_file", &self.geo_cert),
            ("geo.key_file", &self.geo_key),
            ("geo.ca_file", &self.geo_ca),
        ] {
            if let Some(v) = v {
                o.push((k.to_string(), v.clone()));
            }
        }
    }
}

impl StandaloneArgs {
    fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        let mut add = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                o.push((k.to_string(), v.clone()));
            }
        };
        add("standalone.data_dir", &self.data_dir);
        add("broker.listen", &self.pulsar_listen);
        add("broker.http_listen", &self.http_listen);
        add("broker.admin_listen", &self.admin_listen);
        add("broker.advertise", &self.advertise);
        add("broker.tls_listen", &self.pulsar_tls_listen);
        self.geo.add_to(&mut o);
        o
    }
}

#[derive(clap::Args)]
struct BrokerArgs {
    /// Metadata store endpoints, `HOST:PORT,...` (client.endpoints).
    #[arg(long)]
    metadata: Option<String>,
    /// Address of the Pulsar protocol (broker.listen).
    #[arg(long)]
    listen: Option<String>,
    /// Address clients are told to connect to (broker.advertise).
    #[arg(long)]
    advertise: Option<String>,
    /// Address of /metrics and /health (broker.http_listen).
    #[arg(long)]
    http_listen: Option<String>,
    /// Address of the gRPC admin API (broker.admin_listen).
    #[arg(long)]
    admin_listen: Option<String>,
    #[command(flatten)]
    geo: GeoArgs,
}

impl BrokerArgs {
    fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        let mut add = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                o.push((k.to_string(), v.clone()));
            }
        };
        add("client.endpoints", &self.metadata);
        add("broker.listen", &self.listen);
        add("broker.advertise", &self.advertise);
        add("broker.http_listen", &self.http_listen);
        add("broker.admin_listen", &self.admin_listen);
        self.geo.add_to(&mut o);
        o
    }
}

async fn run_standalone(cfg: Config) -> anyhow::Result<()> {
    meridian_broker::http::init_metrics(cfg.broker.metrics_series_idle_s);
    let s = standalone::Standalone::start(&cfg).await?;
    let tls = s
        .pulsar_tls_addr
        .map(|a| format!(" and pulsar+ssl://{a}"))
        .unwrap_or_default();
    let geo = meridian_broker::geo::banner(s.geo.as_ref(), &cfg.broker.cluster_name);
    println!(
        "meridian standalone: Pulsar protocol on pulsar://{}{tls}, HTTP on http://{} (/metrics, /health), admin API on {}://{} (meridian-admin){geo}, data in {}",
        s.pulsar_addr,
        s.http_addr,
        if cfg.broker.admin_tls { "https" } else { "http" },
        s.admin_addr,
        s.data_dir.display()
    );
    shutdown_signal().await;
    tracing::info!("signal received; stopping");
    s.shutdown().await;
    Ok(())
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the effective configuration of a role (defaults < file < env < flags).
    Print {
        #[arg(long)]
        role: Role,
    },
}

#[derive(clap::Args)]
struct MetadataArgs {
    /// This node's id (metadata.node_id).
    #[arg(long)]
    node_id: Option<u64>,
    /// Address to serve gRPC on (metadata.listen).
    #[arg(long)]
    listen: Option<String>,
    /// Address other nodes and clients use to reach this node (metadata.advertise).
    #[arg(long)]
    advertise: Option<String>,
    /// Data directory (metadata.data_dir).
    #[arg(long)]
    data_dir: Option<String>,
    /// Members of a new cluster, `ID=HOST:PORT,...` (metadata.initial_members). Without it, a
    /// node with an empty data directory waits to be added.
    #[arg(long)]
    initial_members: Option<String>,
}

impl MetadataArgs {
    fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        let mut add = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                o.push((format!("metadata.{k}"), v));
            }
        };
        add("node_id", self.node_id.map(|v| v.to_string()));
        add("listen", self.listen.clone());
        add("advertise", self.advertise.clone());
        add("data_dir", self.data_dir.clone());
        add("initial_members", self.initial_members.clone());
        o
    }
}

/// Raises this process's soft limit of open files to its hard limit, as servers commonly do:
/// every connection, journal and entry-log file and RocksDB table holds a descriptor, and
/// Debian's soft default (1,024) is far below the hard one. Logs what it runs with.
fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let was = getrlimit(Resource::Nofile);
    // Linux refuses a hard limit of open files above `fs.nr_open`, so both are numbers.
    if let (Some(soft), Some(hard)) = (was.current, was.maximum) {
        if soft < hard {
            if let Err(e) = setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(hard),
                    maximum: Some(hard),
                },
            ) {
                tracing::warn!(soft, hard, error = %e, "could not raise the open files limit");
            }
        }
    }
    let now = getrlimit(Resource::Nofile);
    let shown = |n: Option<u64>| n.map_or("unlimited".to_string(), |n| n.to_string());
    tracing::info!(
        open_files_max = shown(now.current),
        before = shown(was.current),
        hard = shown(now.maximum),
        "open files limit"
    );
}

fn init_logging(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // openraft narrates every election at info; keep it to warnings unless RUST_LOG asks.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(format!("{},openraft=warn", cfg.log.level))
        });
    // Colour only on a terminal: a log file or a pipe gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if cfg.log.json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The process's `[tls]` material (see `meridian_broker::tls::site`).
pub(crate) fn tls_of(
    cfg: &Config,
    role: Option<meridian_metadata::tls::ProcessRole>,
) -> anyhow::Result<Option<std::sync::Arc<meridian_metadata::tls::SiteTls>>> {
    meridian_broker::tls::site(&cfg.tls, role)
}

pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn run_metadata(cfg: Config) -> anyhow::Result<()> {
    let m = &cfg.metadata;
    let tls = meridian_broker::tls::site(&cfg.tls, None)?;
    let listener = tokio::net::TcpListener::bind(&m.listen)
        .await
        .with_context(|| format!("metadata.listen {}", m.listen))?;
    let mut node = MetadataNode::start_with_tls(m, tls, listener)
        .await
        .map_err(|e| anyhow::anyhow!("metadata node {}: {e}", m.node_id))?;
    println!(
        "meridian metadata node {} listening on {} (data in {})",
        m.node_id, node.addr, m.data_dir
    );
    tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("signal received; stopping");
            node.shutdown().await;
        }
        r = node.wait() => {
            r.map_err(|e| anyhow::anyhow!("server stopped: {e}"))?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // No transparent huge pages for processes that run bookies or brokers: on first touch the
    // kernel zeroes a whole 2 MiB page at once, which took 3.5-4.8 ms on this machine's VM, in
    // whichever thread touched it (a tokio worker, the journal's completion thread) while the
    // heap grew (tail caches, the write cache). A new topic at 10,000 msg/s saw publish p99 of
    // 5-7 ms in its first second from that, 1.1-1.8 ms without; the maximum publish rate did
    // not drop (554,772 / 571,623 against 526,533 / 546,748 msg/s, alternating). A metadata
    // node's heap does not grow like that, and its puts were faster with them (8,552 / 8,157 /
    // 8,665 against 6,645 / 7,817 / 7,944 puts/s), so it keeps the system's default.
    // Best effort: a kernel without the flag keeps its default.
    if matches!(
        cli.command,
        Command::Standalone(_) | Command::Broker(_) | Command::Bookie(_) | Command::Perf(_)
    ) {
        let _ = rustix::thread::disable_transparent_huge_pages(true);
    }
    let mut overrides = match &cli.command {
        Command::Metadata(a) => a.overrides(),
        Command::Meta(a) => a.overrides(),
        Command::Bookie(a) => a.overrides(),
        Command::Autorecovery(a) => a.overrides(),
        Command::Ledger(a) => a.overrides(),
        Command::Perf(a) => a.overrides(),
        Command::Standalone(a) => a.overrides(),
        Command::Broker(a) => a.overrides(),
        Command::Config { .. } | Command::Site(_) => Vec::new(),
    };
    for (key, value) in [
        ("tls.cert_file", &cli.tls_cert_file),
        ("tls.key_file", &cli.tls_key_file),
        ("tls.ca_file", &cli.tls_ca_file),
    ] {
        if let Some(v) = value {
            overrides.push((key.to_string(), v.clone()));
        }
    }
    let cfg = match Config::from_env_and_file(cli.config.as_deref(), overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if !matches!(cli.command, Command::Config { .. }) {
        if let Err(e) = cfg.tls.check_readable() {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match cli.command {
        Command::Config {
            command: ConfigCommand::Print { role },
        } => {
            print!("{}", cfg.to_toml_for(role));
            Ok(ExitCode::SUCCESS)
        }
        Command::Metadata(_) => {
            init_logging(&cfg);
            raise_open_files_limit();
            runtime
                .block_on(run_metadata(cfg))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Meta(args) => {
            if std::env::var_os("RUST_LOG").is_some() {
                init_logging(&cfg);
            }
            runtime.block_on(meta::run(args, cfg))
        }
        Command::Bookie(_) => {
            init_logging(&cfg);
            raise_open_files_limit();
            runtime
                .block_on(storage_cmds::run_bookie(cfg))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Autorecovery(_) => {
            init_logging(&cfg);
            raise_open_files_limit();
            runtime
                .block_on(storage_cmds::run_autorecovery(cfg))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Ledger(args) => {
            if std::env::var_os("RUST_LOG").is_some() {
                init_logging(&cfg);
            }
            runtime.block_on(storage_cmds::run_ledger(args, cfg))
        }
        Command::Standalone(_) => {
            init_logging(&cfg);
            raise_open_files_limit();
            runtime
                .block_on(run_standalone(cfg))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Broker(_) => {
            init_logging(&cfg);
            raise_open_files_limit();
            runtime
                .block_on(broker_role::run_broker(cfg))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Perf(args) => {
            if std::env::var_os("RUST_LOG").is_some() {
                init_logging(&cfg);
            }
            runtime.block_on(storage_cmds::run_perf(args, cfg))
        }
        Command::Site(SiteCommand::Up(args)) => runtime
            .block_on(site_up::run(args))
            .map(|()| ExitCode::SUCCESS),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    };
    // Tokio's threads end here (joined); then the threads that used RocksDB, before `exit` runs
    // RocksDB's static destructors (see `join_db_threads`).
    drop(runtime);
    meridian_metadata::store::join_db_threads(std::time::Duration::from_secs(5));
    code
}
