"""``gradmon top``: a terminal view of one gradmon endpoint, refreshed every second.

It reads ``/metrics`` as Prometheus would (basic auth, TLS and mTLS included), keeps a
short history in memory for the step rate and the global norm's sparkline, and runs the
instant-threshold part of the alert rules locally, with the thresholds of
:class:`gradmon.alerting.Thresholds`. Those are local checks, not the alerts: the rules'
``for`` durations, 30-minute baselines and cross-rank comparisons need Prometheus.

Standard library only (``curses`` for the screen); when stdout is not a terminal (or
with ``--once``) it prints one frame as plain text and exits.
"""

from __future__ import annotations

import argparse
import base64
import collections
import locale
import math
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

from . import metrics as M
from .alerting import Thresholds

DEFAULT_URL = "http://127.0.0.1:9400/metrics"
HISTORY_SECONDS = 300.0
"""How long readings are kept: the sparkline shows the last minute, the non-finite check
looks back five minutes like the rule's window."""
SPARK = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.-=+*#@"

Labels = Tuple[Tuple[str, str], ...]


# -- reading the endpoint ------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """Where and how to scrape: the URL (user:password@ in it is honoured), basic auth, and
    TLS files (a CA to trust, a client certificate for mTLS)."""

    url: str = DEFAULT_URL
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    cafile: Optional[str] = None
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    insecure: bool = False
    timeout: float = 5.0

    def fetch(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        user, password = self.user or parts.username, self.password or parts.password
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        netloc = host + (f":{parts.port}" if parts.port else "") if host else parts.netloc  # without user:password@
        request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
        if user is not None:
            token = base64.b64encode(f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password or '')}".encode())
            request.add_header("Authorization", "Basic " + token.decode())
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=self.cafile)
            if self.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if self.certfile:
                context.load_cert_chain(self.certfile, self.keyfile)
        with urllib.request.urlopen(request, timeout=self.timeout, context=context) as response:
            return response.read().decode("utf-8", "replace")


@dataclass
class Target:
    """One monitored model on one rank, as one scrape showed it: sample name -> [(labels, value)]
    with the ``model`` and ``rank`` labels taken out."""

    model: str
    rank: str
    samples: Dict[str, List[Tuple[Dict[str, str], float]]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> Optional[float]:
        for have, v in self.samples.get(name, ()):
            if all(have.get(k) == want for k, want in labels.items()):
                return v
        return None

    def by_layer(self, name: str, **labels: str) -> Dict[str, float]:
        return {have["layer"]: v for have, v in self.samples.get(name, ())
                if "layer" in have and all(have.get(k) == want for k, want in labels.items())}

    def total(self, name: str) -> float:
        return sum(v for _, v in self.samples.get(name, ()) if not math.isnan(v))


def parse(text: str) -> Dict[Tuple[str, str], Target]:
    """Every gradmon sample of an exposition, grouped by (model, rank)."""
    targets: Dict[Tuple[str, str], Target] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(M.PREFIX + "_") or "model" not in s.labels:
                continue
            labels = dict(s.labels)
            key = (labels.pop("model"), labels.pop("rank", "0"))
            target = targets.setdefault(key, Target(*key))
            target.samples.setdefault(s.name, []).append((labels, s.value))
    return targets


# -- what the view remembers ----------------------------------------------------------------

@dataclass
class Reading:
    at: float
    steps: Optional[float]
    global_norm: Optional[float]
    nonfinite: float


class View:
    """The latest scrape and a few minutes of readings per target."""

    def __init__(self, endpoint: Endpoint, model: Optional[str] = None,
                 thresholds: Thresholds = Thresholds(), clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.model, self.thresholds, self.clock = endpoint, model, thresholds, clock
        self.targets: Dict[Tuple[str, str], Target] = {}
        self.history: Dict[Tuple[str, str], Deque[Reading]] = collections.defaultdict(collections.deque)
        self.error: Optional[str] = None
        self.updated: Optional[float] = None

    def refresh(self) -> None:
        try:
            targets = parse(self.endpoint.fetch())
        except Exception as exc:  # unreachable, refused, bad certificate: shown, and retried
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.error = None
        now = self.clock()
        self.updated = time.time()
        self.targets = {k: t for k, t in targets.items() if self.model is None or t.model == self.model}
        for key, t in self.targets.items():
            readings = self.history[key]
            readings.append(Reading(now, t.value(M.exposed_names(M.STEPS)[0]), t.value(M.GRAD_GLOBAL_NORM.name),
                                    _nonfinite_total(t)))
            while readings and readings[0].at < now - HISTORY_SECONDS:
                readings.popleft()

    def steps_per_second(self, key: Tuple[str, str], window: float = 10.0) -> Optional[float]:
        readings = [r for r in self.history[key] if r.steps is not None]
        if len(readings) < 2:
            return None
        last = readings[-1]
        first = next((r for r in readings if r.at >= last.at - window), readings[0])
        if first is last:
            first = readings[-2]
        return (last.steps - first.steps) / (last.at - first.at) if last.at > first.at else None


def _nonfinite_total(t: Target) -> float:
    """Non-finite elements this target counted, every tensor: the rank-level counters where
    it exports them (every rank does), else its per-layer ones."""
    rank = M.exposed_names(M.RANK_NONFINITE)[0]
    if rank in t.samples:
        return t.total(rank)
    return t.total(M.exposed_names(M.NONFINITE)[0]) + t.total(M.exposed_names(M.LOCAL_NONFINITE)[0])


# -- local checks ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """The instant part of one alert rule: ``hits`` lists what crosses its threshold now."""

    alert: str
    hits: Callable[[Target, Sequence[Reading], Thresholds], List[str]]


def _past_warmup(t: Target, th: Thresholds) -> bool:
    steps = t.value(M.exposed_names(M.STEPS)[0])
    return steps is not None and steps > th.warmup_steps


def _above(name: str, limit: Callable[[Thresholds], float], what: str, warmup: bool = False, **labels: str):
    def hits(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
        if warmup and not _past_warmup(t, th):
            return []
        bound = limit(th)
        return [f"{layer}: {what} {_num(v)} > {_num(bound)}"
                for layer, v in sorted(t.by_layer(name, **labels).items(), key=lambda kv: -kv[1]) if v > bound]
    return hits


def _nonfinite(t: Target, readings: Sequence[Reading], th: Thresholds) -> List[str]:
    if len(readings) < 2 or readings[-1].nonfinite <= readings[0].nonfinite:
        return []
    new = readings[-1].nonfinite - readings[0].nonfinite
    origin = ", ".join(f"{have.get('tensor')} {have.get('layer')} at step {v:.0f}"
                       for have, v in t.samples.get(M.NONFINITE_ORIGIN.name, ()))
    return [f"{_num(new)} new NaN/Inf elements" + (f" (started: {origin})" if origin else "")]


def _explosion(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    norm = t.value(M.GRAD_GLOBAL_NORM.name)
    if norm is None or not _past_warmup(t, th) or not norm > th.explode_abs:
        return []
    return [f"global norm {_num(norm)} > {_num(th.explode_abs)}"]


def _vanishing(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    if not _past_warmup(t, th):
        return []
    return [f"{layer}: norm {_num(v)} < {_num(th.vanish_abs)}"
            for layer, v in sorted(t.by_layer(M.GRAD_NORM.name).items(), key=lambda kv: kv[1]) if v < th.vanish_abs]


def _learning_rate(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    return [f"group {have.get('group')}: lr {v}" for have, v in t.samples.get(M.LEARNING_RATE.name, ())
            if not math.isfinite(v)]


def _failed(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    if t.value(M.RUN_STATE.name, state=M.STATE_FAILED) != 1:
        return []
    exc = [have.get("exception") for have, _ in t.samples.get(M.RUN_FAILURE_INFO.name, ())]
    return ["run failed" + (f" ({exc[0]})" if exc and exc[0] else "")]


def _loss_scale(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    scale = t.value(M.AMP_LOSS_SCALE.name)
    return [f"loss scale {_num(scale)} < {_num(th.amp_min_loss_scale)}"] if scale is not None and scale < th.amp_min_loss_scale else []


CHECKS: Tuple[Check, ...] = (
    Check("GradmonNonFiniteGradients", _nonfinite),
    Check("GradmonRunFailed", _failed),
    Check("GradmonGradientExplosion", _explosion),
    Check("GradmonVanishingGradients", _vanishing),
    Check("GradmonActivationBlowup", lambda t, r, th: sorted(set(
        _above(M.ACTIVATION_ABS_MAX.name, lambda th: th.activation_abs_max, "max|x|")(t, r, th)
        + _above(M.ACTIVATION_ABS_MAX_WORST.name, lambda th: th.activation_abs_max, "max|x|")(t, r, th)))),
    Check("GradmonGradNormAboveBaseline", _above(M.GRAD_NORM_BASELINE_RATIO.name, lambda th: th.norm_baseline_ratio,
                                                 "norm / its baseline", warmup=True)),
    Check("GradmonLocalGradNormAboveBaseline", _above(M.LOCAL_GRAD_NORM_RATIO_WORST.name,
                                                      lambda th: th.norm_baseline_ratio, "own norm / its baseline",
                                                      warmup=True)),
    Check("GradmonUpdateRatioAboveBaseline", _above(M.UPDATE_RATIO_BASELINE_RATIO.name,
                                                    lambda th: th.update_baseline_ratio, "update ratio / its baseline",
                                                    warmup=True)),
    Check("GradmonAdamRmsSpike", _above(M.ADAM_RMS.name, lambda th: th.adam_rms_spike, "Adam RMS")),
    Check("GradmonFp16HeadroomLow", _above(M.FP16_RANGE_USED.name, lambda th: 1 / th.fp16_min_headroom,
                                           "fp16 range used", tensor=M.TENSOR_ACTIVATION)),
    Check("GradmonLearningRateNonFinite", _learning_rate),
    Check("GradmonLossScaleCollapse", _loss_scale),
)


# -- the frame --------------------------------------------------------------------------------

def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x != x or math.isinf(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 or x == 0 else f"{x:.2e}"


def sparkline(values: Sequence[float], chars: str = SPARK) -> str:
    """One character per value on a log scale between the smallest and largest positive
    finite value; a non-finite value is ``!``, a missing or non-positive one a space."""
    good = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not good:
        return "".join("!" if v is not None and not math.isfinite(v) else " " for v in values)
    lo, hi = math.log10(min(good)), math.log10(max(good))
    out = []
    for v in values:
        if v is None or (math.isfinite(v) and v <= 0):
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!")
        else:
            level = 0 if hi == lo else int((math.log10(v) - lo) / (hi - lo) * (len(chars) - 1) + 0.5)
            out.append(chars[level])
    return "".join(out)


def render(view: View, width: int = 100, chars: str = SPARK) -> List[str]:
    """The frame as lines of at most ``width`` characters."""
    when = time.strftime("%H:%M:%S", time.localtime(view.updated)) if view.updated else "never"
    lines = [f"gradmon top  {view.endpoint.url}  read {when}  (q quits)"]
    if view.error:
        lines.append(f"cannot read the endpoint: {view.error}")
    if not view.targets:
        lines.append("no gradmon model on this endpoint yet" if not view.error else "")
    for key in sorted(view.targets):
        lines += [""] + _render_target(view, key, chars)
    return [line[:width] for line in lines]


def _render_target(view: View, key: Tuple[str, str], chars: str) -> List[str]:
    t, readings, th = view.targets[key], list(view.history[key]), view.thresholds
    state = next((have["state"] for have, v in t.samples.get(M.RUN_STATE.name, ()) if v == 1), "-")
    rate = view.steps_per_second(key)
    step = t.value(M.STEP.name)
    lines = [f"model {t.model}  rank {t.rank}  state {state}  step {_num(step) if step is not None else '-'}  "
             f"steps {_num(t.value(M.exposed_names(M.STEPS)[0]))}  steps/s {_num(rate) if rate is not None else '-'}  "
             f"world {_num(t.value(M.WORLD_SIZE.name))}"]
    recent = [r.global_norm for r in readings if r.at >= readings[-1].at - 60] if readings else []
    norm = t.value(M.GRAD_GLOBAL_NORM.name)
    lines.append(f"global norm {_num(norm)}  {sparkline(recent, chars)}  (last minute, log scale)")
    extras = [f"loss {_num(t.value(M.LOSS.name))}"] if t.value(M.LOSS.name) is not None else []
    extras += [f"lr[{have.get('group')}] {_num(v)}" for have, v in t.samples.get(M.LEARNING_RATE.name, ())][:4]
    if extras:
        lines.append("  ".join(extras))
    norms = t.by_layer(M.GRAD_NORM.name)
    if norms:
        ranked = sorted(norms.items(), key=lambda kv: (-kv[1] if kv[1] == kv[1] else -math.inf))
        name_w = min(40, max(len(layer) for layer in norms))
        lines.append(f"{'largest gradient norms':<{name_w + 12}}smallest")
        top, bottom = ranked[:10], sorted(norms.items(), key=lambda kv: kv[1])[:5]
        for i in range(len(top)):
            left = f"  {top[i][0][:name_w]:<{name_w}} {_num(top[i][1]):>9}"
            right = f"  {bottom[i][0][:name_w]:<{name_w}} {_num(bottom[i][1]):>9}" if i < len(bottom) else ""
            lines.append(f"{left}{right}")
    else:
        lines.append("per-layer gradient norms: not exported here (a data-parallel rank other than 0)")
    counts = collections.Counter()
    for have, v in t.samples.get(M.exposed_names(M.RANK_NONFINITE)[0], ()):
        counts[have.get("tensor")] += v
    origin = [f"{have.get('tensor')}: {have.get('layer')} at step {v:.0f}"
              for have, v in t.samples.get(M.NONFINITE_ORIGIN.name, ())]
    lines.append("non-finite elements: " + ("  ".join(f"{k} {v:.0f}" for k, v in sorted(counts.items())) or "-")
                 + (f"  (started in {'; '.join(origin)})" if origin else ""))
    lines.append("local checks (the alert rules' instant thresholds; durations, baselines, ranks: Prometheus):")
    fired = [(c.alert, hit) for c in CHECKS for hit in c.hits(t, readings, th)]
    if fired:
        lines += [f"  !! {alert}: {hit}" for alert, hit in fired]
    else:
        lines.append(f"  ok: all {len(CHECKS)} local checks pass")
    return lines


# -- the command ------------------------------------------------------------------------------

def _chars() -> str:
    encoding = (getattr(sys.stdout, "encoding", None) or locale.getpreferredencoding(False) or "").lower()
    return SPARK if "utf" in encoding else SPARK_ASCII


def _plain(view: View, interval: float, out) -> int:
    view.refresh()
    if not view.error:
        time.sleep(interval)  # a second reading gives the step rate
        view.refresh()
    print("\n".join(render(view, width=200, chars=_chars())), file=out)
    return 1 if view.error else 0


def _screen(view: View, interval: float) -> int:
    import curses

    def loop(screen) -> int:
        try:
            curses.curs_set(0)
        except curses.error:  # a terminal without cursor control
            pass
        screen.timeout(int(interval * 1000))
        chars = _chars()
        while True:
            view.refresh()
            height, width = screen.getmaxyx()
            screen.erase()
            for row, line in enumerate(render(view, width=max(1, width - 1), chars=chars)[:height]):
                try:
                    screen.addstr(row, 0, line)
                except curses.error:  # the last cell of a small window
                    pass
            screen.refresh()
            key = screen.getch()  # waits up to ``interval``
            if key in (ord("q"), ord("Q"), 27):
                return 0

    try:
        return curses.wrapper(loop)
    except KeyboardInterrupt:
        return 0


def main(argv: Optional[Sequence[str]] = None, out=None) -> int:
    out = sys.stdout if out is None else out
    p = argparse.ArgumentParser(prog="gradmon top", description="A terminal view of a gradmon endpoint.")
    p.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the /metrics URL (default {DEFAULT_URL})")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--model", default=None, help="show this model only (several may share an endpoint)")
    p.add_argument("--user", default=None, help="basic-auth user (or user:password@ in the URL)")
    p.add_argument("--password-file", default=None,
                   help="file holding the basic-auth password (or GRADMON_TOP_PASSWORD)")
    p.add_argument("--cacert", default=None, help="CA certificate (PEM) to trust for an https URL")
    p.add_argument("--cert", default=None, help="client certificate (PEM) for mutual TLS")
    p.add_argument("--key", default=None, help="the client certificate's key (PEM)")
    p.add_argument("--insecure", action="store_true", help="do not verify the server's certificate")
    p.add_argument("--once", action="store_true", help="print one frame as text and exit (the default when "
                                                       "stdout is not a terminal)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be positive")
    password = os.environ.get("GRADMON_TOP_PASSWORD")
    if args.password_file:
        with open(args.password_file) as f:
            password = f.read().strip()
    endpoint = Endpoint(args.url, args.user, password, args.cacert, args.cert, args.key, args.insecure)
    view = View(endpoint, args.model)
    if args.once or not (out is sys.stdout and sys.stdout.isatty()):
        return _plain(view, min(args.interval, 1.0), out)
    return _screen(view, args.interval)
