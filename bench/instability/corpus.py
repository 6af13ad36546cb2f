"""The alert-evaluation corpus (issue 22): five small model families and the runs trained on them.

Every run is declared here once: its family, its cause (why it should or should not go wrong), the
mechanism in words, its hyperparameters, its seed and its split. ``record_corpus.py`` trains each
run with gradmon attached and keeps every step packet; ``label.py`` labels it from its loss alone;
``score.py`` replays it through gradmon and the shipped rules.

    python bench/instability/corpus.py --run lm-lr-high-nowarmup-s0   # loss only, no gradmon

prints a run's loss curve (min/max every 50 steps): how each scenario was tuned to show its cause.
Tuning here is of the scenarios, never of a detector.

Families (small enough for one CPU thread, ~2,000 steps each):

- ``lm``: a 2-layer, width-64, 4-head pre-LN GPT (no QK-layernorm) on a copy task: 8 random
  tokens of 16, a separator, the same 8 tokens; the loss counts the copy (chance ln 16); 10 % of
  the targets are random (lm and gru), so the loss has a floor, as real data has. Its
  learning comes in sudden drops (the copy circuit forms at once): the hardest negatives.
- ``cnn``: two 3x3 convolutions and a linear head on generated 10x10 images: one fixed random
  template per class (6 classes, chance ln 6), scaled by a random contrast and buried in noise.
- ``gru``: an embedding, a one-layer GRU of width 32 and a linear head recalling the first of 12
  tokens (8 symbols, chance ln 8): a long plateau at chance, then a sharp drop.
- ``lstm`` (tune seeds only, added on 2026-11-27): an embedding, a one-layer LSTM of width 32 and a
  linear head counting the 0s among 12 tokens of 4 symbols (6 classes, "5 or more" the last;
  chance ln 6): a recurrent family for the tune split, whose only recurrent runs were the held-out
  family's.
- ``rnn`` (tune seeds only, added on 2026-11-28): an embedding, a one-layer tanh RNN of width 32
  and a linear head recalling the first of 6 tokens (8 symbols, chance ln 8): a plateau, a sharp
  drop, and then, healthy as it is, a lone gradient-norm spike of 3-30x every few hundred steps
  (a recurrent net's gradient meeting a steep wall now and then): a negative the tune split had
  no case of.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer import Block  # noqa: E402  (bench/transformer.py: no QK-layernorm)

STEPS = 2000
Batch = Tuple[torch.Tensor, torch.Tensor]


# -- model families ----------------------------------------------------------------------


class CopyLM(nn.Module):
    """GPT-style: token and position embeddings, pre-LN blocks, a final LayerNorm, an untied head."""

    def __init__(self, vocab: int = 16, copy_len: int = 8, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.copy_len = copy_len
        self.embed = nn.Embedding(vocab + 1, width)  # + the separator
        self.pos = nn.Embedding(2 * copy_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))[:, self.copy_len:]  # the positions that predict the copy


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x)).mean(dim=(2, 3))
        return self.head(x)


class Recurrent(nn.Module):
    """An embedding of 16, one recurrent layer of ``width`` (``cell``: ``nn.GRU`` or ``nn.LSTM``,
    named after it: the layers' names are in the recordings) and a linear head read at the last
    position."""

    def __init__(self, cell: type, symbols: int, classes: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(symbols, 16)
        self.cell = cell.__name__.lower()
        self.add_module(self.cell, cell(16, width, batch_first=True))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self._modules[self.cell](self.embed(tokens))
        return self.head(out[:, -1])


def recall_gru() -> nn.Module:
    return Recurrent(nn.GRU, symbols=8, classes=8)


def recall_rnn() -> nn.Module:
    return Recurrent(nn.RNN, symbols=8, classes=8)


def count_lstm() -> nn.Module:
    return Recurrent(nn.LSTM, symbols=4, classes=6)


def _noisy(y: torch.Tensor, classes: int, g: torch.Generator, p: float = 0.1) -> torch.Tensor:
    """A fraction ``p`` of targets replaced by random classes: an irreducible loss floor (about
    0.6 nats here), as real data has, so that "within 1.2x of the minimum" is not read against 0."""
    flip = torch.rand(y.shape, generator=g) < p
    return torch.where(flip, torch.randint(0, classes, y.shape, generator=g), y)


def lm_batches(seed: int, batch: int = 16, vocab: int = 16, copy_len: int = 8) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(1000 + seed)
    sep = torch.full((batch, 1), vocab)
    while True:
        x = torch.randint(0, vocab, (batch, copy_len), generator=g)
        seq = torch.cat([x, sep, x], dim=1)
        yield seq[:, :-1], _noisy(x, vocab, g)


def cnn_templates(classes: int = 6, size: int = 10) -> torch.Tensor:
    """The class templates: the same for every run (the task), smooth enough for a 3x3 conv."""
    g = torch.Generator().manual_seed(7)
    t = torch.randn(classes, 1, size // 2, size // 2, generator=g)
    return F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)


def cnn_batches(seed: int, batch: int = 128, noise: float = 1.5) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(2000 + seed)
    templates = cnn_templates()
    while True:
        y = torch.randint(0, templates.shape[0], (batch,), generator=g)
        contrast = 0.5 + torch.rand(batch, 1, 1, 1, generator=g)
        yield templates[y] * contrast + noise * torch.randn(batch, *templates.shape[1:], generator=g), y


def recall_batches(seed: int, length: int, batch: int = 128, symbols: int = 8) -> Iterator[Batch]:
    """``length`` random tokens; the target is the first (a recurrent net must carry it to the end)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, symbols, (batch, length), generator=g)
        yield x, _noisy(x[:, 0], symbols, g)


