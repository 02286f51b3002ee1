"""`python -m minidp.explain MODEL`: what DDP does with your model (see minidp/study/explain.py)."""
import sys

from minidp.study.explain import explain, format_report, main

__all__ = ["explain", "format_report", "main"]

if __name__ == "__main__":
    sys.exit(main())
