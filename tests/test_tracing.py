"""OpenTelemetry traces (issue 35, --otlp-traces-endpoint): a split request sent with a W3C
traceparent leaves, at the test's own OTLP/HTTP receiver, the router's span (a child of the
client's), the prefill's and the decode's (children of the router's) and the KV pull's (a child
of the decode's), all under the client's trace id. Real processes; tracing off by default."""

from __future__ import annotations

import http.server
import secrets
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tandem.client import LLM, SamplingParams
from tandem.common import tracing
from tandem.testing.cluster import LocalCluster, free_port


class _Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP (protobuf) trace receiver: every span it is sent, with its service."""

    def __init__(self):
        self.spans: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 - the handler's self
                body = handler.rfile.read(int(handler.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    )
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            self.spans.append(
                                dict(
                                    name=span.name,
                                    service=service,
                                    trace_id=span.trace_id.hex(),
                                    span_id=span.span_id.hex(),
                                    parent=span.parent_span_id.hex(),
                                )
                            )
                handler.send_response(200)
                handler.send_header("Content-Type", "application/x-protobuf")
                handler.end_headers()
                handler.wfile.write(
                    trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                )

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)


def _spans(receiver: _Receiver, trace_id: str, want: set[str]) -> dict[str, dict]:
    """The trace's spans by name, once every wanted one reached the receiver (20 s at most)."""
    deadline = time.monotonic() + 20
    while True:
        spans = {s["name"]: s for s in receiver.spans if s["trace_id"] == trace_id}
        if want <= set(spans) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert want <= set(spans), spans
    return spans


@pytest.fixture(scope="module")
def receiver():
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_a_split_request_is_one_trace_of_router_prefill_pull_and_decode(model_dirs, receiver):
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--block-size", "8"],
        env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    ) as cluster:
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        with LLM(cluster.address) as llm:
            out = llm.generate_async(
                [1] + list(range(4, 40)),
                SamplingParams(max_tokens=4, ignore_eos=True),
                trace_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
            ).result()
        assert len(out.outputs[0].token_ids) == 4
        spans = _spans(
            receiver,
            trace_id,
            {"tandem.router.generate", "tandem.prefill", "tandem.kv_pull", "tandem.decode"},
        )
    router, prefill = spans["tandem.router.generate"], spans["tandem.prefill"]
    decode, pull = spans["tandem.decode"], spans["tandem.kv_pull"]
    assert router["parent"] == client_span and router["service"] == "tandem-router"
    assert prefill["parent"] == decode["parent"] == router["span_id"]
    assert (prefill["service"], decode["service"]) == ("tandem-prefill", "tandem-decode")
    assert pull["parent"] == decode["span_id"]


def test_the_openai_front_traces_between_its_client_and_the_router(model_dirs, receiver, tmp_path):
    """An HTTP client's traceparent: the front's span is its child and the router's span the
    front's (one trace from the HTTP request to the workers)."""
    from test_openai import openai_front

    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    with (
        LocalCluster(
            roles=["both"],
            engine_args=["--model", str(model_dirs["llama"]), "--block-size", "8"],
            env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        ) as cluster,
        openai_front(cluster, tmp_path / "front.log", "--otlp-traces-endpoint", endpoint) as (
            base,
            _,
        ),
    ):
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(
            f"{base}/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 3},
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        spans = _spans(
            receiver,
            trace_id,
            {"tandem.openai /v1/completions", "tandem.router.generate", "tandem.generate"},
        )
    front, router = spans["tandem.openai /v1/completions"], spans["tandem.router.generate"]
    assert front["parent"] == client_span and front["service"] == "tandem-openai"
    assert router["parent"] == front["span_id"]


def test_a_bad_endpoint_is_refused_and_tracing_is_off_without_one():
    with pytest.raises(ValueError, match="give the collector's OTLP/HTTP URL"):
        tracing.configure("otel-collector:4318", "t")
    assert not tracing.enabled()
    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    with tracing.span("nothing", headers):
        pass
    assert headers == {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
