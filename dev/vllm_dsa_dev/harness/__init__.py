"""Harnesses for the demo, the benches and the tests (nothing here runs inside vLLM).

Servers
    :mod:`~vllm_dsa_dev.harness.procs` (stdlib only): ``Cluster`` / ``cluster(workdir)`` start
    processes each in its own process group and stop whole groups (SIGTERM, SIGKILL after a grace
    period, wait until the group is gone) on exit, exception, Ctrl-C and SIGTERM; ``wait_healthy(url,
    procs, timeout_s)`` fails with the log tails (``NotReady``).
    :mod:`~vllm_dsa_dev.harness.engines`: vLLM ``api_server`` command lines and environments, the
    expected attention backend, DSAConnector configs, ``start_pair`` (P, D and the P/D proxy).
    :mod:`~vllm_dsa_dev.harness.client`: ``scrape``/``metric`` (Prometheus), ``chat``, ``post_json``.

Two-process transfers
    :mod:`~vllm_dsa_dev.harness.pair` (no vLLM imports): ``run_pair(spec, driver, args)``: a
    producer (P) and a consumer (D) process with real NIXL agents, one control channel between them and
    one message protocol; D's loop is ``serve_consumer`` (the transport's BounceReceiver), P runs the
    caller's driver. ``run_two(producer, consumer, ...)`` is the process part alone for other roles; it, the
    ``Channel`` and the message kinds are in :mod:`~vllm_dsa_dev.harness.channel` (stdlib only, also
    importable from ``pair``).

Submodules are imported explicitly (this package imports nothing), so a transfer script does not pull
in vLLM.
"""
