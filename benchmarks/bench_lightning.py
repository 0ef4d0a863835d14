"""Cost of the Lightning integration inside real `Trainer.fit` runs.

Alternates fits of the same tiny module without TraceML and with TraceML as
`traceml run` sets it up (auto mode + automatic Lightning attach), and times the
training epoch only (a clock callback present in both arms, so set-up and
teardown are excluded). Prints the per-batch cost of each arm, the added cost per
batch and the throughput ratio (traced / plain). Run:

    .venv/bin/python -m benchmarks.bench_lightning [--device cpu|cuda] [--batches N] [--trials K] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

from benchmarks.lib.json_output import add_json_flag, print_json, table_output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--mode", default="auto", choices=("auto", "manual"),
                        help="traceml.init mode of the traced arm (auto = what traceml run does)")
    parser.add_argument("--profile", type=int, default=0,
                        help="instead: cProfile one traced fit, print the top N functions")
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = _measure(args)
    if args.json and figures is not None:
        print_json("bench_lightning", args, figures)


def _measure(args) -> dict | None:
    warnings.filterwarnings("ignore")

    import lightning.pytorch as pl
    import torch

    import traceml
    from traceml.integrations import lightning as tl

    width = args.width

    class Clock(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            if module.device.type == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            if module.device.type == "cuda":
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0

    class Mlp(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                           torch.nn.Linear(width, width), torch.nn.ReLU(),
                                           torch.nn.Linear(width, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    x = torch.randn(args.batches * 32, width)
    data = torch.utils.data.TensorDataset(x, x[:, :1].clone())

    def one_fit() -> float:
        clock = Clock()
        trainer = pl.Trainer(accelerator=args.device, devices=1, max_epochs=1,
                             accumulate_grad_batches=args.accumulate, callbacks=[clock],
                             enable_progress_bar=False, logger=False, enable_checkpointing=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(Mlp(), torch.utils.data.DataLoader(data, batch_size=32))
        return clock.seconds / args.batches

    one_fit()  # warm-up: imports, allocator, kernels
    if args.profile:
        import cProfile
        import pstats

        traceml.init(mode=args.mode)
        tl.auto_attach()
        profiler = cProfile.Profile()
        profiler.enable()
        one_fit()
        profiler.disable()
        tl.remove_auto_attach()
        traceml.shutdown()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        return None
    plain, traced = [], []
    for _ in range(args.trials):
        plain.append(one_fit())
        traceml.init(mode=args.mode)
        tl.auto_attach()
        before = traceml.steps_completed()
        traced.append(one_fit())
        steps = traceml.steps_completed() - before
        tl.remove_auto_attach()
        traceml.shutdown()
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"device={args.device} mode={args.mode} batches={args.batches} accumulate={args.accumulate} "
          f"trials={args.trials} (medians)")
    print(f"plain   {p * 1e3:8.3f} ms/batch")
    print(f"traced  {t * 1e3:8.3f} ms/batch  ({steps} TraceML steps in the last traced fit)")
    print(f"added   {(t - p) * 1e6:8.1f} us/batch")
    print(f"throughput ratio traced/plain = {p / t:.3f}")
    return {"plain_ms_per_batch": p * 1e3, "traced_ms_per_batch": t * 1e3,
            "added_us_per_batch": (t - p) * 1e6, "throughput_ratio": p / t, "traceml_steps": steps}


if __name__ == "__main__":
    main()
