"""minidp.DDP with torch.compile, in both wrapping orders: bitwise torch DDP's results, and overlap.

Under torch.compile a model's backward is one autograd node unless the graph is cut; graph_split.py
cuts it where buckets end, as torch DDP's DDPOptimizer does. The tests use the aot_eager backend
(eager kernels, so compiles take a second, not a minute of C++ builds); the benchmark
(benchmarks/overlap/compile_timeline.py) measures the same overlap with the default backend, inductor.

Overlap is proven by event order, not timing: with the graph cut, backward nodes of the model still
start after bucket 0 was launched; with it whole (the control), every backward node starts before.
"""
import copy
import operator
import pickle

import pytest
import torch
from processes import fresh_interpreter_report
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp.engine import graph_split, planning
from models import CNNWithBatchNorm
from training import mse, rank_batches, snapshot, train

BACKEND = "aot_eager"
LAYER_BYTES = (16 * 16 + 16) * 4  # one Linear(16, 16): a bucket, and a piece, of its own at this cap
CAP_MB = LAYER_BYTES / planning.MIB


class DeepMLP(nn.Module):
    """A class of its own, as user models are: torch.compile(torch DDP(m)) compiles m's forward as a
    frame, which dynamo would not do for a bare nn.Sequential (torch.nn's code starts no frame)."""

    def __init__(self, layers=5):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())])

    def forward(self, x):
        return self.layers(x)


def wrap(engine, order, module, **ddp_kwargs):
    """`order`: "ddp_of_compiled" = DDP(torch.compile(m)), "compiled_ddp" = torch.compile(DDP(m))."""
    wrapper = minidp.DDP if engine == "minidp" else TorchDDP
    if order == "ddp_of_compiled":
        return wrapper(torch.compile(module, backend=BACKEND), **ddp_kwargs)
    return torch.compile(wrapper(module, **ddp_kwargs), backend=BACKEND)


def ddp_of(model):
    return model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model


