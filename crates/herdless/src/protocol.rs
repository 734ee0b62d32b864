//! The wire format between native clients and the broker (versions 3 to
//! 5: version 4 adds the shared token table, version 5
//! [`Request::CancelNowait`] and [`Reply::TakenBack`]).
//!
//! Every message is one frame: a 5-byte header (`len: u32` little-endian, the
//! payload length, then `kind: u8`) followed by `len` payload bytes. Frames
//! from client to broker are [`Request`]s, frames from broker to client are
//! [`Reply`]s. `docs/PROTOCOL.md` is the full specification, including what
//! each message means; this module only turns frames into values and back.
//!
//! The module does no I/O. [`decode_request`] and [`decode_reply`] take
//! whatever bytes have arrived and say whether a whole frame is there;
//! [`FrameBuffer`] keeps the bytes between reads. The decoders never panic,
//! and they reject a frame whose length cannot be right as soon as its header
//! is in, so a peer cannot make the other side buffer more than one bounded
//! frame.

#![forbid(unsafe_code)]

use std::fmt;

use bitflags::bitflags;

/// The protocol version this module speaks, sent in [`Request::Hello`] and
/// [`Reply::Welcome`].
///
/// Version 3 names the slot a job may borrow (`HERDLESS_SLOT`) in `Hello`
/// and the slot minted for the client's own job in `Welcome`. Versions 1
/// and 2 named the client's parent by process id, which the broker no
/// longer trusts; their `Hello` is decoded only to be refused by version.
pub const PROTOCOL_VERSION: u16 = 3;

/// The lowest version with [`Request::Control`] and [`Reply::Controlled`]
/// (they came with version 2). A broker speaks every version from
/// [`PROTOCOL_VERSION`] to this one and answers `Welcome` with the version
/// the client asked for; today that is version 3 alone.
pub const CONTROL_VERSION: u16 = 3;

/// The version that adds the shared token table (the fast path): the
/// `Hello` flag [`HelloFlags::FAST`], the reply [`Reply::Segment`] and the
/// request [`Request::Returned`]. A broker speaks versions
/// [`PROTOCOL_VERSION`] to this one; a client asks for it only to ask for
/// the table, and otherwise speaks [`PROTOCOL_VERSION`].
pub const FAST_VERSION: u16 = 4;

/// The version that adds [`Request::CancelNowait`] and [`Reply::TakenBack`]:
/// a withdrawal nobody waits for, after which no grant that raced it stays
/// with the client. A broker speaks versions [`PROTOCOL_VERSION`] to this
/// one; a client asks for it first and speaks [`PROTOCOL_VERSION`] to a
/// broker that refuses it.
pub const TAKE_BACK_VERSION: u16 = 5;

/// The message of the `Error` a broker sends, before it closes the
/// connection, to a client that waits or asks for a token after the broker
/// stopped granting. A client reports it as the broker going away.
pub const STOPPING_MESSAGE: &str = "the broker is shutting down: no more job tokens are granted";

/// The first four payload bytes of [`Request::Hello`].
pub const MAGIC: [u8; 4] = *b"HRDL";

/// The length of a frame header: `len: u32` little-endian, then `kind: u8`.
pub const HEADER_LEN: usize = 5;

/// The largest payload a client-to-broker frame may carry.
pub const MAX_REQUEST_PAYLOAD: usize = 64;

/// The largest payload a broker-to-client frame may carry (1 MiB).
pub const MAX_REPLY_PAYLOAD: usize = 1 << 20;

/// The largest payload of [`Reply::Error`]: its message in bytes.
pub const MAX_ERROR_MESSAGE: usize = 1024;

/// How an `Error` frame sent before the `Welcome` begins when the broker
/// cannot take the connection now (out of file descriptors, too many
/// connections in their handshake) but may later: the client should close,
/// wait a little and connect again.
pub const BUSY_PREFIX: &str = "busy: ";

/// How an `Error` frame sent before the `Welcome` begins when the broker
/// runs inside another program's process and turns the client away to
/// leave that program the descriptors it asked to keep free
/// ([`crate::broker::Stopper::keep_fds_free`]): the client should not try
/// again, but use the classic jobserver if it has one (`errno` `EMFILE`
/// in the C ABI).
pub const NO_ROOM_PREFIX: &str = "no room: ";

/// The `kind` byte of each frame.
///
/// Requests use `0x01..=0x0a`, replies `0x81..=0x8a` (`0x08` and `0x88`
/// from version 2, `0x09` and `0x89` from version 4, `0x0a` and `0x8a` from
/// version 5); each decoder knows only its own direction's kinds.
pub mod kind {
    /// [`Request::Hello`](super::Request::Hello).
    pub const HELLO: u8 = 0x01;
    /// [`Request::Acquire`](super::Request::Acquire).
    pub const ACQUIRE: u8 = 0x02;
    /// [`Request::TryAcquire`](super::Request::TryAcquire).
    pub const TRY_ACQUIRE: u8 = 0x03;
    /// [`Request::Cancel`](super::Request::Cancel).
    pub const CANCEL: u8 = 0x04;
    /// [`Request::Release`](super::Request::Release).
    pub const RELEASE: u8 = 0x05;
    /// [`Request::Abort`](super::Request::Abort).
    pub const ABORT: u8 = 0x06;
    /// [`Request::Status`](super::Request::Status).
    pub const STATUS: u8 = 0x07;
    /// [`Request::Control`](super::Request::Control) (version 2).
    pub const CONTROL: u8 = 0x08;
    /// [`Request::Returned`](super::Request::Returned) (version 4).
    pub const RETURNED: u8 = 0x09;
    /// [`Request::CancelNowait`](super::Request::CancelNowait) (version 5).
    pub const CANCEL_NOWAIT: u8 = 0x0a;

    /// [`Reply::Welcome`](super::Reply::Welcome).
    pub const WELCOME: u8 = 0x81;
    /// [`Reply::Grant`](super::Reply::Grant).
    pub const GRANT: u8 = 0x82;
    /// [`Reply::Denied`](super::Reply::Denied).
    pub const DENIED: u8 = 0x83;
    /// [`Reply::Cancelled`](super::Reply::Cancelled).
    pub const CANCELLED: u8 = 0x84;
    /// [`Reply::Aborted`](super::Reply::Aborted).
    pub const ABORTED: u8 = 0x85;
    /// [`Reply::Status`](super::Reply::Status).
    pub const STATUS_REPLY: u8 = 0x86;
    /// [`Reply::Error`](super::Reply::Error).
    pub const ERROR: u8 = 0x87;
    /// [`Reply::Controlled`](super::Reply::Controlled) (version 2).
    pub const CONTROLLED: u8 = 0x88;
    /// [`Reply::Segment`](super::Reply::Segment) (version 4).
    pub const SEGMENT: u8 = 0x89;
    /// [`Reply::TakenBack`](super::Reply::TakenBack) (version 5).
    pub const TAKEN_BACK: u8 = 0x8a;
}

/// Payload length of `Hello`: magic, version, flags, pid, slot.
const HELLO_LEN: usize = 4 + 2 + 1 + 4 + 8;
/// Payload length of a version 1 or 2 `Hello` (magic, version, flags, pid,
/// ppid): decoded only so that the broker can refuse it by its version.
const HELLO_OLD_LEN: usize = 4 + 2 + 1 + 4 + 4;
/// Payload length of `Welcome`: version, capacity, client id, slot.
const WELCOME_LEN: usize = 2 + 4 + 8 + 8;
/// `Control`: op, pid, value.
const CONTROL_LEN: usize = 1 + 4 + 4;
/// `Segment`: owner id, table words.
const SEGMENT_LEN: usize = 4 + 4;

