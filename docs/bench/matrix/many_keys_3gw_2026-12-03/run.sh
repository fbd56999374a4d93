# 2026-12-03 06:32-06:40 UTC, at b46e3d7 (copied to /tmp/sluice-b46); one benchmark at a time.
python3 benches/e2e/matrix.py --routers-venv /tmp/routers --cells many_keys_3gw --seeds 1,2,3 \
  --only sluice-shared sglang-cache_aware --bin /tmp/sluice-b46 --requests-dir /tmp/b1/mrows --json /tmp/b1/matrix.json > /tmp/b1/matrix.log 2>&1
# then copied here; rows gzipped into rows/
