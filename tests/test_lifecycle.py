"""attach()/detach(): validation, kill switch, sharing, leaks, failure to bind (issue 2)."""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref

from typing import Optional

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

import gradmon
from conftest import parse, scrape, value


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def hook_state(model: nn.Module):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(getattr(m, "_backward_pre_hooks", {}))) for m in model.modules()] + [
        len(p._backward_hooks or {}) if hasattr(p, "_backward_hooks") else 0 for p in model.parameters()]


def optimizer_hook_count() -> int:
    from torch.optim import optimizer
    return len(optimizer._global_optimizer_pre_hooks) + len(optimizer._global_optimizer_post_hooks)


# -- bad input at attach() time ------------------------------------------------------------

def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        gradmon.attach(lambda x: x)


def test_no_trainable_parameters_is_a_value_error():
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gradmon.attach(model)


@pytest.mark.parametrize("compiled", [False, True])
def test_data_parallel_over_several_devices_is_a_value_error_naming_ddp(compiled):
    """Its replicas, made on every forward, would run the original blocks' checked forwards;
    torch.compile's wrapper around it hides none of that."""
    parallel = nn.DataParallel(mlp())  # on a machine without CUDA it keeps no device ids
    parallel.device_ids = [0, 1]  # as it holds them on a machine with two GPUs
    model = torch.compile(parallel) if compiled else parallel
    with pytest.raises(ValueError, match="DataParallel over 2 devices.*DistributedDataParallel"):
        gradmon.attach(model)


@pytest.mark.parametrize("options, option", [
    ({"every": -1}, "every"), ({"every": 0}, "every"), ({"detail_every": 0}, "detail_every"),
    ({"port": 70000}, "port"), ({"port": -1}, "port"), ({"addr": "not an address"}, "addr"),
    ({"labels": {"model": "x"}}, "labels"), ({"labels": {"bad-name": "x"}}, "labels"),
    ({"include": [""]}, "include"), ({"optimizer_sample": 100}, "optimizer_sample"),
    ({"optimizer_sample": 2 ** 21}, "optimizer_sample"),
])
def test_invalid_option_values_name_the_option(options, option):
    with pytest.raises(ValueError, match=f"'{option}'"):
        gradmon.attach(mlp(), **options)


def test_unknown_layer_type_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown layer type 'Linaer'.*Linear"):
        gradmon.attach(mlp(), layer_types=["Linaer"])


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown option"):
        gradmon.attach(mlp(), prot=9400)


def test_filters_that_match_nothing_are_a_value_error():
    with pytest.raises(ValueError, match="no layer matches"):
        gradmon.attach(mlp(), include=["encoder.*"])


def test_bad_environment_value_is_a_value_error(monkeypatch):
    monkeypatch.setenv("GRADMON_EVERY", "often")
    with pytest.raises(ValueError, match="GRADMON_EVERY"):
        gradmon.attach(mlp())


# -- configuration ------------------------------------------------------------------------------

def test_environment_overrides_keyword_options(monkeypatch, attach):
    monkeypatch.setenv("GRADMON_DETAIL_EVERY", "7")
    monkeypatch.setenv("GRADMON_LABELS", "run_id=exp-42,team=llm")
    monkeypatch.setenv("GRADMON_EXCLUDE", "2")
    mon = attach(mlp(), detail_every=1)
    assert mon.config.detail_every == 7
    assert mon.layers == ("0",)
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total", run_id="exp-42", team="llm") == 0


def test_include_exclude_and_layer_types_select_layers(attach):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert attach(model, layer_types=["LayerNorm"]).layers == ("1",)


def test_kill_switch_registers_nothing_and_starts_no_thread(monkeypatch):
    monkeypatch.setenv("GRADMON_DISABLE", "1")
    model = mlp()
    before_hooks, before_threads = hook_state(model), threading.active_count()
    before_opt = optimizer_hook_count()
    mon = gradmon.attach(model, port=0)
    train(model)
    assert mon.state == "disabled" and mon.url is None
    assert hook_state(model) == before_hooks
    assert optimizer_hook_count() == before_opt
    assert threading.active_count() == before_threads
    mon.step()
    mon.detach()
    with gradmon.attach(model):
        pass


# -- sharing and identity ------------------------------------------------------------------------

