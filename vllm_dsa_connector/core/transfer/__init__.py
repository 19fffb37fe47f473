"""Transport: moving a request's KV bytes from P's pools into D's. No vLLM imports here.

A byte's way, in five modules (the connector's worker calls the first and the last):

1. :mod:`.routed` (P): :class:`RoutedTransport` posts one writer's parts (``[(local Region, remote region,
   Runs)]``, one per pool pair, the plan's runs of :mod:`.runs`) along the route D chose for the pair:
   ``direct`` (:class:`DirectTransport` of :mod:`.transports`: one NIXL WRITE per part), ``bounce`` (every part
   gathered into one reservation of the local :class:`StagingArena` at :func:`packed_offsets`, one WRITE
   into D's slot) or ``ipc`` (one copy per part into this process's CUDA IPC mapping of D's pools,
   :mod:`.ipc`). ``post(...) -> Post``; ``progress(post)`` from the engine's steps until DONE or FAILED;
   never raises; a route it cannot follow is a FAILED post naming why. Layer by layer (:mod:`.layered`):
   ``open(...)`` the whole request's parts, ``add(post, [(part, Runs)])`` each layer's runs as its attention
   ran (direct: its WRITEs; bounce: gathered at the one-shot packed positions, each part's newly complete
   prefix written into D's slot; ipc: its copies), ``close(post)``; the receiver sees the same one notice
   and the same packed slot as from ``post``.
2. :mod:`.local_copy`: every copy inside a process: :func:`gather`, :func:`scatter` (torch index ops on the
   widest view, :mod:`.widths`), :func:`copy_runs` (the Triton kernel of :mod:`.kernels`, its cached launch
   plans and CUDA-graph replays in :mod:`.launches`; ``VLLM_DSA_COPY_IMPL``).
3. :mod:`.engine`: :class:`NixlEngine`, the one NIXL agent wrapper: its transfers (``write``, prepared
   lists, ``wait``/``state``) there, the agent it subclasses (:class:`NixlAgent` of :mod:`.agent`:
   ``register``, ``add_peer``, notifications, reconnect after a lost connection and a bounded backoff while a
   peer stays unreachable: ``reconnect_backoff_s`` doubling up to ``reconnect_backoff_max_s``, posts in
   between fail at once naming the peer); its plain data (:class:`Region`, :class:`RegionDesc`,
   :class:`Transfer`, :class:`TransferStats`, :class:`TransferError`) in :mod:`.nixl_data`.
4. :mod:`.notices`: the ``dsa1:<path><writer>:<tag>`` notification codec (one per writer and request,
   whatever the path).
5. :mod:`.receiver` (D): :class:`Receiver`, the one target side: ``arm(key, {writer: WriterSpec})``,
   ``pump()`` (notifications; scatters a bounced writer's parts), ``collect()`` -> :class:`RecvResult`;
   :data:`COMPLETES` says which notification completes a writer of each route; the specs, states,
   results and hooks it names in :mod:`.receiver_data` (:meth:`WriterSpec.for_bounce`: a bounced writer's
   slot layout, :func:`packed_parts`, the one the sender packs).

Beside them: :mod:`.gate` (:class:`BounceGate`, the one cost model, bounce or direct; options
:mod:`.gate_options`, profiles :mod:`.profiles`), :mod:`.slots` (:class:`SlotAllocator`, torch-free: D's
scheduler plans slots with it), :mod:`.staging` (:class:`StagingArena`, :class:`StagingSlot`). The benches'
extra paths (pipelined bounce, the event-signalled ipc send, the link path chooser, the fan-in receiver) live
in :mod:`vllm_dsa_dev.harness.paths`.

Every name below is importable from ``vllm_dsa_connector.core.transfer`` (lazily: torch loads on first use).
"""