bitflags! {
    /// The flags byte of [`Request::Hello`].
    ///
    /// A decoder rejects a byte with any other bit set
    /// ([`ProtocolError::UnknownFlags`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct HelloFlags: u8 {
        /// The client is a job of the runner whose slot the `slot` field
        /// names (an id from `HERDLESS_SLOT`), and may be lent that slot's
        /// implicit token when no other job holds it.
        const JOB = 0x01;
        /// The client only asks for status and never holds tokens.
        const OBSERVER = 0x02;
        /// The client is a job of a make recipe: the `slot` field holds the
        /// process id of the recipe's root process, whose slot all the
        /// recipe's jobs share.
        const RECIPE_JOB = 0x04;
        /// The client asks for the shared token table (version 4 only):
        /// the broker answers [`Reply::Segment`] right after `Welcome`.
        const FAST = 0x08;
        /// With `RECIPE_JOB`: the client is a job runner all the same (a
        /// make started by a recipe that may start others beside it), whose
        /// implicit token is its share of the recipe's. The hello is also
        /// the `Acquire` of it (the recipe's slot, lent before the answer
        /// when it is free; its `Grant` may come before `Segment`), and a
        /// drain waits for it as for any runner.
        const RUNNER = 0x10;
    }
}

/// Why a build was aborted: bmake's abort tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// A job failed (bmake's `E` token).
    Error,
    /// The build was interrupted (bmake's `I` token).
    Interrupt,
}

impl AbortReason {
    /// The byte on the wire, which is also bmake's token byte: `b'E'` or
    /// `b'I'`.
    pub fn byte(self) -> u8 {
        match self {
            AbortReason::Error => b'E',
            AbortReason::Interrupt => b'I',
        }
    }

    /// The reason a wire byte (or bmake token) stands for, or `None` for any
    /// byte other than `b'E'` and `b'I'`.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            b'E' => Some(AbortReason::Error),
            b'I' => Some(AbortReason::Interrupt),
            _ => None,
        }
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AbortReason::Error => "error",
            AbortReason::Interrupt => "interrupt",
        })
    }
}

/// A frame from client to broker.
///
/// `Display` writes the message's name (`Hello`, `TryAcquire`, …) for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The first frame on every connection.
    Hello {
        /// The protocol version the client speaks. The decoder accepts any
        /// value; the broker refuses those it does not speak.
        version: u16,
        /// What kind of client this is.
        flags: HelloFlags,
        /// The client's process id.
        pid: u32,
        /// The slot the client may borrow: a minted id with
        /// [`HelloFlags::JOB`], a recipe root's pid with
        /// [`HelloFlags::RECIPE_JOB`], otherwise 0. A version 1 `Hello`
        /// decodes with 0 here.
        slot: u64,
    },
    /// Wait in the FIFO queue for one token; answered by one `Grant`.
    Acquire,
    /// Take a token only if one is free now; answered by `Grant` or `Denied`.
    TryAcquire,
    /// Withdraw one pending `Acquire`; answered by `Cancelled`.
    Cancel,
    /// Withdraw one pending `Acquire`, for a client that will not wait for
    /// the answer (version 5). When none is pending, its `Grant` is on the
    /// way to a client that had not read it when it asked: the broker
    /// takes that token back into the pool at once (it goes to the next
    /// waiter) and answers `TakenBack`, and the client voids the `Grant`.
    /// Otherwise answered as `Cancel` is.
    CancelNowait,
    /// Give one held token back. No reply.
    Release,
    /// Abort the build for every client.
    Abort {
        /// Why.
        reason: AbortReason,
    },
    /// Ask for the broker's state; answered by `Status`.
    Status,
    /// Change the running pool (version 2 only); answered by `Controlled`.
    Control(ControlOp),
    /// The client gave tokens back into the shared table while the table
    /// was closed (version 4): the broker should look at it. No reply.
    Returned,
}

/// What a [`Request::Control`] changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlOp {
    /// Make the pool `-j jobs`: grow at once, shrink as tokens come back.
    SetJobs(u32),
    /// Let the subtree of process `pid` hold at most `max` shared tokens at
    /// once; `None` lifts the cap.
    Cap {
        /// The process whose subtree (itself and every descendant) is capped.
        pid: u32,
        /// The most shared tokens, or `None` for no cap.
        max: Option<u32>,
    },
}

impl ControlOp {
    const SET_JOBS: u8 = 1;
    const CAP: u8 = 2;
    const UNCAP: u8 = 3;
}

/// A frame from broker to client.
///
/// `Display` writes the message's name (`Welcome`, `Grant`, …) for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The answer to an accepted `Hello`.
    Welcome {
        /// The protocol version the broker speaks on this connection.
        version: u16,
        /// The number of shared tokens in the pool: `N - 1` for `-jN`, the
        /// N-th being the implicit token of the top-level process.
        capacity: u32,
        /// This connection's id, unique for the broker's lifetime.
        client_id: u64,
        /// The slot minted for this client's own job: a job runner exports
        /// it to its command as `HERDLESS_SLOT`. 0 for an observer.
        slot: u64,
    },
    /// One token now belongs to the client.
    Grant,
    /// The answer to `TryAcquire` when no token is free.
    Denied,
    /// The answer to `Cancel`, and to `CancelNowait` when the broker took
    /// nothing back.
    Cancelled {
        /// `true`: a pending `Acquire` was withdrawn. `false`: none was
        /// pending; its `Grant` was sent earlier on the stream.
        cancelled: bool,
    },
    /// The answer to `CancelNowait` when no `Acquire` was pending (version
    /// 5): the token of a `Grant` sent earlier on the stream, and not read
    /// by the client when it asked, went back to the pool. The client holds
    /// one token fewer than the grants it read say.
    TakenBack,
    /// The build was aborted; no more tokens will be granted.
    Aborted {
        /// Why.
        reason: AbortReason,
    },
    /// The broker's state as a JSON document.
    Status {
        /// The JSON text.
        json: String,
    },
    /// A fatal error; the broker closes the connection after it.
    Error {
        /// Why, in at most [`MAX_ERROR_MESSAGE`] bytes.
        message: String,
    },
    /// The answer to `Control`: the change is made (version 2).
    Controlled,
    /// Sent right after `Welcome` to a client that asked for the shared
    /// token table (version 4). With a non-zero `owner` the table's memory
    /// file comes with the frame's first byte (`SCM_RIGHTS`); 0 means the
    /// broker offers no table and the client uses this socket alone.
    Segment {
        /// The client's id in the table's words; 0 for "no table".
        owner: u32,
        /// The table's words.
        words: u32,
    },
}

