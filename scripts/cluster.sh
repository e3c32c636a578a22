#!/usr/bin/env bash
# The emulated cluster from a checkout (root):
#   scripts/cluster.sh up 4 --rate 1gbit
#   scripts/cluster.sh status
#   scripts/cluster.sh down
# Runs `python -m fusionring.cluster`; see docs/cluster.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the active environment's python, else the system's (the lab itself needs only the standard library)
python="$(command -v python || command -v python3)"
if ! "$python" -c "import fusionring.cluster" 2>/dev/null; then
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" -m fusionring.cluster "$@"
