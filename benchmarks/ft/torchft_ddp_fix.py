"""torchft 0.2.0's DistributedDataParallel with its comm hook's error path mended (the `torchft-fixed` mode).

In torchft 0.2.0, once the Manager has seen an error in a step (a peer died mid all-reduce, or the
quorum's process group could not be configured because the replica hosting its store was just
killed), `Manager.allreduce` returns a `_DummyWork`, whose future is a plain torch Future, and a
`_ManagedWork` whose wait failed leaves its future chain unbuilt (`_fut` None); the DDP comm hook
does `assert fut._fut` on either, and the backward raises AttributeError or AssertionError, so the
survivors of a peer's failure die too (reported upstream: meta-pytorch/torchft issues 295 and 304,
PR 294 "Fix inconsistent return types", open at 0.2.0). This subclass's hook, once the Manager has
errored, hands the reducer a completed future of the bucket's local gradient instead: the commit
vote fails (the Manager has errored) and the replica goes on to the next quorum, as torchft
intends. Nothing else differs from torchft's class.
"""
import torch
import torch.distributed as dist
from torchft.ddp import DistributedDataParallel


class TolerantDistributedDataParallel(DistributedDataParallel):
    """torchft.DistributedDataParallel whose comm hook accepts the Manager's no-op work after an error.

    Args:
        manager: the torchft Manager.
        module: the model.
    """

    @staticmethod
    def _comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # (no `from __future__ import annotations` here: torch's DDP checks these annotations' objects)
        work = state.allreduce(bucket.buffer())
        work.wait()  # an error here is caught and reported to the Manager (the step will not commit)
        if state.errored() is None:
            # the future the reducer must get (torchft: "otherwise this can hang")
            return work.get_future()._fut
        # errored: the work is a _DummyWork (a plain Future), or a _ManagedWork whose wait failed and
        # whose future chain was never built (its _fut is None, and waiting on it never returns)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
