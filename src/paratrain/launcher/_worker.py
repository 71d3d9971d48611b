"""Entry point of one `paratrain.launch` worker: unpickle the function, run it, report."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path


def main(workdir: Path) -> int:
    rank = int(os.environ["RANK"])
    try:
        import cloudpickle

        fn, args, kwargs = cloudpickle.loads((workdir / "payload.pkl").read_bytes())
        result = fn(*args, **kwargs)
        tmp = workdir / f".result-{rank}.pkl"
        tmp.write_bytes(cloudpickle.dumps(result))
        tmp.rename(workdir / f"result-{rank}.pkl")
        return 0
    except BaseException:
        failed_at = time.time()
        text = traceback.format_exc()
        sys.stderr.write(text)
        tmp = workdir / f".error-{rank}.json"
        tmp.write_text(json.dumps({"time": failed_at, "traceback": text}))
        tmp.rename(workdir / f"error-{rank}.json")
        return 1
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
