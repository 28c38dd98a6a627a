"""Settings of the servers: the router's flags come from RouterConfig's fields (one definition of
each name, default and help): `tandem serve router` parses them into the config, and `tandem up`
takes the same ones but worker discovery and passes them on to its router; a worker bound to a
wildcard advertises a host its peers reach."""

from __future__ import annotations

import pytest

from tandem.cli.flags import router_argv, router_settings
from tandem.cli.main import _parser
from tandem.router.config import RouterConfig


def test_router_flags_reach_the_config_and_tandem_up_passes_them_on():
    args = _parser().parse_args(
        [
            "serve",
            "router",
            "--workers",
            "10.0.0.1:50052, 10.0.0.2:50052",
            "--routing",
            "prefill=kv,decode=least-load",
            "--health-interval",
            "2.5",
            "--max-in-flight",
            "7",
        ]
    )
    config = RouterConfig(**router_settings(args))
    assert config.workers == ("10.0.0.1:50052", "10.0.0.2:50052")
    assert config.routing == "prefill=kv,decode=least-load"
    assert (config.health_interval_s, config.max_in_flight) == (2.5, 7)
    assert config.stream_progress_timeout_s == RouterConfig.stream_progress_timeout_s

    up = _parser().parse_args(["up", "--routing", "round-robin", "--stream-interval", "4"])
    argv = router_argv(up)
    # Every setting, defaults too (the launcher's own faster health polls must not win).
    assert argv[argv.index("--health-interval") + 1] == "1.0"
    served = router_settings(_parser().parse_args(["serve", "router", "--workers", "a:1", *argv]))
    assert (served["routing"], served["stream_interval"]) == ("round-robin", 4)
    assert served == {**router_settings(args), "workers": ("a:1",), "routing": "round-robin"} | {
        "stream_interval": 4,
        "health_interval_s": 1.0,
        "max_in_flight": 4096,
    }
    with pytest.raises(SystemExit):  # tandem up wires its own workers
        _parser().parse_args(["up", "--workers", "a:1"])


def test_a_bad_router_setting_is_refused_with_its_name():
    settings = router_settings(_parser().parse_args(["serve", "router", "--workers", "a:1"]))
    for name, bad in [("routing", "fastest"), ("max_in_flight", 0), ("stream_interval", 257)]:
        with pytest.raises(ValueError, match=name if name != "routing" else "fastest"):
            RouterConfig(**{**settings, name: bad})


def test_a_worker_bound_to_a_wildcard_advertises_a_reachable_host(monkeypatch):
    """A prefill names itself in its handoffs: bound to 0.0.0.0 (the chart's pods) it must name a
    host a decode on another node reaches (tests/containers/test_chart_pods.py pulls across two
    network namespaces), never the wildcard; an explicit --advertise-host wins."""
    import socket

    from tandem.common.server import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "decode-0.tandem.ns.svc") == "decode-0.tandem.ns.svc"
    monkeypatch.setattr(socket, "getfqdn", lambda: "llm-prefill-0.llm-prefill.ns.svc.cluster.local")
    assert advertised_host("0.0.0.0") == "llm-prefill-0.llm-prefill.ns.svc.cluster.local"
    monkeypatch.setattr(socket, "getfqdn", lambda: "c0ffee")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.1.2.3")
    assert advertised_host("::") == "10.1.2.3"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    assert advertised_host("0.0.0.0") not in ("0.0.0.0", "127.0.1.1", "")


def test_tandem_up_prefix_pulls_reach_the_router_and_the_workers_that_run_prompts(
    monkeypatch, model_dirs
):
    """`tandem up --prefix-pulls`: the router gets the flag (with its cost model's), and every
    prefill and both worker --kv-prefix-pulls (a decode runs no prompt from its start)."""
    from tandem.cli import up as up_module
    from tandem.engine.config import EngineConfig

    started = {}

    class Started(Exception):
        pass

    def fake_cluster(**kwargs):
        started.update(kwargs)
        raise Started

    monkeypatch.setattr(up_module, "LocalCluster", fake_cluster)
    args = _parser().parse_args(
        ["up", "--prefill", "2", "--decode", "1", "--both", "1", "--prefix-pulls"]
    )
    with pytest.raises(Started):
        up_module.up(args, EngineConfig(model_dir=str(model_dirs["llama"])))
    assert "--prefix-pulls" in started["router_args"]
    pulling = {
        name for name, extra in started["worker_args"].items() if "--kv-prefix-pulls" in extra
    }
    assert pulling == {"prefill-1", "prefill-2", "both-1"}
