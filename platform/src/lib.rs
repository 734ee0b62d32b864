//! Kernel-facing parts of herdless.