def gru_batches(seed: int) -> Iterator[Batch]:
    return recall_batches(3000 + seed, length=12)


def lstm_batches(seed: int, batch: int = 128, symbols: int = 4, length: int = 12, classes: int = 6
                 ) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(5000 + seed)
    while True:
        x = torch.randint(0, symbols, (batch, length), generator=g)
        yield x, _noisy((x == 0).sum(dim=1).clamp(max=classes - 1), classes, g)


def rnn_batches(seed: int) -> Iterator[Batch]:
    return recall_batches(7000 + seed, length=6)


@dataclass(frozen=True)
class Family:
    name: str
    model: Callable[[], nn.Module]
    batches: Callable[[int], Iterator[Batch]]
    classes: int
    poison: Callable[[Batch, torch.Generator], Batch]

    @property
    def chance(self) -> float:
        """The loss of a uniform guess: ln C."""
        return math.log(self.classes)


def _poison_tokens(b: Batch, g: torch.Generator, classes: int) -> Batch:
    """A corrupted shard: the right inputs with random targets (a mislabelled file)."""
    x, y = b
    return x, torch.randint(0, classes, y.shape, generator=g)


def _poison_images(b: Batch, g: torch.Generator) -> Batch:
    """A corrupted shard: images x4 (a missed normalisation), random labels."""
    x, y = b
    return x * 4.0, torch.randint(0, 6, y.shape, generator=g)


FAMILIES: Dict[str, Family] = {
    "lm": Family("lm", CopyLM, lm_batches, 16, lambda b, g: _poison_tokens(b, g, 16)),
    "cnn": Family("cnn", SmallCNN, cnn_batches, 6, _poison_images),
    "gru": Family("gru", recall_gru, gru_batches, 8, lambda b, g: _poison_tokens(b, g, 8)),
    "lstm": Family("lstm", count_lstm, lstm_batches, 6, lambda b, g: _poison_tokens(b, g, 6)),
    "rnn": Family("rnn", recall_rnn, rnn_batches, 8, lambda b, g: _poison_tokens(b, g, 8)),
}


