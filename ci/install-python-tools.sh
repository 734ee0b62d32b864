#!/usr/bin/env bash
# Installs the Python-packaged tools the tests drive into a virtual
# environment at target/tools/venv: ninja (1.13 or later, the first release
# that reads a jobserver) and prometheus_client (its parser checks
# `herdless status --format openmetrics`). Does nothing when the venv already
# has both at the wanted versions.
#
# Needs python3 with venv and ensurepip (Debian: python3-venv, installed by
# ci/install-tools.sh). With HERDLESS_NINJA naming a ninja from the system's
# packages (where PyPI has no ninja wheel: the BSDs), only prometheus_client
# is installed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/target/tools/venv
python=${PYTHON:-python3}

# What the tests need, as pip requirements.
requirements=("prometheus_client>=0.17,<1")
want_ninja=1
if [[ -n ${HERDLESS_NINJA:-} ]]; then
  want_ninja=0
else
  requirements+=("ninja>=1.13,<2")
fi

log() { printf '[install-python-tools] %s\n' "$*"; }

have_all() {
  [[ -x $venv/bin/python ]] || return 1
  ((want_ninja == 0)) || [[ -x $venv/bin/ninja ]] || return 1
  "$venv/bin/python" - "$want_ninja" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version

def parse(v):
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())

wanted = {"prometheus_client": (0, 17)}
if sys.argv[1] == "1":
    wanted["ninja"] = (1, 13)
for name, least in wanted.items():
    if parse(version(name)) < least:
        sys.exit(1)
import prometheus_client.openmetrics.parser  # noqa: F401
PY
}

if have_all; then
  log "already installed in $venv: ${requirements[*]}"
  exit 0
fi

if ! command -v "$python" >/dev/null 2>&1; then
  log "missing $python (run ci/install-tools.sh first)" >&2
  exit 1
fi
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "$python cannot make a venv with pip (Debian: apt-get install python3-venv; ci/install-tools.sh does)" >&2
  exit 1
fi

logfile=$(mktemp)
trap 'rm -f "$logfile"' EXIT
run_quiet() {
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*" >&2
    tail -n 40 "$logfile" >&2
    exit 1
  fi
}

if [[ ! -x $venv/bin/python ]]; then
  log "$python -m venv $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  run_quiet "$python" -m venv "$venv"
fi
log "pip install ${requirements[*]}"
run_quiet "$venv/bin/python" -m pip install -q --disable-pip-version-check "${requirements[@]}"

if ! have_all; then
  log "still missing after pip install: ${requirements[*]}" >&2
  exit 1
fi
log "installed in $venv: ${requirements[*]}"
