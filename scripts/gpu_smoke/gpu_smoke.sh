#!/usr/bin/env bash
# One-shot 1-GPU smoke run of zephon-ray's TorchTitan loader (see scripts/gpu_smoke/gpu_smoke.py). Run from the repository root:
#   bash scripts/gpu_smoke/gpu_smoke.sh
# Installs the carried wheels (.whl/*.whl: zephon, torchtitan and the dependencies this path imports; never torch) to
# /tmp/site, then runs scripts/gpu_smoke/gpu_smoke.py. Results: $OUT/gpu_smoke.json, $OUT/gpu_smoke.log, one log per variant.
# The wheels are not in git: on a machine with pip access, download zephon 0.2.0, torchtitan 0.3.0, torchdata 0.11.0,
# spmd_types 0.2.3, tyro 1.0.17, docstring_parser 0.18.0, optree 0.20.0, backports.zstd 1.8.0, tenacity 9.2.1,
# datasets 4.7.0, dill 0.4.0 and multiprocess 0.70.18 for the GPU machine's Python (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION`), plus
# typing_extensions>=4.13 into .whl/optional/. Result of 2026-11-30 on one H200: docs/gpu-smoke-2026-11-30.json.
# SMOKE_MODE=service also needs ray 2.60.0 (cp312 manylinux2014) in .whl: its Java jars, dashboard client, rllib, llm
# and serve may be left out of the wheel to fit a 64 MiB upload (the smoke starts no dashboard and uses none of them),
# and jsonschema, referencing, rpds-py and jsonschema-specifications.
# Local testing: SMOKE_WHEELS (wheel folder), SMOKE_SITE (install target), SMOKE_DEVICE=cpu.
set -u
export PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/.whl/out}"
WHEELS="${SMOKE_WHEELS:-.whl}"
SITE="${SMOKE_SITE:-/tmp/site}"
mkdir -p "$OUT"
echo "== gpu_smoke.sh $(date -u +%FT%TZ) on $(hostname) ($(uname -m)) in $PWD"
nvidia-smi -L 2>&1 || echo "(nvidia-smi -L failed)"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
  || { echo "== wheel install FAILED"; exit 3; }
echo "== installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"
# tyro 1.0.17 (imported by torchtitan.config) needs typing_extensions >= 4.13 (TypeForm). Installed only if the
# machine's own is older: it would shadow the machine's copy for every package.
if ! python3 -c 'import typing_extensions as t, sys; sys.exit(0 if hasattr(t, "TypeForm") else 1)' 2>/dev/null; then
  echo "== typing_extensions lacks TypeForm here: installing $(ls "$WHEELS"/optional/typing_extensions-*.whl)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/optional/typing_extensions-*.whl || echo "== typing_extensions install FAILED"
fi
export PYTHONPATH="$SITE:$PWD"
python3 - <<'EOF' 2>&1
import sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
python3 -m pip list 2>/dev/null | grep -iE '^(typing.extensions|numpy|pyarrow|tokenizers|triton|safetensors|fsspec|huggingface.hub|pandas|msgpack|cloudpickle|wrapt|filelock|xxhash|httpx|requests) ' \
  | tr -s ' ' | paste -sd ',' | sed 's/^/== base packages: /'
set -o pipefail
timeout -k 10 420 python3 "$(dirname "$0")/gpu_smoke.py" 2>&1 | tee "$OUT/gpu_smoke.log"
rc=$?
echo "== gpu_smoke.py exit status $rc (0: data check and cpu_test_config passed); total $(( $(date +%s) - t0 )) s"
exit $rc