/// Why bytes are not a valid frame.
///
/// Every error is fatal for the connection: after it the stream is out of
/// step and cannot be read further.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The header announces more payload than the kind (or the direction)
    /// allows. Reported from the header alone.
    #[error("frame of kind {kind:#04x} has a {len}-byte payload; the limit is {max}")]
    Oversized {
        /// The frame's kind byte.
        kind: u8,
        /// The announced payload length.
        len: usize,
        /// The largest payload allowed.
        max: usize,
    },
    /// The kind byte names no message of this direction.
    #[error("unknown frame kind {0:#04x}")]
    UnknownKind(u8),
    /// A fixed-size message announces a payload of the wrong length.
    /// Reported from the header alone.
    #[error("frame of kind {kind:#04x} has a {len}-byte payload; expected {expected}")]
    BadLength {
        /// The frame's kind byte.
        kind: u8,
        /// The announced payload length.
        len: usize,
        /// The payload length of this kind.
        expected: usize,
    },
    /// A `Hello` that does not start with [`MAGIC`].
    #[error("hello has magic \"{}\"; expected \"HRDL\"", .0.escape_ascii())]
    BadMagic([u8; 4]),
    /// A `Hello` flags byte with bits [`HelloFlags`] does not define.
    #[error("hello has unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    /// An abort byte other than `b'E'` or `b'I'`.
    #[error("unknown abort reason byte {0:#04x}; expected 'E' or 'I'")]
    BadAbortReason(u8),
    /// A boolean byte other than 0 or 1.
    #[error("frame of kind {kind:#04x} has boolean byte {byte:#04x}; expected 0 or 1")]
    BadBool {
        /// The frame's kind byte.
        kind: u8,
        /// The byte found.
        byte: u8,
    },
    /// A `Control` whose op byte is unknown, or whose unused field is not 0.
    #[error("control op {op:#04x} with pid {pid} and value {value} is not defined")]
    BadControl {
        /// The op byte.
        op: u8,
        /// The pid field.
        pid: u32,
        /// The value field.
        value: u32,
    },
    /// A string payload that is not UTF-8.
    #[error("frame of kind {kind:#04x} has a payload that is not valid utf-8")]
    BadUtf8 {
        /// The frame's kind byte.
        kind: u8,
    },
}

