"""Data paths: the rank-aware sampler, and DALI pipelines sharded by rank.

DALI is optional: minidp.data.dali imports it only when a loader is built, so `import minidp.data`
works without it.
"""
from .dali import DaliImageLoader, image_folder_loader, list_image_folder
from .sampler import DistributedSampler

__all__ = ["DaliImageLoader", "DistributedSampler", "image_folder_loader", "list_image_folder"]
