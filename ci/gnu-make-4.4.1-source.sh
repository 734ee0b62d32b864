#!/usr/bin/env bash
# Prepares GNU make 4.4.1's source tree, from the make-dfsg source package of
# Debian trixie (Debian's patches applied, the manual dropped as Debian does),
# at target/src/gnu-make-4.4.1 and prints its path. Does nothing but print
# the path when the tree is already there.
#
# The system's apt lists are left alone: the trixie deb-src list and its
# indexes live in a temporary directory.
set -euo pipefail

version=4.4.1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/target/src/gnu-make-$version

log() { printf '[gnu-make-%s source] %s\n' "$version" "$*" >&2; }

if [[ -f $out/.prepared ]]; then
  echo "$out"
  exit 0
fi

for cmd in apt-get dpkg-source patch xz; do
  if ! command -v "$cmd" >/dev/null 2>&1; then
    log "missing $cmd (run ci/install-tools.sh first)" >&2
    exit 1
  fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gnu-make-$version.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
logfile=$tmp/log

run_quiet() {
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*"
    tail -n 60 "$logfile" >&2
    exit 1
  fi
}

# --- 1. a private deb-src list for trixie --------------------------------
# Taken from the stanzas of the machine's own debian.sources (or the lines of
# sources.list) that name a plain release suite such as "bookworm"; suites
# like "bookworm-updates" or "bookworm-security" have no trixie counterpart
# under the same URI and are skipped.
list=$tmp/trixie-src.list
deb822=/etc/apt/sources.list.d/debian.sources
if [[ -r $deb822 ]]; then
  awk '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && plain && uris != "") {
        opts = (signed != "" && signed !~ / /) ? "[signed-by=" signed "] " : ""
        n = split(uris, u, / +/)
        for (i = 1; i <= n; i++) print "deb-src " opts u[i] " trixie main"
      }
      types = ""; uris = ""; signed = ""; plain = 0
    }
    /^[ \t]*$/ { flush(); next }
    /^#/ { next }
    /^[ \t]/ { next }
    {
      key = $0; sub(/:.*/, "", key); val = $0; sub(/^[^:]*:[ \t]*/, "", val)
      key = tolower(key)
      if (key == "types") types = val
      else if (key == "uris") uris = val
      else if (key == "signed-by") signed = val
      else if (key == "suites") {
        n = split(val, s, / +/)
        for (i = 1; i <= n; i++) if (s[i] !~ /[-\/]/) plain = 1
      }
    }
    END { flush() }
  ' "$deb822" | sort -u >"$list"
fi
if [[ ! -s $list && -r /etc/apt/sources.list ]]; then
  awk '
    $1 == "deb" {
      opts = ""; i = 2
      if ($2 ~ /^\[/) { while ($i !~ /\]$/) { opts = opts $i " "; i++ } opts = opts $i " "; i++ }
      if ($(i + 1) !~ /[-\/]/) print "deb-src " opts $i " trixie main"
    }
  ' /etc/apt/sources.list | sort -u >"$list"
fi
if [[ ! -s $list ]]; then
  echo "deb-src http://deb.debian.org/debian trixie main" >"$list"
fi
log "source list: $(tr '\n' ' ' <"$list")"

lists=$tmp/lists
mkdir -p "$lists/partial"
apt_opts=(
  -q
  -o "Dir::Etc::sourcelist=$list"
  -o "Dir::Etc::sourceparts=/dev/null"
  -o "Dir::State::Lists=$lists"
  -o "Dir::Cache::pkgcache="
  -o "Dir::Cache::srcpkgcache="
  -o "APT::Sandbox::User=root"
)

log "apt-get update (trixie sources only)"
run_quiet apt-get "${apt_opts[@]}" update
log "apt-get source --download-only make-dfsg"
(cd "$tmp" && run_quiet apt-get "${apt_opts[@]}" source --download-only make-dfsg)

shopt -s nullglob
dscs=("$tmp"/make-dfsg_"$version"-*.dsc)
shopt -u nullglob
if ((${#dscs[@]} != 1)); then
  log "expected one make-dfsg_$version-*.dsc, found: $(cd "$tmp" && ls ./*.dsc 2>/dev/null | tr '\n' ' ')" >&2
  exit 1
fi
log "unpacking $(basename "${dscs[0]}")"

# --- 2. unpack, applying Debian's patches --------------------------------
src=$tmp/src
(cd "$tmp" && run_quiet dpkg-source -x "${dscs[0]}" "$src")

# --- 3. Debian drops the manual and patches only Makefile.am; mirror that in
# the generated files so that automake/autoconf are not needed.
cd "$src"
sed -i 's/^SUBDIRS = lib po doc$/SUBDIRS = lib po/' Makefile.in
grep -q '^SUBDIRS = lib po$' Makefile.in || { log "Makefile.in: SUBDIRS edit did not apply" >&2; exit 1; }
sed -i '/^ac_config_files=/s| doc/Makefile||' configure
if grep '^ac_config_files=' configure | grep -q 'doc/Makefile'; then
  log "configure: ac_config_files edit did not apply" >&2
  exit 1
fi
mkdir -p doc
cp debian/make.1 doc/make.1

touch .prepared
mkdir -p "$(dirname "$out")"
rm -rf "$out"
cp -a "$src" "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
log "prepared $out"
echo "$out"
