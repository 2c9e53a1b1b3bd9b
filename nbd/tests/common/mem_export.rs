//! The in-memory export the protocol tests serve (it lives in `nbd::testing`).
#![allow(unused_imports)]

pub use nbd::testing::*;
