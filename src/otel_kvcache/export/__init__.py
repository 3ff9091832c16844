"""From a finished request's record to its span, mostly outside the engine.

The engine thread hands each finished request over as a flat record
(``spans.RequestEnded``) to ``exporter_process.ExporterProcess``, whose own thread
marshals what it was handed about once a second into a pipe to the helper process
(``helper``). The helper builds the spans and request histograms
(``spans.RequestExporter``) with an SDK configured from the same ``OTEL_*``
environment, with each request's miss reasons found from the prefix events handed
over with the records (``miss_reasons``), and exports them in requests bounded in bytes
(``bounded_export``), held through a collector's outage (``held_spans``); ``drain``
keeps vLLM's shutdown from cutting the helper off. Code here that runs in the
EngineCore process (``exporter_process``) never waits.
"""
