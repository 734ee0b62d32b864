//! Locks that survive a panic elsewhere.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data as it is when another thread panicked while
/// holding it: every structure kept under these locks stays consistent
/// between statements, and a client must go on giving tokens back.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
