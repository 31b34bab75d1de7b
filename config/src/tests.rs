//! Data-driven tests: each case layers a file, environment variables and
//! overrides, and `check` renders either the keys that differ from the
//! defaults or the error message, one case after another.

use std::fmt::Write as _;

use expect_test::{expect, Expect};

use super::*;

/// One load: an optional file body, environment variables and overrides.
#[derive(Default)]
struct Case {
    file: Option<&'static str>,
    env: Vec<(&'static str, &'static str)>,
    set: Vec<(&'static str, &'static str)>,
}

fn file(body: &'static str) -> Case {
    Case::default().file(body)
}

fn env(name: &'static str, value: &'static str) -> Case {
    Case::default().env(name, value)
}

fn set(path: &'static str, value: &'static str) -> Case {
    Case::default().set(path, value)
}

impl Case {
    fn file(mut self, body: &'static str) -> Case {
        self.file = Some(body);
        self
    }

    fn env(mut self, name: &'static str, value: &'static str) -> Case {
        self.env.push((name, value));
        self
    }

    fn set(mut self, path: &'static str, value: &'static str) -> Case {
        self.set.push((path, value));
        self
    }

    fn label(&self) -> String {
        let mut parts = Vec::new();
        if let Some(body) = self.file {
            parts.push(format!("file {:?}", body.trim()));
        }
        parts.extend(self.env.iter().map(|(k, v)| format!("env {k}={v}")));
        parts.extend(self.set.iter().map(|(k, v)| format!("set {k}={v}")));
        if parts.is_empty() {
            "(nothing)".to_string()
        } else {
            parts.join(" ")
        }
    }

    /// Loads the case; the file path in messages is replaced by `$FILE`.
    fn run(&self) -> Result<Config, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meridian.toml");
        if let Some(body) = self.file {
            std::fs::write(&path, body).unwrap();
        }
        let owned = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let sources = Sources {
            file: self.file.map(|_| path.as_path()),
            env: owned(&self.env),
            overrides: owned(&self.set),
        };
        Config::load(&sources)
            .map_err(|e| e.to_string().replace(&path.display().to_string(), "$FILE"))
    }
}

/// Dotted keys whose value differs from the default, as `key = value`.
fn changes(config: &Config) -> Vec<String> {
    let flatten = |config: &Config| -> Vec<(String, Value)> {
        let mut out = Vec::new();
        for (section, table) in Table::try_from(config).unwrap() {
            if let Value::Table(table) = table {
                out.extend(
                    table
                        .into_iter()
                        .map(|(k, v)| (format!("{section}.{k}"), v)),
                );
            }
        }
        out
    };
    let defaults = flatten(&Config::default());
    flatten(config)
        .into_iter()
        .zip(defaults)
        .filter(|(now, default)| now != default)
        .map(|((key, value), _)| format!("{key} = {value}"))
        .collect()
}

fn check(cases: impl IntoIterator<Item = Case>, expect: Expect) {
    let mut out = String::new();
    for case in cases {
        let result = match case.run() {
            Ok(config) if changes(&config).is_empty() => "ok: defaults".to_string(),
            Ok(config) => format!("ok: {}", changes(&config).join(", ")),
            Err(message) => format!("error: {message}"),
        };
        writeln!(out, "{}\n  {result}", case.label()).unwrap();
    }
    expect.assert_eq(&out);
}

