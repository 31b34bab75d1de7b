//! TLS between roles (issue 18): the role-authentication matrix.
//!
//! A site "east" with its internal CA (made by `meridian-admin site-tls`), three metadata
//! nodes and a bookie started with `[tls]`. Every internal port (the metadata client API and
//! its membership changes, the Raft RPCs, bookie reads, bookie writes) is tried by every kind of peer: plaintext, TLS
//! without a certificate, a certificate of another site's CA ("west"), and certificates of
//! each role of this site. Each cell must be exactly what the rules say: refused at the
//! handshake, refused by role, or admitted.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use meridian_integration::access::{
    cell, try_bookie, try_membership, try_metadata_api, try_raft, Peer, ADMITTED, DENIED, HANDSHAKE,
};
use meridian_integration::{free_port, meridian_bin, run_admin, run_cli, step};
use meridian_metadata::tls::SiteTls;
use meridian_storage::proto::Request;

/// A `meridian` process killed when dropped; its output in `log`.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(args: &[&str], tls: &Files, log: PathBuf) -> anyhow::Result<Proc> {
        let out = std::fs::File::create(&log)?;
        let child = Command::new(meridian_bin())
            .args(args)
            .env("RUST_LOG", "info,openraft=warn")
            .env("MERIDIAN_TLS_CERT_FILE", &tls.cert)
            .env("MERIDIAN_TLS_KEY_FILE", &tls.key)
            .env("MERIDIAN_TLS_CA_FILE", &tls.ca)
            .env("MERIDIAN_BOOKIE_JOURNAL_FILE_BYTES_MAX", "8388608")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("spawning meridian")?;
        Ok(Proc { child, log })
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- {} (last {} lines) ---", self.log.display(), tail.len());
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process's `[tls]` files.
#[derive(Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl Files {
    fn load(&self) -> Arc<SiteTls> {
        let read = |p: &Path| std::fs::read(p).unwrap();
        Arc::new(SiteTls::from_pem(read(&self.ca), read(&self.cert), read(&self.key)).unwrap())
    }
}

fn admin(args: &[&str]) {
    let (code, out, err) = run_admin(args).unwrap();
    assert_eq!(code, 0, "meridian-admin {args:?}: {out}{err}");
}

