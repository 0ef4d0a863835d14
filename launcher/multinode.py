"""Where a multi-node job's one embedded processor runs, and how every node reaches it.

Without `--endpoint`, all ranks of a job must reach one processor, or no
straggler across nodes can be found. The processor runs on the node that hosts
the job's rendezvous store, decided by torch's own rule for that store, so no
node needs to hear from another before its ranks start:

- c10d: the node that hosts the TCPStore at `--rdzv-endpoint`: `is_host` in
  `--rdzv-conf` when given, else torch's `_matches_machine_hostname` test on the
  endpoint's host (the very test torch's c10d backend runs). Group ranks are not
  a guide: c10d assigns them at rendezvous (sorted by `--local-addr`/FQDN and
  pid, `--node-rank` ignored), after the launcher must already know.
- static: `--node-rank 0`, which hosts the store at `--master-addr` (or the
  `--rdzv-endpoint` host).
- other backends (etcd): no node is known to hold the endpoint, so each node
  keeps its own processor (a warning says so).

The address is derived, not published: the endpoint's host and
`--processor-port` (default `DEFAULT_PROCESSOR_PORT`) for OTLP gRPC, and the next
port for its OTLP/HTTP (`CONTROL_PORT_OFFSET`), which every node's ranks poll for
deep-capture requests and upload captures to. Every node computes both from
its own arguments, and no rank of any node starts before the rendezvous
completes, which needs the host's agent, which `traceml run` starts only once
the processor answers `/readyz`: a late host delays everyone exactly as torchrun
does, and nobody waits on a second channel with its own timeout.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

DEFAULT_PROCESSOR_PORT = 29317  # torchrun's 29xxx range, "317" for OTLP's 4317 (taken by node collectors)
C10D_DEFAULT_PORT = 29400  # torch's own default for a c10d endpoint without a port
# OTLP/HTTP (capture control, uploads) = --processor-port + 1: derived like the gRPC port, so a rank
# on any node can be asked for a capture with nothing published between nodes.
CONTROL_PORT_OFFSET = 1


@dataclass(frozen=True, slots=True)
class ProcessorPlacement:
    """The job's processor: on this node or not, and the address every node's ranks export to."""

    hosts_here: bool
    host: str  # the rendezvous host as the nodes name it
    port: int
    why: str  # for the log line: which rule chose the host
    # OTLP/HTTP of the job's processor (captures); None: the host's is taken, the processor keeps
    # a loopback one and other nodes' ranks cannot be asked for captures.
    control_port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{format_host(self.host)}:{self.port}"

    @property
    def control_url(self) -> str | None:
        """The base URL every node's ranks poll for capture requests (`TRACEML_CONTROL_ENDPOINT`)."""
        if self.control_port is None:
            return None
        return f"http://{format_host(self.host)}:{self.control_port}"

    @property
    def address(self) -> str:
        return f"{format_host(self.host)}:{self.port}"


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def placement_of(args: argparse.Namespace, processor_port: int) -> ProcessorPlacement | None:
    """The placement for torchrun's parsed `args`; None: one node, or no shared host known."""
    from torch.distributed.run import get_rdzv_endpoint

    backend = str(args.rdzv_backend)
    endpoint = get_rdzv_endpoint(args)
    control_port = control_port_of(processor_port)
    if backend == "static":
        host = _endpoint_host(args.rdzv_endpoint, 29500) if args.rdzv_endpoint else str(args.master_addr)
        return ProcessorPlacement(int(args.node_rank) == 0, host, processor_port,
                                  "static rendezvous: --node-rank 0 hosts the store", control_port)
    if backend == "c10d" and endpoint:
        host = _endpoint_host(endpoint, C10D_DEFAULT_PORT)
        is_host, why = _hosts_c10d_store(args, endpoint, host)
        return ProcessorPlacement(is_host, host, processor_port, why, control_port)
    return None


def control_port_of(processor_port: int) -> int:
    """The job's processor's OTLP/HTTP port, derived from `--processor-port` on every node."""
    return processor_port + CONTROL_PORT_OFFSET


def _endpoint_host(endpoint: str, default_port: int) -> str:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, _ = parse_rendezvous_endpoint(endpoint, default_port=default_port)
    return host


def _hosts_c10d_store(args: argparse.Namespace, endpoint: str, host: str) -> tuple[bool, str]:
    """torch's c10d backend's own decision (`c10d_rendezvous_backend._create_tcp_store`)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, _parse_rendezvous_config

    params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=str(args.rdzv_id),
                                  min_nodes=1, max_nodes=1, **_parse_rendezvous_config(args.rdzv_conf))
    configured = params.get_as_bool("is_host")
    if configured is not None:
        return configured, "c10d rendezvous: is_host in --rdzv-conf"
    return _matches_machine_hostname(host), "c10d rendezvous: the --rdzv-endpoint host hosts the store"


def bind_host_for(host: str) -> str:
    """Where the host node's processor listens: the rendezvous host's own address when it is
    one of this machine's (only that interface is exposed), else every interface."""
    try:
        ipaddress.ip_address(host)
        candidates = [host]
    except ValueError:
        try:
            candidates = [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
        except (OSError, UnicodeError):
            candidates = []
    for address in sorted(dict.fromkeys(candidates), key=lambda a: ":" in a):  # IPv4 first, as clients try
        if _can_bind(address, 0) is None:
            return address
    return "::" if candidates and all(":" in a for a in candidates) else "0.0.0.0"


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on (host, port): another launcher of this job on the
    same machine (several "nodes" on one host), or a stranger; never a wrong guess for a free port."""
    return _can_bind(host, port) == errno.EADDRINUSE


def _can_bind(host: str, port: int) -> int | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what a server binding it sets
            sock.bind((host, port))
    except OSError as exc:
        return exc.errno or -1
    return None


def bearer_header(token_file: str | Path) -> str:
    """`TRACEML_OTLP_HEADERS` for the ranks (no SDK of the job reads it, so the token goes to the job's
    processor only): the token read with the processor's own reader."""
    from traceml.processor.api import read_token_file

    return "authorization=" + quote("Bearer " + read_token_file(token_file), safe="")
