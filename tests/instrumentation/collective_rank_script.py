"""One gloo rank of a collective-wait scenario (started by tests/instrumentation/test_collective_wait.py).

argv: scenario (explicit | ddp | user_hook | late_user_hook), output path. Each rank
writes, per step, the collective-wait totals its sampler published and the step's
`traceml.collective.last_entry` as the exporter computes it.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import traceml
from traceml.exporter.encoding import collective_last_entry
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_COLLECTIVE_WAIT

scenario, out_path = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
SLOW_RANK = world - 1
DELAY_S = 0.05
STEPS = 8


class Sink:
    def __init__(self):
        self.steps = []

    def on_step_time(self, record):
        wait = record.events.get(RAW_COLLECTIVE_WAIT)
        backward = record.events.get(RAW_BACKWARD)
        self.steps.append({"step": record.step,
                           "wait_ms": None if wait is None else wait.cpu_ms,
                           "wait_count": None if wait is None else wait.count,
                           "backward_ms": None if backward is None else backward.cpu_ms,
                           "last_entry_s": collective_last_entry(record)})

    def on_step_memory(self, record):
        pass


dist.init_process_group("gloo")
sink = Sink()
traceml.register_sink(sink)
traceml.init(mode="auto")
torch.manual_seed(0)
result = {"rank": rank}

if scenario == "explicit":
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(STEPS):
        with traceml.trace_step(model):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if rank == SLOW_RANK:
                time.sleep(DELAY_S)
            t = torch.ones(1)
            dist.all_reduce(t)                          # blocking: timed
            work = dist.all_reduce(torch.ones(1), async_op=True)
            work.wait()                                 # async: timed at wait()
            objs = [None] * world
            dist.all_gather_object(objs, rank)          # nested all_gather inside: counted once
    result["sum"] = float(t.item())
else:
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
        bucket_cap_mb=0.001)  # several buckets
    calls = []

    def user_hook(state, bucket):
        calls.append(bucket.index())
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    if scenario == "user_hook":
        model.register_comm_hook(None, user_hook)
    if rank == SLOW_RANK:
        first = model.module[0].weight  # its gradient is computed last: this rank's graph ends late

        def slow(grad):
            time.sleep(DELAY_S)
            return grad

        first.register_hook(slow)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(STEPS):
        if scenario == "late_user_hook" and i == 2:
            model.register_comm_hook(None, user_hook)  # after the first forward (DDP allows one hook)
        with traceml.trace_step(model):
            torch.manual_seed(100 + i * world + rank)
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    result["hook_calls"] = len(calls)
    result["param_sum"] = float(sum(p.detach().sum() for p in model.parameters()))

traceml.shutdown()
result["steps"] = sink.steps
result["misuse"] = traceml.misuse_counts()
dist.barrier()
with open(out_path, "w") as fh:
    json.dump(result, fh)
os._exit(0)  # see test_multiprocess_gloo.py: gloo teardown can abort on a loaded CPU
