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


def value(samples: Dict[Key, float], name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    hits = [v for (n, ls), v in samples.items()
            if n == name and all(item in ls for item in want)]
    if len(hits) != 1:
        raise KeyError(f"{name}{labels}: {len(hits)} matching samples")
    return hits[0]


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
