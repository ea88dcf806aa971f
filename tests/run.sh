#!/usr/bin/env bash
# The full test suite: library in sync with the notebooks, notebooks clean, pytest, and every notebook executed
# (nbdev-test, and nbval on output-stripped copies). `gpu`-flagged cells are skipped on machines without CUDA.
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

echo "== notebooks executed (nbdev-test)"
flags=""; python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" && flags="--flags gpu"
# one process per notebook, two at a time: each notebook's memory goes back to the system when it ends (a long-lived
# worker that runs several notebooks keeps growing, and two of them outgrew 24 GB)
ls nbs/*.ipynb | xargs -P 2 -I{} nbdev-test --n-workers 0 --timing $flags {}

echo "== notebooks executed (nbval on output-stripped copies)"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python tests/strip_notebooks.py nbs "$tmp"
# the conftest.py beside the copies skips flagged cells; pytest finds it there (pytest 9 no longer takes it as `-c`)
( cd nbs && IN_TEST=1 pytest -p no:cacheprovider --nbval-lax --rootdir="$tmp" "$tmp" -q )

echo "== pytest"
pytest tests
