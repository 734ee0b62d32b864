# Shared by embed/*/build.sh. The caller sets `root` (the checkout),
# `embed_name` (for its log lines) and `logfile`, then sources this file,
# which defines `log` and `run_quiet` (a step's output goes to the log,
# shown only when it fails) and builds the C ABI library for the profile
# chosen by HERDLESS_PROFILE (release by default): `lib` is its path,
# `libs_private` the system libraries it needs (from herdless.pc).
target=${CARGO_TARGET_DIR:-$root/target}
profile=${HERDLESS_PROFILE:-release}

log() { printf '[embed/%s] %s\n' "$embed_name" "$*" >&2; }

mkdir -p "$(dirname "$logfile")"
: >"$logfile"
run_quiet() {
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*"
    tail -n 60 "$logfile" >&2
    exit 1
  fi
}

if [[ $profile == release ]]; then
  run_quiet cargo build --release --locked -p herdless-ffi
else
  run_quiet cargo build --locked -p herdless-ffi
fi
lib=$target/$profile/libherdless.a
[[ -f $lib ]] || {
  log "no $lib"
  exit 1
}
libs_private=$(sed -n 's/^Libs.private: //p' "$root/crates/ffi/herdless.pc")
