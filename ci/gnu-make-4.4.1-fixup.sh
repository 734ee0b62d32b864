#!/usr/bin/env bash
# Run by ci/debian-source.sh in the unpacked make-dfsg 4.4.1 tree. Debian
# drops the manual and patches only Makefile.am; this mirrors that in the
# generated files so that automake and autoconf are not needed.
set -euo pipefail

fail() { printf '[gnu-make-4.4.1 source] %s\n' "$*" >&2; exit 1; }

sed -i 's/^SUBDIRS = lib po doc$/SUBDIRS = lib po/' Makefile.in
grep -q '^SUBDIRS = lib po$' Makefile.in || fail "Makefile.in: SUBDIRS edit did not apply"
sed -i '/^ac_config_files=/s| doc/Makefile||' configure
if grep '^ac_config_files=' configure | grep -q 'doc/Makefile'; then
  fail "configure: ac_config_files edit did not apply"
fi
mkdir -p doc
cp debian/make.1 doc/make.1
