//! herdless: a job-token service for build tools.
//!
//! A broker owns a pool of job tokens and hands each one to exactly one
//! waiting client, so exactly one process wakes per token. See
//! `docs/PROTOCOL.md` for the wire format and the README for the command
//! line.
#![deny(unsafe_code)]

pub mod bench;
pub mod bridge;
pub mod broker;
pub mod classic;
pub mod client;
#[allow(unsafe_code)]
pub mod ffi;
pub mod log;
pub mod pool;
pub mod protocol;
pub mod rundir;
pub mod stats;

pub use client::{Client, Token};
