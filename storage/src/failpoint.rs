//! Fail points for tests: [`arm`] makes [`hit`] true once at a named point (its name carries
//! what it applies to, such as one managed ledger's name, so tests running at once in one
//! process do not meet each other's). A process started with
//! `MERIDIAN_TEST_FAILPOINTS=name[,name...]` (as a broker's fail points are armed) has those
//! armed once each from the start. Nothing is armed in production, where [`hit`] is one look
//! at an empty list on paths that are not per entry.

use std::sync::{Mutex, MutexGuard};

static ARMED: Mutex<Option<Vec<String>>> = Mutex::new(None);

fn armed() -> MutexGuard<'static, Option<Vec<String>>> {
    let mut armed = ARMED.lock().expect("fail points");
    armed.get_or_insert_with(from_env);
    armed
}

/// The fail points named in `MERIDIAN_TEST_FAILPOINTS` (`name[,name...]`; none when unset),
/// for this crate's and the broker's.
pub fn from_env() -> Vec<String> {
    std::env::var("MERIDIAN_TEST_FAILPOINTS")
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Arms `point` for one hit.
pub fn arm(point: &str) {
    armed()
        .as_mut()
        .expect("initialized")
        .push(point.to_string());
}

/// Whether `point` is armed; disarms it.
pub(crate) fn hit(point: &str) -> bool {
    let mut guard = armed();
    let armed = guard.as_mut().expect("initialized");
    let Some(i) = armed.iter().position(|p| p == point) else {
        return false;
    };
    armed.remove(i);
    tracing::warn!(fail_point = point, "fail point hit");
    true
}