def test_two_models_share_one_endpoint_told_apart_by_model_label(attach):
    gen, disc = mlp(), nn.Sequential(nn.Linear(2, 1))
    g = attach(gen, name="generator")
    d = attach(disc, name="discriminator")
    assert g.url == d.url
    train(gen, 2)
    g.flush()
    s = scrape(g.url)
    assert value(s, "gradmon_steps_total", model="generator") == 2
    assert value(s, "gradmon_steps_total", model="discriminator") == 0


def test_default_model_names_are_unique(attach):
    a, b = attach(mlp()), attach(mlp())
    assert (a.name, b.name) == ("sequential", "sequential-2")


def test_attaching_twice_returns_the_same_handle_and_never_doubles_hooks(attach):
    model = mlp()
    first = attach(model)
    hooks = hook_state(model)
    assert attach(model) is first
    assert hook_state(model) == hooks
    with pytest.raises(ValueError, match="already monitored"):
        gradmon.attach(model, port=0, addr="127.0.0.1", detail_every=5)


def test_existing_registry_gets_the_metrics_and_no_server_starts():
    registry = CollectorRegistry()
    model = mlp()
    threads = threading.active_count()
    with gradmon.attach(model, registry=registry) as mon:
        assert mon.url is None and mon.state == "running"
        train(model, 3)
        mon.flush()
        body = generate_latest(registry).decode()
        assert value(parse(body), "gradmon_steps_total") == 3
        assert threading.active_count() == threads + 1  # the publisher only
    assert "gradmon_steps_total" not in generate_latest(registry).decode()


# -- detach ----------------------------------------------------------------------------------------

def test_detach_is_idempotent_restores_hooks_and_frees_the_port():
    model = mlp()
    before = hook_state(model)
    before_opt = optimizer_hook_count()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1")
    port = mon.port
    assert hook_state(model) != before
    mon.detach()
    mon.detach()
    assert mon.state == "detached"
    assert hook_state(model) == before
    assert optimizer_hook_count() == before_opt
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again
    train(model)  # the model trains on, untouched


def test_hundred_attach_detach_cycles_leak_nothing():
    model = mlp()
    threads = threading.active_count()
    hooks = hook_state(model)
    for _ in range(100):
        with gradmon.attach(model, port=0, addr="127.0.0.1") as mon:
            train(model, 1)
            mon.flush()
    assert threading.active_count() == threads
    assert hook_state(model) == hooks
    ref = weakref.ref(model)
    del model, mon
    gc.collect()
    assert ref() is None, "gradmon kept the model alive"


def test_a_taken_port_keeps_training_and_says_so(caplog):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        model = mlp()
        with gradmon.attach(model, port=port, addr="127.0.0.1") as mon:
            assert mon.state == "server_failed"
            assert str(port) in mon.error
            train(model, 2)  # no exception reaches training
            mon.flush()
            assert mon.snapshot().steps_total == 2
        assert "training continues" in caplog.text
    # one line that says what to do, not a traceback: a taken port is not a bug in gradmon
    errors = [r for r in caplog.records if r.name == "gradmon" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None and "GRADMON_PORT" in errors[0].getMessage()


def test_context_manager_detaches_on_error():
    model = mlp()
    with pytest.raises(RuntimeError):
        with gradmon.attach(model, port=0, addr="127.0.0.1") as mon:
            raise RuntimeError("user code failed")
    assert mon.state == "detached"


# -- errors inside gradmon ------------------------------------------------------------------------

@pytest.mark.parametrize("targets, stage", [
    # a detail step's activations (and gradient flow) are recorded in each layer's hook on the
    # first, at once after
    (("activation_record", "activation_many"), "forward"),
    (("gradient_record", "gradient_many"), "grad_flow"),
    (("param_grad_stats",), "backward"),
    (("pack",), "step"),
])
def test_errors_inside_hooks_are_counted_logged_once_and_never_raised(monkeypatch, attach, caplog, targets, stage):
    from gradmon.capture import kernels as stats

    def boom(*a, **k):
        raise RuntimeError("injected")

    for target in targets:
        monkeypatch.setattr(stats, target, boom)
    model = mlp()
    mon = attach(model, detail_every=1)
    train(model, 3)  # must not raise
    mon.flush()
    s = scrape(mon.url)
    assert value(s, "gradmon_hook_errors_total", stage=stage) >= 3
    assert value(s, "gradmon_steps_total") == 3  # no step lost
    assert caplog.text.count(f"error in {stage} stage") == 1


def test_collector_error_is_counted_and_the_scrape_still_works(attach, monkeypatch):
    from gradmon.serve import collector
    model = mlp()
    mon = attach(model)
    other = attach(nn.Sequential(nn.Linear(2, 2)), name="other")
    real = collector.add_view

    def flaky(fam, view):
        if view.labels["model"] == "other":
            raise RuntimeError("injected")
        real(fam, view)

    monkeypatch.setattr(collector, "add_view", flaky)
    s = scrape(mon.url)
    assert value(s, "gradmon_steps_total", model="sequential") == 0
    monkeypatch.setattr(collector, "add_view", real)
    assert value(scrape(mon.url), "gradmon_hook_errors_total", model="other", stage="collect") == 1


def test_process_metrics_do_not_collide_with_prometheus_client_process_collector():
    from prometheus_client import ProcessCollector
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    with gradmon.attach(mlp(), registry=registry):
        body = generate_latest(registry).decode()
    assert "gradmon_process_resident_memory_bytes" in body
    assert "\nprocess_resident_memory_bytes" in body


def scrape_from(url: str, source: str = "127.0.0.1", scrape_timeout: Optional[float] = None):
    """One GET of ``url`` from the loopback address ``source`` (a second Prometheus of an HA
    pair), telling the scrape timeout as Prometheus does when ``scrape_timeout`` is given."""
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5, source_address=(source, 0))
    headers = {"X-Prometheus-Scrape-Timeout-Seconds": str(scrape_timeout)} if scrape_timeout is not None else {}
    try:
        conn.request("GET", u.path, headers=headers)
        return parse(conn.getresponse().read().decode())
    finally:
        conn.close()


