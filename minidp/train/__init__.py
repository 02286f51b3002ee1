"""Training helpers that data parallelism needs beside the engine.

  optim.py        LARS, LAMB, NovoGrad (large-batch optimizers), exclude_bias_and_norm
  lr.py           scaled_lr (linear / sqrt scaling with the world size), warmup_scheduler
  syncbn.py       SyncBatchNorm and convert_sync_batchnorm (CPU/gloo too); its autograd: syncbn_autograd.py
  metrics.py      all_reduce_sums: several sums in one all-reduce
  checkpoint.py   save_checkpoint / load_checkpoint: atomic, verified, every rank's RNG states
"""
