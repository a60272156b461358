"""generate() on a parallelize(..., sequence_parallel=True) model (README: 'generate() works, not with SP'),
and on a torch.compile'd parallelized model. 2 gloo ranks."""
import os, sys, warnings, torch, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_compile import build

def main(rank, world, fam):
    torch.set_num_threads(1); warnings.filterwarnings("ignore")
    import torch.distributed as dist, llmmem.parallel as tp
    ref = build(fam).eval()
    prompt = torch.tensor([[5, 17, 33, 2]])
    want = ref.generate(prompt, max_new_tokens=5, do_sample=False)
    m = build(fam).eval(); tp.parallelize(m, dist.group.WORLD, sequence_parallel=True)
    try:
        got = m.generate(prompt, max_new_tokens=5, do_sample=False)
        print("SP generate:", got.tolist(), "ref", want.tolist())
    except Exception as e:
        print("SP generate raised:", type(e).__name__, str(e)[:600])
    try:
        out = m(input_ids=torch.randint(0, 128, (1, 6))).logits  # no labels, seq 6 divisible by 2
        print("SP forward no labels, logits shape", tuple(out.shape))
        out = m(input_ids=torch.randint(0, 128, (1, 5))).logits
        print("SP forward odd length, logits shape", tuple(out.shape))
    except Exception as e:
        print("SP forward raised:", type(e).__name__, str(e)[:600])
    m2 = build(fam).eval(); tp.parallelize(m2, dist.group.WORLD)
    m2.forward = torch.compile(m2.forward, backend="aot_eager", fullgraph=True)
    try:
        got = m2.generate(prompt, max_new_tokens=5, do_sample=False)
        print("compiled-forward generate:", got.tolist(), "ref", want.tolist(), "equal:", torch.equal(got, want))
    except Exception as e:
        print("compiled-forward generate raised:", type(e).__name__, "".join(traceback.format_exception(e))[-1500:])

if __name__ == "__main__":
    from llmmem.parallel.ranks import run_ranks
    for r in run_ranks(os.path.abspath(__file__), "main", 2, args=(sys.argv[1],), timeout=400, check=False):
        if r.rank == 0 or r.returncode: print(f"--- rank {r.rank} rc={r.returncode}\n" + "\n".join(l for l in r.output.splitlines() if "Warning" not in l)[-5000:])
