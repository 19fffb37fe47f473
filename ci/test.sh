#!/usr/bin/env bash
# The test command: ruff, then the whole pytest suite, inside the venv made by ci/setup.sh.
#
# The suite runs as two concurrent pytest processes on the 2-core CI machine: the `slow` tests (every
# test that starts vLLM engines or multi-process NIXL transfers; one at a time, as before) and the
# rest. A sequential run leaves a core idle most of the time (one request at a time through an
# engine, single-threaded Python tests); the two shards share no port or file (fixed port bases are
# per module and every engine test is marked `slow`). The tiny models are made once beforehand, so
# the shards never write the same model directory at the same time.
# With extra arguments (they go to pytest: `-m "not slow"`, a file, `-k ...`) or CI_TEST_JOBS=1, one
# sequential pytest runs instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
echo "[test] ruff check"
ruff check .
start=$SECONDS
if [ "${CI_TEST_JOBS:-2}" = 1 ] || [ "$#" -gt 0 ]; then
  echo "[test] pytest"
  python -m pytest -p no:cacheprovider --durations=30 "$@"
  echo "[test] pytest: $((SECONDS - start)) s"
  exit 0
fi
echo "[test] tiny models (made once, reused by both shards)"
python - <<'PY'
from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa
from vllm_dsa_dev.tiny_models import make_tiny_mla
from vllm_dsa_dev.tokenizer.tiny_models import make_tiny_glm_qwen, make_tiny_v32

for path in (make_tiny_mla(), make_tiny_glm_dsa(index_topk_freq=2, index_topk=16),
             make_tiny_glm_dsa(index_topk_freq=2, index_topk=16, num_mtp_layers=1), make_tiny_v32(),
             make_tiny_glm_qwen()):
    print(f"[test]   {path}")
PY
fast_log="$(mktemp)"
# failed tests' exception lines and engine log excerpts (tests/conftest.py), printed last
export VLLM_DSA_TEST_DIAG="$(mktemp)"
fast_pid=""
trap '[ -n "$fast_pid" ] && kill "$fast_pid" 2>/dev/null; rm -f "$fast_log" "$VLLM_DSA_TEST_DIAG"' EXIT
echo "[test] pytest: shard 'not slow' in the background (its output follows the slow shard's), shard 'slow' here"
python -m pytest -p no:cacheprovider --durations=10 --tb=short -m "not slow" >"$fast_log" 2>&1 &
fast_pid=$!
set +e
python -m pytest -p no:cacheprovider --durations=10 --tb=short -m slow
slow_rc=$?
slow_s=$((SECONDS - start))
wait "$fast_pid"
fast_rc=$?
fast_pid=""
set -e
echo "[test] ---------------- shard 'not slow' (ran concurrently with the slow shard) ----------------"
cat "$fast_log"
if [ -s "$VLLM_DSA_TEST_DIAG" ]; then
  echo "[test] ---------------- failed tests: exception lines and what they printed (last 150 lines) ----------------"
  tail -n 200 "$VLLM_DSA_TEST_DIAG"
  echo "[test] ---------------- the first failure: its exception line and the engines' key log lines ----------------"
  awk '/^=== /{n++} n==1 && /^--- .*last lines/{exit} n==1' "$VLLM_DSA_TEST_DIAG" | head -n 24
fi
echo "[test] pytest: slow shard rc=$slow_rc in $slow_s s; not-slow shard rc=$fast_rc; both done in $((SECONDS - start)) s"
[ "$slow_rc" = 0 ] && [ "$fast_rc" = 0 ]
