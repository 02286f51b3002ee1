"""comm.StreamingDiLoCo (Douillard et al. 2025, arXiv 2501.18512) on gloo processes, 2 and 3 ranks.

Against a straightforward reference of the paper's algorithm written here (inner AdamW on each
rank; fragment f's outer gradient, global - local averaged over ranks, taken after steps
(f + 1) H / F + k H with plain blocking collectives, in 4 bits when asked, and landed tau steps
later: outer Nesterov SGD on the fragment's global parameters, then alpha * local +
(1 - alpha) * global); against comm.DiLoCo with F = 1, tau = 0; the bytes of every sync; a bitwise
resume with a sync in flight. One launch per world size runs every case; the tests below check
what the workers returned.
"""
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minidp
from harness import error_of, run_ranks
from minidp import comm
from minidp.comm.streaming_diloco import decode_e3m0, encode_e3m0, plan_fragments
from training import bitwise_equal, rank_batches, snapshot, train

H, STEPS, LAYERS = 6, 14, 6  # two or three syncs of each fragment, one in flight at the end
CASES = {  # name: (fragments, sync_delay, quantize_bits, mixing); not only 0.5, which is symmetric
    "f2-tau1": (2, 1, None, 0.25),
    "f2-tau1-4bit": (2, 1, 4, 0.5),
    "f3-tau2": (3, 2, None, 0.0),
    "f3-tau2-4bit": (3, 2, 4, 0.25),
}
GRID = torch.tensor([0.0] + [2.0 ** -j for j in (6, 5, 4, 3, 2, 1, 0)])  # E3M0's magnitudes


def _stack():
    """Six equal Linear(8, 8) layers: fragments of 1/2 or 1/3 of the model hold equal bytes."""
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(*layers[:-1])


def _batches():
    return rank_batches(STEPS, dist.get_rank(), targets=(4, 8))


def _nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _outer_gradient(fragment, theta, bits):
    """global - local, averaged over ranks: the paper's outer gradient, with plain collectives."""
    world = dist.get_world_size()
    if bits is None:  # the fragment flattened, divided, all-reduced (DiLoCo's arithmetic)
        flat = torch.cat([p.detach().reshape(-1) for p in fragment]) / world
        dist.all_reduce(flat)  # ranks meet here
        means = flat.split([p.numel() for p in fragment])
        return [theta[p] - m.view_as(p) for p, m in zip(fragment, means)]
    out = []
    for p in fragment:  # 4 bits: per tensor, the nearest of sign * scale * GRID
        delta = theta[p] - p.detach()
        scale = delta.abs().max()
        ratio = delta.abs() / scale if scale > 0 else torch.zeros_like(delta)
        # argmin: the first, the smaller, of two equally near
        nearest = (ratio.reshape(-1, 1) - GRID).abs().argmin(dim=1)
        sent = torch.sign(delta) * (GRID[nearest].view_as(delta) * scale)
        every = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(every, sent)  # ranks meet here
        out.append(sum(every[1:], every[0].clone()) / world)  # rank order
    return out


def _reference(fragments, tau, bits, alpha):
    """The algorithm in full, its own loop: shares no code with what it checks."""
    module = _stack()
    layers = [m for m in module if isinstance(m, nn.Linear)]
    parts = [[p for layer in layers[f::fragments] for p in layer.parameters()]
             for f in range(fragments)]
    theta = {p: p.detach().clone() for p in module.parameters()}  # the global parameters
    outer, inner = _nesterov(list(theta.values())), torch.optim.AdamW(module.parameters(), lr=0.01)
    landing = {}  # step -> [(fragment, its outer gradient)]

    def land(part, delta):
        for g in theta.values():
            g.grad = None
        for p, d in zip(part, delta):
            theta[p].grad = d
        outer.step()
        with torch.no_grad():
            for p in part:
                p.copy_(alpha * p + (1 - alpha) * theta[p])

    for t, (x, y) in enumerate(_batches(), 1):
        inner.zero_grad()
        F.mse_loss(module(x), y).backward()
        inner.step()
        for f, delta in landing.pop(t, []):
            land(parts[f], delta)
        for f in range(fragments):
            start = (f + 1) * H // fragments
            if t >= start and (t - start) % H == 0:
                landing.setdefault(t + tau, []).append((f, _outer_gradient(parts[f], theta, bits)))
                if tau == 0:
                    land(parts[f], landing.pop(t)[0][1])
    return snapshot(module), list(theta.values())


def _setup(fragments, tau, bits, alpha, cls=comm.StreamingDiLoCo, wrap=True, warmup_steps=0):
    module = _stack()
    model = minidp.DDP(module) if wrap else module
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    args = {} if cls is comm.DiLoCo else {"fragments": fragments, "sync_delay": tau,
                                          "quantize_bits": bits, "mixing": alpha}
    method = cls(model, _nesterov(model.parameters()), H, warmup_steps=warmup_steps, **args)
    return module, model, inner, method


