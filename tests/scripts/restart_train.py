"""Train a tiny model for a few steps, checkpointing every step; resume from the checkpoint if one exists.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/scripts/restart_train.py OUT_DIR --steps 40 --kill-at 20
    python -m minidp.run --nproc-per-node 2 --max-restarts 1 tests/scripts/restart_train.py OUT_DIR ...

With --kill-at S, rank 1 SIGKILLs itself at step S on the first attempt only (TORCHELASTIC_RESTART_COUNT
0), so the launcher restarts the workers and they resume from the last checkpoint. Rank 0 writes the
final weights to OUT_DIR/final.pt; tests/test_restarts.py compares them with an uninterrupted run of
the same `build` and `train_step` (in ranks of its own, without checkpoints or a launcher).
"""
import argparse
import os
import signal

import torch

import minidp


def build():
    """The model and optimizer every attempt (and the uninterrupted reference) starts from."""
    torch.manual_seed(0)
    model = minidp.DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model, opt, step: int, rank: int) -> None:
    """One step on this rank's batch of `step` (a batch depends only on both: a resumed run sees the same)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    env = minidp.init(timeout=30)
    model, opt = build()
    path = os.path.join(args.out_dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        start = minidp.load_checkpoint(path, model, opt)["step"]
    print(f"attempt {attempt} rank {env.rank} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        if step == args.kill_at and attempt == 0 and env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: no exception, no clean-up
        train_step(model, opt, step, env.rank)
        minidp.save_checkpoint(path, model, opt, step=step + 1)
    if env.rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out_dir, "final.pt"))
    print(f"attempt {attempt} rank {env.rank} done", flush=True)
    minidp.shutdown()


if __name__ == "__main__":
    main()
