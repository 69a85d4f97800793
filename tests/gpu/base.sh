#!/usr/bin/env bash
# Runs stages of tests/gpu/device.sh on a baseline tree: an earlier commit unpacked (plain files, no .git) at
# $BASE (default .base), for A/B figures measured in the same device call as the working tree. Here:
#
#   echo /.base/ >> .git/info/exclude
#   rm -rf .base && mkdir .base && git archive COMMIT -- . ':!bench/results' ':!docs' | tar -x -C .base
#
# then, with carry [".whl", ".base"], after `bash tests/gpu/device.sh setup` in the same machine session:
#
#   bash tests/gpu/base.sh offline && PYTHONPATH=/tmp/site bash tests/gpu/device.sh offline
#
# The baseline runs with PYTHONPATH=/tmp/basepkg:/tmp/site, /tmp/basepkg/treadle a link to $BASE, so `treadle`
# imports from it; the built-in plugins' entry points (the same module names in both trees) come from the
# working tree's editable install. Its logs and results go to $OUT/base.
set -u
base=$(cd "${BASE:-.base}" && pwd) || exit 1
mkdir -p /tmp/basepkg && ln -sfn "$base" /tmp/basepkg/treadle
OUT=${OUT:-/tmp/out}/base
mkdir -p "$OUT"
cd "$base" && OUT=$OUT PYTHONPATH=/tmp/basepkg:/tmp/site bash tests/gpu/device.sh "$@"
