#!/usr/bin/env bash
# Builds Debian's bmake 20200710 twice, from its source package
# (embed/bmake/source.sh) with Debian's own build flags:
#
#   target/embed/bmake/bin/bmake          herdless.patch: job tokens from
#                                         a herdless broker (linked with
#                                         libherdless.a)
#   target/embed/bmake-polling/bin/bmake  polling.patch: stock, but polling
#                                         the token pipe while it wants a
#                                         token, as bmake does since 2022
#                                         (NetBSD) and FreeBSD's does
#
# Debian's own /usr/bin/bmake is the third, non-polling variant. Each build
# is skipped when its binary is there and was built from the same patch,
# script and library (a stamp of their checksums).
#
# HERDLESS_PROFILE=debug links the debug library instead of the release one.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/embed/bmake
embed_name=bmake
logfile=$root/target/embed/bmake-build.log
# shellcheck source=embed/lib.sh
source "$root/embed/lib.sh"

# build NAME PATCH [LIBS]: target/embed/NAME/bin/bmake
build() {
  local name=$1 patch=$2 libs=${3:-}
  local dest=$root/target/embed/$name
  local bin=$dest/bin/bmake
  local stamp
  stamp=$(cat "$here/$patch" "$here/build.sh" "$root/embed/lib.sh" ${libs:+"$lib" "$root/crates/ffi/include/herdless.h"} |
    sha256sum | cut -d' ' -f1)
  if [[ -x $bin && -f $dest/stamp && $(cat "$dest/stamp") == "$stamp" ]]; then
    log "up to date: $bin"
    return
  fi
  local src build
  src=$(bash "$here/source.sh")
  build=$dest/build
  rm -rf "$build"
  mkdir -p "$dest"
  cp -a "$src" "$build"
  (
    cd "$build"
    log "$name: patch"
    run_quiet patch -p1 -i "$here/$patch"
    log "$name: configure"
    run_quiet ./configure -q --with-machine=debian
    local version
    version=$(sed -n -e '/MAKE_VERSION=[^0-9]*[0-9]/s,.*=[^0-9]*,,p' Makefile VERSION | head -n 1)
    local arch=x86_64
    arch=$(dpkg-architecture -qDEB_HOST_ARCH_CPU 2>/dev/null || uname -m)
    local multiarch
    multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")
    # Debian's CFLAGS (debian/rules), with -O2 -g for dpkg-buildflags;
    # escaped for the shell that runs Makefile.boot's recipes.
    local q='\"'
    local cflags="-O2 -g -D__COPYRIGHT\\(x\\)= -D__RCSID\\(x\\)= -I."
    cflags+=" -DMACHINE=${q}debian${q} -DMACHINE_ARCH=${q}$arch${q}"
    cflags+=" -DMACHINE_MULTIARCH=${q}$multiarch${q}"
    cflags+=" -DHAVE_CONFIG_H -DNEED_HOST_CDEFS_H -DMAKE_NATIVE -DUSE_META"
    cflags+=" -D_PATH_DEFSYSPATH=${q}/usr/share/mk${q}"
    cflags+=" -DMAKE_VERSION=${q}$version${q} -Wno-unused -I$root/crates/ffi/include"
    log "$name: make -f Makefile.boot"
    run_quiet make -j"$(nproc 2>/dev/null || echo 2)" -f Makefile.boot \
      CFLAGS="$cflags" LIBS="$libs"
    [[ -x bmake ]] || { log "$name: no bmake built"; exit 1; }
  )
  mkdir -p "$dest/bin"
  cp "$build/bmake" "$bin.tmp.$$"
  mv -f "$bin.tmp.$$" "$bin"
  echo "$stamp" >"$dest/stamp"
  log "installed $bin"
}

build bmake herdless.patch "$lib $libs_private"
build bmake-polling polling.patch
