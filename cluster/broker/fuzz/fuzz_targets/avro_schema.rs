//! Any two texts as Avro schemas (a producer's and a registered one): each parses or is
//! refused, and the compatibility check between them ends, either way round, without a panic.
//! Run: `scripts/fuzz cluster/broker avro_schema`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_broker::broker::avro;

fuzz_target!(|data: &[u8]| {
    // The two schemas, split at the first NUL byte (or the same text twice).
    let (a, b) = match data.iter().position(|&c| c == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, data),
    };
    let (Ok(a), Ok(b)) = (avro::parse(a), avro::parse(b)) else {
        return;
    };
    let _ = avro::can_read(&a, &b);
    let _ = avro::can_read(&b, &a);
    avro::can_read(&a, &a).expect("a schema reads its own data");
});
