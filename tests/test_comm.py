"""minidp.comm in one process: bad input, byte formulas by hand, the compressor contract, bit packing, state, QSGD.

The hook runs here over a one-rank loopback transport (the Transport interface needs nothing more);
the multi-rank behaviour is in test_comm_dist.py, the CUDA paths in test_comm_gpu.py.
"""
import math

import pytest
import torch
from torch import nn

from harness import Loopback
from minidp import comm
from minidp.comm.context import RandomStream
from minidp.comm.memory import ParamStore
from minidp.comm.powersgd import orthogonalize
from minidp.comm.sign import pack_bits, signs_of, unpack_signs
from minidp.engine.hooks import GradBucket


def _bucket(numels=(600, 397), dtype=torch.float32, seed=0):
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]
    buffer = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed)).to(dtype)
    return GradBucket(0, buffer, params, [0, numels[0]], is_last=True)


def _ctx(shapes, dtype=torch.float32, world_size=2):
    """A context for a byte formula: only the shapes, dtype and world size matter."""
    return comm.Context(0, world_size, 0, shapes, dtype, torch.device("cpu"))


ALL = {"FP16": comm.FP16, "BF16": comm.BF16, "TopK": lambda: comm.TopK(0.01), "RandomK": lambda: comm.RandomK(0.01),
       "QSGD": lambda: comm.QSGD(4), "Sign": comm.Sign, "PowerSGD": lambda: comm.PowerSGD(1)}


