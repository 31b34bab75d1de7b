//! A linearizability checker for the metadata store's keys used as registers with
//! compare-and-set: the search of Wing and Gong with Lowe's memoization (as Knossos and
//! Porcupine do it), one key's history at a time (a key is a register of its own, so the
//! whole history is linearizable when each key's is).
//!
//! Values written are unique, so a value names the write that made it. The store's versions
//! are its revisions (not predictable by a model), so the version of each value is taken
//! from what clients saw: the version a put answered, or the one a read returned with the
//! value. A value seen with two versions is a violation by itself (a write applied twice).
//! Revisions only grow, so writes whose versions are known take effect in the order of their
//! versions; a value whose version nobody saw may match any version no other value has.

use std::collections::{HashMap, HashSet};

/// What a client asked of one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write(String),
    /// Put `value` if the key's version is `expected` (0: the key is absent).
    Cas {
        expected: u64,
        value: String,
    },
}

/// What the client learnt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A read: the value and its version, or none.
    Read(Option<(String, u64)>),
    /// A write or compare-and-set applied, at this version.
    Written(u64),
    /// A compare-and-set refused: the key's version (0: absent) was this, not the one
    /// expected.
    CasFailed(u64),
    /// No answer (timeout, connection lost): applied or not, at some time after the call.
    Unknown,
}

/// One operation of the history. Times are nanoseconds on one clock.
#[derive(Clone, Debug)]
pub struct Call {
    pub client: usize,
    pub op: Op,
    pub outcome: Outcome,
    pub invoked: u64,
    /// `None` for an unknown outcome: it may take effect until the end of the history.
    pub completed: Option<u64>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        let end = match self.completed {
            Some(c) => format!("{:.3}", ms(c)),
            None => "never".to_string(),
        };
        write!(
            f,
            "client {} [{:.3} .. {end} ms] {:?} -> {:?}",
            self.client,
            ms(self.invoked),
            self.op,
            self.outcome
        )
    }
}

/// Why a key's history is not linearizable.
#[derive(Debug)]
pub struct Violation {
    pub what: String,
    /// The search gave up (its budget of states spent): neither shown linearizable nor not.
    pub inconclusive: bool,
    /// The operations that show it: the one no order could place, with those overlapping it
    /// and the last ones placed before it.
    pub excerpt: Vec<Call>,
}

/// The register's state after the operations placed so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct State {
    /// The value (an index into the history's values) and its version (`None`: a version no
    /// client saw); `None` while the key is absent.
    current: Option<(usize, Option<u64>)>,
    /// The highest known version placed: a later write's known version is above it.
    floor: u64,
}

/// States the search may remember before it gives up (inconclusive).
const STATES_MAX: usize = 2_000_000;

/// Checks one key's history. Reads and failed compare-and-sets must be explained by the
/// writes; writes with unknown outcomes may be placed anywhere after their call, or left out.
pub fn check(calls: &[Call]) -> Result<(), Violation> {
    let (values, versions) = value_versions(calls)?;
    let known = versions.iter().flatten().copied().collect();
    let model = Model {
        calls,
        values: &values,
        versions: &versions,
        known: &known,
    };
    search(&model)
}

