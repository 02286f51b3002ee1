"""Overlap under torch.compile: the compiled graph is cut where gradient buckets end.

Why: torch.compile turns the model's forward into one graph, and AOTAutograd turns that graph's
backward into one autograd node. Every gradient is accumulated when that node finishes, at the very
end of backward, so the reducer's hooks all fire then and no all-reduce overlaps with backward.
torch DDP's answer (dynamo's DDPOptimizer, torch/_dynamo/backends/distributed.py) is to cut the
graph where buckets end: each piece gets a backward node of its own, so a piece's gradients are
ready, and their bucket launched, while the pieces before it still compute. minidp does the same:

  BucketSplitter    a torch.compile backend: walks dynamo's graph from the output back and starts
                    a new piece each time the parameters read since the last cut fill a bucket
                    (`assign_pieces`, with the reducer's byte limits), splits the graph there
                    (torch.fx.passes.split_module) and compiles each piece with the user's backend
                    (one torch.compile per piece, on its first call: dynamo traces the piece again
                    with real inputs, so the piece's guards, strides and recompiles are its own).
  ModuleRunner      what minidp.DDP calls in place of its module: the module as it is when nothing
                    is compiled; else the module compiled by a BucketSplitter around the backend
                    the user chose, whichever order they wrapped in:
                      minidp.DDP(torch.compile(m))  the backend that compiled m;
                      torch.compile(minidp.DDP(m))  the backend of the compile that runs the
                                                    wrapper (read in `forward_outside_dynamo`).

Cutting moves no arithmetic: a piece computes what the whole graph computed for its nodes. With a
backend that keeps eager kernels (aot_eager) results are bitwise those of eager; with inductor,
those of torch DDP + torch.compile when the cuts fall in the same places (the same byte limits).

torch has no public accessor for "the backend this compile uses": `_backend_of` reads it the way
dynamo does for torch DDP (the `_torchdynamo_orig_backend` chain of a compile's callback), and the
callback of the compile running the wrapper comes from torch._C._dynamo. Both are looked up only
once a compile is involved, and torch._dynamo is imported only then (it costs seconds to import).
"""
from __future__ import annotations

import sys

import torch
from torch import fx, nn

from . import planning


class BucketSplitter:
    """A torch.compile backend: cut the graph into bucket-sized pieces, compile each with `backend`.

    Args:
        backend: the backend that compiles each piece (what the user gave torch.compile).
        limits: byte limits of the pieces, from the output back: the last piece closes once its
            parameters reach limits[0], the one before at limits[1], ... (the last limit repeats).

    `pieces` records, per graph this backend compiled, how many pieces it was cut into.
    """

    def __init__(self, backend, limits):
        self.backend, self.limits, self.pieces = backend, list(limits), []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        # No gradients (eval, no_grad): nothing to overlap, keep the graph whole.
        piece_of = assign_pieces(gm, self.limits) if torch.is_grad_enabled() else {}
        count = 1 + max(piece_of.values(), default=0)
        self.pieces.append(count)
        if count == 1:
            return self.backend(gm, example_inputs)
        split = fx.passes.split_module.split_module(gm, None, lambda node: piece_of[node])
        for node in split.graph.nodes:
            if node.op == "call_module":  # one call per piece
                piece = getattr(split, node.target)
                delattr(split, node.target)
                setattr(split, node.target, _CompiledOnFirstCall(piece, self.backend))
        return split


class _CompiledOnFirstCall:
    """One piece of the graph, compiled with the user's backend when it first runs.

    Not sooner: while dynamo compiles, the code FX generates for a GraphModule is marked for dynamo
    to skip (convert_frame.fx_forward_from_src_skip_result), so a piece compiled from the backend
    would silently stay eager. The piece is rebuilt as a plain GraphModule at its first run, which
    gives it code of its own (split_module's pieces share a lazy stub, one frame to dynamo), and its
    forward is compiled rather than the module (fewer Python layers per call: 16 pieces, 2 passes).
    """

    def __init__(self, piece: fx.GraphModule, backend):
        self.piece, self.backend, self.compiled = piece, backend, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = torch.compile(fx.GraphModule(self.piece, self.piece.graph).forward, backend=self.backend)
        return self.compiled(*args)


