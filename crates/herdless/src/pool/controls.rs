//! What an operator changes while the pool runs, and what may hold a grant
//! back: the pool's size, per-subtree caps, and admission (load, memory).
//!
//! All three only ever *withhold* shared tokens; none takes a token from a
//! client that holds it:
//!
//! - **Resize.** Growing adds free tokens at once. Shrinking removes free
//!   tokens at once and *retires* the rest as their holders give them back:
//!   a released token that is owed to a shrink leaves the pool instead of
//!   going to a waiter. Shared tokens in use never exceed the new capacity
//!   once the retired ones are back.
//! - **Caps.** A cap on a process id limits the tokens held by every
//!   client whose pid is that one or has it among its ancestors (the broker
//!   tells the pool each client's ancestry), slots included. A
//!   waiter at its subtree's cap is passed over, not dropped: the next
//!   waiter that may take the token gets it, and the capped one keeps its
//!   place for later. The top command's slot (the N-th token of `-jN`)
//!   counts against a cap like a shared token, except that a subtree
//!   capped at 0 still runs one job on it; a slot lent by a job (an
//!   `exec`'s, a recipe's) is that job's own token and is never withheld.
//! - **Admission.** While admission is held (the broker's load or memory
//!   limit is crossed), no shared token is granted unless fewer than the
//!   floor (`min_jobs`) are in use, so a build always progresses.
//!
//! Slots lent by a job are never withheld: they are not drawn from the
//! pool, and the job that lends one already holds its token.
//!
//! With no cap and admission open, the pool behaves exactly as without
//! this module: FIFO, one token to the first waiter.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::{ClientId, Pool};

/// The controls' state inside a [`Pool`].
#[derive(Clone, Debug)]
pub(super) struct Controls {
    /// Shared tokens held beyond the capacity after a shrink: each one
    /// released leaves the pool.
    retiring: u32,
    /// Process id → the most shared tokens its subtree may hold.
    caps: BTreeMap<u32, u32>,
    /// Each client's ancestors (parent first), as the broker found them.
    ancestry: HashMap<ClientId, Vec<u32>>,
    /// False while a load or memory limit holds grants back.
    admission_open: bool,
    /// Shared tokens that may be in use whatever admission says.
    floor: u32,
}

impl Default for Controls {
    fn default() -> Self {
        Controls {
            retiring: 0,
            caps: BTreeMap::new(),
            ancestry: HashMap::new(),
            admission_open: true,
            floor: 0,
        }
    }
}

/// One cap, for status output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cap {
    /// The process whose subtree is capped.
    pub pid: u32,
    /// The most shared tokens the subtree may hold.
    pub max: u32,
    /// Tokens the subtree's clients hold now, slots included.
    pub held: u32,
}

impl Pool {
    /// Shared tokens held by clients now (the bridge's included), counting
    /// those a shrink still waits for.
    pub fn shared_in_use(&self) -> u32 {
        self.capacity + self.controls.retiring - self.free
    }

    /// Shared tokens a shrink still waits for: held beyond the capacity.
    pub fn retiring(&self) -> u32 {
        self.controls.retiring
    }

    /// Changes the number of shared tokens. Growing frees the new tokens
    /// and grants them to waiters at once. Shrinking removes free tokens at
    /// once and retires held ones as they come back; no holder loses one.
    pub fn resize(&mut self, capacity: u32, now: Duration) {
        if capacity >= self.capacity {
            let more = capacity - self.capacity;
            // Tokens still owed to an earlier shrink stay in the pool.
            let kept = more.min(self.controls.retiring);
            self.controls.retiring -= kept;
            self.free += more - kept;
            self.capacity = capacity;
            self.dispatch_pool(now);
        } else {
            let fewer = self.capacity - capacity;
            let at_once = fewer.min(self.free);
            self.free -= at_once;
            self.controls.retiring += fewer - at_once;
            self.capacity = capacity;
        }
    }

    /// Bounds a pool whose tokens are backed on demand (see
    /// `crate::backing`) by a new `limit`. Such a pool holds only the
    /// tokens it was given, so none is added here: above `limit` it shrinks
    /// as [`Pool::resize`] does; at or below it, the tokens an earlier
    /// shrink still waits for are kept again, as many as `limit` allows.
    /// Their holders keep them either way; what changes is that, once none
    /// is retiring, a waiter the new limit lets run is short of a shared
    /// token again ([`Pool::short_of_shared`]) and the backing adds one.
    /// Capacity plus retiring tokens never grows.
    pub fn bound_backed(&mut self, limit: u32, now: Duration) {
        let capacity = limit.min(self.capacity + self.controls.retiring);
        if capacity != self.capacity {
            self.resize(capacity, now);
        }
    }

    /// Whether a waiter that may take a shared token waits because none is
    /// free: the demand a pool whose tokens are backed on demand (see
    /// `crate::backing`) answers by adding one. False after a stop or an
    /// abort, and while a shrink still waits for tokens.
    pub fn short_of_shared(&self) -> bool {
        self.free == 0
            && self.controls.retiring == 0
            && self.aborted.is_none()
            && !self.stopped
            && self.first_eligible().is_some()
    }

    /// Removes every free shared token from the pool (the capacity shrinks
    /// by as many) and returns how many: tokens a backed pool gives back
    /// to where they came from as soon as nobody here may take them.
    pub fn give_up_free(&mut self) -> u32 {
        let n = self.free;
        self.free = 0;
        self.capacity -= n;
        n
    }

