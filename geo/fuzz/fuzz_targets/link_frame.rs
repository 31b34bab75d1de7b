#![no_main]
//! Any bytes on a link stream: frames decode or are refused, never a panic, and every frame
//! decoded encodes back to the bytes it came from.
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use meridian_geo::frame::Frame;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((frame, used))) = Frame::decode(rest, 64 * 1024) {
        let mut again = BytesMut::new();
        frame.encode(&mut again);
        assert_eq!(&again[..], &rest[..used]);
        rest = &rest[used..];
    }
});
