//! Arbitrary management API requests (protobuf messages) against a live pool.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ferrovol::fuzzing::management(data));
