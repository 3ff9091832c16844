"""How otel-kvcache gets into vLLM, in each of vLLM's processes.

- ``hooks`` puts wrappers on vLLM's methods, named by role in
  ``otel_kvcache.vllm_compat.hook_points``; ``patch`` builds them (small factories,
  one per role) and ``signatures`` gives a hot one the exact parameters of the
  method it replaces.
- ``propagation`` carries the caller's trace context and baggage from the API
  server to the engine, inside vLLM's own request.
- ``instrumentor`` builds the rooms' parts (instruments, exporter, patcher) on
  ``instrument()``; ``plugin`` (plain ``vllm serve``) and ``distro``
  (``opentelemetry-instrument``) start it all; ``resource`` names each process
  (API server, EngineCore, worker).

On the engine thread run only the wrappers ``patch`` builds, and ``propagation``'s
helpers that read a request's trace context once per request.
"""
