"""The README against the code: its configuration table is the one ``config.SETTINGS`` renders,
every setting with the default the code uses, the reference tables (``docs/telemetry.md``) use the names module's names, and the
links of the README and every page in ``docs/`` lead to files."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import SERVICE_NAME

from otel_kvcache import config, names
from otel_kvcache.export import drain
from otel_kvcache.wiring import resource

pytestmark = pytest.mark.vllm_independent  # the same on every vLLM: tested in the default environment

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "telemetry.md"
PACKAGE = ROOT / "src" / "otel_kvcache"
PREFIX = "OTEL_KVCACHE_"

INTERNAL = {
    config.WARNED_SETTINGS: "the bad values already warned about, passed down to vLLM's child processes",
    resource.PROCESS_ENVIRONMENT_VARIABLE: "a child process's role, set by the parent that starts it",
    drain.LOCK_VARIABLE: "the lock file through which the first process waits for the span helpers",
}
"""otel-kvcache's own notes to vLLM's child processes: set by the package, never by a user."""

METRIC_DOCSTRING = re.compile(
    r"^(Observable gauge|Observable counter|Counter|Histogram)\b|Also an?\s+(observable\s+)?counter"
)
"""How ``names.py`` documents a metric's constant (some span attributes are also counters)."""


def section(title: str) -> str:
    """The README's text under the heading ``## title``, up to the next heading of that level."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``, as its body rows of cells (header and rule left out)."""
    found, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        elif rows:
            found.append(rows[2:])
            rows = []
    return found


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def configuration_table() -> dict[str, list[str]]:
    """The first table under "Configuration": variable -> its row's cells."""
    rows = tables(section("Configuration"))[0]
    documented = {code_spans(row[0])[0]: row for row in rows}
    assert len(documented) == len(rows), "a setting is in the configuration table twice"
    return documented


def documented_default(variable: str) -> str:
    """The default column of ``variable``'s row, without its backticks (``none``: unset)."""
    row = configuration_table().get(variable)
    assert row, f"{variable} is not in the README's configuration table"
    return (code_spans(row[1]) or [row[1]])[0]


def declared() -> dict[str, config.Setting]:
    """The settings ``config.py`` declares, by variable."""
    return {setting.variable: setting for setting in config.SETTINGS}


def named_in_the_package() -> set[str]:
    """Every ``OTEL_KVCACHE_*`` name written anywhere in the package's source."""
    return {name for path in PACKAGE.rglob("*.py") for name in re.findall(rf"\b{PREFIX}[A-Z0-9_]+", path.read_text())}


def matches(documented: str, value: object) -> bool:
    """A default as the table writes it (`5`, `auto`, none) against the value the code returns
    (None: worked out at run time, which the table writes `auto`)."""
    if value is None:
        return documented == "auto"
    if isinstance(value, list):
        return documented == (",".join(value) or "none")
    if isinstance(value, (int, float)):
        try:
            return float(documented) == value
        except ValueError:
            return False
    return documented == value


def test_the_configuration_table_is_the_one_the_declarations_render():
    text = section("Configuration")
    written = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    rendered = config.markdown_table()
    assert written == rendered, (
        "the README's configuration table is not the one config.py's settings render "
        f"(python -m otel_kvcache.config prints it); paste this in its place:\n{rendered}"
    )


def test_the_configuration_table_is_every_setting_and_nothing_else():
    settings = (set(declared()) | named_in_the_package()) - set(INTERNAL)
    assert set(configuration_table()) == settings
    assert set(declared()).isdisjoint(INTERNAL)
    assert set(INTERNAL) <= named_in_the_package(), "an internal variable the package no longer uses"
    text = section("Configuration")
    assert [variable for variable in INTERNAL if f"`{variable}`" not in text] == [], "say that these are not settings"


