"""The test cluster's `train.py`: examples/toy.py saving its weights to weights.pt, after each rank has
noted where it runs (places/RANK.json), so a test can tell one job of 4 workers from two jobs of 2."""

import json
import os
import runpy
import socket
import sys
from pathlib import Path

TOY = Path(__file__).resolve().parents[2] / "examples" / "toy.py"

rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
place = {"rank": int(rank), "world": int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))),
         "node": os.environ.get("SLURMD_NODENAME", socket.gethostname())}
Path("places").mkdir(exist_ok=True)
Path("places", f"{rank}.json").write_text(json.dumps(place))
sys.argv = [str(TOY), *sys.argv[1:], "--save-weights", "weights.pt"]
runpy.run_path(str(TOY), run_name="__main__")
