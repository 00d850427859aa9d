"""GET /metrics: the node and its bridge in Prometheus text format, through prometheus_client.

Each app has its own CollectorRegistry (never the process-global one: a test process runs several apps, and a
global registry would refuse the second app's metrics). The node's numbers are read when Prometheus scrapes,
so nothing polls; the bridge's counters come from one middleware that sees every answer (its method, route
template and status), so the handlers carry no metrics code. Update durations and WebSocket forward latencies
happen outside any HTTP answer: `observe_update` (a node update listener) and `observe_forward` (a split
WebSocket forward listener) are the hooks their owners call.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

from aiohttp import web
from hivemind.utils.logging import get_logger
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = get_logger(__name__)

SUBMIT_ROUTE = "/api/v1/train/submit"
TENSOR_ROUTE = "/api/v1/model/tensor/{id}"
FORWARD_ROUTE = "/api/v1/split/forward"
UNMATCHED = "(unmatched)"  # route label of paths no route matched: a bounded label set whatever clients send
# why the node refused a packet, by the status /api/v1/train/submit answered (bridge/training_routes.py)
REJECT_REASONS = {400: "malformed", 403: "scored_out", 409: "step_mismatch", 411: "no_content_length", 413: "too_large",
                  500: "internal", 503: "node_busy"}
BYTES_PER_ELEMENT = {"f16": 2, "f32": 4}
FORWARD_BUCKETS_S = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UPDATE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class NodeNumbers:
    """What /metrics reports of the node itself."""

    step: int  # model step the node serves
    updates: int  # updates applied (a restored checkpoint's included)
    peers: int  # swarm peers seen, this node included
    contributors: int  # distinct contributor node ids accepted since start
    accepted_samples: int  # samples of accepted contributions since start
    applied_samples: int  # of them (and of the node's own data), applied by an update of the swarm
    carried_samples: int  # missed at least one update and went into a later one
    pending_samples: int  # handed to the training thread, not applied yet
    pending_contributors: int  # contributors gathered towards the next hand-over
    references: int  # trusted reference gradients computed (node/train/reference.py)
    reference_seconds: float  # their total wall time
    scored_out: int  # contributors refused for their record (node/train/ledger.py)


def read_node(node) -> NodeNumbers:
    """The one place that reads the node (its typed NodeStatus)."""
    status = node.status()
    return NodeNumbers(**{f.name: getattr(status, f.name) for f in dataclasses.fields(NodeNumbers)})


class _LiveCollector:
    """Numbers read at scrape time: the node's, and the split service's open sessions and sockets."""

    def __init__(self, node, split_state=None, serve_state=None):
        self._node = node
        self._split = split_state  # bridge.split_routes.SplitState, or None
        self._serve = serve_state  # bridge.openai_routes.ServeState, or None

    def collect(self):
        n = read_node(self._node)
        yield GaugeMetricFamily("dtrain_step", "Model step this node serves", value=n.step)
        yield CounterMetricFamily("dtrain_updates", "Updates this node applied", value=n.updates)
        yield GaugeMetricFamily("dtrain_peers", "Swarm peers this node sees, itself included", value=n.peers)
        yield GaugeMetricFamily("dtrain_contributors", "Distinct contributors whose packets were accepted",
                                value=n.contributors)
        yield CounterMetricFamily("dtrain_samples", "Samples of accepted contributions", value=n.accepted_samples)
        yield CounterMetricFamily("dtrain_applied_samples", "Samples applied by an update of the swarm",
                                  value=n.applied_samples)
        yield CounterMetricFamily("dtrain_carried_samples", "Samples that missed an update and went into a later one",
                                  value=n.carried_samples)
        yield GaugeMetricFamily("dtrain_pending_samples", "Samples handed to the training thread, not applied yet",
                                value=n.pending_samples)
        yield GaugeMetricFamily("dtrain_pending_contributors", "Contributors gathered towards the next update",
                                value=n.pending_contributors)
        yield CounterMetricFamily("dtrain_reference_gradients", "Trusted reference gradients the node computed on its "
                                  "own data (one per step with contributions)", value=n.references)
        yield CounterMetricFamily("dtrain_reference_seconds", "Wall seconds spent computing reference gradients",
                                  value=n.reference_seconds)
        yield GaugeMetricFamily("dtrain_scored_out_contributors", "Contributors refused (403) because their record "
                                "disagreed with the node's reference", value=n.scored_out)
        if self._split is not None:
            yield GaugeMetricFamily("dtrain_split_sessions", "KV-cached split-inference sessions alive",
                                    value=self._split.service.engine.session_count())
            yield GaugeMetricFamily("dtrain_split_sockets", "Open split-inference WebSockets",
                                    value=len(self._split.sockets))
        if self._serve is not None:
            engine = self._serve.service.engine
            running, waiting = engine.load()
            yield GaugeMetricFamily("dtrain_serve_sequences", "Sequences in the /v1 engine's running batch",
                                    value=running)
            yield GaugeMetricFamily("dtrain_serve_waiting", "/v1 requests waiting for room in the batch", value=waiting)
            yield CounterMetricFamily("dtrain_serve_requests", "/v1 requests the engine finished",
                                      value=engine.completed_requests)
            yield CounterMetricFamily("dtrain_serve_tokens", "Tokens the /v1 engine generated (end of text included)",
                                      value=engine.generated_tokens)


class BridgeMetrics:
    """One app's registry and the bridge's own counters and histograms."""

    def __init__(self, node, split_state=None, serve_state=None):
        self.registry = r = CollectorRegistry()
        r.register(_LiveCollector(node, split_state, serve_state))
        self.requests = Counter("dtrain_http_requests", "HTTP answers by method, route template and status",
                                ["method", "route", "status"], registry=r)
        self.packets_accepted = Counter("dtrain_packets_accepted", "DGRD packets accepted", registry=r)
        self.packets_rejected = Counter("dtrain_packets_rejected", "DGRD packets refused, by status and reason",
                                        ["status", "reason"], registry=r)
        self.ingest_bytes = Counter("dtrain_ingest_bytes", "Bytes of DGRD packets read (accepted or refused)",
                                    registry=r)
        self.download_bytes = Counter("dtrain_download_bytes", "Bytes of model tensors served, by format",
                                      ["format"], registry=r)
        self.forward_seconds = Histogram("dtrain_split_forward_seconds", "Split forward calls: request to answer",
                                         ["transport"], buckets=FORWARD_BUCKETS_S, registry=r)
        self.update_seconds = Histogram("dtrain_update_duration_seconds", "Time one swarm update took",
                                        buckets=UPDATE_BUCKETS_S, registry=r)
        # every label set a dashboard plots exists from the start, at zero
        for status, reason in REJECT_REASONS.items():
            self.packets_rejected.labels(str(status), reason)
        for fmt in BYTES_PER_ELEMENT:
            self.download_bytes.labels(fmt)
        for transport in ("http", "ws"):
            self.forward_seconds.labels(transport)

    def observe_update(self, seconds: float) -> None:
        """Hook for the node side: one update took `seconds` (from hand-over to the new step being served)."""
        self.update_seconds.observe(seconds)

    def observe_forward(self, seconds: float, transport: str = "ws") -> None:
        """Hook for split forwards answered outside an HTTP response (the WebSocket stream)."""
        self.forward_seconds.labels(transport).observe(seconds)

    def record(self, request: web.Request, status: int, response: Optional[web.StreamResponse],
               elapsed_s: float) -> None:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else UNMATCHED
        self.requests.labels(request.method, route, str(status)).inc()
        if route == SUBMIT_ROUTE and request.method == "POST":
            if status == 200:
                self.packets_accepted.inc()
            else:
                self.packets_rejected.labels(str(status), REJECT_REASONS.get(status, "other")).inc()
            if status not in (411, 413) and request.content_length:  # those answers come before the body is read
                self.ingest_bytes.inc(request.content_length)
        elif route == TENSOR_ROUTE and status == 200 and response is not None:
            fmt = response.headers.get("X-Tensor-Format", "")
            if fmt in BYTES_PER_ELEMENT:  # the body is a view of the snapshot: count it from its headers
                self.download_bytes.labels(fmt).inc(int(response.headers["X-Tensor-Count"]) * BYTES_PER_ELEMENT[fmt])
        elif route == FORWARD_ROUTE and status == 200:
            self.forward_seconds.labels("http").observe(elapsed_s)


METRICS = web.AppKey("metrics", BridgeMetrics)


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    started = time.perf_counter()
    try:
        response = await handler(request)
    except web.HTTPException as e:  # only what the error middleware lets through (redirects)
        request.app[METRICS].record(request, e.status, None, time.perf_counter() - started)
        raise
    request.app[METRICS].record(request, response.status, response, time.perf_counter() - started)
    return response


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


def setup(app: web.Application, node, split_state=None, serve_state=None) -> BridgeMetrics:
    """Add /metrics and the counting middleware; call it after the other middlewares are installed."""
    app[METRICS] = BridgeMetrics(node, split_state, serve_state)
    node.add_update_listener(app[METRICS].observe_update)
    if split_state is not None:
        split_state.forward_listeners.append(app[METRICS].observe_forward)
    # outermost: it sees the final answer, the JSON errors of bridge.http's middleware included
    app.middlewares.insert(0, metrics_middleware)
    app.router.add_get("/metrics", metrics)
    return app[METRICS]
