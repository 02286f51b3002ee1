"""Inside a rank: who am I, which backend, where do the ranks meet, and who is stuck.

  env.py         minidp.init(), DistEnv, minidp.shutdown(): args, torchrun's or SLURM's environment
  backend.py     NCCL or gloo, the collective timeout
  rendezvous.py  the store the ranks meet through (torchrun's agent's, or rank 0's)
  ranks.py       rank helpers: is_main, print0, barrier, local_rank_zero_first, get_logger
  watchdog.py    a thread that publishes where this rank is and names the ranks that did not arrive
"""
