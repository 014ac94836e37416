#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks (scripts/gpu_wheels.txt) into .gpu-wheels/ (ignored by
# git; carry it to that machine, where scripts/gpu_check.sh installs it with --no-index).
#
#   scripts/gpu_wheels.sh            (then: du -sh .gpu-wheels)
#
# cp312 manylinux x86-64 wheels, pinned, --no-deps each, one version of each: a wheel left from an
# older pin is removed.  Runs here, where the package registry is reachable; any pip will do.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
list=scripts/gpu_wheels.txt
mkdir -p "$dest"
pins=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$')
# shellcheck disable=SC2086
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest" $pins 2>&1 | grep -v '^WARNING: Location' || true
# Keep exactly the pinned files: wheel names normalise '-' to '_'.
keep=()
for pin in $pins; do
    name=${pin%%==*}; version=${pin#*==}
    match=$(ls "$dest" | grep -i -E "^${name//-/_}-${version}-.*\.whl$" || true)
    if [[ -z $match ]]; then
        echo "gpu_wheels: no wheel for $pin in $dest" >&2; exit 1
    fi
    keep+=("$match")
done
for f in "$dest"/*; do
    base=${f##*/}
    [[ " ${keep[*]} " == *" $base "* ]] || { echo "gpu_wheels: removing stale $base" >&2; rm -f "$f"; }
done
echo "gpu_wheels: ${#keep[@]} wheels, $(du -sh "$dest" | cut -f1) in $dest" >&2
