"""The series names that rules and panels query: each metric's sample name as the metric
contract exposes it, and the recording rules' names."""

from __future__ import annotations

from .. import metrics as M

TARGET = "job, instance, model, rank"  # the labels that identify one monitored model on one rank


def sample(spec: M.MetricSpec) -> str:
    """A metric's sample name as PromQL reads it (a counter's ends in _total). Every name a
    rule or panel uses comes from the metric contract, so a rename cannot leave one behind."""
    return M.exposed_names(spec)[0]


REC_GLOBAL_POST_WARMUP = f"model_rank:{M.GRAD_GLOBAL_NORM.name}:post_warmup"
REC_GLOBAL_BASELINE = f"model_rank:{M.GRAD_GLOBAL_NORM.name}:median_baseline"
REC_LAYER_POST_WARMUP = f"model_rank_layer:{M.GRAD_NORM.name}:post_warmup"
REC_LAYER_BASELINE = f"model_rank_layer:{M.GRAD_NORM.name}:median_baseline"
REC_LOCAL_MEDIAN = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:median"
REC_LOCAL_MIN = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:min"
REC_LOCAL_RANKS = f"job_model:{M.LOCAL_GRAD_GLOBAL_NORM.name}:count"
REC_STEPS_RATE = f"model_rank:{M.STEPS.name}:rate1m"
LOCAL_GLOBAL_NORM = M.LOCAL_GRAD_GLOBAL_NORM.name  # issue 4's pre-all-reduce view
