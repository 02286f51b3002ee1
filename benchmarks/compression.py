"""The gradient-compression study: one model, world size 2, exact all-reduce against every minidp.comm method.

    python benchmarks/compression.py                        # full run on this machine (about 15 min on 2 cores)
    python benchmarks/compression.py --quick --out /tmp/c   # tiny sizes, seconds (the smoke test)
    python benchmarks/compression.py --configs exact,TopK+EF --epochs 2

Model and data: the width-16 ResNet-18 (CIFAR stem, 0.7 M parameters) on the synthetic 10-class set
of examples/common.py (1500 training, 500 validation images of 32x32), as `make demo` trains it:
4 epochs of 23 steps, 32 images per rank, SGD with momentum 0.9 and weight decay, lr 0.05 scaled to
0.1 by a one-epoch linear warm-up, then cosine. Every method starts after --start-iter exact steps
(local SGD: its warm-up). Per method: final training loss, validation loss and accuracy (rank 0's
weights; local SGD averages them first), bytes this rank handed to collectives per compressed step
(measured by the hook, and by the compressor's formula), and median step time over exact's.
Writes OUT/results/compression_<device>.json and .png, and the table into --results-md (between
markers, so the rest of the file is kept).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]  # gpu_check; common, train_torchvision

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_check import write_section  # noqa: E402 - the marker writer both scripts use

import common  # noqa: E402 - examples/ is not a package
import minidp  # noqa: E402
from minidp import comm  # noqa: E402

START_ITER, PERIOD = 10, 4
CONFIGS = {  # name: (compressor factory, error feedback); None: exact; "local": local SGD
    "exact": None,
    "FP16": (comm.FP16, False), "BF16": (comm.BF16, False),
    "TopK 1%": (lambda: comm.TopK(0.01), False), "TopK 1%+EF": (lambda: comm.TopK(0.01), True),
    "RandomK 1%": (lambda: comm.RandomK(0.01), False), "RandomK 1%+EF": (lambda: comm.RandomK(0.01), True),
    "QSGD 16": (lambda: comm.QSGD(16), False), "QSGD 16+EF": (lambda: comm.QSGD(16), True),
    "Sign": (comm.Sign, False), "Sign+EF": (comm.Sign, True),
    "PowerSGD 1": (lambda: comm.PowerSGD(1), False), "PowerSGD 1+EF": (lambda: comm.PowerSGD(1), True),
    "PowerSGD 4+EF": (lambda: comm.PowerSGD(4), True),
    f"local SGD /{PERIOD}": "local",
}
FULL = dict(train_per_class=150, val_per_class=50, image_size=32, width=16, batch_size=32, epochs=4)
QUICK = dict(train_per_class=4, val_per_class=2, image_size=16, width=4, batch_size=4, epochs=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"tiny sizes: {QUICK}, --start-iter 2")
    p.add_argument("--out", default=HERE, help="folder for results/ (default: benchmarks/)")
    p.add_argument("--results-md", default=None, help="markdown file for the table (default OUT/RESULTS.md; "
                   "'' to skip)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=common.positive, default=2, help="world size (default 2)")
    p.add_argument("--start-iter", type=int, default=None, help=f"exact steps before compression (default "
                   f"{START_ITER})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic-dir", default=None, help="where the synthetic set is written (default: temp dir)")
    p.add_argument("--from-json", default=None, help="comma-separated result JSONs of earlier runs (e.g. one per "
                   "subset of --configs, each with exact): merge them into the table and plot; run nothing")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=common.positive, default=None, help=f"default {value}")
    args = p.parse_args(argv)
    for name in FULL:
        if getattr(args, name) is None:
            setattr(args, name, (QUICK if args.quick else FULL)[name])
    args.start_iter = (2 if args.quick else START_ITER) if args.start_iter is None else args.start_iter
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if args.results_md is None:
        args.results_md = os.path.join(args.out, "RESULTS.md")
    return args


def load_data(args, device) -> dict:
    """The synthetic set as tensors (normalized, no augmentation: every method sees the same images)."""
    from train_torchvision import image_folders

    ns = argparse.Namespace(data=None, synthetic_dir=args.synthetic_dir, train_per_class=args.train_per_class,
                            val_per_class=args.val_per_class, image_size=args.image_size, seed=args.seed)
    train_set, val_set = image_folders(common.data_root(ns), args.image_size)  # ranks meet here (barriers)
    val_set.transform = train_set.transform = val_set.transform  # drop the random flip
    out = {}
    for split, dataset in (("train", train_set), ("val", val_set)):
        images, labels = zip(*(dataset[i] for i in range(len(dataset))))
        out[split] = (torch.stack(images).to(device), torch.tensor(labels, device=device))
    return out


def batches(data, args, epoch: int, rank: int, world_size: int):
    """This rank's batches of one epoch: a permutation shared by seed, rank r taking every world_size-th."""
    images, labels = data["train"]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
    mine = order[rank::world_size].to(labels.device)
    for start in range(0, len(mine) - args.batch_size + 1, args.batch_size):
        index = mine[start:start + args.batch_size]
        yield images[index], labels[index]


