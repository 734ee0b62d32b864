#!/bin/sh
# Runs 40 short jobs, all started at once in the background, each through
# `herdless exec`; the broker lets only -j of them run at a time. Each job
# records how many jobs are running while it runs.
#
#   herdless run -j 4 --stats -- examples/jobs.sh
#
# `herdless run` exports HERDLESS, the path of its own binary, so this
# works without herdless on PATH.
set -eu
herdless=${HERDLESS:-herdless}
jobs=${JOBS:-40}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
: > "$dir/log"
i=0
while [ "$i" -lt "$jobs" ]; do
    i=$((i + 1))
    "$herdless" exec sh -c '
        dir=$1
        mkdir "$dir/running.$$"
        set -- "$dir"/running.*
        echo "$#" >> "$dir/log"
        sleep 0.05
        rmdir "$dir/running.$$"
    ' job "$dir" &
done
wait
max=$(sort -n "$dir/log" | tail -n 1)
echo "examples/jobs.sh: $jobs jobs done; at most $max ran at once"
