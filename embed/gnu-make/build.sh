#!/usr/bin/env bash
# Builds GNU make 4.4.1 with herdless as its jobserver backend:
# target/embed/gnu-make/bin/make.
#
# Debian's make-dfsg source (ci/gnu-make-4.4.1-source.sh) is configured and
# compiled unmodified; herdless-jobserver.c (here) is compiled against its
# headers and linked in with `-Wl,--wrap=` for each jobserver function of
# src/os.h (and reap_children), together with libherdless.a from
# `cargo build --release -p herdless-ffi`.
#
# Does nothing when the binary is there and was built from the same glue,
# build script and library (a stamp of their checksums). The configured
# tree is kept in target/embed/gnu-make/build, so a changed glue or library
# only recompiles the glue and relinks.
#
# HERDLESS_PROFILE=debug links the debug library (cargo build -p
# herdless-ffi) instead of the release one.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/embed/gnu-make
dest=$root/target/embed/gnu-make
build=$dest/build
bin=$dest/bin/make

# --- the library --------------------------------------------------------
embed_name=gnu-make
logfile=$dest/build.log
# shellcheck source=embed/lib.sh
source "$root/embed/lib.sh"

stamp=$(cat "$here/herdless-jobserver.c" "$here/build.sh" "$root/embed/lib.sh" "$lib" \
  "$root/crates/ffi/include/herdless.h" | sha256sum | cut -d' ' -f1)
if [[ -x $bin && -f $dest/stamp && $(cat "$dest/stamp") == "$stamp" ]]; then
  log "up to date: $bin"
  exit 0
fi

# --- configure once -------------------------------------------------------
if [[ ! -f $build/.configured ]]; then
  src=$(bash "$root/ci/gnu-make-4.4.1-source.sh")
  rm -rf "$build"
  cp -a "$src" "$build"
  log "configure"
  (cd "$build" && run_quiet ./configure -q --disable-nls --without-guile \
    --disable-dependency-tracking)
  touch "$build/.configured"
fi

# --- the glue -------------------------------------------------------------
wrapped=(
  jobserver_enabled jobserver_setup jobserver_parse_auth jobserver_get_auth
  jobserver_get_invalid_auth jobserver_clear jobserver_acquire_all
  jobserver_release jobserver_signal jobserver_pre_child jobserver_post_child
  jobserver_pre_acquire jobserver_acquire reap_children
)
wrap_flags=""
for f in "${wrapped[@]}"; do wrap_flags+=" -Wl,--wrap=$f"; done

cd "$build"
log "compile the glue"
run_quiet cc -O2 -g -Wall -Wextra -Werror -Wno-unused-parameter \
  -DHAVE_CONFIG_H -Isrc -Ilib -I"$root/crates/ffi/include" \
  -c "$here/herdless-jobserver.c" -o herdless-jobserver.o
configured_libs=$(sed -n 's/^LIBS = //p' Makefile)
rm -f make
jobs=$(nproc 2>/dev/null || echo 2)
log "make -j$jobs"
run_quiet make -j"$jobs" ACLOCAL=: AUTOCONF=: AUTOMAKE=: AUTOHEADER=: MAKEINFO=: \
  LDFLAGS="$wrap_flags" \
  LIBS="$build/herdless-jobserver.o $lib $configured_libs $libs_private"

if [[ $(./make --version | head -n 1) != "GNU Make 4.4.1" ]]; then
  log "the built make does not report GNU Make 4.4.1"
  exit 1
fi
# Every wrapped function must really be routed through the glue.
symbols=$(nm make)
for f in "${wrapped[@]}"; do
  if ! grep -q " T __wrap_$f\$" <<<"$symbols"; then
    log "the link did not route $f through the glue"
    exit 1
  fi
done

mkdir -p "$dest/bin"
cp make "$bin.tmp.$$"
mv -f "$bin.tmp.$$" "$bin"
echo "$stamp" >"$dest/stamp"
log "installed $bin"
