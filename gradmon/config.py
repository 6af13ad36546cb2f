"""gradmon's one configuration dataclass, and the one place that reads environment variables.

Precedence: ``GRADMON_*`` environment variables > keyword arguments to ``attach()`` >
defaults. The environment wins because it is the operator's lever: a job can be
reconfigured (or switched off with ``GRADMON_DISABLE=1``) without a code change.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

LayerType = Union[str, type]

_LABEL_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_RESERVED_LABELS = {"model", "rank", "layer", "tensor", "kind", "stage", "state", "family",
                    "device", "version", "torch_version", "world_size", "le", "job", "instance"}


@dataclass(frozen=True)
class Config:
    """Everything ``attach()`` can be told. Each field has a ``GRADMON_<FIELD>`` override."""

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

    every: int = 1
    """Publish per-layer gradient norms every N optimizer steps. The non-finite check,
    the global-norm histogram and the step counters still run on every step, so a NaN
    on an unsampled step is never lost."""

    detail_every: int = 10
    """Measure activation and gradient-flow statistics every N optimizer steps; the
    hooks are inert in between. They read every activation twice or more, which costs
    more than the 3% budget on every step (see README's benchmark), so the default
    samples them; 1 measures them on every step."""

    include: Tuple[str, ...] = ()
    """Glob patterns (fnmatch) over layer names to monitor; empty means all layers."""

    exclude: Tuple[str, ...] = ()
    """Glob patterns over layer names to leave out; applied after ``include``."""

    layer_types: Tuple[LayerType, ...] = ()
    """Module classes (or their class names) to monitor; empty means every layer type."""

    activations: bool = True
    """Activation RMS / max|x| / non-finite counts from forward hooks."""

    grad_flow: bool = True
    """Norm and non-finite counts of the gradient with respect to each layer's output."""

    local_view: Optional[bool] = None
    """Also measure each rank's own gradient before DDP's all-reduce (the
    ``gradmon_local_*`` families): the only view in which one bad rank or data shard
    stands out, since after the all-reduce every rank holds the same gradient. None
    turns it on when the attached model is wrapped in DistributedDataParallel."""

    labels: Mapping[str, str] = field(default_factory=dict)
    """Constant labels added to every series, e.g. ``{"run_id": "exp-42"}``."""

    name: Optional[str] = None
    """Value of the ``model`` label; defaults to the model's class name in lower case
    (made unique within the process when several models are monitored)."""

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
    itself. It runs on gradmon's publisher thread, as soon as the step's statistics
    reach the host; exceptions it raises are caught and counted."""

    scaler: Any = None
    """The job's ``torch.amp.GradScaler``: norms are reported unscaled and steps the
    scaler skips on overflow are counted as such, not as non-finite incidents. Without
    it, norms under fp16 loss scaling are scaled norms, and a skipped step's statistics
    are merged into the next step (see README, Mixed precision)."""

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

    def __post_init__(self) -> None:
        _validate(self)


def _fail(option: str, message: str) -> None:
    raise ValueError(f"gradmon: option {option!r} {message}")


def _validate(cfg: Config) -> None:
    if not isinstance(cfg.port, int) or isinstance(cfg.port, bool) or not 0 <= cfg.port <= 65535:
        _fail("port", f"must be an integer in 0..65535 (0 picks a free port), got {cfg.port!r}")
    if not isinstance(cfg.addr, str):  # ip_address() would take an int such as 2130706433
        _fail("addr", f"must be a string IP address such as '0.0.0.0' or '127.0.0.1', got {cfg.addr!r}")
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
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, str) or not value):
            # an empty user or password would otherwise turn authentication off
            _fail(name, "must be a non-empty string (leave both basic_auth options unset to serve without auth)")
    if cfg.basic_auth_user is not None and ":" in cfg.basic_auth_user:
        _fail("basic_auth_user", "must not contain ':' (HTTP basic auth separates user and password with it)")
    if cfg.tls_key_password is not None and not cfg.tls_certfile:
        _fail("tls_certfile", "is required when tls_key_password is set")
    if not isinstance(cfg.connection_timeout, (int, float)) or isinstance(cfg.connection_timeout, bool) \
            or not 0.5 <= cfg.connection_timeout <= 300:
        _fail("connection_timeout", f"must be a number of seconds in 0.5..300, got {cfg.connection_timeout!r}")
    if not isinstance(cfg.max_connections, int) or isinstance(cfg.max_connections, bool) \
            or not 4 <= cfg.max_connections <= 1024:
        _fail("max_connections", f"must be an integer in 4..1024, got {cfg.max_connections!r}")
    for name in ("every", "detail_every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(name, f"must be a positive integer number of optimizer steps, got {value!r}")
    for name in ("include", "exclude"):
        value = getattr(cfg, name)
        if not all(isinstance(p, str) and p for p in value):
            _fail(name, f"must be a sequence of non-empty glob patterns, got {value!r}")
    for t in cfg.layer_types:
        if not (isinstance(t, str) and t) and not (isinstance(t, type)):
            _fail("layer_types", f"entries must be module classes or class names, got {t!r}")
    for k, v in cfg.labels.items():
        if not isinstance(k, str) or not k or k[0].isdigit() or not set(k) <= _LABEL_NAME_OK or k.startswith("__"):
            _fail("labels", f"key {k!r} is not a valid Prometheus label name")
        if k in _RESERVED_LABELS:
            _fail("labels", f"key {k!r} is used by gradmon itself; choose another name")
        if not isinstance(v, str):
            _fail("labels", f"value of {k!r} must be a string, got {type(v).__name__}")
    if not isinstance(cfg.final_scrape_timeout, (int, float)) or isinstance(cfg.final_scrape_timeout, bool) \
            or not 0 <= cfg.final_scrape_timeout <= 3600:
        _fail("final_scrape_timeout", f"must be a number of seconds in 0..3600, got {cfg.final_scrape_timeout!r}")
    if not isinstance(cfg.handle_sigterm, bool):
        _fail("handle_sigterm", f"must be True or False, got {cfg.handle_sigterm!r}")
    if not isinstance(cfg.series_budget, int) or isinstance(cfg.series_budget, bool) or cfg.series_budget < 20:
        _fail("series_budget", f"must be an integer of at least 20 series, got {cfg.series_budget!r}")
    if cfg.on_nonfinite is not None and not callable(cfg.on_nonfinite):
        _fail("on_nonfinite", f"must be callable (it receives a NonFiniteIncident), got {cfg.on_nonfinite!r}")
    if cfg.scaler is not None:
        from .amp import is_scaler
        if not is_scaler(cfg.scaler):
            _fail("scaler", f"must be a torch.amp.GradScaler, got {type(cfg.scaler).__name__}")
    if cfg.name is not None and (not isinstance(cfg.name, str) or not cfg.name):
        _fail("name", f"must be a non-empty string, got {cfg.name!r}")
    if cfg.registry is not None and not hasattr(cfg.registry, "register"):
        _fail("registry", "must be a prometheus_client.CollectorRegistry (or None to serve /metrics)")


# --- environment overrides ---------------------------------------------------------

ENV_PREFIX = "GRADMON_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"gradmon: environment variable {name}={raw!r} must be one of 1/0/true/false")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"gradmon: environment variable {name}={raw!r} must be an integer") from None


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"gradmon: environment variable {name}={raw!r} must be a number") from None


def _parse_list(name: str, raw: str) -> Tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def _parse_labels(name: str, raw: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in _parse_list(name, raw):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"gradmon: environment variable {name} wants key=value pairs, got {item!r}")
        out[key.strip()] = value.strip()
    return out


_ENV_PARSERS: Dict[str, Callable[[str, str], Any]] = {
    "port": _parse_int,
    "addr": lambda n, r: r.strip(),
    "tls_certfile": lambda n, r: r.strip() or None,
    "tls_keyfile": lambda n, r: r.strip() or None,
    "tls_client_cafile": lambda n, r: r.strip() or None,
    # kept as given, even empty: an empty credential is the same error from code and env
    "basic_auth_user": lambda n, r: r.strip(),
    "basic_auth_password": lambda n, r: r,
    "tls_key_password": lambda n, r: r,
    "connection_timeout": _parse_float,
    "max_connections": _parse_int,
    "port_offset_by_local_rank": _parse_bool,
    "every": _parse_int,
    "detail_every": _parse_int,
    "include": _parse_list,
    "exclude": _parse_list,
    "layer_types": _parse_list,
    "activations": _parse_bool,
    "grad_flow": _parse_bool,
    "local_view": _parse_bool,
    "labels": _parse_labels,
    "name": lambda n, r: r.strip() or None,
    "disable": _parse_bool,
    "series_budget": _parse_int,
    "final_scrape_timeout": _parse_float,
    "handle_sigterm": _parse_bool,
    "log_every_incident": _parse_bool,
}


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def env_overrides(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The fields that ``GRADMON_*`` variables set, parsed and named by field."""
    environ = os.environ if environ is None else environ
    out: Dict[str, Any] = {}
    for fname, parse in _ENV_PARSERS.items():
        var = env_var(fname)
        if var in environ:
            out[fname] = parse(var, environ[var])
    return out


def resolve(options: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Config:
    """Build the Config for ``attach(**options)``: defaults < options < environment."""
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"gradmon.attach() got unknown option(s) {unknown}; valid options: {sorted(known)}")
    merged = dict(options)
    for key in ("include", "exclude", "layer_types"):
        if key in merged and isinstance(merged[key], (str, type)):
            merged[key] = (merged[key],)
        if key in merged:
            merged[key] = tuple(merged[key])
    if "labels" in merged and merged["labels"] is None:
        merged["labels"] = {}
    merged.update(env_overrides(environ))
    return Config(**merged)


def is_disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The kill switch alone, read without validating anything else."""
    environ = os.environ if environ is None else environ
    raw = environ.get(env_var("disable"))
    return raw is not None and raw.strip().lower() in _TRUE


def replace(cfg: Config, **changes: Any) -> Config:
    return dataclasses.replace(cfg, **changes)