impl Request {
    /// The frame's kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Request::Hello { .. } => kind::HELLO,
            Request::Acquire => kind::ACQUIRE,
            Request::TryAcquire => kind::TRY_ACQUIRE,
            Request::Cancel => kind::CANCEL,
            Request::CancelNowait => kind::CANCEL_NOWAIT,
            Request::Release => kind::RELEASE,
            Request::Abort { .. } => kind::ABORT,
            Request::Status => kind::STATUS,
            Request::Control(_) => kind::CONTROL,
            Request::Returned => kind::RETURNED,
        }
    }

    /// The message's name, as `Display` writes it.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "Hello",
            Request::Acquire => "Acquire",
            Request::TryAcquire => "TryAcquire",
            Request::Cancel => "Cancel",
            Request::CancelNowait => "CancelNowait",
            Request::Release => "Release",
            Request::Abort { .. } => "Abort",
            Request::Status => "Status",
            Request::Control(_) => "Control",
            Request::Returned => "Returned",
        }
    }

    /// Appends this message's frame to `out`.
    ///
    /// `Hello` sends only the bits of `flags` that [`HelloFlags`] defines
    /// (a value built with `from_bits_retain` may carry others), so every
    /// frame written here decodes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Request::Hello {
                version,
                flags,
                pid,
                slot,
            } => {
                put_header(out, self.kind(), HELLO_LEN);
                out.extend_from_slice(&MAGIC);
                out.extend_from_slice(&version.to_le_bytes());
                out.push(flags.intersection(HelloFlags::all()).bits());
                out.extend_from_slice(&pid.to_le_bytes());
                out.extend_from_slice(&slot.to_le_bytes());
            }
            Request::Acquire
            | Request::TryAcquire
            | Request::Cancel
            | Request::CancelNowait
            | Request::Release
            | Request::Returned
            | Request::Status => put_header(out, self.kind(), 0),
            Request::Abort { reason } => {
                put_header(out, self.kind(), 1);
                out.push(reason.byte());
            }
            Request::Control(op) => {
                let (code, pid, value) = match *op {
                    ControlOp::SetJobs(jobs) => (ControlOp::SET_JOBS, 0, jobs),
                    ControlOp::Cap {
                        pid,
                        max: Some(max),
                    } => (ControlOp::CAP, pid, max),
                    ControlOp::Cap { pid, max: None } => (ControlOp::UNCAP, pid, 0),
                };
                put_header(out, self.kind(), CONTROL_LEN);
                out.push(code);
                out.extend_from_slice(&pid.to_le_bytes());
                out.extend_from_slice(&value.to_le_bytes());
            }
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Reply {
    /// The frame's kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Reply::Welcome { .. } => kind::WELCOME,
            Reply::Grant => kind::GRANT,
            Reply::Denied => kind::DENIED,
            Reply::Cancelled { .. } => kind::CANCELLED,
            Reply::TakenBack => kind::TAKEN_BACK,
            Reply::Aborted { .. } => kind::ABORTED,
            Reply::Status { .. } => kind::STATUS_REPLY,
            Reply::Error { .. } => kind::ERROR,
            Reply::Controlled => kind::CONTROLLED,
            Reply::Segment { .. } => kind::SEGMENT,
        }
    }

    /// The message's name, as `Display` writes it.
    pub fn name(&self) -> &'static str {
        match self {
            Reply::Welcome { .. } => "Welcome",
            Reply::Grant => "Grant",
            Reply::Denied => "Denied",
            Reply::Cancelled { .. } => "Cancelled",
            Reply::TakenBack => "TakenBack",
            Reply::Aborted { .. } => "Aborted",
            Reply::Status { .. } => "Status",
            Reply::Error { .. } => "Error",
            Reply::Controlled => "Controlled",
            Reply::Segment { .. } => "Segment",
        }
    }

    /// Appends this message's frame to `out`.
    ///
    /// Strings that do not fit are truncated at the last character boundary
    /// within the limit, so every frame written here decodes: an `Error`
    /// message to [`MAX_ERROR_MESSAGE`] bytes, a `Status` document to
    /// [`MAX_REPLY_PAYLOAD`] bytes. A truncated `Status` is no longer valid
    /// JSON, which the client then reports as a parse error; a broker keeps
    /// its status far below 1 MiB, so this is a guard, not a mode of use.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Welcome {
                version,
                capacity,
                client_id,
                slot,
            } => {
                put_header(out, self.kind(), WELCOME_LEN);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&capacity.to_le_bytes());
                out.extend_from_slice(&client_id.to_le_bytes());
                out.extend_from_slice(&slot.to_le_bytes());
            }
            Reply::Grant | Reply::Denied | Reply::Controlled | Reply::TakenBack => {
                put_header(out, self.kind(), 0)
            }
            Reply::Cancelled { cancelled } => {
                put_header(out, self.kind(), 1);
                out.push(u8::from(*cancelled));
            }
            Reply::Aborted { reason } => {
                put_header(out, self.kind(), 1);
                out.push(reason.byte());
            }
            Reply::Status { json } => {
                let json = truncate_str(json, MAX_REPLY_PAYLOAD);
                put_header(out, self.kind(), json.len());
                out.extend_from_slice(json.as_bytes());
            }
            Reply::Error { message } => {
                let message = truncate_str(message, MAX_ERROR_MESSAGE);
                put_header(out, self.kind(), message.len());
                out.extend_from_slice(message.as_bytes());
            }
            Reply::Segment { owner, words } => {
                put_header(out, self.kind(), SEGMENT_LEN);
                out.extend_from_slice(&owner.to_le_bytes());
                out.extend_from_slice(&words.to_le_bytes());
            }
        }
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Writes a frame header. `len` is at most [`MAX_REPLY_PAYLOAD`] at every
/// call, so it fits the `u32` length field.
fn put_header(out: &mut Vec<u8>, kind: u8, len: usize) {
    debug_assert!(len <= MAX_REPLY_PAYLOAD);
    out.reserve(HEADER_LEN + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(kind);
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character
/// boundary.
fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Reads a frame header: `None` until all [`HEADER_LEN`] bytes are in.
fn header(buf: &[u8]) -> Option<(u8, usize)> {
    let &[l0, l1, l2, l3, kind] = buf.first_chunk::<HEADER_LEN>()?;
    // A length beyond usize (16-bit targets only) is oversized anyway.
    let len = usize::try_from(u32::from_le_bytes([l0, l1, l2, l3])).unwrap_or(usize::MAX);
    Some((kind, len))
}

/// The exact payload length of each request kind.
fn request_payload_len(kind: u8) -> Option<usize> {
    match kind {
        kind::HELLO => Some(HELLO_LEN),
        kind::ACQUIRE
        | kind::TRY_ACQUIRE
        | kind::CANCEL
        | kind::CANCEL_NOWAIT
        | kind::RELEASE
        | kind::STATUS
        | kind::RETURNED => Some(0),
        kind::ABORT => Some(1),
        kind::CONTROL => Some(CONTROL_LEN),
        _ => None,
    }
}

/// What payload length a reply kind allows.
enum ReplyLen {
    Exact(usize),
    AtMost(usize),
}

fn reply_payload_len(kind: u8) -> Option<ReplyLen> {
    match kind {
        kind::WELCOME => Some(ReplyLen::Exact(WELCOME_LEN)),
        kind::GRANT | kind::DENIED | kind::CONTROLLED | kind::TAKEN_BACK => {
            Some(ReplyLen::Exact(0))
        }
        kind::CANCELLED | kind::ABORTED => Some(ReplyLen::Exact(1)),
        kind::SEGMENT => Some(ReplyLen::Exact(SEGMENT_LEN)),
        kind::STATUS_REPLY => Some(ReplyLen::AtMost(MAX_REPLY_PAYLOAD)),
        kind::ERROR => Some(ReplyLen::AtMost(MAX_ERROR_MESSAGE)),
        _ => None,
    }
}

/// Views a payload whose length the header check has already fixed as an
/// array, without a path that could panic.
fn fixed<const N: usize>(kind: u8, payload: &[u8]) -> Result<&[u8; N], ProtocolError> {
    payload.try_into().map_err(|_| ProtocolError::BadLength {
        kind,
        len: payload.len(),
        expected: N,
    })
}

fn abort_reason(byte: u8) -> Result<AbortReason, ProtocolError> {
    AbortReason::from_byte(byte).ok_or(ProtocolError::BadAbortReason(byte))
}

fn utf8(kind: u8, payload: &[u8]) -> Result<String, ProtocolError> {
    std::str::from_utf8(payload)
        .map(str::to_owned)
        .map_err(|_| ProtocolError::BadUtf8 { kind })
}

/// What the decoders return: a message and the bytes it took, or `None` for
/// "need more bytes".
type Decoded<T> = Result<Option<(T, usize)>, ProtocolError>;

/// Decodes the client-to-broker frame at the start of `buf`.
///
/// Returns `Ok(None)` while `buf` holds less than a whole frame, and
/// `Ok(Some((request, consumed)))` once it holds one, where `consumed` is the
/// frame's length in bytes (never more than `buf.len()`); bytes after it are
/// left for the next call.
///
/// # Errors
///
/// A frame longer than [`MAX_REQUEST_PAYLOAD`], of an unknown kind, or of the
/// wrong length for its kind is rejected as soon as its 5-byte header is in.
/// A whole frame is rejected for a bad magic, unknown flag bits or an unknown
/// abort byte. Any version number is accepted.
pub fn decode_request(buf: &[u8]) -> Result<Option<(Request, usize)>, ProtocolError> {
    let Some((kind, len)) = header(buf) else {
        return Ok(None);
    };
    if len > MAX_REQUEST_PAYLOAD {
        return Err(ProtocolError::Oversized {
            kind,
            len,
            max: MAX_REQUEST_PAYLOAD,
        });
    }
    let expected = request_payload_len(kind).ok_or(ProtocolError::UnknownKind(kind))?;
    // A version 1 hello is read far enough to be refused by its version.
    let hello_old = kind == kind::HELLO && len == HELLO_OLD_LEN;
    if len != expected && !hello_old {
        return Err(ProtocolError::BadLength {
            kind,
            len,
            expected,
        });
    }
    let end = HEADER_LEN + len;
    let Some(payload) = buf.get(HEADER_LEN..end) else {
        return Ok(None);
    };
    let request = match kind {
        kind::HELLO if hello_old => {
            let p = fixed::<HELLO_OLD_LEN>(kind, payload)?;
            let magic = [p[0], p[1], p[2], p[3]];
            if magic != MAGIC {
                return Err(ProtocolError::BadMagic(magic));
            }
            Request::Hello {
                version: u16::from_le_bytes([p[4], p[5]]),
                flags: HelloFlags::from_bits_truncate(p[6] & 0x02),
                pid: u32::from_le_bytes([p[7], p[8], p[9], p[10]]),
                slot: 0,
            }
        }
        kind::HELLO => {
            let p = fixed::<HELLO_LEN>(kind, payload)?;
            let magic = [p[0], p[1], p[2], p[3]];
            if magic != MAGIC {
                return Err(ProtocolError::BadMagic(magic));
            }
            let flags = HelloFlags::from_bits(p[6]).ok_or(ProtocolError::UnknownFlags(
                p[6] & !HelloFlags::all().bits(),
            ))?;
            Request::Hello {
                version: u16::from_le_bytes([p[4], p[5]]),
                flags,
                pid: u32::from_le_bytes([p[7], p[8], p[9], p[10]]),
                slot: u64::from_le_bytes([p[11], p[12], p[13], p[14], p[15], p[16], p[17], p[18]]),
            }
        }
        kind::ACQUIRE => Request::Acquire,
        kind::TRY_ACQUIRE => Request::TryAcquire,
        kind::CANCEL => Request::Cancel,
        kind::CANCEL_NOWAIT => Request::CancelNowait,
        kind::RELEASE => Request::Release,
        kind::RETURNED => Request::Returned,
        kind::ABORT => {
            let [byte] = *fixed::<1>(kind, payload)?;
            Request::Abort {
                reason: abort_reason(byte)?,
            }
        }
        kind::STATUS => Request::Status,
        kind::CONTROL => {
            let p = fixed::<CONTROL_LEN>(kind, payload)?;
            let pid = u32::from_le_bytes([p[1], p[2], p[3], p[4]]);
            let value = u32::from_le_bytes([p[5], p[6], p[7], p[8]]);
            Request::Control(match p[0] {
                ControlOp::SET_JOBS if pid == 0 => ControlOp::SetJobs(value),
                ControlOp::CAP => ControlOp::Cap {
                    pid,
                    max: Some(value),
                },
                ControlOp::UNCAP if value == 0 => ControlOp::Cap { pid, max: None },
                op => return Err(ProtocolError::BadControl { op, pid, value }),
            })
        }
        _ => return Err(ProtocolError::UnknownKind(kind)),
    };
    Ok(Some((request, end)))
}

/// Decodes the broker-to-client frame at the start of `buf`.
///
/// Returns `Ok(None)` while `buf` holds less than a whole frame, and
/// `Ok(Some((reply, consumed)))` once it holds one, where `consumed` is the
/// frame's length in bytes (never more than `buf.len()`); bytes after it are
/// left for the next call.
///
/// # Errors
///
/// A frame longer than [`MAX_REPLY_PAYLOAD`] (or, for `Error`,
/// [`MAX_ERROR_MESSAGE`]), of an unknown kind, or of the wrong length for a
/// fixed-size kind is rejected as soon as its 5-byte header is in. A whole
/// frame is rejected for a boolean byte other than 0 or 1, an unknown abort
/// byte, or a string that is not UTF-8.
pub fn decode_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>, ProtocolError> {
    let Some((kind, len)) = header(buf) else {
        return Ok(None);
    };
    if len > MAX_REPLY_PAYLOAD {
        return Err(ProtocolError::Oversized {
            kind,
            len,
            max: MAX_REPLY_PAYLOAD,
        });
    }
    match reply_payload_len(kind).ok_or(ProtocolError::UnknownKind(kind))? {
        ReplyLen::Exact(expected) if len != expected => {
            return Err(ProtocolError::BadLength {
                kind,
                len,
                expected,
            });
        }
        ReplyLen::AtMost(max) if len > max => {
            return Err(ProtocolError::Oversized { kind, len, max });
        }
        ReplyLen::Exact(_) | ReplyLen::AtMost(_) => {}
    }
    let end = HEADER_LEN + len;
    let Some(payload) = buf.get(HEADER_LEN..end) else {
        return Ok(None);
    };
    let reply = match kind {
        kind::WELCOME => {
            let p = fixed::<WELCOME_LEN>(kind, payload)?;
            Reply::Welcome {
                version: u16::from_le_bytes([p[0], p[1]]),
                capacity: u32::from_le_bytes([p[2], p[3], p[4], p[5]]),
                client_id: u64::from_le_bytes([p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13]]),
                slot: u64::from_le_bytes([p[14], p[15], p[16], p[17], p[18], p[19], p[20], p[21]]),
            }
        }
        kind::GRANT => Reply::Grant,
        kind::TAKEN_BACK => Reply::TakenBack,
        kind::CONTROLLED => Reply::Controlled,
        kind::SEGMENT => {
            let p = fixed::<SEGMENT_LEN>(kind, payload)?;
            Reply::Segment {
                owner: u32::from_le_bytes([p[0], p[1], p[2], p[3]]),
                words: u32::from_le_bytes([p[4], p[5], p[6], p[7]]),
            }
        }
        kind::DENIED => Reply::Denied,
        kind::CANCELLED => {
            let [byte] = *fixed::<1>(kind, payload)?;
            let cancelled = match byte {
                0 => false,
                1 => true,
                _ => return Err(ProtocolError::BadBool { kind, byte }),
            };
            Reply::Cancelled { cancelled }
        }
        kind::ABORTED => {
            let [byte] = *fixed::<1>(kind, payload)?;
            Reply::Aborted {
                reason: abort_reason(byte)?,
            }
        }
        kind::STATUS_REPLY => Reply::Status {
            json: utf8(kind, payload)?,
        },
        kind::ERROR => Reply::Error {
            message: utf8(kind, payload)?,
        },
        _ => return Err(ProtocolError::UnknownKind(kind)),
    };
    Ok(Some((reply, end)))
}

/// Bytes received but not yet decoded, for reading frames incrementally.
///
/// Append what each read returns with [`extend`](Self::extend), then call
/// [`next_request`](Self::next_request) (broker side) or
/// [`next_reply`](Self::next_reply) (client side) until it returns
/// `Ok(None)`. Decoded frames are dropped from the buffer, and the space is
/// reused. Because the decoders reject an oversized header at once, a caller
/// that drains every whole frame before reading again never holds more than
/// one bounded frame plus one read's worth of bytes.
///
/// After an error the stream is out of step: every later call returns the
/// same error, and the connection should be closed.
#[derive(Debug, Clone, Default)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    pos: usize,
}

