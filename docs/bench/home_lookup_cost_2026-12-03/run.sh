# 2026-12-03, at b46e3d7 (copied to /tmp/sluice-b46); one benchmark at a time.
# first_run_4000.*: 06:23-06:25, the script's first version (closed loop only, 4,000 prompts a round).
SLUICE_BIN=/tmp/sluice-b46 python3 benches/e2e/home_lookup_cost.py --rounds 5 --requests 4000 --rate 0 --json first_run_4000.json > first_run_4000.log 2>&1
#   (that version had no open loop and no --rate; it ran as: --rounds 5 --json ...)
# home_lookup_cost.*: 06:40-06:43, the script as then (the committed one differs only in
# clean-up on errors and in counting placed + found lookups, not skipped or failed ones).
SLUICE_BIN=/tmp/sluice-b46 python3 benches/e2e/home_lookup_cost.py --rounds 5 --requests 16000 --json home_lookup_cost.json > home_lookup_cost.log 2>&1
