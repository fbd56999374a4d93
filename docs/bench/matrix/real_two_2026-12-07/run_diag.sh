#!/usr/bin/env bash
# `run.sh`'s fleet and arrivals for one seed, Sluice alone, its access log
# written to /tmp/realdiag_access.jsonl (`access_log.yaml`): what each request's
# routing decided, for `diag.py`. (The committed run: seed 3, 2026-12-07 22:17.)
# Usage: run_diag.sh SEED
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/real_two_2026-12-07
rm -f /tmp/realdiag_access.jsonl
python3 benches/e2e/real_fleet.py --llama-venv /tmp/engine \
  --seeds "$1" --requests 120 --rate 0.5 --replicas 2 --prefixes 8 --cache-ram 0 \
  --only sluice --sluice-config $d/access_log.yaml \
  --json $d/diag_seed$1_access_$(git rev-parse --short HEAD).json
gzip -c /tmp/realdiag_access.jsonl > $d/diag_seed$1_access.jsonl.gz
