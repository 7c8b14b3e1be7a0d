"""The Grafana dashboard only queries metrics the API actually exports."""

from __future__ import annotations

import json
import re

from api_helpers import CONFIGS
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxima.api.server import SimulatedServer


def test_dashboard_metrics_exist(client: TestClient, server: SimulatedServer) -> None:
    server.controller.metrics.kernel_seconds.observe(0.001)  # histograms appear once observed
    exported = set()
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        exported |= {s.name for s in fam.samples} | {fam.name}
    # (the dashboard stays in configs/: CONFIGS is the shipped policies' folder since they became package data)
    dash = json.loads((CONFIGS.parents[1] / "configs" / "grafana" / "proxima-dashboard.json").read_text())
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bproxima_[a-z0-9_]+", target["expr"]))
    assert used, "dashboard queries no proxima_ metric"
    # A labelled counter with no samples yet is exported as its family only (name without _total).
    missing = {m for m in used if m not in exported and m.removesuffix("_total") not in exported}
    assert not missing, sorted(missing)
