"""The synthetic image set of the two training examples: 10 classes of shapes and colours plus noise.

Written once per node (common.data_root calls ensure_synthetic on local rank 0 first) as an ImageFolder
root; every image is seeded by (seed, split, class, index), so every run and node sees the same set.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
from PIL import Image, ImageDraw


def draw_image(label: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `label`: its own shape and hue, random place, size and shade, plus noise."""
    hue = np.array([[230, 40, 40], [40, 200, 40], [50, 80, 230], [230, 210, 40], [200, 50, 200],
                    [40, 210, 210], [240, 140, 30], [140, 90, 40], [240, 240, 240], [120, 120, 120]])[label]
    img = Image.new("RGB", (size, size), tuple(int(c) for c in rng.integers(0, 90, 3)))
    d = ImageDraw.Draw(img)
    r = rng.uniform(0.22, 0.4) * size
    cx, cy = rng.uniform(r, size - r, 2)
    box = (cx - r, cy - r, cx + r, cy + r)
    colour = tuple(int(c) for c in np.clip(hue + rng.integers(-45, 46, 3), 0, 255))
    w = max(1, size // 10)
    shapes = [
        lambda: d.ellipse(box, fill=colour),
        lambda: d.rectangle(box, fill=colour),
        lambda: d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour),
        lambda: (d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour),
                 d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)),
        lambda: d.ellipse(box, outline=colour, width=w + 1),
        lambda: [d.rectangle((cx - r, y, cx + r, y + w), fill=colour) for y in np.arange(cy - r, cy + r, 2 * w + 1)],
        lambda: [d.rectangle((x, cy - r, x + w, cy + r), fill=colour) for x in np.arange(cx - r, cx + r, 2 * w + 1)],
        lambda: d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=colour),
        lambda: (d.line((cx - r, cy - r, cx + r, cy + r), fill=colour, width=w + 1),
                 d.line((cx - r, cy + r, cx + r, cy - r), fill=colour, width=w + 1)),
        lambda: d.rectangle(box, outline=colour, width=w + 1),
    ]
    shapes[label]()
    pixels = np.asarray(img, dtype=np.float32) + rng.normal(0, 20, (size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_synthetic(root: str, train_per_class: int, val_per_class: int, size: int, seed: int) -> None:
    """Write root/{train,val}/class<k>/<i>.png; every image is seeded by (seed, split, class, index)."""
    for split_id, (split, count) in enumerate((("train", train_per_class), ("val", val_per_class))):
        for label in range(10):
            folder = os.path.join(root, split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                rng = np.random.default_rng([seed, split_id, label, i])
                draw_image(label, size, rng).save(os.path.join(folder, f"{i:05d}.png"))


def ensure_synthetic(args: argparse.Namespace) -> str:
    """The synthetic set's root, written if missing. Call on local rank 0 first (local_rank_zero_first).

    It is written into a fresh folder, with a marker file last, then renamed into place: a
    half-written set (a crash) is never used, and two jobs sharing the temp dir do not collide.
    """
    spec = dict(train_per_class=args.train_per_class, val_per_class=args.val_per_class,
                size=args.image_size, seed=args.seed)
    name = "minidp-synthetic-{size}px-{train_per_class}x{val_per_class}-seed{seed}".format(**spec)
    root = os.path.join(args.synthetic_dir or tempfile.gettempdir(), name)
    marker = os.path.join(root, "COMPLETE")
    if os.path.exists(marker):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=name + ".partial-", dir=os.path.dirname(root))
    write_synthetic(tmp, **spec)
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        json.dump(spec, f)
    if os.path.isdir(root) and not os.path.exists(marker):
        shutil.rmtree(root, ignore_errors=True)  # left half-written by an older run
    try:
        os.rename(tmp, root)
    except OSError:  # another job got there first with the same set
        shutil.rmtree(tmp, ignore_errors=True)
    return root
