"""`from minidp.accelerate import Accelerator` (the code: minidp/integrations/accelerate.py)."""
from minidp.integrations.accelerate import *  # noqa: F401, F403
from minidp.integrations.accelerate import __all__  # noqa: F401
