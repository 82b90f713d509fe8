#!/usr/bin/env bash
# A virtualenv with the official inference clients the tests drive (openai,
# tritonclient[http]); prints the path of its python. Cached under ~/.cache/tessera.
set -euo pipefail
venv="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}/venv-clients"
marker="$venv/.tessera-clients-1"
if [[ ! -f "$marker" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "openai==3.54.0" "tritonclient[http]==2.73.0" "numpy<3" >&2
    touch "$marker"
fi
echo "$venv/bin/python"
