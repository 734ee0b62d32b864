#!/bin/sh
# One row of docs/RELIABILITY.md: starts `BROKER serve -j 5` on a fresh
# socket, runs `herdless stress CASE` against it (STRESS, default: the
# herdless next to this checkout's release build), stops the broker and
# prints the stress figures (one JSON line) and the broker's last lines.
#
#   scripts/stress-case.sh BROKER CASE SECONDS [stress options]
#
# BROKER may be an older herdless binary: the figures "before" were taken
# with one built from an earlier commit.
set -eu
broker=$1 case=$2 seconds=$3
shift 3
stress=${STRESS:-$(dirname "$0")/../target/release/herdless}
dir=$(mktemp -d "${TMPDIR:-/tmp}/herdless-stress.XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$broker" serve -j 5 --socket "$dir/s.sock" > "$dir/out" 2> "$dir/err" &
pid=$!
i=0
while [ ! -S "$dir/s.sock" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
"$stress" stress "$case" --socket "$dir/s.sock" --seconds "$seconds" "$@" || echo "stress failed: $?"
kill -TERM $pid
wait $pid || echo "broker exit status $?"
tail -n 1 "$dir/err"
