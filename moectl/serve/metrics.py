"""`/metrics` of `moectl serve` in the Prometheus text format (prometheus_client).

Request counts by endpoint and status are counted by the app; everything about the runtime is read at
scrape time from the worker's published state, so the numbers are the runtime's own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()            # no *_created series: a scraper needs only the values


class RuntimeCollector:
    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        s = self.worker.state
        yield InfoMetricFamily("moectl_engine", "The engine serving (torch, or torch-free: the one ggml graph of a "
                               "GGUF) and its expert cache (device: slots copied into; in place: every expert "
                               "computed where it lies, each routed expert a hit)",
                               {"engine": s["engine"], "cache": "in place" if s["in_place"] else "device"})
        yield CounterMetricFamily("moectl_prompt_tokens", "Prompt tokens of finished requests", s["prompt_tokens"])
        yield CounterMetricFamily("moectl_generated_tokens", "Tokens generated", s["generated_tokens"])
        yield CounterMetricFamily("moectl_requests_cancelled", "Generations stopped because the client left",
                                  s["cancelled"])
        yield GaugeMetricFamily("moectl_tokens_per_second", "Decode rate of the last finished request",
                                s["tokens_per_s"])
        yield GaugeMetricFamily("moectl_queue_depth", "Requests waiting for the runtime", self.worker.queue_depth)
        yield GaugeMetricFamily("moectl_busy", "1 while a request is generating", int(s["busy"]))
        yield CounterMetricFamily("moectl_cache_hits", "Expert cache hits", s["hits"])
        yield CounterMetricFamily("moectl_cache_misses", "Expert cache misses (demand loads and misses computed on "
                                  "the CPU)", s["misses"])
        yield GaugeMetricFamily("moectl_cache_hit_rate", "Expert cache hit rate since start", s["hit_rate"])
        yield CounterMetricFamily("moectl_bytes_loaded", "Expert bytes copied to the device (demand + prefetch)",
                                  s["bytes_loaded"])
        layer = GaugeMetricFamily("moectl_layer_hit_rate", "Expert cache hit rate per MoE layer", labels=["layer"])
        for i, row in enumerate(s["layers"]):
            layer.add_metric([str(i)], row["hit_rate"])
        yield layer


class Metrics:
    def __init__(self, worker):
        self.registry = CollectorRegistry()
        self.requests = Counter("moectl_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.registry.register(RuntimeCollector(worker))

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
