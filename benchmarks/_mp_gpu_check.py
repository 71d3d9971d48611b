"""mp on one GPU: correctness against single, the traced ResNet-50 split, and mp overhead vs single."""
import json, statistics, sys, time
sys.path.insert(0, "tests")
import torch
from torch import nn
import paratrain
from pipeline_cases import train, weight_error

out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
single = train("single", steps=3, batch=12)
for m in (1, 3, "auto"):
    got = train("mp", steps=3, batch=12, microbatches=m, devices=["cuda:0", "cuda:0"])
    out[f"mp_{m}_weight_err"] = weight_error(got["weights"], single["weights"])
    out[f"mp_{m}_loss_err"] = max(abs(a - b) for a, b in zip(got["losses"], single["losses"]))
print(out, flush=True)

import torchvision
def resnet_times(strategy, **kw):
    run = paratrain.setup(strategy=strategy, seed=0, **kw)
    model = torchvision.models.resnet50(num_classes=1000)
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.001))
    x = torch.randn(120, 3, 128, 128, device=run.device); y = torch.randint(0, 1000, (120,), device=run.device)
    times = []
    for i in range(8):
        torch.cuda.synchronize(); t = time.perf_counter()
        run.forward_backward(model, x, y, nn.functional.cross_entropy); opt.step(); opt.zero_grad()
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    plan = getattr(model, "plan", None)
    return statistics.median(times[3:]), (plan.balance if plan else None)
res = {}
for name, strat, kw in [("single", "single", {}), ("mp_same_gpu", "mp", {"devices": ["cuda:0", "cuda:0"], "microbatches": 1}),
                        ("single2", "single", {}), ("mp_same_gpu_m6", "mp", {"devices": ["cuda:0", "cuda:0"], "microbatches": 6})]:
    res[name] = resnet_times(strat, **kw)
    print(name, res[name], flush=True)
out["resnet50"] = res
print(json.dumps(out, default=str))