def assign_pieces(gm: fx.GraphModule, limits) -> dict:
    """The piece of each node of dynamo's graph, 0 first in forward order (DDPOptimizer's rule).

    Walk the nodes from the output back, adding the bytes of the trainable parameters each node
    reads (each once). Once the current piece's parameters reach its limit, the next node starts a
    new piece, as soon as the current one has a value used outside it (a piece must output
    something). Nodes before the first parameter (a preamble) join the piece after them.

    Args:
        gm: the graph dynamo hands a backend (parameters are placeholders or get_attr nodes).
        limits: byte limits, from the output back; the last one repeats.
    """
    pieces, sizes, seen = [[]], [0], set()
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        limit = limits[min(len(pieces), len(limits)) - 1]
        if sizes[-1] >= limit and _used_outside(pieces[-1]):
            pieces.append([])
            sizes.append(0)
        for key, param in _parameters_read(gm, node):
            if key not in seen:
                seen.add(key)
                sizes[-1] += param.numel() * param.element_size()
        pieces[-1].append(node)
    if len(pieces) > 1 and sizes[-1] == 0:
        pieces[-2].extend(pieces.pop())
    last = len(pieces) - 1
    return {node: last - i for i, piece in enumerate(pieces) for node in piece}


def _parameters_read(gm: fx.GraphModule, node: fx.Node) -> list:
    """(key, parameter) for each trainable parameter `node` reads directly."""
    if node.op == "call_module":  # a module dynamo did not inline
        return [(id(p), p) for p in gm.get_submodule(node.target).parameters() if p.requires_grad]
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "placeholder":
            value = arg.meta.get("example_value")  # a fake tensor, still an nn.Parameter
        elif arg.op == "get_attr":
            value = _attribute(gm, arg.target)
        else:
            continue
        if isinstance(value, nn.Parameter) and value.requires_grad:
            found.append((arg, value))
    return found


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value


def _used_outside(piece: list) -> bool:
    members = set(piece)
    return any(user not in members for node in piece for user in node.users)


class ModuleRunner:
    """Calls the wrapped module; under torch.compile, compiled in bucket-sized pieces.

    Args:
        module: the module minidp.DDP wraps, possibly compiled (torch.compile's OptimizedModule).
        bucket_cap_mb: minidp.DDP's bucket_cap_mb; pieces are cut at the reducer's byte limits for
            the buckets it rebuilds after the first iteration (gradients in ready order).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb):
        self.module = module
        self.limits = planning.bucket_limits(bucket_cap_mb, first_iteration=False, needs_rebuild=True)
        self.callback = None  # the callback of a compile that runs the wrapper (forward_outside_dynamo)
        self.compiled = {}    # id(backend) -> (backend, BucketSplitter, the module compiled with it)

    def __call__(self, *inputs, **kwargs):
        target, callback = self.module, self.callback
        if is_compiled(target):  # minidp.DDP(torch.compile(m)): compile m again, in pieces
            target, callback = target._orig_mod, callback or target.dynamo_ctx.callback
        if not callback:  # None: nothing compiles; False: dynamo runs cached code only
            return self.module(*inputs, **kwargs)
        return self._compiled_with(target, _backend_of(callback))(*inputs, **kwargs)

    def _compiled_with(self, target: nn.Module, backend):
        if id(backend) not in self.compiled:
            splitter = BucketSplitter(backend, self.limits)
            self.compiled[id(backend)] = (backend, splitter, torch.compile(target, backend=splitter))
        return self.compiled[id(backend)][2]

    @property
    def splitters(self) -> list[BucketSplitter]:
        """The backends made so far (usually one); each records how many pieces its graphs have."""
        return [splitter for _, splitter, _ in self.compiled.values()]

    def __getstate__(self) -> dict:
        # Compiled code does not pickle; a loaded copy compiles again on its first forward.
        return {**self.__dict__, "callback": None, "compiled": {}}


def forward_outside_dynamo(ddp: nn.Module, inputs: tuple, kwargs: dict):
    """minidp.DDP's forward, as plain Python, while a compile traces it: torch.compile(minidp.DDP(m)).

    Dynamo must not trace the wrapper: its collectives break the graph, and its counters (the
    reducer's iteration number) become guards that fail on every step, until dynamo gives up and
    runs the whole model eagerly. So DDP.forward, when traced, calls this through
    torch.compiler.disable(recursive=False): dynamo skips this frame yet still compiles the frames it
    calls, so the compile's callback is still installed here. It is read here; then the wrapper's
    forward runs with dynamo off, and its ModuleRunner compiles the module, in pieces, with it.
    """
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    runner = ddp._run_module
    runner.callback = get_eval_frame_callback()
    try:
        return torch.compiler.disable(type(ddp)._forward)(ddp, runner, inputs, kwargs)
    finally:
        runner.callback = None


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` came from torch.compile (checked without importing torch._dynamo)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _backend_of(callback):
    """The backend a dynamo callback compiles with (what was given to torch.compile, resolved).

    Each layer of dynamo's callback keeps the one it wraps in `_torchdynamo_orig_backend`, down to
    the backend itself (as torch._dynamo.eval_frame.innermost_backend walks it).
    """
    while hasattr(callback, "_torchdynamo_orig_backend"):
        callback = callback._torchdynamo_orig_backend
    return callback
