"""The handoff: how a finished prefill's KV is handed from a producer engine (P) to a consumer (D).

Named for what it does, not for where it sits: P *leases* a finished prompt's blocks, D *registers* the
blocks it allocated for the same token positions, P's workers WRITE into them and D *takes* the KV, or
either side gives up under rules that never let a WRITE land in blocks D gave back. This package is
that protocol and nothing else; it imports nothing from vLLM (``tests/test_core_isolation.py`` proves
it), so the vLLM adapter (:mod:`vllm_dsa_connector.connector`) and an SGLang adapter would share it.
Together with :mod:`vllm_dsa_connector.core.plan` (page tables), :mod:`vllm_dsa_connector.core.plan.peer_plan`
(the transfer plan) and :mod:`vllm_dsa_connector.core.transfer` (moving bytes) it is the transfer core.

Reading order:

- :mod:`.wire`: handshake payloads, push/receive jobs, completion notices (msgspec structs).
- :mod:`.messages`: side-channel requests and replies, the authenticated envelope; beside it :mod:`.clock`
  (the peer clock estimate that turns D's give-up time into a deadline in P's clock) and :mod:`.ids`
  (transfer ids and prompt digests).
- :mod:`.params`: ``kv_transfer_params`` typed (the proxy's, P's and D's view of them), and what D logs of params it
  cannot use (another connector's told apart).
- :mod:`.side_channel`: the ZMQ server and client, the handshake (``fetch_payloads``) and the
  compatibility check that builds the transfer plan (``validate_peer``).
- :mod:`.producer` and :mod:`.leases` (P: leases, :class:`~.leases.LeaseState`) and, for D, :mod:`.loads` (one load,
  :class:`~.loads.LoadState`, and its give-up/release bounds), :mod:`.peers` (the P engines D knows: the
  handshake, its retries, P's restarts) and :mod:`.consumer` (the loads driven: registrations,
  heartbeats, cancels): one state enum per role, one method where transitions happen, the clock
  injected; :mod:`.states` checks every transition against the role's table.
- :mod:`.settings`: the plain values both roles run on (an adapter maps its options onto them).

Logging uses ``logging.getLogger(__name__)``; the vLLM adapter routes the package logger to vLLM's
handlers, another host configures ``vllm_dsa_connector`` as it likes.
"""
