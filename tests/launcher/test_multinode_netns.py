"""One processor per job across nodes: two "nodes" on this machine, one summary of all ranks.

Two network namespaces joined by a veth pair stand for two hosts (10.77.0.1 and
10.77.0.2, each with its own loopback). Each runs the real `traceml run --nnodes 2
--node-rank K --nproc-per-node 1` with a c10d rendezvous hosted by node 0
(`--rdzv-endpoint 10.77.0.1:PORT`, `is_host` in `--rdzv-conf`: inside a namespace
torch's hostname test cannot tell which node owns the address), with the
processor's bearer token given to both nodes (`--processor-token-file`: the
ranks send it, the processor requires it, so a rank without it would lose its
steps and the summary would miss it); `--local-addr`
gives c10d's rank order (sorted node addresses), so node 1 holds global rank 1,
whose input pipeline straggles. Node 1 starts first, as it may on a cluster.
The one summary, on node 0, must name rank 1 and hold both ranks; node 1
starts no processor and writes no run folder. The processor's automatic deep
capture of rank 1 must reach node 1 (its ranks poll the OTLP/HTTP port derived
from `--processor-port`, +1, on the rendezvous host) and end with a digest: the
loop runs until rank 0 sees that capture ended (`--until-capture`, at most
`MAX_UPDATES`), a few seconds more than the 30 updates it ran before. No rank's
output carries kineto's `USDT:` lines (TraceML sets KINETO_LOG_LEVEL).

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2
(scripts/install-system-deps.sh); skipped, with the reason, otherwise. The
namespaces and the veth are named after this process's pid, so parallel runs do
not collide, and are deleted in `finally` with every process left in them.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from harness.child_python import child_env
from tests.launcher.launcher_helpers import SCRIPTS, TRACEML, clean_env
from traceml.launcher import multinode

NODE_ADDRESSES = ("10.77.0.1", "10.77.0.2")
RDZV_PORT = 29400
RUN_TIMEOUT_S = 240
MAX_UPDATES = 1500  # a bound: the loop stops once the capture ended (a few hundred updates here)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


class TwoNodes:
    """Two namespaces `tml<pid>n0`/`n1` joined by the veth pair `tv<pid>n0`/`n1`."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}"
        self.namespaces = (f"tml{tag}n0", f"tml{tag}n1")
        self.veths = (f"tv{tag}n0", f"tv{tag}n1")  # interface names stay within 15 characters

    def create(self) -> str | None:
        """None when ready, else why the namespaces cannot be made here."""
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed (scripts/install-system-deps.sh)"
        made = _ip("netns", "add", self.namespaces[0])
        if made.returncode != 0:
            return f"cannot create a network namespace (needs root/CAP_SYS_ADMIN): {made.stderr.strip()}"
        steps = [("netns", "add", self.namespaces[1]),
                 ("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])]
        for ns, veth, address in zip(self.namespaces, self.veths, NODE_ADDRESSES):
            steps += [("link", "set", veth, "netns", ns),
                      ("-n", ns, "addr", "add", f"{address}/24", "dev", veth),
                      ("-n", ns, "link", "set", veth, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                return f"`ip {' '.join(step)}` failed: {done.stderr.strip()}"
        return None

    def destroy(self) -> None:
        for ns in self.namespaces:
            pids = _ip("netns", "pids", ns)
            for pid in pids.stdout.split() if pids.returncode == 0 else ():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # only what this test started lives in its namespace
                except (ProcessLookupError, ValueError):
                    pass
        for ns in self.namespaces:
            _ip("netns", "del", ns)
        _ip("link", "del", self.veths[0])  # gone with its namespace already, unless moving it failed


def _node_command(nodes: TwoNodes, node: int, rdzv_id: str, token_file) -> list[str]:
    return ["ip", "netns", "exec", nodes.namespaces[node], str(TRACEML), "run",
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{NODE_ADDRESSES[0]}:{RDZV_PORT}",
            "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
            "--local-addr", NODE_ADDRESSES[node], "--no-summary-print",
            "--processor-token-file", str(token_file),
            str(SCRIPTS / "plain_loop.py"), "--updates", str(MAX_UPDATES), "--until-capture",
            "--straggler-rank", "1", "--delay-ms", "25"]


@pytest.mark.slow
def test_two_nodes_share_one_processor_and_the_straggler_on_node_1_is_named(tmp_path):
    nodes = TwoNodes()
    procs: list[subprocess.Popen] = []
    try:
        reason = nodes.create()
        if reason is not None:
            print(f"skipped: {reason}")
            pytest.skip(reason)
        rdzv_id = f"netns-{os.getpid()}-{int(time.time())}"
        token_file = tmp_path / "token"  # one file standing for the same secret on each node
        token_file.write_text(f"tok-{os.getpid()}-{time.time_ns()}\n")
        outputs = []
        for node in (1, 0):  # node 1 first: the job must not depend on node 0 starting first
            cwd = tmp_path / f"node{node}"
            cwd.mkdir()
            env = clean_env(GLOO_SOCKET_IFNAME=nodes.veths[node], TRACEML_EXIT_AFTER_FLUSH="1",
                            NO_PROXY=",".join(NODE_ADDRESSES), no_proxy=",".join(NODE_ADDRESSES),
                            PYTHONPATH=child_env()["PYTHONPATH"])  # --until-capture's harness.capture_watch
            procs.append(subprocess.Popen(_node_command(nodes, node, rdzv_id, token_file), cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
            if node == 1:
                time.sleep(1.0)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
        node1_out, node0_out = outputs
        both = f"--- node 0 ---\n{node0_out[-4000:]}\n--- node 1 ---\n{node1_out[-4000:]}"
        assert [p.returncode for p in procs] == [0, 0], both

        assert "no processor on this node" in node1_out, both
        assert f"job's processor on {NODE_ADDRESSES[0]}:" in node1_out, both
        assert "the summary of all ranks is written on that node" in node1_out, both
        assert re.search(r"^rank 1: \d+ updates", node1_out, re.M), both  # the straggler ran on node 1
        control = f"http://{NODE_ADDRESSES[0]}:{multinode.control_port_of(multinode.DEFAULT_PROCESSOR_PORT)}"
        assert f"poll {control} for deep-capture requests" in node0_out, both
        assert "USDT" not in node0_out + node1_out, both  # kineto's profiler_start/stop lines
        assert not (tmp_path / "node1" / "traceml_runs").exists(), both  # node 1 started no processor
        assert "every node's ranks export to it" in node0_out, both
        assert "without a bearer token" not in node0_out, both

        run_dirs = list((tmp_path / "node0" / "traceml_runs").iterdir())
        assert len(run_dirs) == 1, (run_dirs, both)
        import json

        summary = json.loads((run_dirs[0] / "final_summary.json").read_text())
        endings = summary["telemetry"]["rank_endings"]
        assert sorted(endings) == ["0", "1"], (endings, both)
        assert {e["outcome"] for e in endings.values()} == {"finished"}, endings
        diagnosis = summary["diagnosis"]
        assert diagnosis["kind"] == "INPUT_STRAGGLER", (diagnosis, both)
        assert diagnosis["culprit_rank"] == 1, (diagnosis, both)
        # The automatic capture of the culprit on node 1 reached it and came back with a digest.
        auto = [c for c in summary["captures"] if c["trigger"] != "manual"]
        assert len(auto) == 1, (summary["captures"], both)
        capture = auto[0]
        assert (capture["status"], capture["culprit_rank"], capture["reference_rank"]) == ("done", 1, 0), \
            (capture, both)
        assert capture["digest"]["rows"] and len(capture["traces"]) == 2, capture
        for name in capture["traces"]:  # moved beside the summary on node 0
            assert (run_dirs[0] / name).is_file(), (name, list(run_dirs[0].iterdir()))
        updates = re.search(r"^rank 1: (\d+) updates", node1_out, re.M).group(1)
        print(f"\n[figure] two nodes: {updates} updates until the capture of rank 1 ended")
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        nodes.destroy()
