"""OpenTelemetry traces of forwarded requests, exported over OTLP/HTTP (`tracing.otlp_endpoint`).

One span per request (`kvlb.request`, a child of the client's `traceparent` when it sends
one), with children for the routing decision (`kvlb.route`: the candidates, the chosen
replica, its predicted cached tokens and cost terms) and for each upstream attempt
(`kvlb.attempt`: the replica, its outcome, a `first_byte` event). Each attempt passes its own
`traceparent` to the replica, so an engine that exports spans (vLLM's and SGLang's
`--otlp-traces-endpoint`) hangs its work under the attempt that asked for it.

Off (no endpoint), nothing here is imported or called: the proxy checks for a trace object
and finds none. The SDK and its exporter are the `tracing` extra; spans are batched and sent
from the SDK's own thread, so a slow collector never holds a request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from balancer.config import TracingSettings
from balancer.wire.server import Request
from policies.base import Choice

TRACE_HEADERS = ("traceparent", "tracestate")
# Cost terms of the chosen replica carried as attributes, under this prefix.
TERM_PREFIX = "kvlb.term."


class Tracing:
    def __init__(self, settings: TracingSettings) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError("tracing.otlp_endpoint needs the tracing extra: pip install 'kvlb[tracing]'") from exc
        from opentelemetry import trace

        self._trace = trace
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=settings.otlp_endpoint),
            schedule_delay_millis=int(settings.export_interval_s * 1000),
        ))
        self.tracer = self.provider.get_tracer("kvlb")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, request: Request, route: str, request_id: str) -> RequestTrace:
        carrier = {name: value for name in TRACE_HEADERS if (value := request.header(name)) is not None}
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span("kvlb.request", context=parent, kind=self._trace.SpanKind.SERVER,
                                      attributes={"http.route": route, "kvlb.request_id": request_id})
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        self.provider.shutdown()  # sends what is still batched


class RequestTrace:
    """One request's spans."""

    __slots__ = ("_tracing", "span", "_context", "_attempt")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self._tracing = tracing
        self.span = span
        self._context = tracing._trace.set_span_in_context(span)
        self._attempt: Any = None

    def decision(self, model: str | None, candidates: int, ranking: Sequence[Choice]) -> None:
        attributes: dict[str, Any] = {"kvlb.model": model or "", "kvlb.candidates": candidates}
        if ranking:
            chosen = ranking[0]
            attributes["kvlb.chosen"] = chosen.replica.name
            for name, value in chosen.terms.items():
                attributes[TERM_PREFIX + name] = value
            attributes["kvlb.predicted_cached_tokens"] = chosen.terms.get("cached", 0.0)
        self._tracing.tracer.start_span("kvlb.route", context=self._context, attributes=attributes).end()

    def attempt(self, replica: str) -> list[tuple[str, str]]:
        """A new attempt on `replica`: its span, and the headers that carry it to the replica."""
        self._attempt = self._tracing.tracer.start_span(
            "kvlb.attempt", context=self._context, kind=self._tracing._trace.SpanKind.CLIENT,
            attributes={"kvlb.replica": replica})
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=self._tracing._trace.set_span_in_context(self._attempt))
        return list(carrier.items())

    def first_byte(self) -> None:
        if self._attempt is not None:
            self._attempt.add_event("first_byte")

    def attempt_ended(self, outcome: str) -> None:
        if self._attempt is not None:
            self._attempt.set_attribute("kvlb.outcome", outcome)
            self._attempt.end()
            self._attempt = None

    def end(self, status: int, attributes: Mapping[str, Any] | None = None) -> None:
        self.attempt_ended("abandoned")
        span = self.span
        span.set_attribute("http.response.status_code", status)
        for name, value in (attributes or {}).items():
            span.set_attribute(name, value)
        if status >= 500:
            span.set_status(self._tracing._trace.Status(self._tracing._trace.StatusCode.ERROR))
        span.end()
