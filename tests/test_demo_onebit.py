"""comm.DeMo and comm.OneBitAdam on real gloo processes at 2 and 3 ranks, against plain references.

Each reference is written here from the paper (and, for DeMo, the authors' demo.py; for 1-bit Adam,
DeepSpeed's onebit/adam.py), in one process that plays every rank, sharing no code with minidp:
DeMo block by block with explicit DCT matrices, 1-bit Adam on flat vectors with the server chunks
in a loop. One launch per world size runs every case (both optimizers 20 steps with a checkpoint at
step 10 and a resume from it, Adam + minidp.DDP for its bytes); rank 0 also runs the references.
"""
import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minidp
from harness import run_ranks
from minidp import comm
from minidp.comm.demo import chunks_for, dct_matrix
from training import bitwise_equal, max_abs_diff, rank_batches, snapshot

STEPS, SAVE_AT = 20, 10
LR, DECAY, TOPK, CHUNK, WD = 0.01, 0.999, 32, 64, 0.01  # DeMo (the paper's decay, top-k and chunk)
ADAM_LR, BETAS, EPS, FREEZE = 0.01, (0.9, 0.999), 1e-8, 5  # 1-bit Adam: 5 exact, 15 compressed
NEAR_ZERO = 1e-6
# DeMo's bytes per step: per parameter, blocks x k x (int16 index + fp32 value). The blocks:
# weight 128x8 -> 2 of 64x8 (k 32); bias 128 -> 2 of 1x64 (k 32); weight 4x128 -> 2 of 4x64 (k 32);
# bias 4 -> 1 of 1x4 (k 4: every coefficient).
DEMO_BYTES = 2 * 32 * 6 + 2 * 32 * 6 + 2 * 32 * 6 + 4 * 6
ELEMENTS = 8 * 128 + 128 + 128 * 4 + 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 4))


def _demo(params):
    return comm.DeMo(params, lr=LR, compression_decay=DECAY, compression_topk=TOPK,
                     compression_chunk=CHUNK, weight_decay=WD)


def _onebit(params):
    return comm.OneBitAdam(params, lr=ADAM_LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           freeze_step=FREEZE)


def _state_tensors(state):
    """Every tensor of a state_dict, in a fixed order (nested dicts by key)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _state_tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _state_tensors(item)]
    return []


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # a plain module: no gradient all-reduce
        opt.step()


def _run_and_resume(make):
    """20 steps with a checkpoint after step 10; a fresh model and optimizer resumed from it."""
    batches = rank_batches(STEPS, dist.get_rank())
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, batches[:SAVE_AT])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    stats_at_save = opt.stats()
    _train(model, opt, batches[SAVE_AT:])
    model2 = _model()
    opt2 = make(model2.parameters())
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    _train(model2, opt2, batches[SAVE_AT:])
    return {"params": snapshot(model), "resumed": snapshot(model2), "stats": opt.stats(),
            "stats_resumed": opt2.stats(), "stats_at_save": stats_at_save,
            "state_same": bitwise_equal(*(_state_tensors(o.state_dict()) for o in (opt, opt2)))}


def _under_no_sync(make):
    """The same 20 steps on minidp.DDP, backward under no_sync(): DDP's all-reduce never runs."""
    model = minidp.DDP(_model())
    opt = make(model.parameters())
    for x, y in rank_batches(STEPS, dist.get_rank()):
        opt.zero_grad()
        with model.no_sync():
            F.mse_loss(model(x), y).backward()
        opt.step()
    return snapshot(model.module)


def _adam_ddp_bytes():
    """Adam + minidp.DDP: the bytes its gradient all-reduce hands to collectives per step, counted
    by comm's hook in its exact-average mode (start_iter beyond the run: DDP's arithmetic)."""
    model = minidp.DDP(_model())
    state, hook = comm.compression_hook(comm.FP16(), start_iter=10**9)
    model.register_comm_hook(state, hook)
    adam = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    _train(model, adam, rank_batches(3, dist.get_rank()))
    stats = state.stats()
    state.close()
    return stats["bytes_sent"] / stats["steps"]