def _run(case, **setup):
    """Train STEPS steps; the bytes each step handed to collectives, what is in flight after it."""
    module, model, inner, method = _setup(*case, **setup)
    out = {"sent": [], "in_flight": []}

    def after(step):
        before = method.bytes_sent
        method.step()
        out["sent"].append(method.bytes_sent - before)
        out["in_flight"].append(getattr(method, "in_flight", None))
    train(model, inner, _batches(), per_step=after)
    return {**out, "params": snapshot(module), "global": [g.clone() for g in method.global_params],
            "stats": method.stats()}


def _resume(name, save_at, folder):
    """Train save_at steps (a sync in flight), save; fresh objects loaded from it go on alike."""
    case, batches = CASES[name], _batches()
    path = os.path.join(folder, f"{name}-{dist.get_rank()}.pt")
    module, model, inner, method = _setup(*case)
    step = lambda _: method.step()  # noqa: E731
    train(model, inner, batches[:save_at], per_step=step)
    in_flight = method.in_flight
    torch.save({"model": module.state_dict(), "inner": inner.state_dict(),
                "method": method.state_dict()}, path)
    train(model, inner, batches[save_at:], per_step=step)
    module2, model2, inner2, method2 = _setup(*case)  # its constructor broadcasts: load after it
    saved = torch.load(path, weights_only=True)
    module2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    method2.load_state_dict(saved["method"])
    train(model2, inner2, batches[save_at:], per_step=lambda _: method2.step())
    other = _setup(5 - case[0], *case[1:])[3]  # 2 fragments where 3 were saved, or 3 for 2
    return {"in_flight": in_flight, "stats": (method.stats(), method2.stats()),
            "same": bitwise_equal(module.parameters(), module2.parameters())
            and bitwise_equal(method.global_params, method2.global_params),
            "other_layout": error_of(lambda: other.load_state_dict(saved["method"]))}


def _world(folder):
    torch.set_num_threads(1)
    cases = {name: {"run": _run(case), "reference": _reference(*case)}
             for name, case in CASES.items()}
    resumes = (("f2-tau1", 6), ("f3-tau2-4bit", 7))  # a sync in flight after steps 6 and 7
    return {"diloco": _run((1, 0, None, 0.0), cls=comm.DiLoCo), "f1": _run((1, 0, None, 0.0)),
            **cases, "resume": {name: _resume(name, at, folder) for name, at in resumes},
            "plain": _run(CASES["f3-tau2-4bit"], wrap=False),
            "warmup": _run(CASES["f2-tau1"], warmup_steps=2)}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request, tmp_path_factory):
    return run_ranks(_world, request.param, str(tmp_path_factory.mktemp("streaming")), timeout=120)


def test_one_fragment_no_delay_no_quantisation_is_diloco_bitwise(world):
    for result in world:
        diloco, streaming = result["diloco"], result["f1"]
        assert bitwise_equal(streaming["params"], diloco["params"])
        assert bitwise_equal(streaming["global"], diloco["global"])
        assert streaming["sent"] == diloco["sent"] and sum(s > 0 for s in diloco["sent"]) == 2


@pytest.mark.parametrize("name", CASES)
def test_fragments_equal_the_papers_algorithm_written_plainly(world, name):
    for result in world:
        params, theta = result[name]["reference"]
        run = result[name]["run"]
        # bitwise (measured: max abs difference 0.0 at 2 and 3 ranks, every case): the same sums
        # in the same order (one flat all-reduce per fragment; exact 4-bit values, in rank order)
        assert bitwise_equal(run["params"], params), name
        assert bitwise_equal(run["global"], theta), name
    assert bitwise_equal(world[0][name]["run"]["global"], world[-1][name]["run"]["global"])


def test_a_plain_module_without_ddp_trains_the_same(world):
    for result in world:  # the hook only counts bytes_dense: without it, the same run
        run, params = result["plain"], result["f3-tau2-4bit"]["reference"][0]
        assert bitwise_equal(run["params"], params) and run["stats"]["bytes_dense"] == 0


def test_warmup_averages_gradients_then_fragments_sync_on_the_local_schedule(world):
    for result in world:  # f2-tau1 after 2 warm-up steps: the broadcast, then syncs at local 3, 6
        run = result["warmup"]
        assert run["sent"] == [0, 1728, 0, 0, 864, 0, 0, 864, 0, 0, 864, 0, 0, 864]
        # gradients in the 2 warm-up steps (counted by the hook), the broadcast, 4 syncs
        assert run["stats"]["bytes_sent"] == 2 * 1728 + 1728 + 4 * 864
        assert run["stats"]["bytes_dense"] == STEPS * 1728


