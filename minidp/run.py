"""`python -m minidp.run`: the launcher's command line (the code: minidp/launcher/cli.py)."""
from minidp.launcher.cli import main, run_main

__all__ = ["main"]

if __name__ == "__main__":
    run_main()
