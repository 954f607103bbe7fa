#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ubc_fuzz::spec_case(data));
