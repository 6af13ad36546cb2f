"""The Alertmanager config: one receiver, and the inhibitions that make one fault one page."""

from __future__ import annotations

from typing import Any, Dict

from .rules import INHIBITIONS


def alertmanager_config(webhook_url: str = "http://alert-receiver.example:5001/gradmon",
                        group_wait: str = "30s", group_interval: str = "5m",
                        repeat_interval: str = "4h") -> Dict[str, Any]:
    return {
        "route": {
            "receiver": "oncall",
            "group_by": ["job", "alertname"],
            "group_wait": group_wait, "group_interval": group_interval, "repeat_interval": repeat_interval,
        },
        "receivers": [{"name": "oncall", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        "inhibit_rules": [
            {"source_matchers": [f"alertname = {src}"],
             "target_matchers": [f"alertname =~ \"{'|'.join(targets)}\""],
             "equal": ["job"]}
            for src, targets in INHIBITIONS],
    }
