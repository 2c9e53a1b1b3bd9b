//! Arbitrary client bytes from the first byte of a connection: client flags, option
//! haggling, and requests if an export is entered.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nbd::testing::fuzz_handshake(data));
