#!/usr/bin/env bash
# Prepares GNU make 4.4.1's source tree, from the make-dfsg source package of
# Debian trixie (Debian's patches applied, the manual dropped as Debian does:
# ci/gnu-make-4.4.1-fixup.sh), at target/src/gnu-make-4.4.1 and prints its
# path (ci/debian-source.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/debian-source.sh" gnu-make 4.4.1 trixie make-dfsg "$here/gnu-make-4.4.1-fixup.sh"
