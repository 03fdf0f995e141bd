//! The config parsers on arbitrary text: an error, never a panic.
#![no_main]

use amp::levels::AmpConfig;
use amp::{CurrentScaling, DelayedScaling};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = AmpConfig::from_json(text);
        let _ = AmpConfig::from_toml(text);
        let _ = DelayedScaling::from_json(text);
        let _ = DelayedScaling::from_toml(text);
        let _ = CurrentScaling::from_json(text);
    }
});
