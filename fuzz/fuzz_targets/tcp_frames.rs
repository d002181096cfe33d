//! Fuzz target: see `kvxfer::fuzzing::tcp_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvxfer::fuzzing::tcp_frames(data));
