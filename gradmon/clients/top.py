"""``gradmon top``: a terminal view of one gradmon endpoint, refreshed every second.

It reads ``/metrics`` as Prometheus would (basic auth, TLS and mTLS included), keeps a
short history in memory for the step rate and the global norm's sparkline, and runs the
instant-threshold part of the alert rules locally, with the thresholds of
:class:`gradmon.thresholds.Thresholds`. Those are local checks, not the alerts: the rules'
``for`` durations, 30-minute baselines and cross-rank comparisons need Prometheus.

The endpoint is a network peer and may be hostile: it is read through :mod:`gradmon.fetch`
(one deadline per refresh, a bound on the body, no redirect followed, no proxy unless
``--proxy``), and everything it sends passes :func:`gradmon.sanitize.clean` before it is
shown. A URL's password is never shown.

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
import queue
import re
import ssl
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from prometheus_client.parser import text_string_to_metric_families

from . import fetch
from .. import metrics as M
from ..thresholds import PRODUCTION, Thresholds, dur
from .fetch import mask_credentials
from .sanitize import clean

DEFAULT_URL = "http://127.0.0.1:9400/metrics"
NONFINITE_WINDOW = PRODUCTION.nonfinite_window
GUARD_WINDOW = PRODUCTION.guard_window
HISTORY_SECONDS = max(300.0, NONFINITE_WINDOW, GUARD_WINDOW)
"""How long readings are kept: the sparkline shows the last minute, the non-finite and guard
checks look back as far as their rules' windows."""
SPARK = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.-=+*#@"
KEY_WAIT_MS = 100
"""How long the screen waits for a key between looks at the poller: how fast ``q`` answers."""

Labels = Tuple[Tuple[str, str], ...]


# -- reading the endpoint ------------------------------------------------------------------

def metrics_url(arg: str) -> str:
    """The /metrics URL the user meant: ``9400`` (or ``:9400``) is that port on 127.0.0.1,
    ``host:port`` without a scheme is http, and the live page's URL (no path, or ``/``) is
    its ``/metrics``. Anything else that cannot be read raises ValueError saying what to type."""
    example = "e.g. gradmon top http://127.0.0.1:9400/metrics, or just gradmon top 9400"
    text = arg.strip()
    if re.fullmatch(r":?\d+", text):
        port = int(text.lstrip(":"))
        if not 0 < port < 65536:
            raise ValueError(f"{clean(arg)!r} is no port (1 to 65535); {example}")
        return f"http://127.0.0.1:{port}/metrics"
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    shown = clean(mask_credentials(text))
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{shown} is not an http:// or https:// URL; {example}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"the port of {shown} is not a number from 1 to 65535; {example}") from None
    if not parts.hostname:
        raise ValueError(f"{shown} names no host; {example}")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to scrape: the URL (user:password@ in it is honoured), basic auth, and
    TLS files (a CA to trust, a client certificate for mTLS); ``timeout`` bounds a whole
    read, ``max_bytes`` its body, and ``proxy`` is the only proxy it ever goes through."""

    url: str = DEFAULT_URL
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    cafile: Optional[str] = None
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    insecure: bool = False
    timeout: float = fetch.DEFAULT_TIMEOUT
    max_bytes: int = fetch.DEFAULT_MAX_BYTES
    proxy: Optional[str] = None

    def __repr__(self) -> str:
        return f"Endpoint({self.shown!r})"

    @property
    def shown(self) -> str:
        """The URL as it may be printed: no password, nothing a terminal would obey."""
        return clean(mask_credentials(self.url))

    def redact(self, text: str) -> str:
        """``text`` (an error, a Location) safe to print: no URL password, not the password
        itself wherever a server echoed it, nothing a terminal would obey."""
        text = mask_credentials(text)
        for secret in (self._password(), urllib.parse.urlsplit(self.proxy).password if self.proxy else None):
            if secret and len(secret) >= 3:  # shorter, and every "ab" in a message would be starred
                text = text.replace(secret, "***")
        return clean(text)

    def _password(self) -> Optional[str]:
        if self.password is not None:
            return self.password
        password = urllib.parse.urlsplit(self.url).password
        return None if password is None else urllib.parse.unquote(password)

    def fetch(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        user = self.user or parts.username
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        netloc = host + (f":{parts.port}" if parts.port else "") if host else parts.netloc  # without user:password@
        authorization = None
        if user is not None:
            token = f"{urllib.parse.unquote(user)}:{self._password() or ''}"
            authorization = "Basic " + base64.b64encode(token.encode()).decode()
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=self.cafile)
            if self.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if self.certfile:
                context.load_cert_chain(self.certfile, self.keyfile)
        response = fetch.get(urllib.parse.urlunsplit(parts._replace(netloc=netloc)), authorization=authorization,
                             context=context, timeout=self.timeout, max_bytes=self.max_bytes, proxy=self.proxy)
        if response.content_type.lower().startswith("text/html"):
            metrics = mask_credentials(urllib.parse.urlunsplit(parts._replace(path="/metrics", query="")))
            raise fetch.FetchError(f"{self.shown} is a web page, not the metrics; run: gradmon top {metrics}")
        return response.body.decode("utf-8", "replace")


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


MAX_LINE = 64 * 1024
"""Longest exposition line read. prometheus_client's parser takes time quadratic in a line's
length (a sample with a million labels parses for minutes); gradmon's lines are far shorter."""
_LONG_LINE = re.compile(f"^[^\n]{{{MAX_LINE + 1}}}", re.MULTILINE)  # tried at line starts only: linear


