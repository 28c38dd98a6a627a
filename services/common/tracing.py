"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one span per request on the
router, one per phase on the workers (the prefill's context phase, the decode's generation) and
one per KV pull, all under the trace the client's W3C `traceparent` names (`trace_headers`,
TensorRT-LLM's and vLLM's way in); exported over OTLP/HTTP to a collector.

Off (the default), every call here is a no-op and OpenTelemetry is not imported: the CPU cost
and the dependency are only for those who ask. On, the router hands each worker the traceparent
of its own span in the request's trace_headers, so the workers' spans are its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, MutableMapping

log = logging.getLogger("tandem.tracing")

# OpenTelemetry's own variable for the endpoint: the default of --otlp-traces-endpoint.
TRACES_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
# The OpenTelemetry tracer once configure() ran with an endpoint; None: tracing is off.
_tracer = None


def configure(endpoint: str | None, service_name: str, check_only: bool = False) -> None:
    """Sends this process's spans to endpoint (an OTLP/HTTP collector: http://host:4318, or its
    full /v1/traces URL) as service_name; None or "": tracing stays off. check_only: refuse a
    bad endpoint, send nothing (a launcher whose children trace)."""
    global _tracer
    if not endpoint:
        return
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"--otlp-traces-endpoint {endpoint!r}: give the collector's OTLP/HTTP URL, e.g. "
            "http://otel-collector:4318"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(
            "--otlp-traces-endpoint needs OpenTelemetry: pip install opentelemetry-sdk "
            "opentelemetry-exporter-otlp-proto-http"
        ) from exc
    url = (
        endpoint
        if endpoint.rstrip("/").endswith("/v1/traces")
        else endpoint.rstrip("/") + "/v1/traces"
    )
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _tracer = provider.get_tracer("tandem")
    log.info("traces to %s as %s", url, service_name)


def enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def span(name: str, headers: MutableMapping[str, str] | None, **attributes) -> Iterator[None]:
    """A span named name around the block, the child of the traceparent in headers (a new trace
    without one); headers then carry this span's traceparent for the calls made under it. Not
    made the current span: a request's spans live across the yields of generators, where a
    context attached in one step would be detached in another. With tracing off, nothing."""
    if _tracer is None:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.propagate import extract, inject

    parent = extract(dict(headers)) if headers else None
    current = _tracer.start_span(
        name, context=parent, attributes={k: v for k, v in attributes.items() if v is not None}
    )
    if headers is not None:
        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(current))
        for key, value in carrier.items():
            headers[key] = value
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        current.set_attribute("tandem.cancelled", True)
        raise
    except BaseException as exc:
        current.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        current.end()
