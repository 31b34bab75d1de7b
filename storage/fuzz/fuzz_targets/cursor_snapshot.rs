//! Any bytes as a cursor's snapshot entry: refused, or a snapshot whose encoding decodes to
//! the same snapshot.
//! Run: `scripts/fuzz storage cursor_snapshot`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::cursor::CursorSnapshot;

fuzz_target!(|data: &[u8]| {
    let Some(s) = CursorSnapshot::decode(data) else {
        return;
    };
    let again = CursorSnapshot::decode(&s.encode()).expect("its own encoding decodes");
    assert_eq!(again, s);
});
