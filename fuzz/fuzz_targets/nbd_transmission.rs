//! Arbitrary transmission-phase requests after a valid handshake (structured replies,
//! base:allocation) to a 1 MiB in-memory export.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nbd::testing::fuzz_transmission(data));
