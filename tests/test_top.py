"""``otel-kvcache top`` on the real scheduler: each engine's snapshot, read back through
the command's ``--json``, against vLLM's own pool, block lists, requests and connector."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from vllm.v1.request import RequestStatus

from engine_harness import EngineHarness, KVTransfers, nixl_both
from harness.offloading import OffloadingWorker, offloading
from harness.scheduler import make_scheduler
from otel_kvcache import VLLMKVCacheInstrumentor, config, names
from otel_kvcache.commands.cli import main as cli
from otel_kvcache.engine import snapshot_files
from otel_kvcache.engine import live_snapshot

TENANT = "tenant"
TOP_REQUESTS = 6


@pytest.fixture
def publisher(monkeypatch, request):
    """The instrumentor's snapshot publisher, its own thread put to sleep: the test publishes."""
    monkeypatch.setattr(live_snapshot, "PUBLISH_SECONDS", 3600.0)
    monkeypatch.setenv(config.TOP_REQUESTS, str(TOP_REQUESTS))
    monkeypatch.setenv(config.BAGGAGE_KEYS, TENANT)
    request.getfixturevalue("telemetry")  # instruments
    snapshot_files.read_snapshots()  # a reader is watching: the engines publish in full
    return VLLMKVCacheInstrumentor()._publisher


