"""bench_overhead's CPU training job and its plain step loop, built without TraceML.

One model, optimizer and DataLoader serve every variant of a benchmark (separate but
identical model instances differ by several microseconds per small step and by up to
1 % per ~10 ms step here, as much as the figures measured). Two shapes are used:
hidden 64, batch 16 (about 0.35 ms) and hidden 960, batch 128 (about 10 ms).
Nothing here imports TraceML: bench_peers' workers build the same job under the
original TraceML and the other peers (`traced_steps` adds ours).
"""
from __future__ import annotations

import torch


class Batches:
    """next() over an iterable, restarting it at the end of each epoch (outside any step)."""

    def __init__(self, iterable) -> None:
        self._iterable = iterable
        self._it = iter(iterable)

    def next(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self._iterable)
            return next(self._it)


class Job:
    """One model/optimizer/loader, shared by every variant; each variant has its own iterator.

    `plain_batches` iterates the bare loader; `timed_batches`, TraceML's wrapped one, is
    set by `traced_steps.with_timed_loader` (None until then).
    """

    def __init__(self, hidden: int, batch: int, batches: int, features: int = 32) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-5)
        data = torch.utils.data.TensorDataset(torch.randn(batch * batches, features),
                                              torch.randn(batch * batches, 1))
        self.loader = torch.utils.data.DataLoader(data, batch_size=batch)
        self.plain_batches = Batches(self.loader)
        self.timed_batches: Batches | None = None


def block_plain(job: Job, steps: int, clock, out: list) -> None:
    """`steps` uninstrumented steps, each timed by `clock` (the difference of two readings)."""
    model, opt, next_batch = job.model, job.opt, job.plain_batches.next
    for _ in range(steps):
        t0 = clock()
        x, y = next_batch()
        x = x.to("cpu")
        out_ = model(x)  # bound to a name, as in the manual loop (it lives until the next step)
        loss = torch.nn.functional.mse_loss(out_, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)