def detach_in_background(mon) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (mon.detach(), done.set()), daemon=True).start()
    return done


def test_finished_state_survives_one_last_scrape_after_detach():
    model = mlp()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=20)
    train(model, 1)
    url = mon.url
    scrape(url)
    time.sleep(0.3)
    assert value(scrape(url), "gradmon_run_state", state="training") == 1  # scraped periodically
    done = detach_in_background(mon)
    assert not done.wait(0.3)  # detach waits for the final scrape...
    s = scrape(url)
    assert value(s, "gradmon_run_state", state="finished") == 1
    assert value(s, "gradmon_run_state", state="training") == 0
    assert done.wait(5)  # ...and returns as soon as it happened
    with pytest.raises(urllib.error.URLError):
        scrape(url, timeout=1)


def test_detach_does_not_wait_when_nobody_ever_scraped():
    model = mlp()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=20)
    t0 = time.monotonic()
    mon.detach()
    assert time.monotonic() - t0 < 5


def test_detach_after_a_single_scrape_returns_at_once():
    model = mlp()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=20)
    scrape(mon.url)  # one curl during development is not a Prometheus
    t0 = time.monotonic()
    mon.detach()
    assert time.monotonic() - t0 < 1


def test_final_scrape_waits_for_each_scraper_of_an_ha_pair():
    mon = gradmon.attach(mlp(), port=0, addr="127.0.0.1", final_scrape_timeout=20)
    url = mon.url
    for _ in range(2):
        scrape_from(url, "127.0.0.1")
        scrape_from(url, "127.0.0.2")
        time.sleep(0.5)
    done = detach_in_background(mon)
    assert value(scrape_from(url, "127.0.0.1"), "gradmon_run_state", state="finished") == 1
    assert not done.wait(0.5)  # the other Prometheus has not seen it yet
    scrape_from(url, "127.0.0.2")
    assert done.wait(5)


def test_a_scrape_answered_after_the_scrapers_timeout_does_not_end_the_wait():
    """Under load a Prometheus whose scrape_timeout passed drops the answer: it has not
    seen the final state, so the wait goes on for its next scrape."""
    mon = gradmon.attach(mlp(), port=0, addr="127.0.0.1", final_scrape_timeout=20)
    url = mon.url
    for _ in range(2):
        scrape_from(url, scrape_timeout=10)
        time.sleep(0.3)
    done = detach_in_background(mon)
    time.sleep(0.1)
    scrape_from(url, scrape_timeout=1e-9)  # answered, but after the scraper gave up
    assert not done.wait(0.5)
    assert value(scrape_from(url, scrape_timeout=10), "gradmon_run_state", state="finished") == 1
    assert done.wait(5)


