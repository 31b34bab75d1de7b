//! Any bytes as a managed ledger's record: refused with a reason, or a record whose ledgers
//! ascend, whose only open ledger is the last, and that encodes and decodes to itself.
//! Run: `scripts/fuzz storage managed_ledger_metadata`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::managed_ledger::ManagedLedgerMetadata;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = ManagedLedgerMetadata::decode(data) else {
        return;
    };
    assert!(m
        .ledgers
        .windows(2)
        .all(|w| w[0].ledger_id < w[1].ledger_id));
    let again = serde_json::to_vec(&m).expect("encodes");
    assert_eq!(
        ManagedLedgerMetadata::decode(&again).expect("decodes again"),
        m
    );
});
