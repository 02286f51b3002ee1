"""PowerSGD (Vogels et al. 2019) in minidp: low-rank gradients in two rounds, with error feedback and warm start.

Each gradient viewed as an n x m matrix M (worth compressing when (n + m) * rank * min_compression_rate
< n * m) becomes P = M Q (all-reduced, orthogonalized), then Q = M^T P (all-reduced, averaged), and
comes back as P Q^T. Other gradients are all-reduced as they are. The arithmetic, the order of
the matrices (grouped by shape), the random Q (a numpy RandomState seeds a torch generator) and
the error (this rank's corrected gradient minus the averaged result) follow torch's powerSGD_hook,
so both agree at the same rank, start iteration and seed. Differences, on purpose:
  - Q memories and errors are kept per parameter, not per bucket index, so they stay right when
    DDP rebuilds its buckets after iteration 1 (torch's needs start_powerSGD_iter >= 2 for that);
  - the rounds run on the hook's worker thread, not inside gloo callbacks (which deadlock on gloo
    with several buckets);
  - the error feedback is the hook's memory: PowerSGD(r) with memory=comm.ErrorFeedback() is
    torch's use_error_feedback=True.
"""
from __future__ import annotations

import numpy as np
import torch

from ..validate import check_bool, check_int, check_number
from .exchange import Channel, Job
from .interfaces import MultiRound
from .memory import ParamStore


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalize the columns of each matrix of a (batch, n, r) tensor in place (torch's choice of method)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):  # Gram-Schmidt
            col = matrices[:, :, i:i + 1]
            norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
            col /= norm + epsilon if epsilon else norm
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        r_factor = matrices.new_empty(matrices.shape[0], rank, rank)
        torch.linalg.qr(matrices, out=(matrices, r_factor))


class PowerSGD(MultiRound):
    """Rank-`rank` PowerSGD; pair it with memory=comm.ErrorFeedback() (error feedback) as the paper does.

    Args:
        rank: the approximation rank r >= 1 (torch's matrix_approximation_rank).
        warm_start: start each step's power iteration from the last Q. Default True.
        min_compression_rate: compress a matrix only if it shrinks by more than this. Default 2.
        seed: seed of the numpy RandomState that seeds each random Q (torch's random_seed). Default 0.
        orthogonalization_epsilon: added to column norms (torch's). Default 0.
    """

    def __init__(self, rank: int, warm_start: bool = True, min_compression_rate: float = 2, seed: int = 0,
                 orthogonalization_epsilon: float = 0.0):
        self.rank = check_int("rank", rank, low=1)
        self.warm_start = check_bool("warm_start", warm_start)
        self.min_compression_rate = check_number("min_compression_rate", min_compression_rate, low=0)
        self.seed = check_int("seed", seed, low=0)
        self.epsilon = check_number("orthogonalization_epsilon", orthogonalization_epsilon, low=0)
        self.rng = np.random.RandomState(self.seed)
        self.q_store = ParamStore()  # per parameter: its last Q (m x r), for warm start

    def _plan(self, shapes: list) -> tuple[list, list]:
        """(compressed: [(index, n, m, r)] grouped by matrix shape as torch orders them, uncompressed indices)."""
        groups, uncompressed = {}, []
        for i, shape in enumerate(shapes):
            numel = int(np.prod(shape)) if len(shape) else 1
            n = shape[0] if len(shape) else 1
            m = numel // n if n else 0
            r = min(n, m, self.rank)
            if len(shape) and (n + m) * r * self.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append((i, n, m, r))
            else:
                uncompressed.append(i)
        return [item for group in groups.values() for item in group], uncompressed

    def payload_bytes(self, ctx):
        compressed, uncompressed = self._plan(ctx.shapes)
        plain = sum(int(np.prod(ctx.shapes[i])) for i in uncompressed)
        elements = plain + sum((n + m) * r for _, n, m, r in compressed)
        return elements * ctx.dtype.itemsize

    def _starting_qs(self, job: Job, compressed: list) -> tuple[torch.Tensor, list]:
        """This step's Q matrices (one flat tensor and (1, m, r) views), warm or freshly random, orthogonalized."""
        keys = [job.keys[i] for i, _, _, _ in compressed]
        q_flat, missing, _ = self.q_store.flat(keys, [m * r for _, _, m, r in compressed], job.tensor)
        qs, offset = [], 0
        for _, _, m, r in compressed:
            qs.append(q_flat[offset:offset + m * r].view(1, m, r))
            offset += m * r
        if compressed and (missing or not self.warm_start):
            # As torch: one numpy draw seeds a CPU generator that fills every Q of the bucket in order
            # (torch's values on every device). On CUDA the draws go to pinned memory and are copied
            # without making the host wait (torch's pageable copy does); the caching host allocator
            # keeps the pinned block until the copy is done.
            gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            pinned = job.tensor.is_cuda
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=q.dtype, pin_memory=pinned), non_blocking=pinned)
        for q in qs:
            orthogonalize(q, self.epsilon)
        return q_flat, qs

    def reduce(self, job: Job, channel: Channel) -> torch.Tensor | None:
        x, ws, shapes = job.tensor, job.ctx.world_size, job.ctx.shapes
        original = x.clone() if job.with_memory else None
        offsets = np.cumsum([0, *job.numels]).tolist()
        views = [x[offsets[i]:offsets[i + 1]].view(shape) for i, shape in enumerate(shapes)]
        compressed, uncompressed = self._plan(shapes)
        matrices = [views[i].view(1, n, m) for i, n, m, _ in compressed]
        q_flat, qs = self._starting_qs(job, compressed)
        p_flat = x.new_empty(sum(n * r for _, n, _, r in compressed))
        ps, offset = [], 0
        for matrix, q, (_, n, _, r) in zip(matrices, qs, compressed):
            ps.append(p_flat[offset:offset + n * r].view(1, n, r))
            offset += n * r
            torch.bmm(matrix, q, out=ps[-1])
        plain = torch.cat([views[i].reshape(-1) for i in uncompressed]) if uncompressed else x.new_empty(0)
        channel.all_reduce(plain).div_(ws)  # ranks meet here (round 0: the uncompressed gradients)
        offset = 0
        for i in uncompressed:
            views[i].copy_(plain[offset:offset + views[i].numel()].view_as(views[i]))
            offset += views[i].numel()
        channel.all_reduce(p_flat)  # ranks meet here (round 1: P)
        for p in ps:
            orthogonalize(p, self.epsilon)
        for matrix, p, q in zip(matrices, ps, qs):
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        channel.all_reduce(q_flat).div_(ws)  # ranks meet here (round 2: Q, averaged)
        for matrix, p, q in zip(matrices, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=matrix)
        return original - x if job.with_memory else None

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, gauss = self.rng.get_state()
        return {"q": self.q_store.state_dict(),
                "rng": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}

    def load_state_dict(self, state: dict) -> None:
        self.q_store.load_state_dict(state["q"])
        kind, keys, pos, has_gauss, gauss = state["rng"]
        self.rng.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, warm_start={self.warm_start})"