def test_several_models_on_one_endpoint_wait_once():
    a = gradmon.attach(mlp(), name="a", port=0, addr="127.0.0.1", final_scrape_timeout=20)
    b = gradmon.attach(mlp(), name="b", port=0, addr="127.0.0.1", final_scrape_timeout=20)
    url = a.url
    scrape(url)
    time.sleep(0.3)
    scrape(url)
    t0 = time.monotonic()
    a.detach()  # not the last one out: no wait, its final state stays served
    assert time.monotonic() - t0 < 1
    s = scrape(url)
    assert value(s, "gradmon_run_state", model="a", state="finished") == 1
    assert value(s, "gradmon_run_state", model="b", state="training") == 1
    done = detach_in_background(b)
    assert not done.wait(0.3)
    s = scrape(url)
    assert value(s, "gradmon_run_state", model="a", state="finished") == 1
    assert value(s, "gradmon_run_state", model="b", state="finished") == 1
    assert done.wait(5)


def test_a_long_final_scrape_wait_is_announced_with_how_to_turn_it_off(caplog):
    mon = gradmon.attach(mlp(), port=0, addr="127.0.0.1", final_scrape_timeout=4)
    scrape(mon.url)
    time.sleep(2.2)  # a scrape interval above 2 s
    scrape(mon.url)
    done = detach_in_background(mon)
    t0 = time.monotonic()
    while "waiting up to" not in caplog.text and time.monotonic() - t0 < 2:
        time.sleep(0.05)
    assert not done.is_set()  # said before the wait, not after it
    message = [r for r in caplog.records if "waiting up to" in r.getMessage()][0]
    assert message.levelname == "WARNING"
    assert "127.0.0.1" in message.getMessage() and "GRADMON_FINAL_SCRAPE_TIMEOUT=0" in message.getMessage()
    scrape(mon.url)
    assert done.wait(5)


def periodically_scraped(**options):
    mon = gradmon.attach(mlp(), port=0, addr="127.0.0.1", final_scrape_timeout=20, **options)
    scrape(mon.url)
    time.sleep(0.3)
    scrape(mon.url)
    return mon


def ctrl_c_after(seconds: float) -> None:
    import os
    import signal
    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT)).start()


def test_ctrl_c_ends_the_final_scrape_wait_at_once_and_still_frees_the_port():
    mon = periodically_scraped()
    port = mon.port
    ctrl_c_after(0.3)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        mon.detach()
    assert time.monotonic() - t0 < 2
    assert mon.state == "detached"
    with socket.socket() as s:
        # as any server would: the scrapes' closed connections may linger in TIME_WAIT
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # fails while anything still listens on it


def test_ctrl_c_during_the_wait_leaves_the_users_exception_as_it_was():
    mon = periodically_scraped()
    ctrl_c_after(0.3)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="the user's"):
        with mon:
            raise ValueError("the user's")
    assert time.monotonic() - t0 < 2


def test_pause_and_resume_set_the_run_state(attach):
    mon = attach(mlp())
    mon.pause()
    assert value(scrape(mon.url), "gradmon_run_state", state="paused") == 1
    mon.resume()
    assert value(scrape(mon.url), "gradmon_run_state", state="training") == 1


def test_snapshot_is_built_when_read_not_at_every_step(attach):
    """The publisher folds every step but builds a snapshot only when one is read (a
    scrape, ``snapshot()``): building one per step took the training thread's interpreter
    lock for nothing between two scrapes. What a read sees is still every folded step."""
    model = mlp()
    mon = attach(model)
    first = mon.snapshot()
    train(model, steps=7)
    mon.flush()
    snap = mon.snapshot()
    assert snap.steps_total == first.steps_total + 7
    assert snap.generation == first.generation + 1  # one build for seven steps
    assert mon.snapshot() is snap  # nothing new folded: the same snapshot
    assert value(scrape(mon.url), "gradmon_steps_total") == snap.steps_total


# -- saying where to look, and keeping it up -------------------------------------------------------

def announcements(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("gradmon: monitoring")]


def test_attach_says_where_the_metrics_and_the_live_page_are_on_one_stderr_line(attach, capfd):
    capfd.readouterr()
    mon = attach(mlp(), name="announced")
    err = capfd.readouterr().err
    assert announcements(err) == [f"gradmon: monitoring 2 layers of announced, metrics at {mon.url}, "
                                  f"live page at {mon.url[:-len('metrics')]}"]
    assert urllib.request.urlopen(mon.url[:-len("metrics")], timeout=5).status == 200  # the page it names


def test_attaching_the_same_model_again_does_not_announce_it_again(attach, capfd):
    model = mlp()
    attach(model)
    capfd.readouterr()
    attach(model)
    assert announcements(capfd.readouterr().err) == []


