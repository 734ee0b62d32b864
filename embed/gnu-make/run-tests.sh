#!/usr/bin/env bash
# Runs GNU make's own test suite (tests/run_make_tests.pl of the 4.4.1
# source) against stock GNU make 4.4.1 and against the herdless build,
# and compares: the herdless build must pass exactly the tests stock
# passes, and herdless must really have been used (native grants > 0).
#
#   embed/gnu-make/run-tests.sh            jobserver and parallelism tests
#   embed/gnu-make/run-tests.sh --full     the whole suite (about a minute
#                                          per make on two cores)
#
# Needs target/tools/gnu-make-4.4.1/bin/make (ci/build-gnu-make-4.4.1.sh)
# and target/embed/gnu-make/bin/make (embed/gnu-make/build.sh).
#
# The suite's driver passes only a few variables (PATH, HOME, TMPDIR, ...)
# to the makes it runs, so HERDLESS_MAKE_STATS cannot reach them from
# here: each make is run through a wrapper named `make` that sets it and
# execs the binary with the wrapper's own argv[0], so messages and
# $(MAKE) are as the suite expects. Every make the suite starts with -jN
# then starts a broker in its process and appends its figures to the
# stats file; sub-makes use it through HERDLESS_SOCKET.
#
# The suite runs with `ulimit -n 128`, as upstream's `make check` does.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$root/target/embed/gnu-make/build
stock=$root/target/tools/gnu-make-4.4.1/bin/make
herdless=$root/target/embed/gnu-make/bin/make
categories=(features/jobserver features/parallelism)
if [[ ${1:-} == --only ]]; then shift; categories=("$@"); fi
if [[ ${1:-} == --full ]]; then
  categories=()
fi

for b in "$stock" "$herdless"; do
  [[ -x $b ]] || { echo "missing $b" >&2; exit 1; }
done
[[ -f $build/tests/run_make_tests.pl ]] || { echo "missing $build (embed/gnu-make/build.sh)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/gnu-make-tests.XXXXXX")
[[ -n ${KEEP:-} ]] || trap 'rm -rf "$work"' EXIT; [[ -z ${KEEP:-} ]] || echo "work dir: $work"

# run NAME BINARY: the suite against BINARY; leaves NAME.summary (one line
# per test script: name, passed, total) and NAME.out.
run() {
  local name=$1 bin=$2
  local dir=$work/$name
  mkdir -p "$dir/bin" "$dir/tests"
  cp -a "$build/tests/." "$dir/tests/"
  cat >"$dir/bin/make" <<EOF
#!/bin/bash
HERDLESS_MAKE_STATS=$dir/stats exec -a "\$0" $bin "\$@"
EOF
  chmod +x "$dir/bin/make"
  : >"$dir/stats"
  (
    cd "$dir/tests"
    ulimit -n 128
    perl run_make_tests.pl -srcdir "$build" -make "$dir/bin/make" "${categories[@]}" \
      >"$dir/out" 2>&1 || true
  )
  # "features/jobserver ..... ok     (17 passed)", or "... FAILED (7/8
  # passed)", possibly on a later line after what the failing test printed.
  awk '
    /^[^ ]+ \.\.\.+ / { name = $1 }
    /ok +\([0-9]+ passed\)$/ { n = $0; sub(/.*\(/, "", n); sub(/ .*/, "", n); print name, n, n; name = "" }
    /FAILED +\([0-9]+\/[0-9]+ passed\)$/ {
      n = $0; sub(/.*\(/, "", n); sub(/ .*/, "", n); split(n, pt, "/")
      print name, pt[1], pt[2]; name = ""
    }
  ' "$dir/out" | sort >"$dir/summary"
  cp "$dir/out" "$work/$name.out"
  cp "$dir/summary" "$work/$name.summary"
  cp "$dir/stats" "$work/$name.stats"
}

total() { awk '{p += $2; t += $3} END {printf "%d/%d", p, t}' "$1"; }

run stock "$stock"
run herdless "$herdless"

echo "stock GNU make 4.4.1:    $(total "$work/stock.summary") subtests passed"
echo "herdless GNU make 4.4.1: $(total "$work/herdless.summary") subtests passed"
failed=0
if ! diff <(cat "$work/stock.summary") <(cat "$work/herdless.summary") >"$work/diff"; then
  echo "the two differ (test passed total; < stock, > herdless):"
  cat "$work/diff"
  failed=1
fi
awk '$2 != $3 {print "  both fail: " $1 " (" $2 "/" $3 ")"}' "$work/stock.summary"

brokers=$(wc -l <"$work/herdless.stats")
grants=$(awk '{for (i = 1; i < NF; i++) if ($i == "native_grants") g += $(i + 1)} END {print g + 0}' "$work/herdless.stats")
lost=$(awk '{for (i = 1; i < NF; i++) if ($i == "lost") l += $(i + 1)} END {print l + 0}' "$work/herdless.stats")
echo "herdless: $brokers broker(s) started by the suite's makes, $grants native grants, $lost token(s) lost"
if [[ -s $work/stock.stats ]]; then
  echo "stock make wrote broker figures: it is not stock" >&2
  failed=1
fi
if ((grants == 0)); then
  echo "herdless was never used: no native grant" >&2
  failed=1
fi
if ((lost != 0)); then
  echo "tokens were lost" >&2
  failed=1
fi
if ((failed)); then
  tail -n 40 "$work/herdless.out" >&2
fi
exit "$failed"
