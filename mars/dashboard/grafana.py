"""The dashboard as Grafana JSON, built with Grafana's foundation SDK
(``grafana-foundation-sdk``): typed builders generated from Grafana's own schema, maintained by
Grafana Labs, so a panel or query field that does not exist fails here rather than in a
browser (grafanalib, the older choice, is hand-written and lags Grafana's schema). Panels are
time series laid out two to a row, one Grafana row per group of :data:`mars.dashboard.panels.ROWS`.
"""

from __future__ import annotations

import json
from typing import Any

from mars.dashboard.panels import ROWS

UID = "mars-overview"
TITLE = "mars: agent-aware serving"


def build() -> dict[str, Any]:
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, Dashboard, Row
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (Dashboard(TITLE).uid(UID).tags(["mars", "vllm", "agents"]).refresh("10s")
         .time("now-30m", "now").editable()
         .with_variable(DatasourceVariable("datasource").label("Prometheus")
                        .type("prometheus")))
    for row, panels in ROWS:
        d = d.with_row(Row(row))
        for p in panels:
            ts = (Timeseries().title(p.title).unit(p.unit).datasource(ds).height(8).span(12)
                  .min(0))
            if p.description:
                ts = ts.description(p.description)
            for i, q in enumerate(p.queries):
                ts = ts.with_target(Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
                                    .ref_id(chr(ord("A") + i)).datasource(ds))
            d = d.with_panel(ts)
    return json.loads(JSONEncoder(sort_keys=True, indent=1).encode(d.build()))


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every query expression in a built dashboard (what the tests run against Prometheus)."""
    return [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", [])
            if "expr" in t]