def test_each_sync_lands_sync_delay_steps_after_it_starts(world):
    """f3-tau2 (H = 6): fragment f starts after steps 2 (f + 1) + 6 k, in flight until 2 later."""
    expected = [[], [(0, 4)], [(0, 4)], [(1, 6)], [(1, 6)], [(2, 8)], [(2, 8)], [(0, 10)],
                [(0, 10)], [(1, 12)], [(1, 12)], [(2, 14)], [(2, 14)], [(0, 16)]]
    for result in world:
        assert result["f3-tau2"]["run"]["in_flight"] == expected
        assert result["f1"]["in_flight"] == [[]] * STEPS  # tau = 0: each sync lands as it starts


PER_SYNC = {"f2-tau1": 864, "f2-tau1-4bit": 132, "f3-tau2": 576, "f3-tau2-4bit": 88}


def test_bytes_per_sync_are_1_over_f_of_dilocos_and_4_bits_an_eighth_plus_scales(world):
    for result in world:  # every rank
        dense = max(result["diloco"]["sent"])
        assert dense == 4 * LAYERS * 72 == 1728  # every parameter in fp32, once per sync
        for name, (fragments, _, bits, _) in CASES.items():
            run, per_sync = result[name]["run"], PER_SYNC[name]
            starts = [t for t in range(1, STEPS + 1) if t % (H // fragments) == 0]
            assert [t for t, sent in enumerate(run["sent"], 1) if sent] == starts, name
            assert set(run["sent"]) == {0, per_sync} == {0, run["stats"]["peak_sync_bytes"]}, name
            numel, tensors = LAYERS * 72 // fragments, 2 * LAYERS // fragments
            if bits is None:  # the fragment's parameters in fp32
                assert per_sync * fragments == dense, name
            else:  # two 4-bit codes a byte, a float32 scale per tensor
                assert per_sync == math.ceil(numel / 2) + 4 * tensors, name


def test_resume_with_a_sync_in_flight_is_bitwise_the_uninterrupted_run(world):
    for result in world:
        for name, resume in result["resume"].items():
            assert resume["in_flight"], name  # the checkpoint held a sync on the wire
            assert resume["same"] and resume["stats"][0] == resume["stats"][1], name
            kind, message = resume["other_layout"]
            assert kind == "ValueError" and "build it with the saved fragments" in message, name


def test_fragments_are_modules_dealt_out_strided_or_the_lists_given():
    model = _stack()
    model[0].bias.requires_grad_(False)  # frozen: in no fragment
    # trainable indices: layer 0 weight (0), then layer k's weight and bias at 2k - 1, 2k
    assert plan_fragments(model, 2) == [[0, 3, 4, 7, 8], [1, 2, 5, 6, 9, 10]]
    assert plan_fragments(model, 3) == [[0, 5, 6], [1, 2, 7, 8], [3, 4, 9, 10]]
    layers = [m for m in model if isinstance(m, nn.Linear)]
    given = [list(layers[5].parameters()), [p for m in layers[:5] for p in m.parameters()]]
    assert plan_fragments(model, given) == [[9, 10], list(range(9))]


def test_e3m0_rounds_to_the_nearest_power_of_two_of_the_scale_ties_down_two_codes_a_byte():
    x = torch.tensor([1.0, -0.75, 0.74, 0.3, -0.0117, 0.0078125, 0.006, 0.0, -2.0 ** -6])
    packed, scales = encode_e3m0([x * 4])  # scale 4: max |x|
    assert packed.dtype == torch.uint8 and packed.numel() == 5 and scales.tolist() == [4.0]
    (decoded,) = decode_e3m0(packed, scales, [x])
    want = torch.tensor([1.0, -0.5, 0.5, 0.25, -2.0 ** -6, 0.0, 0.0, 0.0, -2.0 ** -6]) * 4
    assert torch.equal(decoded, want)
    (zeros,) = decode_e3m0(*encode_e3m0([torch.zeros(3)]), [torch.zeros(3)])
    assert torch.equal(zeros, torch.zeros(3))  # scale 0: no division by it


def _plain(**kwargs):
    model = _stack()
    return comm.StreamingDiLoCo(model, _nesterov(model.parameters()), **{"period": H, **kwargs})


@pytest.mark.parametrize("kwargs, error, words", [
    ({"fragments": 0}, ValueError, "fragments=0 must be >= 1"),
    ({"fragments": 4}, ValueError, "period=6 must be a multiple of fragments=4"),
    ({"fragments": 12, "period": 12}, ValueError,
     "fragments=12 needs at least 12 modules with trainable parameters, the model has 6"),
    ({"fragments": [[nn.Parameter(torch.zeros(1))]]}, ValueError, "fragments: 1 lists holding 1"),
    ({"sync_delay": 6}, ValueError, "sync_delay=6 must be <= 5"),
    ({"quantize_bits": 8}, ValueError, "quantize_bits=8 is not built: use 4"),
    ({"quantize_bits": "4"}, TypeError, "quantize_bits='4' must be an int"),
    ({"mixing": 1.0}, ValueError, "mixing=1.0 must be < 1"),
    ({}, RuntimeError, "needs an initialised process group"),
])
def test_bad_arguments_are_refused_with_their_name_and_value(kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)):
        _plain(**kwargs)
