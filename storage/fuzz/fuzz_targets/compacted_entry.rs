//! Any bytes as an entry of a compacted ledger: refused with a reason, or an entry that
//! encodes back to the same bytes.
//! Run: `scripts/fuzz storage compacted_entry`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::compacted::CompactedEntry;

fuzz_target!(|data: &[u8]| {
    let Ok(e) = CompactedEntry::decode(bytes::Bytes::copy_from_slice(data)) else {
        return;
    };
    assert_eq!(&e.encode()[..], data);
});
