//! Any bytes as a page of a bookie's entry index: `records` refuses it or lists each slot once
//! in order, `find` agrees with it for every slot, and what `salvage` keeps is always a page
//! `records` accepts.
//! Run: `scripts/fuzz storage index_page`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::bookie::index;

fuzz_target!(|data: &[u8]| {
    let _ = index::parse_key(data);
    let salvaged = index::salvage(data);
    let kept = index::records(&salvaged).expect("a salvaged page is sound");
    if let Ok(records) = index::records(data) {
        assert_eq!(records, kept, "a sound page salvages to itself");
        for slot in 0..index::PAGE_ENTRIES as u16 {
            let want = records.iter().find(|(s, _)| *s == slot).map(|(_, l)| *l);
            assert_eq!(index::find(data, slot).expect("a sound page"), want);
        }
    }
});
