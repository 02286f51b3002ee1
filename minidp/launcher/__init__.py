"""Starting ranks and keeping them honest: no torch imported anywhere in this folder.

A launcher only starts, watches and restarts worker processes; importing torch would cost each
launcher seconds of CPU for nothing. tests/test_layout.py checks the rule.

  spawn.py       minidp.launch(fn, nprocs): the mp.spawn style, from Python (also a notebook)
  cli.py         python -m minidp.run: a script once per local rank, torchrun's environment, restarts
  supervisor.py  the parent side: watch the workers, stop them all when one fails, name the first
  worker.py      the child side: torchrun's environment, report an error to the parent, die with it
"""
