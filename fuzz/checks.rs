//! What each fuzz target checks, shared by the cargo-fuzz targets and by
//! the stable test suite, which replays the committed seeds
//! (`tests/fuzz_seeds.rs`). Each function panics when a property fails.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use herdless::classic::{Auth, Flavor, Jobserver};
use herdless::pool::{ClientId, ClientInfo, Effect, Pool, SlotKey};
use herdless::protocol::{self, AbortReason, FrameBuffer, ProtocolError};

/// Any bytes: the request decoder never panics, never claims more bytes
/// than it was given, and what it decodes encodes back to the same frame.
pub fn decode_request(data: &[u8]) {
    if let Ok(Some((req, used))) = protocol::decode_request(data) {
        assert!(used <= data.len() && used >= protocol::HEADER_LEN);
        let mut again = Vec::new();
        req.encode(&mut again);
        assert_eq!(&again[..], &data[..used], "{req:?} re-encodes differently");
    }
}

/// Any bytes: as [`decode_request`], for replies.
pub fn decode_reply(data: &[u8]) {
    if let Ok(Some((reply, used))) = protocol::decode_reply(data) {
        assert!(used <= data.len() && used >= protocol::HEADER_LEN);
        let mut again = Vec::new();
        reply.encode(&mut again);
        let back = protocol::decode_reply(&again).unwrap().unwrap();
        assert_eq!(back.0, reply);
    }
}

/// The outcome of decoding a stream frame by frame.
#[derive(Debug, PartialEq)]
enum Outcome<T> {
    Frames(Vec<T>),
    Error(Vec<T>, ProtocolError),
}

fn feed<T>(
    chunks: &[&[u8]],
    mut next: impl FnMut(&mut FrameBuffer) -> Result<Option<T>, ProtocolError>,
) -> Outcome<T> {
    let mut fb = FrameBuffer::new();
    let mut got = Vec::new();
    for chunk in chunks {
        fb.extend(chunk);
        loop {
            match next(&mut fb) {
                Ok(Some(m)) => got.push(m),
                Ok(None) => break,
                Err(e) => return Outcome::Error(got, e),
            }
        }
        fb.shrink_if_empty();
    }
    Outcome::Frames(got)
}

/// The first byte picks the split points of the rest: however the bytes
/// arrive, a `FrameBuffer` yields the same frames and the same error as
/// when they arrive at once, and never holds more than the bytes not yet
/// decoded.
pub fn frame_buffer(data: &[u8]) {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let mut chunks = Vec::new();
    let mut rest = stream;
    let mut k = u32::from(seed) | 1;
    while !rest.is_empty() {
        k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = 1 + (k >> 16) as usize % 17;
        let (a, b) = rest.split_at(n.min(rest.len()));
        chunks.push(a);
        rest = b;
    }
    let whole = feed(&[stream], FrameBuffer::next_request);
    let split = feed(&chunks, FrameBuffer::next_request);
    assert_eq!(whole, split);
    let whole = feed(&[stream], FrameBuffer::next_reply);
    let split = feed(&chunks, FrameBuffer::next_reply);
    assert_eq!(whole, split);
}

/// Any MAKEFLAGS value: the parser never panics; and the value `run`
/// exports for a child, made from it by [`Jobserver::makeflags`] (an outer
/// make's job count and jobserver flags replaced by this jobserver's), is
/// read back as exactly this jobserver, whatever the value held before.
pub fn makeflags(data: &[u8]) {
    let value = OsStr::from_bytes(data);
    let _ = Jobserver::parse("MAKEFLAGS", value);
    for flavor in [Flavor::Gnu, Flavor::Bmake] {
        let ours = Jobserver::new(Auth::Fds { read: 3, write: 4 }, flavor, Some(7));
        let written = ours.makeflags(Some(value));
        let back = Jobserver::parse("MAKEFLAGS", &written)
            .unwrap_or_else(|e| panic!("{value:?} -> {written:?}: {e}"))
            .unwrap_or_else(|| panic!("{value:?} -> {written:?} lost the jobserver"));
        assert_eq!(back.auth(), ours.auth(), "{value:?} -> {written:?}");
        assert_eq!(back.flavor(), flavor, "{value:?} -> {written:?}");
        assert_eq!(back.jobs(), Some(7), "{value:?} -> {written:?}");
    }
}

