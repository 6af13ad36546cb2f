"""Hooks on the models people really train: in-place ops, tuples, sharing, gaps (issue 2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from conftest import scrape, value


def step(model, x, opt, loss_fn=lambda out: out.float().pow(2).mean()):
    out = model(x)
    loss_fn(out).backward()
    opt.step()
    opt.zero_grad()


class ResBlock(nn.Module):
    """torchvision-style: Conv -> BN -> ReLU(inplace) -> Conv -> BN, residual, ReLU(inplace)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def test_resnet_block_with_inplace_relu_trains_and_reports_pre_relu_grad_flow(attach):
    torch.manual_seed(0)
    model = ResBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = {}

    def keep(name):
        def hook(mod, inp, out):
            out.register_hook(lambda g: grads.__setitem__(name, g.double().norm().item()))
        return hook

    for name in ("bn1", "bn2"):
        getattr(model, name).register_forward_hook(keep(name))
    mon = attach(model, detail_every=1)
    step(model, torch.randn(2, 4, 6, 6), opt)  # must not raise "modified by an inplace operation"
    mon.flush()
    s = scrape(mon.url)
    for name in ("bn1", "bn2"):
        got = value(s, "gradmon_grad_flow_norm", layer=name)
        assert math.isclose(got, grads[name], rel_tol=1e-5), name
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 0