/// Every value written, and the version each was seen with (a value never seen has none).
#[allow(clippy::type_complexity)]
fn value_versions(calls: &[Call]) -> Result<(HashMap<&str, usize>, Vec<Option<u64>>), Violation> {
    let mut values: HashMap<&str, usize> = HashMap::new();
    for c in calls {
        if let Op::Write(v) | Op::Cas { value: v, .. } = &c.op {
            if values.insert(v.as_str(), values.len()).is_some() {
                return Err(Violation {
                    inconclusive: false,
                    what: format!("value {v:?} written twice: the history is not usable"),
                    excerpt: vec![c.clone()],
                });
            }
        }
    }
    let mut versions: Vec<Option<u64>> = vec![None; values.len()];
    let mut seen_at: Vec<Option<&Call>> = vec![None; values.len()];
    for c in calls {
        let (value, version) = match (&c.op, &c.outcome) {
            (Op::Write(v) | Op::Cas { value: v, .. }, Outcome::Written(ver)) => (v, *ver),
            (_, Outcome::Read(Some((v, ver)))) => (v, *ver),
            _ => continue,
        };
        let Some(&i) = values.get(value.as_str()) else {
            return Err(Violation {
                inconclusive: false,
                what: format!("read {value:?}, which no client wrote"),
                excerpt: vec![c.clone()],
            });
        };
        match versions[i] {
            Some(known) if known != version => {
                return Err(Violation {
                    inconclusive: false,
                    what: format!("value {value:?} seen at versions {known} and {version}"),
                    excerpt: vec![seen_at[i].cloned().unwrap_or_else(|| c.clone()), c.clone()],
                })
            }
            _ => {
                versions[i] = Some(version);
                seen_at[i] = Some(c);
            }
        }
    }
    Ok((values, versions))
}

struct Model<'a> {
    calls: &'a [Call],
    values: &'a HashMap<&'a str, usize>,
    versions: &'a [Option<u64>],
    /// Every version some value was seen with.
    known: &'a HashSet<u64>,
}

