//! Fuzz target: see `kvxfer::fuzzing::kv_wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvxfer::fuzzing::kv_wire(data));
