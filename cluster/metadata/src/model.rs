//! The replicated state machine, with no I/O and no clock.
//!
//! ```text
//!   Command (from the Raft log) --apply--> KvState --> Response
//!                                              |----> Events    (watch hub, history)
//!                                              '----> Mutations (written to RocksDB in the
//!                                                                same batch as the applied id)
//! ```
//!
//! Every node applies the same commands in the same order, so everything here must be
//! deterministic: no clock, no randomness, no iteration over hash maps. Session expiry is decided
//! by the leader (which owns the clock) and enters the log as [`Command::ExpireSession`].

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use serde::{Deserialize, Serialize};

/// Store-wide revision: incremented once by every command that changes something.
pub type Revision = u64;
/// A session's id is the revision of the command that created it, so ids never repeat.
pub type SessionId = u64;

/// Width of the monotonic suffix of a sequential key.
pub const SEQUENTIAL_SUFFIX_DIGITS: usize = 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The key's version: the revision of the write that last changed it.
    pub mod_revision: Revision,
    pub create_revision: Revision,
    /// 0 for a persistent key; otherwise the session the key is bound to.
    pub session: SessionId,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub id: SessionId,
    pub ttl_ms: u64,
    /// Ephemeral keys bound to this session.
    pub keys: BTreeSet<String>,
}

/// The key's version must equal `expected_version` (0: the key must be absent).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    pub key: String,
    pub expected_version: Revision,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        session: SessionId,
        sequential: bool,
    },
    Delete {
        key: String,
        prefix: bool,
    },
}

/// The payload of one Raft log entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    Txn {
        conditions: Vec<Condition>,
        success: Vec<Op>,
        failure: Vec<Op>,
    },
    CreateSession {
        ttl_ms: u64,
    },
    /// A client ended its session.
    CloseSession {
        id: SessionId,
    },
    /// The leader saw no keep-alive within the session's TTL.
    ExpireSession {
        id: SessionId,
    },
    /// Concurrent proposals carried by one log entry, applied in order, each as if alone.
    /// Never nested.
    Batch(Vec<Command>),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpResult {
    pub key: String,
    pub version: Revision,
    pub deleted: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Txn {
        succeeded: bool,
        results: Vec<OpResult>,
        revision: Revision,
        /// When the conditions failed: the current version of each condition key.
        current: Vec<Condition>,
    },
    SessionCreated {
        id: SessionId,
        ttl_ms: u64,
    },
    SessionEnded {
        deleted_keys: u64,
    },
    /// The command was valid when proposed but not when applied (for example a put bound to a
    /// session that expired in between). Nothing changed.
    Rejected {
        reason: String,
    },
    /// Raft-internal entries (blank, membership) answer with this.
    None,
    /// One response per command of a [`Command::Batch`], in order.
    Batch(Vec<Response>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    Put,
    Delete,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub revision: Revision,
    pub kind: EventKind,
    /// For a delete: the key with an empty value and the version it had.
    pub kv: KeyValue,
}

/// What must reach disk for one applied command, written atomically with the applied log id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutation {
    PutKv(KeyValue),
    DeleteKv(String),
    PutSession(Session),
    DeleteSession(SessionId),
}

/// The whole state machine. Small enough to keep in memory (as ZooKeeper and etcd's index do);
/// RocksDB holds the durable copy and it is loaded back at start-up.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvState {
    pub revision: Revision,
    pub kvs: BTreeMap<String, KeyValue>,
    pub sessions: BTreeMap<SessionId, Session>,
}

/// Output of [`KvState::apply`].
#[derive(Debug, Default)]
pub struct Applied {
    pub events: Vec<Event>,
    pub mutations: Vec<Mutation>,
}

/// Checks a key's shape: `/`-separated, absolute, no empty segment, no trailing `/`, no NUL or
/// control characters, at most `key_bytes_max` bytes.
pub fn validate_key(key: &str, key_bytes_max: usize) -> Result<(), String> {
    if key.len() > key_bytes_max {
        return Err(format!(
            "key is {} bytes; the limit (metadata.key_bytes_max) is {key_bytes_max}",
            key.len()
        ));
    }
    if !key.starts_with('/') {
        return Err(format!("key {key:?} must start with '/'"));
    }
    if key.len() > 1 && key.ends_with('/') {
        return Err(format!("key {key:?} must not end with '/'"));
    }
    if key.contains("//") {
        return Err(format!("key {key:?} has an empty segment"));
    }
    if key.chars().any(|c| c.is_control()) {
        return Err(format!("key {key:?} contains a control character"));
    }
    Ok(())
}

