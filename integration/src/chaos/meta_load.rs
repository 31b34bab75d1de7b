//! The metadata store's load during a run: a few clients reading, writing and
//! compare-and-setting a few keys, each operation recorded with when it was called, when it
//! returned and what it returned, for the linearizability checker.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_metadata::MetadataClient;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::linearizable::{Call, Op, Outcome};

/// The clients at work; [`finish`](MetaLoad::finish) stops them and returns each key's history.
pub struct MetaLoad {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(String, Call)>>>,
}

impl MetaLoad {
    /// `clients` clients over `keys` keys under `prefix`; times count from `t0`.
    pub fn start(
        endpoints: &[String],
        prefix: &str,
        clients: usize,
        keys: usize,
        seed: u64,
        t0: Instant,
    ) -> anyhow::Result<MetaLoad> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for c in 0..clients {
            let client = MetadataClient::connect_to(endpoints)?;
            let keys: Vec<String> = (0..keys).map(|k| format!("{prefix}/k{k}")).collect();
            let stop = Arc::clone(&stop);
            let rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(c as u64));
            tasks.push(tokio::spawn(run_client(client, c, keys, rng, stop, t0)));
        }
        Ok(MetaLoad { stop, tasks })
    }

    /// Stops the clients; every key's operations in the order they were called.
    pub async fn finish(mut self) -> BTreeMap<String, Vec<Call>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out: BTreeMap<String, Vec<Call>> = BTreeMap::new();
        for t in std::mem::take(&mut self.tasks) {
            if let Ok(calls) = t.await {
                for (key, call) in calls {
                    out.entry(key).or_default().push(call);
                }
            }
        }
        for calls in out.values_mut() {
            calls.sort_by_key(|c| c.invoked);
        }
        out
    }
}

/// A run that ends early (an error) stops its clients too.
impl Drop for MetaLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn run_client(
    client: MetadataClient,
    me: usize,
    keys: Vec<String>,
    mut rng: StdRng,
    stop: Arc<AtomicBool>,
    t0: Instant,
) -> Vec<(String, Call)> {
    let mut out = Vec::new();
    // The version this client last saw of each key: what its compare-and-sets expect.
    let mut seen: HashMap<usize, u64> = HashMap::new();
    let mut n = 0u64;
    let nanos = |t0: Instant| t0.elapsed().as_nanos() as u64;
    while !stop.load(Ordering::Relaxed) {
        let k = rng.gen_range(0..keys.len());
        let key = &keys[k];
        let value = format!("c{me}-{n}");
        n += 1;
        let roll = rng.gen_range(0..10);
        let invoked = nanos(t0);
        let (op, outcome) = if roll < 4 {
            let outcome = match client.get(key).await {
                Ok(kv) => {
                    let got = kv.map(|kv| {
                        (
                            String::from_utf8_lossy(&kv.value).into_owned(),
                            kv.mod_revision,
                        )
                    });
                    if let Some((_, v)) = &got {
                        seen.insert(k, *v);
                    }
                    Some(Outcome::Read(got))
                }
                // A read that failed changed nothing and says nothing.
                Err(_) => None,
            };
            (Op::Read, outcome)
        } else {
            let (op, opts) = if roll < 7 {
                (Op::Write(value.clone()), PutOptions::default())
            } else {
                let expected = seen.get(&k).copied().unwrap_or(0);
                (
                    Op::Cas {
                        expected,
                        value: value.clone(),
                    },
                    PutOptions {
                        expected_version: Some(expected),
                        ..PutOptions::default()
                    },
                )
            };
            let outcome = match client.put_with(key, value.into_bytes(), opts).await {
                Ok(r) => {
                    seen.insert(k, r.version);
                    Some(Outcome::Written(r.version))
                }
                Err(ClientError::Conflict { current, .. }) if matches!(op, Op::Cas { .. }) => {
                    seen.insert(k, current);
                    Some(Outcome::CasFailed(current))
                }
                // Certainly not applied: as if never called.
                Err(e) if e.write_not_applied() => None,
                Err(_) => Some(Outcome::Unknown),
            };
            (op, outcome)
        };
        if let Some(outcome) = outcome {
            let completed = (outcome != Outcome::Unknown).then(|| nanos(t0));
            out.push((
                key.clone(),
                Call {
                    client: me,
                    op,
                    outcome,
                    invoked,
                    completed,
                },
            ));
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(5..30))).await;
    }
    out
}
