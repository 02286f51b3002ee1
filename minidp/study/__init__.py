"""Tools for people studying DDP: explain a model's buckets, simulate a step at scale, draw timelines.

    python -m minidp.explain resnet18 --world-size 2      # buckets, hooks, timeline; checked against DDP
    python -m minidp.simulate --events resnet18_events.json  # one step at 2 ... 1,024 ranks
    python -m minidp.simulate --study benchmarks/results/compression_study.json   # time to target per method
    python -m minidp.simulate --memory --params 7.5B --ranks 64   # bytes per rank and sent, DDP vs ZeRO-1/2/3
    python -m minidp.simulate goodput   # restart from a checkpoint vs heal from a peer, 1,024 ... 16,384 GPUs

explain.py  runs a few real steps of a model on CPU ranks under minidp and torch DDP (record.py)
simulate.py predicts a step from a recorded timeline and an alpha-beta network model (network.py)
time_to_target.py  each communication method's time to a target loss at 8 ... 1,024 ranks, from
            benchmarks/compression/study.py's measurements (validation.py: --study's command, and --validate
            against the times measured on this machine)
memory_model.py  the ZeRO paper's memory and communication per rank (memory_table.py: --memory's table)
goodput.py  goodput under failures at 1,024 ... 16,384 GPUs, restart from a checkpoint vs heal from a
            live peer, analytic and Monte-Carlo (goodput_table.py: the goodput subcommand)
plot.py     draws timelines and scaling curves (matplotlib, imported only when drawing)
"""
