#!/usr/bin/env bash
# Prepares the source tree of a Debian source package, Debian's patches
# applied, at target/src/NAME-VERSION and prints its path:
#
#   bash ci/debian-source.sh NAME VERSION SUITE PACKAGE [FIXUP]
#
# fetches PACKAGE's VERSION (the upstream version; Debian's revision may be
# any) from SUITE's deb-src, unpacks it with dpkg-source and, when FIXUP (a
# script) is given, runs it in the tree before the tree is marked prepared.
# Does nothing but print the path when the tree is already there.
#
# The system's apt lists are left alone: the deb-src list and its indexes
# live in a temporary directory.
set -euo pipefail

if (($# < 4)); then
  echo "usage: $0 NAME VERSION SUITE PACKAGE [FIXUP]" >&2
  exit 2
fi
name=$1 version=$2 suite=$3 package=$4 fixup=${5:-}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/target/src/$name-$version

log() { printf '[%s-%s source] %s\n' "$name" "$version" "$*" >&2; }

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

tmp=$(mktemp -d "${TMPDIR:-/tmp}/$name-$version.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
logfile=$tmp/log

run_quiet() {
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*"
    tail -n 60 "$logfile" >&2
    exit 1
  fi
}

# --- 1. a private deb-src list for the suite ------------------------------
# Taken from the stanzas of the machine's own debian.sources (or the lines of
# sources.list) that name a plain release suite such as "bookworm"; suites
# like "bookworm-updates" or "bookworm-security" have no counterpart in the
# suite
# under the same URI and are skipped.
list=$tmp/$suite-src.list
deb822=/etc/apt/sources.list.d/debian.sources
if [[ -r $deb822 ]]; then
  awk -v suite="$suite" '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && plain && uris != "") {
        opts = (signed != "" && signed !~ / /) ? "[signed-by=" signed "] " : ""
        n = split(uris, u, / +/)
        for (i = 1; i <= n; i++) print "deb-src " opts u[i] " " suite " main"
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
  awk -v suite="$suite" '
    $1 == "deb" {
      opts = ""; i = 2
      if ($2 ~ /^\[/) { while ($i !~ /\]$/) { opts = opts $i " "; i++ } opts = opts $i " "; i++ }
      if ($(i + 1) !~ /[-\/]/) print "deb-src " opts $i " " suite " main"
    }
  ' /etc/apt/sources.list | sort -u >"$list"
fi
if [[ ! -s $list ]]; then
  echo "deb-src http://deb.debian.org/debian $suite main" >"$list"
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

log "apt-get update ($suite sources only)"
run_quiet apt-get "${apt_opts[@]}" update
log "apt-get source --download-only --only-source $package/$suite"
(cd "$tmp" && run_quiet apt-get "${apt_opts[@]}" source --download-only --only-source "$package/$suite")

shopt -s nullglob
dscs=("$tmp"/"$package"_"$version"-*.dsc)
shopt -u nullglob
if ((${#dscs[@]} != 1)); then
  log "expected one ${package}_$version-*.dsc, found: $(cd "$tmp" && ls ./*.dsc 2>/dev/null | tr '\n' ' ')" >&2
  exit 1
fi
log "unpacking $(basename "${dscs[0]}")"

# --- 2. unpack, applying Debian's patches --------------------------------
src=$tmp/src
(cd "$tmp" && run_quiet dpkg-source -x "${dscs[0]}" "$src")

# --- 3. the caller's fixups ---------------------------------------------
cd "$src"
if [[ -n $fixup ]]; then
  log "fixups: $fixup"
  bash "$fixup"
fi

touch .prepared
mkdir -p "$(dirname "$out")"
rm -rf "$out"
cp -a "$src" "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
log "prepared $out"
echo "$out"
