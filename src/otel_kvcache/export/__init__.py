"""From a finished request's record to its span, mostly outside the engine.

The engine thread hands each finished request over as a flat record
(``otel_kvcache.handover.record``) to ``helper_pipe.HelperPipe``, the engine's end of
the pipe to the helper process (``helper``), whose own thread encodes what it was
handed about once a second (``wire_format``) and writes it to the helper it starts
and watches (``helper_process``). The helper builds the spans and request histograms
(``spans.SpanBuilder``) with an SDK configured from the same ``OTEL_*`` environment,
with each request's miss reasons found from the prefix events handed over with the
records (``otel_kvcache.handover.miss_reasons``), and exports them in requests bounded
in bytes (``bounded_export``), held through a collector's outage (``held_spans``);
``drain`` keeps vLLM's shutdown from cutting the helper off. Code here that runs in
the EngineCore process (``helper_pipe``, ``helper_process``) never waits.

Nothing here imports the engine (``otel_kvcache.engine``) or the wiring: what the two
share is in ``otel_kvcache.handover``.
"""
