"""``otel-kvcache top``: the KV cache of every instrumented engine on this host, live.

Each engine process publishes a small snapshot of its pool and its largest holders
(``otel_kvcache.engine.live_snapshot``, in the engine) into a directory only its user can
read (``otel_kvcache.engine.snapshot_files``, shared by both sides). The command reads those files (``command``), or a
Prometheus that scrapes a fleet (``fleet``), and draws them as a frame (``frame``),
once or live in a terminal (``app``). The JSON frame's fields are in ``docs/top.md``.

Nothing here runs in vLLM's processes.
"""
