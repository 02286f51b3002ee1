"""The timeline drawing now lives in minidp.study.plot (explain draws it too); kept for old imports."""
from minidp.study.plot import plot_timelines

__all__ = ["plot_timelines"]
