#!/usr/bin/env bash
# The cells the gate was not made for, as a check: per seed the build with the
# gate beside sglang-router `cache_aware` only (their earlier builds' runs are
# in BENCHMARKS.md): `run.sh` with no build before. On replicas speaking
# SGLang's metrics; with ENGINE=b on the second engine model instead (runs
# named `b_after`).
# Usage: [ENGINE=b] run_peer.sh CELL AFTER_BIN [ROUTERS_VENV]
exec bash "$(dirname "$0")/run.sh" "$1" none "$2" "${3:-/tmp/routers}"
