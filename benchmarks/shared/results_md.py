"""Write one generated section of a markdown file (RESULTS.md) between its markers, keeping the rest.

Used by gpu/gpu_check.py and compression/compression_report.py; it imports nothing heavy (gpu_check.py
runs without torchvision).
"""
from __future__ import annotations

import os
import re


def write_section(path: str, tag: str, text: str) -> None:
    """Put `text` between `tag`'s markers in `path`, keeping the rest of the file."""
    begin, end = f"<!-- BEGIN {tag} -->", f"<!-- END {tag} -->"
    old = open(path).read() if os.path.exists(path) else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    block = f"{begin}\n{text}\n{end}"
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)