# -- runs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One recorded run. ``boost``: from step ``boost_at`` the lr climbs linearly to ``boost`` x its
    value over ``boost_ramp`` steps (a schedule restart after convergence); ``poison``: the steps
    whose batch is corrupted; ``head_lr``: the head's lr as a multiple of the rest."""

    family: str
    cause: str
    seed: int
    lr: float
    warmup: int = 0
    eps: float = 1e-8
    weight_decay: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.999)
    head_lr: float = 1.0
    boost: float = 1.0
    boost_at: int = 0
    boost_ramp: int = 1
    poison: Tuple[int, ...] = ()
    fp16: bool = False
    loss_scale: float = 1.0  # multiplies the loss before backward: tiny gradients, same optimum
    steps: int = STEPS
    tag: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}-{self.cause}{'-' + self.tag if self.tag else ''}-s{self.seed}"

    def lr_factor(self, step: int) -> float:
        """The schedule's multiplier at 0-based optimizer step ``step``."""
        f = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.boost != 1.0 and step >= self.boost_at:
            f *= 1.0 + (self.boost - 1.0) * min(1.0, (step - self.boost_at + 1) / self.boost_ramp)
        return f


MECHANISMS: Dict[str, str] = {
    "healthy-warmup": "A sane lr with a linear warm-up: learns the task (with sudden drops on lm and gru) and stays.",
    "healthy-nowarmup": "A sane lr from the first step, no warm-up: gradient norms jump early while it learns, "
                        "the loss never diverges.",
    "lr-high-nowarmup": "The lr is too high and applied from the first step: Adam's first updates are lr-sized "
                        "in every coordinate while its second-moment estimate is young, and the weights leave "
                        "the region the task was learnable from.",
    "lr-high-warmup": "The lr is too high but reached through a warm-up: the run learns first and diverges late, "
                      "once the full lr acts on a sharpened loss surface (edge of stability).",
    "late-collapse": "Converges at a sane lr; then a schedule restart raises the lr 100x over 100 steps from "
                     "step 1200: the converged, sharp minimum cannot take it and the loss collapses toward chance.",
    "attn-logit": "Wortsman et al. 2023's condition for attention-logit growth: no QK-layernorm, a high lr "
                  "(3e-2, warm-up 300) and no weight decay to hold the q/k weights back. The loss diverges "
                  "after the warm-up; the attention logits were not measured, so that they, and not the lr "
                  "alone, drive it is the literature's claim, not this corpus's.",
    "output-logit": "Wortsman et al. 2023's condition for output-logit divergence: no z-loss, the head's lr 10x "
                    "the rest (0.2) and no weight decay on it. At this scale the loss wobbles (near step 700) "
                    "but the logits do not run away: a hard negative unless its label says otherwise.",
    "adam-eps": "Molybog et al. 2023's regime: tiny gradients (the loss scaled by 1e-4) against Adam's epsilon "
                "(1e-4): the update g/(sqrt(v)+eps) is SGD-like and damped. At this scale the run learns slowly "
                "and does not diverge: a hard negative for the gradient alerts, not a divergence.",
    "fp16-overflow": "fp16 autocast on the CPU with a GradScaler and a high lr (3e-2, no warm-up): the scaler "
                     "skips the steps whose scaled gradients overflow (a few per run here) while the lr drives "
                     "the loss up. At lr 3e-2 the forward pass never overflowed; at lr 1e-1 without weight "
                     "decay the loss first diverges to chance, then the weights keep growing until the fp16 "
                     "forward overflows (a non-finite loss from about step 1,350).",
    "poisoned-batch": "Sane lr; a corrupted shard (random targets; for cnn also images x4) is fed for a few "
                      "steps: the loss spikes and recovers within 200 steps.",
}


