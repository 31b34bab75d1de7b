//! Any bytes as a journal file: replay keeps whole, verified records only and never panics.
//! Run: `scripts/fuzz storage journal_file`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::journal;

fuzz_target!(|data: &[u8]| {
    let d = journal::decode_file(1, data);
    assert!(d.end as usize <= data.len().max(16));
});
