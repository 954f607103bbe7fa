#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ubc_fuzz::aead_case(data));
