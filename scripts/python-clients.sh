#!/usr/bin/env bash
# A virtualenv with the official inference clients the tests drive (openai,
# tritonclient[http]); prints the path of its python. Cached under ~/.cache/tessera, and
# made again when the pins below change (the marker holds them).
set -euo pipefail
venv="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}/venv-clients"
pins=("openai==3.54.0" "tritonclient[http]==2.73.0" "numpy==2.4.6")
marker="$venv/.tessera-clients"
if [[ "$(cat "$marker" 2>/dev/null)" != "${pins[*]}" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" >&2
    echo "${pins[*]}" >"$marker"
fi
echo "$venv/bin/python"
