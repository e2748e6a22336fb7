#!/usr/bin/env bash
# On the GPU machine (after `source .device/env.sh`): each module's CUDA tests in a process of
# its own, so a device fault ends one module rather than the run; prints each module's summary
# and its failures' one-line reasons. Modules that import the OpenAI client (absent there) are
# named and skipped. Extra arguments go to pytest; PER_MODULE_S bounds each module (150 s).
cd "$(dirname "$0")/.."
per=${PER_MODULE_S:-150}
for f in tests/test_*.py; do
  grep -q "mark.cuda" "$f" || continue
  if grep -q "import openai\|from tests.test_server" "$f"; then echo "SKIP $f (imports the OpenAI client)"; continue; fi
  timeout "$per" python -m pytest "$f" -m cuda -q -rfE --tb=line -p no:cacheprovider "$@" 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR|^E |Error:" | head -8 | sed "s#^#$(basename "$f"): #"
  [ "${PIPESTATUS[0]}" = 124 ] && echo "$(basename "$f"): timed out after ${per} s"
done
