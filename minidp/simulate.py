"""`python -m minidp.simulate`: one data-parallel step at 2 ... 1,024 ranks (see minidp/study/simulate.py);
`python -m minidp.simulate goodput`: goodput under failures, restart vs heal (minidp/study/goodput.py)."""
import sys

from minidp.study.simulate import Profile, main, scaling, simulate_step

__all__ = ["Profile", "main", "scaling", "simulate_step"]

if __name__ == "__main__":
    sys.exit(main())
