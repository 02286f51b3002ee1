"""GPT-2 124M in nanoGPT's shape (12 layers, 12 heads, 768 wide, 1,024 context, vocabulary 50,304, tied
embedding), for the real-model benchmark (real_models.py).

The transformer block is examples/train_lm.py's (imported from there: one copy of it in the project);
the GPT here differs from that script's in its defaults (nanoGPT's sizes), nanoGPT's scaled init of the
residual projections, and a forward that returns the logits only, as the benchmark's loss takes them.
"""
from __future__ import annotations

import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
from train_lm import Block  # noqa: E402  (examples/ on the path first)


class GPT(nn.Module):
    """Token + position embeddings, blocks, final norm, a head tied to the token embedding.

    Args:
        vocab_size: default 50304 (GPT-2's 50257 padded, as nanoGPT).
        block_size: the context, default 1024.
        n_layer, n_head, n_embd: default 12, 12, 768 (124 M parameters).
    """

    def __init__(self, vocab_size: int = 50304, block_size: int = 1024, n_layer: int = 12, n_head: int = 12,
                 n_embd: int = 768):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, reduced once
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):  # nanoGPT's scaled init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class FromNoise(nn.Module):
    """GPT-2 for `python -m minidp.explain benchmarks/speed/gpt2.py:from_noise`-style use (explain
    feeds float noise of --input-shape): each value picks a token, so the step is GPT-2's."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT()

    def forward(self, noise):
        return self.gpt((noise.abs() * 1e4).long() % self.gpt.wte.num_embeddings)


def from_noise() -> FromNoise:
    return FromNoise()
