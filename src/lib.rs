//! herdless
