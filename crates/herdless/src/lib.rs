//! herdless: a job-token service for build tools.
//!
//! A broker owns a pool of job tokens and hands each one to exactly one
//! waiting client, so exactly one process wakes per token. See
//! `docs/ARCHITECTURE.md` for how the parts fit, `docs/PROTOCOL.md` for the
//! wire format and the README for the command line.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod backing;
pub mod bridge;
pub mod broker;
pub mod classic;
pub mod client;
pub mod error;
pub mod fast;
pub mod log;
pub mod pool;
pub mod protocol;
pub mod rundir;
pub mod stats;
pub mod status;
mod sync;

pub use client::{Client, Connecting, Token};