impl Model<'_> {
    fn value(&self, v: &str) -> usize {
        self.values[v]
    }

    /// Whether the key's version in `state` can be `v` (0: absent). A value whose version
    /// nobody saw can have any version above the floor that no other value has.
    fn version_is(&self, state: &State, v: u64) -> bool {
        match state.current {
            None => v == 0,
            Some((_, Some(known))) => known == v,
            Some((_, None)) => v > state.floor && !self.known.contains(&v),
        }
    }

    /// The state after `call` applied in `state`, if it can apply there.
    fn step(&self, state: State, call: &Call) -> Option<State> {
        let write = |value: &str| -> Option<State> {
            let i = self.value(value);
            let version = self.versions[i];
            match version {
                // Revisions only grow.
                Some(v) if v <= state.floor => None,
                Some(v) => Some(State {
                    current: Some((i, version)),
                    floor: v,
                }),
                None => Some(State {
                    current: Some((i, None)),
                    floor: state.floor,
                }),
            }
        };
        match (&call.op, &call.outcome) {
            (Op::Read, Outcome::Read(seen)) => {
                let fits = match (seen, state.current) {
                    (None, None) => true,
                    (Some((val, ver)), Some((i, _))) => {
                        i == self.value(val) && self.version_is(&state, *ver)
                    }
                    _ => false,
                };
                fits.then_some(state)
            }
            (Op::Write(v), Outcome::Written(_) | Outcome::Unknown) => write(v),
            (Op::Cas { expected, value }, Outcome::Written(_) | Outcome::Unknown) => {
                if self.version_is(&state, *expected) {
                    write(value)
                } else {
                    None
                }
            }
            (Op::Cas { expected, .. }, Outcome::CasFailed(current)) => {
                let fits = current != expected && self.version_is(&state, *current);
                fits.then_some(state)
            }
            // A read without an answer, or an outcome that does not fit its operation,
            // changes nothing.
            _ => Some(state),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Call,
    Return,
}

/// A doubly linked list of the history's call and return events, in time order, from which
/// placed operations are lifted out and put back as the search goes.
struct Events {
    op: Vec<usize>,
    kind: Vec<Kind>,
    next: Vec<usize>,
    prev: Vec<usize>,
    call_at: Vec<usize>,
    return_at: Vec<usize>,
}

/// The list's head, before the first event (index 0); `NIL` ends it.
const HEAD: usize = 0;
const NIL: usize = usize::MAX;

impl Events {
    fn new(calls: &[Call]) -> Self {
        // (time, calls before returns at equal times: the more lenient order, op)
        let mut evs: Vec<(u64, u8, usize)> = Vec::with_capacity(calls.len() * 2);
        for (i, c) in calls.iter().enumerate() {
            evs.push((c.invoked, 0, i));
            evs.push((c.completed.unwrap_or(u64::MAX), 1, i));
        }
        evs.sort();
        let n = evs.len() + 1;
        let mut e = Events {
            op: vec![NIL; n],
            kind: vec![Kind::Call; n],
            next: vec![NIL; n],
            prev: vec![NIL; n],
            call_at: vec![0; calls.len()],
            return_at: vec![0; calls.len()],
        };
        for (k, (_, kind, i)) in evs.into_iter().enumerate() {
            let at = k + 1;
            e.op[at] = i;
            if kind == 0 {
                e.call_at[i] = at;
            } else {
                e.kind[at] = Kind::Return;
                e.return_at[i] = at;
            }
            e.prev[at] = at - 1;
            e.next[at - 1] = at;
        }
        e
    }

    fn unlink(&mut self, at: usize) {
        let (p, n) = (self.prev[at], self.next[at]);
        self.next[p] = n;
        if n != NIL {
            self.prev[n] = p;
        }
    }

    fn relink(&mut self, at: usize) {
        let (p, n) = (self.prev[at], self.next[at]);
        self.next[p] = at;
        if n != NIL {
            self.prev[n] = at;
        }
    }

    fn lift(&mut self, op: usize) {
        self.unlink(self.call_at[op]);
        self.unlink(self.return_at[op]);
    }

    fn unlift(&mut self, op: usize) {
        self.relink(self.return_at[op]);
        self.relink(self.call_at[op]);
    }
}

fn search(model: &Model<'_>) -> Result<(), Violation> {
    let calls = model.calls;
    let mut events = Events::new(calls);
    let words = calls.len().div_ceil(64);
    let mut placed = vec![0u64; words];
    let mut seen: HashSet<(Vec<u64>, State)> = HashSet::new();
    let mut stack: Vec<(usize, State)> = Vec::new();
    let mut state = State {
        current: None,
        floor: 0,
    };
    let mut at = events.next[HEAD];
    // The deepest point reached: how many were placed, and the operation that stopped it.
    let mut deepest: (usize, usize, Vec<usize>) = (0, NIL, Vec::new());
    loop {
        if at == NIL {
            return Ok(());
        }
        let op = events.op[at];
        match events.kind[at] {
            Kind::Call => {
                let applied = model.step(state, &calls[op]);
                let mut moved = false;
                if let Some(next) = applied {
                    placed[op / 64] |= 1 << (op % 64);
                    if seen.len() >= STATES_MAX {
                        return Err(Violation {
                            what: format!(
                                "inconclusive: {STATES_MAX} states searched ({} operations placed at most)",
                                deepest.0
                            ),
                            inconclusive: true,
                            excerpt: Vec::new(),
                        });
                    }
                    if seen.insert((placed.clone(), next)) {
                        stack.push((op, state));
                        state = next;
                        events.lift(op);
                        at = events.next[HEAD];
                        moved = true;
                    } else {
                        placed[op / 64] &= !(1 << (op % 64));
                    }
                }
                if !moved {
                    at = events.next[at];
                }
            }
            Kind::Return => {
                if calls[op].completed.is_none() {
                    // Only returns at the end of time are left: every operation with a known
                    // outcome is placed.
                    return Ok(());
                }
                if stack.len() >= deepest.0 {
                    deepest = (stack.len(), op, stack.iter().map(|(o, _)| *o).collect());
                }
                let Some((last, before)) = stack.pop() else {
                    return Err(violation(calls, deepest));
                };
                state = before;
                placed[last / 64] &= !(1 << (last % 64));
                events.unlift(last);
                at = events.next[events.call_at[last]];
            }
        }
    }
}

/// The violation at the deepest point of the search: the operation that could not be placed,
/// the operations overlapping it, and the last five placed before it.
fn violation(calls: &[Call], (_, stuck, order): (usize, usize, Vec<usize>)) -> Violation {
    let s = &calls[stuck];
    let overlaps = |c: &Call| {
        c.invoked <= s.completed.unwrap_or(u64::MAX) && c.completed.unwrap_or(u64::MAX) >= s.invoked
    };
    let mut excerpt: Vec<Call> = order
        .iter()
        .rev()
        .take(5)
        .rev()
        .map(|&i| calls[i].clone())
        .collect();
    for (i, c) in calls.iter().enumerate() {
        if i != stuck && overlaps(c) && !order[order.len().saturating_sub(5)..].contains(&i) {
            excerpt.push(c.clone());
        }
    }
    excerpt.push(s.clone());
    excerpt.sort_by_key(|c| c.invoked);
    Violation {
        what: format!(
            "no order of the operations explains {s} (after {} placed)",
            order.len()
        ),
        inconclusive: false,
        excerpt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(client: usize, op: Op, outcome: Outcome, invoked: u64, completed: u64) -> Call {
        Call {
            client,
            op,
            outcome,
            invoked,
            completed: Some(completed),
        }
    }

    fn w(v: &str) -> Op {
        Op::Write(v.to_string())
    }

    fn read(v: Option<(&str, u64)>) -> Outcome {
        Outcome::Read(v.map(|(s, n)| (s.to_string(), n)))
    }

    #[test]
    fn given_sequential_writes_and_reads_then_linearizable() {
        let h = vec![
            call(0, Op::Read, read(None), 0, 1),
            call(0, w("a"), Outcome::Written(5), 2, 3),
            call(1, Op::Read, read(Some(("a", 5))), 4, 5),
            call(
                1,
                Op::Cas {
                    expected: 5,
                    value: "b".into(),
                },
                Outcome::Written(9),
                6,
                7,
            ),
            call(
                0,
                Op::Cas {
                    expected: 5,
                    value: "c".into(),
                },
                Outcome::CasFailed(9),
                8,
                9,
            ),
            call(0, Op::Read, read(Some(("b", 9))), 10, 11),
        ];
        check(&h).unwrap();
    }

    #[test]
    fn given_a_stale_read_after_a_completed_write_then_a_violation() {
        let h = vec![
            call(0, w("a"), Outcome::Written(5), 0, 1),
            call(0, w("b"), Outcome::Written(6), 2, 3),
            call(1, Op::Read, read(Some(("a", 5))), 4, 5),
        ];
        let v = check(&h).unwrap_err();
        assert!(v.what.contains("no order"), "{}", v.what);
        assert!(v.excerpt.iter().any(|c| c.op == Op::Read), "{v:?}");
    }

    #[test]
    fn given_concurrent_write_and_read_then_either_value_is_fine() {
        for seen in [None, Some(("a", 5))] {
            let h = vec![
                call(0, w("a"), Outcome::Written(5), 0, 10),
                call(1, Op::Read, read(seen), 1, 2),
            ];
            check(&h).unwrap();
        }
    }

    #[test]
    fn given_a_write_of_unknown_outcome_then_it_may_apply_late_or_never() {
        let unknown = Call {
            client: 0,
            op: w("a"),
            outcome: Outcome::Unknown,
            invoked: 0,
            completed: None,
        };
        // Seen long after its call: fine.
        let h = vec![
            unknown.clone(),
            call(1, Op::Read, read(None), 5, 6),
            call(1, Op::Read, read(Some(("a", 7))), 100, 101),
        ];
        check(&h).unwrap();
        // Never seen: fine.
        check(&[unknown.clone(), call(1, Op::Read, read(None), 5, 6)]).unwrap();
        // Seen, then gone without another write: not fine.
        let h = vec![
            unknown,
            call(1, Op::Read, read(Some(("a", 7))), 5, 6),
            call(1, Op::Read, read(None), 8, 9),
        ];
        check(&h).unwrap_err();
    }

    #[test]
    fn given_two_cas_on_one_version_both_applied_then_a_violation() {
        let cas = |v: &str| Op::Cas {
            expected: 5,
            value: v.to_string(),
        };
        let h = vec![
            call(0, w("a"), Outcome::Written(5), 0, 1),
            call(1, cas("b"), Outcome::Written(6), 2, 10),
            call(2, cas("c"), Outcome::Written(7), 3, 11),
        ];
        check(&h).unwrap_err();
    }

    #[test]
    fn given_writes_out_of_their_versions_order_then_a_violation() {
        // Two overlapping writes, then a read of the one with the lower version: b (6) was
        // applied after a (5), so a read after both cannot see a.
        let concurrent = || {
            vec![
                call(0, w("a"), Outcome::Written(5), 0, 10),
                call(1, w("b"), Outcome::Written(6), 0, 10),
            ]
        };
        let mut stale = concurrent();
        stale.push(call(2, Op::Read, read(Some(("a", 5))), 20, 21));
        check(&stale).unwrap_err();
        // A lost update: a compare-and-set on a's version after b's write applied.
        let mut lost = concurrent();
        lost.push(call(
            2,
            Op::Cas {
                expected: 5,
                value: "c".into(),
            },
            Outcome::Written(7),
            20,
            21,
        ));
        check(&lost).unwrap_err();
        // Two writes acknowledged at one version (two leaders).
        let split = vec![
            call(0, w("a"), Outcome::Written(5), 0, 1),
            call(1, w("b"), Outcome::Written(5), 2, 3),
        ];
        check(&split).unwrap_err();
    }

    #[test]
    fn given_a_conflict_naming_the_version_of_an_unseen_write_then_a_cas_on_it_fits() {
        // x's put got no answer and nobody read x, but a refused compare-and-set learnt its
        // version (8) and the next one expected it.
        let h = vec![
            Call {
                client: 0,
                op: w("x"),
                outcome: Outcome::Unknown,
                invoked: 0,
                completed: None,
            },
            call(
                1,
                Op::Cas {
                    expected: 0,
                    value: "y".into(),
                },
                Outcome::CasFailed(8),
                10,
                11,
            ),
            call(
                1,
                Op::Cas {
                    expected: 8,
                    value: "z".into(),
                },
                Outcome::Written(9),
                12,
                13,
            ),
            call(1, Op::Read, read(Some(("z", 9))), 14, 15),
        ];
        check(&h).unwrap();
    }

    #[test]
    fn given_a_value_seen_at_two_versions_then_a_violation() {
        let h = vec![
            call(0, w("a"), Outcome::Written(5), 0, 1),
            call(1, Op::Read, read(Some(("a", 8))), 2, 3),
        ];
        let v = check(&h).unwrap_err();
        assert!(v.what.contains("versions 5 and 8"), "{}", v.what);
    }

    #[test]
    fn given_many_overlapping_writes_then_the_search_finds_their_order() {
        // 300 rounds of three overlapping writes, each round's read seeing the write its
        // version puts last: linearizable (without the memo the search would try the
        // orders of every round again for each later one).
        let mut h = Vec::new();
        let mut t = 0;
        for round in 0..300u64 {
            for c in 0..3usize {
                let v = format!("{c}-{round}");
                let ver = round * 10 + c as u64 + 1;
                h.push(call(c, w(&v), Outcome::Written(ver), t + c as u64, t + 5));
            }
            t += 10;
            // The last write of the round (client 2's, applied last by its version) is read.
            let last = format!("2-{round}");
            h.push(call(
                0,
                Op::Read,
                read(Some((&last, round * 10 + 3))),
                t,
                t + 1,
            ));
            t += 2;
        }
        check(&h).unwrap();
    }
}
