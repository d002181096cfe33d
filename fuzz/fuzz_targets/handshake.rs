//! Fuzz target: see `kvxfer::fuzzing::handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvxfer::fuzzing::handshake(data));
