//! Producers of the stock Rust `pulsar` crate in a run, beside the Python client's: each
//! sends `NAME#S` with properties p and s and records every receipt or failure as the Python
//! producer prints them (JSON lines with "p", so one checker reads both).
//!
//! The crate numbers a producer's sends from 0 whatever the broker says of the name, so a
//! producer it had to make again (after a send it could not hand over) takes a new name
//! (`NAME.K`): with deduplication on, the old name's numbers would make every send of the new
//! one a duplicate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pulsar::{producer, ProducerOptions, Pulsar, TokioExecutor};
use serde_json::{json, Value};

use super::wall;

/// A crate producer at work on one topic.
pub struct CrateProducer {
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
    lines: Arc<Mutex<Vec<Box<str>>>>,
}

impl CrateProducer {
    /// `urls`: one `pulsar://HOST:PORT` per broker (the crate takes one host); each new
    /// client takes the next; `pause`: between sends.
    pub fn start(urls: &[String], topic: &str, name: &str, pause: Duration) -> CrateProducer {
        let stop = Arc::new(AtomicBool::new(false));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(produce(
            urls.to_vec(),
            topic.to_string(),
            name.to_string(),
            pause,
            Arc::clone(&stop),
            Arc::clone(&lines),
        ));
        CrateProducer {
            stop,
            task: Some(task),
            lines,
        }
    }

    /// How many sends were acknowledged so far.
    pub fn acked(&self) -> usize {
        let lines = self.lines.lock().expect("lines");
        lines
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v.get("acked").is_some())
            .count()
    }

    /// Stops sending and waits (at most `timeout`) for every send's answer; its lines, as
    /// printed (JSON).
    pub async fn finish(mut self, timeout: Duration) -> Vec<Box<str>> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(timeout, task).await;
        }
        let lines = self.lines.lock().expect("lines");
        lines.clone()
    }
}

/// A run that ends early (an error) stops its producer too.
impl Drop for CrateProducer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Kept as text: a long run records millions ([`crate::PyClient::spawn_script_as_text`]).
fn record(lines: &Mutex<Vec<Box<str>>>, mut v: Value) {
    v["t"] = json!(wall());
    lines
        .lock()
        .expect("lines")
        .push(v.to_string().into_boxed_str());
}

async fn produce(
    urls: Vec<String>,
    topic: String,
    base: String,
    pause: Duration,
    stop: Arc<AtomicBool>,
    lines: Arc<Mutex<Vec<Box<str>>>>,
) {
    let mut receipts = Vec::new();
    let mut incarnation = 0;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("{base}.{incarnation}");
        let url = urls[incarnation % urls.len()].clone();
        incarnation += 1;
        let client = match Pulsar::<TokioExecutor>::builder(url, TokioExecutor)
            .build()
            .await
        {
            Ok(c) => c,
            Err(e) => {
                record(&lines, json!({"p": name, "create_failed": e.to_string()}));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let made = client
            .producer()
            .with_topic(&topic)
            .with_name(&name)
            .with_options(ProducerOptions {
                block_queue_if_full: true,
                ..Default::default()
            })
            .build()
            .await;
        let mut p = match made {
            Ok(p) => p,
            Err(e) => {
                record(&lines, json!({"p": name, "create_failed": e.to_string()}));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut s = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let msg = producer::Message {
                payload: format!("{name}#{s}").into_bytes(),
                properties: HashMap::from([
                    ("p".to_string(), name.clone()),
                    ("s".to_string(), s.to_string()),
                ]),
                partition_key: Some(format!("k{}", s % 8)),
                ..Default::default()
            };
            let at = Instant::now();
            match p.send_non_blocking(msg).await {
                Ok(receipt) => {
                    let lines = Arc::clone(&lines);
                    let name = name.clone();
                    receipts.push(tokio::spawn(async move {
                        let v = match receipt.await {
                            Ok(r) => {
                                // As the Python client prints ids: signed (a duplicate's
                                // receipt names -1:-1).
                                let id = r.message_id.map_or("-1:-1".to_string(), |m| {
                                    let (l, e) = (m.ledger_id as i64, m.entry_id as i64);
                                    match m.batch_index {
                                        Some(b) if b >= 0 => format!("{l}:{e}:{b}"),
                                        _ => format!("{l}:{e}"),
                                    }
                                });
                                let l = at.elapsed().as_secs_f64() * 1000.0;
                                json!({"p": name, "acked": s, "id": id, "l": l})
                            }
                            Err(e) => json!({"p": name, "failed": s, "result": e.to_string()}),
                        };
                        record(&lines, v);
                    }));
                }
                Err(e) => {
                    record(
                        &lines,
                        json!({"p": name, "failed": s, "result": e.to_string()}),
                    );
                    break;
                }
            }
            s += 1;
            tokio::time::sleep(pause).await;
        }
    }
    for r in receipts {
        let _ = r.await;
    }
}
