#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ubc_fuzz::zstd_case(data));
