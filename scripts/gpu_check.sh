#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with a GPU (and torch, transformers, msgpack there):
# the whole fast suite on the real device (the layouts' "cuda" devices become real; gpu tests run),
# then decode speed on the GPU with and without a tiered layout, and on quantized GGUFs (the device-side
# dequantization of stored blocks). Writes logs under $OUT (or ./gpu-out).
# Usage: bash scripts/gpu_check.sh [pytest targets, default tests]
#   (extra wheels in .whl/ are installed to /tmp/site first). The H200 image (Python 3.12) lacked, on
#   2026-12-04: gguf, pyzmq, fastapi, starlette, pydantic(-core), typing-inspection, annotated-types/-doc,
#   uvicorn, openai, jiter, distro, sniffio, opentelemetry-api, and for transformers 5.25 (the image has
#   5.17): huggingface_hub 2.x, kernels, httpx2, httpcore2, truststore, tomlkit, hf-xet, regex, filelock,
#   fsspec, idna, click, anyio, h11, typing_extensions. Fetch each at .venv's version, e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export MOETIER_HOME=/tmp/moetier-home PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2  # 8 test workers share the cores
nvidia-smi -L
python3 -c "import torch, zmq, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'zmq', zmq.__version__, 'transformers', transformers.__version__)"
# the gpu-marked tests first (the CUDA paths themselves); the whole fast suite, with real "cuda" devices, last
timeout 150 python3 -m pytest -p no:cacheprovider -p no:benchmark -n 8 -rfEs --tb=short -m gpu "${@:-tests}" 2>&1 | tee "$out/pytest-gpu.log" | grep -E "FAILED|ERROR|SKIPPED|passed|failed|^E " | tail -30
for device in cpu cuda; do
    timeout 60 python3 -m moetier.cli run --device $device --max-new-tokens 64 --json > "$out/run-$device.json" || echo "run --device $device failed"
done
timeout 90 python3 -m moetier.cli run --layout examples/local.toml --max-new-tokens 64 --json > "$out/run-layout.json" || echo "run --layout failed"
# a Q8_0 GGUF (moetier's converter) decoded with its experts dequantized on the device, against the CPU lane
timeout 120 python3 -m moetier.cli synth --preset medium --format gguf --gguf-type Q8_0 --out /tmp/medium-q8_0.gguf >/dev/null || echo "synth failed"
for device in cpu cuda; do
    timeout 90 python3 -m moetier.cli run --model /tmp/medium-q8_0.gguf --device $device --max-new-tokens 64 --json > "$out/run-q8_0-$device.json" || echo "run q8_0 --device $device failed"
done
python3 - "$out" <<'PY'
import json, sys, pathlib
for name in ("run-cpu", "run-cuda", "run-layout", "run-q8_0-cpu", "run-q8_0-cuda"):
    path = pathlib.Path(sys.argv[1]) / f"{name}.json"
    if path.exists() and path.stat().st_size:
        data = json.loads(path.read_text())
        print(name, {k: data[k] for k in ("decode_tok_per_s", "prefill_tok_per_s", "hit_rate", "decode_path", "experts", "device") if k in data})
PY
timeout 300 python3 -m pytest -p no:cacheprovider -p no:benchmark -n 8 -rfE --tb=short "${@:-tests}" 2>&1 | tee "$out/pytest.log" | grep -E "FAILED|ERROR|passed|failed|^E " | tail -40
