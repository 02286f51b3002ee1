"""The engine: what torch's DistributedDataParallel does, in files a learner reads in order.

  ddp.py          the nn.Module wrapper: verify and broadcast at construction, the collectives
                  before each forward, no_sync(), register_comm_hook(), join()
  reducer.py      one hook per parameter, buckets launched in order as they fill, and the
                  end-of-backward finalize that waits and writes the averaged gradients back
  layout.py       the buckets over training: built, rebuilt once in ready order, re-planned by "auto"
  planning.py     bucket planning (DDP's layout rules) and the automatic cap (bucket_cap_mb="auto")
  buckets.py      the flat buffers and their views: gradients copied in, reduced gradients written back
  hooks.py        GradBucket and the default all-reduce hook (DDP's comm-hook contract)
  collectives.py  coalesced broadcast, cross-rank agreement checks
  join.py         uneven inputs on torch's Join protocol
  static_graph.py static_graph=True: hook counts learned in the first iteration (unused, checkpointed)
  debug.py        debug mode: per-step fingerprints of what each rank reduces
  arguments.py    the constructor's checks before any collective: arguments, device_mesh, transport
  devices.py      one device per process: device_ids checked, inputs moved there as DDP does
  timeline.py     the event recorder behind model.enable_timeline()
  graph_split.py  a torch.compile backend that cuts the graph at bucket boundaries, so gradients
                  arrive during backward under torch.compile, in both wrapping orders
"""
