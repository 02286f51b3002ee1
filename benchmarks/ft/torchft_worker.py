"""One replica group (of one process) under torchft 0.2.0's DDP: Manager, DistributedDataParallel, Optimizer.

    python benchmarks/ft/torchft_worker.py --replica 0 --replicas 3 --lighthouse http://HOST:PORT \\
        --log-dir LOGS --schedule SCHEDULE.json --run-start T0 --deadline T1

torchft_side.py starts one per replica and restarts a dead one alone. The process hosts its replica
group's TCPStore (a group of one) and its Manager server; the Manager asks the lighthouse for a
quorum at every step (zero_grad, asynchronously), heals a process that starts behind its peers
from a live one (torchft's HTTP checkpoint transport), all-reduces the gradients over the quorum's
gloo group, and votes on the commit (Optimizer.step steps only if every rank of the group agrees).
A commit is logged when the Manager's step count went up by one in Optimizer.step. With
--fix-dummy-work the DDP class is torchft_ddp_fix.py's (torchft 0.2.0's comm hook raises in the
backward after any error in the step, so a failure's survivors die too; see that file).
An injected exception is not caught: the process dies (exit 1) and its supervisor restarts it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from event_log import EventLog, add_run_arguments  # noqa: E402 - before torch's import: "start" is the process's start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--replica", type=int, required=True, help="this replica group's id")
    p.add_argument("--replicas", type=int, required=True, help="replica groups in the run (the data's stride)")
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address")
    p.add_argument("--batch", type=int, default=64, help="samples per replica and step (default 64)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="the gloo collective timeout and the Manager's (commit vote, healing), s (default 3)")
    p.add_argument("--fix-dummy-work", action="store_true",
                   help="use torchft_ddp_fix.py's DDP (torchft 0.2.0's comm hook crashes after an error)")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="the Manager's quorum timeout, s (default 60)")
    return p.parse_args(argv)


def train(a: argparse.Namespace, log: EventLog) -> None:
    """Build the replica and train until the deadline, logging each committed step."""
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from workload import Injector, make_data, make_model

    torch.set_num_threads(1)
    if os.environ.get("RUST_LOG", "").lower() in ("info", "debug"):  # torchft's Python logs with its Rust ones
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    injector = Injector(a.schedule, a.replica, a.run_start, hang_s=a.hang_s)
    # the replica group's own store (torchft's integration tests do the same): the Manager's server
    # advertises it; the quorum's gloo group meets in the store of the quorum's chosen replica
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica_{a.replica}", store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=a.lighthouse,
                      hostname="127.0.0.1", timeout=timeout, quorum_timeout=timedelta(seconds=a.quorum_timeout),
                      connect_timeout=timedelta(seconds=10))
    if a.fix_dummy_work:
        from torchft_ddp_fix import TolerantDistributedDataParallel as DistributedDataParallel  # noqa: F811
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    x, y = make_data()
    loss_fn = torch.nn.CrossEntropyLoss()
    while time.time() < a.deadline:
        opt.zero_grad()  # starts this step's quorum (asynchronously)
        first = ((manager.current_step() * a.replicas + a.replica) * a.batch) % len(x)
        idx = torch.arange(first, first + a.batch) % len(x)
        loss = loss_fn(ddp(x[idx]), y[idx])
        log.poll(injector)  # mid-step: log a due failure, then raise, SIGKILL, or sleep
        loss.backward()  # the quorum's replicas meet here: gradient all-reduce
        manager.wait_quorum()  # done by now (the all-reduce waited for it); a heal has set the step
        before = manager.current_step()
        opt.step()  # the commit vote; steps the SGD only if it passed
        if manager.current_step() == before + 1:
            log.commit(before)
    manager.shutdown(wait=False)


def main(argv=None) -> None:
    a = parse_args(argv)
    log = EventLog(a.log_dir, a.replica)
    code = 0
    if time.time() < a.deadline:
        try:
            train(a, log)
        except BaseException:  # the process dies, as torchft leaves it to: its supervisor restarts it
            traceback.print_exc()
            code = 1
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not interpreter exit: it would join torchft's quorum thread, maybe mid-RPC


if __name__ == "__main__":
    main()
