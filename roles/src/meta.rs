//! `meridian meta`: an etcdctl-like client of the metadata store.
//!
//! Output is for people by default and one JSON document per result with `--json`. A missing
//! key exits 1 with a message on stderr.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use meridian_config::Config;
use meridian_metadata::client::PutOptions;
use meridian_metadata::model::{Event, EventKind, KeyValue};
use meridian_metadata::{ClientError, MetadataClient};
use serde_json::json;

#[derive(Args)]
pub struct MetaArgs {
    /// Metadata nodes, `HOST:PORT,...` (client.endpoints).
    #[arg(long, global = true)]
    endpoints: Option<String>,
    /// Deadline of each call in milliseconds, retries included (client.request_timeout_ms).
    #[arg(long, global = true)]
    timeout_ms: Option<u64>,
    /// Print JSON for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: MetaCommand,
}

impl MetaArgs {
    pub fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        if let Some(e) = &self.endpoints {
            o.push(("client.endpoints".into(), e.clone()));
        }
        if let Some(t) = self.timeout_ms {
            o.push(("client.request_timeout_ms".into(), t.to_string()));
        }
        o
    }
}

#[derive(Subcommand)]
enum MetaCommand {
    /// Write a key; prints its new version.
    Put {
        key: String,
        value: String,
        /// Only if the key is at this version (0: only if absent).
        #[arg(long)]
        expect_version: Option<u64>,
        /// Only if the key is absent (same as --expect-version 0).
        #[arg(long, conflicts_with = "expect_version")]
        create: bool,
        /// Append a monotonic 20-digit suffix; prints the key and its version.
        #[arg(long)]
        sequential: bool,
    },
    /// Print a key's value (exit 1 if absent).
    Get {
        key: String,
        /// Print the version and revisions too.
        #[arg(long, short = 'v')]
        verbose: bool,
    },
    /// Delete a key, or every key under a prefix; prints how many went.
    Del {
        key: String,
        #[arg(long)]
        expect_version: Option<u64>,
        #[arg(long, conflicts_with = "expect_version")]
        prefix: bool,
    },
    /// List keys under a prefix, one per line, in key order.
    List {
        prefix: String,
        /// Print the direct children's names instead of the keys.
        #[arg(long)]
        children: bool,
        /// Print `key<TAB>value` lines.
        #[arg(long)]
        values: bool,
        /// Stop after this many (default: all, fetched page by page).
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Print events on a key (or prefix) as they happen.
    Watch {
        key: String,
        #[arg(long)]
        prefix: bool,
        /// Start at this revision (replays history); default: from now.
        #[arg(long, default_value_t = 0)]
        from_revision: u64,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Show the cluster's members and leader.
    Members,
    /// Add a node (learner, then voter).
    AddMember {
        id: u64,
        addr: String,
        /// Leave it a learner (replicates, does not vote).
        #[arg(long)]
        learner: bool,
    },
    /// Remove a node.
    RemoveMember { id: u64 },
    /// Measure puts and linearizable gets.
    Bench(crate::bench::BenchArgs),
}

fn kv_json(kv: &KeyValue) -> serde_json::Value {
    json!({
        "key": kv.key,
        "value": String::from_utf8_lossy(&kv.value),
        "version": kv.mod_revision,
        "create_revision": kv.create_revision,
        "session": kv.session,
    })
}

fn event_json(ev: &Event) -> serde_json::Value {
    json!({
        "type": match ev.kind { EventKind::Put => "PUT", EventKind::Delete => "DELETE" },
        "revision": ev.revision,
        "kv": kv_json(&ev.kv),
    })
}

pub async fn run(args: MetaArgs, cfg: Config) -> anyhow::Result<ExitCode> {
    let client = MetadataClient::with_tls(&cfg.client, crate::tls_of(&cfg, None)?)?;
    let json = args.json;
    let mut out = std::io::stdout().lock();
    match args.command {
        MetaCommand::Put {
            key,
            value,
            expect_version,
            create,
            sequential,
        } => {
            let opts = PutOptions {
                expected_version: if create { Some(0) } else { expect_version },
                session: 0,
                sequential,
            };
            match client.put_with(&key, value, opts).await {
                Ok(r) if json => writeln!(out, "{}", json!({"key": r.key, "version": r.version}))?,
                Ok(r) if sequential => writeln!(out, "{} {}", r.key, r.version)?,
                Ok(r) => writeln!(out, "{}", r.version)?,
                Err(e @ ClientError::Conflict { .. }) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(e) => return Err(e.into()),
            }
        }
        MetaCommand::Get { key, verbose } => match client.get(&key).await? {
            None => {
                if json {
                    writeln!(out, "null")?;
                }
                eprintln!("error: key not found: {key}");
                return Ok(ExitCode::FAILURE);
            }
            Some(kv) if json => writeln!(out, "{}", kv_json(&kv))?,
            Some(kv) => {
                out.write_all(&kv.value)?;
                writeln!(out)?;
                if verbose {
                    writeln!(
                        out,
                        "version {} create_revision {} session {}",
                        kv.mod_revision, kv.create_revision, kv.session
                    )?;
                }
            }
        },
        MetaCommand::Del {
            key,
            expect_version,
            prefix,
        } => {
            let deleted = if prefix {
                let resp = client
                    .txn(meridian_metadata::pb::TxnRequest {
                        conditions: vec![],
                        success: vec![meridian_metadata::pb::Op {
                            op: Some(meridian_metadata::pb::op::Op::Delete(
                                meridian_metadata::pb::DeleteOp {
                                    key: key.clone(),
                                    prefix: true,
                                },
                            )),
                        }],
                        failure: vec![],
                    })
                    .await?;
                resp.results.first().map_or(0, |r| r.deleted)
            } else {
                match client.delete(&key, expect_version).await {
                    Ok(d) => u64::from(d),
                    Err(e @ ClientError::Conflict { .. }) => {
                        eprintln!("error: {e}");
                        return Ok(ExitCode::FAILURE);
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            if json {
                writeln!(out, "{}", json!({ "deleted": deleted }))?;
            } else {
                writeln!(out, "{deleted}")?;
            }
        }
        MetaCommand::List {
            prefix,
            children,
            values,
            limit,
        } => {
            let mut remaining = limit.unwrap_or(u64::MAX);
            let mut after = String::new();
            let mut items = Vec::new();
            while remaining > 0 {
                let page_size = remaining.min(1_000) as u32;
                let page = if children {
                    client.children(&prefix, &after, page_size).await?
                } else {
                    client.list(&prefix, &after, page_size).await?
                };
                if children {
                    for c in &page.children {
                        if json {
                            items.push(json!(c));
                        } else {
                            writeln!(out, "{c}")?;
                        }
                    }
                    remaining -= page.children.len() as u64;
                    after = page.children.last().cloned().unwrap_or_default();
                } else {
                    for kv in &page.kvs {
                        if json {
                            items.push(kv_json(kv));
                        } else if values {
                            writeln!(out, "{}\t{}", kv.key, String::from_utf8_lossy(&kv.value))?;
                        } else {
                            writeln!(out, "{}", kv.key)?;
                        }
                    }
                    remaining -= page.kvs.len() as u64;
                    after = page.kvs.last().map(|kv| kv.key.clone()).unwrap_or_default();
                }
                if !page.more {
                    break;
                }
            }
            if json {
                writeln!(out, "{}", serde_json::Value::Array(items))?;
            }
        }
        MetaCommand::Watch {
            key,
            prefix,
            from_revision,
            count,
        } => {
            let mut watch = client.watch(&key, prefix, from_revision).await?;
            let mut seen = 0u64;
            if !json {
                let from = if from_revision == 0 {
                    watch.revision + 1
                } else {
                    from_revision
                };
                eprintln!("watching {key} from revision {from}");
            }
            while count.is_none_or(|c| seen < c) {
                let Some(batch) = watch.next().await else {
                    bail!("watch ended");
                };
                for ev in batch.context("watch failed")? {
                    if json {
                        writeln!(out, "{}", event_json(&ev))?;
                    } else {
                        let kind = match ev.kind {
                            EventKind::Put => "PUT",
                            EventKind::Delete => "DELETE",
                        };
                        writeln!(
                            out,
                            "{kind} {} {} {}",
                            ev.revision,
                            ev.kv.key,
                            String::from_utf8_lossy(&ev.kv.value)
                        )?;
                    }
                    out.flush()?;
                    seen += 1;
                    if count.is_some_and(|c| seen >= c) {
                        break;
                    }
                }
            }
        }
        MetaCommand::Members => {
            let m = client.members().await?;
            print_members(&mut out, &m, json)?;
        }
        MetaCommand::AddMember { id, addr, learner } => {
            let m = client.add_member(id, &addr, learner).await?;
            print_members(&mut out, &m, json)?;
        }
        MetaCommand::RemoveMember { id } => {
            let m = client.remove_member(id).await?;
            print_members(&mut out, &m, json)?;
        }
        MetaCommand::Bench(b) => {
            drop(out);
            crate::bench::run(b, &cfg.client, crate::tls_of(&cfg, None)?, json).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_members(
    out: &mut impl Write,
    m: &meridian_metadata::pb::MembersResponse,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        let members: Vec<_> = m
            .members
            .iter()
            .map(|x| {
                json!({"id": x.id, "addr": x.addr, "voter": x.voter, "leader": x.id == m.leader})
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({"members": members, "leader": m.leader, "term": m.term,
                   "answered_by": m.node, "last_applied": m.last_applied})
        )?;
    } else {
        writeln!(out, "{:<6} {:<24} {:<8} LEADER", "ID", "ADDRESS", "ROLE")?;
        for x in &m.members {
            writeln!(
                out,
                "{:<6} {:<24} {:<8} {}",
                x.id,
                x.addr,
                if x.voter { "voter" } else { "learner" },
                if x.id == m.leader { "*" } else { "" }
            )?;
        }
        writeln!(
            out,
            "term {}, answered by node {}, last applied index {}",
            m.term, m.node, m.last_applied
        )?;
    }
    Ok(())
}
