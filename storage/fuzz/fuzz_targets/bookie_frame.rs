//! Any bytes as a bookie connection's input: frames decode or the stream is refused with an
//! error, never a panic, and whatever decodes encodes back to the same bytes.
//! Run: `scripts/fuzz storage bookie_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_storage::proto;

fuzz_target!(|data: &[u8]| {
    let mut buf = bytes::BytesMut::from(data);
    loop {
        let before = buf.clone();
        match proto::decode(&mut buf, 1 << 16) {
            Ok(Some(frame)) => {
                let mut again = Vec::new();
                proto::encode(&frame, &mut again);
                assert_eq!(&again[..], &before[..again.len()], "re-encoding differs");
            }
            Ok(None) | Err(_) => break,
        }
    }
    let _ = proto::open(&bytes::Bytes::copy_from_slice(data));
});
