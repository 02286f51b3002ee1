"""StreamingDiLoCo: DiLoCo syncing fragment by fragment, overlapped, optionally in 4 bits.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512). As in
DiLoCo (diloco.py, whose machinery this extends), every rank trains alone and keeps global
parameters, the same on every rank. What changes, as the paper's algorithm does it (written here
from its description; the assumptions are in the class docstring):
  - the parameters are split into F fragments (blocks of layers, dealt out strided), and every H/F
    steps one fragment's sync starts, so each fragment syncs every H steps and a sync carries 1/F of
    the model;
  - a sync started after step t is applied after step t + tau (`sync_delay`): the collective runs
    asynchronously while the next tau inner steps compute;
  - the outer gradient may travel in 4 bits (E3M0: sign and a power of two, scaled per tensor);
  - when the outer step lands, the fragment's local parameters are mixed with the new global ones:
    alpha * local + (1 - alpha) * global (alpha = `mixing`, 0 by default: replaced, as DiLoCo does).

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    streaming = comm.StreamingDiLoCo(model, outer, period=100, fragments=4, sync_delay=5,
                                     quantize_bits=4, mixing=0.5)
    for x, y in batches:
        loss_fn(model(x), y).backward(); inner.step(); inner.zero_grad()
        streaming.step()                        # after the inner optimizer's step
    streaming.sync()                            # lands the syncs still in flight
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..validate import check_int, check_number
from .diloco import DiLoCo


class StreamingDiLoCo(DiLoCo):
    """DiLoCo with fragments synced in turn, each sync overlapped with `sync_delay` inner steps.

    Schedule (counting step() calls after the warm-up): fragment f's syncs start after calls
    (f + 1) * H / F + k * H, k = 0, 1, ..., and land `sync_delay` calls later (at the same call when
    0); so fragment F - 1 syncs when DiLoCo would, and with F = 1, tau = 0, no quantisation and
    mixing 0 this is DiLoCo, bitwise (tested). A sync: outer gradient of the fragment averaged over
    ranks (below), the outer optimizer steps the fragment's global parameters on it (the others sit
    out: their .grad is None), then the local fragment becomes
    mixing * local + (1 - mixing) * global.

    The outer gradient is global - local, averaged over ranks. Without quantisation the
    fragment's parameters are averaged as DiLoCo's (divided, then all-reduced in one flat buffer;
    global - mean): the same value, DiLoCo's arithmetic. With quantize_bits=4 each rank's own
    global - local is quantised per tensor (see encode_e3m0), codes and scales are all-gathered,
    and every rank decodes them, sums in rank order and divides: every rank gets the same bits.

    Assumptions where the paper leaves a choice: the outer gradient is taken against the global
    parameters of the fragment's last sync (as DiLoCo's); fragments are the modules that own
    trainable parameters, dealt out strided (the paper's better pattern), unless given as lists;
    the first sync of fragment f comes after (f + 1) H / F local steps.

    Args:
        model, outer_optimizer, period, warmup_steps, process_group: as DiLoCo's (period is H).
        fragments: F, an int >= 1 dividing `period` (the model's modules that own trainable
            parameters, in registration order, module m in fragment m % F), or a list of F lists of
            parameters, every trainable parameter in exactly one. Default 1.
        sync_delay: tau, inner steps between a sync's start and its landing, 0 <= tau < period.
            Default 0.
        quantize_bits: None (send what DiLoCo sends) or 4 (E3M0). Default None.
        mixing: alpha in [0, 1), the local parameters' share when a sync lands. Default 0.0.
    """

    def __init__(self, model: nn.Module, outer_optimizer: torch.optim.Optimizer, period: int,
                 fragments=1, sync_delay: int = 0, quantize_bits: int | None = None,
                 mixing: float = 0.0, warmup_steps: int = 0, process_group=None):
        period = check_int("period", period, low=1)
        self.sync_delay = check_int("sync_delay", sync_delay, low=0, high=period - 1)
        if quantize_bits is not None and check_int("quantize_bits", quantize_bits) != 4:
            raise ValueError(f"quantize_bits={quantize_bits} is not built: use 4 (E3M0) or None")
        self.quantize_bits = quantize_bits
        self.mixing = check_number("mixing", mixing, low=0.0)
        if self.mixing >= 1:
            raise ValueError(f"mixing={mixing!r} must be < 1: at 1 no sync would change a thing")
        # checked before DiLoCo's constructor, which broadcasts (ranks meet there)
        self.fragments = plan_fragments(model, fragments) if isinstance(model, nn.Module) else []
        if self.fragments and period % len(self.fragments):
            raise ValueError(f"period={period} must be a multiple of "
                             f"fragments={len(self.fragments)}, so that one fragment's sync "
                             "starts every period / fragments steps")
        self._in_flight: list[_Flight] = []
        self.peak_sync_bytes = 0
        super().__init__(model, outer_optimizer, period, warmup_steps, process_group)

    def step(self) -> bool:
        """Call after each inner optimizer step: lands, then starts, the syncs due (True if any)."""
        self.steps += 1
        local = self.steps - self.warmup_steps
        if local == 0:
            self._start_local()  # ranks meet here: the warm-up is over
        if local <= 0:
            return False
        due = [flight for flight in self._in_flight if flight.due == local]
        for flight in due:
            self._land(flight)
        spacing = self.period // len(self.fragments)
        for f in range(len(self.fragments)):
            offset = (f + 1) * spacing
            if local >= offset and (local - offset) % self.period == 0:
                due.append(self._start(f, local + self.sync_delay))
                if self.sync_delay == 0:
                    self._land(due[-1])
        return bool(due)

    @torch.no_grad()
    def sync(self) -> bool:
        """Land every sync in flight now (every rank calls it), e.g. at the end; returns if any did.

        Unlike DiLoCo.sync() it starts none: fragments sync on their schedule.
        """
        landed = bool(self._in_flight)
        for flight in list(self._in_flight):
            self._land(flight)
        return landed

    @property
    def in_flight(self) -> list[tuple[int, int]]:
        """(fragment, local step it lands at) of each sync started and not landed yet."""
        return [(flight.fragment, flight.due) for flight in self._in_flight]

    @torch.no_grad()
    def _start(self, fragment: int, due: int) -> _Flight:
        """Start fragment's outer-gradient exchange (async); it lands at local step `due`."""
        indices, before = self.fragments[fragment], self.bytes_sent
        globals_ = [self.global_params[i] for i in indices]
        if self.quantize_bits is None:
            pending = self._start_mean(indices)  # ranks meet here (async all-reduce)

            def finish():
                means = self._finish_mean(pending)
                return torch._foreach_sub(globals_, [means[i] for i in indices])
        else:
            finish = self._start_quantized(indices, globals_)
        self.peak_sync_bytes = max(self.peak_sync_bytes, self.bytes_sent - before)
        flight = _Flight(fragment, due, finish)
        self._in_flight.append(flight)
        return flight

    def _start_quantized(self, indices: list[int], globals_: list[torch.Tensor]):
        """All-gather each rank's global - local in E3M0 (async); returns what waits, averages."""
        params = [self.params[i] for i in indices]
        codes, scales = encode_e3m0(torch._foreach_sub(globals_, [p.detach() for p in params]))
        world = dist.get_world_size(self.group)
        gathered = [[torch.empty_like(t) for _ in range(world)] for t in (codes, scales)]
        works = [dist.all_gather(out, t, group=self.group, async_op=True)  # ranks meet here
                 for out, t in zip(gathered, (codes, scales))]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in (codes, scales))

        def finish():
            for work in works:
                work.wait()
            total = None
            for rank_codes, rank_scales in zip(*gathered):  # rank order: the same bits everywhere
                decoded = decode_e3m0(rank_codes, rank_scales, params)
                total = decoded if total is None else torch._foreach_add(total, decoded)
            return torch._foreach_div(total, world)
        return finish

    @torch.no_grad()
    def _land(self, flight: _Flight) -> None:
        """The outer step on the fragment, then the paper's merge of local and global parameters."""
        indices = self.fragments[flight.fragment]
        params = [self.params[i] for i in indices]
        local = [p.detach().clone() for p in params] if self.mixing else None
        self._outer_step(indices, flight.pseudo())
        if local is not None:  # mixing * local + (1 - mixing) * global
            torch._foreach_mul_(local, self.mixing)
            globals_ = [self.global_params[i] for i in indices]
            torch._foreach_add_(local, torch._foreach_mul(globals_, 1 - self.mixing))
            torch._foreach_copy_(params, local)
        self._in_flight.remove(flight)

    def stats(self) -> dict:
        """DiLoCo's, plus peak_sync_bytes: the most bytes one sync handed to collectives."""
        return {**super().stats(), "peak_sync_bytes": self.peak_sync_bytes}

    def _layout(self) -> dict:
        return {"fragments": self.fragments, "sync_delay": self.sync_delay,
                "quantize_bits": self.quantize_bits}

    def state_dict(self) -> dict:
        """DiLoCo's, plus the syncs in flight (waited for: their averaged outer gradients).

        Waiting only completes collectives every rank has already started; nothing new is sent.
        """
        in_flight = [(f.fragment, f.due, [g.clone() for g in f.pseudo()]) for f in self._in_flight]
        return {**super().state_dict(), **self._layout(), "in_flight": in_flight,
                "peak_sync_bytes": self.peak_sync_bytes}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned, syncs in flight too (load the model separately)."""
        saved = {key: state[key] for key in self._layout()}
        if saved != self._layout():
            raise ValueError(f"the state was saved with {saved}, this StreamingDiLoCo has "
                             f"{self._layout()}: build it with the saved fragments, sync_delay and "
                             "quantize_bits")
        super().load_state_dict(state)
        self.peak_sync_bytes = state["peak_sync_bytes"]
        self._in_flight = []
        for fragment, due, pseudo in state["in_flight"]:
            like = [self.params[i] for i in self.fragments[fragment]]
            pseudo = [g.to(device=p.device, dtype=p.dtype, copy=True) for g, p in zip(pseudo, like)]
            self._in_flight.append(_Flight(fragment, due, lambda pseudo=pseudo: pseudo))


class _Flight:
    """One fragment's sync on the wire: started at one step, landing at local step `due`."""

    def __init__(self, fragment: int, due: int, finish):
        self.fragment, self.due, self._finish, self._pseudo = fragment, due, finish, None

    def pseudo(self) -> list[torch.Tensor]:
        """The fragment's averaged outer gradient (waits for its collectives the first time)."""
        if self._pseudo is None:
            self._pseudo = self._finish()
        return self._pseudo


