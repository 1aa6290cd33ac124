"""Build DeepSpeed's one CPU op up front: ``DS_ACCELERATOR=cpu python tests/deepspeed_warmup.py``.

DeepSpeed 0.19.8 on the CPU accelerator compiles ``deepspeed_shm_comm`` (its shared-memory collectives) with g++
the first time a process initialises ``deepspeed.comm`` (about 3 minutes on 2 cores), into the torch extensions
cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``). Run once before the tests, so that the first
2-process test (tests/test_deepspeed_zero3.py) does not spend its timeout compiling. Prints where the op is.
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    started = time.monotonic()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        sys.exit(
            f"DeepSpeed's accelerator {get_accelerator()._name!r} has no ShareMemCommBuilder (DS_ACCELERATOR=cpu?)"
        )
    module = builder.load()
    print(f"{builder.absolute_name()} ready in {time.monotonic() - started:.0f} s: {module.__file__}")
