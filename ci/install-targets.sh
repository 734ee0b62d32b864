#!/usr/bin/env bash
# Adds the Rust standard libraries of the targets named on the command line
# (.ci/run type-checks and lints the BSD and Apple code with them) to the
# active toolchain. rustup is skipped entirely when every target is already
# installed. Nothing else is needed: clippy does not link, and no crate in
# the tree compiles C for the target.
set -euo pipefail

log() { printf '[install-targets] %s\n' "$*"; }

if ! command -v rustup >/dev/null 2>&1; then
  log "rustup is needed to add the targets: $*" >&2
  exit 1
fi

is_installed() { grep -qxF "$1" <<<"$(rustup target list --installed)"; }

missing=()
for target in "$@"; do
  if ! is_installed "$target"; then
    missing+=("$target")
  fi
done

if ((${#missing[@]} == 0)); then
  log "all targets present, skipping rustup"
  exit 0
fi

logfile=$(mktemp)
trap 'rm -f "$logfile"' EXIT

log "rustup target add ${missing[*]}"
if ! rustup target add "${missing[@]}" >"$logfile" 2>&1; then
  log "failed: rustup target add ${missing[*]}" >&2
  tail -n 40 "$logfile" >&2
  exit 1
fi

for target in "${missing[@]}"; do
  if ! is_installed "$target"; then
    log "still missing after rustup: $target" >&2
    exit 1
  fi
done
log "done"
