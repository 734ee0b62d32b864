//! Takes and gives back one token N times (default 100 000) with nobody
//! else waiting, and prints the path the client used and the time per
//! acquire and release: the uncontended cost of the shared token table
//! against the socket (`HERDLESS_FAST_PATH=0`). Run it under a broker:
//!
//! ```text
//! eval "$(herdless serve -j 4 &)"   # or inside `herdless run --no-classic`
//! cargo run --release -p herdless --example acquire_loop -- 100000
//! HERDLESS_FAST_PATH=0 cargo run --release -p herdless --example acquire_loop
//! ```

use herdless::client::{Client, Options};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u32 = match std::env::args().nth(1) {
        Some(s) => s.parse()?,
        None => 100_000,
    };
    let client = Client::from_env_with(Options::default().implicit_token(false))?;
    // The first take connects everything up; it is not timed.
    drop(client.acquire()?);
    let start = std::time::Instant::now();
    for _ in 0..n {
        let token = client.acquire()?;
        token.release()?;
    }
    let each = start.elapsed().as_secs_f64() * 1e6 / f64::from(n.max(1));
    println!(
        "{}: {n} acquires and releases, {each:.3} µs each",
        client.token_path()
    );
    Ok(())
}
