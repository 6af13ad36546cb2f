"""The package layout says which thread runs what (gradmon/capture, serve, clients, and the
build-time artefacts: their __init__ docstrings), and imports go one way between them:
checked on the source with ``ast`` by scripts/sizes.py, which prints the same findings."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_sizes():
    spec = importlib.util.spec_from_file_location("gradmon_sizes", ROOT / "scripts" / "sizes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sizes = _load_sizes()

# (importer, imported) pairs that point the wrong way today, each with the change that removes it.
KNOWN: set = set()  # wrong-way imports tolerated for now: none


def _wrong_way(root: Path = sizes.PACKAGE):
    return {(imp.importer, imp.imported): str(imp) for imp, _ in sizes.wrong_way(sizes.imports(root))}


def test_no_import_points_the_wrong_way_between_the_threads_packages():
    unexpected = {pair: where for pair, where in _wrong_way().items() if pair not in KNOWN}
    assert not unexpected, sorted(unexpected.values())


def test_every_known_exception_still_exists():
    """When issue 23 moves the thresholds into a shared module, the exception goes too."""
    assert KNOWN <= set(_wrong_way()), KNOWN - set(_wrong_way())


def _package(tmp_path: Path, files: dict) -> Path:
    root = tmp_path / "gradmon"
    for name, text in {"__init__.py": "", "capture/__init__.py": "", "serve/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("statement", [
    "from ..serve import exporter", "from ..serve.exporter import Collector", "import gradmon.serve.exporter",
    "from .. import snapshot", "from ..spikes import SpikeTracker", "from gradmon.history import History",
])
def test_the_check_finds_capture_importing_the_publisher_or_scrape_side(tmp_path, statement):
    root = _package(tmp_path, {"capture/hooks.py": f"def record():\n    {statement}\n",
                               "serve/exporter.py": "", "snapshot.py": "", "spikes.py": "", "history.py": ""})
    assert [(i.importer, r.importer) for i, r in sizes.wrong_way(sizes.imports(root))] == [
        ("gradmon.capture.hooks", "gradmon.capture")]


def test_the_check_finds_a_runtime_module_importing_the_build_time_generators(tmp_path):
    root = _package(tmp_path, {"ui.py": "from .alerting import Thresholds\n", "alerting.py": ""})
    assert [str(i) for i, _ in sizes.wrong_way(sizes.imports(root))] == ["gradmon.ui:1 imports gradmon.alerting"]


@pytest.mark.parametrize("importer, statement", [
    ("serve/exporter.py", "from ..artefacts import rules"),
    ("capture/hooks.py", "from ..artefacts.rules import alerts"),
    ("clients/top.py", "import gradmon.artefacts.rules"),
    ("monitor.py", "from .artefacts import rules"),
    ("snapshot.py", "from gradmon import artefacts"),
])
def test_the_check_finds_a_runtime_package_importing_the_artefacts_package(tmp_path, importer, statement):
    root = _package(tmp_path, {importer: f"def f():\n    {statement}\n", "clients/__init__.py": "",
                               "artefacts/__init__.py": "", "artefacts/rules.py": ""})
    found = sizes.wrong_way(sizes.imports(root))
    assert [(i.imported.split(".")[:2], r.importer) for i, r in found] == [(["gradmon", "artefacts"], "gradmon")]


def test_the_alerting_shim_and_the_artefacts_package_may_import_the_generators_and_the_shared_declarations(tmp_path):
    root = _package(tmp_path, {
        "alerting.py": "from .artefacts.rules import alerts\nfrom .thresholds import Thresholds\n",
        "artefacts/__init__.py": "", "artefacts/rules.py": "from . import names\nfrom .. import metrics, thresholds\n",
        "artefacts/names.py": "", "metrics.py": "", "thresholds.py": ""})
    assert sizes.wrong_way(sizes.imports(root)) == []


def test_the_check_finds_the_artefacts_package_importing_a_running_thread_s_code(tmp_path):
    root = _package(tmp_path, {"artefacts/__init__.py": "", "artefacts/rules.py": "from ..serve import exporter\n",
                               "serve/exporter.py": ""})
    assert [(str(i), r.importer) for i, r in sizes.wrong_way(sizes.imports(root))] == [
        ("gradmon.artefacts.rules:1 imports gradmon.serve.exporter", "gradmon.artefacts")]


def test_the_check_follows_a_compatibility_shim_to_the_module_it_stands_for(tmp_path):
    shim = "import sys\n\nfrom .serve import run_end\n\nsys.modules[__name__] = run_end\n"
    root = _package(tmp_path, {"run_end.py": shim, "serve/run_end.py": "",
                               "capture/hooks.py": "from .. import run_end\n"})
    assert [str(i) for i, _ in sizes.wrong_way(sizes.imports(root))] == [
        "gradmon.capture.hooks:1 imports gradmon.serve.run_end"]


def test_the_check_lets_capture_import_its_own_modules_and_the_shared_declarations(tmp_path):
    root = _package(tmp_path, {"capture/hooks.py": "from . import kernels\nfrom .. import statistics\n",
                               "capture/kernels.py": "", "statistics.py": "from .capture import kernels\n"})
    assert sizes.wrong_way(sizes.imports(root)) == []


def test_every_thread_package_says_in_its_docstring_which_thread_runs_it_and_what_it_may_import():
    for package in ("capture", "serve", "clients", "artefacts"):
        doc = (sizes.PACKAGE / package / "__init__.py").read_text()
        docstring = doc.split('"""')[1] if doc.startswith('"""') else ""
        assert "\nMay import: " in docstring and ("thread" in docstring or "process" in docstring), package


def test_gradmon_alerting_is_a_shim_whose_names_are_the_artefacts_package_s_own_objects():
    from gradmon import alerting, artefacts  # noqa: F401  (artefacts: its modules are what the shim names)

    defined_in_shim = [name for name in alerting.__all__ if getattr(getattr(alerting, name), "__module__", "")
                       == "gradmon.alerting"]
    assert defined_in_shim == []
    assert alerting.rule_groups is sys.modules["gradmon.artefacts.rules"].rule_groups


def test_python_m_gradmon_alerting_check_runs_from_the_shim_against_the_repository(tmp_path):
    """The default root is the repository holding deploy/ and dashboards/, found from the
    generator's own file wherever the command is run."""
    done = subprocess.run([sys.executable, "-m", "gradmon.alerting", "check"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