def top_json(capsys) -> dict:
    capsys.readouterr()
    assert cli(["top", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def engine_frame(capsys) -> dict:
    (engine,) = [e for e in top_json(capsys)["engines"] if e["pid"] == os.getpid()]
    assert not engine["stale"]
    return engine


def vllm_state(request) -> str:
    status = request.status
    if status == RequestStatus.RUNNING:
        return names.LIVE_STATE_RUNNING
    if status == RequestStatus.PREEMPTED:
        return names.LIVE_STATE_PREEMPTED
    if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        return names.LIVE_STATE_WAITING_FOR_REMOTE_KV
    if request.is_finished():
        return names.LIVE_STATE_HELD_FOR_SEND  # a finished request still in the scheduler, within its grace
    return names.LIVE_STATE_WAITING


def test_the_snapshot_is_vllms_pool_and_the_requests_holding_the_most(model_config, publisher, capsys):
    harness = EngineHarness(make_scheduler(model_config, num_blocks=40))  # 39 usable: preemptions
    for k in range(10):
        harness.add(harness.make_request(
            f"chat-{k}", prompt_len=40 + 23 * k, shared_prefix=32, max_tokens=60 + 10 * k, session_id=f"s{k % 3}",
            trace_headers={"baggage": f"{TENANT}=team-{'ab'[k % 2]},note=left%20out"}))  # fmt: skip
    pool = harness.scheduler.kv_cache_manager.block_pool
    publisher.publish()
    preempted_before = sum(r.num_preemptions for r in harness.requests.values())
    checked = preempted_rows = 0
    while harness.scheduler.has_requests():
        harness.step()
        publisher.publish()
        frame = engine_frame(capsys)

        # The pool, as a scan of vLLM's blocks finds it.
        assert {k: frame["pool"][k] for k in ("used", "cached", "free")} == harness.pool_scan()
        assert frame["pool"]["limit"] == pool.num_gpu_blocks - 1
        assert frame["pool"]["free"] + frame["pool"]["cached"] == pool.get_num_free_blocks()
        # The requests holding the most blocks, as vLLM's block lists hold them.
        held = {rid: harness.held_blocks(rid) for rid in harness.scheduler.requests}
        waiting = {rid for rid, r in harness.scheduler.requests.items() if r.status == RequestStatus.PREEMPTED}
        assert frame["holding_requests"] == len([rid for rid, blocks in held.items() if blocks])
        # Those holding the most, then the preempted (they hold none, and wait for some).
        held = {rid: blocks for rid, blocks in held.items() if blocks or rid in waiting}
        assert sorted((r["blocks"] for r in frame["requests"]), reverse=True) == sorted(held.values(), reverse=True)[:TOP_REQUESTS]
        for row in frame["requests"]:
            request = harness.scheduler.requests[row["id"]]
            assert row["blocks"] == held[row["id"]]
            assert row["state"] == vllm_state(request)
            assert row["preemptions"] == request.num_preemptions
            assert row["session"] == request.session_id
            assert row["baggage"] == {TENANT: request.trace_headers["baggage"].split(",")[0].split("=")[1]}
            assert row["model"] == frame["model"]
            preempted_rows += row["state"] == names.LIVE_STATE_PREEMPTED
        # Holders: each block shared by k requests counts 1/k, so they add up to the used blocks.
        assert sum(h["blocks"] for h in frame["holders"]) + frame["holders_other"] == pytest.approx(frame["pool"]["used"])
        # Rates over the window: the preemptions vLLM counted since the first snapshot.
        minute = frame["last_minute"]
        preempted = sum(r.num_preemptions for r in harness.requests.values()) - preempted_before
        assert minute["preemptions_per_s"] * minute["seconds"] == pytest.approx(preempted)
        checked += 1
    assert preempted > 0 and preempted_rows > 0 and checked > 50
    frame = engine_frame(capsys)
    assert frame["requests"] == [] and frame["pool"]["used"] == 0


def test_the_what_if_line_says_how_little_a_light_load_used_and_nothing_before_any(model_config, publisher, capsys):
    """A large pool and a short request: the peak demand is a sliver of the pool, said as
    vLLM's own used blocks at the busiest step over its pool, not as 0.00x."""
    harness = EngineHarness(make_scheduler(model_config, num_blocks=4000))
    pool = harness.scheduler.kv_cache_manager.block_pool
    publisher.publish()
    capsys.readouterr()
    assert cli(["top", "--once"]) == 0
    assert "what-if  no prefix lookups in the last 10 min  no demand yet" in capsys.readouterr().out
    harness.add(harness.make_request("light", prompt_len=200, max_tokens=20))
    busiest = 0
    while harness.scheduler.has_requests():
        harness.step()
        busiest = max(busiest, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    publisher.publish()
    capsys.readouterr()
    assert cli(["top", "--once"]) == 0
    shown = capsys.readouterr().out
    assert f"peak demand used {100 * busiest / (pool.num_gpu_blocks - 1):.2g} % of the pool" in shown, shown


def test_connector_states_are_vllms(model_config, publisher, capsys):
    transfers = KVTransfers(EngineHarness(make_scheduler(model_config, num_blocks=48, kv_transfer_config=nixl_both())))
    for _ in range(6):
        transfers.add()
    seen = set()
    while transfers.harness.scheduler.has_requests():
        transfers.step()
        publisher.publish()
        for row in engine_frame(capsys)["requests"]:
            request = transfers.harness.scheduler.requests[row["id"]]
            assert row["state"] == vllm_state(request)
            assert row["blocks"] == transfers.harness.held_blocks(row["id"])
            seen.add(row["state"])
    assert {names.LIVE_STATE_WAITING_FOR_REMOTE_KV, names.LIVE_STATE_HELD_FOR_SEND} <= seen


def test_the_tier_line_is_vllms_offload_tier(model_config, publisher, capsys):
    """An engine with a CPU offload tier: ``top``'s tier is its manager's pool, and what went
    through it is what vLLM's offloading scheduler registered (``test_offload_tier.Ledger``)."""
    from test_offload_tier import Ledger

    harness = EngineHarness(make_scheduler(model_config, num_blocks=64, kv_transfer_config=offloading(1 << 20, "lru")))
    connector_scheduler = harness.scheduler.connector.connector_scheduler
    worker, ledger = OffloadingWorker(), Ledger(connector_scheduler)
    publisher.publish()
    assert engine_frame(capsys)["offload"]["used"] == 0
    for request_id in ("a", "b"):
        harness.add(harness.make_request(request_id, 80, shared_prefix=80, max_tokens=4))
        while harness.scheduler.has_requests() or worker.jobs:
            output = harness.step(kv_connector_output=worker.output())
            worker.take(output)
            ledger.take(output)
        assert harness.scheduler.reset_prefix_cache()  # the next one loads from the tier
    publisher.publish()
    tier = engine_frame(capsys)["offload"]
    manager = connector_scheduler.manager
    assert ledger.loads and sum(ledger.stored.values())
    assert tier == {
        "medium": "cpu", "used": len(ledger.resident), "free": manager._num_chunks - len(ledger.resident),
        "bytes_per_block": tier["bytes_per_block"], "stores": sum(ledger.stored.values()), "loads": ledger.loads,
        "evictions": ledger.evictions, "evicted_unused": ledger.evicted_unused,
        "projected_hit_ratio": tier["projected_hit_ratio"],
    }  # fmt: skip
    # The what-if at today's tier is what vLLM served, from the GPU pool and the tier; with none, the GPU pool's.
    ratios, truth = tier["projected_hit_ratio"], harness.truth
    assert truth.connector_hits and ratios["1"] == (truth.prefix_hits + truth.connector_hits) / truth.prefix_queries
    assert ratios["0"] == truth.prefix_hits / truth.prefix_queries
    per_block = tier["bytes_per_block"]  # vLLM's tier takes the whole blocks its 1 MiB holds
    assert manager._num_chunks * per_block <= 1 << 20 < (manager._num_chunks + 1) * per_block
    capsys.readouterr()
    assert cli(["top", "--once"]) == 0
    shown = capsys.readouterr().out
    assert f"tier  cpu: used {tier['used']}  free {tier['free']}  of {manager._num_chunks} blocks" in shown, shown
    assert f"what-if 2x the tier: hit ratio {ratios['1']:.2f} → {ratios['2']:.2f}" in shown, shown


def test_the_snapshots_are_this_users_only_and_go_with_their_engine(model_config, publisher, top_snapshot_directory):
    harness = EngineHarness(make_scheduler(model_config, num_blocks=16))
    publisher.publish()
    (path,) = [p for p in top_snapshot_directory.glob("engine-*.json") if f"-{os.getpid()}-" in p.name]
    assert stat.S_IMODE(top_snapshot_directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_uid == os.getuid()
    del harness
    import gc

    gc.collect()
    assert not path.exists()


def test_unwatched_an_engine_publishes_no_holders_nor_requests(model_config, publisher, top_snapshot_directory, capsys):
    harness = EngineHarness(make_scheduler(model_config, num_blocks=16))
    harness.add(harness.make_request("alone", prompt_len=40, max_tokens=20))
    harness.step()
    os.utime(top_snapshot_directory / snapshot_files.WATCHING, (0, 0))  # nobody has read for ages
    publisher.publish()
    (path,) = [p for p in top_snapshot_directory.glob("engine-*.json") if f"-{os.getpid()}-" in p.name]
    unwatched = json.loads(path.read_text())
    assert not unwatched["detailed"] and unwatched["requests"] == [] and unwatched["holders"] == []
    assert unwatched["pool"]["used"] == harness.pool_scan()["used"] > 0
    snapshot_files.read_snapshots()  # top reads: from the next round on, in full
    publisher.publish()
    frame = engine_frame(capsys)
    assert frame["detailed"] and [(r["id"], r["blocks"]) for r in frame["requests"]] == [("alone", harness.held_blocks("alone"))]


def spend_thread_time(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_rounds_budget_is_the_building_of_its_snapshots_not_the_writing_of_their_files(
    model_config, publisher, monkeypatch
):
    """A slow file system's open, write and rename (5 ms of the thread's time here, the GIL
    free meanwhile) leave the next round a second away; snapshots costing 5 ms of Python
    to build, two rounds in a row, put it five seconds away (``BUDGET``)."""
    monkeypatch.setattr(live_snapshot, "PUBLISH_SECONDS", 1.0)  # the thread waits on: its wait began at 3600
    harness = EngineHarness(make_scheduler(model_config, num_blocks=16))
    harness.add(harness.make_request("alone", prompt_len=40, max_tokens=20))
    harness.step()
    write = live_snapshot.write_snapshot

    def slow_write(path, data):
        spend_thread_time(0.005)
        write(path, data)

    monkeypatch.setattr(live_snapshot, "write_snapshot", slow_write)
    publisher.publish()
    assert publisher.interval == 1.0
    build = publisher.snapshot_of

    def slow_build(*args):
        spend_thread_time(0.005)
        return build(*args)

    monkeypatch.setattr(publisher, "snapshot_of", slow_build)
    publisher.publish()
    assert publisher.interval == 1.0  # a one-off, as a garbage collection is
    publisher.publish()
    assert 5.0 <= publisher.interval < 10.0
    monkeypatch.setattr(publisher, "snapshot_of", build)
    publisher.publish()
    assert publisher.interval == 1.0


def test_a_directory_others_can_open_is_refused(tmp_path, monkeypatch, caplog):
    open_to_all = tmp_path / "top"
    open_to_all.mkdir(mode=0o755)
    open_to_all.chmod(0o755)
    monkeypatch.setenv(config.TOP_DIR, str(open_to_all))
    (open_to_all / "engine-1-0.json").write_text(json.dumps({"format": snapshot_files.FORMAT}))
    with pytest.raises(snapshot_files.UnsafeDirectory, match="open to other users"):
        snapshot_files.private_directory(open_to_all, create=True)
    assert snapshot_files.read_snapshots() == []
    assert "unsafe directory" in caplog.text


@pytest.mark.vllm_independent
def test_top_imports_only_what_it_draws(tmp_path):
    """On a host whose cores vLLM keeps busy every import is slow: ``top`` leaves out the
    instrumentation (OpenTelemetry's instrumentation machinery, the SDK's pipelines, vLLM)."""
    import subprocess
    import sys

    program = (
        "import sys\nfrom otel_kvcache.commands.cli import main\nassert main(['top', '--json']) == 0\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    tmp_path.chmod(0o700)
    environment = {**os.environ, config.TOP_DIR: str(tmp_path)}  # no engine here
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["engines"] == []
    imported = result.stderr.split()
    unwanted = ("opentelemetry.instrumentation", "opentelemetry.sdk.trace", "opentelemetry.exporter", "wrapt",
                "grpc", "vllm", "torch", "otel_kvcache.wiring", "otel_kvcache.export")  # fmt: skip
    assert [m for m in imported if m.startswith(unwanted)] == []
