"""Every benchmark script still imports and parses its --help (issue #31): each module under benchmarks/ is
imported, and each one with a `main()` is run with `--help` (and each subcommand's `--help`), which exits in
argparse before any benchmark work starts: no server, no checkpoint, no measurement."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest

import benchmarks

MODULES = sorted(m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.") if not m.ispkg)

# the scripts with subcommands: each subcommand's --help too
SUBCOMMANDS = {
    "benchmarks.peers.clients": ["install", "run", "wire", "report"],
    "benchmarks.peers.compare": ["bars", "interleaved", "vllm", "openvino"],
    "benchmarks.serving.articles": ["procedure", "sweep"],
}

# the shared helpers (no `main`): imported only
LIBRARIES = {
    "benchmarks.common",
    "benchmarks.gguf_checkpoint",
    "benchmarks.peers.client_commands",
    "benchmarks.peers.engines",
    "benchmarks.peers.openvino_runs",
    "benchmarks.peers.servers",
    "benchmarks.peers.vllm_runs",
    "benchmarks.peers.wire",
    "benchmarks.serving.router_load",
}

CASES = [
    (m, [*sub, "--help"]) for m in MODULES if m not in LIBRARIES for sub in [[], *([s] for s in SUBCOMMANDS.get(m, []))]
]


def test_every_module_is_listed():
    """A new script is either a library or gets its --help checked; every folder's scripts are found."""
    assert LIBRARIES <= set(MODULES)
    assert set(SUBCOMMANDS) <= set(MODULES) - LIBRARIES
    for folder in ("kernels", "engine", "serving", "peers"):
        assert any(m.startswith(f"benchmarks.{folder}.") for m in MODULES), folder


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_library_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize(("name", "argv"), CASES, ids=[" ".join([m, *a]) for m, a in CASES])
def test_help_parses(name, argv, monkeypatch, capsys):
    mod = importlib.import_module(name)
    assert callable(getattr(mod, "main", None)), f"{name}: no main(); add it to LIBRARIES if it is a helper"
    monkeypatch.setattr(sys, "argv", [name.rsplit(".", 1)[1] + ".py", *argv])
    with pytest.raises(SystemExit) as exit_:
        mod.main()
    assert exit_.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")


def test_write_section_keeps_the_next_topic(tmp_path):
    """A script's section is replaced up to the next section or topic heading, never into the next topic."""
    from benchmarks.common import write_section

    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n# Kernels\n\n## A\n\nold a\n\n# Engine\n\n## B\n\nold b\n")
    write_section("A", "new a", str(path))
    write_section("C", "new c", str(path))
    text = path.read_text()
    assert "old a" not in text and "new a" in text and "old b" in text
    assert text.index("## A") < text.index("# Engine") < text.index("## B") < text.index("## C")


def test_ab_table_survives_a_run_whose_requests_all_failed():
    """A setting whose every request failed has no latency medians (None): the table shows nan, never raises."""
    from benchmarks.common import ab_table

    ok = {"tok_s": 10.0, "ttft_median": 100.0, "itl_p99": 50.0, "failed": 0}
    dead = {"tok_s": 0.0, "ttft_median": None, "itl_p99": None, "failed": 8}
    runs = {("a", 4): [ok, ok], ("b", 4): [dead, dead], ("c", 4): [ok, ok]}
    table = ab_table(runs, ["b", "a", "c"], [4], "setting")
    assert "| `b` | 4 | 0.00 / 0.00 | nan / nan | nan / nan | 16 |" in table
    assert "`a` against `b` at 4 concurrent" in table and "median TTFT nan" in table


def test_dtype_modes_quality_table():
    """The quality pass's table: each mode's perplexity, its ratio to float32's, and the share of positions whose
    argmax is float32's; no table where a mode ran without the quality pass."""
    from benchmarks.engine.dtype_modes import quality_table

    runs = {
        "float32": [{"quality": {"ppl": 20.0, "argmax": [1, 2, 3, 4]}}],
        "int8": [{"quality": {"ppl": 21.0, "argmax": [1, 2, 9, 4]}}],
    }
    table = quality_table(runs, ["float32", "int8"])
    assert "| int8 | 21.000 | 1.0500 | 75.0% of 4 |" in table and "| float32 | 20.000 | 1.0000 | 100.0% of 4 |" in table
    assert quality_table({"float32": [{"tok_s": {}}]}, ["float32"]) == ""
