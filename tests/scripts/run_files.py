"""Run Python files one after another in this one process, each as `__main__` in a namespace of its own.

    python tests/scripts/run_files.py a.py b.py ...

test_readme.py runs the README's one-process snippets this way: each is a file run as written (runpy,
as `python a.py` would), and the process's start (importing torch, seconds on 2 cores) is paid once.
Each file's output is framed by `=== <path> ===` and `=== <path> exit <status> ===` (0: it ran to
its end); a file that raises does not stop the next. The exit status is 1 if any file failed.
"""
import os
import runpy
import sys
import traceback


def main(paths) -> int:
    failed = False
    for path in paths:
        print(f"=== {path} ===", flush=True)
        status, cwd = 0, os.getcwd()
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:  # sys.exit() in a file ends that file, as it would end its process
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            os.chdir(cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"=== {path} exit {status} ===", flush=True)
        failed |= status != 0
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
