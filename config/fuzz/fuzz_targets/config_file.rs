//! Any bytes as a configuration file: loaded or refused with an error, never a panic.
//! Run: `scripts/fuzz config config_file` (seeds in `config/fuzz/seeds/config_file`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = meridian_config::Config::from_toml_str(text, "fuzz.toml") {
            assert!(!e.to_string().is_empty());
        }
    }
});