@pytest.mark.parametrize("make, error, words", [
    (lambda: comm.TopK(0), ValueError, "ratio=0"),
    (lambda: comm.TopK(1.5), ValueError, "ratio=1.5"),
    (lambda: comm.TopK(-0.1), ValueError, "ratio=-0.1"),
    (lambda: comm.RandomK("0.1"), TypeError, "ratio='0.1'"),
    (lambda: comm.RandomK(0.5, seed=-1), ValueError, "seed=-1"),
    (lambda: comm.QSGD(0), ValueError, "levels=0"),
    (lambda: comm.QSGD(2.5), TypeError, "levels=2.5"),
    (lambda: comm.QSGD(40000), ValueError, "levels=40000"),
    (lambda: comm.QSGD(4, block_size=0), ValueError, "block_size=0"),
    (lambda: comm.PowerSGD(0), ValueError, "rank=0"),
    (lambda: comm.PowerSGD(1, warm_start="yes"), TypeError, "warm_start='yes'"),
    (lambda: comm.PowerSGD(1, min_compression_rate=-1), ValueError, "min_compression_rate=-1"),
    (lambda: comm.compression_hook("topk"), TypeError, "compressor='topk'"),
    (lambda: comm.compression_hook(comm.FP16(), memory="ef", transport=Loopback()), TypeError, "memory='ef'"),
    (lambda: comm.compression_hook(comm.FP16(), transport="nccl"), TypeError, "transport='nccl'"),
    (lambda: comm.compression_hook(comm.FP16(), transport=Loopback(), start_iter=-1), ValueError, "start_iter=-1"),
    (lambda: comm.PeriodicAverager(nn.Linear(2, 2), period=0), ValueError, "period=0"),
    (lambda: comm.PeriodicAverager(nn.Linear(2, 2), period=2, warmup_steps=-1), ValueError, "warmup_steps=-1"),
    (lambda: comm.PeriodicAverager("model", period=2), TypeError, "model=str"),
    (lambda: comm.TorchDist(group="world"), TypeError, "group='world'"),
])
def test_bad_arguments_are_refused_with_their_name_and_value(make, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        make()


def test_a_compressor_refuses_a_non_float_bucket():
    state, hook = comm.compression_hook(comm.TopK(0.5), transport=Loopback())
    bucket = _bucket()
    bucket.set_buffer(torch.arange(997))
    with pytest.raises(TypeError, match=r"compressor=TopK\(ratio=0.5\) needs a floating-point bucket, got dtype "
                                        r"torch.int64"):
        hook(state, bucket)
    assert state._thread is None  # refused before a worker thread started


def test_a_transport_refuses_tensors_on_the_wrong_device():
    nccl = comm.TorchDist.__new__(comm.TorchDist)  # an NCCL group cannot exist without CUDA: only its check
    nccl.backend, nccl.rank, nccl.world_size = "nccl", 0, 1
    state, hook = comm.compression_hook(comm.FP16(), transport=nccl)
    with pytest.raises(ValueError, match=r"cannot reduce tensors on cpu: NCCL needs CUDA tensors"):
        hook(state, _bucket())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cupy_nccl_without_cuda_says_what_is_missing():
    with pytest.raises(RuntimeError, match=r"CupyNccl\(\) needs .*a CUDA device \(torch.cuda.is_available\(\) is "
                                           r"False\)"):
        comm.CupyNccl()


@pytest.mark.parametrize("name, world_size, expected", [
    ("FP16", 2, 2 * 997), ("BF16", 2, 2 * 997),
    ("TopK", 2, 9 * (4 + 4)),  # k = int(0.01 * 997) = 9 values + 9 int32 indices
    ("RandomK", 2, 9 * 4),  # indices come from the shared seed: values only
    ("QSGD", 2, 997 * 1 + 2 * 4),  # one int8 per element, one norm per 512-element block
    ("Sign", 2, 504 * 2 // 8 + 504 // 8 + 2 * 4),  # chunk ceil(997/16)*8 = 504: all-to-all, all-gather, 2 scales
    ("Sign", 3, 336 * 3 // 8 + 336 // 8 + 2 * 4),  # chunk ceil(997/24)*8 = 336
    ("PowerSGD", 2, (600 + 397) * 4),  # vectors are never compressed
])
def test_analytical_bytes_by_hand(name, world_size, expected):
    assert ALL[name]().payload_bytes(_ctx([torch.Size([600]), torch.Size([397])], world_size=world_size)) == expected


def test_powersgd_bytes_count_p_and_q():
    shapes = [torch.Size([32, 8]), torch.Size([32]), torch.Size([4, 2, 2])]  # 32x8 compressed at rank 1; 4x4 not
    assert comm.PowerSGD(1).payload_bytes(_ctx(shapes)) == ((32 + 8) * 1 + 32 + 16) * 4
    assert comm.QSGD(200).payload_bytes(_ctx(shapes)) == 304 * 2 + 1 * 4  # int16 above 127 levels


@pytest.mark.parametrize("name", ALL)
def test_measured_bytes_equal_analytical_and_one_rank_keeps_its_gradient_shape(name):
    state, hook = comm.compression_hook(ALL[name](), memory=comm.ErrorFeedback(), transport=Loopback(),
                                        start_iter=1)
    for step in range(3):
        bucket = _bucket(seed=step)
        before = bucket.buffer().clone()
        result = hook(state, bucket).wait()
        assert result.shape == before.shape and torch.isfinite(result).all()
        if step == 0:  # before start_iter: the exact average (of one rank)
            assert torch.equal(result, before)
    stats = state.stats()
    dense = 997 * 4
    assert stats["steps"] == 3 and stats["bytes_dense"] == 3 * dense
    assert stats["bytes_sent"] == state.bytes_analytical == dense + 2 * ALL[name]().payload_bytes(
        _ctx([torch.Size([600]), torch.Size([397])], world_size=1))
    assert stats["ratio"] == stats["bytes_sent"] / stats["bytes_dense"]
    state.close()  # the worker thread ends: no thread left behind in the pytest process
    assert state._thread is None


class Exact(comm.Compressor):
    """Sends the bucket as it is, keeps every context it is given, and declares no byte formula."""

    summable = True

    def __init__(self):
        self.seen = []

    def compress(self, tensor, ctx):
        self.seen.append(ctx)
        return [tensor.clone()]

    def decompress(self, payload, ctx):
        return payload[0]


def test_a_compressor_gets_a_context_and_needs_no_byte_formula():
    exact = Exact()
    state, hook = comm.compression_hook(exact, transport=Loopback(), start_iter=1)
    for step in range(3):
        bucket = _bucket(seed=step)
        assert torch.equal(hook(state, bucket).wait(), _bucket(seed=step).buffer())
    assert [(c.rank, c.world_size, c.step, c.numel, c.dtype) for c in exact.seen] == [(0, 1, 1, 997, torch.float32),
                                                                                      (0, 1, 2, 997, torch.float32)]
    assert exact.seen[0].shapes == [torch.Size([600]), torch.Size([397])]
    assert exact.seen[0].generator is exact.seen[1].generator is state.random.generator  # one per hook
    assert state.stats()["bytes_sent"] == state.bytes_analytical == 3 * 997 * 4  # counted by the channel
    state.close()


class Miscounted(Exact):
    def payload_bytes(self, ctx):
        return ctx.numel  # wrong: it sends 4 bytes per element


class OldStyle(Exact):
    def compress(self, tensor, ctx):
        return [tensor.clone()], None  # the contract before the context: (payload, what decompress needs)


@pytest.mark.parametrize("compressor, error, words", [
    (Miscounted(), RuntimeError, r"compressor=Miscounted\(\): payload_bytes declares 997 bytes for a bucket of shapes "
                                 r"\[\(600,\), \(397,\)\] \(torch.float32, world size 1\), but 3988 were handed"),
    (OldStyle(), TypeError, r"compressor=OldStyle\(\): compress\(tensor, ctx\) must return a list of tensors \(the "
                            r"payload\), got tuple"),
])
def test_a_compressor_that_breaks_the_contract_fails_its_first_bucket(compressor, error, words):
    state, hook = comm.compression_hook(compressor, transport=Loopback())
    with pytest.raises(error, match=words):
        hook(state, _bucket()).wait()
    state.close()


def test_a_compressor_without_decompress_cannot_be_made():
    class Half(comm.Compressor):
        def compress(self, tensor, ctx):
            return [tensor.half()]

    with pytest.raises(TypeError, match=r"abstract method '?decompress"):
        Half()


def test_the_generator_is_seeded_per_rank_unless_shared_and_resumes_from_a_state_dict():
    rank_two = Loopback()
    rank_two.rank = 2
    assert comm.compression_hook(comm.QSGD(4, seed=5), transport=rank_two)[0].random.seed == 7  # seed + rank
    assert comm.compression_hook(comm.RandomK(0.1, seed=5), transport=rank_two)[0].random.seed == 5  # shared

    def run(state, hook, seeds):
        return [hook(state, _bucket(seed=s)).wait().clone() for s in seeds]

    state, hook = comm.compression_hook(comm.QSGD(2), transport=Loopback())
    run(state, hook, [0, 1])
    saved = state.state_dict()
    assert set(saved["generator"]) == {"seed", "device_type", "state"}  # no device index: resumes on any GPU
    going_on = run(state, hook, [2, 3])
    again, hook2 = comm.compression_hook(comm.QSGD(2), transport=Loopback())
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(run(again, hook2, [2, 3]), going_on))
    other, _ = comm.compression_hook(comm.QSGD(2, seed=1), transport=Loopback())
    with pytest.raises(ValueError, match=r"the random generator's seed is 0, this hook's 1"):
        other.load_state_dict(saved)
    for s in (state, again):
        s.close()


def test_a_random_stream_goes_on_where_it_was_saved_and_refuses_another_device_type():
    stream = RandomStream(3)
    first = torch.rand(4, generator=stream.on("cpu"))
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(3)))
    saved = stream.state_dict()
    expected = torch.rand(4, generator=stream.on(torch.device("cpu")))  # the same generator: the stream goes on
    resumed = RandomStream(3)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["state"].equal(saved["state"])  # saved again before its first use: unchanged
    assert torch.equal(torch.rand(4, generator=resumed.on("cpu")), expected)
    cuda_state = RandomStream(3)
    cuda_state.load_state_dict({**saved, "device_type": "cuda"})
    with pytest.raises(RuntimeError, match=r"saved on a cuda device and cannot go on on cpu"):
        cuda_state.on("cpu")


