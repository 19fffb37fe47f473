#!/usr/bin/env bash
# Compatibility job: the `compat`-marked tests (imports of every module, GLM-5.2 offline page
# tables at pp 1-3, the MTP fix on vLLM's real CommonAttentionMetadata, the upstream patch,
# connector and backend classes against vLLM's, option parsing) against each vLLM release in
# VLLM_COMPAT_VERSIONS (default "0.33.0 0.34.0"; "installed" = the venv's own vLLM, 0.32 here).
#
# No CPU build of vLLM 0.33 or 0.34 exists, so a release is tested as its wheel's pure-Python
# sources (ci/vllm_tree.py: wheel downloaded once per machine into
# ~/.cache/vllm-dsa-connector/wheels, sources unpacked into .cache/vllm-compat/) put first on
# PYTHONPATH over the venv's CPU torch, with VLLM_TARGET_DEVICE=cpu. Engines cannot run that way.
# CUDA_VISIBLE_DEVICES is set empty: vLLM >= 0.34 refuses an x86 CPU platform without Triton
# (CpuPlatform.check_and_update_config), and its Triton check (vllm.triton_utils.importing) keeps
# the venv's Triton only with one active driver, or with none when CUDA_VISIBLE_DEVICES is empty
# (its rule for a worker that sees no GPU yet). Nothing here launches a Triton kernel.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$PWD/$VENV/bin/python"
VERSIONS="${VLLM_COMPAT_VERSIONS:-0.33.0 0.34.0}"
mapfile -t FILES < <(grep -l "pytest.mark.compat" tests/test_*.py)
for version in $VERSIONS; do
  start=$SECONDS
  if [ "$version" = installed ]; then
    echo "[compat] vLLM $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) (installed)"
    "$PY" -m pytest -p no:cacheprovider -q -m compat "${FILES[@]}" "$@"
  else
    tree="$("$PY" ci/vllm_tree.py "$version")"
    echo "[compat] vLLM $version from $tree"
    CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu VLLM_DSA_EXPECT_VLLM="$version" PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" -m pytest -p no:cacheprovider -q -m compat "${FILES[@]}" "$@"
  fi
  echo "[compat] vLLM $version: $((SECONDS - start)) s"
done