# ---- DeMo's reference: the paper's steps for every rank, block by block -------------------------

def _divisor(n):
    """The longest block side: the largest divisor of n up to CHUNK."""
    return max(d for d in range(1, min(n, CHUNK) + 1) if n % d == 0)


def _dct(n):
    """The orthonormal DCT-II matrix: (k, i) = s_k cos(pi (2i + 1) k / 2n), s_0 = 1/sqrt(n)."""
    c = torch.tensor([[math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n)]
                      for k in range(n)], dtype=torch.float64) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.float()


def _rank_grads(model, batches, t):
    """Each rank's gradient at step t (the parameters are the same on every rank)."""
    grads = []
    for rank_batches_ in batches:
        model.zero_grad()
        x, y = rank_batches_[t]
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _demo_reference(world_size):
    """Final parameters, and where some step's decoded value was within NEAR_ZERO of zero."""
    model = _model()
    params = list(model.parameters())
    deltas = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    batches = [rank_batches(STEPS, r) for r in range(world_size)]
    near_zero = [torch.zeros_like(p, dtype=torch.bool) for p in params]
    for t in range(STEPS):
        grads = _rank_grads(model, batches, t)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.mul_(1 - LR * WD)
                for r in range(world_size):
                    deltas[r][i] = DECAY * deltas[r][i] + LR * grads[r][i]
                _demo_blocks(p, [deltas[r][i] for r in range(world_size)], near_zero[i])
    return [p.detach().clone() for p in params], near_zero


def _matrix(x):
    return x.view(x.shape[0] if x.dim() > 1 else 1, -1)


def _demo_blocks(p, deltas, near_zero):
    """One parameter's step, block by block: each rank sends its top-k; their mean is decoded."""
    rows, cols = _matrix(p).shape
    h, w = _divisor(rows), _divisor(cols)
    c_h, c_w, k = _dct(h), _dct(w), min(TOPK, h * w)
    for a in range(0, rows, h):
        for b in range(0, cols, w):
            total, count = torch.zeros(h * w), torch.zeros(h * w)
            for delta in deltas:  # rank order
                block = _matrix(delta)[a:a + h, b:b + w]
                coefficients = (c_h @ block @ c_w.T).flatten()
                top = coefficients.abs().topk(k).indices
                sent = torch.zeros(h * w)
                sent[top] = coefficients[top]
                block -= c_h.T @ sent.view(h, w) @ c_w  # what is sent leaves this rank's momentum
                total += sent
                count[top] += 1
            mean = torch.where(count > 0, total / count, 0.0)
            decoded = c_h.T @ mean.view(h, w) @ c_w
            _matrix(near_zero)[a:a + h, b:b + w] |= decoded.abs() < NEAR_ZERO
            _matrix(p)[a:a + h, b:b + w] -= LR * decoded.sign()


# ---- 1-bit Adam's reference: Algorithm 1 on flat vectors, each rank and server chunk in turn ----

def _onebit_reference(world_size):
    model = _model()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    chunk = math.ceil(n / (8 * world_size)) * 8  # rank o serves elements o*chunk .. (o+1)*chunk
    m, v = torch.zeros(n), torch.zeros(n)
    worker_error = [torch.zeros(n) for _ in range(world_size)]
    server_error = torch.zeros(n)  # each chunk's part is kept by its server
    batches = [rank_batches(STEPS, r) for r in range(world_size)]
    for t in range(STEPS):
        grads = [torch.cat([g.reshape(-1) for g in rank])
                 for rank in _rank_grads(model, batches, t)]
        if t < FREEZE:  # Adam on the average gradient
            g = grads[0].clone()
            for other in grads[1:]:
                g += other
            g /= world_size
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        else:  # v frozen; each worker compresses its momentum + error, each server its chunk's mean
            sent = []
            for r in range(world_size):
                x = BETAS[0] * m + (1 - BETAS[0]) * grads[r] + worker_error[r]
                scale, signs = x.norm() / math.sqrt(n), torch.where(x >= 0, 1.0, -1.0)
                worker_error[r] = x - scale * signs
                sent.append((scale, signs))
            m = torch.zeros(n)
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                average = torch.zeros(hi - lo)
                for scale, signs in sent:
                    average += signs[lo:hi] * (scale * (1 / world_size))
                average += server_error[lo:hi]
                scale = average.norm() / math.sqrt(hi - lo)
                signs = torch.where(average >= 0, 1.0, -1.0)
                server_error[lo:hi] = average - scale * signs
                m[lo:hi] = signs * scale
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in params])
            flat = flat - ADAM_LR * (m / (v.sqrt() + EPS) + WD * flat)
            torch.nn.utils.vector_to_parameters(flat, params)
    return [p.detach().clone() for p in params]


