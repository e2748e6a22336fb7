#!/usr/bin/env bash
# Run on a GPU machine from the project root, after `pip install ".[cuda,test]"` (or, in a
# sandbox without network, `source scripts/device_env.sh`):
# Times the JIT rope_store kernel build (cold, then cached), then runs the whole test suite.
set -o pipefail
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for attempt in first second; do
  python - "$attempt" <<'PY' 2>&1 | tee -a "$out/jit.log"
import sys, time
start = time.perf_counter()
from minisgl.device.kernels.jit import load_module
load_module("rope_store")
print(f"rope_store load ({sys.argv[1]} process): {time.perf_counter() - start:.2f} s")
PY
done
python -m pytest tests -q -rs --durations=15 "$@" 2>&1 | tee "$out/pytest.log"