def parse(text: str) -> Dict[Tuple[str, str], Target]:
    """Every gradmon sample of an exposition, grouped by (model, rank); names, label names
    and label values cleaned, so nothing the endpoint wrote reaches the screen raw."""
    if _LONG_LINE.search(text):
        raise ValueError(f"a line longer than {MAX_LINE:,} characters: not a gradmon exposition")
    targets: Dict[Tuple[str, str], Target] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(M.PREFIX + "_") or "model" not in s.labels:
                continue
            labels = {clean(k): clean(v) for k, v in s.labels.items()}
            key = (labels.pop("model"), labels.pop("rank", "0"))
            target = targets.setdefault(key, Target(*key))
            target.samples.setdefault(clean(s.name), []).append((labels, s.value))
    return targets


@dataclass(frozen=True)
class Scrape:
    """One read of the endpoint: when it ended, and the targets it showed or why it failed."""

    at: float
    result: Union[Dict[Tuple[str, str], Target], Exception]


def read(endpoint: Endpoint, clock: Callable[[], float] = time.monotonic) -> Scrape:
    """Fetch and parse once; a failure is returned, not raised (it may cross threads)."""
    try:
        result: Union[Dict[Tuple[str, str], Target], Exception] = parse(endpoint.fetch())
    except Exception as exc:  # unreachable, refused, too slow, too large, not an exposition
        result = exc
    return Scrape(clock(), result)


# -- what the view remembers ----------------------------------------------------------------

@dataclass
class Reading:
    at: float
    steps: Optional[float]
    global_norm: Optional[float]
    nonfinite: float
    guard_skipped: float = 0.0


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
        self.take(read(self.endpoint, self.clock))

    def take(self, scrape: Scrape) -> None:
        """Remember one scrape. A redirect is raised: it is never retried nor followed."""
        if isinstance(scrape.result, fetch.Redirected):
            raise scrape.result
        if isinstance(scrape.result, Exception):  # shown, and retried
            exc = scrape.result
            message = str(exc) if isinstance(exc, fetch.FetchError) else f"{type(exc).__name__}: {exc}"
            self.error = self.endpoint.redact(message[:500])
            return
        self.error = None
        self.updated = time.time()
        self.targets = {k: t for k, t in scrape.result.items() if self.model is None or t.model == self.model}
        for key, t in self.targets.items():
            readings = self.history[key]
            readings.append(Reading(scrape.at, t.value(M.exposed_names(M.STEPS)[0]),
                                    t.value(M.GRAD_GLOBAL_NORM.name), _nonfinite_total(t),
                                    t.total(M.exposed_names(M.GUARD_SKIPPED_STEPS)[0])))
            # one reading at or before the window's start stays: it says the window was watched whole
            while len(readings) > 1 and readings[1].at <= scrape.at - HISTORY_SECONDS:
                readings.popleft()
        for key in set(self.history) - set(self.targets):  # an endpoint that renames its models grows nothing
            del self.history[key]

    def steps_per_second(self, key: Tuple[str, str], window: float = 10.0) -> Optional[float]:
        readings = [r for r in self.history[key] if r.steps is not None]
        if len(readings) < 2:
            return None
        last = readings[-1]
        first = next((r for r in readings if r.at >= last.at - window), readings[0])
        if first is last:
            first = readings[-2]
        return (last.steps - first.steps) / (last.at - first.at) if last.at > first.at else None


