"""`make demo`: a real 2-process CPU training with minidp's runtime; rank 0 prints the loss.

(A placeholder main job until the full torchvision/DALI workflows land.)
"""
import torch
import torch.distributed as dist

import minidp


def train(local_rank: int, steps: int = 60) -> None:
    torch.set_num_threads(1)
    env = minidp.init()
    torch.manual_seed(0)  # same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    true_w = torch.randn(16, 1)
    gen = torch.Generator().manual_seed(1000 + env.rank)  # each rank draws its own data
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # average gradients over ranks
            dist.all_reduce(p.grad)  # ranks meet here
            p.grad /= env.world_size
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            minidp.print0(f"step {step:3d}  loss {loss.item():.4f}  (world size {env.world_size})")
    minidp.shutdown()


if __name__ == "__main__":
    minidp.launch(train, nprocs=2)
