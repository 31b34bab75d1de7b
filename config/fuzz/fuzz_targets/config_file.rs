//! Any bytes as a configuration file: loaded or refused with an error, never a panic.
//! Run (stable toolchain, hence no sanitizer):
//! `cd config && cargo fuzz run --sanitizer none config_file -- -max_total_time=60`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = meridian_config::Config::from_toml_str(text, "fuzz.toml") {
            assert!(!e.to_string().is_empty());
        }
    }
});
