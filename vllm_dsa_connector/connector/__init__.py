"""The vLLM KV connector: ``DSAConnector`` (registered by name by the general plugin).

Modules: :mod:`.connector` (facade, and why push), :mod:`.scheduler`, :mod:`.worker`, :mod:`.metadata`
(msgspec structs), :mod:`.handshake` (ZMQ side channel, compatibility checks), :mod:`.stats`
(KVConnectorStats + Prometheus), :mod:`.options` (``kv_connector_extra_config``).
"""

from vllm_dsa_connector.connector.connector import DSAConnector

__all__ = ["DSAConnector"]