def attach(model, spec, start_iter: int):
    """Register the config's communication on the wrapped model; returns what keeps its counters."""
    if spec is None:
        return None
    if spec == "local":
        return comm.PeriodicAverager(model, period=PERIOD, warmup_steps=start_iter)
    make, ef = spec
    state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback() if ef else None, start_iter=start_iter)
    model.register_comm_hook(state, hook)
    return state


def run_config(name: str, data: dict, args, env, device: torch.device) -> dict:
    """Train one config from the same initial weights; returns its measurements (same on every rank)."""
    torch.manual_seed(args.seed)
    module = common.resnet18_cifar(10, args.width).to(device)
    model = minidp.DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    counter = attach(model, CONFIGS[name], args.start_iter)
    steps_per_epoch = len(data["train"][1]) // env.world_size // args.batch_size
    opt_args = argparse.Namespace(optimizer="sgd", lr=0.05, epochs=args.epochs, warmup_epochs=1.0)
    opt, sched = common.make_optimizer(model, opt_args, steps_per_epoch, env.world_size)
    times, losses, snapshot, step = [], [], None, 0
    for epoch in range(args.epochs):
        for images, labels in batches(data, args, epoch, env.rank, env.world_size):
            if step == args.start_iter and counter is not None:
                snapshot = _counters(counter)
            _sync(device)
            start = time.perf_counter()
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if CONFIGS[name] == "local":
                counter.step()
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.detach())
            step += 1
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    sent = _bytes(counter, snapshot, step - args.start_iter, grad_bytes)
    if CONFIGS[name] == "local":
        counter.average()  # ranks meet here: evaluate the averaged model (not counted in the bytes above)
    return {"name": name, "steps": step, "times": times, **sent,
            "train_loss": _mean_over_ranks(losses[-steps_per_epoch:]), **_evaluate(module, data)}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _counters(counter) -> tuple:
    if isinstance(counter, comm.PeriodicAverager):
        return counter.bytes_sent, counter.bytes_sent
    return counter.stats()["bytes_sent"], counter.bytes_analytical


def _bytes(counter, snapshot, steps: int, grad_bytes: int) -> dict:
    """Bytes per step after start_iter: measured by the hook, and from the compressor's formula."""
    if counter is None:  # exact: DDP's own all-reduce sends every gradient (not counted by a hook)
        return {"bytes_measured": grad_bytes, "bytes_analytical": grad_bytes, "bytes_dense": grad_bytes}
    measured, analytical = _counters(counter)
    steps = max(steps, 1)
    return {"bytes_measured": (measured - snapshot[0]) / steps, "bytes_analytical": (analytical - snapshot[1]) / steps,
            "bytes_dense": grad_bytes}


def _mean_over_ranks(losses: list) -> float:
    total = torch.stack(losses).float().mean().reshape(1)
    torch.distributed.all_reduce(total)  # ranks meet here
    return total.item() / torch.distributed.get_world_size()


@torch.no_grad()
def _evaluate(module, data) -> dict:
    """Rank 0's weights on the whole validation set, broadcast so every rank returns the same."""
    module.eval()
    images, labels = data["val"]
    logits = torch.cat([module(images[i:i + 250]) for i in range(0, len(labels), 250)])
    result = torch.stack([F.cross_entropy(logits, labels), (logits.argmax(1) == labels).float().mean()])
    torch.distributed.broadcast(result, src=0)  # ranks meet here
    module.train()
    return {"val_loss": result[0].item(), "val_accuracy": result[1].item()}


