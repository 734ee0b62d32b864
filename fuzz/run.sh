#!/bin/sh
# Runs each fuzz target for RUNS executions (default 10 million, at most
# MAX_SECONDS each), one at a time and at low priority, then merges what it
# found into the committed, minimised seeds under corpus/TARGET.
#
#   fuzz/run.sh [TARGET...]
#
# SANITIZER (default address) is passed to `cargo fuzz -s`: `none` runs
# about three times faster, and the fuzzed code is safe Rust. FUZZ_ARGS
# adds libFuzzer options, for example `-max_len=512`.
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
set -eu
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
max=${MAX_SECONDS:-1200}
san=${SANITIZER:-address}
extra=${FUZZ_ARGS:-}
targets=${*:-decode_request decode_reply frame_buffer makeflags pool}
for t in $targets; do
    mkdir -p "corpus-run/$t" "corpus/$t"
    [ -d "seeds/$t" ] && cp -n "seeds/$t"/* "corpus-run/$t/" 2>/dev/null || true
    cp -n "corpus/$t"/* "corpus-run/$t/" 2>/dev/null || true
    nice -n 19 cargo +nightly fuzz run -s "$san" -O "$t" "corpus-run/$t" -- \
        $extra -runs="$runs" -max_total_time="$max" -print_final_stats=1 \
        2>&1 | tee "corpus-run/$t.log" | grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|==[0-9]+== ERROR|SUMMARY)" || true
    # Keep a minimal set that covers the same edges.
    mkdir -p "corpus-run/$t.min"
    nice -n 19 cargo +nightly fuzz cmin -s "$san" -O "$t" "corpus-run/$t" > /dev/null 2>&1 || true
    rm -rf "corpus/$t"
    mkdir -p "corpus/$t"
    cp "corpus-run/$t"/* "corpus/$t/"
done
