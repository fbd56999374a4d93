#!/usr/bin/env bash
# A release build of the gateway laid out by BOLT (LLVM's post-link optimiser)
# from a profile of its own work: the code a request runs, packed together
# and in the order it runs. Measured against the same code without it
# (docs/benchmarks-log.md, "2026-11-26 morning"): 3% less CPU per non-streamed
# request (user time 6.3 against 6.6 us), 2% more requests per second on a
# capped core. The image's build stage runs it (Dockerfile); `cargo build
# --release` does not. Its `RUN` steps were run as written on Debian 12, the
# stage's own base, since no Docker engine runs where this was made
# (docs/benchmarks-log.md, "2026-11-26 afternoon").
#
#   scripts/bolt.sh [OUT]        # default OUT: target/bolt/sluice
#
# Steps:
# 1. `cargo build --release` with the link keeping its relocations
#    (`--emit-relocs`, so BOLT may move whole functions), in target/bolt/;
# 2. an instrumented copy (`llvm-bolt -instrument`) serves a training load on
#    loopback: the gateway in front of `sluice sim`, driven by `sluice bench`,
#    every API (chat, Messages, Responses), streamed and whole, fixed and
#    varied shapes, prefix-sharing and agent sessions (~32,000 requests, a
#    few seconds against a replica that answers at once);
#    the profile is written when it exits;
# 3. `llvm-bolt` lays out the build from the profile; the result must serve
#    the same load with every request answered, or the script fails.
#
# Needs llvm-bolt (Debian: bolt-15, installed here when missing and root) and
# nothing else beyond the Rust toolchain: no Python, no curl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/bolt/sluice}
say() { echo "bolt: $*" >&2; }

# llvm-bolt run from its LLVM prefix (Debian: /usr/lib/llvm-15/bin) finds its
# instrumentation runtime beside it, in that prefix's lib/.
find_bolt() { ls /usr/lib/llvm-*/bin/llvm-bolt 2>/dev/null | sort -V | tail -1 || true; }
BOLT=$(find_bolt)
[ -n "$BOLT" ] || BOLT=$(command -v llvm-bolt || true)
if [ -z "$BOLT" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing bolt-15"
        apt-get update -qq >/dev/null && apt-get install -y -qq bolt-15 >/dev/null
        BOLT=$(find_bolt)
        [ -n "$BOLT" ] || { say "bolt-15 installed, but no llvm-bolt found"; exit 1; }
    else
        say "needs llvm-bolt (Debian: apt-get install bolt-15)"
        exit 1
    fi
fi

say "release build with relocations (target/bolt)"
CARGO_TARGET_DIR=target/bolt RUSTFLAGS="${RUSTFLAGS:-} -C link-args=-Wl,--emit-relocs" \
    cargo build --release --locked --bin sluice
BUILT=target/bolt/release/sluice
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

taken=" "
port() {
    # A free loopback port (bash's /dev/tcp fails to connect to a free one),
    # not one handed out before.
    local p
    while :; do
        p=$((20000 + RANDOM % 40000))
        case "$taken" in *" $p "*) continue ;; esac
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
        echo "$p"
        return
    done
}
wait_port() {
    for _ in $(seq 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    say "nothing listens on port $1"
    exit 1
}

# Until the gateway's admin port answers /readyz with 200 (a replica found
# healthy, its models known).
wait_ready() {
    local status
    for _ in $(seq 200); do
        status=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" \
            && printf 'GET /readyz HTTP/1.0\r\n\r\n' >&3 && head -c 12 <&3) 2>/dev/null || true)
        case "$status" in "HTTP/1."[01]" 200") return 0 ;; esac
        sleep 0.05
    done
    say "the gateway on admin port $1 never became ready"
    exit 1
}

# The training load against GATEWAY (a binary); its requests must all succeed.
load() {
    local gw=$1 sim_port gw_port admin_port sim gwpid
    sim_port=$(port); taken+="$sim_port "
    gw_port=$(port); taken+="$gw_port "
    admin_port=$(port); taken+="$admin_port "
    "$BUILT" sim --listen "127.0.0.1:$sim_port" --profile fixed --prefill-delay 0ms --token-delay 0ms \
        2>/dev/null & sim=$!; pids+=("$sim")
    printf 'telemetry:\n  access_log:\n    enabled: false\n' > "$work/gw.yaml"
    RUST_LOG=warn "$gw" serve --config "$work/gw.yaml" --backend "http://127.0.0.1:$sim_port" \
        --listen "127.0.0.1:$gw_port" --admin-listen "127.0.0.1:$admin_port" & gwpid=$!
    pids+=("$gwpid")
    wait_port "$sim_port"; wait_port "$gw_port"; wait_ready "$admin_port"
    local url=http://127.0.0.1:$gw_port
    local runs=(
        "--workload fixed --no-stream --requests 20000 --concurrency 64 --max-tokens 32"
        "--workload fixed --requests 2000 --concurrency 64 --max-tokens 128"
        "--workload random --no-stream --requests 4000 --concurrency 32"
        "--workload random --requests 1000 --concurrency 32"
        "--workload shared-prefix --requests 1000 --concurrency 16"
        "--api messages --workload random --requests 1000 --concurrency 16"
        "--api messages --workload random --no-stream --requests 2000 --concurrency 16"
        "--api responses --workload random --requests 1000 --concurrency 16"
        "--workload agentic --sessions 40 --turns 6 --think-time 0ms --concurrency 16"
    )
    for r in "${runs[@]}"; do
        # shellcheck disable=SC2086 # each run is a list of options
        "$BUILT" bench --url "$url" --quiet --json "$work/run.json" $r >/dev/null
        local asked ok
        asked=$(grep -o '"requests": *[0-9]*' "$work/run.json" | head -1 | grep -o '[0-9]*$' || true)
        ok=$(grep -o '"ok": *[0-9]*' "$work/run.json" | head -1 | grep -o '[0-9]*$' || true)
        if [ -z "$ok" ] || [ "$ok" != "$asked" ]; then
            say "requests failed under $gw ($r):"
            cat "$work/run.json" >&2
            exit 1
        fi
    done
    # A clean stop, so that an instrumented gateway writes its profile.
    kill -TERM "$gwpid"; wait "$gwpid" || true
    kill "$sim" 2>/dev/null || true; wait "$sim" 2>/dev/null || true
    # Both reaped: their numbers may go to other processes now.
    pids=()
}

say "instrumenting"
"$BOLT" "$BUILT" -instrument -o "$work/sluice.inst" \
    -instrumentation-file="$work/profile.fdata" >"$work/instrument.log" 2>&1 \
    || { cat "$work/instrument.log" >&2; exit 1; }
say "training load"
load "$work/sluice.inst"
[ -s "$work/profile.fdata" ] || { say "the instrumented gateway wrote no profile"; exit 1; }
say "optimising"
mkdir -p "$(dirname "$OUT")"
"$BOLT" "$BUILT" -o "$OUT" -data="$work/profile.fdata" \
    -reorder-blocks=ext-tsp -reorder-functions=hfsort -split-functions -split-all-cold \
    -split-eh -icf=1 -use-gnu-stack >"$work/optimise.log" 2>&1 \
    || { cat "$work/optimise.log" >&2; exit 1; }
say "checking the optimised build under the same load"
load "$OUT"
"$OUT" --version >/dev/null
say "done: $OUT"