impl FrameBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The number of bytes received and not yet decoded. Non-zero at end of
    /// stream means the peer closed in the middle of a frame.
    pub fn len(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Whether every byte received has been decoded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decodes and removes the next client-to-broker frame, or returns
    /// `Ok(None)` if no whole frame is buffered.
    ///
    /// # Errors
    ///
    /// As [`decode_request`].
    pub fn next_request(&mut self) -> Result<Option<Request>, ProtocolError> {
        self.next_with(decode_request)
    }

    /// Decodes and removes the next broker-to-client frame, or returns
    /// `Ok(None)` if no whole frame is buffered.
    ///
    /// # Errors
    ///
    /// As [`decode_reply`].
    pub fn next_reply(&mut self) -> Result<Option<Reply>, ProtocolError> {
        self.next_with(decode_reply)
    }

    fn next_with<T>(
        &mut self,
        decode: fn(&[u8]) -> Decoded<T>,
    ) -> Result<Option<T>, ProtocolError> {
        let Some((message, consumed)) = decode(&self.buf[self.pos..])? else {
            return Ok(None);
        };
        self.pos += consumed;
        self.compact();
        Ok(Some(message))
    }

    /// Gives back the buffer's memory when nothing is buffered, so an idle
    /// connection holds none.
    pub fn shrink_if_empty(&mut self) {
        if self.is_empty() && self.buf.capacity() > 0 {
            self.buf = Vec::new();
            self.pos = 0;
        }
    }

    /// Drops consumed bytes once they are at least as many as the bytes kept,
    /// so each byte is moved a bounded number of times on average.
    fn compact(&mut self) {
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos >= self.buf.len() - self.pos {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello {
                version: PROTOCOL_VERSION,
                flags: HelloFlags::empty(),
                pid: 4242,
                slot: 0,
            },
            Request::Hello {
                version: 0xbeef,
                flags: HelloFlags::JOB | HelloFlags::OBSERVER | HelloFlags::RECIPE_JOB,
                pid: u32::MAX,
                slot: 0x0102_0304_0506_0708,
            },
            Request::Acquire,
            Request::TryAcquire,
            Request::Cancel,
            Request::CancelNowait,
            Request::Release,
            Request::Abort {
                reason: AbortReason::Error,
            },
            Request::Abort {
                reason: AbortReason::Interrupt,
            },
            Request::Status,
        ]
    }

    fn all_replies() -> Vec<Reply> {
        vec![
            Reply::Welcome {
                version: PROTOCOL_VERSION,
                capacity: 16,
                client_id: 0x0102_0304_0506_0708,
                slot: u64::MAX,
            },
            Reply::Grant,
            Reply::Denied,
            Reply::Cancelled { cancelled: true },
            Reply::Cancelled { cancelled: false },
            Reply::TakenBack,
            Reply::Aborted {
                reason: AbortReason::Error,
            },
            Reply::Aborted {
                reason: AbortReason::Interrupt,
            },
            Reply::Status {
                json: r#"{"capacity":16,"free":3}"#.to_owned(),
            },
            Reply::Status {
                json: String::new(),
            },
            Reply::Error {
                message: "unsupported protocol version 2 (broker speaks 1)".to_owned(),
            },
            Reply::Error {
                message: "é".repeat(10),
            },
        ]
    }

    fn request_bytes(request: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        request.encode(&mut out);
        out
    }

    fn reply_bytes(reply: &Reply) -> Vec<u8> {
        let mut out = Vec::new();
        reply.encode(&mut out);
        out
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_le_bytes().to_vec();
        out.push(kind);
        out.extend_from_slice(payload);
        out
    }

    fn hello_payload(magic: &[u8; 4], flags: u8) -> Vec<u8> {
        let mut p = magic.to_vec();
        p.extend_from_slice(&2u16.to_le_bytes());
        p.push(flags);
        p.extend_from_slice(&7u32.to_le_bytes());
        p.extend_from_slice(&8u64.to_le_bytes());
        p
    }

    #[test]
    fn hello_has_the_documented_layout() {
        let bytes = request_bytes(&Request::Hello {
            version: 2,
            flags: HelloFlags::JOB,
            pid: 0x0a0b_0c0d,
            slot: 0x0102_0304_0506_0708,
        });
        assert_eq!(
            bytes,
            [
                19, 0, 0, 0, 0x01, b'H', b'R', b'D', b'L', 2, 0, 0x01, 0x0d, 0x0c, 0x0b, 0x0a, 8,
                7, 6, 5, 4, 3, 2, 1
            ]
        );
    }

    #[test]
    fn a_version_1_hello_decodes_for_its_refusal() {
        let v1 = [
            0x0f, 0, 0, 0, 0x01, 0x48, 0x52, 0x44, 0x4c, 0x01, 0, 0x01, 0x92, 0x10, 0, 0, 0xa0,
            0x0f, 0, 0,
        ];
        assert_eq!(
            decode_request(&v1),
            Ok(Some((
                Request::Hello {
                    version: 1,
                    flags: HelloFlags::empty(),
                    pid: 4242,
                    slot: 0,
                },
                v1.len()
            )))
        );
    }

    #[test]
    fn welcome_has_the_documented_layout() {
        let bytes = reply_bytes(&Reply::Welcome {
            version: 2,
            capacity: 8,
            client_id: 3,
            slot: 0x0102_0304_0506_0708,
        });
        assert_eq!(
            bytes,
            [22, 0, 0, 0, 0x81, 2, 0, 8, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]
        );
    }

    #[test]
    fn the_documented_example_decodes() {
        let client = [
            0x13, 0, 0, 0, 0x01, 0x48, 0x52, 0x44, 0x4c, 0x02, 0, 0x01, 0x92, 0x10, 0, 0, 0x88,
            0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0, 0, 0, 0, 0x02,
        ];
        let mut fb = FrameBuffer::new();
        fb.extend(&client);
        assert_eq!(
            fb.next_request(),
            Ok(Some(Request::Hello {
                version: 2,
                flags: HelloFlags::JOB,
                pid: 4242,
                slot: 0x1122_3344_5566_7788,
            }))
        );
        assert_eq!(fb.next_request(), Ok(Some(Request::Acquire)));
        let broker = [
            0x16, 0, 0, 0, 0x81, 0x02, 0, 0x07, 0, 0, 0, 0x03, 0, 0, 0, 0, 0, 0, 0, 0xf0, 0xde,
            0xbc, 0x9a, 0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0, 0x82,
        ];
        fb.extend(&broker);
        assert_eq!(
            fb.next_reply(),
            Ok(Some(Reply::Welcome {
                version: 2,
                capacity: 7,
                client_id: 3,
                slot: 0x1234_5678_9abc_def0,
            }))
        );
        assert_eq!(fb.next_reply(), Ok(Some(Reply::Grant)));
        assert!(fb.is_empty());
    }

    #[test]
    fn every_request_round_trips() {
        for request in all_requests() {
            let mut bytes = request_bytes(&request);
            let len = bytes.len();
            assert_eq!(
                decode_request(&bytes),
                Ok(Some((request.clone(), len))),
                "{request:?}"
            );
            bytes.extend_from_slice(&[0xff; 3]);
            assert_eq!(decode_request(&bytes), Ok(Some((request, len))));
        }
    }

    #[test]
    fn every_reply_round_trips() {
        for reply in all_replies() {
            let mut bytes = reply_bytes(&reply);
            let len = bytes.len();
            assert_eq!(
                decode_reply(&bytes),
                Ok(Some((reply.clone(), len))),
                "{reply:?}"
            );
            bytes.extend_from_slice(&[0xff; 3]);
            assert_eq!(decode_reply(&bytes), Ok(Some((reply, len))));
        }
    }

    #[test]
    fn every_truncation_of_a_request_needs_more_bytes() {
        for request in all_requests() {
            let bytes = request_bytes(&request);
            for cut in 0..bytes.len() {
                assert_eq!(
                    decode_request(&bytes[..cut]),
                    Ok(None),
                    "{request:?} at {cut}"
                );
            }
        }
    }

    #[test]
    fn every_truncation_of_a_reply_needs_more_bytes() {
        for reply in all_replies() {
            let bytes = reply_bytes(&reply);
            for cut in 0..bytes.len() {
                assert_eq!(decode_reply(&bytes[..cut]), Ok(None), "{reply:?} at {cut}");
            }
        }
    }

    #[test]
    fn oversized_request_is_rejected_from_the_header() {
        let header = [0, 0, 0x10, 0, kind::ACQUIRE];
        let err = decode_request(&header).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Oversized {
                kind: kind::ACQUIRE,
                len: 1 << 20,
                max: MAX_REQUEST_PAYLOAD
            }
        );
        assert_eq!(
            err.to_string(),
            "frame of kind 0x02 has a 1048576-byte payload; the limit is 64"
        );
        let header = [0xff, 0xff, 0xff, 0xff, 0x99];
        assert!(matches!(
            decode_request(&header),
            Err(ProtocolError::Oversized { kind: 0x99, .. })
        ));
        let header = [65, 0, 0, 0, kind::HELLO];
        assert!(matches!(
            decode_request(&header),
            Err(ProtocolError::Oversized { len: 65, .. })
        ));
    }

    #[test]
    fn oversized_reply_is_rejected_from_the_header() {
        let len = (MAX_REPLY_PAYLOAD as u32 + 1).to_le_bytes();
        let header = [len[0], len[1], len[2], len[3], kind::STATUS_REPLY];
        assert_eq!(
            decode_reply(&header),
            Err(ProtocolError::Oversized {
                kind: kind::STATUS_REPLY,
                len: MAX_REPLY_PAYLOAD + 1,
                max: MAX_REPLY_PAYLOAD
            })
        );
        let header = [0xff, 0xff, 0xff, 0xff, kind::GRANT];
        assert!(matches!(
            decode_reply(&header),
            Err(ProtocolError::Oversized { .. })
        ));
        let header = [1, 4, 0, 0, kind::ERROR];
        assert_eq!(
            decode_reply(&header),
            Err(ProtocolError::Oversized {
                kind: kind::ERROR,
                len: MAX_ERROR_MESSAGE + 1,
                max: MAX_ERROR_MESSAGE
            })
        );
        let header = [0, 4, 0, 0, kind::ERROR];
        assert_eq!(decode_reply(&header), Ok(None));
    }

    #[test]
    fn a_status_at_the_limit_decodes() {
        let json = "x".repeat(MAX_REPLY_PAYLOAD);
        let reply = Reply::Status { json };
        let bytes = reply_bytes(&reply);
        assert_eq!(bytes.len(), HEADER_LEN + MAX_REPLY_PAYLOAD);
        assert_eq!(decode_reply(&bytes), Ok(Some((reply, bytes.len()))));
    }

    #[test]
    fn unknown_kinds_are_rejected_from_the_header() {
        for kind in [0x00, 0x0b, 0x7f, 0x80, 0x81, 0x87, 0x88, 0x89, 0x8a, 0xff] {
            assert_eq!(
                decode_request(&[0, 0, 0, 0, kind]),
                Err(ProtocolError::UnknownKind(kind))
            );
        }
        for kind in [0x00, 0x01, 0x08, 0x09, 0x0a, 0x80, 0x8b, 0xff] {
            assert_eq!(
                decode_reply(&[0, 0, 0, 0, kind]),
                Err(ProtocolError::UnknownKind(kind))
            );
        }
        assert_eq!(
            ProtocolError::UnknownKind(0x42).to_string(),
            "unknown frame kind 0x42"
        );
    }

    #[test]
    fn wrong_lengths_of_fixed_request_kinds_are_rejected_from_the_header() {
        let fixed = [
            (kind::HELLO, HELLO_LEN),
            (kind::ACQUIRE, 0),
            (kind::TRY_ACQUIRE, 0),
            (kind::CANCEL, 0),
            (kind::RELEASE, 0),
            (kind::ABORT, 1),
            (kind::STATUS, 0),
        ];
        for (kind, expected) in fixed {
            for len in 0..=MAX_REQUEST_PAYLOAD {
                if len == expected || (kind == kind::HELLO && len == HELLO_OLD_LEN) {
                    continue;
                }
                let header = [len as u8, 0, 0, 0, kind];
                assert_eq!(
                    decode_request(&header),
                    Err(ProtocolError::BadLength {
                        kind,
                        len,
                        expected
                    })
                );
            }
        }
        assert_eq!(
            decode_request(&[16, 0, 0, 0, kind::HELLO])
                .unwrap_err()
                .to_string(),
            "frame of kind 0x01 has a 16-byte payload; expected 19"
        );
    }

    #[test]
    fn wrong_lengths_of_fixed_reply_kinds_are_rejected_from_the_header() {
        let fixed = [
            (kind::WELCOME, WELCOME_LEN),
            (kind::GRANT, 0),
            (kind::DENIED, 0),
            (kind::CANCELLED, 1),
            (kind::ABORTED, 1),
        ];
        for (kind, expected) in fixed {
            for len in (0..=64).chain([1000, MAX_REPLY_PAYLOAD]) {
                if len == expected {
                    continue;
                }
                let l = (len as u32).to_le_bytes();
                assert_eq!(
                    decode_reply(&[l[0], l[1], l[2], l[3], kind]),
                    Err(ProtocolError::BadLength {
                        kind,
                        len,
                        expected
                    })
                );
            }
        }
    }

    #[test]
    fn bad_magic_is_rejected() {
        let bytes = frame(kind::HELLO, &hello_payload(b"HRDX", 0));
        let err = decode_request(&bytes).unwrap_err();
        assert_eq!(err, ProtocolError::BadMagic(*b"HRDX"));
        assert_eq!(
            err.to_string(),
            "hello has magic \"HRDX\"; expected \"HRDL\""
        );
        let bytes = frame(kind::HELLO, &hello_payload(&[0, 0xff, b'"', b'\n'], 0));
        assert_eq!(
            decode_request(&bytes).unwrap_err().to_string(),
            "hello has magic \"\\x00\\xff\\\"\\n\"; expected \"HRDL\""
        );
    }

    #[test]
    fn any_version_is_accepted() {
        for version in [0, 1, 2, u16::MAX] {
            let mut payload = hello_payload(&MAGIC, 0);
            payload[4..6].copy_from_slice(&version.to_le_bytes());
            let bytes = frame(kind::HELLO, &payload);
            let Ok(Some((Request::Hello { version: v, .. }, 24))) = decode_request(&bytes) else {
                panic!("version {version} rejected");
            };
            assert_eq!(v, version);
        }
    }

    #[test]
    fn unknown_flags_are_rejected() {
        for flags in 0x20..=0xff_u8 {
            let bytes = frame(kind::HELLO, &hello_payload(&MAGIC, flags));
            assert_eq!(
                decode_request(&bytes),
                Err(ProtocolError::UnknownFlags(flags & !0x1f)),
            );
        }
        assert_eq!(
            ProtocolError::UnknownFlags(0x80).to_string(),
            "hello has unknown flag bits 0x80"
        );
    }

    #[test]
    fn encode_drops_undefined_flag_bits() {
        let request = Request::Hello {
            version: 1,
            flags: HelloFlags::from_bits_retain(0xe1),
            pid: 1,
            slot: 1,
        };
        let Ok(Some((Request::Hello { flags, .. }, _))) = decode_request(&request_bytes(&request))
        else {
            panic!("hello with retained bits did not decode");
        };
        assert_eq!(flags, HelloFlags::JOB);
    }

    #[test]
    fn bad_abort_byte_is_rejected() {
        for byte in (0..=0xff_u8).filter(|b| !matches!(b, b'E' | b'I')) {
            assert_eq!(
                decode_request(&frame(kind::ABORT, &[byte])),
                Err(ProtocolError::BadAbortReason(byte))
            );
            assert_eq!(
                decode_reply(&frame(kind::ABORTED, &[byte])),
                Err(ProtocolError::BadAbortReason(byte))
            );
            assert_eq!(AbortReason::from_byte(byte), None);
        }
        for reason in [AbortReason::Error, AbortReason::Interrupt] {
            assert_eq!(AbortReason::from_byte(reason.byte()), Some(reason));
        }
        assert_eq!(
            ProtocolError::BadAbortReason(b'X').to_string(),
            "unknown abort reason byte 0x58; expected 'E' or 'I'"
        );
    }

    #[test]
    fn bad_cancelled_byte_is_rejected() {
        for byte in 2..=0xff_u8 {
            assert_eq!(
                decode_reply(&frame(kind::CANCELLED, &[byte])),
                Err(ProtocolError::BadBool {
                    kind: kind::CANCELLED,
                    byte
                })
            );
        }
    }

    #[test]
    fn invalid_utf8_is_rejected() {
        for kind in [kind::STATUS_REPLY, kind::ERROR] {
            for payload in [&b"\xff"[..], b"ok\xc3", b"\xed\xa0\x80", b"{\"a\":\x80}"] {
                assert_eq!(
                    decode_reply(&frame(kind, payload)),
                    Err(ProtocolError::BadUtf8 { kind })
                );
            }
        }
        assert_eq!(
            ProtocolError::BadUtf8 { kind: 0x86 }.to_string(),
            "frame of kind 0x86 has a payload that is not valid utf-8"
        );
    }

    #[test]
    fn error_message_is_truncated_at_a_char_boundary() {
        // 'é' is two bytes, so 1024 bytes fall in the middle of none and 1023
        // in the middle of one.
        let message = "é".repeat(600);
        let Ok(Some((Reply::Error { message: got }, _))) =
            decode_reply(&reply_bytes(&Reply::Error { message }))
        else {
            panic!("truncated error did not decode");
        };
        assert_eq!(got, "é".repeat(512));

        let message = format!("x{}", "é".repeat(600));
        let Ok(Some((Reply::Error { message: got }, _))) =
            decode_reply(&reply_bytes(&Reply::Error { message }))
        else {
            panic!("truncated error did not decode");
        };
        assert_eq!(got.len(), 1023);
        assert_eq!(got, format!("x{}", "é".repeat(511)));
    }

    #[test]
    fn oversized_status_is_truncated_at_a_char_boundary() {
        let json = format!("x{}", "€".repeat(MAX_REPLY_PAYLOAD / 3 + 1));
        let bytes = reply_bytes(&Reply::Status { json: json.clone() });
        let Ok(Some((Reply::Status { json: got }, consumed))) = decode_reply(&bytes) else {
            panic!("truncated status did not decode");
        };
        assert_eq!(consumed, bytes.len());
        assert!(got.len() <= MAX_REPLY_PAYLOAD);
        assert!(json.starts_with(&got));
        assert!(got.len() > MAX_REPLY_PAYLOAD - 3);
    }

    #[test]
    fn frame_buffer_decodes_concatenated_messages_in_sequence() {
        let requests = all_requests();
        let mut bytes = Vec::new();
        for request in &requests {
            request.encode(&mut bytes);
        }
        let mut fb = FrameBuffer::new();
        fb.extend(&bytes);
        for request in &requests {
            assert_eq!(fb.next_request().as_ref(), Ok(&Some(request.clone())));
        }
        assert_eq!(fb.next_request(), Ok(None));
        assert!(fb.is_empty());

        let replies = all_replies();
        let mut bytes = Vec::new();
        for reply in &replies {
            reply.encode(&mut bytes);
        }
        let mut fb = FrameBuffer::new();
        let mut got = Vec::new();
        // Feed in awkward chunks so frames straddle every kind of boundary.
        for chunk in bytes.chunks(3) {
            fb.extend(chunk);
            while let Some(reply) = fb.next_reply().unwrap() {
                got.push(reply);
            }
        }
        assert_eq!(got, replies);
        assert!(fb.is_empty());
    }

    #[test]
    fn frame_buffer_keeps_a_partial_frame_and_repeats_errors() {
        let mut fb = FrameBuffer::new();
        let mut bytes = request_bytes(&Request::Acquire);
        bytes.extend_from_slice(&request_bytes(&Request::Release)[..3]);
        fb.extend(&bytes);
        assert_eq!(fb.next_request(), Ok(Some(Request::Acquire)));
        assert_eq!(fb.next_request(), Ok(None));
        assert_eq!(fb.len(), 3);
        fb.extend(&[0, 0x05]);
        assert_eq!(fb.next_request(), Ok(Some(Request::Release)));
        assert!(fb.is_empty());

        fb.extend(&[0, 0, 0, 0, 0x42]);
        assert_eq!(fb.next_request(), Err(ProtocolError::UnknownKind(0x42)));
        assert_eq!(fb.next_request(), Err(ProtocolError::UnknownKind(0x42)));
    }

    #[test]
    fn names_are_displayed() {
        let names: Vec<String> = all_requests().iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "Hello",
                "Hello",
                "Acquire",
                "TryAcquire",
                "Cancel",
                "CancelNowait",
                "Release",
                "Abort",
                "Abort",
                "Status"
            ]
        );
        let names: Vec<String> = all_replies().iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "Welcome",
                "Grant",
                "Denied",
                "Cancelled",
                "Cancelled",
                "TakenBack",
                "Aborted",
                "Aborted",
                "Status",
                "Status",
                "Error",
                "Error"
            ]
        );
        assert_eq!(AbortReason::Interrupt.to_string(), "interrupt");
    }

    fn any_abort_reason() -> impl Strategy<Value = AbortReason> {
        prop_oneof![Just(AbortReason::Error), Just(AbortReason::Interrupt)]
    }

    fn any_request() -> impl Strategy<Value = Request> {
        prop_oneof![
            (any::<u16>(), any::<u8>(), any::<u32>(), any::<u64>()).prop_map(
                |(version, flags, pid, slot)| Request::Hello {
                    version,
                    flags: HelloFlags::from_bits_truncate(flags),
                    pid,
                    slot,
                }
            ),
            Just(Request::Acquire),
            Just(Request::TryAcquire),
            Just(Request::Cancel),
            Just(Request::CancelNowait),
            Just(Request::Release),
            any_abort_reason().prop_map(|reason| Request::Abort { reason }),
            Just(Request::Status),
            Just(Request::Returned),
        ]
    }

    fn any_reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            (any::<u16>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
                |(version, capacity, client_id, slot)| Reply::Welcome {
                    version,
                    capacity,
                    client_id,
                    slot,
                }
            ),
            Just(Reply::Grant),
            Just(Reply::Denied),
            any::<bool>().prop_map(|cancelled| Reply::Cancelled { cancelled }),
            Just(Reply::TakenBack),
            any_abort_reason().prop_map(|reason| Reply::Aborted { reason }),
            ".{0,200}".prop_map(|json| Reply::Status { json }),
            ".{0,600}".prop_map(|message| Reply::Error { message }),
            (any::<u32>(), any::<u32>()).prop_map(|(owner, words)| Reply::Segment { owner, words }),
        ]
    }

    /// Arbitrary bytes, and bytes that start with a plausible header so the
    /// payload checks are reached too.
    fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            (
                0u32..80,
                prop_oneof![0x01u8..=0x0a, 0x81u8..=0x8a, any::<u8>()],
                proptest::collection::vec(any::<u8>(), 0..80),
            )
                .prop_map(|(len, kind, rest)| {
                    let mut out = len.to_le_bytes().to_vec();
                    out.push(kind);
                    out.extend(rest);
                    out
                }),
        ]
    }

    proptest! {
        #[test]
        fn decoders_never_panic_and_stay_in_bounds(buf in any_bytes()) {
            if let Ok(Some((request, consumed))) = decode_request(&buf) {
                prop_assert!(consumed <= buf.len());
                // An accepted frame is canonical: it re-encodes to its bytes.
                prop_assert_eq!(request_bytes(&request), &buf[..consumed]);
            }
            if let Ok(Some((reply, consumed))) = decode_reply(&buf) {
                prop_assert!(consumed <= buf.len());
                prop_assert_eq!(reply_bytes(&reply), &buf[..consumed]);
            }
            let mut fb = FrameBuffer::new();
            fb.extend(&buf);
            while let Ok(Some(_)) = fb.next_request() {}
            prop_assert!(fb.len() <= buf.len());
            let mut fb = FrameBuffer::new();
            fb.extend(&buf);
            while let Ok(Some(_)) = fb.next_reply() {}
            prop_assert!(fb.len() <= buf.len());
        }

        #[test]
        fn requests_round_trip(requests in proptest::collection::vec(any_request(), 1..8), chunk in 1usize..32) {
            let mut bytes = Vec::new();
            for request in &requests {
                let start = bytes.len();
                request.encode(&mut bytes);
                prop_assert_eq!(
                    decode_request(&bytes[start..]),
                    Ok(Some((request.clone(), bytes.len() - start)))
                );
            }
            let mut fb = FrameBuffer::new();
            let mut got = Vec::new();
            for piece in bytes.chunks(chunk) {
                fb.extend(piece);
                while let Some(request) = fb.next_request().unwrap() {
                    got.push(request);
                }
            }
            prop_assert_eq!(got, requests);
            prop_assert!(fb.is_empty());
        }

        #[test]
        fn replies_round_trip(replies in proptest::collection::vec(any_reply(), 1..8), chunk in 1usize..64) {
            let mut expected = Vec::new();
            let mut bytes = Vec::new();
            for reply in &replies {
                let start = bytes.len();
                reply.encode(&mut bytes);
                let want = match reply {
                    Reply::Error { message } => Reply::Error {
                        message: truncate_str(message, MAX_ERROR_MESSAGE).to_owned(),
                    },
                    other => other.clone(),
                };
                prop_assert_eq!(
                    decode_reply(&bytes[start..]),
                    Ok(Some((want.clone(), bytes.len() - start)))
                );
                expected.push(want);
            }
            let mut fb = FrameBuffer::new();
            let mut got = Vec::new();
            for piece in bytes.chunks(chunk) {
                fb.extend(piece);
                while let Some(reply) = fb.next_reply().unwrap() {
                    got.push(reply);
                }
            }
            prop_assert_eq!(got, expected);
            prop_assert!(fb.is_empty());
        }
    }
}