def test_a_rank_other_than_0_logs_the_announcement_at_debug_and_prints_nothing(attach, capfd, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="gradmon"):
        mon = attach(mlp())
    assert announcements(capfd.readouterr().err) == []
    said = [r for r in caplog.records if r.getMessage().startswith("gradmon: monitoring")]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.DEBUG, f"gradmon: monitoring 2 layers of sequential on rank 1, metrics at {mon.url}, "
                        f"live page at {mon.url[:-len('metrics')]}")]


@pytest.mark.parametrize("how", ["option", "environment"])
def test_announce_off_prints_nothing(attach, capfd, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("GRADMON_ANNOUNCE", "0")
    capfd.readouterr()
    attach(mlp(), **({"announce": False} if how == "option" else {}))
    assert announcements(capfd.readouterr().err) == []


def test_keep_serving_serves_the_finished_run_and_its_page_after_detach_until_taken_over(capfd):
    """The end of the process releases a held endpoint (tests/test_run_end.py); a monitor
    attached again under the same name takes it over, here on the same port."""
    model = mlp()
    mon = gradmon.attach(model, port=0, addr="127.0.0.1", final_scrape_timeout=0, keep_serving=True)
    port, url = mon.port, mon.url
    train(model, 3)
    mon.detach()
    assert "still serving it until the process exits (keep_serving)" in capfd.readouterr().err
    assert mon.state == "detached" and hook_state(model) == hook_state(mlp())
    samples = scrape(url)
    assert value(samples, "gradmon_run_state", state="finished") == 1
    assert value(samples, "gradmon_steps_total") == 3
    assert urllib.request.urlopen(url[:-len("metrics")], timeout=5).status == 200
    mon.detach()  # idempotent: still served
    assert value(scrape(url), "gradmon_run_state", state="finished") == 1

    again = gradmon.attach(model, port=port, addr="127.0.0.1", final_scrape_timeout=0)
    assert again.url == url and value(scrape(url), "gradmon_run_state", state="training") == 1
    again.detach()
    with pytest.raises(ConnectionRefusedError):  # the held endpoint went with the run that took it over
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_endpoint_serves_a_model_before_its_hooks_exist_and_a_held_run_until_its_successor(monkeypatch):
    """A scrape while attach() installs the hooks (here: from inside the installation) sees the
    model at its first step, not an endpoint that is up with no series of it; and a held run
    taken over is served until the new monitor is, never neither."""
    from gradmon.capture.hooks import HookSet
    from servers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    seen = []
    install = HookSet.install

    def scraping_install(self, *args, **kwargs):
        seen.append(scrape(url))
        return install(self, *args, **kwargs)

    model = mlp()
    monkeypatch.setattr(HookSet, "install", scraping_install)
    mon = gradmon.attach(model, port=port, addr="127.0.0.1", final_scrape_timeout=0, keep_serving=True)
    assert value(seen[0], "gradmon_steps_total") == 0
    monkeypatch.setattr(HookSet, "install", install)
    train(model, 3)
    mon.detach()  # held: its final view served

    monkeypatch.setattr(HookSet, "install", scraping_install)
    again = gradmon.attach(model, port=port, addr="127.0.0.1", final_scrape_timeout=0)
    try:
        assert value(seen[1], "gradmon_steps_total") == 3  # the counters continue under the same name
        assert value(seen[1], "gradmon_run_state", state="training") == 1  # the new run's view, not the held one
    finally:
        again.detach()


@pytest.mark.slow
def test_a_two_rank_ddp_job_announces_once_from_rank_0(tmp_path, capfd):
    """Real ranks (gloo, spawned): the line comes from rank 0 alone, rank 1 keeps quiet."""
    import torch.multiprocessing as mp

    import ddp_worker
    from servers import free_port, free_port_range

    base = free_port_range(2)
    plan = [{"name": "one", "steps": 1}]
    (tmp_path / "one.go").write_text("")
    capfd.readouterr()
    ctx = mp.start_processes(ddp_worker.run, args=(2, str(tmp_path), free_port(), base, plan),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(1):
        assert time.monotonic() < deadline, "ranks did not finish in time"
    said = announcements(capfd.readouterr().err)
    assert said == [f"gradmon: monitoring 3 layers of sequential on rank 0, metrics at "
                    f"http://127.0.0.1:{base}/metrics, live page at http://127.0.0.1:{base}/"], said
