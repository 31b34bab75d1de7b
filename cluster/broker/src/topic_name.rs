//! Topic names as clients send them, normalised to `persistent://tenant/namespace/local`.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Domain {
    Persistent,
    NonPersistent,
}

/// A full topic name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TopicName {
    pub domain: Domain,
    pub tenant: String,
    pub namespace: String,
    pub local: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid topic name {name:?}: {reason}")]
pub struct TopicNameError {
    pub name: String,
    pub reason: String,
}

const NAME_BYTES_MAX: usize = 512;

fn check_part(name: &str, what: &str, part: &str) -> Result<(), TopicNameError> {
    let bad = |reason: String| TopicNameError {
        name: name.to_string(),
        reason,
    };
    if part.is_empty() {
        return Err(bad(format!("empty {what}")));
    }
    if what != "topic" {
        // Tenants and namespaces: letters, digits and - _ . = :
        if let Some(c) = part
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "-_.=:".contains(*c)))
        {
            return Err(bad(format!(
                "{what} {part:?} has {c:?}; allowed are letters, digits and - _ . = :"
            )));
        }
    } else if let Some(c) = part.chars().find(|c| c.is_control()) {
        return Err(bad(format!("topic {part:?} has a control character {c:?}")));
    }
    Ok(())
}

impl TopicName {
    /// Parses a name in any form clients send: `x` (public/default), `t/n/x`, or a full
    /// `persistent://t/n/x` / `non-persistent://t/n/x`.
    pub fn parse(name: &str) -> Result<TopicName, TopicNameError> {
        let bad = |reason: &str| TopicNameError {
            name: name.to_string(),
            reason: reason.to_string(),
        };
        if name.len() > NAME_BYTES_MAX {
            return Err(bad(&format!("longer than {NAME_BYTES_MAX} bytes")));
        }
        let (domain, rest, full) = if let Some(r) = name.strip_prefix("persistent://") {
            (Domain::Persistent, r, true)
        } else if let Some(r) = name.strip_prefix("non-persistent://") {
            (Domain::NonPersistent, r, true)
        } else if name.contains("://") {
            return Err(bad("the domain must be persistent:// or non-persistent://"));
        } else {
            (Domain::Persistent, name, false)
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let (tenant, namespace, local) = match (full, parts.as_slice()) {
            (false, [local]) => ("public", "default", *local),
            (_, [t, n, local]) => (*t, *n, *local),
            (true, _) => return Err(bad("expected persistent://tenant/namespace/topic")),
            (false, _) => return Err(bad("expected topic or tenant/namespace/topic")),
        };
        check_part(name, "tenant", tenant)?;
        check_part(name, "namespace", namespace)?;
        check_part(name, "topic", local)?;
        // The limit holds for the full form too: a short name whose full form is longer was
        // taken, and then its own full name (in admin calls, stats, replication) was refused.
        let full_len = match domain {
            Domain::Persistent => "persistent://".len(),
            Domain::NonPersistent => "non-persistent://".len(),
        } + tenant.len()
            + namespace.len()
            + local.len()
            + 2;
        if full_len > NAME_BYTES_MAX {
            return Err(bad(&format!(
                "longer than {NAME_BYTES_MAX} bytes as a full name ({full_len})"
            )));
        }
        Ok(TopicName {
            domain,
            tenant: tenant.to_string(),
            namespace: namespace.to_string(),
            local: local.to_string(),
        })
    }

    pub fn namespace(&self) -> String {
        format!("{}/{}", self.tenant, self.namespace)
    }

    /// The managed ledger holding the topic: `tenant/namespace/persistent/local`, with `/` and
    /// `%` of the local name escaped so the name stays four segments.
    pub fn managed_ledger_name(&self) -> String {
        format!(
            "{}/{}/persistent/{}",
            self.tenant,
            self.namespace,
            escape(&self.local)
        )
    }

    /// The partition index if the local name ends in `-partition-N`.
    pub fn partition(&self) -> Option<u32> {
        let (_, n) = self.local.rsplit_once("-partition-")?;
        // Digits only, without leading zeros: `-partition-01` and `-partition-+1` are not
        // partitions' names.
        if n.is_empty()
            || !n.bytes().all(|b| b.is_ascii_digit())
            || (n.len() > 1 && n.starts_with('0'))
        {
            return None;
        }
        n.parse().ok()
    }

    /// The partitioned topic a partition belongs to (`x` for `x-partition-3`).
    pub fn parent(&self) -> Option<TopicName> {
        self.partition()?;
        let (base, _) = self.local.rsplit_once("-partition-")?;
        Some(TopicName {
            local: base.to_string(),
            ..self.clone()
        })
    }

    /// Partition `i` of this topic.
    pub fn partition_name(&self, i: u32) -> TopicName {
        TopicName {
            local: format!("{}-partition-{i}", self.local),
            ..self.clone()
        }
    }
}

/// Escapes `%` and `/` (and nothing else), so names map one to one.
pub fn escape(s: &str) -> String {
    s.replace('%', "%25").replace('/', "%2F")
}

/// The inverse of [`escape`].
pub fn unescape(s: &str) -> String {
    s.replace("%2F", "/").replace("%25", "%")
}

impl fmt::Display for TopicName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = match self.domain {
            Domain::Persistent => "persistent",
            Domain::NonPersistent => "non-persistent",
        };
        write!(f, "{d}://{}/{}/{}", self.tenant, self.namespace, self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `topic_name` fuzz target: a short name under the limit whose full form
    /// is over it was taken, and its full form then refused.
    #[test]
    fn given_a_short_name_whose_full_form_is_too_long_then_it_is_refused() {
        let local = "x".repeat(NAME_BYTES_MAX - "persistent://public/default/".len() + 1);
        let e = TopicName::parse(&local).unwrap_err();
        assert!(e.reason.contains("as a full name"), "{e}");
        let fits = &local[1..];
        let t = TopicName::parse(fits).unwrap();
        assert_eq!(TopicName::parse(&t.to_string()).unwrap(), t);
    }

    #[test]
    fn given_short_and_full_forms_then_names_normalise() {
        for (input, full) in [
            ("orders", "persistent://public/default/orders"),
            ("acme/eu/orders", "persistent://acme/eu/orders"),
            ("persistent://acme/eu/orders", "persistent://acme/eu/orders"),
            ("non-persistent://acme/eu/o", "non-persistent://acme/eu/o"),
            (
                "t-1/ns.2/x-partition-3",
                "persistent://t-1/ns.2/x-partition-3",
            ),
        ] {
            assert_eq!(TopicName::parse(input).unwrap().to_string(), full);
        }
        let t = TopicName::parse("a/b/x-partition-3").unwrap();
        assert_eq!(t.partition(), Some(3));
        assert_eq!(t.managed_ledger_name(), "a/b/persistent/x-partition-3");
    }

    #[test]
    fn given_names_with_slashes_and_percents_then_escape_round_trips() {
        for n in ["a/b", "50%", "%2F", "x"] {
            assert_eq!(unescape(&escape(n)), n);
        }
    }

    #[test]
    fn given_partition_names_then_parent_and_index_are_found() {
        let t = TopicName::parse("t/n/orders-partition-3").unwrap();
        assert_eq!(t.partition(), Some(3));
        assert_eq!(t.parent().unwrap().to_string(), "persistent://t/n/orders");
        let p = TopicName::parse("orders").unwrap();
        assert_eq!(p.partition(), None);
        assert!(p.parent().is_none());
        assert_eq!(
            p.partition_name(0).to_string(),
            "persistent://public/default/orders-partition-0"
        );
        assert_eq!(
            TopicName::parse("x-partition-01").unwrap().partition(),
            None
        );
        assert_eq!(TopicName::parse("x-partition-").unwrap().partition(), None);
        assert_eq!(
            TopicName::parse("x-partition-+1").unwrap().partition(),
            None
        );
    }

    #[test]
    fn given_bad_names_then_errors_say_what_is_wrong() {
        for (input, says) in [
            ("", "empty topic"),
            ("a/b", "expected topic or tenant/namespace/topic"),
            (
                "persistent://a/b",
                "expected persistent://tenant/namespace/topic",
            ),
            ("http://a/b/c", "domain"),
            ("a b/ns/x", "tenant \"a b\" has ' '"),
            ("a//x", "empty namespace"),
            ("persistent://a/b/c/d", "expected"),
        ] {
            let e = TopicName::parse(input).unwrap_err().to_string();
            assert!(e.contains(says), "{input:?}: {e}");
        }
        assert!(TopicName::parse(&"x".repeat(600)).is_err());
    }
}
