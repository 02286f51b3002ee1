"""What minidp.DDP adds for looking inside: the timeline, the bucket plan, the automatic cap's timings.

A base class of minidp.DistributedDataParallel; none of it changes what is computed.
"""
from __future__ import annotations

from .timeline import OFF, ReducerRecorder, Timeline


class Inspection:
    """model.enable_timeline(), model.bucket_plan(), model.auto_bucket_cap."""

    def enable_timeline(self) -> Timeline:
        """Start recording gradient-ready, launch and completion events; returns the Timeline."""
        timeline = Timeline()
        self.reducer.recorder = ReducerRecorder(timeline, self.reducer)
        return timeline

    def disable_timeline(self) -> None:
        self.reducer.recorder = OFF

    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        names = self.reducer.names
        return [[names[i] for i in indices] for indices in self.reducer.layout.plan]

    @property
    def auto_bucket_cap(self):
        """With bucket_cap_mb="auto", the tuner (autocap.AutoCap: `.chosen`, `.medians()`); else None."""
        return self.reducer.layout.tuner
