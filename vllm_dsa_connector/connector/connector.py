"""``DSAConnector``: the vLLM KV connector facade (scheduler and worker halves live in their modules).

Use it by name (the general plugin registers it)::

    --kv-transfer-config '{"kv_connector":"DSAConnector","kv_role":"kv_producer",
                           "kv_connector_extra_config":{"verify_transfers":true}}'

Why push (P WRITEs into D's blocks) and not pull (D READs P's blocks):

- Measured here (2-vCPU KVM guest, NIXL 1.5.1 UCX, two processes, the same runs posted as WRITE or as
  READ from one side, median of 12; the peer polls every 5 ms, as a busy engine would)::

      runs              CMA WRITE  CMA READ   tcp WRITE  tcp READ
      4 x 1 MiB          0.36 ms    0.36 ms    15.5 ms    24.5 ms
      112 x 36 KiB       0.67 ms    0.90 ms    15.8 ms    19.6 ms
      1024 x 4 KiB      10.7 ms    10.6 ms     21.2 ms    26.3 ms

  On loopback (CMA) the direction does not matter; on the network path (tcp), where both directions
  need the peer to progress, WRITE is 1.2-1.6x faster. On one GPU node vLLM measured READ over cuda_ipc
  falling back to TCP at 0.5 GB/s against 49 GB/s for WRITE (vLLM #52607).
- The sender knows its source layout, so only push can coalesce fragmented KV through the bounce
  transport (gather into a staging slot, ONE write, scatter on D): on an H200 a GLM-5.2-shaped request
  went from 744 ms (58,806 descriptors, what NixlConnector posts) to 2.2 ms with one bounced write
  (transport-measurements.md). Pull would need P to pre-gather every finished request and hold the
  copy for the whole lease.
- P frees its blocks as soon as its WRITE completes instead of waiting for D's read and a notification.

The cost of push is one extra message (D registers its block ids with P over the side channel), paid in
parallel with D's scheduling, and a rule that D must not reuse blocks a late WRITE could still hit:
D keeps a request's blocks until every expected notice arrived or ``transfer_timeout_s`` passed, and
tells P to cancel what it gave up on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata, DSAHandshakeMetadata
from vllm_dsa_connector.connector.options import ConnectorOptions
from vllm_dsa_connector.connector.stats import DSAKVConnectorStats, DSAPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

#: The vLLM-free layers (handoff/, transport/, layout/, matching) log to ``logging.getLogger(__name__)``.
_CORE_LOGGER = "vllm_dsa_connector"


class _ToVllmLog(logging.Handler):
    """Hands the core's records to vLLM's ``vllm`` logger, so they go wherever vLLM's own lines go (with
    vLLM's format and level), even when vLLM configures or reconfigures its logging later."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def share_vllm_log_output() -> None:
    """Print the core's log lines where vLLM prints its own (once per process).

    vLLM's ``vllm`` logger does not propagate: without this, the core's INFO lines would reach no handler
    in a vLLM process. The package logger gets a forwarding handler and vLLM's level (``VLLM_LOGGING_LEVEL``).
    """
    core = logging.getLogger(_CORE_LOGGER)
    if any(isinstance(h, _ToVllmLog) for h in core.handlers):
        return
    core.addHandler(_ToVllmLog())
    if core.level == logging.NOTSET:
        vllm_level = logging.getLogger("vllm").level
        core.setLevel(vllm_level or os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())


