"""Which node runs a multi-node job's processor, from torchrun's own arguments (no process started).

The rule (launcher/multinode.py): c10d -> the node hosting the TCPStore at
--rdzv-endpoint (is_host in --rdzv-conf, else torch's hostname test); static ->
--node-rank 0; etcd -> none known (each node keeps its own processor).
"""
from __future__ import annotations

import socket

import pytest

from traceml.launcher import multinode
from traceml.launcher.run import launch, parse


def _placement(*argv: str):
    args, options = parse([*argv, "train.py"])
    return multinode.placement_of(args, options.processor_port)


def test_static_rendezvous_puts_the_processor_on_node_rank_0_at_the_master_address():
    host = _placement("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.2.3")
    other = _placement("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3")
    assert (host.hosts_here, host.endpoint) == (True, "http://10.1.2.3:29317")
    assert (other.hosts_here, other.endpoint) == (False, "http://10.1.2.3:29317")


def test_c10d_follows_torchs_store_host_rule_and_the_processor_port():
    common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.77.0.1:29400",
              "--processor-port", "31000")
    assert _placement(*common).hosts_here is False  # 10.77.0.1 is not this machine
    chosen = _placement(*common, "--rdzv-conf", "is_host=1")
    assert (chosen.hosts_here, chosen.address) == (True, "10.77.0.1:31000")
    assert _placement("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost").hosts_here
    assert _placement(*common, "--rdzv-conf", "is_host=false").hosts_here is False


def test_ipv6_hosts_are_bracketed_and_etcd_has_no_placement():
    v6 = _placement("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[fd00::1]:29400")
    assert v6.endpoint == "http://[fd00::1]:29317"
    assert _placement("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd:2379") is None


def test_a_taken_port_is_seen_and_a_local_address_is_bound_rather_than_every_interface():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert multinode.port_taken("127.0.0.1", listener.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert not multinode.port_taken("127.0.0.1", free)
    assert multinode.bind_host_for("127.0.0.1") == "127.0.0.1"
    assert multinode.bind_host_for("192.0.2.77") == "0.0.0.0"  # TEST-NET-1: not this machine's


def test_the_token_goes_to_the_ranks_percent_encoded_and_an_empty_file_stops_the_launch(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cr,et=x\n")
    assert multinode.bearer_header(token) == "authorization=Bearer%20s3cr%2Cet%3Dx"
    from traceml.schema.otlp_headers import parse_otlp_headers

    assert parse_otlp_headers(multinode.bearer_header(token)) == (("authorization", "Bearer s3cr,et=x"),)
    token.write_text("  \n")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    args, options = parse(["--nnodes", "2", "--node-rank", "1", "--processor-token-file", str(token),
                           str(script)])
    result = launch(args, options)
    assert result.exit_code == 2 and result.run_dir is None
    assert "is empty" in capsys.readouterr().out


def test_the_processor_port_is_checked():
    with pytest.raises(SystemExit):
        parse(["--processor-port", "0", "train.py"])


def test_the_control_address_is_derived_from_the_processor_port_on_every_node():
    """Deep captures: every node's ranks poll the job's processor's OTLP/HTTP at --processor-port + 1."""
    host = _placement("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.2.3")
    other = _placement("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3")
    assert host.control_url == other.control_url == "http://10.1.2.3:29318"
    c10d = _placement("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[fd00::1]:29400",
                      "--processor-port", "31000")
    assert (c10d.control_port, c10d.control_url) == (31001, "http://[fd00::1]:31001")
    parse(["--processor-port", "65534", "train.py"])
    with pytest.raises(SystemExit):  # its OTLP/HTTP port would be 65536
        parse(["--processor-port", "65535", "train.py"])


def _free_pair() -> tuple[int, socket.socket]:
    """A free loopback port P whose next port P + 1 is held by the returned listener."""
    for _ in range(50):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1] - 1
        if 0 < port and not multinode.port_taken("127.0.0.1", port):
            return port, listener
        listener.close()
    pytest.skip("no free port below a free one")


def _host_args(port: int):
    return parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
                  "--rdzv-conf", "is_host=1", "--processor-port", str(port), "train.py"])


def test_a_taken_control_port_on_the_host_keeps_the_processor_but_loses_other_nodes_captures():
    import io

    from traceml.launcher import run

    port, listener = _free_pair()
    with listener:
        out = io.StringIO()
        placement = run._placement(*_host_args(port), out)
        # A stranger holds P + 1 (another launcher of this job would hold P too): this node still
        # hosts the processor, whose OTLP/HTTP stays on a free loopback port.
        assert placement.hosts_here and placement.control_port is None and placement.control_url is None
        assert f"port {port + 1} on 127.0.0.1 (--processor-port + 1" in out.getvalue()
    with socket.socket() as grpc:  # P taken: another launcher of the job; its P + 1 is the control port
        grpc.bind(("127.0.0.1", port))
        grpc.listen()
        placement = run._placement(*_host_args(port), io.StringIO())
        assert not placement.hosts_here and placement.control_url == f"http://127.0.0.1:{port + 1}"


