//! Any text as a topic name from a client: refused with a reason, or a name whose full form
//! parses to the same name, whose managed-ledger name unescapes back to its local name, and
//! whose partition arithmetic holds.
//! Run: `scripts/fuzz cluster/broker topic_name`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_broker::topic_name::{unescape, TopicName};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(t) = TopicName::parse(text) else {
        return;
    };
    let again = TopicName::parse(&t.to_string()).expect("a parsed name's full form parses");
    assert_eq!(again, t);
    let ml = t.managed_ledger_name();
    let local = ml.splitn(4, '/').nth(3).expect("four segments");
    assert_eq!(unescape(local), t.local);
    if let Some(i) = t.partition() {
        let parent = t.parent().expect("a partition has a parent");
        assert_eq!(parent.partition_name(i), t);
    }
});