def _world(_):
    out = {"demo": _run_and_resume(_demo), "onebit": _run_and_resume(_onebit),
           "ddp_bytes": _adam_ddp_bytes(),
           "no_sync": {"demo": _under_no_sync(_demo), "onebit": _under_no_sync(_onebit)}}
    if dist.get_rank() == 0:
        out["demo_reference"] = _demo_reference(dist.get_world_size())
        out["onebit_reference"] = _onebit_reference(dist.get_world_size())
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def world(request):
    return request.param, run_ranks(_world, request.param, None, timeout=120)


def test_demo_equals_the_papers_steps(world):
    world_size, results = world
    reference, near_zero = results[0]["demo_reference"]
    for result in results:
        params = result["demo"]["params"]
        assert bitwise_equal(params, results[0]["demo"]["params"])  # every rank steps alike
        differ = [(p - q).abs() > NEAR_ZERO for p, q in zip(params, reference)]
        # a difference can only come from the sign of a value within NEAR_ZERO of zero
        assert all(not (d & ~z).any() for d, z in zip(differ, near_zero))
    count = sum(int(z.sum()) for z in near_zero)
    worst = max(max_abs_diff(result["demo"]["params"], reference) for result in results)
    print(f"DeMo ws={world_size}: max |difference| {worst:.3g}, {count} element(s) with a "
          f"decoded value within {NEAR_ZERO} of zero at some step")
    assert worst <= NEAR_ZERO


def test_demo_bytes_on_every_rank(world):
    world_size, results = world
    for result in results:
        assert result["demo"]["stats"] == {
            "steps": STEPS, "bytes_sent": STEPS * DEMO_BYTES,
            "bytes_received": STEPS * DEMO_BYTES * world_size, "bytes_dense": STEPS * 4 * ELEMENTS,
            "ratio": DEMO_BYTES / (4 * ELEMENTS)}


def test_onebit_adam_equals_the_papers_algorithm_bitwise(world):
    _, results = world
    for result in results:
        # bitwise: the same operations in the same order (the warm-up sums gradients in rank order)
        assert bitwise_equal(result["onebit"]["params"], results[0]["onebit_reference"])


def test_onebit_adam_bytes_on_every_rank_and_against_adam_with_ddp(world):
    world_size, results = world
    chunk = math.ceil(ELEMENTS / (8 * world_size)) * 8
    exact = 4 * ELEMENTS  # a warm-up step: the flat fp32 gradients, all-gathered
    # a compressed step: signs all-to-all, the server chunk's signs all-gathered, two fp32 scales
    compressed = chunk * world_size // 8 + chunk // 8 + 2 * 4
    received = chunk * world_size // 8 + world_size * (chunk // 8 + 2 * 4)
    for result in results:
        stats = result["onebit"]["stats"]
        assert stats["steps"] == STEPS and stats["bytes_dense"] == STEPS * 4 * ELEMENTS
        assert stats["bytes_sent"] == FREEZE * exact + (STEPS - FREEZE) * compressed
        assert stats["bytes_received"] == FREEZE * exact * world_size + (STEPS - FREEZE) * received
        assert result["ddp_bytes"] == 4 * ELEMENTS  # Adam + DDP: every gradient, every step
        assert result["ddp_bytes"] / compressed >= 4  # 20.7x at 2 ranks, 23.2x at 3
    print(f"1-bit Adam ws={world_size}: {compressed} bytes sent per compressed step per rank, "
          f"Adam + DDP {results[0]['ddp_bytes']:.0f} ({results[0]['ddp_bytes'] / compressed:.1f}x)")


