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
# load: dev/bench/gpu_load.py on that slice: one engine, the DSAConnector pair and the NixlConnector pair
#       behind the proxy, vLLM's serving benchmark at LOAD_LEVELS (default 8,32,64) concurrent ~4k-token
#       requests (64-256 output tokens), pages checked on sampled requests.
# mtp:  dev/bench/gpu_pd.py, MTP speculative decoding at real widths: the DeepSeek-V3.2 slice and a GLM-5 slice
#       (make-model --width glm-5), each with its MTP layer; pages of the prefill request itself (MTP_PAIRS).
# fp8:  dev/bench/gpu_pd.py on the DeepSeek-V3.2 slice: fp8_ds_mla KV (eager) and bf16 KV in graphs mode
#       (FP8_PAIRS), 128 and 512 blocks.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
slice() {  # slice WIDTH LAYERS MTP -> the model directory, made once per host
  local m=/tmp/models/$1-slice-$2l-mtp$3
  [ -f "$m/.complete" ] || python3 -m vllm_dsa_connector.cli make-model --kind dsa --width "$1" --num-layers "$2" \
    --mtp-layers "$3" --out "$m" >>"$OUT/session.log" 2>&1
  echo "$m"
}
t0=$(date +%s)
stamp() { echo "[gpu_spans $(( $(date +%s) - t0 ))s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch,vllm,transformers;print("torch",torch.__version__,"cuda",torch.version.cuda,"vllm",vllm.__version__,"transformers",transformers.__version__)'
  python3 -c 'import importlib.metadata as m;print("nixl", m.version("nixl"))' 2>/dev/null
  # the device's copy of the working tree may carry a stale .git: .commit (written before the call) wins
  if [ -f "$REPO/.commit" ]; then echo "tree $(cat "$REPO/.commit")"; else git -C "$REPO" log -1 --format='tree %H'; fi
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
    load)
      M=$(slice deepseek-v3.2 4 0)
      ARGS=(--model "$M" --load-format dummy --contenders "${LOAD_CONTENDERS:-single,dsa,nixl}"
            --concurrency "${LOAD_LEVELS:-8,32,64}" --input-len 4096 --output-len 160 --output-range 0.6
            --kv-cache-bytes $((2 << 30)) --max-model-len 8192 --base-port 9500)
      LIMIT=${LOAD_LIMIT:-400}; SCRIPT=dev/bench/gpu_load.py
      ;;
    mtp)
      V=$(slice deepseek-v3.2 4 1); G=$(slice glm-5 4 1)
      ARGS=(--model "$V" --load-format dummy --max-model-len 9000 --kv-cache-bytes $((1 << 30))
            --pairs "${MTP_PAIRS:-mtpv32=dsa/graphs/auto,mtpglm5=dsa/eager/auto}" --pair-model "mtpv32=$V"
            --pair-model "mtpglm5=$G" --timing-blocks "${MTP_BLOCKS:-128}" --repeats "${REPEATS:-3}" --base-port 9300)
      LIMIT=${MTP_LIMIT:-420}
      ;;
    fp8)
      M=$(slice deepseek-v3.2 4 0)
      ARGS=(--model "$M" --load-format dummy --max-model-len 33000 --kv-cache-bytes $((1 << 30))
            --pairs "${FP8_PAIRS:-fp8=dsa/eager/fp8_ds_mla,graphs=dsa/graphs/auto}"
            --timing-blocks "${WIDE_BLOCKS:-128,512}" --repeats "${REPEATS:-3}" --base-port 9300)
      LIMIT=${FP8_LIMIT:-420}
      ;;
    wide1|wide2)
      # two rounds of 4 engines (a real-width engine holds ~8.5 GB of weights): the sequential pair beside
      # NixlConnector, then early registration with and without layer_push
      M=$(slice deepseek-v3.2 4 0)
      PAIRS=${WIDE1_PAIRS:-dsa=dsa/eager/auto,nixl=nixl/eager/auto}
      [ "$step" = wide2 ] && PAIRS=${WIDE2_PAIRS:-early=dsa/eager/auto,earlynolp=dsa/eager/auto}
      ARGS=(--model "$M" --load-format dummy --max-model-len 33000 --kv-cache-bytes $((1 << 30))
            --pairs "$PAIRS" --timing-blocks "${WIDE_BLOCKS:-128,512}" --repeats "${REPEATS:-3}" --base-port 9300)
      LIMIT=${WIDE_LIMIT:-270}
      ;;
    *) echo "gpu_spans: unknown step $step"; rc=1; continue ;;
  esac
  SCRIPT=${SCRIPT:-dev/bench/gpu_pd.py}; base=$(basename "$SCRIPT" .py)
  stamp "$base $step: ${ARGS[*]}"
  echo "command: python3 $SCRIPT ${ARGS[*]}" >>"$OUT/session.log"
  OUT=$W timeout "$LIMIT" python3 "$SCRIPT" "${ARGS[@]}" >"$W/$base.log" 2>&1
  r=$?; stamp "$base $step rc=$r"; [ $r -eq 0 ] || rc=1
  [ -f "$W/$base.json" ] && cp "$W/$base.json" "$OUT/${base}_$step.json"
  tar -C "$W" -czf "$OUT/logs_$step.tgz" . 2>/dev/null
  grep -a "^\[$base\]" "$W/$base.log" | cut -c1-260 | tail -30
  tail -c 1500 "$W/$base.log"
  unset SCRIPT
done 2>&1 | tee -a "$OUT/session.log"
exit $rc
