"""Bad settings: named once per vLLM instance, replaced by the default, and never turn a check off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from engine_harness import break_free_for
from otel_kvcache import config, names

NOT_FINITE = ["nan", "inf", "-inf", "1e309", "NaN"]


@pytest.mark.parametrize("raw", NOT_FINITE)
@pytest.mark.parametrize(
    ("variable", "read", "default"),
    [
        (config.RECONCILE_SECONDS, config.reconcile_seconds, 5.0),
        (config.ZOMBIE_GRACE_SECONDS, config.zombie_grace_seconds, 30.0),
        (config.STUCK_STEPS, config.stuck_steps, 1024),
    ],
)
def test_a_number_that_is_not_finite_is_refused_by_name(monkeypatch, caplog, variable, read, default, raw):
    monkeypatch.setenv(variable, raw)
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert read() == default
    [message] = [r.getMessage() for r in caplog.records]
    assert f"{variable}={raw!r}" in message and f"using {default}" in message


def test_a_bad_setting_names_the_variable_and_the_value_used(monkeypatch, caplog):
    monkeypatch.setenv(config.ZOMBIE_GRACE_SECONDS, "half a minute")
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert config.zombie_grace_seconds() == 30.0
    [message] = [r.getMessage() for r in caplog.records]
    assert "OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS='half a minute'" in message and "using 30.0" in message


@pytest.mark.parametrize("raw", [*NOT_FINITE, "-1", "eight minutes"])
def test_a_bad_connector_timeout_falls_back_to_the_connectors_own(monkeypatch, caplog, raw):
    monkeypatch.setenv(config.CONNECTOR_TIMEOUT_SECONDS, raw)
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert config.connector_timeout_seconds() is None  # auto
    [message] = [r.getMessage() for r in caplog.records]
    assert f"{config.CONNECTOR_TIMEOUT_SECONDS}={raw!r}" in message and "using auto" in message
    monkeypatch.setenv(config.CONNECTOR_TIMEOUT_SECONDS, "90")
    assert config.connector_timeout_seconds() == 90.0


def test_fastapi_exclude_spans_keeps_the_spans_it_knows_and_names_the_rest(monkeypatch, caplog):
    monkeypatch.setenv(config.FASTAPI_EXCLUDE_SPANS, " Send, bodies ")
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert config.fastapi_exclude_spans() == ["send"]
    [message] = [r.getMessage() for r in caplog.records]
    assert "OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS=' Send, bodies '" in message and "using send" in message
    monkeypatch.delenv(config.FASTAPI_EXCLUDE_SPANS)
    assert config.fastapi_exclude_spans() == []


@pytest.mark.parametrize(
    ("variable", "good", "read_as", "bad", "default"),
    [
        (config.STUCK_STEPS, "1", 1, "0", 1024),
        (config.STUCK_STEPS, "7", 7, "2.5", 1024),
        (config.RECONCILE_SECONDS, "0", 0.0, "-0.5", 5.0),
        (config.CLIENT_VALUE_LENGTH_LIMIT, "16", 16, "15", 256),
        (config.EXPORT_MAX_BYTES, "65536", 65536, "65535", 3 << 20),
        (config.EXPORT_HOLD_BYTES, "0", 0, "-1", 64 << 20),
        (config.CONNECTOR_TIMEOUT_SECONDS, "0", 0.0, "-0.5", None),
        (config.WHATIF_SAMPLE_RATE, "1", 1.0, "0", None),
        (config.WHATIF_SAMPLE_RATE, "0.25", 0.25, "1.5", None),
        (config.EXPORTER_PROCESS, " ON ", "on", "sometimes", "auto"),
        (config.TOP_SNAPSHOT, "Off", "off", "no", "on"),
        (config.TOP_DIR, "/srv/otel-kvcache", "/srv/otel-kvcache", "otel-kvcache", None),
    ],
)
def test_a_value_at_its_bound_is_used_and_one_past_it_is_refused(monkeypatch, caplog, variable, good, read_as, bad,
                                                                 default):  # fmt: skip
    read = {setting.variable: setting for setting in config.SETTINGS}[variable]
    monkeypatch.setenv(config.WARNED_SETTINGS, "[]")
    monkeypatch.setenv(variable, good)
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert read() == read_as
        assert caplog.records == []
        monkeypatch.setenv(variable, bad)
        assert read() == default
    [message] = [r.getMessage() for r in caplog.records]
    assert f"{variable}={bad!r}" in message and "using" in message


def test_the_sdks_attribute_limit_wins_where_lower(monkeypatch):
    monkeypatch.setenv(config.CLIENT_VALUE_LENGTH_LIMIT, "64")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "40")
    assert config.client_value_length_limit() == 40
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4000")
    assert config.client_value_length_limit() == 64
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "0")
    assert config.client_value_length_limit() == 1


def test_attribution_takes_the_baggage_keys_and_names_what_it_leaves_out(monkeypatch, caplog):
    monkeypatch.setenv(config.WARNED_SETTINGS, "[]")
    monkeypatch.setenv(config.BAGGAGE_KEYS, "tenant.id, tenant.id")
    monkeypatch.setenv(config.ATTRIBUTION, "tenant.id,session.id,vllm.request.priority")
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert config.baggage_keys() == ["tenant.id"]
        assert config.attribution() == ["tenant.id", names.PRIORITY]
    [message] = [r.getMessage() for r in caplog.records]
    assert "OTEL_KVCACHE_ATTRIBUTION='tenant.id,session.id,vllm.request.priority'" in message
    assert "using tenant.id,vllm.request.priority" in message
    monkeypatch.setenv(config.ATTRIBUTION, "session.id")
    assert config.attribution() == [names.MODEL]  # none kept: the default


def test_check_all_reads_every_setting(monkeypatch, caplog):
    monkeypatch.setenv(config.WARNED_SETTINGS, "[]")
    for setting in config.SETTINGS:
        monkeypatch.setenv(setting.variable, "not a value")
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        config.check_all()
    warned = {r.getMessage().split("=")[0].removeprefix("otel-kvcache: ") for r in caplog.records}
    assert warned == {setting.variable for setting in config.SETTINGS}


def test_a_nan_interval_still_finds_an_injected_zombie(monkeypatch, make_engine, telemetry):
    """With ``nan`` the next pass was never due: a zombie went unreported while the engine was busy."""
    monkeypatch.setenv(config.RECONCILE_SECONDS, "nan")
    monkeypatch.setenv(config.ZOMBIE_GRACE_SECONDS, "0")
    engine = make_engine(num_blocks=256)
    break_free_for(monkeypatch, engine, "victim", orphan=False)
    engine.add(engine.make_request("victim", prompt_len=70, max_tokens=4))
    engine.add(engine.make_request("busy", prompt_len=40, max_tokens=1900))
    while "victim" in engine.scheduler.requests:
        engine.step()
    leaked = engine.held_blocks("victim")  # vLLM's own KV manager still lists them
    assert leaked > 0
    deadline = time.monotonic() + 2 * config.reconcile_seconds() + 5
    while telemetry.total(names.ZOMBIE_REQUESTS) == 0 and time.monotonic() < deadline:
        assert "busy" in engine.scheduler.requests, "the engine went idle before the pass was due"
        engine.step()
        time.sleep(0.002)  # a model step's worth: the default interval passes within the request
    assert telemetry.total(names.ZOMBIE_REQUESTS) == 1
    assert telemetry.total(names.ZOMBIE_BLOCKS) == leaked


def test_a_bad_setting_is_warned_about_once_per_vllm_instance(tmp_path):
    """The first process warns; the processes it starts afterwards (spawned, as vLLM's
    EngineCore and workers are) inherit the record and stay quiet about the same value."""
    code = textwrap.dedent(
        """
        import logging, multiprocessing, sys
        from otel_kvcache import config

        def child():
            logging.basicConfig(stream=sys.stderr)
            config.check_all()

        if __name__ == "__main__":
            logging.basicConfig(stream=sys.stderr)
            config.check_all()
            context = multiprocessing.get_context("spawn")
            for _ in range(3):
                process = context.Process(target=child)
                process.start()
                process.join()
        """
    )
    script = tmp_path / "instance.py"
    script.write_text(code)
    environment = {**os.environ, config.RECONCILE_SECONDS: "inf", config.EXPORTER_PROCESS: "sometimes"}
    environment.pop(config.WARNED_SETTINGS, None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "otel-kvcache:" in line]
    assert len(warnings) == 2, result.stderr
    assert any("OTEL_KVCACHE_RECONCILE_SECONDS='inf'" in w and "using 5.0" in w for w in warnings)
    assert any("OTEL_KVCACHE_EXPORTER_PROCESS='sometimes'" in w and "using 'auto'" in w for w in warnings)
