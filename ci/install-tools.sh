#!/usr/bin/env bash
# Installs the system packages the test suite and ci/build-gnu-make-4.4.1.sh
# need: GNU make (Debian's 4.3, also used to build 4.4.1), bmake, dpkg-dev
# (dpkg-source), patch and xz-utils (to unpack the source package), a C
# toolchain with binutils (gcc, whose -flto=jobserver link the tests drive;
# tests/ffi.rs measures a linked program with nm and strip), and python3
# able to make a venv with pip (ci/install-python-tools.sh). apt is skipped
# entirely when everything is already present.
set -euo pipefail

log() { printf '[install-tools] %s\n' "$*"; }

# package:command pairs; an empty command means "check the package only".
wanted=(
  make:make
  bmake:bmake
  dpkg-dev:dpkg-source
  patch:patch
  xz-utils:xz
  gcc:gcc
  binutils:nm
  libc6-dev:
)

missing=()
for entry in "${wanted[@]}"; do
  pkg=${entry%%:*}
  cmd=${entry#*:}
  if [[ -n $cmd ]] && ! command -v "$cmd" >/dev/null 2>&1; then
    missing+=("$pkg")
  elif [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true) != "install ok installed" ]]; then
    missing+=("$pkg")
  fi
done

# Debian's python3 makes venvs only with python3-venv (ensurepip). Checked
# by what python3 can do rather than by package, so that a python3 from
# elsewhere first in PATH (pyenv) with a working venv is enough.
if ! command -v python3 >/dev/null 2>&1; then
  missing+=(python3 python3-venv)
elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi

if ((${#missing[@]} == 0)); then
  log "all tools present, skipping apt"
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    log "need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
logfile=$(mktemp)
trap 'rm -f "$logfile"' EXIT

run_quiet() {
  if ! "$@" >"$logfile" 2>&1; then
    log "failed: $*" >&2
    tail -n 40 "$logfile" >&2
    exit 1
  fi
}

log "missing: ${missing[*]}"
log "apt-get update"
run_quiet "${sudo[@]}" apt-get update -q
log "apt-get install ${missing[*]}"
run_quiet "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"

for entry in "${wanted[@]}"; do
  cmd=${entry#*:}
  if [[ -n $cmd ]] && ! command -v "$cmd" >/dev/null 2>&1; then
    log "still missing after install: $cmd" >&2
    exit 1
  fi
done
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "python3 still cannot make a venv with pip after install: $(command -v python3)" >&2
  exit 1
fi
log "done"
