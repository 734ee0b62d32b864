#!/usr/bin/env bash
# Builds GNU make 4.4.1 (the first release with `--jobserver-auth=fifo:PATH`)
# from the make-dfsg source package of Debian trixie, and installs the binary
# at target/tools/gnu-make-4.4.1/bin/make. Does nothing when that binary is
# already there and reports 4.4.1.
#
# The system's apt lists are left alone: the trixie deb-src list and its
# indexes live in a temporary directory.
set -euo pipefail

version=4.4.1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=$root/target/tools/gnu-make-$version
bin=$dest/bin/make

log() { printf '[gnu-make-%s] %s\n' "$version" "$*"; }

reports_version() {
  [[ -x $1 ]] && [[ $("$1" --version 2>/dev/null | head -n 1) == "GNU Make $version" ]]
}

if reports_version "$bin"; then
  log "already built: $bin"
  exit 0
fi

src=$(bash "$root/ci/gnu-make-4.4.1-source.sh")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gnu-make-$version.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
logfile=$tmp/log

run_quiet() {
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*" >&2
    tail -n 60 "$logfile" >&2
    exit 1
  fi
}

# Build out of the source tree, which stays pristine for other builds.
cp -a "$src" "$tmp/src"
cd "$tmp/src"

# --- 4. configure and build -----------------------------------------------
log "configure"
run_quiet ./configure -q --disable-nls --without-guile --disable-dependency-tracking
jobs=$(nproc 2>/dev/null || echo 2)
log "make -j$jobs"
run_quiet make -j"$jobs" ACLOCAL=: AUTOCONF=: AUTOMAKE=: AUTOHEADER=: MAKEINFO=:

if ! reports_version ./make; then
  log "built binary does not report GNU Make $version: $(./make --version 2>&1 | head -n 1)" >&2
  exit 1
fi

mkdir -p "$dest/bin"
cp ./make "$bin.tmp.$$"
mv -f "$bin.tmp.$$" "$bin"
cd "$root"
log "installed $bin: $("$bin" --version | head -n 1)"
