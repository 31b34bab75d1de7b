//! Fail points for tests: [`arm`] makes [`hit`] true once at a named point (its name carries
//! what it applies to, such as one managed ledger's name, so tests running at once in one
//! process do not meet each other's). Nothing is armed in production, where [`hit`] is one
//! look at an empty list on paths that are not per entry.

use std::sync::Mutex;

static ARMED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Arms `point` for one hit.
pub fn arm(point: &str) {
    ARMED.lock().expect("fail points").push(point.to_string());
}

/// Whether `point` is armed; disarms it.
pub(crate) fn hit(point: &str) -> bool {
    let mut armed = ARMED.lock().expect("fail points");
    let Some(i) = armed.iter().position(|p| p == point) else {
        return false;
    };
    armed.remove(i);
    tracing::warn!(fail_point = point, "fail point hit");
    true
}
