#!/usr/bin/env bash
# The fast CUDA path on the GPU machine: its tests, the benchmark (docs/design.md), a profile.
# Stage the model as for tools/device_suite.sh (tools/device_model.sh), then:
#   bash tools/device_bench.sh            (results under $OUT)
set -uo pipefail
stage=/root/stage
model=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
bash tools/device_model.sh "$model" || exit 1
[ -d .stage/whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage/whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD QLIB_MODELS_DIR=$stage PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -x tests/test_fast_cuda.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
python3 tools/gpu_profile.py --out "$OUT" 2>&1 | head -8
[ "${TUNE:-0}" = 1 ] && python3 tools/gpu_tune.py --out "$OUT" 2>&1 | grep -v Warning
python3 -m qlib bench --form fast --device cuda --peers --json > "$OUT/bench_cuda.json"
python3 -c "
import json; r = json.load(open('$OUT/bench_cuda.json'))
for x in [r['qlib'], *r['peers']]:
    print(x.get('runtime'), x.get('engine') or x.get('dtype'), 'prefill', x.get('prefill_ms'), 'decode', x.get('decode_ms_per_token'), 'first', x.get('first_run'), x.get('error', ''))
print(r['ratios'])"
