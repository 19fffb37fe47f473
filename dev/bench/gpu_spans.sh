#!/usr/bin/env bash
# One device call of the "one span" GPU runs (issues 48 and 49), after the payload is installed in the same
# call (shared/gpu/README.md: `bash .gpu/bin/run.sh stage part02 install patch gate && bash dev/bench/gpu_spans.sh
# tiny`, the machine kept warm since `stage part00` / `stage part01`), or on a machine still warm from that.
# Writes at most 7 files under $OUT: session.log, gpu_pd_<step>.json, logs_<step>.tgz (engine logs).
#
# tiny: dev/bench/gpu_pd.py on the tiny GLM DSA model (graphs mode): DSAConnector direct, early registration with
#       layer_push, vLLM's NixlConnector; 16, 30 and 128 blocks (1k, 2k, 8k tokens). transfer_ms is per
#       (request, destination rank) for all of them; span_ms is P's prefill end -> D's KV ready, one clock.
# wide1, wide2: a 4-layer slice at DeepSeek-V3.2's per-layer widths (make-model --width deepseek-v3.2, dummy
#       weights, eager), 128 and 512 blocks (8k and 32k tokens): wide1 the sequential DSAConnector pair and
#       NixlConnector, wide2 early registration with and without layer_push (WIDE1_PAIRS / WIDE2_PAIRS).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYLIB=${PYLIB:-$REPO/.gpu/pylib}; [ -d "$PYLIB" ] || PYLIB=$REPO/../.gpu/pylib
export PYTHONPATH=/tmp/site:$REPO:$PYLIB PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
cd "$REPO"
t0=$(date +%s)
stamp() { echo "[gpu_spans $(( $(date +%s) - t0 ))s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch,vllm,transformers;print("torch",torch.__version__,"cuda",torch.version.cuda,"vllm",vllm.__version__,"transformers",transformers.__version__)'
  python3 -c 'import importlib.metadata as m;print("nixl", m.version("nixl"))' 2>/dev/null
  git -C "$REPO" log -1 --format='tree %H' 2>/dev/null || cat "$REPO/.commit" 2>/dev/null
} >>"$OUT/session.log" 2>&1
rc=0
for step in "$@"; do
  W=/tmp/spans_$step; rm -rf "$W"; mkdir -p "$W"
  case $step in
    tiny)
      M=/tmp/models/tiny-glm-dsa-h32-k128
      [ -f "$M/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --index-n-heads 32 \
        --index-topk 128 --out "$M" >>"$OUT/session.log" 2>&1
      ARGS=(--model "$M" --pairs "${TINY_PAIRS:-dsa=dsa/graphs/auto,early=dsa/graphs/auto,nixl=nixl/graphs/auto}"
            --timing-blocks 16,30,128 --repeats "${REPEATS:-4}" --base-port 9100)
      LIMIT=${TINY_LIMIT:-330}
      ;;
    wide1|wide2)
      # two rounds of 4 engines (a real-width engine holds ~8.5 GB of weights): the sequential pair beside
      # NixlConnector, then early registration with and without layer_push
      M=/tmp/models/deepseek-v3.2-slice-4l
      [ -f "$M/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --width deepseek-v3.2 \
        --num-layers 4 --out "$M" >>"$OUT/session.log" 2>&1
      PAIRS=${WIDE1_PAIRS:-dsa=dsa/eager/auto,nixl=nixl/eager/auto}
      [ "$step" = wide2 ] && PAIRS=${WIDE2_PAIRS:-early=dsa/eager/auto,earlynolp=dsa/eager/auto}
      ARGS=(--model "$M" --load-format dummy --max-model-len 33000 --kv-cache-bytes $((1 << 30))
            --pairs "$PAIRS" --timing-blocks "${WIDE_BLOCKS:-128,512}" --repeats "${REPEATS:-3}" --base-port 9300)
      LIMIT=${WIDE_LIMIT:-270}
      ;;
    *) echo "gpu_spans: unknown step $step"; rc=1; continue ;;
  esac
  stamp "gpu_pd $step: ${ARGS[*]}"
  echo "command: python3 dev/bench/gpu_pd.py ${ARGS[*]}" >>"$OUT/session.log"
  OUT=$W timeout "$LIMIT" python3 dev/bench/gpu_pd.py "${ARGS[@]}" >"$W/gpu_pd.log" 2>&1
  r=$?; stamp "gpu_pd $step rc=$r"; [ $r -eq 0 ] || rc=1
  [ -f "$W/gpu_pd.json" ] && cp "$W/gpu_pd.json" "$OUT/gpu_pd_$step.json"
  tar -C "$W" -czf "$OUT/logs_$step.tgz" . 2>/dev/null
  grep -a "^\[gpu_pd\]" "$W/gpu_pd.log" | cut -c1-260 | tail -30
  tail -c 1500 "$W/gpu_pd.log"
done 2>&1 | tee -a "$OUT/session.log"
exit $rc
