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
