"""The benches' transfer paths beside the connector's (not on the connector's runtime path).

- :mod:`.sender`: :class:`~.sender.BounceSender` (gate, gather, one WRITE into a slot, or direct; also the
  ``pipelined`` bounce and the event-signalled ``ipc`` send of :mod:`.ipc_send`) and
  :class:`~.sender.BounceTransport` (the transport interface over it); its handle :class:`~.sends.Send`.
- :mod:`.fan_in`: :class:`~.fan_in.BounceReceiver` (the transport's receiver plus slot reservation for several
  writers, :func:`~.fan_in.check_fan_in`).
- :mod:`.links`: :class:`~.links.PathChooser`, the fastest path over a link (per-link
  :class:`~.links.LinkProfile` of :data:`~.links.LINKS`), and :func:`~.links.link_between`.

``vllm-dsa bench transfer``, ``dev/bench/gpu_transfer.py`` and the transport tests use them to compare the paths
side by side; the connector's own sending side is :mod:`vllm_dsa_connector.core.transfer.routed`.
"""