@pytest.mark.parametrize("name", ["demo", "onebit"])
def test_under_ddp_no_sync_equals_the_plain_module(world, name):
    _, results = world
    for result in results:
        assert bitwise_equal(result["no_sync"][name], result[name]["params"])


@pytest.mark.parametrize("name", ["demo", "onebit"])
def test_resume_from_step_10_is_bitwise_the_uninterrupted_run(world, name):
    _, results = world
    for result in results:
        run = result[name]
        assert bitwise_equal(run["params"], run["resumed"]) and run["state_same"]
        assert run["stats"] == run["stats_resumed"] and run["stats_at_save"]["steps"] == SAVE_AT


def _fft_dct(x):
    """The orthonormal DCT-II of x's rows, built as the authors do (Makhoul's FFT), in float64."""
    n = x.shape[-1]
    v = torch.cat([x[..., ::2], x[..., 1::2].flip(-1)], -1)
    out = (torch.fft.fft(v) * torch.exp(-1j * math.pi * torch.arange(n) / (2 * n))).real
    out[..., 0] /= math.sqrt(n)
    out[..., 1:] /= math.sqrt(n / 2)
    return out


def test_demo_blocks_are_the_orthonormal_dct_of_every_shape():
    """No process group: the DCT matrix against the FFT construction; blocks of 0-D to 4-D."""
    for n in (1, 4, 8, 64):
        x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        assert torch.allclose(x @ dct_matrix(n, torch.float64, "cpu").T, _fft_dct(x), atol=1e-12)
    cases = {(): (1, 1, 1), (100,): (1, 50, 32), (100, 10): (50, 10, 32), (6, 3, 3, 3): (6, 27, 32),
             (4, 96): (4, 48, 32), (2, 3): (2, 3, 6)}
    for shape, (h, w, k) in cases.items():
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        chunks = chunks_for(x, CHUNK, TOPK)
        assert (chunks.h, chunks.w, chunks.k) == (h, w, k), shape
        coefficients = chunks.encode(x)
        assert coefficients.shape[-1] == h * w and coefficients.numel() == x.numel()
        assert torch.allclose(chunks.decode(coefficients), x, atol=1e-12), shape  # C^T C = I


def _linear():
    return nn.Linear(2, 2).parameters()


@pytest.mark.parametrize("make, error, words", [
    (lambda: comm.DeMo(_linear(), lr=0.0), ValueError, "lr=0.0 must be > 0"),
    (lambda: comm.DeMo(_linear(), lr=1e-3, compression_decay=1.0), ValueError,
     "compression_decay=1.0 must be < 1"),
    (lambda: comm.DeMo(_linear(), lr=1e-3, compression_topk=0), ValueError,
     "compression_topk=0 must be >= 1"),
    (lambda: comm.DeMo(_linear(), lr=1e-3, compression_chunk=2.0), TypeError,
     "compression_chunk=2.0 must be an int"),
    (lambda: comm.DeMo(_linear(), lr=1e-3, weight_decay=-1.0), ValueError,
     "weight_decay=-1.0 must be >= 0"),
    (lambda: comm.DeMo(_linear(), lr=1e-3), RuntimeError, "needs torch.distributed"),
    (lambda: comm.OneBitAdam(_linear(), betas=0.9), TypeError, "betas=0.9 must be a pair"),
    (lambda: comm.OneBitAdam(_linear(), betas=(0.9, 1.0)), ValueError, "betas[1]=1.0 must be < 1"),
    (lambda: comm.OneBitAdam(_linear(), freeze_step=-1), ValueError, "freeze_step=-1 must be >= 0"),
    (lambda: comm.OneBitAdam([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2).double())]),
     ValueError, "a parameter group holds trainable parameters of 2 dtypes or devices"),
    (lambda: comm.OneBitAdam(_linear()), RuntimeError, "needs torch.distributed"),
])
def test_bad_arguments_are_refused_with_their_name_and_value(make, error, words):
    with pytest.raises(error) as caught:
        make()
    assert words in str(caught.value)