def worker(local_rank: int, args, json_path: str) -> None:
    env = minidp.init(backend="nccl" if args.device == "cuda" else "gloo")
    device = env.device if args.device == "cuda" else torch.device("cpu")  # cpu even where there is a GPU
    torch.set_num_threads(1)  # two ranks on two cores
    data = load_data(args, device)
    results = []
    for name in args.configs:
        results.append(run_config(name, data, args, env, device))
        minidp.print0(f"{name:>16}: val accuracy {results[-1]['val_accuracy']:.3f}  train loss "
                      f"{results[-1]['train_loss']:.3f}  bytes/step {results[-1]['bytes_measured']:,.0f}")
    if minidp.is_main():
        with open(json_path, "w") as f:
            json.dump({"args": vars(args), "world_size": env.world_size, "device": device.type,
                       "results": results}, f, indent=1)
    minidp.shutdown()


# ----------------------------------------------------------------------------- report
def median_step(result: dict) -> float:
    return statistics.median(result["times"][3:] or result["times"])


def add_step_ratios(data: dict) -> None:
    """Each result's median step time over exact's in the same run (runs differ in machine load)."""
    exact = next((r for r in data["results"] if r["name"] == "exact"), None)
    for r in data["results"]:
        r["step_ratio"] = median_step(r) / median_step(exact) if exact else None


def merge(paths: list[str]) -> dict:
    """Several runs' results as one (the first run's row wins for a config run twice, e.g. exact)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    seen, results = set(), []
    for run in runs:
        results += [r for r in run["results"] if r["name"] not in seen]
        seen.update(r["name"] for r in run["results"])
    order = list(CONFIGS)
    results.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    return {**runs[0], "results": results}


def table(data: dict) -> str:
    """The markdown table: one row per config."""
    rows = data["results"]
    lines = ["| method | val accuracy | val loss | train loss | bytes/step measured | bytes/step analytical | "
             "vs exact bytes | step time vs exact |", "|" + " --- |" * 8]
    for r in rows:
        time_ratio = f"{r['step_ratio']:.2f}" if r.get("step_ratio") else "-"
        lines.append(f"| {r['name']} | {r['val_accuracy']:.3f} | {r['val_loss']:.3f} | {r['train_loss']:.3f} | "
                     f"{r['bytes_measured']:,.0f} | {r['bytes_analytical']:,.0f} | "
                     f"{r['bytes_measured'] / r['bytes_dense']:.4f} | {time_ratio} |")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    """Validation accuracy against bytes per step (log scale); filled markers: error feedback."""
    import matplotlib
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r, offset in zip(*_label_offsets(data["results"])):
        ef = r["name"].endswith("+EF")
        ax.scatter(r["bytes_measured"], r["val_accuracy"], s=36, facecolors="tab:blue" if ef else "white",
                   edgecolors="tab:blue" if r["name"] != "exact" else "black", zorder=3)
        ax.annotate(r["name"], (r["bytes_measured"], r["val_accuracy"]), xytext=offset, textcoords="offset points",
                    fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step per rank (after the exact warm-up)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{data['args']['width']}-wide ResNet-18, world size {data['world_size']}, "
                 f"{data['args']['epochs']} epochs (filled: error feedback)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _label_offsets(results: list) -> tuple[list, list]:
    """Points with (nearly) the same bytes: the most accurate labelled above, the others below it in order."""
    points = sorted(results, key=lambda r: r["bytes_measured"])
    clusters = []
    for r in points:
        if clusters and r["bytes_measured"] < 1.1 * clusters[-1][0]["bytes_measured"]:
            clusters[-1].append(r)
        else:
            clusters.append([r])
    ordered, offsets = [], []
    for cluster in clusters:
        for k, r in enumerate(sorted(cluster, key=lambda r: -r["val_accuracy"])):
            ordered.append(r)
            offsets.append((5, 4) if k == 0 else (5, -11 * k))
    return ordered, offsets


def main(argv=None) -> None:
    args = parse_args(argv)
    results = os.path.join(args.out, "results")
    os.makedirs(results, exist_ok=True)
    json_path = os.path.join(results, f"compression_{args.device}.json")
    if args.from_json:
        data = merge(args.from_json.split(","))
    else:
        minidp.launch(worker, nprocs=args.nproc, args=(args, json_path))
        with open(json_path) as f:
            data = json.load(f)
        add_step_ratios(data)
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    plot(data, os.path.join(results, f"compression_{args.device}.png"))
    text = (f"Gradient compression, {data['device']}, world size {data['world_size']} (benchmarks/compression.py)"
            f"\n\n{table(data)}\n\n![accuracy against bytes](results/compression_{args.device}.png)")
    print(text)
    if args.results_md:
        write_section(args.results_md, f"compression {args.device}", text)


if __name__ == "__main__":
    main()
