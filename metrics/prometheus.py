"""Prometheus metrics: the ``Observer`` the engine calls, and the ``/metrics`` exposition.

Every metric carries the label ``model_name``. Each observer owns its own ``CollectorRegistry``
(tests and multi-app processes create several); the server renders ``observer.registry``.

Where numbers come from:
- per step (``StepStats``): token counters, TTFT and inter-token gaps (observed as they happen, so
  a dashboard sees them live), tokens per iteration, queue/KV gauges, preemptions, prefix cache,
  and the FLOPs/bytes behind MFU/MBU;
- per finished request (``RequestStats``): end-to-end, queue, prefill, decode and per-output-token
  times and the request's token counts, for successful requests only (an aborted request's
  latency says nothing about the server), plus success/failure counters for all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from servelm.metrics.batch_histogram import BatchHistogram
from servelm.metrics.observer import RequestStats, StepStats

# Roughly log-spaced 1 ms .. 60 s: a GPU decode step is a few ms, a CPU one tens of ms, and a
# CPU TTFT under load runs to tens of seconds. Request-level times get a longer tail.
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(14))  # 1 .. 8192

SUCCESS_REASONS = ("stop", "length")
FAILURE_REASONS = ("rejected", "aborted", "error")
# RequestStats.finish_reason -> failure label
_FAILURE_OF = {"abort": "aborted", "error": "error"}

DEFAULT_UTILIZATION_WINDOW_S = 10.0


class PrometheusObserver:
    """Records engine steps and finished requests into Prometheus metrics (thread-safe).

    ``peak_flops`` and ``peak_bandwidth`` (bytes/s) are the device ceilings (see ``metrics.roofline``)
    against which ``servelm_model_flops_utilization`` / ``servelm_model_bandwidth_utilization`` are
    computed at scrape time over the steps of the last ``window_s`` seconds, so they fall to 0 once
    the engine goes idle. ``clock`` is injectable for tests (``time.monotonic`` by default).
    """

    def __init__(
        self,
        model_name: str,
        info: dict[str, str],
        peak_flops: float,
        peak_bandwidth: float,
        registry: CollectorRegistry | None = None,
        *,
        window_s: float = DEFAULT_UTILIZATION_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        process_metrics: bool = True,
        max_loras: int | None = None,
    ) -> None:
        if registry is None:
            registry = CollectorRegistry()
            if process_metrics:
                # The global registry has these built in; a private one needs them added.
                ProcessCollector(registry=registry)
                PlatformCollector(registry=registry)
                GCCollector(registry=registry)
        self.registry = registry
        self.model_name = model_name
        self.peak_flops = float(peak_flops)
        self.peak_bandwidth = float(peak_bandwidth)
        self.window_s = float(window_s)
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        # (time the step was reported, its duration, flops, bytes) of the steps inside the window
        self._recent: deque[tuple[float, float, float, float]] = deque()

        labels = ["model_name"]
        reg = registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        m = model_name
        # Observed per step, one value per request: taken a whole list at a time (see BatchHistogram).
        self.ttft = BatchHistogram(
            "servelm_time_to_first_token_seconds",
            "Arrival to first output token.",
            {"model_name": m},
            REQUEST_LATENCY_BUCKETS,
            reg,
        )
        self.tpot = hist(
            "servelm_time_per_output_token_seconds",
            "Per request: (e2e latency - TTFT) / (output tokens - 1), for requests of more than one token.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(m)
        self.itl = BatchHistogram(
            "servelm_inter_token_latency_seconds",
            "Gap between consecutive output tokens.",
            {"model_name": m},
            TOKEN_LATENCY_BUCKETS,
            reg,
        )
        self.e2e = hist(
            "servelm_e2e_request_latency_seconds", "Arrival to finish, successful requests.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.queue_time = hist(
            "servelm_request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.prefill_time = hist(
            "servelm_request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.decode_time = hist(
            "servelm_request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.request_prompt_tokens = hist(
            "servelm_request_prompt_tokens", "Prompt tokens per successful request.", TOKEN_COUNT_BUCKETS
        ).labels(m)
        self.request_generation_tokens = hist(
            "servelm_request_generation_tokens", "Generated tokens per successful request.", TOKEN_COUNT_BUCKETS
        ).labels(m)
        self.iteration_tokens = hist(
            "servelm_iteration_tokens", "Prompt + generated tokens per engine step.", TOKEN_COUNT_BUCKETS
        ).labels(m)

        self.prompt_tokens = counter(
            "servelm_prompt_tokens", "Prompt tokens computed (prefill, chunks and recompute after preemption)."
        ).labels(m)
        self.generation_tokens = counter("servelm_generation_tokens", "Tokens generated.").labels(m)
        self.num_preemptions = counter("servelm_num_preemptions", "Requests preempted.").labels(m)
        self.prefix_cache_queries = counter(
            "servelm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        # Speculative decoding, vLLM's spec_decode counters: acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts.
        self.spec_drafts = counter("servelm_spec_decode_num_drafts", "Sequences whose drafts were verified.").labels(m)
        self.spec_draft_tokens = counter(
            "servelm_spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        ).labels(m)
        self.spec_accepted_tokens = counter(
            "servelm_spec_decode_num_accepted_tokens", "Speculative draft tokens kept."
        ).labels(m)
        self.spec_per_pos = Counter("servelm_spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept at each "
                                    "position (0: the first draft).", labels + ["position"], registry=reg)  # fmt: skip
        self.prefix_cache_hits = counter(
            "servelm_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(m)
        success = Counter(
            "servelm_request_success", "Requests finished normally.", labels + ["finished_reason"], registry=reg
        )
        failure = Counter("servelm_request_failure", "Requests that failed.", labels + ["reason"], registry=reg)
        # Touch every label value so each series exists (at 0) from the first scrape.
        self.success = {r: success.labels(m, r) for r in SUCCESS_REASONS}
        self.failure = {r: failure.labels(m, r) for r in FAILURE_REASONS}

        self.num_running = gauge("servelm_num_requests_running", "Requests in the running batch.").labels(m)
        self.num_waiting = gauge("servelm_num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.kv_cache_usage = gauge("servelm_kv_cache_usage_perc", "KV cache blocks in use, 0..1.").labels(m)
        gauge(
            "servelm_model_flops_utilization",
            f"Counted model FLOPs / (window wall time x peak FLOP/s) over the last {self.window_s:g} s.",
        ).labels(m).set_function(lambda: self.utilization()[0])
        gauge(
            "servelm_model_bandwidth_utilization",
            f"Weight + KV bytes moved / (window wall time x peak bytes/s) over the last {self.window_s:g} s.",
        ).labels(m).set_function(lambda: self.utilization()[1])
        gauge("servelm_device_peak_flops", "Peak FLOP/s used as the MFU denominator.").labels(m).set(self.peak_flops)
        gauge("servelm_device_peak_bandwidth_bytes", "Peak bytes/s used as the MBU denominator.").labels(m).set(
            self.peak_bandwidth
        )

        # LoRA serving (``max_loras`` set): vLLM's ``lora_requests_info``, which gateways read to route by
        # adapter. One series at a time (cleared when the adapters change, not kept per combination),
        # its value the Unix time of the last change.
        self.max_loras = max_loras
        self._lora_state: tuple[list[str], list[str]] | None = None
        self.lora_info: Gauge | None = None
        if max_loras is not None:
            self.lora_info = Gauge(
                "servelm_lora_requests_info",
                "LoRA adapters of running and waiting requests (comma-separated names); value: when they last changed.",
                labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=reg,
            )
            self._set_lora_info(([], []))

        info_labels = {k: str(v) for k, v in info.items() if k != "model_name"}
        Info("servelm_model", "The served model and its KV cache.", labels, registry=reg).labels(m).info(info_labels)

    # --- Observer -------------------------------------------------------------------------
    def on_step(self, stats: StepStats) -> None:
        now = self._clock()
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens:  # a step that computed nothing is not an iteration worth a sample
            self.iteration_tokens.observe(step_tokens)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_draft_tokens:
            self.spec_drafts.inc(stats.num_drafts)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.num_accepted_draft_tokens)
            for j, n in enumerate(stats.accepted_per_pos):
                self.spec_per_pos.labels(self.model_name, str(j)).inc(n)
        self.ttft.observe_many(stats.time_to_first_tokens)
        self.itl.observe_many(stats.inter_token_latencies)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.lora_adapters is not None and stats.lora_adapters != self._lora_state:
            self._set_lora_info(stats.lora_adapters)
        with self._lock:
            self._recent.append((now, stats.duration_s, stats.flops, stats.bytes_moved))
            self._expire(now)

    def _set_lora_info(self, adapters: tuple[list[str], list[str]]) -> None:
        if self.lora_info is None:
            return
        self._lora_state = adapters
        running, waiting = adapters
        self.lora_info.clear()
        self.lora_info.labels(self.model_name, str(self.max_loras), ",".join(running), ",".join(waiting)).set(
            time.time()
        )

    def on_request_finished(self, stats: RequestStats) -> None:
        failure = _FAILURE_OF.get(stats.finish_reason)
        if failure is not None:
            self.failure[failure].inc()
            return
        counter = self.success.get(stats.finish_reason)
        if counter is None:  # an unknown reason is a contract bug upstream; count it, don't crash the engine
            self.failure["error"].inc()
            return
        counter.inc()
        e2e = stats.finished_time - stats.arrival_time
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        if stats.first_scheduled_time is not None:
            self.queue_time.observe(stats.first_scheduled_time - stats.arrival_time)
            if stats.first_token_time is not None:
                self.prefill_time.observe(stats.first_token_time - stats.first_scheduled_time)
        if stats.first_token_time is not None:
            if stats.last_token_time is not None:
                self.decode_time.observe(stats.last_token_time - stats.first_token_time)
            if stats.num_generation_tokens > 1:
                ttft = stats.first_token_time - stats.arrival_time
                self.tpot.observe((e2e - ttft) / (stats.num_generation_tokens - 1))

    def on_request_rejected(self) -> None:
        self.failure["rejected"].inc()

    # --- utilisation ----------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    def utilization(self) -> tuple[float, float]:
        """(MFU, MBU) over the last ``window_s`` seconds (shorter right after start-up)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            busy = sum(d for _, d, _, _ in self._recent)
            flops = sum(f for _, _, f, _ in self._recent)
            moved = sum(b for _, _, _, b in self._recent)
        # Right after start-up the window is only as long as the observer has lived; never shorter
        # than the steps it holds (a step reported just inside the window began before it).
        wall = max(min(self.window_s, now - self._start), busy)
        if wall <= 0:
            return 0.0, 0.0
        mfu = flops / (wall * self.peak_flops) if self.peak_flops > 0 else 0.0
        mbu = moved / (wall * self.peak_bandwidth) if self.peak_bandwidth > 0 else 0.0
        return mfu, mbu


def render_metrics(registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The text exposition of ``registry`` (the global one when None) and its content type."""
    return generate_latest(registry if registry is not None else REGISTRY), CONTENT_TYPE_LATEST
