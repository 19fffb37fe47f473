"""The vLLM KV connector: ``DSAConnector`` (registered by name by the general plugin).

A thin adapter from vLLM's ``KVConnectorBase_V1`` API to the vLLM-free transfer core
(:mod:`vllm_dsa_connector.core.handoff`: producer/consumer roles, side channel, wire structs). Modules:
:mod:`.connector` (facade, and why push), :mod:`.scheduler` (vLLM's scheduler calls -> the core's roles),
:mod:`.worker` (KV caches, NIXL), :mod:`.metadata` (vLLM's metadata containers), :mod:`.stats`
(KVConnectorStats + Prometheus), :mod:`.options` (``kv_connector_extra_config``), :mod:`.compose`
(vLLM's MultiConnector).
"""

from vllm_dsa_connector.connector.connector import DSAConnector

__all__ = ["DSAConnector"]
