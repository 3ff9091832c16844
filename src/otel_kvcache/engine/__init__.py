"""Inside vLLM's EngineCore process: what follows the KV cache as the engine runs.

Most of it runs on vLLM's engine thread, called from our hooks on the scheduler,
the KV cache manager and the block pool (``otel_kvcache.wiring.patch``), where every
instruction is serving time. The rules there:

- work per step is O(requests touched), never a scan over all blocks;
- vLLM's exceptions pass through unchanged; ours are caught and counted;
- nothing waits: a span is built elsewhere (``otel_kvcache.export``), from a record
  handed over in one C call (unless the instrumentor was given its providers in code);
- what can wait for a reader waits for it: the what-if curve and the miss reasons'
  counters catch up when read, the fair shares are computed at collection, and each
  request's miss reasons are found where its span is built.

The rest runs on threads of this process that read what the engine thread keeps:
the metric reader's callbacks (``instruments``) and the snapshot for
``otel-kvcache top`` (``live_snapshot``, written through ``snapshot_files``).
"""