/// A prefix for scans and watches: like a key, but may end with `/` (and may be just `/`).
pub fn validate_prefix(prefix: &str, key_bytes_max: usize) -> Result<(), String> {
    let trimmed = prefix.strip_suffix('/').filter(|p| !p.is_empty());
    match trimmed {
        Some(p) => validate_key(p, key_bytes_max),
        None if prefix == "/" => Ok(()),
        None => validate_key(prefix, key_bytes_max),
    }
}

impl KvState {
    pub fn get(&self, key: &str) -> Option<&KeyValue> {
        self.kvs.get(key)
    }

    fn version_of(&self, key: &str) -> Revision {
        self.kvs.get(key).map_or(0, |kv| kv.mod_revision)
    }

    /// Keys starting with `prefix`, after `start_after` (exclusive), at most `limit`.
    /// Returns the keys and whether more remain.
    pub fn range(&self, prefix: &str, start_after: &str, limit: usize) -> (Vec<&KeyValue>, bool) {
        let lower = if start_after.is_empty() || start_after < prefix {
            Bound::Included(prefix.to_string())
        } else {
            Bound::Excluded(start_after.to_string())
        };
        let mut iter = self
            .kvs
            .range((lower, Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v);
        let out: Vec<&KeyValue> = iter.by_ref().take(limit).collect();
        let more = iter.next().is_some();
        (out, more)
    }

    /// Names of the direct children of `parent` (a path such as `/a`; `/` is the root), in byte
    /// order, after `start_after`, at most `limit`. A child exists when any key lies under it.
    pub fn children(&self, parent: &str, start_after: &str, limit: usize) -> (Vec<String>, bool) {
        if limit == 0 {
            return (Vec::new(), true);
        }
        let base = if parent.ends_with('/') {
            parent.to_string()
        } else {
            format!("{parent}/")
        };
        let mut found: BTreeSet<String> = BTreeSet::new();
        // Keys of child `c` lie in [base+c, base+c+"0") ('0' is the byte after '/'), so child
        // names do not arrive in sorted order when one name is a prefix of another
        // ("x-1" sorts before "x/..."). Scan until no unseen child can sort before the
        // limit-th one found.
        let start = if start_after.is_empty() {
            base.clone()
        } else {
            format!("{base}{start_after}")
        };
        for key in self.kvs.range(start..).map(|(k, _)| k) {
            if !key.starts_with(&base) {
                break;
            }
            let rest = &key[base.len()..];
            let child = rest.split('/').next().unwrap_or(rest);
            if child.is_empty() || child <= start_after {
                continue;
            }
            if found.len() > limit {
                let kth = found
                    .iter()
                    .nth(limit - 1)
                    .map(String::as_str)
                    .unwrap_or("");
                // Any child not yet seen has keys >= `rest`; once `rest` is past the key range
                // of every prefix of the limit-th child, nothing smaller can appear.
                let horizon = (1..=kth.len())
                    .filter(|&i| kth.is_char_boundary(i))
                    .map(|i| format!("{}0", &kth[..i]))
                    .max()
                    .unwrap_or_default();
                if rest > horizon.as_str() {
                    break;
                }
            }
            found.insert(child.to_string());
        }
        let more = found.len() > limit;
        (found.into_iter().take(limit).collect(), more)
    }

    /// Applies one command. Deterministic: the same state and command give the same result on
    /// every node.
    pub fn apply(&mut self, cmd: &Command) -> (Response, Applied) {
        let mut out = Applied::default();
        let response = match cmd {
            Command::Txn {
                conditions,
                success,
                failure,
            } => self.apply_txn(conditions, success, failure, &mut out),
            Command::CreateSession { ttl_ms } => {
                let id = self.revision + 1;
                self.revision = id;
                let session = Session {
                    id,
                    ttl_ms: *ttl_ms,
                    keys: BTreeSet::new(),
                };
                out.mutations.push(Mutation::PutSession(session.clone()));
                self.sessions.insert(id, session);
                Response::SessionCreated {
                    id,
                    ttl_ms: *ttl_ms,
                }
            }
            Command::Batch(cmds) => {
                let mut responses = Vec::with_capacity(cmds.len());
                for cmd in cmds {
                    let (r, applied) = match cmd {
                        Command::Batch(_) => (
                            Response::Rejected {
                                reason: "nested batches are not allowed".into(),
                            },
                            Applied::default(),
                        ),
                        cmd => self.apply(cmd),
                    };
                    out.events.extend(applied.events);
                    out.mutations.extend(applied.mutations);
                    responses.push(r);
                }
                Response::Batch(responses)
            }
            Command::CloseSession { id } | Command::ExpireSession { id } => {
                match self.sessions.contains_key(id) {
                    false => Response::Rejected {
                        reason: format!("session {id} does not exist (expired or closed)"),
                    },
                    true => {
                        self.revision += 1;
                        let deleted = self.end_session(*id, self.revision, &mut out);
                        Response::SessionEnded {
                            deleted_keys: deleted,
                        }
                    }
                }
            }
        };
        (response, out)
    }

    fn apply_txn(
        &mut self,
        conditions: &[Condition],
        success: &[Op],
        failure: &[Op],
        out: &mut Applied,
    ) -> Response {
        let succeeded = conditions
            .iter()
            .all(|c| self.version_of(&c.key) == c.expected_version);
        let ops = if succeeded { success } else { failure };
        // Check every op before changing anything: all or nothing.
        for op in ops {
            if let Op::Put { session, .. } = op {
                if *session != 0 && !self.sessions.contains_key(session) {
                    return Response::Rejected {
                        reason: format!("session {session} does not exist (expired or closed)"),
                    };
                }
            }
        }
        let current = if succeeded {
            Vec::new()
        } else {
            conditions
                .iter()
                .map(|c| Condition {
                    key: c.key.clone(),
                    expected_version: self.version_of(&c.key),
                })
                .collect()
        };
        let changes = ops.iter().any(|op| match op {
            Op::Put { .. } => true,
            Op::Delete { key, prefix } => {
                if *prefix {
                    !self.range(key, "", 1).0.is_empty()
                } else {
                    self.kvs.contains_key(key)
                }
            }
        });
        if changes {
            self.revision += 1;
        }
        let revision = self.revision;
        let mut results = Vec::with_capacity(ops.len());
        for op in ops {
            results.push(match op {
                Op::Put {
                    key,
                    value,
                    session,
                    sequential,
                } => {
                    let key = if *sequential {
                        format!("{key}{revision:0width$}", width = SEQUENTIAL_SUFFIX_DIGITS)
                    } else {
                        key.clone()
                    };
                    self.put(key.clone(), value.clone(), *session, revision, out);
                    OpResult {
                        key,
                        version: revision,
                        deleted: 0,
                    }
                }
                Op::Delete { key, prefix } => {
                    let keys: Vec<String> = if *prefix {
                        self.range(key, "", usize::MAX)
                            .0
                            .into_iter()
                            .map(|kv| kv.key.clone())
                            .collect()
                    } else if self.kvs.contains_key(key) {
                        vec![key.clone()]
                    } else {
                        Vec::new()
                    };
                    for k in &keys {
                        self.delete(k, revision, out);
                    }
                    OpResult {
                        key: key.clone(),
                        version: revision,
                        deleted: keys.len() as u64,
                    }
                }
            });
        }
        Response::Txn {
            succeeded,
            results,
            revision,
            current,
        }
    }

    fn put(
        &mut self,
        key: String,
        value: Vec<u8>,
        session: SessionId,
        revision: Revision,
        out: &mut Applied,
    ) {
        let old = self
            .kvs
            .get(&key)
            .map(|old| (old.session, old.create_revision));
        let create_revision = match old {
            Some((old_session, create_revision)) => {
                if old_session != 0 && old_session != session {
                    self.unbind(old_session, &key, out);
                }
                create_revision
            }
            None => revision,
        };
        if session != 0 {
            if let Some(s) = self.sessions.get_mut(&session) {
                if s.keys.insert(key.clone()) {
                    out.mutations.push(Mutation::PutSession(s.clone()));
                }
            }
        }
        let kv = KeyValue {
            key: key.clone(),
            value,
            mod_revision: revision,
            create_revision,
            session,
        };
        out.mutations.push(Mutation::PutKv(kv.clone()));
        out.events.push(Event {
            revision,
            kind: EventKind::Put,
            kv: kv.clone(),
        });
        self.kvs.insert(key, kv);
    }

    fn delete(&mut self, key: &str, revision: Revision, out: &mut Applied) {
        let Some(old) = self.kvs.remove(key) else {
            return;
        };
        if old.session != 0 {
            self.unbind(old.session, key, out);
        }
        out.mutations.push(Mutation::DeleteKv(key.to_string()));
        out.events.push(Event {
            revision,
            kind: EventKind::Delete,
            kv: KeyValue {
                key: key.to_string(),
                value: Vec::new(),
                mod_revision: old.mod_revision,
                create_revision: old.create_revision,
                session: old.session,
            },
        });
    }

    fn unbind(&mut self, session: SessionId, key: &str, out: &mut Applied) {
        if let Some(s) = self.sessions.get_mut(&session) {
            if s.keys.remove(key) {
                out.mutations.push(Mutation::PutSession(s.clone()));
            }
        }
    }

    fn end_session(&mut self, id: SessionId, revision: Revision, out: &mut Applied) -> u64 {
        let Some(session) = self.sessions.remove(&id) else {
            return 0;
        };
        for key in &session.keys {
            // Keys were unbound from the session as they were overwritten or deleted, so every
            // key listed here is still bound to it.
            debug_assert_eq!(self.kvs.get(key).map(|kv| kv.session), Some(id));
            if let Some(old) = self.kvs.remove(key) {
                out.mutations.push(Mutation::DeleteKv(key.clone()));
                out.events.push(Event {
                    revision,
                    kind: EventKind::Delete,
                    kv: KeyValue {
                        key: key.clone(),
                        value: Vec::new(),
                        mod_revision: old.mod_revision,
                        create_revision: old.create_revision,
                        session: id,
                    },
                });
            }
        }
        out.mutations.push(Mutation::DeleteSession(id));
        session.keys.len() as u64
    }
}

/// Does `event` match a watch on `key` (exact) or on the prefix `key`?
pub fn watch_matches(watch_key: &str, prefix: bool, event_key: &str) -> bool {
    if prefix {
        event_key.starts_with(watch_key)
    } else {
        event_key == watch_key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, value: &str) -> Op {
        Op::Put {
            key: key.into(),
            value: value.as_bytes().to_vec(),
            session: 0,
            sequential: false,
        }
    }

    fn txn(conditions: Vec<(&str, u64)>, success: Vec<Op>, failure: Vec<Op>) -> Command {
        Command::Txn {
            conditions: conditions
                .into_iter()
                .map(|(k, v)| Condition {
                    key: k.into(),
                    expected_version: v,
                })
                .collect(),
            success,
            failure,
        }
    }

    fn value(state: &KvState, key: &str) -> Option<String> {
        state
            .get(key)
            .map(|kv| String::from_utf8(kv.value.clone()).unwrap())
    }

    fn succeeded(r: &Response) -> bool {
        matches!(
            r,
            Response::Txn {
                succeeded: true,
                ..
            }
        )
    }

    #[test]
    fn given_key_when_put_with_expected_version_then_only_matching_version_writes() {
        let mut s = KvState::default();
        let (r, _) = s.apply(&txn(vec![], vec![put("/a", "1")], vec![]));
        assert!(succeeded(&r));
        let v1 = s.get("/a").unwrap().mod_revision;
        assert_eq!(v1, 1);

        // stale version: refused, current version reported, nothing changes
        let (r, applied) = s.apply(&txn(vec![("/a", 99)], vec![put("/a", "2")], vec![]));
        match r {
            Response::Txn {
                succeeded, current, ..
            } => {
                assert!(!succeeded);
                assert_eq!(current[0].expected_version, v1);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(applied.events.is_empty() && applied.mutations.is_empty());
        assert_eq!(s.revision, 1, "a failed CAS does not consume a revision");
        assert_eq!(value(&s, "/a").as_deref(), Some("1"));

        let (r, _) = s.apply(&txn(vec![("/a", v1)], vec![put("/a", "2")], vec![]));
        assert!(succeeded(&r));
        let kv = s.get("/a").unwrap();
        assert_eq!((kv.mod_revision, kv.create_revision), (2, 1));
    }

    #[test]
    fn given_existing_key_when_create_if_absent_then_refused() {
        let mut s = KvState::default();
        assert!(succeeded(
            &s.apply(&txn(vec![("/x", 0)], vec![put("/x", "a")], vec![]))
                .0
        ));
        assert!(!succeeded(
            &s.apply(&txn(vec![("/x", 0)], vec![put("/x", "b")], vec![]))
                .0
        ));
        assert_eq!(value(&s, "/x").as_deref(), Some("a"));
    }

    #[test]
    fn given_txn_when_conditions_fail_then_failure_branch_applies_all_or_nothing() {
        let mut s = KvState::default();
        s.apply(&txn(vec![], vec![put("/a", "1"), put("/b", "1")], vec![]));
        let (r, applied) = s.apply(&txn(
            vec![("/a", 1), ("/b", 7)],
            vec![put("/a", "S"), put("/b", "S")],
            vec![put("/c", "F")],
        ));
        assert!(!succeeded(&r));
        assert_eq!(value(&s, "/a").as_deref(), Some("1"));
        assert_eq!(value(&s, "/c").as_deref(), Some("F"));
        assert_eq!(applied.events.len(), 1);
        // Both puts of one txn share one revision.
        let (_, applied) = s.apply(&txn(vec![], vec![put("/p", "1"), put("/q", "1")], vec![]));
        let revs: Vec<u64> = applied.events.iter().map(|e| e.revision).collect();
        assert_eq!(revs, vec![3, 3]);
    }

    #[test]
    fn given_put_bound_to_missing_session_then_whole_txn_rejected() {
        let mut s = KvState::default();
        let (r, applied) = s.apply(&txn(
            vec![],
            vec![
                put("/ok", "1"),
                Op::Put {
                    key: "/eph".into(),
                    value: vec![],
                    session: 42,
                    sequential: false,
                },
            ],
            vec![],
        ));
        assert!(matches!(r, Response::Rejected { .. }), "{r:?}");
        assert!(s.kvs.is_empty() && applied.mutations.is_empty());
    }

    #[test]
    fn given_session_with_ephemeral_keys_when_expired_then_keys_deleted_with_events() {
        let mut s = KvState::default();
        let Response::SessionCreated { id, .. } =
            s.apply(&Command::CreateSession { ttl_ms: 500 }).0
        else {
            panic!()
        };
        let eph = |k: &str| Op::Put {
            key: k.into(),
            value: b"e".to_vec(),
            session: id,
            sequential: false,
        };
        s.apply(&txn(
            vec![],
            vec![eph("/e/1"), eph("/e/2"), put("/p", "1")],
            vec![],
        ));
        // Overwriting an ephemeral key with a persistent one unbinds it from the session.
        s.apply(&txn(vec![], vec![put("/e/2", "now persistent")], vec![]));
        assert_eq!(s.sessions[&id].keys.len(), 1);

        let (r, applied) = s.apply(&Command::ExpireSession { id });
        assert_eq!(r, Response::SessionEnded { deleted_keys: 1 });
        assert!(s.get("/e/1").is_none());
        assert!(s.get("/e/2").is_some() && s.get("/p").is_some());
        let deleted: Vec<_> = applied
            .events
            .iter()
            .map(|e| (e.kind, e.kv.key.as_str()))
            .collect();
        assert_eq!(deleted, vec![(EventKind::Delete, "/e/1")]);
        assert!(applied.mutations.contains(&Mutation::DeleteSession(id)));
        // Expiring twice is refused, not an error of the state machine.
        assert!(matches!(
            s.apply(&Command::ExpireSession { id }).0,
            Response::Rejected { .. }
        ));
    }

    #[test]
    fn given_sequential_puts_then_suffixes_are_monotonic_and_fixed_width() {
        let mut s = KvState::default();
        let seq = Op::Put {
            key: "/ids/ledger-".into(),
            value: vec![],
            session: 0,
            sequential: true,
        };
        let mut keys = Vec::new();
        for _ in 0..3 {
            let (r, _) = s.apply(&txn(vec![], vec![seq.clone()], vec![]));
            let Response::Txn { results, .. } = r else {
                panic!()
            };
            keys.push(results[0].key.clone());
        }
        assert_eq!(keys[0], "/ids/ledger-00000000000000000001");
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert_eq!(s.range("/ids/", "", 10).0.len(), 3);
    }

    #[test]
    fn given_keys_then_range_and_children_are_ordered_limited_and_paged() {
        let mut s = KvState::default();
        let keys = [
            "/a/x",
            "/a/x-1",
            "/a/x/deep/er",
            "/a/y/1",
            "/a/y/2",
            "/ab",
            "/b",
        ];
        s.apply(&txn(
            vec![],
            keys.iter().map(|k| put(k, "v")).collect(),
            vec![],
        ));

        let (kvs, more) = s.range("/a/", "", 2);
        let names: Vec<_> = kvs.iter().map(|kv| kv.key.as_str()).collect();
        assert_eq!((names, more), (vec!["/a/x", "/a/x-1"], true));
        let (kvs, more) = s.range("/a/", "/a/x-1", 10);
        assert_eq!(kvs.len(), 3);
        assert!(!more);

        assert_eq!(
            s.children("/a", "", 10),
            (vec!["x".into(), "x-1".into(), "y".into()], false)
        );
        assert_eq!(s.children("/a", "", 1), (vec!["x".into()], true));
        assert_eq!(s.children("/a", "x", 1), (vec!["x-1".into()], true));
        assert_eq!(s.children("/a", "x-1", 5), (vec!["y".into()], false));
        assert_eq!(s.children("/a", "", 0), (vec![], true));
        assert_eq!(
            s.children("/", "", 10),
            (vec!["a".into(), "ab".into(), "b".into()], false)
        );
        // A child that only exists through deeper keys still sorts first.
        let mut s = KvState::default();
        s.apply(&txn(
            vec![],
            vec![put("/r/x-1", "v"), put("/r/x/z", "v")],
            vec![],
        ));
        assert_eq!(s.children("/r", "", 1), (vec!["x".into()], true));
    }

    #[test]
    fn given_prefix_delete_then_every_key_under_it_goes_in_one_revision() {
        let mut s = KvState::default();
        s.apply(&txn(
            vec![],
            vec![put("/t/1", "v"), put("/t/2", "v"), put("/u", "v")],
            vec![],
        ));
        let (r, applied) = s.apply(&txn(
            vec![],
            vec![Op::Delete {
                key: "/t/".into(),
                prefix: true,
            }],
            vec![],
        ));
        let Response::Txn {
            results, revision, ..
        } = r
        else {
            panic!()
        };
        assert_eq!(results[0].deleted, 2);
        assert_eq!(revision, 2);
        assert_eq!(applied.events.len(), 2);
        assert_eq!(s.kvs.len(), 1);
        // Deleting nothing changes nothing, not even the revision.
        let (_, applied) = s.apply(&txn(
            vec![],
            vec![Op::Delete {
                key: "/nothing".into(),
                prefix: false,
            }],
            vec![],
        ));
        assert!(applied.events.is_empty());
        assert_eq!(s.revision, 2);
    }

    #[test]
    fn given_batch_then_each_command_applies_as_if_alone() {
        let mut alone = KvState::default();
        let cmds = vec![
            txn(vec![], vec![put("/a", "1")], vec![]),
            txn(vec![("/a", 1)], vec![put("/a", "2")], vec![]),
            txn(vec![("/a", 1)], vec![put("/a", "stale")], vec![]),
            Command::CreateSession { ttl_ms: 100 },
        ];
        let expected: Vec<Response> = cmds.iter().map(|c| alone.apply(c).0).collect();
        let mut batched = KvState::default();
        let (r, applied) = batched.apply(&Command::Batch(cmds));
        assert_eq!(r, Response::Batch(expected));
        assert_eq!(batched, alone);
        assert_eq!(applied.events.len(), 2);
    }

    #[test]
    fn key_validation_names_the_problem() {
        assert!(validate_key("/a/b", 16).is_ok());
        for (key, needle) in [
            ("a/b", "must start with '/'"),
            ("/a/", "must not end with '/'"),
            ("/a//b", "empty segment"),
            ("/a\0", "control character"),
            ("/0123456789abcdef", "metadata.key_bytes_max"),
        ] {
            let err = validate_key(key, 16).unwrap_err();
            assert!(err.contains(needle), "{key:?}: {err}");
        }
        assert!(validate_prefix("/", 16).is_ok());
        assert!(validate_prefix("/a/", 16).is_ok());
        assert!(validate_prefix("a", 16).is_err());
    }

    #[test]
    fn watch_matching() {
        assert!(watch_matches("/a/", true, "/a/b"));
        assert!(!watch_matches("/a/", true, "/ab"));
        assert!(watch_matches("/a", false, "/a"));
        assert!(!watch_matches("/a", false, "/a/b"));
    }
}
