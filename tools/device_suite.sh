#!/usr/bin/env bash
# Run the experiment suite on the GPU machine (docs/suite.md, "GPU runs", says how it was used).
# Stage the model first, in parts small enough for a call beside the working tree (pieces of
# the file or of its xz stream: tools/device_model.sh): each call but the last copies one part
# to /root/stage, the last carries the last part and .whl/ (or .whl/ goes to /root/whl in a
# call of its own when both do not fit in one) and runs:
#   bash tools/device_suite.sh [suite args...]
# Results come back as $OUT/results_cuda.tgz (the device folder allows only a few files).
set -uo pipefail
stage=/root/stage
model=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
bash tools/device_model.sh "$model" || exit 1
# the wheels come with this call (.whl/) or were copied to /root/whl by an earlier one
wheels=.whl; [ -d .whl ] || wheels=/root/whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels/*.whl \
  2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD QLIB_MODELS_DIR=$stage PYTHONUNBUFFERED=1
export QLIB_COMMIT=${QLIB_COMMIT:-unknown}
# the H200 machine's matplotlib (2026-12-03) rejects ipykernel's inline backend, so every
# notebook would fail at its first plot: fall back to Agg there (the plots still go to files)
python3 -c "import matplotlib; matplotlib.rcParams['backend'] = 'module://matplotlib_inline.backend_inline'" \
  2>/dev/null || export MPLBACKEND=${MPLBACKEND:-agg}
out=/tmp/results
# the suite stops at $SUITE_SECONDS (default 540: inside the device's 600 s a call) so that the
# notebooks already done still come back in the tarball (2026-12-05: a call cut at its limit
# before the tar lost seven finished notebooks)
timeout "${SUITE_SECONDS:-540}" python3 -m qlib suite run --device cuda --output-dir "$out" "$@" 2>&1 \
  | tee "$OUT/suite_cuda.log"
status=${PIPESTATUS[0]}
tar czf "$OUT/results_cuda.tgz" -C "$out" .
exit "$status"