def runs() -> Tuple[Run, ...]:
    """Every run of the corpus. Seeds 0-1 are tune seeds; seeds >= 2 are late seeds (test split)."""
    out: List[Run] = []

    def add(family: str, cause: str, seeds, **kw) -> None:
        out.extend(Run(family, cause, s, **kw) for s in seeds)

    # lm: lr 1e-3/3e-3 learn the copy in sudden drops; 3e-2 without warm-up diverges
    add("lm", "healthy-warmup", (0, 1, 2), lr=1e-3, warmup=200)
    add("lm", "healthy-warmup", (0, 2), lr=3e-3, warmup=200, tag="lr3e-3")
    add("lm", "healthy-nowarmup", (0, 1, 2), lr=1e-3)
    add("lm", "lr-high-nowarmup", (0, 1, 2), lr=3e-2)
    add("lm", "lr-high-warmup", (0, 1, 2), lr=3e-2, warmup=300)
    add("lm", "late-collapse", (0, 2), lr=1e-3, warmup=200, boost=100.0, boost_at=1200, boost_ramp=100)
    add("lm", "attn-logit", (0, 2), lr=3e-2, warmup=300, weight_decay=0.0)
    add("lm", "output-logit", (0, 2), lr=2e-2, warmup=300, head_lr=10.0, weight_decay=0.0)
    add("lm", "poisoned-batch", (0, 1, 2), lr=1e-3, warmup=200, poison=tuple(range(1000, 1008)))
    add("lm", "fp16-overflow", (0, 2), lr=3e-2, fp16=True)
    add("lm", "fp16-overflow", (1,), lr=1e-1, warmup=300, weight_decay=0.0, fp16=True, tag="lr1e-1")
    # cnn: robust to a high lr (it dies at chance at once or plateaus), so its divergences come late
    add("cnn", "healthy-warmup", (0, 1, 2), lr=3e-3, warmup=200)
    add("cnn", "healthy-nowarmup", (0, 2), lr=1e-3)
    add("cnn", "lr-high-nowarmup", (0, 2), lr=5e-2)
    add("cnn", "late-collapse", (0, 1, 2), lr=3e-3, warmup=200, boost=100.0, boost_at=1200, boost_ramp=100)
    add("cnn", "poisoned-batch", (0, 1, 2), lr=3e-3, warmup=200, poison=tuple(range(1000, 1004)))
    add("cnn", "adam-eps", (0,), lr=3e-2, eps=1e-4, loss_scale=1e-4)
    # gru: the held-out family
    add("gru", "healthy-warmup", (0, 1), lr=3e-3, warmup=200)
    add("gru", "healthy-nowarmup", (0, 1), lr=3e-3)
    add("gru", "lr-high-nowarmup", (0, 1, 2), lr=3e-1)
    add("gru", "lr-high-warmup", (0, 1), lr=3e-1, warmup=300)
    add("gru", "late-collapse", (0, 1), lr=3e-3, warmup=200, boost=100.0, boost_at=1200, boost_ramp=100)
    add("gru", "poisoned-batch", (0, 1, 2, 3), lr=3e-3, warmup=200, poison=tuple(range(1000, 1008)))
    # lstm: tune seeds only (added after the test split was first scored: a recurrent family to tune on,
    # the held-out gru family staying held out); the corpus's causes at the gru runs' settings, unchanged
    add("lstm", "healthy-warmup", (0, 1), lr=3e-3, warmup=200)
    add("lstm", "healthy-nowarmup", (0, 1), lr=3e-3)
    add("lstm", "lr-high-nowarmup", (0, 1), lr=3e-1)
    add("lstm", "lr-high-warmup", (0, 1), lr=3e-1, warmup=300)
    add("lstm", "late-collapse", (0, 1), lr=3e-3, warmup=200, boost=100.0, boost_at=1200, boost_ramp=100)
    add("lstm", "poisoned-batch", (0, 1), lr=3e-3, warmup=200, poison=tuple(range(1000, 1008)))
    # rnn: tune seeds only (added after the test split was scored, for the lone spikes of a healthy
    # recurrent net); the corpus's causes, the lr of lr-high-nowarmup lowered until the run learns first
    add("rnn", "healthy-warmup", (0, 1), lr=3e-3, warmup=200)
    add("rnn", "healthy-nowarmup", (0, 1), lr=3e-3)
    add("rnn", "lr-high-nowarmup", (0, 1), lr=1e-1)  # at 3e-1 it never leaves chance: nothing to lose
    add("rnn", "lr-high-warmup", (0, 1), lr=3e-1, warmup=300)
    add("rnn", "late-collapse", (0, 1), lr=3e-3, warmup=200, boost=100.0, boost_at=1200, boost_ramp=100)
    add("rnn", "poisoned-batch", (0, 1), lr=3e-3, warmup=200, poison=tuple(range(1000, 1008)))
    return tuple(out)