#[test]
fn defaults_validate_and_need_no_source() {
    Config::default().validate().unwrap();
    check(
        [
            Case::default(),
            file(""),
            env("MERIDIAN_ROOT", "/x").env("MERIDIAN_TOKEN", "t"),
        ],
        expect![[r#"
            (nothing)
              ok: defaults
            file ""
              ok: defaults
            env MERIDIAN_ROOT=/x env MERIDIAN_TOKEN=t
              ok: defaults
        "#]],
    );
}

#[test]
fn layers_override_in_order() {
    check(
        [
            file("[metadata]\nnode_id = 2\nfsync = false\n[log]\nlevel = \"debug\""),
            file("[metadata]\nnode_id = 2").env("MERIDIAN_METADATA_NODE_ID", "3"),
            file("[metadata]\nnode_id = 2")
                .env("MERIDIAN_METADATA_NODE_ID", "3")
                .set("metadata.node_id", "4"),
            env("MERIDIAN_LOG_JSON", "1").set("log.json", "false"),
            set("metadata.node_id", "5").set("metadata.node_id", "6"),
            env("MERIDIAN_METADATA_ADVERTISE", "10.0.0.1:7101")
                .env("MERIDIAN_ADMIN_URL", "http://x"),
        ],
        expect![[r#"
            file "[metadata]\nnode_id = 2\nfsync = false\n[log]\nlevel = \"debug\""
              ok: log.level = "debug", metadata.fsync = false, metadata.node_id = 2
            file "[metadata]\nnode_id = 2" env MERIDIAN_METADATA_NODE_ID=3
              ok: metadata.node_id = 3
            file "[metadata]\nnode_id = 2" env MERIDIAN_METADATA_NODE_ID=3 set metadata.node_id=4
              ok: metadata.node_id = 4
            env MERIDIAN_LOG_JSON=1 set log.json=false
              ok: defaults
            set metadata.node_id=5 set metadata.node_id=6
              ok: metadata.node_id = 6
            env MERIDIAN_METADATA_ADVERTISE=10.0.0.1:7101 env MERIDIAN_ADMIN_URL=http://x
              ok: metadata.advertise = "10.0.0.1:7101"
        "#]],
    );
}

#[test]
fn unknown_keys_are_rejected_with_their_path() {
    check(
        [
            file("[metadata]\nnod_id = 3"),
            file("[metdata]\nnode_id = 3"),
            file("node_id = 3"),
            env("MERIDIAN_METADATA_NOD_ID", "3"),
            env("MERIDIAN_CLIENT_ENDPOINT", "a:1"),
            set("metadata.nod_id", "3"),
            set("metdata.node_id", "3"),
            set("log", "debug"),
        ],
        expect![[r#"
            file "[metadata]\nnod_id = 3"
              error: unknown key metadata.nod_id in $FILE; known keys in [metadata]: advertise, data_dir, election_timeout_max_ms, election_timeout_min_ms, fsync, heartbeat_interval_ms, initial_members, key_bytes_max, list_limit_max, listen, log_entries_kept_after_snapshot, node_id, session_ttl_ms_max, session_ttl_ms_min, snapshot_every_entries, txn_ops_max, value_bytes_max, watch_buffer_batches, watch_history_events
            file "[metdata]\nnode_id = 3"
              error: unknown top-level key metdata in $FILE; known sections: bookie, broker, client, geo, log, metadata, standalone, tls
            file "node_id = 3"
              error: unknown top-level key node_id in $FILE; known sections: bookie, broker, client, geo, log, metadata, standalone, tls
            env MERIDIAN_METADATA_NOD_ID=3
              error: unknown key metadata.nod_id in environment variable MERIDIAN_METADATA_NOD_ID; known keys in [metadata]: advertise, data_dir, election_timeout_max_ms, election_timeout_min_ms, fsync, heartbeat_interval_ms, initial_members, key_bytes_max, list_limit_max, listen, log_entries_kept_after_snapshot, node_id, session_ttl_ms_max, session_ttl_ms_min, snapshot_every_entries, txn_ops_max, value_bytes_max, watch_buffer_batches, watch_history_events
            env MERIDIAN_CLIENT_ENDPOINT=a:1
              error: unknown key client.endpoint in environment variable MERIDIAN_CLIENT_ENDPOINT; known keys in [client]: connect_timeout_ms, endpoints, request_timeout_ms, retry_backoff_initial_ms, retry_backoff_max_ms
            set metadata.nod_id=3
              error: unknown key metadata.nod_id in command-line flags; known keys in [metadata]: advertise, data_dir, election_timeout_max_ms, election_timeout_min_ms, fsync, heartbeat_interval_ms, initial_members, key_bytes_max, list_limit_max, listen, log_entries_kept_after_snapshot, node_id, session_ttl_ms_max, session_ttl_ms_min, snapshot_every_entries, txn_ops_max, value_bytes_max, watch_buffer_batches, watch_history_events
            set metdata.node_id=3
              error: unknown top-level key metdata in command-line flags; known sections: bookie, broker, client, geo, log, metadata, standalone, tls
            set log=debug
              error: unknown key log. in command-line flags; known keys in [log]: json, level
        "#]],
    );
}

#[test]
fn out_of_range_values_name_the_accepted_range() {
    check(
        [
            set("metadata.node_id", "0"),
            set("metadata.heartbeat_interval_ms", "5"),
            set("metadata.snapshot_every_entries", "99"),
            set("metadata.log_entries_kept_after_snapshot", "10000001"),
            set("metadata.key_bytes_max", "0"),
            set("metadata.value_bytes_max", "16777217"),
            set("metadata.txn_ops_max", "10001"),
            set("metadata.session_ttl_ms_min", "99"),
            set("metadata.session_ttl_ms_max", "999"),
            set("metadata.watch_history_events", "999"),
            set("metadata.list_limit_max", "0"),
            set("client.request_timeout_ms", "600001"),
            set("client.connect_timeout_ms", "9"),
            set("client.retry_backoff_initial_ms", "0"),
            set("client.retry_backoff_max_ms", "19"),
        ],
        expect![[r#"
            set metadata.node_id=0
              error: metadata.node_id = 0 is out of range; accepted 1..=1000000
            set metadata.heartbeat_interval_ms=5
              error: metadata.heartbeat_interval_ms = 5 is out of range; accepted 10..=10000
            set metadata.snapshot_every_entries=99
              error: metadata.snapshot_every_entries = 99 is out of range; accepted 100..=10000000
            set metadata.log_entries_kept_after_snapshot=10000001
              error: metadata.log_entries_kept_after_snapshot = 10000001 is out of range; accepted 0..=10000000
            set metadata.key_bytes_max=0
              error: metadata.key_bytes_max = 0 is out of range; accepted 1..=65536
            set metadata.value_bytes_max=16777217
              error: metadata.value_bytes_max = 16777217 is out of range; accepted 1..=16777216
            set metadata.txn_ops_max=10001
              error: metadata.txn_ops_max = 10001 is out of range; accepted 1..=10000
            set metadata.session_ttl_ms_min=99
              error: metadata.session_ttl_ms_min = 99 is out of range; accepted 100..=3600000
            set metadata.session_ttl_ms_max=999
              error: metadata.session_ttl_ms_max = 999 is out of range; accepted 1000..=3600000 (at least metadata.session_ttl_ms_min)
            set metadata.watch_history_events=999
              error: metadata.watch_history_events = 999 is out of range; accepted 1000..=100000000
            set metadata.list_limit_max=0
              error: metadata.list_limit_max = 0 is out of range; accepted 1..=1000000
            set client.request_timeout_ms=600001
              error: client.request_timeout_ms = 600001 is out of range; accepted 10..=600000
            set client.connect_timeout_ms=9
              error: client.connect_timeout_ms = 9 is out of range; accepted 10..=60000
            set client.retry_backoff_initial_ms=0
              error: client.retry_backoff_initial_ms = 0 is out of range; accepted 1..=10000
            set client.retry_backoff_max_ms=19
              error: client.retry_backoff_max_ms = 19 is out of range; accepted 20..=60000 (at least client.retry_backoff_initial_ms)
        "#]],
    );
}

#[test]
fn site_cluster_compaction_and_rack_settings_are_checked() {
    check(
        [
            set("broker.session_ttl_ms", "999"),
            set("broker.default_bundles", "0"),
            set("broker.load_report_interval_ms", "60001"),
            set("broker.load_shed_interval_ms", "999"),
            set("broker.compaction_threshold_bytes", "1125899906842625"),
            set("broker.compaction_keys_max", "0"),
            set("bookie.rack", "rack-1"),
            set("bookie.rack", "/a//b"),
            set("bookie.http_listen", "localhost"),
            set("bookie.flusher_io_idle", "sometimes"),
        ],
        expect![[r#"
            set broker.session_ttl_ms=999
              error: broker.session_ttl_ms = 999 is out of range; accepted 1000..=300000
            set broker.default_bundles=0
              error: broker.default_bundles = 0 is out of range; accepted 1..=1024
            set broker.load_report_interval_ms=60001
              error: broker.load_report_interval_ms = 60001 is out of range; accepted 500..=60000
            set broker.load_shed_interval_ms=999
              error: broker.load_shed_interval_ms = 999 is out of range; accepted 1000..=3600000
            set broker.compaction_threshold_bytes=1125899906842625
              error: broker.compaction_threshold_bytes = 1125899906842625 is out of range; accepted 0..=1125899906842624
            set broker.compaction_keys_max=0
              error: broker.compaction_keys_max = 0 is out of range; accepted 1..=100000000
            set bookie.rack=rack-1
              error: bookie.rack = "rack-1" is invalid: must be /NAME or /NAME/NAME..., without spaces
            set bookie.rack=/a//b
              error: bookie.rack = "/a//b" is invalid: must be /NAME or /NAME/NAME..., without spaces
            set bookie.http_listen=localhost
              error: bookie.http_listen = "localhost" is invalid: expected IP:PORT, e.g. 127.0.0.1:7101
            set bookie.flusher_io_idle=sometimes
              error: command-line override bookie.flusher_io_idle: expected true, false, 1 or 0, got "sometimes"
        "#]],
    );
}

#[test]
fn election_timeouts_follow_the_heartbeat() {
    check(
        [
            set("metadata.election_timeout_min_ms", "299"),
            set("metadata.election_timeout_min_ms", "300"),
            set("metadata.heartbeat_interval_ms", "10")
                .set("metadata.election_timeout_min_ms", "49"),
            set("metadata.heartbeat_interval_ms", "10")
                .set("metadata.election_timeout_min_ms", "50"),
            set("metadata.election_timeout_max_ms", "400"),
            set("metadata.election_timeout_max_ms", "120001"),
            set("metadata.election_timeout_min_ms", "60001"),
            set("metadata.heartbeat_interval_ms", "1000"),
        ],
        expect![[r#"
            set metadata.election_timeout_min_ms=299
              error: metadata.election_timeout_min_ms = 299 is out of range; accepted 300..=60000 (at least 3 * metadata.heartbeat_interval_ms)
            set metadata.election_timeout_min_ms=300
              ok: metadata.election_timeout_min_ms = 300
            set metadata.heartbeat_interval_ms=10 set metadata.election_timeout_min_ms=49
              error: metadata.election_timeout_min_ms = 49 is out of range; accepted 50..=60000
            set metadata.heartbeat_interval_ms=10 set metadata.election_timeout_min_ms=50
              ok: metadata.election_timeout_min_ms = 50, metadata.heartbeat_interval_ms = 10
            set metadata.election_timeout_max_ms=400
              error: metadata.election_timeout_max_ms = 400 is out of range; accepted 401..=120000 (greater than metadata.election_timeout_min_ms)
            set metadata.election_timeout_max_ms=120001
              error: metadata.election_timeout_max_ms = 120001 is out of range; accepted 401..=120000 (greater than metadata.election_timeout_min_ms)
            set metadata.election_timeout_min_ms=60001
              error: metadata.election_timeout_min_ms = 60001 is out of range; accepted 300..=60000 (at least 3 * metadata.heartbeat_interval_ms)
            set metadata.heartbeat_interval_ms=1000
              error: metadata.election_timeout_min_ms = 400 is out of range; accepted 3000..=60000 (at least 3 * metadata.heartbeat_interval_ms)
        "#]],
    );
}

#[test]
fn type_mismatches_name_the_key() {
    check(
        [
            file("[metadata]\nnode_id = \"three\""),
            file("[metadata]\nnode_id = -1"),
            file("[metadata]\nfsync = 1"),
            file("[metadata]\ninitial_members = [1, 2]"),
            file("[client]\nendpoints = \"a:1\""),
            file("metadata = 3"),
            file("[metadata\nnode_id = 3"),
            env("MERIDIAN_METADATA_NODE_ID", "x"),
            env("MERIDIAN_METADATA_NODE_ID", "-1"),
            env("MERIDIAN_METADATA_FSYNC", "maybe"),
            set("client.request_timeout_ms", "5s"),
        ],
        expect![[r#"
            file "[metadata]\nnode_id = \"three\""
              error: $FILE: metadata.node_id: expected an integer, got a string "three"
            file "[metadata]\nnode_id = -1"
              error: $FILE: metadata.node_id: expected a non-negative integer, got -1
            file "[metadata]\nfsync = 1"
              error: $FILE: metadata.fsync: expected a boolean, got an integer 1
            file "[metadata]\ninitial_members = [1, 2]"
              error: $FILE: metadata.initial_members: expected an array of strings, got an array [1, 2]
            file "[client]\nendpoints = \"a:1\""
              error: $FILE: client.endpoints: expected an array of strings, got a string "a:1"
            file "metadata = 3"
              error: $FILE: metadata: expected a table [metadata], got an integer 3
            file "[metadata\nnode_id = 3"
              error: $FILE: line 1, column 10: unclosed table, expected `]`
            env MERIDIAN_METADATA_NODE_ID=x
              error: MERIDIAN_METADATA_NODE_ID: expected an integer, got "x"
            env MERIDIAN_METADATA_NODE_ID=-1
              error: MERIDIAN_METADATA_NODE_ID: expected a non-negative integer, got "-1"
            env MERIDIAN_METADATA_FSYNC=maybe
              error: MERIDIAN_METADATA_FSYNC: expected true, false, 1 or 0, got "maybe"
            set client.request_timeout_ms=5s
              error: command-line override client.request_timeout_ms: expected an integer, got "5s"
        "#]],
    );
}

#[test]
fn lists_and_addresses() {
    check(
        [
            env(
                "MERIDIAN_CLIENT_ENDPOINTS",
                "meta-1:7101, meta-2:7101,[::1]:7101",
            ),
            env("MERIDIAN_CLIENT_ENDPOINTS", ""),
            env("MERIDIAN_CLIENT_ENDPOINTS", "meta-1"),
            env("MERIDIAN_CLIENT_ENDPOINTS", "meta-1:http"),
            env(
                "MERIDIAN_METADATA_INITIAL_MEMBERS",
                "1=127.0.0.1:7101,2=127.0.0.1:7102",
            ),
            env(
                "MERIDIAN_METADATA_INITIAL_MEMBERS",
                "1=127.0.0.1:7101,1=127.0.0.1:7102",
            ),
            env("MERIDIAN_METADATA_INITIAL_MEMBERS", "1=localhost:7101"),
            env("MERIDIAN_METADATA_INITIAL_MEMBERS", "127.0.0.1:7101"),
            env("MERIDIAN_METADATA_INITIAL_MEMBERS", "0=127.0.0.1:7101"),
            set("metadata.listen", "localhost:7101"),
            set("metadata.advertise", "10.0.0.1"),
            set("metadata.data_dir", ""),
            set("log.level", " "),
        ],
        expect![[r#"
            env MERIDIAN_CLIENT_ENDPOINTS=meta-1:7101, meta-2:7101,[::1]:7101
              ok: client.endpoints = ["meta-1:7101", "meta-2:7101", "[::1]:7101"]
            env MERIDIAN_CLIENT_ENDPOINTS=
              error: client.endpoints = [] is invalid: needs at least one HOST:PORT
            env MERIDIAN_CLIENT_ENDPOINTS=meta-1
              error: client.endpoints = "meta-1" is invalid: expected HOST:PORT, e.g. localhost:7101
            env MERIDIAN_CLIENT_ENDPOINTS=meta-1:http
              error: client.endpoints = "meta-1:http" is invalid: the port must be an integer in 1..=65535
            env MERIDIAN_METADATA_INITIAL_MEMBERS=1=127.0.0.1:7101,2=127.0.0.1:7102
              ok: metadata.initial_members = ["1=127.0.0.1:7101", "2=127.0.0.1:7102"]
            env MERIDIAN_METADATA_INITIAL_MEMBERS=1=127.0.0.1:7101,1=127.0.0.1:7102
              error: metadata.initial_members = "1=127.0.0.1:7102" is invalid: id 1 appears more than once
            env MERIDIAN_METADATA_INITIAL_MEMBERS=1=localhost:7101
              error: metadata.initial_members = "1=localhost:7101" is invalid: the address must be IP:PORT, e.g. 127.0.0.1:7101
            env MERIDIAN_METADATA_INITIAL_MEMBERS=127.0.0.1:7101
              error: metadata.initial_members = "127.0.0.1:7101" is invalid: expected ID=HOST:PORT, e.g. 1=127.0.0.1:7101
            env MERIDIAN_METADATA_INITIAL_MEMBERS=0=127.0.0.1:7101
              error: metadata.initial_members = "0=127.0.0.1:7101" is invalid: the id must be an integer in 1..=1000000
            set metadata.listen=localhost:7101
              error: metadata.listen = "localhost:7101" is invalid: expected IP:PORT, e.g. 127.0.0.1:7101
            set metadata.advertise=10.0.0.1
              error: metadata.advertise = "10.0.0.1" is invalid: expected IP:PORT, e.g. 127.0.0.1:7101
            set metadata.data_dir=
              error: metadata.data_dir = "" is invalid: must not be empty
            set log.level= 
              error: log.level = " " is invalid: expected a level such as info or a filter directive
        "#]],
    );
}

#[test]
fn member_helpers() {
    let members = vec![
        "2=127.0.0.1:7102".to_string(),
        "1= 127.0.0.1:7101".to_string(),
    ];
    assert_eq!(
        parse_members(&members).unwrap(),
        vec![
            (2, "127.0.0.1:7102".to_string()),
            (1, "127.0.0.1:7101".to_string())
        ]
    );
    let mut metadata = MetadataConfig {
        initial_members: members,
        ..MetadataConfig::default()
    };
    assert_eq!(metadata.parsed_initial_members().unwrap().len(), 2);
    assert_eq!(metadata.advertise_addr(), "127.0.0.1:7101");
    metadata.advertise = "10.0.0.1:7101".to_string();
    assert_eq!(metadata.advertise_addr(), "10.0.0.1:7101");
}

#[test]
fn missing_file_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.toml");
    let sources = Sources {
        file: Some(&path),
        ..Sources::default()
    };
    let message = Config::load(&sources).unwrap_err().to_string();
    expect![[r#"cannot read config file $FILE: No such file or directory (os error 2)"#]]
        .assert_eq(&message.replace(&path.display().to_string(), "$FILE"));
}

#[test]
fn roles_parse_and_name_their_sections() {
    for role in Role::ALL {
        assert_eq!(role.to_string().parse::<Role>().unwrap(), role);
    }
    expect![[r#"role = "brokr" is invalid: expected one of metadata, meta, standalone, bookie"#]]
        .assert_eq(&"brokr".parse::<Role>().unwrap_err().to_string());
    assert_eq!(Role::Meta.sections(), ["log", "client", "tls"]);
}

#[test]
fn toml_for_a_role_round_trips() {
    let config = Config::default();
    expect![[r##"
        # Meridian configuration of role `metadata`.

        [log]
        level = "info"
        json = false

        [metadata]
        node_id = 1
        listen = "127.0.0.1:7101"
        advertise = ""
        data_dir = "data/metadata"
        initial_members = []
        heartbeat_interval_ms = 100
        election_timeout_min_ms = 400
        election_timeout_max_ms = 800
        snapshot_every_entries = 10000
        log_entries_kept_after_snapshot = 1000
        key_bytes_max = 1024
        value_bytes_max = 1048576
        txn_ops_max = 128
        session_ttl_ms_min = 1000
        session_ttl_ms_max = 300000
        watch_history_events = 100000
        watch_buffer_batches = 4096
        list_limit_max = 10000
        fsync = true

        [tls]
        cert_file = ""
        key_file = ""
        ca_file = ""
    "##]]
    .assert_eq(&config.to_toml_for(Role::Metadata));

    let mut changed = config.clone();
    changed.metadata.node_id = 7;
    changed.metadata.initial_members = vec!["7=10.0.0.7:7101".to_string()];
    changed.client.endpoints = vec!["meta:7101".to_string()];
    changed.bookie.journal_dir = "/disk1/journal".to_string();
    for role in Role::ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("role.toml");
        std::fs::write(&path, changed.to_toml_for(role)).unwrap();
        let loaded = Config::load(&Sources {
            file: Some(&path),
            ..Sources::default()
        })
        .unwrap();
        // A role's file carries its sections; the others keep their defaults.
        fn pick<T>(role: Role, section: &str, changed: T, default: T) -> T {
            if role.sections().contains(&section) {
                changed
            } else {
                default
            }
        }
        assert_eq!(
            loaded.metadata,
            pick(
                role,
                "metadata",
                changed.metadata.clone(),
                config.metadata.clone()
            ),
            "{role}"
        );
        assert_eq!(
            loaded.client,
            pick(
                role,
                "client",
                changed.client.clone(),
                config.client.clone()
            ),
            "{role}"
        );
        assert_eq!(
            loaded.bookie,
            pick(
                role,
                "bookie",
                changed.bookie.clone(),
                config.bookie.clone()
            ),
            "{role}"
        );
    }
}

/// Mutated configuration files (bytes flipped, inserted, removed, lines swapped) are either
/// loaded or refused with an error; none makes the loader panic. Seeded, so a failure prints the
/// seed that reproduces it (`MERIDIAN_CONFIG_SEED=...`).
#[test]
fn mutated_files_never_panic() {
    let seed: u64 = std::env::var("MERIDIAN_CONFIG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_c0f1);
    let mut state = seed;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let base = Config::default().to_toml_for(Role::Metadata)
        + "\n[client]\nendpoints = [\"a:1\", \"b:2\"]\nrequest_timeout_ms = 100\n";
    let alphabet = b"[]=\"'.,#\n -_0123456789abcdefmnrstxyz{}\\\t\xff";
    let (mut loaded, mut refused) = (0, 0);
    for case in 0..2_000 {
        let mut bytes = base.clone().into_bytes();
        for _ in 0..(1 + next() % 6) {
            let at = (next() as usize) % bytes.len().max(1);
            match next() % 4 {
                0 => bytes[at] = alphabet[(next() as usize) % alphabet.len()],
                1 => bytes.insert(at, alphabet[(next() as usize) % alphabet.len()]),
                2 if bytes.len() > 1 => {
                    bytes.remove(at);
                }
                _ => {
                    let text = String::from_utf8_lossy(&bytes).into_owned();
                    let mut lines: Vec<&str> = text.lines().collect();
                    let (a, b) = (
                        (next() as usize) % lines.len(),
                        (next() as usize) % lines.len(),
                    );
                    lines.swap(a, b);
                    bytes = lines.join("\n").into_bytes();
                }
            }
        }
        let text = String::from_utf8_lossy(&bytes);
        let result = std::panic::catch_unwind(|| Config::from_toml_str(&text, "mutated.toml"));
        match result {
            Ok(Ok(_)) => loaded += 1,
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
            Err(_) => panic!(
                "seed {seed} case {case}: the loader panicked on {:?}",
                String::from_utf8_lossy(&bytes)
            ),
        }
    }
    assert!(
        loaded > 0 && refused > 0,
        "mutations too weak or too strong: {loaded} loaded, {refused} refused"
    );
}

#[test]
fn tls_and_authentication_settings_that_do_not_go_together_are_refused() {
    check(
        [
            set("broker.admin_tls", "true"),
            set("broker.tls_cert_file", "/x/server.pem"),
            set("broker.tls_trust_certs_file", "/x/ca.pem"),
            set("broker.authentication_enabled", "true"),
            set("broker.tls_listen", "nowhere"),
        ],
        expect![[r#"
            set broker.admin_tls=true
              error: broker.admin_tls = true is invalid: needs broker.tls_cert_file and broker.tls_key_file
            set broker.tls_cert_file=/x/server.pem
              error: broker.tls_key_file = "" is invalid: broker.tls_cert_file and broker.tls_key_file go together
            set broker.tls_trust_certs_file=/x/ca.pem
              error: broker.tls_trust_certs_file = "/x/ca.pem" is invalid: needs broker.tls_cert_file (client certificates come over TLS)
            set broker.authentication_enabled=true
              error: broker.authentication_enabled = true is invalid: needs a token key (broker.token_secret_key_file or broker.token_public_key_file) or client certificates (broker.tls_trust_certs_file)
            set broker.tls_listen=nowhere
              error: broker.tls_listen = "nowhere" is invalid: expected IP:PORT, e.g. 127.0.0.1:7101
        "#]],
    );
}

#[test]
fn tls_files_go_together_and_take_env_and_flags() {
    check(
        [
            file("[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\"\nca_file = \"ca.pem\""),
            env("MERIDIAN_TLS_CERT_FILE", "b1.pem")
                .env("MERIDIAN_TLS_KEY_FILE", "b1.key")
                .env("MERIDIAN_TLS_CA_FILE", "ca.pem"),
            file("[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\"\nca_file = \"ca.pem\"")
                .set("tls.cert_file", "")
                .set("tls.key_file", "")
                .set("tls.ca_file", ""),
            file("[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\""),
            env("MERIDIAN_TLS_KEY_FILE", "b1.key"),
            set("tls.ca_file", "ca.pem"),
            set("tls.cert", "b1.pem"),
        ],
        expect![[r#"
            file "[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\"\nca_file = \"ca.pem\""
              ok: tls.ca_file = "ca.pem", tls.cert_file = "b1.pem", tls.key_file = "b1.key"
            env MERIDIAN_TLS_CERT_FILE=b1.pem env MERIDIAN_TLS_KEY_FILE=b1.key env MERIDIAN_TLS_CA_FILE=ca.pem
              ok: tls.ca_file = "ca.pem", tls.cert_file = "b1.pem", tls.key_file = "b1.key"
            file "[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\"\nca_file = \"ca.pem\"" set tls.cert_file= set tls.key_file= set tls.ca_file=
              ok: defaults
            file "[tls]\ncert_file = \"b1.pem\"\nkey_file = \"b1.key\""
              error: tls.ca_file = "" is invalid: tls.cert_file, tls.key_file and tls.ca_file go together (all three, or none for plaintext)
            env MERIDIAN_TLS_KEY_FILE=b1.key
              error: tls.cert_file = "" is invalid: tls.cert_file, tls.key_file and tls.ca_file go together (all three, or none for plaintext)
            set tls.ca_file=ca.pem
              error: tls.cert_file = "" is invalid: tls.cert_file, tls.key_file and tls.ca_file go together (all three, or none for plaintext)
            set tls.cert=b1.pem
              error: unknown key tls.cert in command-line flags; known keys in [tls]: ca_file, cert_file, key_file
        "#]],
    );
}

#[test]
fn unreadable_tls_files_are_named_by_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let present = dir.path().join("present.pem");
    std::fs::write(&present, "x").unwrap();
    let present = present.display().to_string();
    let tls = TlsConfig {
        cert_file: present.clone(),
        key_file: dir.path().join("missing.key").display().to_string(),
        ca_file: present.clone(),
    };
    let message = tls
        .check_readable()
        .unwrap_err()
        .to_string()
        .replace(&dir.path().display().to_string(), "$DIR");
    expect![[r#"tls.key_file = "$DIR/missing.key" is invalid: cannot be read: No such file or directory (os error 2)"#]]
        .assert_eq(&message);
    let readable = TlsConfig {
        key_file: present.clone(),
        ..tls
    };
    readable.check_readable().unwrap();
    TlsConfig::default().check_readable().unwrap();
}

#[test]
fn geo_settings_are_checked() {
    check(
        [
            set("geo.listen", "127.0.0.1:7300"),
            set("geo.listen", "127.0.0.1:7300")
                .set("geo.cert_file", "e.crt")
                .set("geo.key_file", "e.key")
                .set("geo.ca_file", "ca.crt")
                .set("broker.cluster_name", "east"),
            set("geo.listen", "127.0.0.1:7300")
                .set("geo.cert_file", "e.crt")
                .set("geo.key_file", "e.key")
                .set("geo.ca_file", "ca.crt")
                .set("broker.cluster_name", "my site"),
            set("geo.listen", "localhost:7300"),
            set("geo.frame_bytes_max", "1024"),
            set("geo.stall_after_ms", "0"),
            set("geo.receive_bytes_max", "67108864"),
            set("geo.frame_bytes_max", "8388608").set("geo.receive_bytes_max", "67108864"),
            set("geo.advertise", "nohost"),
            set(
                "geo.routes",
                "west=10.1.0.7:7300,10.0.0.5:7300=10.1.0.8:7300,quic://b.west:7300=10.1.0.9:7300",
            ),
            set("geo.routes", "west"),
            set("geo.routes", "10.0.0.5:x=10.1.0.8:7300"),
            set("geo.routes", "quic://west=10.1.0.8:7300"),
            set("geo.routes", "west=10.1.0.7"),
            set("geo.listen", "127.0.0.1:7300")
                .set("geo.cert_file", "e.crt")
                .set("geo.key_file", "e.key")
                .set("geo.ca_file", "ca.crt")
                .set("broker.cluster_name", "east")
                .set("geo.frame_bytes_max", "1048576"),
        ],
        expect![[r#"
            set geo.listen=127.0.0.1:7300
              error: geo.cert_file = "" is invalid: geo.listen needs the site's certificate, its key and the federation CA (geo.cert_file, geo.key_file, geo.ca_file; `meridian-admin geo create-site-cert`)
            set geo.listen=127.0.0.1:7300 set geo.cert_file=e.crt set geo.key_file=e.key set geo.ca_file=ca.crt set broker.cluster_name=east
              ok: broker.cluster_name = "east", geo.ca_file = "ca.crt", geo.cert_file = "e.crt", geo.key_file = "e.key", geo.listen = "127.0.0.1:7300"
            set geo.listen=127.0.0.1:7300 set geo.cert_file=e.crt set geo.key_file=e.key set geo.ca_file=ca.crt set broker.cluster_name=my site
              error: broker.cluster_name = "my site" is invalid: a site on the geo link (geo.listen set) is named by 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-'
            set geo.listen=localhost:7300
              error: geo.listen = "localhost:7300" is invalid: expected IP:PORT, e.g. 127.0.0.1:7101
            set geo.frame_bytes_max=1024
              error: geo.frame_bytes_max = 1024 is out of range; accepted 65536..=268435456
            set geo.stall_after_ms=0
              error: geo.stall_after_ms = 0 is out of range; accepted 1000..=3600000
            set geo.receive_bytes_max=67108864
              error: geo.receive_bytes_max = 67108864 is out of range; accepted 134217728..=68719476736 (at least 8 × geo.frame_bytes_max: a stream's share, an eighth, holds a frame)
            set geo.frame_bytes_max=8388608 set geo.receive_bytes_max=67108864
              ok: geo.frame_bytes_max = 8388608, geo.receive_bytes_max = 67108864
            set geo.advertise=nohost
              error: geo.advertise = "nohost" is invalid: expected HOST:PORT, e.g. localhost:7101
            set geo.routes=west=10.1.0.7:7300,10.0.0.5:7300=10.1.0.8:7300,quic://b.west:7300=10.1.0.9:7300
              ok: geo.routes = ["west=10.1.0.7:7300", "10.0.0.5:7300=10.1.0.8:7300", "quic://b.west:7300=10.1.0.9:7300"]
            set geo.routes=west
              error: geo.routes = "west" is invalid: each route is SITE=HOST:PORT or HOST:PORT=HOST:PORT
            set geo.routes=10.0.0.5:x=10.1.0.8:7300
              error: geo.routes = "10.0.0.5:x=10.1.0.8:7300" is invalid: the broker's address: the port must be an integer in 1..=65535
            set geo.routes=quic://west=10.1.0.8:7300
              error: geo.routes = "quic://west=10.1.0.8:7300" is invalid: the broker's address: expected HOST:PORT, e.g. localhost:7101
            set geo.routes=west=10.1.0.7
              error: geo.routes = "west=10.1.0.7" is invalid: expected HOST:PORT, e.g. localhost:7101
            set geo.listen=127.0.0.1:7300 set geo.cert_file=e.crt set geo.key_file=e.key set geo.ca_file=ca.crt set broker.cluster_name=east set geo.frame_bytes_max=1048576
              error: geo.frame_bytes_max = 1048576 is out of range; accepted 5308416..=268435456 (at least broker.message_bytes_max + 65536)
        "#]],
    );
}

#[test]
fn geo_routes_name_a_site_or_a_broker_s_geo_url() {
    let c = GeoConfig {
        routes: vec![
            " west = 10.1.0.7:7300".into(),
            "10.0.0.5:7300=10.1.0.8:7300".into(),
            "quic://b.west:7300=10.1.0.9:7300".into(),
        ],
        ..GeoConfig::default()
    };
    assert_eq!(
        c.route_map().unwrap(),
        [
            ("west".to_string(), "10.1.0.7:7300".to_string()),
            ("quic://10.0.0.5:7300".into(), "10.1.0.8:7300".into()),
            ("quic://b.west:7300".into(), "10.1.0.9:7300".into()),
        ]
    );
}
