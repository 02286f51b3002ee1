"""GPT-2 124M in nanoGPT's shape (12 layers, 12 heads, 768 wide, 1,024 context, vocabulary 50,304, tied
embedding), for the real-model benchmark (real_models.py).

examples/train_lm.py holds the same model (its Block and GPT), but as a script with its own imports
(examples/progress.py) and a character vocabulary; this file is the model alone, importable by the
benchmark's ranks, with nanoGPT's sizes as defaults and its scaled init of the residual projections.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP (nanoGPT's)."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


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
