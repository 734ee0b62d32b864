#!/usr/bin/env bash
# Prepares Debian's bmake 20200710 source tree (the same version in
# bookworm, trixie and sid; bookworm's .dsc is the one reliably fetchable),
# Debian's patches applied, at target/src/bmake-20200710 and prints its
# path (ci/debian-source.sh).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
exec bash "$root/ci/debian-source.sh" bmake 20200710 bookworm bmake
