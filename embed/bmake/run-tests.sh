#!/usr/bin/env bash
# Runs bmake 20200710's own unit tests (unit-tests/ of Debian's source)
# against Debian's bmake, the pipe-polling build and the herdless build
# (embed/bmake/build.sh), and compares: each build must pass exactly the
# tests Debian's passes, and the herdless build must really have used
# herdless (native grants > 0 from the brokers its -jN tests start).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
src=$root/target/embed/bmake/build/unit-tests
debian=${HERDLESS_DEBIAN_BMAKE:-/usr/bin/bmake}
polling=$root/target/embed/bmake-polling/bin/bmake
herdless=$root/target/embed/bmake/bin/bmake

for b in "$debian" "$polling" "$herdless"; do
  [[ -x $b ]] || { echo "missing $b (embed/bmake/build.sh)" >&2; exit 1; }
done
[[ -f $src/Makefile ]] || { echo "missing $src (embed/bmake/build.sh)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/bmake-tests.XXXXXX")
[[ -n ${KEEP:-} ]] || trap 'rm -rf "$work"' EXIT

tests=$(cd "$src" && MAKEFLAGS= "$debian" -r -m / -V TESTS)

# run NAME BINARY: prints "passed/total", leaves NAME.failed and NAME.stats
run() {
  local name=$1 bin=$2 dir=$work/$1/unit-tests
  mkdir -p "$work/$name"
  cp -a "$src" "$dir"
  : >"$work/$name.stats"
  (
    # As bmake's own Makefile runs them (its `test` target).
    cd "$dir"
    MAKEFLAGS= HERDLESS_MAKE_STATS=$work/$name.stats "$debian" -r -m / \
      TEST_MAKE="$bin" all >"$work/$name.log" 2>&1 || true
  )
  local passed=0 total=0 failed=()
  for t in $tests; do
    total=$((total + 1))
    if diff -u "$dir/$t.exp" "$dir/$t.out" >>"$work/$name.diff" 2>&1; then
      passed=$((passed + 1))
    else
      failed+=("$t")
    fi
  done
  printf '%s\n' "${failed[@]}" >"$work/$name.failed"
  echo "$passed/$total"
}

status=0
d=$(run debian "$debian")
p=$(run polling "$polling")
h=$(run herdless "$herdless")
echo "Debian bmake:   $d unit tests passed"
echo "polling bmake:  $p unit tests passed"
echo "herdless bmake: $h unit tests passed"
for v in polling herdless; do
  if ! diff "$work/debian.failed" "$work/$v.failed" >/dev/null; then
    echo "$v fails other tests than Debian's bmake:" >&2
    diff "$work/debian.failed" "$work/$v.failed" >&2 || true
    status=1
  fi
done
grants=$(awk '{for (i = 1; i < NF; i++) if ($i == "native_grants") g += $(i + 1)} END {print g + 0}' "$work/herdless.stats")
lost=$(awk '{for (i = 1; i < NF; i++) if ($i == "lost") l += $(i + 1)} END {print l + 0}' "$work/herdless.stats")
brokers=$(wc -l <"$work/herdless.stats")
echo "herdless: $brokers broker(s) started by the tests' makes, $grants native grants, $lost token(s) lost"
if [[ -s $work/debian.stats || -s $work/polling.stats ]]; then
  echo "a stock bmake wrote broker figures" >&2
  status=1
fi
((grants > 0)) || { echo "herdless was never used: no native grant" >&2; status=1; }
((lost == 0)) || { echo "tokens were lost" >&2; status=1; }
exit "$status"
