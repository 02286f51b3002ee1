"""`import minidp.lightning`: registers Trainer(strategy="minidp") (the code: minidp/integrations/lightning.py)."""
from minidp.integrations.lightning import *  # noqa: F401, F403  the import registers the strategies
from minidp.integrations.lightning import __all__  # noqa: F401