def backward_nodes(loss) -> list:
    """Every autograd node of `loss`'s backward but the gradient accumulators (a test-only walk)."""
    nodes, todo = [], [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in nodes or type(node).__name__ == "AccumulateGrad":
            continue
        nodes.append(node)
        todo += [next_node for next_node, _ in node.next_functions]
    return nodes


def compiled_nodes(loss) -> int:
    return sum("CompiledFunction" in node.name() for node in backward_nodes(loss))


# ---- one process: where the graph is cut, and what the cut graph computes -----------------------

@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles afresh: dynamo's caches (and its recompile limit of 8 per function, which
    every nn.Sequential shares) carry over between tests of one process otherwise."""
    torch._dynamo.reset()


def dynamo_graph(module, x) -> torch.fx.GraphModule:
    """The graph dynamo hands a backend for `module(x)`."""
    graphs = []
    torch.compile(module, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(x)
    return graphs[0]


class Scaled(nn.Module):
    """Work before the first parameter (a preamble), then the layers."""

    def __init__(self):
        super().__init__()
        self.layers = DeepMLP(3)

    def forward(self, x):
        return self.layers(x * 2)


def _piece_by_op(gm, pieces, target) -> list[int]:
    return [pieces[n] for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("limits, expected", [
    ([LAYER_BYTES], [0, 1, 2, 3, 4]),                      # a piece per layer
    ([2 * LAYER_BYTES, LAYER_BYTES], [0, 1, 2, 3, 3]),     # the first limit holds at the output end
    ([planning.UNBOUNDED], [0, 0, 0, 0, 0]),               # nothing fills: the graph stays whole
    ([4 * LAYER_BYTES], [0, 1, 1, 1, 1]),                  # >=: a piece closes once it reaches its limit
])
def test_pieces_follow_the_bucket_limits_from_the_output_back(limits, expected):
    gm = dynamo_graph(DeepMLP(), torch.randn(2, 16))
    pieces = graph_split.assign_pieces(gm, limits)
    assert _piece_by_op(gm, pieces, torch._C._nn.linear) == expected
    assert _piece_by_op(gm, pieces, torch.tanh) == expected  # each activation stays with its layer


def test_preamble_joins_the_first_piece():
    gm = dynamo_graph(Scaled(), torch.randn(2, 16))
    pieces = graph_split.assign_pieces(gm, [LAYER_BYTES])
    assert _piece_by_op(gm, pieces, torch._C._nn.linear) == [0, 1, 2]
    [scale] = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    assert pieces[scale] == 0


def test_cut_graph_computes_what_eager_computes_in_separate_backward_nodes():
    eager, model = DeepMLP(), DeepMLP()
    splitter = graph_split.BucketSplitter(torch._dynamo.lookup_backend(BACKEND), [LAYER_BYTES])
    compiled = torch.compile(model, backend=splitter)
    x = torch.randn(4, 16)
    for _ in range(2):
        expected, loss = eager(x).square().mean(), compiled(x).square().mean()
        assert torch.equal(loss, expected)
        assert compiled_nodes(loss) == 5  # one backward node per piece, each compiled
        expected.backward()
        loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))
    with torch.no_grad():
        compiled(x)
    assert splitter.pieces == [5, 1]  # no gradients: nothing to overlap, the graph stays whole


def test_batch_size_changes_recompile_and_cut_again():
    """A new batch size recompiles the graph (then with a dynamic size), which is cut again."""
    eager, model = DeepMLP(), DeepMLP()
    splitter = graph_split.BucketSplitter(torch._dynamo.lookup_backend(BACKEND), [LAYER_BYTES])
    compiled = torch.compile(model, backend=splitter)
    for batch in (4, 3, 5, 4):
        x = torch.randn(batch, 16)
        expected, loss = eager(x).sum(), compiled(x).sum()
        expected.backward()
        loss.backward()
        assert torch.equal(loss, expected)
    assert splitter.pieces == [5, 5]
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_backend_of_a_compiled_module_is_the_one_given_to_torch_compile():
    m, seen = nn.Linear(2, 2), []

    def mine(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    graph = torch.fx.symbolic_trace(m)
    graph_split._backend_of(torch.compile(m, backend=mine).dynamo_ctx.callback)(graph, [])
    assert seen == [graph]
    assert graph_split._backend_of(torch.compile(m).dynamo_ctx.callback).compiler_name == "inductor"


def test_runner_copies_compile_again():
    """A deep copy and an unpickled copy drop the compiled graphs; the unpickled one compiles again, to the
    same result (one compile of the copies: each costs a second or more of this process's CPU)."""
    runner = graph_split.ModuleRunner(torch.compile(DeepMLP(), backend=BACKEND), CAP_MB)
    x = torch.randn(4, 16)
    expected = runner(x)
    deep, unpickled = copy.deepcopy(runner), pickle.loads(pickle.dumps(runner))
    for clone in (deep, unpickled):
        assert clone.compiled == {} and clone.callback is None
    assert torch.equal(unpickled(x), expected)
    assert [s.pieces for s in unpickled.splitters] == [[5]]


# ---- world size 2: parity with torch DDP + torch.compile, overlap by event order -----------------

def _train(model, shapes, steps=3):
    """Parameters and buffers after `steps` steps on this rank's own data, and the compiled backward nodes
    of the last step's loss."""
    nodes = []

    def loss_fn(model, batch):
        loss = mse(model, batch)
        nodes.append(compiled_nodes(loss))
        return loss
    inputs, targets = shapes
    batches = rank_batches(steps, torch.distributed.get_rank(), inputs=inputs, targets=targets)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, loss_fn)
    return snapshot(model, buffers=True), nodes[-1]


MLP_SHAPES, CNN_SHAPES = ((4, 16), (4, 16)), ((4, 3, 4, 4), (4, 4))  # (inputs, targets) of a batch


# (model, order) cases of the parity run: the MLP in both orders; the CNN with BatchNorm (buffers) where dynamo
# traces the wrapper's forward too. Each case compiles twice per rank (minidp, torch DDP): seconds of CPU each.
PARITY_CASES = [("mlp", "ddp_of_compiled"), ("mlp", "compiled_ddp"), ("cnn_bn", "compiled_ddp")]


def _parity_worker():
    """Per model and order: minidp's and torch DDP's weights after 3 steps, and minidp's piece counts."""
    assert torch._dynamo.config.optimize_ddp in (True, "ddp_optimizer")  # torch DDP's graph cutting is on
    out = {}
    models = {"mlp": (DeepMLP, MLP_SHAPES, CAP_MB), "cnn_bn": (_cnn, CNN_SHAPES, 0.0002)}
    for name, order in PARITY_CASES:
        build, shapes, cap = models[name]
        torch._dynamo.reset()  # each case compiles afresh (and stays under dynamo's recompile limit)
        ours = wrap("minidp", order, build(), bucket_cap_mb=cap)
        out[name, order, "minidp"], out[name, order, "compiled nodes"] = _train(ours, shapes)
        out[name, order, "pieces"] = [s.pieces for s in ddp_of(ours)._run_module.splitters]
        torch._dynamo.reset()
        theirs = wrap("torch", order, build())
        out[name, order, "torch"], out[name, order, "torch compiled nodes"] = _train(theirs, shapes)
    return out