def attention_backends(vllm_config: VllmConfig, layer_names: Iterable[str]) -> list[str]:
    """Names of the attention backends that own these KV cache layers (what vLLM picked, e.g. ``CPU_MLA``,
    ``AMX_MLA``, ``FLASHMLA_SPARSE``), sorted and deduplicated."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    return sorted({layer.get_attn_backend().get_name() for layer in layers.values()})


def compat_facts(vllm_config: VllmConfig, backends: Iterable[str] = ()) -> dict[str, str]:
    """Facts both sides must share exactly (the page tables cover the layout itself).

    Block size and attention backends are NOT among them: backends fix the block size and page format
    (on CPU, AMX_MLA needs bf16 and a multiple of 32, CPU_MLA uses 16), and the page tables state both per
    role (block size, page format, bytes per token); the planner maps different block sizes by token
    position and refuses different formats or row sizes (``matching``), naming both sides. ``backends``
    are only logged.
    """
    mc = vllm_config.model_config
    facts = {
        "model_dtype": str(mc.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "architecture": ",".join(getattr(mc.hf_config, "architectures", None) or []),
    }
    return facts


class DSAConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D KV connector for MLA and DSA (indexer K) KV caches over NIXL, push mode."""

    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # vLLM >= 0.33 asks; NIXL registrations are not dropped/redone across sleep

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """How the workers reach the device KV cache (vLLM >= 0.34 asks; it decides how its extensible
        KV cache is allocated, or whether it can be used).

        NIXL registers the pools (``REGISTERS``: one physical allocation per segment) and a peer on the
        host reaches them through UCX cuda_ipc (``EXPORTS_FABRIC``), as vLLM's NixlConnector declares. A D
        with ``ipc_mode`` on also exports them through torch's legacy CUDA IPC (``LEGACY_IPC``), which
        cannot export driver-mapped memory: vLLM then keeps the extensible KV cache off.
        """
        from vllm.config.kv_transfer import KVCacheAccess

        opts = ConnectorOptions.from_config(kv_transfer_config.kv_connector_extra_config)
        access = KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
        if opts.exports_cuda_ipc(str(kv_transfer_config.kv_role)):
            access |= KVCacheAccess.LEGACY_IPC
        return access

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """True (vLLM >= 0.34 asks): KV moves per request and token position, never by block hash."""
        return True

    def may_load_async(self, request: Request) -> bool:
        """D (vLLM >= 0.34 asks, for ``--max-num-inflight-kv-loads``): exactly the requests with
        ``do_remote_prefill`` set, which :meth:`get_num_new_matched_tokens` claims asynchronously."""
        params = request.kv_transfer_params
        return self._scheduler is not None and bool(params and params.get("do_remote_prefill"))

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.opts = ConnectorOptions.from_config(kvc.kv_connector_extra_config)
        share_vllm_log_output()
        self.engine_id = str(kvc.engine_id)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                f"DSAConnector supports one KV cache group (MLA/DSA models); this model has {len(groups)}"
            )
        self._scheduler: DSAConnectorScheduler | None = None
        self._worker: DSAConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

            self._scheduler = DSAConnectorScheduler(vllm_config, self.engine_id, self.opts)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Our workers' payloads. Under vLLM's MultiConnector every child gets the same dict (the first
        child's metadata that is not None): entries of other connectors are skipped; none of ours means
        DSAConnector is not the first child, which cannot work."""
        assert self._scheduler is not None
        payloads = [meta.payload for meta in metadata.values() if isinstance(meta, DSAHandshakeMetadata)]
        foreign = sorted({type(m).__name__ for m in metadata.values() if not isinstance(m, DSAHandshakeMetadata)})
        if not payloads and metadata:
            raise ValueError(
                f"DSAConnector: the workers' handshake metadata is {', '.join(foreign)}, not DSAConnector's: "
                "vLLM collects one connector's handshake metadata (under MultiConnector, the first child's "
                "that has one), so DSAConnector must be the FIRST entry of kv_connector_extra_config.connectors")
        if foreign:
            logger.debug("DSAConnector: skipped handshake metadata of other connectors: %s", ", ".join(foreign))
        self._scheduler.set_local_payloads(payloads)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        from vllm_dsa_connector.connector.page_tables import build_from_kv_caches
        from vllm_dsa_connector.connector.worker import DSAConnectorWorker

        cfg = self._vllm_config
        pp = cfg.parallel_config
        pp_rank, tp_rank = get_pp_group().rank_in_group, get_tp_group().rank_in_group
        table = build_from_kv_caches(
            kv_caches, self._kv_cache_config, cfg.model_config.hf_config,
            kv_cache_dtype=str(cfg.cache_config.cache_dtype), pp_rank=pp_rank,
            pp_size=pp.pipeline_parallel_size, tp_rank=tp_rank, tp_size=pp.tensor_parallel_size)
        backends = attention_backends(cfg, kv_caches)
        logger.info("DSAConnector %s (pp %d, tp %d): attention backend(s) %s, KV block size %d",
                    self.engine_id, pp_rank, tp_rank, ",".join(backends), cfg.cache_config.block_size)
        self._worker = DSAConnectorWorker(self.engine_id, self.opts, compat_facts(cfg, backends),
                                          role=str(cfg.kv_transfer_config.kv_role))
        self._worker.register(kv_caches, table)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._worker is None else self._worker.handshake_metadata()

    @property
    def page_table(self) -> Any:
        """This worker's :class:`~vllm_dsa_connector.core.plan.PageTable` (built from the ``kv_caches`` vLLM
        registered), or None on the scheduler side and before ``register_kv_caches``."""
        return None if self._worker is None else self._worker.table

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and isinstance(self._connector_metadata, DSAConnectorMetadata):
            self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer: the whole request (MLA and indexer pages) lands before it is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """P with ``layer_push``: this layer's pages (MLA latent and, for an owning layer, the indexer K page,
        written before the layer's attention) are final; the step's layer-by-layer jobs post them now.
        Otherwise nothing: P writes after the request finished."""
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Close this step's layer-by-layer posts; other WRITEs complete asynchronously and are reported by
        get_transfer_results."""
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """A worker's stats, or on the scheduler side the scheduler's own (unusable kv_transfer_params):
        vLLM's scheduler asks its connector too and aggregates that with the workers' stats."""
        if self._worker is not None:
            return self._worker.get_stats()
        return None if self._scheduler is None else self._scheduler.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return DSAKVConnectorStats(data=data) if data is not None else DSAKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return DSAPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