    /// Called by `release` and `disconnect` for each shared token given
    /// back: true when a shrink takes it (it does not become free).
    pub(super) fn retire_returned(&mut self) -> bool {
        if self.controls.retiring > 0 {
            self.controls.retiring -= 1;
            true
        } else {
            false
        }
    }

    /// Tells the pool a client's ancestors (parent first), for caps.
    pub fn set_ancestry(&mut self, id: ClientId, ancestors: Vec<u32>) {
        if self.clients.contains_key(&id) {
            self.controls.ancestry.insert(id, ancestors);
        }
    }

    /// Forgets a client's ancestry (on disconnect).
    pub(super) fn forget_controls_of(&mut self, id: ClientId) {
        self.controls.ancestry.remove(&id);
    }

    /// Limits the subtree of process `pid` to `max` tokens at once (parent
    /// slots count; the module docs say which may be withheld)
    /// (`None` lifts the cap). Lowering a cap takes nothing back; raising
    /// or lifting one grants to the waiters it held back.
    pub fn set_cap(&mut self, pid: u32, max: Option<u32>, now: Duration) {
        match max {
            Some(max) => {
                self.controls.caps.insert(pid, max);
            }
            None => {
                self.controls.caps.remove(&pid);
            }
        }
        self.dispatch_pool(now);
    }

    /// The caps in force, with what each subtree holds now.
    pub fn caps(&self) -> Vec<Cap> {
        self.controls
            .caps
            .iter()
            .map(|(&pid, &max)| Cap {
                pid,
                max,
                held: self.subtree_held(pid),
            })
            .collect()
    }

    /// Opens or holds admission; `floor` shared tokens may be in use
    /// whatever admission says. Opening grants to waiters at once.
    pub fn set_admission(&mut self, open: bool, floor: u32, now: Duration) {
        let was = (self.controls.admission_open, self.controls.floor);
        self.controls.admission_open = open;
        self.controls.floor = floor;
        if (open, floor) != was {
            self.dispatch_pool(now);
        }
    }

    /// Whether admission is open (no load or memory limit crossed).
    pub fn admission_open(&self) -> bool {
        self.controls.admission_open
    }

    /// True when waiters are queued, a shared token is free, and only
    /// admission keeps it from them: the broker then re-checks its limits
    /// on a slow timer.
    pub fn held_by_admission(&self) -> bool {
        !self.controls.admission_open && self.free > 0 && !self.queue.is_empty()
    }

    /// Whether `pid` is `id`'s own process or one of its ancestors.
    fn in_subtree(&self, id: ClientId, pid: u32) -> bool {
        self.clients.get(&id).is_some_and(|c| c.info.pid == pid)
            || self
                .controls
                .ancestry
                .get(&id)
                .is_some_and(|a| a.contains(&pid))
    }

    /// Tokens the subtree of `pid` holds: shared ones and slots.
    fn subtree_held(&self, pid: u32) -> u32 {
        self.clients
            .iter()
            .filter(|(&id, _)| self.in_subtree(id, pid))
            .map(|(_, c)| c.pool_held + u32::from(c.slot_held) + c.table_held)
            .sum()
    }

    /// Whether admission holds every shared token back now: closed, with
    /// at least its floor in use.
    fn admission_holds(&self) -> bool {
        !self.controls.admission_open && self.shared_in_use() >= self.controls.floor
    }

    /// Whether a shared token may go to `id` now, as far as admission and
    /// caps are concerned (a free token is the caller's business).
    pub(super) fn may_take_shared(&self, id: ClientId) -> bool {
        if self.admission_holds() {
            return false;
        }
        self.controls
            .caps
            .iter()
            .all(|(&pid, &max)| !self.in_subtree(id, pid) || self.subtree_held(pid) < max)
    }

    /// How many of `waiters` a shared token may go to now, as
    /// [`Pool::may_take_shared`] says for each: each cap's subtree is
    /// counted once, not once per waiter.
    pub(super) fn count_may_take_shared(&self, waiters: impl Iterator<Item = ClientId>) -> usize {
        if self.admission_holds() {
            return 0;
        }
        let full: Vec<u32> = self
            .controls
            .caps
            .iter()
            .filter(|(&pid, &max)| self.subtree_held(pid) >= max)
            .map(|(&pid, _)| pid)
            .collect();
        waiters
            .filter(|&id| !full.iter().any(|&pid| self.in_subtree(id, pid)))
            .count()
    }

    /// Whether any cap is in force.
    pub(super) fn has_caps(&self) -> bool {
        !self.controls.caps.is_empty()
    }

    /// Whether the caps over `id` let it borrow the top command's slot, a
    /// token of its own: like a shared token, except that a subtree capped
    /// at 0 may still run one job on it.
    pub(super) fn caps_allow_slot(&self, id: ClientId) -> bool {
        self.controls
            .caps
            .iter()
            .all(|(&pid, &max)| !self.in_subtree(id, pid) || self.subtree_held(pid) < max.max(1))
    }

    /// Whether nothing but FIFO order decides who gets a shared token: no
    /// cap and admission open (the common case, checked first).
    pub(super) fn unrestricted(&self) -> bool {
        self.controls.admission_open && self.controls.caps.is_empty()
    }

    /// The queue position of the first waiter that may take a shared token.
    pub(super) fn first_eligible(&self) -> Option<usize> {
        if self.queue.is_empty() {
            return None;
        }
        if self.unrestricted() {
            return Some(0);
        }
        self.queue
            .iter()
            .position(|w| self.may_take_shared(w.client))
    }
}

#[cfg(test)]
mod tests;