def test_every_setting_is_read_by_its_own_name():
    """The rest of the package reads ``config.<name>()`` and names ``config.<NAME>``: both are the declaration."""
    for variable, setting in declared().items():
        readers = [name for name, value in vars(config).items() if value is setting]
        constants = [name for name, value in vars(config).items() if value == variable]
        assert len(readers) == 1 and len(constants) == 1, (variable, readers, constants)


@pytest.mark.parametrize("variable", sorted(declared()))
def test_the_table_gives_the_default_the_code_uses(monkeypatch, variable):
    monkeypatch.delenv(variable, raising=False)
    default = declared()[variable]()
    documented = documented_default(variable)
    assert matches(documented, default), f"{variable}: the README says {documented!r}, the code uses {default!r}"


BAD_VALUES = {config.BAGGAGE_KEYS: "tenant id"}
"""Where "not-a-value" is a good value (a baggage key), a bad one."""


@pytest.mark.parametrize("variable", sorted(declared()))
def test_a_bad_value_is_named_and_replaced_by_that_default(monkeypatch, caplog, variable):
    monkeypatch.setenv(config.WARNED_SETTINGS, "[]")
    monkeypatch.setenv(variable, BAD_VALUES.get(variable, "not-a-value"))
    with caplog.at_level(logging.WARNING, logger=config.__name__):
        used = declared()[variable]()
    assert matches(documented_default(variable), used)
    assert [record.getMessage() for record in caplog.records if variable in record.getMessage()], "no warning named it"


def test_every_choice_of_a_setting_is_in_its_row():
    choices = {
        variable: setting.kind.choices for variable, setting in declared().items() if getattr(setting.kind, "choices", ())
    }
    assert set(choices) >= {config.EXPORTER_PROCESS, config.FASTAPI_EXCLUDE_SPANS, config.ATTRIBUTION}
    rows = configuration_table()
    missing = {
        variable: [choice for choice in options if f"`{choice}`" not in " ".join(rows.get(variable, []))]
        for variable, options in choices.items()
    }
    assert {variable: left for variable, left in missing.items() if left} == {}


def reference_names() -> list[str]:
    """The names in the first column of every table of the reference page."""
    return [name for table in tables(REFERENCE.read_text()) for row in table for name in code_spans(row[0])]


def metric_names() -> set[str]:
    """The constants of ``names.py`` whose docstring says they name a metric."""
    body = ast.parse(Path(names.__file__).read_text()).body
    found = set()
    for statement, after in zip(body, body[1:]):
        documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(statement, ast.AnnAssign) and documented and METRIC_DOCSTRING.search(after.value.value):
            found.add(getattr(names, statement.target.id))
    return found


def test_the_reference_tables_use_the_names_module():
    defined = {value for value in vars(names).values() if isinstance(value, str)} | {SERVICE_NAME}
    assert [name for name in reference_names() if name not in defined] == []


def test_every_metric_is_in_the_reference_tables():
    assert len(metric_names()) > 20, "names.py's docstrings no longer say which constants are metrics"
    assert sorted(metric_names() - set(reference_names())) == []


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda page: page.name)
def test_every_relative_link_leads_to_a_file(page):
    text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", page.read_text())  # not inside code blocks
    anchors = {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, f"no links found in {page.name}"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        if path and not (page.parent / path).exists():
            broken.append(link)
        elif not path and anchor not in anchors:
            broken.append(link)
    assert broken == []


def test_every_pointer_from_the_code_into_the_docs_names_a_heading_there():
    """A comment states the constraint and points to the numbers (``docs/<page>.md#anchor``):
    each anchor is a heading of that page."""
    pointers = set()
    for module in PACKAGE.rglob("*.py"):
        pointers.update(re.findall(r"docs/([\w-]+\.md)#([\w-]+)", module.read_text()))
    assert pointers, "no pointer into docs/ found in the code"
    missing = []
    for page, anchor in sorted(pointers):
        text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", (ROOT / "docs" / page).read_text())
        if anchor not in {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}:
            missing.append(f"{page}#{anchor}")
    assert missing == []
