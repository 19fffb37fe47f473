#!/usr/bin/env bash
# The GPU session's engine and core work in one device call, after the payload is installed
# (shared/gpu/README.md: `bash .gpu/bin/run.sh stage part02 install patch gate` in the same call, the
# machine kept warm since `stage part00` / `stage part01`). Writes every result and log under $OUT.
#
#   bash .gpu/bin/run.sh stage part02 install patch gate && bash dev/bench/gpu_session.sh [core] [transfer] [early] [pd]
#
# CORE_PATHS (default "ipc bounce direct") and PD_PAIRS (default every pair below) trim a short call.
#
# core: dev/bench/core_pd.py on CUDA, the three routes D can choose (direct, bounce, ipc), every byte of D's pools
#       checked, on the GLM-5.2-shaped table in vLLM's GPU layout (two pools).
# early: dev/bench/gpu_pd.py timing what issue 34 asks: the plain DSAConnector pair, early registration with and
#       without layer_push, and with P's prefill in 512-token chunks, each against one engine without P/D, on
#       1k- and 8k-token prompts (goal: P/D TTFT within 1.05x). EARLY_PAIRS overrides the pairs; BURST=N first
#       sends N requests at once to each fresh pair.
# transfer: dev/bench/gpu_transfer.py (one GLM-5.2-shaped request through the transport's paths, every byte
#       verified) on this tree and on the tree before the transport re-cut (.gpu_before/: `git archive 81dbd93
#       vllm_dsa_connector bench`, carried), one run each, same arguments: the re-cut must be no slower.
# pd:   dev/bench/gpu_pd.py, the tiny GLM DSA model (and one with an MTP layer) as P/D pairs of real vLLM GPU
#       engines: ipc (ipc_mode=auto: one GPU, so D routes through CUDA IPC), bounce (bounce_mode=always), the
#       plain DSAConnector (direct NIXL), vLLM's NixlConnector, and MTP speculative decoding.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(core transfer early pd)
t0=$(date +%s)
stamp() { echo "[gpu_session $(( $(date +%s) - t0 ))s] $*"; }
rc=0
for step in "${steps[@]}"; do
  case $step in
    core)
      # CORE_TABLE: a table built elsewhere (the GPU host's transformers may refuse the GLM-5.2 config's
      # layer_types; build it where `vllm-dsa inspect` works and carry it)
      if [ -n "${CORE_TABLE:-}" ]; then cp "$CORE_TABLE" /tmp/glm52_lbnhc.json; else
      python3 - <<'EOF' >"$OUT/core_table.log" 2>&1
import json
from vllm_dsa_connector.core.plan import build_offline
(t,) = build_offline("vllm_dsa_connector/examples/glm5_2_shape.json", kv_cache_dtype="fp8_ds_mla",
                     num_blocks=1200, layout="LBNHC")
open("/tmp/glm52_lbnhc.json", "w").write(json.dumps(t.to_dict()))
print(len(t.pools), "pools", t.bytes_per_block, "B/block")
EOF
      fi
      for path in ${CORE_PATHS:-ipc bounce direct}; do
        stamp "core_pd --path $path"
        timeout 150 python3 dev/bench/core_pd.py --device cuda --table /tmp/glm52_lbnhc.json --requests 594,300,64,8 \
          --path "$path" --arena-bytes $((4 << 30)) --out "$OUT/core_pd_$path.json" >"$OUT/core_pd_$path.log" 2>&1
        r=$?; stamp "core_pd --path $path rc=$r"; [ $r -eq 0 ] || rc=1
        tail -c 600 "$OUT/core_pd_$path.log"
      done
      ;;
    transfer)
      TARGS=(--paths merged,bounce,ipc,auto --shapes 594,64,8 --reps 8)
      for tree in before after; do
        src=$REPO; [ $tree = before ] && src=$REPO/.gpu_before
        [ -d "$src/vllm_dsa_connector" ] || { echo "gpu_session: $src has no tree (carry .gpu_before)"; rc=1; continue; }
        stamp "gpu_transfer $tree"
        (cd "$src" && PYTHONPATH=/tmp/site:$src:$REPO/.gpu/pylib timeout 200 python3 dev/bench/gpu_transfer.py \
          "${TARGS[@]}" --out "$OUT/transfer_$tree.json") >"$OUT/transfer_$tree.log" 2>&1
        r=$?; stamp "gpu_transfer $tree rc=$r"; [ $r -eq 0 ] || rc=1
        tail -c 800 "$OUT/transfer_$tree.log"
      done
      ;;
    pd)
      M=/tmp/models/tiny-glm-dsa-h32-k128
      [ -f "$M/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --index-n-heads 32 \
        --index-topk 128 --out "$M" >"$OUT/make_model.log" 2>&1
      [ -f "$M-mtp/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --index-n-heads 32 \
        --index-topk 128 --mtp-layers 1 --out "$M-mtp" >>"$OUT/make_model.log" 2>&1
      stamp "gpu_pd"
      timeout 480 python3 dev/bench/gpu_pd.py --model "$M" --mtp-model "$M-mtp" \
        --pairs "${PD_PAIRS:-ipc=dsa/graphs/auto,bounce=dsa/graphs/auto,dsa=dsa/graphs/auto,nixl=nixl/graphs/auto,mtp=dsa/graphs/auto}" \
        >"$OUT/gpu_pd.log" 2>&1
      r=$?; stamp "gpu_pd rc=$r"; [ $r -eq 0 ] || rc=1
      grep -a "^\[gpu_pd\] turn" "$OUT/gpu_pd.log" | cut -c1-300 | tail -15
      ;;
    early)
      M=/tmp/models/tiny-glm-dsa-h32-k128
      [ -f "$M/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --index-n-heads 32 \
        --index-topk 128 --out "$M" >"$OUT/make_model.log" 2>&1
      mkdir -p "$OUT/early"; stamp "gpu_pd early"
      OUT="$OUT/early" timeout "${EARLY_TIMEOUT:-420}" python3 dev/bench/gpu_pd.py --model "$M" --timing-blocks 16,128 --repeats "${REPEATS:-4}" \
        ${BURST:+--burst "$BURST"} \
        --pairs "${EARLY_PAIRS:-dsa=dsa/graphs/auto,early=dsa/graphs/auto,earlynolp=dsa/graphs/auto,earlychunk=dsa/graphs/auto}" \
        >"$OUT/gpu_pd_early.log" 2>&1
      r=$?; stamp "gpu_pd early rc=$r"; [ $r -eq 0 ] || rc=1
      grep -a "ttft_ratio_vs_single\|^\[gpu_pd\] early timing" "$OUT/gpu_pd_early.log" | cut -c1-300 | tail -12
      ;;
    *) echo "gpu_session: unknown step $step (core, transfer, early, pd)"; exit 2 ;;
  esac
done
exit $rc
