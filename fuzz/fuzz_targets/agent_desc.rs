//! Fuzz target: see `kvxfer::fuzzing::agent_desc`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvxfer::fuzzing::agent_desc(data));