class Poller:
    """Reads the endpoint every ``interval`` seconds on a thread of its own, so the screen
    answers keys while a read waits out its deadline."""

    def __init__(self, endpoint: Endpoint, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.interval, self.clock = endpoint, interval, clock
        self._scrapes: "queue.Queue[Scrape]" = queue.Queue()
        self._stopped = threading.Event()
        # a daemon: a read in flight when the user quits ends at its deadline, or with the process
        self._thread = threading.Thread(target=self._run, name="top-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            self._scrapes.put(read(self.endpoint, self.clock))
            if self._stopped.wait(max(0.0, self.interval - (time.monotonic() - began))):
                return

    def scrapes(self) -> List[Scrape]:
        """The scrapes that arrived since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._scrapes.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        self._stopped.set()


def _nonfinite_total(t: Target) -> float:
    """Non-finite elements this target counted, every tensor: the rank-level counters where
    it exports them (every rank does), else its per-layer ones."""
    rank = M.exposed_names(M.RANK_NONFINITE)[0]
    if rank in t.samples:
        return t.total(rank)
    return t.total(M.exposed_names(M.NONFINITE)[0]) + t.total(M.exposed_names(M.LOCAL_NONFINITE)[0])


# -- local checks ----------------------------------------------------------------------------

def _sure(t: Target, readings: Sequence[Reading], th: Thresholds) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Check:
    """The instant part of one alert rule: ``hits`` lists what crosses its threshold now;
    ``unsure`` says why a check that needs history cannot pass yet (None: it can)."""

    alert: str
    hits: Callable[[Target, Sequence[Reading], Thresholds], List[str]]
    unsure: Callable[[Target, Sequence[Reading], Thresholds], Optional[str]] = _sure


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


def _sustained(name: str, steps: Callable[[Thresholds], int], hits: Callable[[Target, Sequence[Reading], Thresholds],
                                                                          List[str]]):
    """``hits`` where the gauge ``name`` (a run of steps counted in the process) has reached ``steps``."""
    def sustained(t: Target, readings: Sequence[Reading], th: Thresholds) -> List[str]:
        run = t.value(name)
        return hits(t, readings, th) if run is not None and run >= steps(th) else []
    return sustained


def _increase(values: Sequence[float]) -> float:
    """What a counter gained over ``values``: a drop is a restart from 0, as in PromQL."""
    return sum(b - a if b >= a else b for a, b in zip(values, values[1:]))


def _nonfinite(t: Target, readings: Sequence[Reading], th: Thresholds) -> List[str]:
    recent = [r.nonfinite for r in readings if r.at >= readings[-1].at - NONFINITE_WINDOW] if readings else []
    new = _increase(recent)
    if not new > 0:
        return []
    origin = ", ".join(f"{have.get('tensor')} {have.get('layer')} at step {_int(v)}"
                       for have, v in t.samples.get(M.NONFINITE_ORIGIN.name, ()))
    return [f"{_int(new)} new NaN/Inf elements" + (f" (started: {origin})" if origin else "")]


def _unsure(count: Callable[[Reading], float], total: Callable[[Target], float], what: str, window: float):
    """Counted, none new while watched: the rule looks back ``window``, further than top has
    (a late start, or ``--once``), so whether it fires is not known here."""
    def unsure(t: Target, readings: Sequence[Reading], th: Thresholds) -> Optional[str]:
        counted = count(readings[-1]) if readings else total(t)
        watched = readings[-1].at - readings[0].at if readings else 0.0
        if counted > 0 and watched < window:
            return (f"not enough history: {_int(counted)} {what} counted, none new in the {watched:.0f} s "
                    f"watched (the rule looks back {dur(window)})")
        return None
    return unsure


_nonfinite_unsure = _unsure(lambda r: r.nonfinite, _nonfinite_total, "NaN/Inf elements", NONFINITE_WINDOW)


def _guard_skipped(t: Target, readings: Sequence[Reading], th: Thresholds) -> List[str]:
    recent = [r.guard_skipped for r in readings if r.at >= readings[-1].at - GUARD_WINDOW] if readings else []
    new = _increase(recent)
    return [f"{_int(new)} optimizer step(s) skipped by the guard in the last {dur(GUARD_WINDOW)}"] if new > 0 else []


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


def _learning_rate_above_peak(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    return [f"group {have.get('group')}: lr {_num(v)}x its settled peak >= {_num(th.lr_over_peak)}"
            for have, v in t.samples.get(M.LEARNING_RATE_OVER_PEAK.name, ()) if v >= th.lr_over_peak]


def _failed(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    if t.value(M.RUN_STATE.name, state=M.STATE_FAILED) != 1:
        return []
    exc = [have.get("exception") for have, _ in t.samples.get(M.RUN_FAILURE_INFO.name, ())]
    return ["run failed" + (f" ({exc[0]})" if exc and exc[0] else "")]


def _loss_scale(t: Target, _: Sequence[Reading], th: Thresholds) -> List[str]:
    scale = t.value(M.AMP_LOSS_SCALE.name)
    return [f"loss scale {_num(scale)} < {_num(th.amp_min_loss_scale)}"] if scale is not None and scale < th.amp_min_loss_scale else []


CHECKS: Tuple[Check, ...] = (
    Check("GradmonNonFiniteGradients", _nonfinite, _nonfinite_unsure),
    Check("GradmonGuardSkippedStep", _guard_skipped, _unsure(
        lambda r: r.guard_skipped, lambda t: t.total(M.exposed_names(M.GUARD_SKIPPED_STEPS)[0]),
        "step(s) skipped by the guard", GUARD_WINDOW)),
    Check("GradmonRunFailed", _failed),
    Check("GradmonGradientExplosion", _explosion),
    Check("GradmonVanishingGradients", _vanishing),
    Check("GradmonActivationBlowup", lambda t, r, th: sorted(set(
        _above(M.ACTIVATION_ABS_MAX.name, lambda th: th.activation_abs_max, "max|x|")(t, r, th)
        + _above(M.ACTIVATION_ABS_MAX_WORST.name, lambda th: th.activation_abs_max, "max|x|")(t, r, th)))),
    Check("GradmonGradNormAboveBaseline", _sustained(
        M.GRAD_NORM_ABOVE_BASELINE_STEPS.name, lambda th: th.norm_ratio_steps,
        _above(M.GRAD_NORM_BASELINE_RATIO.name, lambda th: th.norm_baseline_ratio, "norm / its baseline", warmup=True))),
    Check("GradmonLocalGradNormAboveBaseline", _sustained(
        M.LOCAL_GRAD_NORM_ABOVE_BASELINE_STEPS.name, lambda th: th.norm_ratio_steps,
        _above(M.LOCAL_GRAD_NORM_RATIO_WORST.name, lambda th: th.norm_baseline_ratio, "own norm / its baseline",
               warmup=True))),
    Check("GradmonUpdateRatioAboveBaseline", _above(M.UPDATE_RATIO_BASELINE_RATIO.name,
                                                    lambda th: th.update_baseline_ratio, "update ratio / its baseline",
                                                    warmup=True)),
    Check("GradmonAdamRmsSpike", _above(M.ADAM_RMS.name, lambda th: th.adam_rms_spike, "Adam RMS")),
    Check("GradmonFp16HeadroomLow", _above(M.FP16_RANGE_USED.name, lambda th: 1 / th.fp16_min_headroom,
                                           "fp16 range used", tensor=M.TENSOR_ACTIVATION)),
    Check("GradmonLearningRateNonFinite", _learning_rate),
    Check("GradmonLearningRateAbovePeak", _learning_rate_above_peak),
    Check("GradmonLossScaleCollapse", _loss_scale),
)


# -- the frame --------------------------------------------------------------------------------

def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x != x or math.isinf(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 or x == 0 else f"{x:.2e}"


def _int(x: Optional[float]) -> str:
    """A count or a step, in full (``81234``, not ``8.12e+04``); a fraction as :func:`_num`."""
    if x is not None and math.isfinite(x) and x == int(x):
        return str(int(x))
    return _num(x)


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


def render(view: View, width: int = 100, chars: str = SPARK, interactive: bool = False,
           height: Optional[int] = None) -> List[str]:
    """The frame as lines of at most ``width`` characters, each through :func:`clean` (what
    came from the endpoint is clean already; this is the one gate to every output mode);
    targets past ``height`` lines are not rendered at all (an endpoint may hold thousands)."""
    when = time.strftime("%H:%M:%S", time.localtime(view.updated)) if view.updated else "never"
    lines = [f"gradmon top  {view.endpoint.shown}  read {when}" + ("  (q quits)" if interactive else "")]
    if view.error:
        lines.append(f"cannot read the endpoint: {view.error}")
    if not view.targets:
        lines.append("" if view.error else "no gradmon model on this endpoint yet" if view.updated
                     else "reading the endpoint...")
    for key in sorted(view.targets):
        if height is not None and len(lines) >= height:
            break
        lines += [""] + _render_target(view, key, chars)
    return [clean(line)[:width] for line in lines[:height]]


def _render_target(view: View, key: Tuple[str, str], chars: str) -> List[str]:
    t, readings = view.targets[key], list(view.history[key])
    state = next((have["state"] for have, v in t.samples.get(M.RUN_STATE.name, ()) if v == 1), "-")
    rate = view.steps_per_second(key)
    lines = [f"model {t.model}  rank {t.rank}  state {state}  step {_int(t.value(M.STEP.name))}  "
             f"steps {_int(t.value(M.exposed_names(M.STEPS)[0]))}  steps/s {_num(rate)}  "
             f"world {_int(t.value(M.WORLD_SIZE.name))}"]
    recent = [r.global_norm for r in readings if r.at >= readings[-1].at - 60] if readings else []
    norm = t.value(M.GRAD_GLOBAL_NORM.name)
    lines.append(f"global norm {_num(norm)}  {sparkline(recent, chars)}  (last minute, log scale)")
    extras = [f"loss {_num(t.value(M.LOSS.name))}"] if t.value(M.LOSS.name) is not None else []
    extras += [f"lr[{have.get('group')}] {_num(v)}" for have, v in t.samples.get(M.LEARNING_RATE.name, ())][:4]
    if extras:
        lines.append("  ".join(extras))
    lines += _layer_table(t.by_layer(M.GRAD_NORM.name))
    counts: Dict[str, float] = collections.Counter()
    for have, v in t.samples.get(M.exposed_names(M.RANK_NONFINITE)[0], ()):
        counts[have.get("tensor", "")] += v
    origin = [f"{have.get('tensor')}: {have.get('layer')} at step {_int(v)}"
              for have, v in t.samples.get(M.NONFINITE_ORIGIN.name, ())]
    lines.append("non-finite elements: " + ("  ".join(f"{k} {_int(v)}" for k, v in sorted(counts.items())) or "-")
                 + (f"  (started in {'; '.join(origin)})" if origin else ""))
    lines += _guard_line(t)
    shown = [norm, t.value(M.LOSS.name), *t.by_layer(M.GRAD_NORM.name).values()]
    seen = (bool(origin) or any(v != 0 for v in counts.values()) or _nonfinite_total(t) != 0
            or any(v is not None and not math.isfinite(v) for v in shown))
    return lines + _check_lines(t, readings, view.thresholds, seen)


def _guard_line(t: Target) -> List[str]:
    """The step guard's skips by reason and its latest skip; nothing without a guard."""
    skipped = [(have.get("reason", ""), v) for have, v in t.samples.get(M.exposed_names(M.GUARD_SKIPPED_STEPS)[0], ())]
    if not skipped:
        return []
    last = [(have.get("reason", ""), v) for have, v in t.samples.get(M.GUARD_LAST_SKIP_STEP.name, ())]
    return [f"steps skipped by the guard: {_int(sum(v for _, v in skipped))} ("
            + ", ".join(f"{reason} {_int(v)}" for reason, v in sorted(skipped)) + ")"
            + "".join(f", latest at step {_int(v)}: {reason}" for reason, v in last[:1])]


def _layer_table(norms: Dict[str, float]) -> List[str]:
    if not norms:
        return ["per-layer gradient norms: not exported here (a data-parallel rank other than 0)"]
    ranked = sorted(norms.items(), key=lambda kv: (-kv[1] if kv[1] == kv[1] else -math.inf))
    name_w = min(40, max(len(layer) for layer in norms))
    lines = [f"{'largest gradient norms':<{name_w + 12}}smallest"]
    top, bottom = ranked[:10], sorted(norms.items(), key=lambda kv: kv[1])[:5]
    for i in range(len(top)):
        left = f"  {top[i][0][:name_w]:<{name_w}} {_num(top[i][1]):>9}"
        right = f"  {bottom[i][0][:name_w]:<{name_w}} {_num(bottom[i][1]):>9}" if i < len(bottom) else ""
        lines.append(f"{left}{right}")
    return lines


def _check_lines(t: Target, readings: Sequence[Reading], th: Thresholds, nonfinite_seen: bool) -> List[str]:
    """What fires (``!!``), what cannot be known yet (``??``), and "ok" only when nothing
    fires, every check could decide, and no non-finite value was counted."""
    lines = ["local checks (the alert rules' instant thresholds; durations, baselines, ranks: Prometheus):"]
    fired = [(c.alert, hit) for c in CHECKS for hit in c.hits(t, readings, th)]
    firing = {alert for alert, _ in fired}
    unsure = [(c.alert, why) for c in CHECKS if c.alert not in firing for why in [c.unsure(t, readings, th)] if why]
    lines += [f"  !! {alert}: {hit}" for alert, hit in fired] + [f"  ?? {alert}: {why}" for alert, why in unsure]
    quiet = len(CHECKS) - len(firing) - len(unsure)
    if fired or unsure:
        lines.append(f"  the other {quiet} local checks: nothing over their thresholds")
    elif nonfinite_seen:
        lines.append(f"  none of the {len(CHECKS)} local checks fires now, but non-finite values are shown above "
                     f"(counts older than the rule's {dur(NONFINITE_WINDOW)}, or a NaN reading)")
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

    def draw(screen, chars: str) -> None:
        height, width = screen.getmaxyx()
        screen.erase()
        for row, line in enumerate(render(view, width=max(1, width - 1), chars=chars, interactive=True,
                                          height=height)):
            try:
                screen.addstr(row, 0, line)
            except curses.error:  # the last cell of a small window
                pass
        screen.refresh()

    def loop(screen) -> int:
        try:
            curses.curs_set(0)
        except curses.error:  # a terminal without cursor control
            pass
        screen.timeout(KEY_WAIT_MS)
        chars, stale = _chars(), True
        poller = Poller(view.endpoint, interval, view.clock)
        try:
            while True:
                scrapes = poller.scrapes()
                for scrape in scrapes:
                    view.take(scrape)
                if scrapes or stale:
                    draw(screen, chars)
                key = screen.getch()  # waits up to KEY_WAIT_MS, whatever the endpoint does
                if key in (ord("q"), ord("Q"), 27):
                    return 0
                stale = key == curses.KEY_RESIZE
        finally:
            poller.stop()

    try:
        return curses.wrapper(loop)
    except KeyboardInterrupt:
        return 0


def _size(text: str) -> int:
    """A byte count: ``33554432``, ``32M``, ``512K``, ``1G`` (binary multiples)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count such as 33554432 or 32M")
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradmon top", description="A terminal view of a gradmon endpoint.",
        epilog="The endpoint is treated as untrusted: each refresh must complete within --timeout and --max-bytes; "
               "a redirect is never followed (its Location is printed and top exits 1, so credentials never go to "
               "another host or from https to http); proxies from the environment (HTTP_PROXY, HTTPS_PROXY, "
               "ALL_PROXY) are ignored, so only a proxy named with --proxy ever sees the request and its "
               "credentials; anything the endpoint sends is shown with control, bidi and invisible characters "
               "escaped; a password is never printed.")
    p.add_argument("url", nargs="?", default=DEFAULT_URL,
                   help=f"the /metrics URL (default {DEFAULT_URL}); a bare port (9400) means 127.0.0.1, and the "
                        "live page's URL (http://host:9400/) means its /metrics")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--model", default=None, help="show this model only (several may share an endpoint)")
    p.add_argument("--user", default=None, help="basic-auth user (or user:password@ in the URL)")
    p.add_argument("--password-file", default=None,
                   help="file holding the basic-auth password (or GRADMON_TOP_PASSWORD)")
    p.add_argument("--cacert", default=None, help="CA certificate (PEM) to trust for an https URL")
    p.add_argument("--cert", default=None, help="client certificate (PEM) for mutual TLS")
    p.add_argument("--key", default=None, help="the client certificate's key (PEM)")
    p.add_argument("--insecure", action="store_true", help="do not verify the server's certificate")
    p.add_argument("--timeout", type=_positive, default=fetch.DEFAULT_TIMEOUT,
                   help=f"seconds one refresh may take, connect, headers and body together "
                        f"(default {fetch.DEFAULT_TIMEOUT:g})")
    p.add_argument("--max-bytes", type=_size, default=fetch.DEFAULT_MAX_BYTES,
                   help="largest response accepted, e.g. 64M (default 32M); a larger one is refused")
    p.add_argument("--proxy", default=None,
                   help="read through this HTTP proxy, http://[user:password@]host:port (a CONNECT tunnel for an "
                        "https URL); without it top connects directly, whatever the environment says")
    p.add_argument("--once", action="store_true", help="print one frame as text and exit (the default when "
                                                       "stdout is not a terminal)")
    return p


def main(argv: Optional[Sequence[str]] = None, out=None) -> int:
    out = sys.stdout if out is None else out
    p = _parser()
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be positive")
    try:
        url = metrics_url(args.url)
    except ValueError as exc:
        p.error(str(exc))
    if args.proxy is not None and urllib.parse.urlsplit(args.proxy).scheme != "http":
        p.error(f"--proxy takes an http:// proxy URL, not {clean(mask_credentials(args.proxy))!r}")
    password = os.environ.get("GRADMON_TOP_PASSWORD")
    if args.password_file:
        with open(args.password_file) as f:
            password = f.read().strip()
    endpoint = Endpoint(url, args.user, password, args.cacert, args.cert, args.key, args.insecure,
                        args.timeout, args.max_bytes, args.proxy)
    view = View(endpoint, args.model)
    try:
        if args.once or not (out is sys.stdout and sys.stdout.isatty()):
            return _plain(view, min(args.interval, 1.0), out)
        return _screen(view, args.interval)
    except fetch.Redirected as exc:
        location = endpoint.redact(exc.location)
        print(f"gradmon top: {endpoint.shown} answered HTTP {exc.status}, a redirect to {location}\n"
              "Not followed: the credentials would go along, maybe to another host or unencrypted. If that "
              f"address is the endpoint, run: gradmon top {location}", file=sys.stderr)
        return 1
