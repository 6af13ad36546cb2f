"""The monitor's parts on their own, without a Monitor around them: its share of an endpoint
(serving.py, on real endpoints over real sockets) and the carry-over of counters from one
monitor of a name to the next (carry.py)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from conftest import parse
from gradmon import metrics as M
from gradmon.aggregate import CarriedCounters, Snapshot
from gradmon.carry import CarryOver
from gradmon.config import Config
from gradmon.errors import ErrorLog
from gradmon.serve.collector import ExportView
from gradmon.serving import Serving


def view(overhead: float = 1.5) -> ExportView:
    return ExportView(labels={"model": "m", "rank": "0"}, snapshot=Snapshot(), errors={},
                      overhead_seconds=overhead, run_state=M.STATE_TRAINING,
                      info={"version": "0", "torch_version": "0", "world_size": "1"})


def serving(**options) -> Serving:
    return Serving(Config(addr="127.0.0.1", port=0, final_scrape_timeout=0, **options), 1, view)


def overhead_served(url: str) -> float:
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    return next(v for (name, labels), v in parse(body).items()
                if name == "gradmon_overhead_seconds_total" and ("model", "m") in labels)


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


# -- Serving ------------------------------------------------------------------------------------

def test_a_registered_view_is_served_until_the_monitor_leaves_and_the_port_closes():
    part = serving()
    assert part.join(0, ErrorLog("m"), "m") is None
    part.register(lambda stage, exc: None, lambda: 0)
    url = part.endpoint.url
    served = overhead_served(url)
    held = part.leave(forked=False, final_scrape=False)
    assert (served, held, part.endpoint) == (1.5, False, None) and refused(url)


def test_a_taken_port_is_said_counted_and_leaves_no_endpoint():
    errors = ErrorLog("m")
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        said = serving().join(port, errors, "m")
    assert said is not None and f"127.0.0.1:{port}" in said and errors.counts()["server"] == 1


def test_with_keep_serving_the_final_view_is_held_until_holding_stops():
    part = serving(keep_serving=True)
    part.join(0, ErrorLog("m"), "m")
    part.register(lambda stage, exc: None, lambda: 0)
    url = part.endpoint.url
    held = part.leave(forked=False, final_scrape=True)
    served_while_held = overhead_served(url)
    part.stop_holding(final_scrape=False)
    assert (held, served_while_held, part.endpoint) == (True, 1.5, None) and refused(url)


def test_a_forked_child_leaves_its_parents_endpoint_serving():
    from gradmon.serve import endpoint as endpoints
    part = serving()
    part.join(0, ErrorLog("m"), "m")
    ep = part.endpoint
    held = part.leave(forked=True, final_scrape=True)
    try:
        assert (held, part.endpoint) == (False, None) and not refused(ep.url)
    finally:
        endpoints.release(ep, 1)


def test_a_setting_that_differs_from_the_shared_endpoints_is_refused_before_joining():
    first, second = serving(), Serving(Config(addr="127.0.0.1", port=0, max_connections=5), 2, view)
    first.join(0, ErrorLog("m"), "m")
    try:
        with pytest.raises(ValueError, match="max_connections"):
            second.join(0, ErrorLog("m"), "m")
        assert second.endpoint is None
    finally:
        first.leave(forked=False, final_scrape=False)


# -- CarryOver ----------------------------------------------------------------------------------

class Resumed:
    """What an aggregator was asked to continue (``Aggregator.resume``)."""

    def __init__(self) -> None:
        self.counters = None

    def resume(self, counters) -> None:
        self.counters = counters


def test_a_later_monitor_continues_the_counters_errors_and_overhead_left_under_its_key():
    store, errors = CarriedCounters(), ErrorLog("m")
    errors.record("step", ValueError("x"), log_first=False)
    first = CarryOver(store)
    first.stopped(overhead=2.0)
    first.leave("key", {"steps": 7}, errors)
    later, aggregator, later_errors = CarryOver(store), Resumed(), ErrorLog("m")
    later.resume("key", aggregator, later_errors)
    assert aggregator.counters == {"steps": 7} and later_errors.counts()["step"] == 1
    assert later.overhead(live=0.5) == 2.5


def test_nothing_is_continued_under_another_key():
    store = CarriedCounters()
    CarryOver(store).leave("key", {"steps": 7}, ErrorLog("m"))
    later, aggregator = CarryOver(store), Resumed()
    later.resume("other", aggregator, ErrorLog("m"))
    assert aggregator.counters is None and later.overhead(live=0.0) == 0.0


def test_once_taken_what_was_carried_is_not_continued_twice():
    store = CarriedCounters()
    CarryOver(store).leave("key", {"steps": 7}, ErrorLog("m"))
    CarryOver(store).taken("key")
    assert store.get("key") is None


def test_the_overhead_after_detach_never_drops_below_what_was_carried():
    store = CarriedCounters()
    first = CarryOver(store)
    first.stopped(overhead=3.0)
    first.leave("key", {}, ErrorLog("m"))
    later = CarryOver(store)
    later.resume("key", Resumed(), ErrorLog("m"))
    before_detach = later.overhead(live=None)
    later.stopped(overhead=1.0)
    assert (before_detach, later.overhead(live=None)) == (3.0, 4.0)
