//! Any bytes as a ledger's metadata record: refused with a reason, or a record every reader of
//! it can use (each entry's fragment has a bookie for every index of its write set, and the
//! key decodes).
//! Run: `scripts/fuzz storage ledger_metadata` (seeds in `corpus/ledger_metadata`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::ledger::LedgerMetadata;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = LedgerMetadata::decode(data) else {
        return;
    };
    let q = m.quorums().expect("decode checked the quorums");
    let last = m.fragments.last().map_or(0, |f| f.first_entry);
    for entry in [
        0,
        1,
        last.saturating_sub(1),
        last,
        last.saturating_add(1),
        u64::MAX,
    ] {
        let f = m.fragment_of(entry);
        for i in q.write_set(entry) {
            assert!(i < f.ensemble.len(), "write set index {i} of entry {entry}");
        }
    }
    assert_eq!(m.key_bytes().len(), m.master_key.len() / 2);
});
