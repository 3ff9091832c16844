"""A picture of what the KV cache did, as one HTML file, from the exported telemetry.

    otel-kvcache report --otlp-dir out/otlp -o report.html

Reads ``traces.jsonl`` and ``metrics.jsonl`` (OTLP JSON lines, as the main job
or the collector's file exporter write them) and draws: the pool's composition
over time with preemptions, allocation stalls and leak findings marked on the
same axis, NVML's device memory beside it, a row per request (admitted,
preempted, resumed, released), the distributions of peak blocks, prefix-hit
ratio and preemptions per request, the capacity what-if curve where the
telemetry has it, and a summary with the leak gate's verdict on top.

Needs the ``report`` extra (Altair, and vl-convert for the inlined Vega
bundle): ``pip install '.[report]'`` in otel-kvcache's checkout. The file opens offline.

Each file is read once, one line at a time, into aggregates of fixed size, so
memory does not grow with the files: see ``build``. Nothing here is imported
by the instrumentation.
"""