def _cnn():
    torch.manual_seed(0)
    return CNNWithBatchNorm()


# (order, cut) cases of the overlap run: the graph cut in both orders; whole (the control) in one.
OVERLAP_CASES = [("ddp_of_compiled", True), ("compiled_ddp", True), ("compiled_ddp", False)]


def _overlap_worker():
    """Events of the third step per case: the graph cut, and (control) whole."""
    out = {}
    for order, cut in OVERLAP_CASES:
        torch._dynamo.reset()
        model = wrap("minidp", order, DeepMLP(), bucket_cap_mb=CAP_MB)
        ddp = ddp_of(model)
        if not cut:
            ddp._run_module.limits = [planning.UNBOUNDED]  # one piece: the whole graph
        timeline = ddp.enable_timeline()
        gen = torch.Generator().manual_seed(torch.distributed.get_rank())
        for _ in range(3):  # iteration 1 reduces in one bucket; the rebuilt layout holds from 2 on
            timeline.events.clear()
            loss = model(torch.randn(4, 16, generator=gen)).square().mean()
            handles = _record_backward_nodes(loss, timeline)
            loss.backward()
            for handle in handles:
                handle.remove()
        out[order, cut] = (timeline.snapshot(), len(ddp.bucket_plan()))
    return out


def _record_backward_nodes(loss, timeline):
    """A "backward_node" event when each autograd node of this backward starts."""
    def record(name):
        return lambda grads: timeline.record("backward_node", name=name)
    return [node.register_prehook(record(node.name())) for node in backward_nodes(loss)]


def _world_size_2_worker():
    return {"parity": _parity_worker(), "overlap": _overlap_worker()}


@pytest.fixture(scope="module", autouse=True)
def world_size_2():
    """Both workers' results from one launch (starting 2 processes costs more than the cases).

    Autouse: it starts before this file's first test, while this process runs no compile threads yet,
    so the harness can fork the workers (no fork server to start)."""
    return run_ranks(_world_size_2_worker, 2, timeout=300)


@pytest.fixture(scope="module")
def parity(world_size_2):
    return [rank_result["parity"] for rank_result in world_size_2]


@pytest.mark.parametrize("model, order", PARITY_CASES)
def test_bitwise_equal_to_torch_ddp_with_compile(parity, model, order):
    assert parity[0][model, order, "torch compiled nodes"] > 0  # the reference ran compiled too
    for rank_result in parity:
        ours, theirs = rank_result[model, order, "minidp"], rank_result[model, order, "torch"]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("model, order", PARITY_CASES)
def test_graph_is_cut_into_pieces(parity, model, order):
    pieces = parity[0][model, order, "pieces"]
    assert len(pieces) == 1  # one backend: the user's, wrapped once
    assert max(pieces[0]) > 1, pieces  # the training graph was cut
    assert parity[0][model, order, "compiled nodes"] == max(pieces[0])  # and every piece is compiled


@pytest.fixture(scope="module")
def overlap(world_size_2):
    return [rank_result["overlap"] for rank_result in world_size_2]


def _first(events, kind, **fields):
    return next(stamp for k, stamp, f in events if k == kind and all(f.get(a) == b for a, b in fields.items()))


@pytest.mark.parametrize("order", ["ddp_of_compiled", "compiled_ddp"])
def test_bucket_0_launches_during_backward(overlap, order):
    for rank_result in overlap:
        events, buckets = rank_result[order, True]
        assert buckets == 5  # one per layer: bucket 0 holds the last layer only
        launch0 = _first(events, "launch", bucket=0)
        assert launch0 < max(stamp for kind, stamp, _ in events if kind == "grad_ready")
        assert launch0 < _first(events, "backward_end")
        later = [f["name"] for kind, stamp, f in events if kind == "backward_node" and stamp > launch0]
        assert any("CompiledFunction" in name for name in later), later  # compiled backward still running


def test_control_whole_graph_has_no_backward_after_launch(overlap):
    """The witness works: with the graph whole, all backward compute is over before bucket 0 launches."""
    for rank_result in overlap:
        events, _ = rank_result["compiled_ddp", False]
        launch0 = _first(events, "launch", bucket=0)
        assert not [f for kind, stamp, f in events if kind == "backward_node" and stamp > launch0]


def test_eager_training_does_not_import_dynamo():
    """torch._dynamo costs seconds to import: minidp touches it only once a compiled module shows up (checked in
    a fresh interpreter, tests/scripts/fresh_imports.py: this process has imported it)."""
    assert fresh_interpreter_report()["dynamo_imported_by_an_eager_step"] is False
