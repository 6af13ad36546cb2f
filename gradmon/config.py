"""gradmon's one configuration dataclass, and the one place that reads environment variables.

Precedence: ``GRADMON_*`` environment variables > keyword arguments to ``attach()`` >
defaults. The environment wins because it is the operator's lever: a job can be
reconfigured (or switched off with ``GRADMON_DISABLE=1``) without a code change.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import ipaddress
import math
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, FrozenSet, Iterator, Mapping, Optional, Tuple, Union

LayerType = Union[str, type]

ATTENTION_LAYERS: Tuple[str, ...] = (
    "*q_proj", "*k_proj", "*qkv*", "*c_attn", "*query_key_value", "*.query", "*.key", "*.wq", "*.wk",
    "*.q", "*.k", "*to_q", "*to_k", "*q_lin", "*k_lin")
"""The query and key projections' names in common models (Llama/Mistral ``q_proj``, GPT-2
``c_attn``, fused ``qkv``/``Wqkv``, GPT-NeoX ``query_key_value``, BERT ``query``/``key``,
torchtitan ``wq``/``wk``, T5 ``q``/``k``, diffusers ``to_q``, DistilBERT ``q_lin``)."""


@dataclass(frozen=True)
class Config:
    """Everything ``attach()`` can be told. Each field that is a value has a ``GRADMON_<FIELD>``
    override; ``registry``, ``on_nonfinite`` and ``scaler`` are objects only code can give."""

    port: int = 9400
    """TCP port of the /metrics endpoint; 0 picks a free one (see ``Monitor.port``).
    Under torchrun the local rank is added (``port_offset_by_local_rank``) so that the
    ranks of one node do not collide. 9400 is not claimed by any well-known exporter."""

    addr: str = "0.0.0.0"
    """Bind address. All interfaces by default because Prometheus usually scrapes from
    another host; use 127.0.0.1 to keep the endpoint local."""

    tls_certfile: Optional[str] = None
    """PEM certificate: serve /metrics over HTTPS (with ``tls_keyfile``)."""

    tls_keyfile: Optional[str] = None
    """PEM private key of ``tls_certfile`` (omit if the certificate file holds it)."""

    tls_client_cafile: Optional[str] = None
    """CA bundle: require scrapers to present a client certificate signed by it (mTLS)."""

    tls_key_password: Optional[str] = field(default=None, repr=False)
    """Pass phrase of an encrypted ``tls_keyfile``. gradmon never prompts for one: an
    encrypted key without it is a ValueError at attach. The three TLS files are re-read
    when they change on disk (certificate rotation) without dropping the endpoint."""

    basic_auth_user: Optional[str] = None
    """Require HTTP basic auth with this user (and ``basic_auth_password``)."""

    basic_auth_password: Optional[str] = field(default=None, repr=False)
    """Password for ``basic_auth_user``; best set through GRADMON_BASIC_AUTH_PASSWORD from
    a secret. Never logged (excluded from the Config's repr)."""

    connection_timeout: float = 10.0
    """Seconds a connection to the endpoint may live, whatever it sends: a client that
    drips one byte a second is cut off at this deadline, not kept forever. 10 s is far
    above a scrape of even a large exposition on a local network."""

    max_connections: int = 64
    """Most concurrent connections to the endpoint (further capped at a quarter of the
    process's open-file limit, so scrapers can never exhaust the training job's file
    descriptors). At the cap a new connection evicts the oldest one that has not sent
    its request yet, so a scraper always gets through."""

    port_offset_by_local_rank: bool = True
    """Serve on ``port + LOCAL_RANK`` so several ranks on one node each get a port."""

    ui: bool = True
    """Serve the live page at ``/`` (and its data at ``/api/``) beside the metrics, with
    the same TLS and basic auth. It shows layer names, the loss and the learning rate to
    anyone who can reach the endpoint: turn it off where that matters."""

    ui_history: int = 2000
    """Optimizer steps the live page can show, kept in the process as float32 (at most
    16 MB: a model with many layers keeps fewer), only on ranks that export per-layer series."""

    incident_dir: str = "./gradmon-incidents"
    """Directory (created when first needed) where each rank writes an incident bundle at
    the first non-finite step of a run of them: the last ``ui_history`` steps, the origin,
    the batch's ids, RNG states and versions (docs/incidents.md). ``""`` turns it off.
    Written by the publisher thread, never the training thread; a disk that refuses it
    is logged once and counted, never raised."""

    incident_max_bytes: int = 8 * 2 ** 20
    """Bytes the incident bundles of one rank may take in all, per run: a bundle keeps
    fewer history steps to fit, and at most a few incidents are written per run."""

    ui_hosts: Tuple[str, ...] = ()
    """Host names the live page answers to besides IP addresses, ``localhost`` and this
    machine's own names (a DNS-rebinding guard): e.g. the name of a proxy or a service."""

    every: int = 1
    """Publish per-layer gradient norms every N optimizer steps. The non-finite check,
    the global-norm histogram and the step counters still run on every step, so a NaN
    on an unsampled step is never lost."""

    detail_every: int = 20
    """Measure activation and gradient-flow statistics every N optimizer steps; the
    hooks are inert in between. They read every activation twice or more, which costs
    more than the 3% budget on every step (see docs/benchmark.md), so the default
    samples them, at the cadence that keeps the defaults inside it; 1 measures them on
    every step."""

    optimizer_every: int = 20
    """Read the statistics taken after the optimizer's step (the configuration reference
    lists their families under this option: the update-to-weight ratio and Adam's
    second-moment RMS rebuilt from the optimizer's state, and the like) every N optimizer
    steps (the first step included); the learning rate of each parameter group is read on every step
    whatever this says. 0 turns them off. Reading them is one more pass over the weights
    and the optimizer's moments, so the default samples it like ``detail_every``: these
    values move slowly."""

    optimizer_sample: int = 16384
    """Most elements of each parameter (and of its gradient and optimizer state) that the
    update-to-weight ratio and Adam's RMS read: a larger parameter is read through 16K-ish
    elements in evenly spaced short runs (``capture.kernels.RUN``), and its sums scaled up to
    its size. Reading every element of the weights, gradients and both Adam moments costs
    about what the optimizer's own step costs; a sample costs a small part of it and moves a
    ratio little (the tests bound it on the reference model; figures in docs/benchmark.md).
    0 reads every element."""

    include: Tuple[str, ...] = ()
    """Glob patterns (fnmatch) over layer names to monitor; empty means all layers."""

    exclude: Tuple[str, ...] = ()
    """Glob patterns over layer names to leave out; applied after ``include``."""

    layer_types: Tuple[LayerType, ...] = ()
    """Module classes (or their class names) to monitor; empty means every layer type."""

    attention_layers: Tuple[str, ...] = ATTENTION_LAYERS
    """Glob patterns over layer names that find the attention's query and key projections
    (a fused qkv one included): each such layer's output max |x| is exported as its growth
    since attach (gradmon_activation_growth{role="attention"}), and
    GradmonAttentionGrowth warns when it grows far (the attention-logit growth that
    precedes many transformer divergences). Empty: no layer. One series per layer named,
    outside ``series_budget`` (which counts what every layer costs): name the projections,
    not every layer. Read on the publisher thread from the detail steps' records: no
    training-time cost."""

    activations: bool = True
    """Activation RMS / max|x| / non-finite counts from forward hooks."""

    activation_kurtosis: bool = True
    """Kurtosis of each layer's output on detail steps (with ``activations``): outlier
    features show as a kurtosis far above a Gaussian's 3 long before max |x| overflows.
    Estimated from a systematic sample of about 16K elements of each output (one copy
    per output, or per stack of small outputs; the moments of a forward's samples are
    computed at once when it returns; see docs/how-it-works.md)."""

    activation_baseline: int = 32
    """Detail measurements of a layer's max |x| whose median is the baseline of
    gradmon_activation_abs_max_ratio: long enough to ignore one odd batch, short enough
    to follow a run's normal drift. Kept on the publisher thread; no training-time cost."""

    norm_baseline: int = 128
    """Sampled measurements (every ``every`` steps) of a layer's gradient norm whose median
    is the baseline of gradmon_grad_norm_baseline_ratio: counted in steps, not minutes, so
    the same rule means the same thing for a job at 1 step/s and at 1 step/min. 128 spans
    the 34-90 steps in which a layer's norm rises before a loss spike, and more. Restarts
    with the spike windows; kept on the publisher thread, no training-time cost."""

    baseline_warmup: int = 100
    """Steps after attach whose values enter no baseline median (activation_baseline,
    norm_baseline, update_baseline): a layer's norm during the first learning phase (an
    lr warm-up, the first loss drop) is no measure of its normal, and a median of it put
    a healthy run's norm at 4x its "baseline" just after the rules' own warm-up
    (Thresholds.warmup_steps, the same 100 steps, which the rules' baselines leave out too).
    0: every step enters. Kept on the publisher thread, no training-time cost."""

    norm_jump_ratio: float = 3.0
    """A sampled step where any layer's gradient norm is far outside its own recent spread
    (above ``spike_threshold`` robust deviations of its log over ``spike_window`` steps, an
    adaptive baseline) *and* at least this many times that baseline counts one spike step
    of signal ``layer_grad_norm``, in the process, so a one-step jump between two scrapes is
    counted. The spread decides what is unusual for each layer; the ratio keeps a very
    quiet layer's small wobble from counting."""

    loss_floor: float = 0.1
    """How far above its best (in the loss's own units) the loss trend must be for a
    divergence to be confirmed, besides twice its best: a converged loss of 0.002 against a
    best of 0.001 is noise, not a divergence. 0.1 suits a cross-entropy in nats; scale it
    with a loss that is scaled."""

    update_baseline: int = 32
    """Measurements (every ``optimizer_every`` steps) of a layer's update-to-weight ratio
    whose median is the baseline of gradmon_update_ratio_baseline_ratio: 32 of them are
    640 steps at the default optimizer_every. Restarts when a learning rate jumps (the
    ratio moves with it); kept on the publisher thread, no training-time cost."""

    grad_flow: bool = True
    """Norm and non-finite counts of the gradient with respect to each layer's output."""

    fp16_headroom: Optional[bool] = None
    """gradmon_fp16_range_used and gradmon_grad_fp16_underflow_fraction for layers whose
    output (or the gradient with respect to it) is float16, on detail steps. None turns
    them on when the model has float16 parameters or a ``scaler`` is given (fp16
    autocast), so that the series budget counts them only where they can exist; True
    turns them on for fp16 autocast without ``scaler``."""

    origin_per_layer: bool = False
    """Record each layer's output extremes on every step, not only the top-level blocks'
    (always on) and detail steps': a NaN's origin is then the exact layer on the very
    step it happens. Costs one small reduction per layer per step (see docs/benchmark.md)."""

    local_view: Optional[bool] = None
    """Also measure each rank's own gradient before DDP's all-reduce (the
    ``gradmon_local_*`` families): the only view in which one bad rank or data shard
    stands out, since after the all-reduce every rank holds the same gradient. None
    turns it on when the attached model is wrapped in DistributedDataParallel."""

    all_ranks_per_layer: bool = False
    """Export per-layer series on every rank of a data-parallel job (DDP, FSDP), not only
    on data-parallel rank 0. Off, the other ranks export a few dozen series each (their own
    global norm, non-finite counts per tensor, the worst layer's activation max |x| and
    local-norm ratio, the incident's origin layer), so a 1,000-rank job costs a
    Prometheus what a few dozen ranks did; on, each rank adds its own per-layer series."""

    labels: Mapping[str, str] = field(default_factory=dict)
    """Constant labels added to every series, e.g. ``{"run_id": "exp-42"}``."""

    name: Optional[str] = None
    """Value of the ``model`` label; defaults to the model's class name in lower case
    (made unique within the process, ``NAME-2``, when several models are monitored, or
    when the counters of an earlier monitor of that name and labels were dropped: at most
    64 detached monitors' counters are carried, and a dropped one's series end)."""

    registry: Any = None
    """An existing ``prometheus_client.CollectorRegistry`` to register into instead of
    starting gradmon's own HTTP server (for apps that already serve /metrics)."""

    disable: bool = False
    """Kill switch: ``attach()`` registers nothing, starts no thread, returns an inert handle."""

    series_budget: int = 2000
    """Most per-layer series one process exports. Past it, layers are grouped by
    module-name prefix (fixed at attach; see gradmon_grouped_layers), so that a
    1,000-layer model on 1,024 ranks cannot flood Prometheus."""

    on_nonfinite: Optional[Callable[["object"], None]] = None
    """Called with a :class:`gradmon.NonFiniteIncident` when a run of non-finite steps
    starts (rank, step, the layer where it started), so a job can checkpoint or stop
    itself. It runs on gradmon's publisher thread, once the step's statistics reach the
    host (within 20 ms after that for a job stepping faster than that: the publisher wakes
    at most every 20 ms and folds the steps that came meanwhile together); exceptions it
    raises are caught and counted."""

    scaler: Any = None
    """The job's ``torch.amp.GradScaler``: norms are reported unscaled and steps the
    scaler skips on overflow are counted as such, not as non-finite incidents. Without
    it, norms under fp16 loss scaling are scaled norms, and a skipped step's statistics
    are merged into the next step (see docs/integrations.md, supported training setups)."""

    final_scrape_timeout: float = 30.0
    """Most seconds the end of a run (``detach()``, the end of a ``with`` block, interpreter
    exit) waits for Prometheus to scrape the final run state once, so that a job that
    ended normally does not page as down and a failed one does. It waits only while the
    endpoint is scraped periodically (two scrapes or more from one address), and only
    until every such scraper has scraped once after the change; 0 never waits. 30 s
    covers the usual 15-30 s scrape intervals."""

    handle_sigterm: bool = False
    """On SIGTERM (preemption, ``scancel``, a pod deleted), publish the non-paging run
    state "terminated", wait up to 10 s (and at most ``final_scrape_timeout``) for one
    scrape, then die of the signal as before. Only when SIGTERM still has its default
    action at ``attach()``: gradmon never replaces a job's own signal handling. Off by
    default, because installing a signal handler is the job's decision."""

    log_every_incident: bool = False
    """Log every non-finite step, not only the first of each run of non-finite steps."""

    announce: Optional[bool] = None
    """Print where the endpoint and the live page are, one line on stderr at ``attach()``
    (and where the page stays with ``keep_serving`` at the end). A print, not a log
    record: the Hugging Face Trainer's default level (WARNING) would hide an INFO one.
    None prints on the job's main process only (global rank 0; the Trainer callbacks use
    the Trainer's own main process), the other ranks log it at DEBUG; True prints on this
    process, False on none."""

    keep_serving: bool = False
    """Keep the endpoint (``/metrics`` and the live page) up after the run ends, serving the
    run's final state (``finished``, or ``failed``) until the process exits, so that a
    notebook or a script that waits can still be looked at. Off by default: the port is
    freed when the run ends. Attaching again under the same model name takes the endpoint over."""

    spike_threshold: float = 6.0
    """Robust score above which a step of the loss or of a global gradient norm is a
    spike (``gradmon_spike_steps_total``), if its value is also above twice the window's
    median. 6 robust standard deviations is OLMo-core's choice: a healthy run, noisy as
    it is, does not reach it, a one-step 3x jump does."""

    spike_window: int = 128
    """Steps of each signal the spike score is measured against (median, MAD and trend).
    128 spans the noise of a few hundred steps while following a schedule's trend."""

    spike_min_steps: int = 32
    """Steps the window must hold before a step is scored; after attach, a resume and a
    learning-rate jump. Fewer make the median and MAD too noisy to trust."""

    guard: str = "off"
    """Skip bad optimizer steps (off by default: a monitor changes nothing unless asked).
    ``"nonfinite"`` skips a step whose gradients hold a NaN or an Inf, ``"nonfinite,spike"``
    also a loss or gradient-norm spike (``guard_spike_z``): parameters and
    optimizer state stay as they were, on every rank alike (one scalar all-reduce of the
    verdict), counted in ``gradmon_guard_skipped_steps_total{reason}``. A fused optimizer
    skips on the device (no host read); any other costs one host read per step, as a
    GradScaler does. The learning-rate scheduler still advances. See docs/guard.md."""

    guard_spike_z: float = 6.0
    """With ``guard="nonfinite,spike"``: the robust score (the pages' spike score, computed on
    the device before the step) above which a loss or global-gradient-norm step is skipped,
    if its value is also above twice its window's median. The window is ``spike_window``
    steps and must be full first. 6 is ``spike_threshold``'s default: a healthy run does not
    reach it (docs/guard.md)."""

    guard_max_skips: int = 10
    """Consecutive bad steps the guard skips; the next one is applied and the run becomes
    failed (``guard_on_persist``): a run of bad steps that long is no longer a bad batch,
    and hiding it would hide a bug."""

    guard_on_persist: str = "fail"
    """What happens past ``guard_max_skips``: ``"fail"`` marks the run failed and training
    goes on; ``"raise"`` raises ``gradmon.GuardPersisted`` from ``optimizer.step()``
    (an optimizer that needs no host read learns it a step or two later)."""

    def __post_init__(self) -> None:
        _validate(self)


# --- checking values ---------------------------------------------------------------
# Types are checked from the field annotations above, so a new option is type-checked by
# declaring it; only the checks a type cannot express (ranges, files, pairs) are written out.

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

#: How a wrong value is corrected, where the type alone does not say it.
_EXAMPLES: Dict[str, str] = {
    "labels": "{'run_id': 'exp-42'}",
    "include": "['blocks.*']",
    "exclude": "['*.norm']",
    "layer_types": "[nn.Linear, 'LayerNorm']",
}


class _OptionError:
    """Marks an error with the option it is about, so that ``resolve`` can name the
    environment variable that set the option (the same check serves code and env)."""

    @staticmethod
    def raise_(kind: type, option: str, detail: str) -> None:
        exc = kind(f"gradmon: option {option!r} {detail}")
        exc.gradmon_option = option  # type: ignore[attr-defined]
        exc.gradmon_detail = detail  # type: ignore[attr-defined]
        raise exc


def _fail(option: str, message: str) -> None:
    _OptionError.raise_(ValueError, option, message)


def _reserved_labels() -> FrozenSet[str]:
    from . import metrics as M
    # le is the histogram's; Prometheus itself sets job and instance at scrape time
    return frozenset(M.BASE_LABELS) | {label for spec in M.ALL_SPECS for label in spec.labels} | {
        "le", "job", "instance"}


def _conforms(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:  # True is an int to Python, never a step count or a port
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is Union:
        return any(_conforms(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_conforms(v, args[0]) for v in value)
    if origin in (Mapping, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if origin in (Callable, collections.abc.Callable):
        return callable(value)
    return isinstance(value, hint)


def _expected(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return "True or False"
    if origin is Union:
        return " or ".join(_expected(arg) for arg in args)
    if origin is tuple:
        return f"a list of items that are each {_expected(args[0])}"
    if origin in (Mapping, collections.abc.Mapping):
        return f"a dict of {args[0].__name__} keys to {args[1].__name__} values"
    if origin in (Callable, collections.abc.Callable):
        return "a callable"
    return {int: "an integer", float: "a number", str: "a string", type: "a class",
            type(None): "None"}.get(hint, getattr(hint, "__name__", str(hint)))


def _check_types(cfg: Config) -> None:
    for name, hint in _HINTS.items():
        value = getattr(cfg, name)
        if not _conforms(value, hint):
            example = f", e.g. {_EXAMPLES[name]}" if name in _EXAMPLES else ""
            shown = "<hidden>" if not _FIELDS[name].repr else repr(value)
            _OptionError.raise_(TypeError, name, f"must be {_expected(hint)}{example}; "
                                                 f"got {shown} ({type(value).__name__})")


# Paths may hold bytes that are not UTF-8 (a Linux file name is bytes); every other text
# option ends up in an exposition, a header or a pass phrase, which are UTF-8.
_PATH_OPTIONS = ("tls_certfile", "tls_keyfile", "tls_client_cafile", "incident_dir")


def utf8_text(text: str) -> str:
    """``text`` in a form that encodes as UTF-8: lone surrogates (what Python makes of an
    environment variable's or a module name's bytes that were not UTF-8) become
    ``\\udcXX`` escapes, so one odd name cannot make an exposition unencodable."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, collections.abc.Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)


def _check_text(cfg: Config) -> None:
    """Every text option must encode as UTF-8: refused here, naming the option, rather than
    a UnicodeEncodeError at the first scrape or the server's start."""
    for name in _HINTS:
        if name in _PATH_OPTIONS:
            continue
        for text in _strings(getattr(cfg, name)):
            if text.isascii():
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = f", got {text!r} ({exc.object[exc.start]!r} at {exc.start})" if _FIELDS[name].repr else ""
                _fail(name, f"must be valid UTF-8 text{where}: bytes that are not UTF-8 in an environment "
                            "variable reach Python as lone surrogates such as '\\udce9'")


def _in_range(cfg: Config, name: str, low: float, high: float, what: str) -> None:
    value = getattr(cfg, name)
    if not low <= value <= high:
        _fail(name, f"must be {what}, got {value!r}")


def _validate(cfg: Config) -> None:
    _check_types(cfg)  # everything below may rely on the declared types
    _check_text(cfg)
    _check_endpoint(cfg)
    _check_cadence(cfg)
    _check_selection(cfg)
    _check_detection(cfg)
    _check_objects(cfg)
    _check_guard(cfg)


def _check_guard(cfg: Config) -> None:
    """The step guard's modes and its limit."""
    from .capture.stepguard import ON_PERSIST, modes
    try:
        modes(cfg.guard)
    except ValueError as exc:
        _fail("guard", str(exc))
    _in_range(cfg, "guard_max_skips", 1, 1_000_000, "a positive number of consecutive steps")
    _in_range(cfg, "guard_spike_z", 1e-9, math.inf, "a positive number of robust standard deviations")
    if cfg.guard_on_persist not in ON_PERSIST:
        _fail("guard_on_persist", f"must be one of {', '.join(ON_PERSIST)}, got {cfg.guard_on_persist!r}")


def _check_endpoint(cfg: Config) -> None:
    """Where and how /metrics is served: address, TLS, basic auth, connection limits."""
    _in_range(cfg, "port", 0, 65535, "in 0..65535 (0 picks a free port)")
    try:
        ipaddress.ip_address(cfg.addr)
    except ValueError:
        if cfg.addr != "localhost":
            _fail("addr", f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {cfg.addr!r}")
    for name in ("tls_certfile", "tls_keyfile", "tls_client_cafile"):
        path = getattr(cfg, name)
        if path is not None and not os.path.isfile(path):
            _fail(name, f"must name a readable PEM file, {path!r} does not exist")
    if (cfg.tls_keyfile or cfg.tls_client_cafile) and not cfg.tls_certfile:
        _fail("tls_certfile", "is required when tls_keyfile or tls_client_cafile is set")
    if (cfg.basic_auth_user is None) != (cfg.basic_auth_password is None):
        _fail("basic_auth_user", "and basic_auth_password must be set together")
    for name in ("basic_auth_user", "basic_auth_password", "tls_key_password"):
        if getattr(cfg, name) == "":
            # an empty user or password would otherwise turn authentication off
            _fail(name, "must be a non-empty string (leave both basic_auth options unset to serve without auth)")
    if cfg.basic_auth_user is not None and ":" in cfg.basic_auth_user:
        _fail("basic_auth_user", "must not contain ':' (HTTP basic auth separates user and password with it)")
    if cfg.tls_key_password is not None and not cfg.tls_certfile:
        _fail("tls_certfile", "is required when tls_key_password is set")
    _in_range(cfg, "connection_timeout", 0.5, 300, "a number of seconds in 0.5..300")
    _in_range(cfg, "max_connections", 4, 1024, "an integer in 4..1024")


def _check_cadence(cfg: Config) -> None:
    """How often each family is measured, and what the incident bundles and the page keep."""
    for name in ("every", "detail_every"):
        _in_range(cfg, name, 1, math.inf, "a positive integer number of optimizer steps")
    _in_range(cfg, "optimizer_every", 0, math.inf, "a number of optimizer steps, 0 to turn the optimizer statistics off")
    _in_range(cfg, "ui_history", 10, 100_000, "a number of optimizer steps in 10..100000")
    _in_range(cfg, "incident_max_bytes", 2 ** 16, 2 ** 40, "a number of bytes in 65536..2**40")
    if "\0" in cfg.incident_dir:
        _fail("incident_dir", "must be a directory path (it contains a NUL character)")
    if cfg.optimizer_sample != 0:
        _in_range(cfg, "optimizer_sample", 256, 2 ** 20, "0 (every element) or a number of elements in 256..1048576")


def _check_selection(cfg: Config) -> None:
    """Which layers are monitored and the labels every series carries."""
    for name in ("include", "exclude", "attention_layers"):
        if not all(getattr(cfg, name)):
            _fail(name, f"must not contain an empty pattern, got {getattr(cfg, name)!r}")
    if not all(cfg.layer_types):
        _fail("layer_types", f"must not contain an empty class name, got {cfg.layer_types!r}")
    reserved = _reserved_labels()
    for k in cfg.labels:
        if not _LABEL_NAME.match(k) or k.startswith("__"):
            _fail("labels", f"key {k!r} is not a valid Prometheus label name "
                            "([a-zA-Z_][a-zA-Z0-9_]*, not starting with '__')")
        if k in reserved:
            _fail("labels", f"key {k!r} is used by gradmon or Prometheus itself "
                            f"({', '.join(sorted(reserved))}); choose another name")


def _check_detection(cfg: Config) -> None:
    """The series budget, the spike detectors, the divergence and the baselines."""
    _in_range(cfg, "final_scrape_timeout", 0, 3600, "a number of seconds in 0..3600")
    _in_range(cfg, "series_budget", 20, math.inf, "an integer of at least 20 series")
    _in_range(cfg, "spike_threshold", 1e-9, math.inf, "a positive number of robust standard deviations")
    _in_range(cfg, "norm_jump_ratio", 1.0 + 1e-9, math.inf, "a ratio above 1")
    _in_range(cfg, "loss_floor", 0.0, math.inf, "a non-negative amount in the loss's units")
    _in_range(cfg, "spike_window", 4, math.inf, "an integer number of steps of at least 4")
    _in_range(cfg, "spike_min_steps", 4, cfg.spike_window, f"in 4..spike_window ({cfg.spike_window})")
    from .statistics import MIN_BASELINE  # the ratio is absent until that many values exist anyway
    _in_range(cfg, "baseline_warmup", 0, 1_000_000, "an integer number of steps in 0..1000000")
    for baseline in ("activation_baseline", "norm_baseline", "update_baseline"):
        _in_range(cfg, baseline, MIN_BASELINE, 10_000, f"an integer in {MIN_BASELINE}..10000")


def _check_objects(cfg: Config) -> None:
    """Options that are objects (a scaler, a registry) or names."""
    if cfg.scaler is not None:
        from .amp import is_scaler
        if not is_scaler(cfg.scaler):
            _fail("scaler", f"must be a torch.amp.GradScaler, got {type(cfg.scaler).__name__}")
    if cfg.name is not None and not cfg.name:
        _fail("name", "must be a non-empty string or None (the model's class name)")
    if cfg.registry is not None and not hasattr(cfg.registry, "register"):
        _fail("registry", "must be a prometheus_client.CollectorRegistry (or None to serve /metrics)")


_FIELDS = {f.name: f for f in fields(Config)}
_HINTS: Dict[str, Any] = typing.get_type_hints(Config)


# --- environment overrides ---------------------------------------------------------

ENV_PREFIX = "GRADMON_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _parse_int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("must be an integer") from None


def _parse_float(raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError("must be a number") from None


def _parse_list(raw: str) -> Tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def _parse_labels(raw: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in _parse_list(raw):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"must be comma-separated key=value pairs, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _parser_for(hint: Any) -> Optional[Callable[[str], Any]]:
    """How an environment variable's text becomes a value of this field type; None for
    fields that only code can set (callables, objects)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union and type(None) in args:  # Optional[X]: empty text means None
        inner = _parser_for(next(a for a in args if a is not type(None)))
        if inner is None:
            return None
        return inner if inner is _parse_bool else (lambda raw: inner(raw) if raw.strip() else None)
    if origin is tuple:
        return _parse_list
    if origin in (Mapping, collections.abc.Mapping):
        return _parse_labels
    return {bool: _parse_bool, int: _parse_int, float: _parse_float, str: lambda raw: raw.strip()}.get(hint)


# Credentials are kept exactly as given, even empty: an empty one is the same error from
# code and environment, never a silent "no authentication".
_VERBATIM = ("basic_auth_user", "basic_auth_password", "tls_key_password")
_ENV_PARSERS: Dict[str, Callable[[str], Any]] = {
    name: (lambda raw: raw) if name in _VERBATIM else parser
    for name, parser in ((n, _parser_for(h)) for n, h in _HINTS.items()) if parser is not None}


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _shown(name: str, raw: str) -> str:
    """``GRADMON_X=value`` as an error message shows it; secrets are never echoed."""
    return f"{env_var(name)}={utf8_text(raw) if _FIELDS[name].repr else '<hidden>'}"


def env_overrides(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The fields that ``GRADMON_*`` variables set, parsed and named by field."""
    environ = os.environ if environ is None else environ
    out: Dict[str, Any] = {}
    for fname, parse in _ENV_PARSERS.items():
        var = env_var(fname)
        if var in environ:
            try:
                out[fname] = parse(environ[var])
            except ValueError as exc:
                raise ValueError(f"gradmon: {_shown(fname, environ[var])}: {exc}") from None
    return out


def resolve(options: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Config:
    """Build the Config for ``attach(**options)``: defaults < options < environment."""
    environ = os.environ if environ is None else environ
    known = set(_FIELDS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"gradmon.attach() got unknown option(s) {unknown}; valid options: {sorted(known)}")
    merged = dict(options)
    for key in ("include", "exclude", "layer_types", "attention_layers"):
        if key in merged and isinstance(merged[key], (str, type)):
            merged[key] = (merged[key],)
        if isinstance(merged.get(key), (list, set, frozenset)):
            merged[key] = tuple(merged[key])
    if "labels" in merged and merged["labels"] is None:
        merged["labels"] = {}
    from_env = env_overrides(environ)
    merged.update(from_env)
    try:
        return Config(**merged)
    except (TypeError, ValueError) as exc:
        option = getattr(exc, "gradmon_option", None)
        if option not in from_env:
            raise
        # the operator set this one: name the variable to change, not a keyword nobody passed
        raise type(exc)(f"gradmon: {_shown(option, environ[env_var(option)])}: option {option!r} "
                        f"{exc.gradmon_detail}") from None  # type: ignore[attr-defined]


def is_disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The kill switch alone, read without validating anything else."""
    environ = os.environ if environ is None else environ
    raw = environ.get(env_var("disable"))
    return raw is not None and raw.strip().lower() in _TRUE


def replace(cfg: Config, **changes: Any) -> Config:
    return dataclasses.replace(cfg, **changes)
