//! Fail points for crash tests: `MERIDIAN_TEST_FAILPOINTS=name[,name...]` in a broker's
//! environment makes [`hit`] true at those points (the caller then fails as if it had
//! crashed there). Unset, as in production, nothing ever fails.

use std::sync::OnceLock;

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(meridian_storage::failpoint::from_env)
}

/// Whether the fail point `name` is armed.
pub fn hit(name: &str) -> bool {
    let on = armed().iter().any(|a| a == name);
    if on {
        tracing::warn!(fail_point = name, "fail point hit");
    }
    on
}
