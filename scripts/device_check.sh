#!/usr/bin/env bash
# The GPU device check in one run (< 8 minutes on one H200 for the engine, ~3 more for HTTP; no network):
#   bash scripts/device_check.sh                 # the Llama-3-8B-shaped check
#   bash scripts/device_check.sh --dry-run --device cpu --tiny   # plumbing only, anywhere
# Needs torch, triton, transformers and gguf on the machine (no pip install of this repo: the script
# puts the repo root on sys.path). The log and a JSON report go to $OUT when set (the device tool's
# output folder), else to /tmp. Extra arguments go to scripts/device_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
out_dir="${OUT:-/tmp}"
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/servelm-triton-cache}"
# The scratch model (16 GB for the 8B shape) goes to RAM (/dev/shm) when it has room, else to local
# disk; removed at the end.
scratch="${TMPDIR:-/tmp}"
if [ -z "${TMPDIR:-}" ] && [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 40 ] 2>/dev/null; then
    scratch=/dev/shm
fi
workdir="$(mktemp -d "$scratch/servelm-device-check.XXXXXX")"
echo "scratch model folder: $workdir"
trap 'rm -rf "$workdir"' EXIT

# Packages the machine lacks (gguf, which the engine imports; fastapi/uvicorn/pydantic for the HTTP check)
# travel as wheels in .whl/ (see docs/cuda.md); installed into a scratch folder, never over the image's.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/servelm-site .whl/*.whl
    export PYTHONPATH="/tmp/servelm-site${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'PYEOF'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("triton", "transformers", "tokenizers", "safetensors", "gguf", "fastapi", "flash_attn"):
    print(f"{name}: {'yes' if importlib.util.find_spec(name) else 'MISSING'}")
if torch.cuda.is_available():
    print("gpu:", torch.cuda.get_device_name(0))
PYEOF

# A hard stop inside the 8-minute budget (SIGINT first so Python prints where it was). The model
# folder is kept for the HTTP check below; the trap removes it.
status=0
timeout --signal=INT --kill-after=20 "${DEVICE_CHECK_TIMEOUT:-460}" \
    "$PY" scripts/device_check.py --workdir "$workdir" --keep --json "$out_dir/device_check.json" "$@" \
    2>&1 | tee "$out_dir/device_check.log" || status=$?

# Then the server over HTTP on the same model, as a client sees it (HTTP_CHECK=0 leaves it out), where
# a GPU and fastapi are there: ~3 minutes for the 8B shape.
if [ "${HTTP_CHECK:-1}" != 0 ] && [ -f "$workdir/model/config.json" ] \
    && "$PY" -c 'import fastapi, torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    timeout --signal=INT --kill-after=20 "${HTTP_CHECK_TIMEOUT:-300}" \
        "$PY" scripts/device_http_check.py --model "$workdir/model" --out "$out_dir/http" || status=$?
fi
exit "$status"
