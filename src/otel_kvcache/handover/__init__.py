"""What the engine hands over for its spans, shared by the engine and the exporter.

- ``tally``: a live request's counts, as the engine keeps them, and their bytes at
  its release;
- ``record``: a released request's record (``RequestEnded``), a ``Finding``, where the
  engine hands them (``RecordSink``), and how a record is read back into what its span
  is built from (``finished_request``);
- ``miss_reasons``: which of a request's missed prefix tokens were evicted, found
  where its span is built, and the prefix events the engine hands over for that.

Code here runs on both sides (the engine thread, and the span builder wherever it
runs), and imports neither ``otel_kvcache.engine`` nor ``otel_kvcache.export``.
"""
