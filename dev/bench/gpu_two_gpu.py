"""Two-GPU transfer run: one GLM-5.2-shaped request from GPU 0 (prefill) to GPU 1 (decode) over NIXL UCX.

Sender process on cuda:0, receiver on cuda:1, VRAM -> VRAM, 594 scattered blocks in vLLM's
block-outermost layout (78 MLA pages x 41,984 B + 21 indexer pages x 8,448 B per block, 2.05 GB), with
the paths of ``dev/bench/gpu_transfer.py`` (same driver on the same two-process harness,
``vllm_dsa_dev.harness.pair``; same request, same seeded data):
  per_page_layer_major  one descriptor per (layer page, block) in NixlConnector's order (58,806)
  per_page              the same descriptors block by block (NIXL merges list-adjacent contiguous ones)
  merged                runs merged by memory adjacency on both sides (``Runs.merged``: 593)
  bounce                gather into one staging region, ONE write, scatter on the receiver
  pipelined:K           the bounce in K chunks (gather / WRITE / scatter of different chunks overlap)
  ipc                   GPU 1's pages written through a CUDA IPC mapping over NVLink by one Triton
                        kernel on GPU 0 (the library's default; launch plan cached on the request's runs
                        and replayed from a CUDA graph, completion on an interprocess CUDA event whose
                        notification leaves at launch); ipc_sm the kernel forced, ipc_ce one copy-engine
                        DMA per merged run, ipc_cold a new request's runs every rep (plan built, no
                        graph), ipc_notify the notification only after the copy (the old signal)
  auto                  the gate's choice with the cross-GPU (``nvlink``) link profile
Every rep is verified byte for byte on the receiver. Prints medians, GB/s, NIXL descriptor counts and
the NVLink copy bound measured in the same run (a plain torch copy of the same bytes GPU 0 -> GPU 1).
Set UCX_PROTO_INFO=y to see what UCX selected.

    PYTHONPATH=. python dev/bench/gpu_two_gpu.py [--reps 10] [--shapes 594,64,8] [--out results.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_transfer import ALL_PATHS, parser, run  # noqa: E402  (same runner, request and data)

PATHS = ",".join(p for p in ALL_PATHS if p != "direct") + ",pipelined:16"


def main() -> int:
    a = vars(parser(__doc__ or "", PATHS, "cuda:0", "cuda:1", "594,64").parse_args())
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
