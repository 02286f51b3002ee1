"""Data paths beyond DistributedSampler. DALI is optional: minidp.data.dali imports it only when a
loader is built, so `import minidp.data` works without it."""
from .dali import DaliImageLoader, image_folder_loader, list_image_folder

__all__ = ["DaliImageLoader", "image_folder_loader", "list_image_folder"]