/// Any sequence of operations on a pool of up to 4 tokens, by up to 8
/// clients that may borrow slots (minted ones, never reused, as the broker
/// mints them, and recipe ones, made by their first user): after each one
/// the pool's invariants hold, no token is unaccounted for, and an effect
/// goes only to a connected client.
pub fn pool(data: &[u8]) {
    let Some((&cap, ops)) = data.split_first() else {
        return;
    };
    let mut pool = Pool::new(u32::from(cap % 5));
    let mut clients: Vec<ClientId> = Vec::new();
    let mut connected = std::collections::HashSet::new();
    let mut minted: Vec<u64> = Vec::new();
    for (step, pair) in ops.chunks(2).enumerate() {
        let (op, arg) = (pair[0], pair.get(1).copied().unwrap_or(0));
        let now = Duration::from_millis(step as u64);
        let pick = |clients: &[ClientId]| {
            (!clients.is_empty()).then(|| clients[usize::from(arg) % clients.len()])
        };
        match op % 8 {
            0 if clients.len() < 8 => {
                let borrows = match (arg & 0x10 != 0, arg & 0x08 != 0) {
                    (false, _) => None,
                    (true, true) => Some(SlotKey::Recipe(1 + u32::from(arg % 3))),
                    (true, false) if minted.is_empty() => None,
                    (true, false) => Some(SlotKey::Minted(minted[usize::from(arg) % minted.len()])),
                };
                let id = pool.connect(ClientInfo {
                    pid: 100 + step as u32,
                    borrows,
                    observer: arg & 0x60 == 0x60,
                    label: "native",
                    internal: false,
                });
                clients.push(id);
                connected.insert(id);
            }
            1 => {
                if let Some(id) = pick(&clients) {
                    let _ = pool.acquire(id, now);
                }
            }
            2 => {
                if let Some(id) = pick(&clients) {
                    let _ = pool.try_acquire(id);
                }
            }
            3 => {
                if let Some(id) = pick(&clients) {
                    // An odd argument: the withdrawal nobody waits for,
                    // which takes a raced grant back.
                    let _ = if arg & 1 == 1 {
                        pool.cancel_or_take_back(id, now)
                    } else {
                        pool.cancel(id)
                    };
                }
            }
            4 | 5 => {
                if let Some(id) = pick(&clients) {
                    let _ = pool.release(id, now);
                }
            }
            6 => {
                if let Some(id) = pick(&clients) {
                    pool.disconnect(id, now);
                    clients.retain(|&c| c != id);
                    connected.remove(&id);
                }
            }
            7 if arg == 0xAB => {
                pool.abort(AbortReason::Error);
            }
            7 => {
                // A fresh slot: the top one (counted as the N-th token) or
                // one owned by a client.
                let owner = if arg & 0x80 != 0 {
                    pick(&clients)
                } else {
                    None
                };
                let key = 1000 + minted.len() as u64;
                if pool.add_slot(SlotKey::Minted(key), owner, owner.is_none()) {
                    minted.push(key);
                }
            }
            _ => {}
        }
        for effect in pool.take_effects() {
            let client = match effect {
                Effect::Grant { client, .. }
                | Effect::Denied { client }
                | Effect::Cancelled { client, .. }
                | Effect::TakenBack { client }
                | Effect::Aborted { client, .. }
                | Effect::Stopped { client }
                | Effect::Swapped { client, .. } => client,
            };
            assert!(
                connected.contains(&client),
                "step {step}: {effect:?} to a gone client"
            );
        }
        if let Err(e) = pool.check_invariants() {
            panic!("step {step} (op {op}, arg {arg}): {e}");
        }
        assert_eq!(pool.unaccounted(), 0, "step {step}");
        assert!(pool.free() <= pool.capacity());
    }
    for id in clients {
        pool.disconnect(id, Duration::from_secs(1));
    }
    let _ = pool.take_effects();
    assert_eq!(
        pool.free(),
        pool.capacity(),
        "tokens left out once every client is gone"
    );
}