TEST_FAMILY = "gru"
LATE_SEED = 2


def split_of(run: Run) -> str:
    """Test: every run of the held-out family, and the late seeds of the other two; the
    independent set's runs (``independent.py``, kept outside the repository): independent."""
    import independent  # noqa: E402  (declares its runs with this module's Run)
    if run in independent.runs():
        return independent.SPLIT
    return "test" if run.family == TEST_FAMILY or run.seed >= LATE_SEED else "tune"


def by_name() -> Dict[str, Run]:
    """Every declared run, the independent set's included (a replay rebuilds its model by name)."""
    import independent  # noqa: E402
    return {r.name: r for r in runs() + independent.runs()}


# -- training ------------------------------------------------------------------------------


def build(run: Run) -> nn.Module:
    """The run's model, initialised from its seed (also how the replay rebuilds its layer names)."""
    torch.manual_seed(run.seed)
    return FAMILIES[run.family].model()


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    head = list(model.head.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    groups = [{"params": rest},
              {"params": head, "lr": run.lr * run.head_lr,
               "weight_decay": 0.0 if run.head_lr != 1.0 else run.weight_decay}]
    return torch.optim.AdamW(groups, lr=run.lr, betas=run.betas, eps=run.eps, weight_decay=run.weight_decay)


Observer = Callable[[torch.Tensor], None]


def train(run: Run, attach: Optional[Callable[[nn.Module, Optional[torch.amp.GradScaler]], Observer]] = None,
          steps: Optional[int] = None, on_step: Optional[Callable[[int], None]] = None) -> List[float]:
    """Train ``run``; ``attach(model, scaler)`` returns the per-step loss observer (gradmon's
    ``monitor.observe``); ``on_step(n)`` runs after step n. Returns the loss of every step as the
    loop computed it (unscaled)."""
    family = FAMILIES[run.family]
    model = build(run)
    opt = _optimizer(run, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, run.lr_factor)
    scaler = torch.amp.GradScaler("cpu") if run.fp16 else None
    observe = attach(model, scaler) if attach is not None else None
    data = family.batches(run.seed)
    poison_rng = torch.Generator().manual_seed(4000 + run.seed)
    losses: List[float] = []
    for step in range(1, (steps or run.steps) + 1):
        batch = next(data)
        if step in run.poison:
            batch = family.poison(batch, poison_rng)
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16, enabled=run.fp16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaled = loss * run.loss_scale
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        if observe is not None:
            observe(loss.detach())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        losses.append(float(loss.detach()))  # the recorder's own bookkeeping, outside gradmon
        if on_step is not None:
            on_step(step)
    return losses


def curve(losses: List[float], every: int = 50) -> str:
    return " ".join(f"{i + every}:{min(losses[i:i + every]):.2f}/{max(losses[i:i + every]):.2f}"
                    for i in range(0, len(losses), every))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run name (see runs()), e.g. lm-healthy-warmup-s0")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float, help="override the run's lr (tuning)")
    a = p.parse_args()
    torch.set_num_threads(1)
    run = by_name()[a.run]
    if a.lr is not None:
        run = replace(run, lr=a.lr)
    t0 = time.process_time()
    losses = train(run, steps=a.steps)
    print(curve(losses))
    print(f"{run.name}: {time.process_time() - t0:.1f} CPU-s, chance {FAMILIES[run.family].chance:.2f}")


if __name__ == "__main__":
    main()
