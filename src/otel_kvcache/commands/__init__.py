"""The user's commands, run on the host, never inside vLLM: ``otel-kvcache`` (``cli``):
``doctor``, ``report``, ``top``, and the leak gate ``otel-kvcache-gate`` (``gate``).
They read what the instrumentation wrote: OTLP files (``otlp_json``), the snapshots
for ``top``, a Prometheus.
"""