/// Makes the certificate of `role` `name` in `dir` (CA in `dir/ca`).
fn cert(dir: &Path, ca_dir: &Path, role: &str, name: &str) -> Files {
    let (cert, key) = meridian_integration::access::site_cert(dir, ca_dir, role, name);
    Files {
        cert,
        key,
        ca: ca_dir.join("ca.pem"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn given_a_site_with_tls_between_roles_then_each_port_admits_exactly_its_roles() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let (east_ca, west_ca) = (dir.join("east-ca"), dir.join("west-ca"));

    step("create the internal CAs of sites east and west, and east's certificates");
    for (site, ca) in [("east", &east_ca), ("west", &west_ca)] {
        admin(&[
            "site-tls",
            "create-ca",
            "--site",
            site,
            "--out-dir",
            ca.to_str().unwrap(),
        ]);
    }
    let certs = dir.join("certs");
    let nodes: Vec<Files> = (1..=3)
        .map(|i| cert(&certs, &east_ca, "metadata", &i.to_string()))
        .collect();
    let bookie_files = cert(&certs, &east_ca, "bookie", "bk1");
    let broker = cert(&certs, &east_ca, "broker", "b1");
    let admin_files = cert(&certs, &east_ca, "admin", "ops");
    let stranger = cert(&certs, &east_ca, "metadata", "9");
    // West's broker trusts east's CA (so the handshake gets as far as east checking west's
    // certificate), but its own certificate comes from west's CA.
    let west = Files {
        ca: east_ca.join("ca.pem"),
        ..cert(&dir.join("west"), &west_ca, "broker", "b1")
    };
    // A metadata certificate must be named by its node id.
    let (code, _, err) = run_admin(&[
        "site-tls",
        "create-cert",
        "--role",
        "metadata",
        "--name",
        "m1",
        "--ca-dir",
        east_ca.to_str().unwrap(),
        "--out-dir",
        certs.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("node id"), "{err}");

    step("a [tls] section with a file missing is refused, naming the key");
    let (code, _, err) = run_cli(&[
        "--tls-cert-file",
        nodes[0].cert.to_str().unwrap(),
        "--tls-ca-file",
        nodes[0].ca.to_str().unwrap(),
        "metadata",
    ])
    .unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tls.key_file"), "{err}");

    step("start three metadata nodes with TLS; they elect a leader over TLS Raft");
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let members = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut procs = Vec::new();
    for (i, files) in nodes.iter().enumerate() {
        let id = (i + 1).to_string();
        procs.push(
            Proc::spawn(
                &[
                    "metadata",
                    "--node-id",
                    &id,
                    "--listen",
                    &addrs[i],
                    "--data-dir",
                    dir.join(format!("m{id}")).to_str().unwrap(),
                    "--initial-members",
                    &members,
                ],
                files,
                dir.join(format!("m{id}.log")),
            )
            .unwrap(),
        );
    }
    let client = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: addrs.clone(),
            request_timeout_ms: 20_000,
            ..Default::default()
        },
        Some(broker.load()),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let version = loop {
        match client.put("/tls-check", "written over TLS").await {
            Ok(v) => break v,
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for the cluster: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no write through the TLS cluster: {e}"),
        }
    };
    assert!(version > 0);

    step("start a bookie with TLS; it registers through the TLS metadata store");
    let bookie_addr = format!("127.0.0.1:{}", free_port());
    procs.push(
        Proc::spawn(
            &[
                "bookie",
                "--metadata",
                &addrs.join(","),
                "--listen",
                &bookie_addr,
                "--journal-dir",
                dir.join("bk/journal").to_str().unwrap(),
                "--ledger-dir",
                dir.join("bk/ledgers").to_str().unwrap(),
            ],
            &bookie_files,
            dir.join("bookie.log"),
        )
        .unwrap(),
    );
    meridian_integration::wait_for_bookies(&client, 1, Duration::from_secs(30))
        .await
        .unwrap();

    step("a broker's certificate writes and reads a ledger over TLS (perf ledger --verify)");
    let tls_flags = |f: &Files| {
        vec![
            "--tls-cert-file".to_string(),
            f.cert.display().to_string(),
            "--tls-key-file".to_string(),
            f.key.display().to_string(),
            "--tls-ca-file".to_string(),
            f.ca.display().to_string(),
        ]
    };
    let perf = |f: &Files| {
        let mut args = tls_flags(f);
        args.extend(
            [
                "perf",
                "ledger",
                "--metadata",
                &addrs.join(","),
                "--ensemble",
                "1",
                "--write-quorum",
                "1",
                "--ack-quorum",
                "1",
                "--entries",
                "200",
                "--entry-size",
                "512",
                "--verify",
            ]
            .map(String::from),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_cli(&args).unwrap()
    };
    let (code, out, err) = perf(&broker);
    assert_eq!(code, 0, "perf ledger as a broker: {out}{err}");
    step("an admin certificate may not write a ledger");
    let (code, out, err) = perf(&admin_files);
    assert_ne!(code, 0, "perf ledger as admin must fail: {out}{err}");
    assert!(
        format!("{out}{err}").contains("adds need a broker's certificate"),
        "perf ledger as admin must fail for its certificate: {out}{err}"
    );

    step("the matrix: every peer against every internal port");
    let meta_addr = &addrs[0];
    let ca = &east_ca.join("ca.pem");
    let peers: Vec<(&str, Peer)> = vec![
        ("plaintext", Peer::Plaintext),
        ("tls without certificate", Peer::NoCertificate),
        ("west broker", Peer::Certificate(west.load())),
        ("east metadata 2", Peer::Certificate(nodes[1].load())),
        ("east metadata 9", Peer::Certificate(stranger.load())),
        ("east bookie", Peer::Certificate(bookie_files.load())),
        ("east broker", Peer::Certificate(broker.load())),
        ("east admin", Peer::Certificate(admin_files.load())),
    ];
    let mut table = String::new();
    let mut details = String::new();
    for (name, peer) in &peers {
        let verdicts = [
            try_metadata_api(meta_addr, peer, ca).await,
            try_membership(meta_addr, peer, ca).await,
            try_raft(meta_addr, peer, ca).await,
            try_bookie(
                &bookie_addr,
                peer,
                ca,
                Request::Read {
                    ledger_id: 1 << 40,
                    entry_id: 0,
                },
            )
            .await,
            try_bookie(
                &bookie_addr,
                peer,
                ca,
                Request::Delete { ledger_id: 1 << 40 },
            )
            .await,
        ];
        let cells: Vec<&str> = verdicts.iter().map(|v| cell(v)).collect();
        table.push_str(&format!("{name:<24} | {}\n", cells.join(" | ")));
        details.push_str(&format!("{name}: {verdicts:?}\n"));
    }
    eprintln!("{details}");
    let n = HANDSHAKE;
    let expected = [
        // metadata API, membership change, Raft, bookie read, bookie write
        ("plaintext", [n, n, n, n, n]),
        ("tls without certificate", [n, n, n, n, n]),
        ("west broker", [n, n, n, n, n]),
        (
            "east metadata 2",
            [ADMITTED, ADMITTED, ADMITTED, DENIED, DENIED],
        ),
        (
            "east metadata 9",
            [ADMITTED, DENIED, DENIED, DENIED, DENIED],
        ),
        ("east bookie", [ADMITTED, DENIED, DENIED, ADMITTED, DENIED]),
        (
            "east broker",
            [ADMITTED, DENIED, DENIED, ADMITTED, ADMITTED],
        ),
        ("east admin", [ADMITTED, ADMITTED, DENIED, ADMITTED, DENIED]),
    ]
    .map(|(name, cells)| format!("{name:<24} | {}\n", cells.join(" | ")))
    .concat();
    assert_eq!(table, expected, "\n{details}");

    step("refusals are logged by the node and the bookie");
    let node_log = procs[0].log_text();
    assert!(node_log.contains("request refused"), "{node_log}");
    assert!(node_log.contains("Raft RPC refused"), "{node_log}");
    let bookie_log = procs[3].log_text();
    assert!(
        bookie_log.contains("bookie request refused"),
        "{bookie_log}"
    );
    assert!(bookie_log.contains("TLS handshake failed"), "{bookie_log}");

    step("the cluster still serves after all that");
    let kv = client.get("/tls-check").await.unwrap().unwrap();
    assert_eq!(kv.value, b"written over TLS");

    step("a bookie's certificate writes only under /bookies/available/ (to a follower too); a broker's anywhere");
    let as_bookie = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: vec![addrs[1].clone()],
            request_timeout_ms: 10_000,
            ..Default::default()
        },
        Some(bookie_files.load()),
    )
    .unwrap();
    as_bookie
        .put("/bookies/available/scope-check", "ok")
        .await
        .expect("a bookie writes under /bookies/available/");
    for key in [
        "/admin/tenants/evil",
        "/ledgers/L00000000000000000001",
        "/bookies",
        "/bookies/scope-check",
        // What the admin API keeps for superusers.
        "/bookies/decommissioned/127.0.0.1:1",
        "/bookies/racks/127.0.0.1:1",
        "/bookies/groups/127.0.0.1:1",
    ] {
        match as_bookie.put(key, "x").await {
            Err(meridian_metadata::ClientError::PermissionDenied(m)) => {
                assert!(
                    m.contains("writes only under /bookies/available/"),
                    "{key}: {m}"
                )
            }
            other => panic!("a bookie's put of {key} must be refused: {other:?}"),
        }
        assert!(client.get(key).await.unwrap().is_none(), "{key} written");
    }
    let by_prefix = meridian_metadata::pb::TxnRequest {
        conditions: Vec::new(),
        success: vec![meridian_metadata::pb::Op {
            op: Some(meridian_metadata::pb::op::Op::Delete(
                meridian_metadata::pb::DeleteOp {
                    key: "/bookies/available/".into(),
                    prefix: true,
                },
            )),
        }],
        failure: Vec::new(),
    };
    match as_bookie.txn(by_prefix).await {
        Err(meridian_metadata::ClientError::PermissionDenied(m)) => {
            assert!(m.contains("not by prefix"), "{m}")
        }
        other => panic!("a bookie's deletion by prefix must be refused: {other:?}"),
    }
    // The probe's registration is not a bookie: it goes.
    as_bookie
        .delete("/bookies/available/scope-check", None)
        .await
        .unwrap();
    client
        .put("/admin/scope-check", "broker")
        .await
        .expect("a broker writes under /admin/");

    step("a fourth node with its certificate joins over TLS when an admin adds it");
    let node4 = cert(&certs, &east_ca, "metadata", "4");
    let addr4 = format!("127.0.0.1:{}", free_port());
    procs.push(
        Proc::spawn(
            &[
                "metadata",
                "--node-id",
                "4",
                "--listen",
                &addr4,
                "--data-dir",
                dir.join("m4").to_str().unwrap(),
            ],
            &node4,
            dir.join("m4.log"),
        )
        .unwrap(),
    );
    let as_admin = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: addrs.clone(),
            request_timeout_ms: 30_000,
            ..Default::default()
        },
        Some(admin_files.load()),
    )
    .unwrap();
    let members = as_admin.add_member(4, &addr4, false).await.unwrap();
    assert!(
        members.members.iter().any(|m| m.id == 4 && m.voter),
        "{members:?}"
    );
    let as_broker_err = client.remove_member(4).await.unwrap_err();
    assert!(
        matches!(
            as_broker_err,
            meridian_metadata::ClientError::PermissionDenied(_)
        ),
        "{as_broker_err}"
    );
    let via_node4 = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: vec![addr4.clone()],
            ..Default::default()
        },
        Some(broker.load()),
    )
    .unwrap();
    let kv = via_node4.get("/tls-check").await.unwrap().unwrap();
    assert_eq!(kv.value, b"written over TLS");

    step("a broker with its certificate serves producers through the TLS store and bookie");
    let mut b = meridian_integration::BrokerProc::new("broker", dir, &addrs.join(","));
    b.env("MERIDIAN_TLS_CERT_FILE", broker.cert.to_str().unwrap())
        .env("MERIDIAN_TLS_KEY_FILE", broker.key.to_str().unwrap())
        .env("MERIDIAN_TLS_CA_FILE", broker.ca.to_str().unwrap());
    b.start().unwrap();
    let (code, out, err) = run_cli(&[
        "perf",
        "produce",
        "--url",
        &b.url,
        "--topic",
        "tls-topic",
        "--messages",
        "2000",
        "--seconds",
        "0",
    ])
    .unwrap();
    assert_eq!(code, 0, "perf produce through a TLS site: {out}{err}");
    b.stop().unwrap();
    step("a broker refuses to start with a bookie's certificate");
    let mut wrong = meridian_integration::BrokerProc::new("wrong-broker", dir, &addrs.join(","));
    wrong
        .env(
            "MERIDIAN_TLS_CERT_FILE",
            bookie_files.cert.to_str().unwrap(),
        )
        .env("MERIDIAN_TLS_KEY_FILE", bookie_files.key.to_str().unwrap())
        .env("MERIDIAN_TLS_CA_FILE", bookie_files.ca.to_str().unwrap());
    assert!(wrong.start().is_err());
    assert!(
        wrong.log_text().contains("this process is a broker"),
        "{}",
        wrong.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_standalone_then_it_is_plaintext_unless_tls_is_set() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let ca = dir.join("ca");
    admin(&[
        "site-tls",
        "create-ca",
        "--site",
        "solo",
        "--out-dir",
        ca.to_str().unwrap(),
    ]);
    let files = cert(&dir.join("certs"), &ca, "broker", "standalone");

    step("by default its metadata store answers a plaintext client");
    for d in ["plain", "tls"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let mut plain = meridian_integration::StandaloneProc::new(&dir.join("plain"));
    plain.start().unwrap();
    plain.metadata_client().unwrap().get("/").await.unwrap();
    plain.stop().unwrap();

    step("with [tls] it refuses a plaintext client and answers its own certificate");
    let mut s = meridian_integration::StandaloneProc::new(&dir.join("tls"));
    s.env("MERIDIAN_TLS_CERT_FILE", files.cert.to_str().unwrap())
        .env("MERIDIAN_TLS_KEY_FILE", files.key.to_str().unwrap())
        .env("MERIDIAN_TLS_CA_FILE", files.ca.to_str().unwrap());
    s.start().unwrap();
    let plaintext = s.metadata_client().unwrap();
    let err = plaintext.get("/").await.unwrap_err();
    eprintln!("plaintext client: {err}");
    let addresses: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.data_dir.join("addresses.json")).unwrap()).unwrap();
    let addr = addresses["metadata"].as_str().unwrap().to_string();
    let tls_client = meridian_metadata::MetadataClient::with_tls(
        &meridian_config::ClientConfig {
            endpoints: vec![addr],
            ..Default::default()
        },
        Some(files.load()),
    )
    .unwrap();
    tls_client.get("/").await.unwrap();
    let (code, out, err) = run_cli(&[
        "perf",
        "produce",
        "--url",
        &s.url,
        "--messages",
        "500",
        "--seconds",
        "0",
    ])
    .unwrap();
    assert_eq!(code, 0, "perf produce against a TLS standalone: {out}{err}");
    s.stop().unwrap();
}
