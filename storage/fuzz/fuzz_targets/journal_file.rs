//! Any bytes as a journal file: replay keeps whole, verified records only and never panics.
//! Run: `cd storage && cargo fuzz run --sanitizer none journal_file -- -max_total_time=60`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::journal;

fuzz_target!(|data: &[u8]| {
    let d = journal::decode_file(1, data);
    assert!(d.end as usize <= data.len().max(16));
});