def test_error_feedback_residual_is_what_was_not_sent():
    state, hook = comm.compression_hook(comm.TopK(0.1), memory=comm.ErrorFeedback(), transport=Loopback())
    bucket = _bucket()
    x = bucket.buffer().clone()
    sent = hook(state, bucket).wait()
    assert (sent != 0).sum() == 99  # int(0.1 * 997)
    residual = torch.cat([state.state_dict()["memory"]["residuals"]["pieces"][state.key_of(p)]
                          for p in bucket.parameters()])
    assert torch.equal(sent + residual, x)
    thread = state._thread
    state.close()
    assert not thread.is_alive()
    again = hook(state, _bucket(seed=1)).wait()  # a bucket after close() starts a new worker thread
    assert (again != 0).sum() == 99 and state._thread is not thread
    state.close()


def test_sign_bits_pack_eight_to_a_byte_and_zero_counts_as_plus():
    bits = torch.rand(64, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_signs(packed, torch.float32), bits.float() * 2 - 1)
    assert pack_bits(torch.tensor([True] + [False] * 7)).item() == 128  # first element in the top bit
    assert signs_of(torch.tensor([0.0, -0.0, -1e-30, 2.0])).tolist() == [1, 1, -1, 1]


def test_param_store_keeps_values_across_layouts_and_checkpoints():
    store, like = ParamStore(), torch.zeros(1)
    flat, missing, moved = store.flat([0, 1], [2, 3], like)
    assert missing and not moved
    flat.copy_(torch.arange(5.0))
    flat2, missing, moved = store.flat([1, 2, 0], [3, 1, 2], like)  # a rebuilt bucket: new order, a new key
    assert torch.equal(flat2, torch.tensor([2.0, 3, 4, 0, 0, 1])) and missing and moved
    assert list(store.flats) == [(1, 2, 0)]  # the old layout's flat is freed
    again = ParamStore()
    again.load_state_dict(store.state_dict())
    same, missing, moved = again.flat([1, 2, 0], [3, 1, 2], like)
    assert torch.equal(same, flat2) and not missing and not moved  # a reload is not a layout change
    with pytest.raises(ValueError, match=r"parameter #1 holds 3 elements but the parameter has 4"):
        again.flat([1], [4], like)


