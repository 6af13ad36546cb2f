"""The benchmark script runs and prints a ratio for every variant (figures are not asserted:
speed is judged by the benchmark's printout, not by a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_overhead.py"


def test_benchmark_quick_run_reports_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res) == set(load_bench().VARIANTS) >= {"baseline", "gradmon_defaults", "gradmon_all_every_step",
                                                         "floor_foreach_norm", "tutorial_hooks_item"}
    assert res["baseline"]["ratio"] == 1.0
    for name, row in res.items():
        assert row["mean_step_ms"] > 0 and row["peak_rss_mb"] > 0, name
        assert name in r.stdout
    assert res["gradmon_defaults"]["host_us_per_step"] > 0  # read from gradmon's own counter


def test_scrape_benchmark_quick_run_reports_no_failed_scrape(tmp_path):
    out = tmp_path / "scrape.json"
    r = subprocess.run([sys.executable, str(BENCH.parent / "bench_scrape.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    paced, flood = json.loads(out.read_text())
    assert paced["scrapes"] > 0 and flood["scrapes"] > paced["scrapes"]
    assert paced["failed_scrapes"] == 0 and flood["failed_scrapes"] == 0
    assert paced["gradmon_errors"] == 0 and flood["gradmon_errors"] == 0


def load_bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_overhead
    finally:
        sys.path.remove(str(BENCH.parent))
    return bench_overhead


def test_the_confidence_bound_is_the_student_t_upper_bound_of_the_mean():
    bench_overhead = load_bench()
    # mean 2, sample sd 1, n 3: 2 + t(0.975, df=2) / sqrt(3)
    assert abs(bench_overhead.ci95_high([1.0, 2.0, 3.0]) - (2 + 4.303 / 3 ** 0.5)) < 1e-9
    assert bench_overhead.ci95_high([1.0, 1.0, 1.0]) == 1.0


def test_overhead_breakdown_times_every_hook_of_a_detail_step_and_the_publishers_fold_in_cpu_time():
    r = subprocess.run([sys.executable, str(BENCH.parent / "overhead_breakdown.py"), "--steps", "1", "--discard", "1",
                        "--threads", "1", "--cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "CPU time" in r.stdout.splitlines()[0]
    rows = dict(line.split() for line in r.stdout.splitlines()[1:])
    for name in ("host", "publisher", "on_forward", "on_grad_flow", "activation_record", "moments_block", "read",
                 "_measure_grads"):
        assert float(rows[name]) > 0, (name, r.stdout)
    assert float(rows["on_forward"]) >= float(rows["activation_record"])  # nested timers sit inside their callers
    # gradmon's own clock is the CPU clock too: the hooks' time is within it
    assert float(rows["host"]) >= float(rows["_measure_grads"]), r.stdout
    # the wait for the publisher's fold is timed where the packet is handed over
    assert float(rows["fold_wait"]) >= 0, r.stdout


def test_prometheus_load_benchmark_reads_a_real_prometheus_scraping_simulated_ranks(tmp_path):
    from servers import binary
    binary("prometheus")  # a missing binary fails under CI=true, skips elsewhere
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(BENCH.parent / "prometheus_load.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    last = res["rows"][-1]
    # 4 simulated ranks of gradmon's real exposition (rank 0's and another rank's) plus Prometheus' own
    assert last["head_series"] > 4 * 100 and last["heap_inuse_mb"] > 0 and last["samples_per_s"] > 0
    assert last["rule_eval_s"] > 0  # the gradmon rules were loaded and evaluated


def test_the_collector_benchmark_prints_both_copies_collections_and_time():
    r = subprocess.run([sys.executable, str(BENCH.parent / "bench_collector.py"), "--model", "chain-10", "--steps", "5",
                        "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.split()[:1] in (["twin"], ["gradmon"])}
    assert set(rows) == {"twin", "gradmon"}, r.stdout
    for copy, cells in rows.items():
        step_ms, young, middle, full, collector_ms = map(float, cells[:5])
        assert step_ms > 0 and young >= 0 and full >= 0 and collector_ms >= 0, (copy, cells)


def test_the_compiled_record_benchmark_times_a_record_after_both_producers():
    """It builds its records with ``capture/traced.py``'s own functions: a change of theirs
    that the benchmark did not follow fails here, not when someone next measures."""
    r = subprocess.run([sys.executable, str(BENCH.parent / "bench_compile_read.py"), "--quick", "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "record after matmul " in r.stdout and "record after matmul+gelu" in r.stdout, r.stdout


def test_the_op_count_proxy_takes_a_devices_paths_without_gradmon_reporting_an_error():
    """``--as-device`` swaps gradmon functions for a device's versions: one whose signature
    moved on fails inside gradmon's guards (counted, not raised), and the counts would leave
    out what it skipped; the script refuses to print them then."""
    r = subprocess.run([sys.executable, str(BENCH.parent / "bench_ops.py"), "--as-device", "--period", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    added = [line for line in r.stdout.splitlines() if line.startswith("gradmon adds ")]
    assert len(added) == 2, r.stdout
    assert "isnan" in r.stdout, r.stdout  # a device counts NaN/Inf on every step: the paths were taken


def test_the_kernel_choices_benchmark_times_every_choice_against_its_alternative():
    """It reaches into ``capture/kernels.py`` for each alternative: a name the kernels no
    longer have fails here, not when someone next measures."""
    r = subprocess.run([sys.executable, str(BENCH.parent / "kernel_choices.py"), "--repeats", "3", "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    timed = [line for line in r.stdout.splitlines() if line.startswith("| `")]
    assert len(timed) >= 12 and all(float(line.rstrip(" |").rsplit("|", 1)[1]) > 0 for line in timed), r.stdout


def test_the_publisher_benchmark_times_both_wake_up_policies_and_counts_their_wake_ups(tmp_path):
    out = tmp_path / "publisher.json"
    r = subprocess.run([sys.executable, str(BENCH.parent / "bench_publisher.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())
    assert row["model"] == "chain-10" and row["twin_ms"] > 0
    for policy in ("per_packet", "gathered"):
        assert row[policy]["ratio"] > 0 and row[policy]["wakes_per_step"] > 0, (policy, row)
    # a wake-up per packet can only fold as many packets as there were, gathered ones fewer
    assert row["per_packet"]["wakes_per_step"] >= row["gathered"]["wakes_per_step"], row
    assert "chain-10" in r.stdout