def test_the_ranks_of_every_node_get_the_control_endpoint_unless_the_user_set_it(monkeypatch):
    import io

    from traceml.launcher import run
    from traceml.launcher.embedded import EmbeddedProcessor, ProcessorEndpoints
    from traceml.schema import environment as env

    other = _placement("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3")
    options = parse(["train.py"])[1]
    monkeypatch.delenv(env.TRACEML_CONTROL_ENDPOINT, raising=False)
    rank_env: dict[str, str] = {}
    run._export_to_job_processor(other, options, rank_env, "r", io.StringIO())
    assert rank_env[env.TRACEML_CONTROL_ENDPOINT] == "http://10.1.2.3:29318"
    monkeypatch.setenv(env.TRACEML_CONTROL_ENDPOINT, "http://mine:4318")
    rank_env = {}
    run._export_to_job_processor(other, options, rank_env, "r", io.StringIO())
    assert env.TRACEML_CONTROL_ENDPOINT not in rank_env  # inherited as the user set it

    # The host node's processor: OTLP/HTTP bound beside gRPC (the node's address, not every
    # interface), the ranks given the name every node uses, readiness asked on this machine.
    host = ProcessorEndpoints(29317, 29318, grpc_host="10.1.2.3", http_host="10.1.2.3",
                              advertised_host="10.1.2.3")
    assert host.control_url == "http://10.1.2.3:29318" and host.ready_url == "http://10.1.2.3:29318/readyz"
    named = ProcessorEndpoints(29317, 29318, grpc_host="0.0.0.0", http_host="0.0.0.0",
                               advertised_host="head-node")
    assert named.control_url == "http://head-node:29318" and named.ready_url == "http://127.0.0.1:29318/readyz"
    command = EmbeddedProcessor(db_path="db", summary_dir=".", log_path="log").command(host)
    assert command[command.index("--otlp-http") + 1] == "10.1.2.3:29318"
    # One node: loopback, as before.
    single = ProcessorEndpoints(40000, 40001)
    assert single.control_url == "http://127.0.0.1:40001"
    assert ProcessorEndpoints(1, 2, http_host="::", advertised_host="fd00::1").ready_url == "http://[::1]:2/readyz"


def test_ranks_exporting_only_to_our_processor_send_no_phase_spans_unless_the_user_asks_and_one_node_uses_http(monkeypatch, tmp_path):
    """Phase child spans are for trace viewers; the embedded processor and the job's processor
    on another node only count and drop them, so those ranks are told not to send them, and a
    user's TRACEML_PHASE_SPANS (on or off) is left to the ranks as it is."""
    import io

    from traceml.launcher import run
    from traceml.launcher.embedded import EmbeddedProcessor, ProcessorEndpoints
    from traceml.schema import environment as env

    grpc_servers: list[bool] = []

    def start(self):
        grpc_servers.append(self.grpc)
        return ProcessorEndpoints(40000 if self.grpc else None, 40001)

    monkeypatch.setattr(EmbeddedProcessor, "start", start)
    args, options = parse(["train.py"])
    other = _placement("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3")

    def rank_envs():
        embedded: dict[str, str] = {}
        assert run._start_embedded(args, options, tmp_path / "run", embedded, "r", io.StringIO()) is not None
        remote: dict[str, str] = {}
        run._export_to_job_processor(other, options, remote, "r", io.StringIO())
        return embedded, remote

    monkeypatch.delenv(env.TRACEML_PHASE_SPANS, raising=False)
    embedded, remote = rank_envs()
    assert [e[env.TRACEML_PHASE_SPANS] for e in (embedded, remote)] == ["0", "0"]
    # One node: the ranks send OTLP/HTTP to the processor's loopback port, which runs no gRPC server.
    assert (embedded[env.TRACEML_OTLP_ENDPOINT], embedded[env.TRACEML_OTLP_PROTOCOL]) == \
        ("http://127.0.0.1:40001", "http/protobuf") and grpc_servers == [False]
    command = EmbeddedProcessor("db", ".", "log", grpc=False).command(ProcessorEndpoints(None, 1))
    assert command[command.index("--otlp-grpc") + 1] == "off"
    assert remote[env.TRACEML_OTLP_PROTOCOL] == "grpc"  # another node's ranks: the job's processor's gRPC
    for mine in ("1", "0"):
        monkeypatch.setenv(env.TRACEML_PHASE_SPANS, mine)
        assert [env.TRACEML_PHASE_SPANS in e for e in rank_envs()] == [False, False]  # inherited as set