def test_tensor_hooks_cover_the_same_layers_as_full_backward_hooks(attach):
    """Where full backward hooks are safe, both paths see the same grad_output."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.GELU(), nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    full = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_full_backward_hook(
                lambda m, gi, go, name=name: full.__setitem__(name, go[0].double().norm().item()))
    mon = attach(model, detail_every=1)
    step(model, torch.randn(3, 5), opt)
    mon.flush()
    s = scrape(mon.url)
    assert set(full) == set(mon.layers)
    for name, want in full.items():
        assert math.isclose(value(s, "gradmon_grad_flow_norm", layer=name), want, rel_tol=1e-5)


def test_multihead_attention_out_proj_gap_is_stated(attach):
    torch.manual_seed(2)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0])

    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    step(model, torch.randn(2, 3, 8), opt)
    mon.flush()
    cov = mon.coverage()
    assert cov["attn.out_proj"] == frozenset({"grad", "optimizer"})  # its forward never runs; its parameters step
    assert cov["attn"] == frozenset({"grad", "grad_flow", "activation", "optimizer"})
    s = scrape(mon.url)
    assert value(s, "gradmon_uncovered_layers", family="activation") == 1
    assert value(s, "gradmon_uncovered_layers", family="grad_flow") == 1
    assert value(s, "gradmon_uncovered_layers", family="grad") == 0


def test_lstm_tuple_outputs_dict_outputs_and_integer_outputs(attach):
    torch.manual_seed(3)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 6, batch_first=True)
            self.proj = nn.Linear(6, 3)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            logits = self.proj(out)
            return {"logits": logits, "pred": logits.argmax(-1), "nothing": None}

    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    step(model, torch.randn(2, 5, 4), opt, loss_fn=lambda o: o["logits"].pow(2).mean())
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_activation_rms", layer="lstm") > 0
    assert value(s, "gradmon_hook_errors_total", stage="forward") == 0
    assert mon.coverage()["lstm"] == frozenset({"grad", "grad_flow", "activation", "optimizer"})


def test_frozen_layers_are_skipped_and_shared_modules_aggregate_all_calls(attach):
    torch.manual_seed(4)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Linear(4, 4).requires_grad_(False)
            self.block = nn.Linear(4, 4)

        def forward(self, x):
            return self.block(self.block(self.backbone(x)))  # called twice per forward

    model = Shared()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    outs = []
    model.block.register_forward_hook(lambda m, i, o: outs.append(o.detach().double()))
    mon = attach(model, detail_every=1)
    assert mon.layers == ("block",)
    step(model, torch.randn(3, 4), opt)
    mon.flush()
    s = scrape(mon.url)
    both = torch.cat([o.flatten() for o in outs])
    assert math.isclose(value(s, "gradmon_activation_rms", layer="block"), both.pow(2).mean().sqrt().item(), rel_tol=1e-5)
    assert math.isclose(value(s, "gradmon_activation_abs_max", layer="block"), both.abs().max().item(), rel_tol=1e-6)


class TinyGPT2(nn.Module):
    """GPT-2's shape in miniature: token and position embeddings, pre-norm blocks with
    Conv1D-like projections, a final LayerNorm and an ``lm_head`` whose weight *is*
    ``wte.weight`` (``lm_head.weight = wte.weight``, as ``tie_weights()`` does)."""

    def __init__(self, vocab: int = 17, d: int = 8, n_ctx: int = 6, layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, d), "wpe": nn.Embedding(n_ctx, d),
            "h": nn.ModuleList([nn.ModuleDict({
                "ln_1": nn.LayerNorm(d), "c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(d, d),
                "ln_2": nn.LayerNorm(d), "c_fc": nn.Linear(d, 4 * d), "mlp_proj": nn.Linear(4 * d, d),
            }) for _ in range(layers)]),
            "ln_f": nn.LayerNorm(d),
        })
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        t = self.transformer
        h = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            q, k, v = block.c_attn(block.ln_1(h)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
            h = h + block.c_proj(att @ v)
            h = h + block.mlp_proj(torch.nn.functional.gelu(block.c_fc(block.ln_2(h))))
        return self.lm_head(t.ln_f(h))


def test_tied_lm_head_is_not_a_gap_and_its_weight_is_counted_once(attach, caplog):
    torch.manual_seed(5)
    model = TinyGPT2()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, detail_every=1)
    for _ in range(2):
        logits = model(torch.randint(0, 17, (2, 6)))
        logits.pow(2).mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()  # each tensor once
        wte = model.transformer.wte.weight.grad.double().norm().item()
        opt.step()
        opt.zero_grad()
    mon.flush()
    s = scrape(mon.url)
    assert math.isclose(value(s, "gradmon_grad_global_norm"), expected, rel_tol=1e-5)
    # the tied weight's gradient (embedding and head contributions together) is wte's
    assert math.isclose(value(s, "gradmon_grad_norm", layer="transformer.wte"), wte, rel_tol=1e-5)
    assert ("gradmon_grad_norm", (("layer", "lm_head"), ("model", mon.name))) not in s
    for family in ("grad", "grad_flow", "activation"):
        assert value(s, "gradmon_uncovered_layers", family=family) == 0, family
    cov = mon.coverage()
    assert cov["lm_head"] == frozenset({"activation", "grad_flow"})
    assert cov.expected["lm_head"] == frozenset({"activation", "grad_flow"})
    assert cov.tied == {"lm_head": "transformer.wte"}
    assert cov.gaps() == {}
    assert "not fully observable" not in caplog.text


def test_sparse_embedding_gradients(attach):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model)
    model(torch.tensor([[1, 1, 5]])).sum().backward()
    expected = model[0].weight.grad.coalesce().values().double().norm().item()
    opt.step()
    mon.flush()
    s = scrape(mon.url)
    assert math.isclose(value(s, "gradmon_grad_norm", layer="0"), expected, rel_tol=1e-5)
    assert value(s, "gradmon_hook_errors_total", stage="backward") == 0


def test_eval_and_no_grad_forwards_are_not_measured(attach):
    model = nn.Sequential(nn.Linear(4, 4))
    mon = attach(model, detail_every=1)
    model.eval()
    model(torch.randn(2, 4))
    with torch.no_grad():
        model.train()
        model(torch.randn(2, 4))
    assert mon._recorder._rec.by_name["activation"].keys() == []


def test_no_activation_or_gradient_tensor_outlives_its_step(attach):
    import gc
    import weakref
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    refs = []
    model[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    mon = attach(model, detail_every=1)
    loss = model(torch.randn(8, 16)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    assert refs and all(r() is None for r in refs)
    mon.flush()


def test_activation_checkpoint_wrappers_keep_the_layer_names_users_know(attach):
    """checkpoint_wrapper (as FSDP recipes apply it per block) inserts
    ``_checkpoint_wrapped_module`` into every name below it; include patterns and the
    ``layer`` label use the names of the unwrapped model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    model[1] = checkpoint_wrapper(model[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = attach(model, include=["1.*", "2"])
    step(model, torch.randn(3, 4), opt)
    mon.flush()
    assert mon.layers == ("1.0", "2")
    assert value(scrape(mon.url), "gradmon_grad_norm", layer="1.0") > 0
