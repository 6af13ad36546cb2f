"""Shared fixtures: real models, real training steps, real HTTP scrapes."""

from __future__ import annotations

import os
import threading
import urllib.request
from typing import Dict, Tuple

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import gradmon

# scripts/test runs the suite on two xdist workers (``-n 2 --dist loadgroup``). Each file is
# one group, so a module's shared server or training run is made once; the files that keep
# many training processes busy at once are one group between them, so that no two of them
# overlap and load the two cores past what their timings allow.
SYSTEM = {"test_demo.py", "test_e2e_alerts.py", "test_multigpu.py", "test_fleet.py", "test_stepguard_ranks.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("system" if name in SYSTEM else name))

# A test that needs a CUDA device: skipped on this project's CPU machines and CI, run where a
# GPU is lent by scripts/gpu_checks.sh.
def op_names():
    """A dispatch mode that lists the aten ops run inside it (``.names``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    return Ops()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_checks.sh)")

torch.set_num_threads(1)

Key = Tuple[str, Tuple[Tuple[str, str], ...]]


def scrape(url: str, timeout: float = 5.0) -> Dict[Key, float]:
    """GET the endpoint and parse it with prometheus_client's parser into
    {(sample name, sorted labels without model/rank): value}."""
    body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return parse(body)


def parse(body: str) -> Dict[Key, float]:
    out: Dict[Key, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("rank",)))
            out[(s.name, labels)] = s.value
    return out


def fresh(mon) -> Dict[Key, float]:
    """Every step so far in the snapshot, then a real scrape of the endpoint: the series
    of this monitor's model (port 0 endpoints may be shared with other models)."""
    assert mon.flush(), "gradmon did not publish the steps within 5 s"
    return {key: v for key, v in scrape(mon.url).items() if dict(key[1]).get("model") == mon.name}


def value(samples: Dict[Key, float], name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    hits = [v for (n, ls), v in samples.items()
            if n == name and all(item in ls for item in want)]
    if len(hits) != 1:
        raise KeyError(f"{name}{labels}: {len(hits)} matching samples")
    return hits[0]



def origins(samples: Dict[Key, float]) -> Dict[str, Tuple[str, float]]:
    """Where the latest non-finite run started, by tensor (``block``, ``activation``,
    ``grad``): (the layer or block named, its first step)."""
    return {dict(ls)["tensor"]: (dict(ls)["layer"], v) for (n, ls), v in samples.items()
            if n == "gradmon_nonfinite_origin_step"}

class Leaves(torch.nn.Module):
    """A root whose direct children are layers (as an LLM's embedding, final norm and head
    are): on a detail step a child's block record and its activation record are of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def tiny() -> torch.nn.Module:
    """Two Linear layers (``0`` and ``2``) around a Tanh: the smallest model with layers to name."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def sgd_steps(model: torch.nn.Module, steps: int) -> None:
    """``steps`` SGD steps of ``tiny()`` on random batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def attach():
    """gradmon.attach on a free loopback port; every monitor is detached after the test."""
    made = []

    def _attach(model, **options):
        options.setdefault("port", 0)
        options.setdefault("addr", "127.0.0.1")
        options.setdefault("final_scrape_timeout", 0)
        mon = gradmon.attach(model, **options)
        made.append(mon)
        return mon

    yield _attach
    for mon in made:
        mon.detach()


@pytest.fixture(autouse=True)
def _fresh_process_counters():
    """Each test starts as a new process would: no counters carried over from an earlier
    test's monitor of the same name (gradmon continues them within a process)."""
    from gradmon import monitor
    monitor._CARRIED.clear()
    yield
    monitor._CARRIED.clear()


@pytest.fixture(autouse=True)
def _no_gradmon_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("GRADMON_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t for t in threading.enumerate()
              if t.ident not in before and t.name.startswith("gradmon") and t.is_alive()]
    assert not leaked, f"gradmon threads left running: {leaked}"


class PKI:
    """Real certificates made by the openssl CLI: a CA, server and client certificates for
    127.0.0.1, and whatever odd files a test asks for (expired, encrypted, mismatched)."""

    def __init__(self, root) -> None:
        self.dir = root
        self.openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
                     "-days", "2", "-subj", "/CN=test-ca")
        (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        for name in ("server", "client"):
            self.issue(name)

    def openssl(self, *args: str) -> None:
        import subprocess
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.dir)

    def issue(self, name: str, *dates: str) -> "tuple":
        """A key and a CA-signed certificate ``name.pem``/``name.key``; ``dates`` as
        (startdate, enddate) in openssl's YYYYMMDDHHMMSSZ make e.g. an expired one."""
        self.openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                     "-subj", f"/CN={name}")
        if dates:
            (self.dir / "ca.cnf").write_text("[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\nnew_certs_dir=.\n"
                                             "serial=serial\ndefault_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n")
            (self.dir / "index.txt").write_text("")
            (self.dir / "serial").write_text("1000\n")
            self.openssl("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key", "-in",
                         f"{name}.csr", "-out", f"{name}.pem", "-startdate", dates[0], "-enddate", dates[1], "-notext")
        else:
            self.openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                         "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"

    def client_context(self, with_cert: bool = False):
        import ssl
        ctx = ssl.create_default_context(cafile=str(self.dir / "ca.pem"))
        if with_cert:
            ctx.load_cert_chain(self.dir / "client.pem", self.dir / "client.key")
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    import shutil
    if not shutil.which("openssl"):
        if os.environ.get("CI") == "true":
            pytest.fail("openssl CLI not found (Debian package openssl)")
        pytest.skip("openssl CLI not found")
    return PKI(tmp_path_factory.mktemp("pki"))