def test_load_state_dict_refuses_a_state_without_the_same_memory():
    saved, _ = comm.compression_hook(comm.TopK(0.5), memory=comm.ErrorFeedback(), transport=Loopback())
    other, _ = comm.compression_hook(comm.TopK(0.5), transport=Loopback())
    with pytest.raises(ValueError, match=r"memory=saved does not match this hook's memory=None"):
        other.load_state_dict(saved.state_dict())


def test_qsgd_is_unbiased_and_within_one_level():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    qsgd = comm.QSGD(4, block_size=16)
    ctx = comm.Context.for_tensor(x)
    draws = torch.stack([qsgd.decompress(qsgd.compress(x, ctx), ctx) for _ in range(2000)])
    norms = torch.linalg.vector_norm(x.view(4, 16), dim=1).repeat_interleave(16)
    assert ((draws - x).abs() <= norms / 4 + 1e-6).all()  # never further than one level
    assert ((draws.mean(0) - x).abs() < 4 * norms / 4 / math.sqrt(2000)).all()  # unbiased, within 4 sigma


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns(rank):
    q = torch.randn(3, 20, rank, generator=torch.Generator().manual_seed(rank))
    orthogonalize(q)
    torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(rank).expand(3, rank, rank), atol=1e-5, rtol=0)


def test_randomk_resumed_from_a_state_dict_draws_the_positions_the_run_would_have_drawn():
    """The hook keeps one generator (not one per device string), so a resumed run draws on where the saved
    one stopped; on CUDA the same holds on another GPU index (tests/test_gpu_streams.py)."""
    state, hook = comm.compression_hook(comm.RandomK(0.1), transport=Loopback())
    hook(state, _bucket(seed=0)).wait()
    saved = state.state_dict()
    going_on = hook(state, _bucket(seed=1)).wait().clone()
    resumed, hook2 = comm.compression_hook(comm.RandomK(0.1), transport=Loopback())
    resumed.load_state_dict(saved)
    again = hook2(resumed, _bucket(seed=1)).wait()
    assert torch.equal(again, going_on) and (again != 0).sum() == 99  # the same 10% of positions
    fresh, hook3 = comm.compression_hook(comm.RandomK(0.1), transport=Loopback())
    assert not torch.equal(hook3(fresh, _bucket(seed=1)).wait(), going_on)  # a fresh stream draws others
    for s in (state, resumed, fresh):
        s.close()
