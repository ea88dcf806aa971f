#!/usr/bin/env bash
# The full test suite: library in sync with the notebooks, notebooks clean, every notebook executed (nbval on
# output-stripped copies), and pytest. `gpu`-flagged cells are skipped on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
# One BLAS thread per process: notebooks run two at a time and server tests run two processes, and oversubscribed
# OpenMP threads make matrix multiplies ~10x slower on 2 cores.
export MPLBACKEND=Agg PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

echo "== notebooks and library in sync (nbdev-export)"
nbdev-export
git diff --exit-code --stat -- mini_infer || { echo "mini_infer/ differs from the notebooks: run nbdev-export and commit"; exit 1; }

echo "== notebooks clean (nbdev-clean)"
nbdev-clean
git diff --exit-code --stat -- nbs || { echo "notebooks are not clean: run nbdev-clean and commit"; exit 1; }

# Every notebook is executed once, in a real Jupyter kernel as Run All would (nbval on output-stripped copies),
# two notebooks at a time (--dist loadfile keeps a notebook's cells in order in one worker). nbdev-test would run
# the same cells a second time in its own shell: the kernel is the stricter check, so it is the one we keep.
echo "== notebooks executed (nbval on output-stripped copies)"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python tests/strip_notebooks.py nbs "$tmp"
# the conftest.py beside the copies skips flagged cells; pytest finds it there (pytest 9 no longer takes it as `-c`)
( cd nbs && IN_TEST=1 pytest -p no:cacheprovider --nbval-lax -n 2 --dist loadfile --rootdir="$tmp" "$tmp" -q )

echo "== pytest"
# a test that hangs (a deadlock, a child process that never answers) fails after 15 minutes, with its stack
# printed, instead of stalling the run until CI's own limit
pytest -n 2 --dist loadfile --timeout 900 tests
