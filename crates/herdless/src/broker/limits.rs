//! The bounds that keep one client from starving, bloating or locking out
//! the others, and the bookkeeping that enforces them.
//!
//! | bound | value | what a client that hits it sees |
//! |---|---|---|
//! | [`READ_BUDGET`] requests per connection per turn | 64; with more than 16 connections ready, [`ROUND_BUDGET`] (1024) shared among them, at least [`MIN_TURN_BUDGET`] (4) each | nothing: its next requests wait for its next turn, after every other ready connection's |
//! | [`READ_CHUNK`] bytes read per connection per turn | 4 KiB | the same |
//! | [`ACCEPT_BUDGET`] connections accepted per turn | 64 | nothing: the next ones wait in the listen queue for the listener's next turn |
//! | [`LISTEN_BACKLOG`] connections in the listen queue | 256 | its `connect` waits in the kernel until the broker accepts one ahead of it |
//! | [`OUTPUT_PAUSE`] unread reply bytes per connection | 64 KiB | the broker stops reading it until it reads its replies; its writes block once the socket buffer is full |
//! | one `Status` reply in the broker per connection | 1 | the same, until that reply has gone to the socket |
//! | [`TOTAL_OUTPUT_PAUSE`] unread reply bytes, all connections | 8 MiB | connections with replies unsent are not read until theirs drain |
//! | [`MAX_PENDING_OUTPUT`] unread reply bytes per connection | 2 MiB | an `Error` frame, and the connection is closed (a guard: the pause keeps well below it) |
//! | [`MAX_HANDSHAKING`] connections before their `Hello` | 256 | the oldest of them gets an `Error` starting `busy:` and is closed |
//! | [`HANDSHAKE_DEADLINE`] to send the `Hello` | 5 s | an `Error` frame, and the connection is closed (a hello already in its socket then is read first) |
//! | [`MAX_PENDING_ACQUIRES`] waiting acquires per connection | 4096 | an `Error` frame, and the connection is closed |
//! | [`MAX_QUEUED_ACQUIRES`] waiting acquires, all connections | 65,536 | an `Error` frame, and the connection is closed |
//! | [`MAX_STATUS_CLIENTS`] client lines in a status document | 256 | a document that lists the busiest 256 and counts the rest |

use std::collections::VecDeque;
use std::time::Duration;

use mio::Token;

use crate::protocol::MAX_REPLY_PAYLOAD;

#[cfg(test)]
mod budget_tests {
    use super::*;

    #[test]
    fn a_round_shares_its_budget() {
        assert_eq!(turn_budget(0), READ_BUDGET);
        assert_eq!(turn_budget(1), READ_BUDGET);
        assert_eq!(turn_budget(16), READ_BUDGET);
        assert_eq!(turn_budget(200), 5);
        assert_eq!(turn_budget(100_000), MIN_TURN_BUDGET);
    }
}

/// Requests handled from one connection before the loop moves on to the
/// others; the rest wait in the connection's buffer for its next turn.
pub const READ_BUDGET: usize = 64;

/// Requests handled in one round of turns, shared by the connections that
/// are ready: with many of them flooding at once, each turn is shorter
/// (down to [`MIN_TURN_BUDGET`]), so a round, and a quiet client's wait for
/// its own turn, stays about as long with 200 flooding connections as with
/// a few.
pub const ROUND_BUDGET: usize = 1024;

/// The fewest requests a turn handles, however many connections are ready.
pub const MIN_TURN_BUDGET: usize = 4;

/// The budget of each turn in a round of `ready` connections.
pub(super) fn turn_budget(ready: usize) -> usize {
    (ROUND_BUDGET / ready.max(1)).clamp(MIN_TURN_BUDGET, READ_BUDGET)
}

/// Connections accepted per turn of the listener.
pub const ACCEPT_BUDGET: usize = 64;

/// Connections the kernel queues for the broker to accept (the `listen`
/// backlog of a socket the broker binds). A client connecting while the
/// queue is full waits in `connect` until the broker accepts one; a short
/// queue keeps a new client behind at most this many others, where the
/// system's default (`somaxconn`, 4096 on Linux) let a flood of
/// connections that never speak put thousands ahead of it.
pub const LISTEN_BACKLOG: i32 = 256;

/// Bytes read from one connection's socket per turn.
pub const READ_CHUNK: usize = 4096;

/// While more than this many reply bytes wait unsent to a connection, the
/// broker reads no more requests from it: a client that does not read its
/// replies cannot make the broker buffer them. Reading resumes once the
/// socket has taken them.
pub const OUTPUT_PAUSE: usize = 64 * 1024;

/// While unsent replies to all connections together exceed this, no
/// connection with replies of its own unsent is read.
pub const TOTAL_OUTPUT_PAUSE: usize = 8 << 20;

