"""minidp inside the frameworks that wrap a model in DDP for you (each imports its framework).

  lightning.py    Trainer(strategy="minidp") after `import minidp.lightning`
  accelerate.py   `from minidp.accelerate import Accelerator`

Their public names are minidp.lightning and minidp.accelerate (one-line modules beside __init__.py).
"""