def plan_fragments(model: nn.Module, fragments) -> list[list[int]]:
    """Each fragment's indices into the model's trainable parameters (model.parameters() order).

    fragments=F: the modules that own trainable parameters are the blocks, in registration order;
    block b goes to fragment b % F (strided). fragments=[[params], ...]: as given (frozen ones
    ignored). Indices within a fragment are sorted, so its buffer follows the model's order.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(trainable)}
    if isinstance(fragments, (list, tuple)):
        plan = [sorted(index.get(id(p), -1) for p in group if p.requires_grad)
                for group in fragments]
        every = sorted(i for group in plan for i in group)
        if every != list(range(len(trainable))) or not all(plan):
            raise ValueError(f"fragments: {len(plan)} lists holding {len(every)} trainable tensors "
                             f"must hold each of the model's {len(trainable)} trainable "
                             "parameters exactly once, and none may be empty")
        return plan
    count = check_int("fragments", fragments, low=1)
    blocks, seen = [], set()
    for module in model.modules():
        block = [index[id(p)] for p in module.parameters(recurse=False)
                 if id(p) in index and id(p) not in seen]
        seen.update(id(trainable[i]) for i in block)
        if block:
            blocks.append(block)
    if len(blocks) < count:
        raise ValueError(f"fragments={count} needs at least {count} modules with trainable "
                         f"parameters, the model has {len(blocks)}: pass fragments as lists of "
                         "parameters instead")
    return [sorted(i for block in blocks[f::count] for i in block) for f in range(count)]


def _grid(dtype, device) -> torch.Tensor:
    """E3M0's magnitudes, ascending: 0, then 2**-6 ... 2**0 (times the tensor's scale)."""
    return torch.tensor([0.0] + [2.0 ** -j for j in range(6, -1, -1)], dtype=dtype, device=device)


def encode_e3m0(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes of every element (two to a byte, uint8) and one float32 scale per tensor.

    E3M0 with a per-tensor scale s = max |x|: a sign bit and 3 bits choosing a magnitude among 0
    and s * 2**-j, j = 6..0, the nearest to |x| (a tie goes to the smaller). Why: pseudo-gradients
    spread over orders of magnitude, and powers of two keep a relative precision that a uniform
    4-bit grid (15 levels, steps of s / 7) loses for all but the largest values; the paper sends
    4-bit floats too.
    """
    codes, scales = [], []
    for t in tensors:
        flat = t.detach().reshape(-1)
        scale = flat.abs().max() if flat.numel() else flat.new_zeros(())
        ratio = flat.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
        grid = _grid(flat.dtype, flat.device)
        magnitude = torch.bucketize(ratio, (grid[:-1] + grid[1:]) / 2)  # nearest; ties go down
        negative = (flat < 0) & (magnitude > 0)
        codes.append((magnitude | (negative.long() << 3)).to(torch.uint8))
        scales.append(scale.float())
    code = torch.cat(codes)
    if code.numel() % 2:
        code = torch.cat([code, code.new_zeros(1)])
    return code[0::2] | (code[1::2] << 4), torch.stack(scales)


def decode_e3m0(packed: torch.Tensor, scales: torch.Tensor, like: list[torch.Tensor]) -> list:
    """The tensors encode_e3m0 encoded, in the shapes and dtypes of `like`."""
    code = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
    out, offset = [], 0
    for t, scale in zip(like, scales):
        c = code[offset:offset + t.numel()].long()
        offset += t.numel()
        magnitude = _grid(scale.dtype, scale.device)[c & 7] * scale
        out.append(torch.where(c >= 8, -magnitude, magnitude).to(t.dtype).view(t.shape))
    return out