/// A connection whose unsent replies still pile up past this is closed.
/// With the pause above it is never reached by one turn's replies (at most
/// [`READ_BUDGET`] small frames or one status document); it is the guard
/// behind the pause.
pub const MAX_PENDING_OUTPUT: usize = 2 * MAX_REPLY_PAYLOAD;

/// Connections accepted and not yet past their `Hello`. One more makes the
/// broker close the oldest of them with an `Error` starting
/// [`BUSY`](crate::protocol::BUSY_PREFIX), so connections that never speak
/// cannot take every descriptor, and a client that sends its `Hello` at once
/// (every herdless client does) is always served.
pub const MAX_HANDSHAKING: usize = 256;

/// How long a connection may take to send its `Hello`.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// The most acquires one connection may have waiting. A build tool waits
/// for a few tokens at a time; a client that queues more is broken or
/// hostile, and would otherwise grow the broker's queue without bound.
pub const MAX_PENDING_ACQUIRES: u32 = 4096;

/// The most acquires waiting in the whole broker (about 1.7 MB of queue).
pub const MAX_QUEUED_ACQUIRES: usize = 65_536;

/// Client lines in a status document; the others are counted, not listed.
pub use crate::status::MAX_STATUS_CLIENTS;

/// Connections with more to read than their last turn took, in the order
/// they get their next turn.
#[derive(Debug, Default)]
pub(super) struct Turns {
    queue: VecDeque<Token>,
}

impl Turns {
    /// Queues `token` for a turn (the caller keeps it queued once).
    pub(super) fn push(&mut self, token: Token) {
        self.queue.push_back(token);
    }

    /// Whether some connection waits for a turn.
    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The connections due a turn in this round: those queued now, not the
    /// ones their turns queue again.
    pub(super) fn round(&mut self) -> Vec<Token> {
        self.queue.drain(..).collect()
    }
}

/// How often, at most, the broker logs the connections it closes for
/// their handshake (past [`MAX_HANDSHAKING`] or [`HANDSHAKE_DEADLINE`]): a
/// flood of them gets one line per period with the count, not one line
/// (and one write) per connection.
pub const HANDSHAKE_LOG_EVERY: Duration = Duration::from_secs(1);

/// Counts the connections closed for their handshake between two log
/// lines (see [`HANDSHAKE_LOG_EVERY`]).
#[derive(Debug, Default)]
pub(super) struct HandshakeLog {
    last: Option<Duration>,
    unlogged: u64,
}

impl HandshakeLog {
    /// Notes one more connection closed at `now`; returns how many to
    /// report when a line is due (the first at once, then at most one per
    /// [`HANDSHAKE_LOG_EVERY`]).
    pub(super) fn note(&mut self, now: Duration) -> Option<u64> {
        self.unlogged += 1;
        match self.last {
            Some(at) if now.saturating_sub(at) < HANDSHAKE_LOG_EVERY => None,
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }

    /// The count not reported yet, cleared.
    pub(super) fn take(&mut self) -> u64 {
        std::mem::take(&mut self.unlogged)
    }
}

/// Connections still in their handshake, oldest first, with the moment
/// each must have sent its `Hello` by.
#[derive(Debug, Default)]
pub(super) struct Handshakes {
    queue: VecDeque<(Duration, Token)>,
    live: usize,
}

impl Handshakes {
    /// A connection accepted at `now`.
    pub(super) fn start(&mut self, token: Token, now: Duration, deadline: Duration) {
        self.queue.push_back((now + deadline, token));
        self.live += 1;
    }

    /// A connection left its handshake (sent its `Hello`, or closed).
    pub(super) fn end(&mut self) {
        self.live -= 1;
    }

    /// Connections in their handshake.
    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// Drops entries at the front that `still_handshaking` says are done.
    fn prune(&mut self, still_handshaking: impl Fn(Token) -> bool) {
        while let Some(&(_, token)) = self.queue.front() {
            if still_handshaking(token) {
                return;
            }
            self.queue.pop_front();
        }
    }

    /// The earliest deadline of a connection still in its handshake.
    pub(super) fn next_deadline(
        &mut self,
        still_handshaking: impl Fn(Token) -> bool,
    ) -> Option<Duration> {
        self.prune(still_handshaking);
        self.queue.front().map(|&(at, _)| at)
    }

    /// The oldest connection still in its handshake whose deadline is past
    /// `now` (or any, with `now` = `None`), taken off the queue.
    pub(super) fn pop_oldest(
        &mut self,
        now: Option<Duration>,
        still_handshaking: impl Fn(Token) -> bool,
    ) -> Option<Token> {
        self.prune(still_handshaking);
        match (self.queue.front(), now) {
            (Some(&(at, _)), Some(now)) if at > now => None,
            (Some(_), _) => self.queue.pop_front().map(|(_, t)| t),
            (None, _) => None,
        }
    }
}
