import torch, json, time, sys
from peregrine.kernels.cute import task_gemv as tg
from peregrine.persistent import table as tb
name, B = sys.argv[1], int(sys.argv[2])
p = f".cute/libtask_gemv-48b{name}-b{B}.so"
comp = json.load(open(p[:-3] + ".json")); comp.pop("case")
g = torch.Generator(device="cuda").manual_seed(0)
def make(*s):
    if len(s) == 1: return 1 + 0.1 * torch.randn(s, device="cuda", generator=g)
    return (torch.randn(s, device="cuda", generator=g) * s[-1] ** -0.5).to(torch.bfloat16)
ops, width, consts, d = tg.case(name, make)
t0 = time.time(); t = tb.encode(ops, width, 132, B); print(name, B, "encoded", round(time.time() - t0, 2), flush=True)
run = tg.Runner(p, t, B, comp)
for step in range(2):
    act = torch.full((B, width), float("nan"), device="cuda"); tb.load_consts(act, consts); act[:, :d] = torch.randn(B, d, device="cuda")
    want = tb.reference(ops, act); torch.cuda.synchronize()
    t0 = time.time(); run.step(act); torch.cuda.synchronize(); print("step", step, "s", round(time.time() - t0, 4), "err", run.error(), "counters", run.counters.tolist(), flush=True)
    for o in ops:
        lo, hi = o.dst, o.dst + (ops[-1].n if hasattr(o, "n") else 0)
        cols = [(lo, hi)]
    print("rel", float((act - want).nan_to_num(1e9).norm() / want.norm()), "nan", int(act.isnan().sum()), flush=True)
    if name == "moe":
        sel = ops[1].dst; print("ids", act[0, sel:sel + 8].tolist(), want[0, sel:sel + 8].tolist(), flush=True)
from peregrine.bench.gpu import time_fn
import statistics
print("ms", statistics.median(time_fn(lambda: run.step(act), iters=30)), flush=True)
