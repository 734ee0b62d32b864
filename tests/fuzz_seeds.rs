//! Replays the committed seeds of the fuzz targets (`fuzz/corpus/TARGET/*`,
//! minimised corpora of cargo-fuzz runs, and `fuzz/seeds/TARGET/*`)
//! through the same checks, on the
//! stable toolchain, so every property the fuzzers check is checked here
//! too on each test run.

#[path = "../fuzz/checks.rs"]
mod checks;

fn replay(target: &str, check: fn(&[u8])) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut seeds = 0;
    // The minimised corpus, and the hand-written seeds and past crash
    // inputs, which a minimisation may drop.
    for dir in [
        root.join("corpus").join(target),
        root.join("seeds").join(target),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(outcome.is_ok(), "{target}: seed {} fails", path.display());
            seeds += 1;
        }
    }
    assert!(seeds > 0, "no seeds for {target} under {}", root.display());
}

#[test]
fn decode_request_seeds() {
    replay("decode_request", checks::decode_request);
}

#[test]
fn decode_reply_seeds() {
    replay("decode_reply", checks::decode_reply);
}

#[test]
fn frame_buffer_seeds() {
    replay("frame_buffer", checks::frame_buffer);
}

#[test]
fn makeflags_seeds() {
    replay("makeflags", checks::makeflags);
}

#[test]
fn pool_seeds() {
    replay("pool", checks::pool);
}
