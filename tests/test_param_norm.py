"""gradmon_param_norm (issue 25): each layer's parameter norm equals torch's own norm of
its weights right after the step, on the optimizer-read steps, with any optimizer; off with
``optimizer_every=0``, and then out of the series budget; drawn on the Layers dashboard and
listed in the metrics reference. Under FSDP: tests/test_multigpu.py, with real ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import scrape
from gradmon import metrics as M
from gradmon import statistics as S
from gradmon.config import Config

ROOT = Path(__file__).resolve().parents[1]


class Small(nn.Module):
    """Embedding, a transformer layer (attention with a fused in-projection, norms, an MLP)
    and a head: parameters from a few elements (biases) to past the kernels' dot-product
    size, each reduced by the path its size takes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.block = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


def _norms(model: nn.Module, layers) -> dict:
    modules = dict(model.named_modules())
    return {name: math.sqrt(sum(p.detach().double().square().sum().item()
                                for p in modules[name].parameters(recurse=False))) for name in layers}


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(seed))
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    opt.zero_grad()


def _exported(mon) -> dict:
    return {dict(labels)["layer"]: v for (name, labels), v in scrape(mon.url).items() if name == M.PARAM_NORM.name}


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=0.05),
                                      lambda ps: torch.optim.RMSprop(ps, lr=0.05)],  # one gradmon cannot read the update of
                         ids=["adamw", "rmsprop"])
def test_each_layer_s_norm_is_torch_s_norm_of_its_weights_after_the_optimizer_read_steps(attach, make_opt):
    torch.manual_seed(0)
    model = Small()
    opt = make_opt(model.parameters())
    mon = attach(model, optimizer_every=3)
    assert len(mon.layers) >= 6
    read = {}
    for i in range(5):
        _step(model, opt, i)
        if i % 3 == 0:
            read = _norms(model, mon.layers)  # the weights as the read step left them
        mon.flush()
        exported = _exported(mon)
        assert set(exported) == set(mon.layers), i
        for layer, norm in read.items():
            assert exported[layer] == pytest.approx(norm, rel=1e-5), (i, layer)
    assert read != _norms(model, mon.layers)  # steps 4 and 5 moved the weights; the gauge kept step 3's


def test_optimizer_every_0_turns_it_off_and_out_of_the_series_budget(attach):
    on, off = S.enabled(Config(), local_view=False), S.enabled(Config(optimizer_every=0), local_view=False)
    assert S.PARAM_NORM in on and S.PARAM_NORM not in off
    assert S.series_per_layer(on) - S.series_per_layer(off) == sum(
        s.series_per_layer for s in on if "optimizer_every" in s.switches)
    model = Small()
    mon = attach(model, optimizer_every=0)
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    mon.flush()
    assert _exported(mon) == {}


def test_the_layers_dashboard_draws_it_and_the_reference_lists_it_with_its_switch():
    board = json.loads((ROOT / "dashboards" / "layers.json").read_text())
    (panel,) = [p for p in board["panels"] if p["targets"] and p["targets"][0]["expr"].startswith(M.PARAM_NORM.name + "{")]
    assert panel["title"] == "Parameter norm by layer" and panel["type"] == "timeseries"
    assert panel["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]["type"] == "log"
    assert panel["targets"][0]["legendFormat"] == "{{layer}} (rank {{rank}})"  # reduced: rank 0 exports it
    reference = (ROOT / "docs" / "metrics.md").read_text()
    assert f"| `{M.PARAM_NORM.name}` | gauge | layer | " in reference
    row = next(line for line in reference.splitlines() if line.startswith(f"| `{M.PARAM_NORM.name}` |"))
    assert "`series_budget`" in row and "`optimizer_every`" in row and "FSDP" in row
    options = (ROOT / "docs" / "configuration.md").read_text()
    switch = next(line for line in options.splitlines() if line.startswith("| `optimizer_every` |"))
    assert f"`{M.PARAM_NORM.name}`" in switch.split("Switches:")[1]
