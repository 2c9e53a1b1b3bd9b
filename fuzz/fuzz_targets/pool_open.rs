//! A valid pool image with arbitrary byte changes in its written blocks: `check` and
//! opening must return errors, never panic, and an opened pool must be readable.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| storage_engine::testing::fuzz_pool_open(data));
