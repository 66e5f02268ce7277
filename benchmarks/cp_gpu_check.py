"""Context parallelism on CUDA (autopar/lower/context_parallel.py): torch's own ring
handlers for the CUDA SDPA kernels, which the CPU tests never reach.

Two ranks, a Plan with cp 2 through `autopar.compile`, the zoo Llama (2 layers, dim 256, 4 heads of 64, 2 KV heads, 256
tokens): 3 AdamW steps against one process, in fp32 (SDPA picks the memory-efficient
kernel) and bf16 (flash). NCCL with one GPU a rank when there are two; on one GPU
both ranks share it over gloo (CUDA tensors). Writes OUT/cp_gpu_check.json.

    python3 benchmarks/cp_gpu_check.py OUT
"""
from __future__ import annotations

import copy
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEPS, LR, SEQ = 3, 1e-3, 256


def _model(device, dtype):
    from autopar.zoo.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, seq_len=SEQ, dim=256, layers=2, heads=4, kv_heads=2, ffn_hidden=512)
    return Llama(cfg).to(device=device, dtype=dtype)


def _run(rank, world, port, results):
    import torch.nn.functional as F
    from autopar.lower import compile as ap_compile
    from autopar.lower import plan_for_model
    cuda = torch.cuda.is_available()  # without one: the same script on CPU (a dry run of this file)
    two_gpus = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if two_gpus else 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if two_gpus else "gloo", rank=rank, world_size=world)
    row = {"backend": dist.get_backend(), "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 512, (2, SEQ), generator=g).to(device),
                    torch.randint(0, 512, (2, SEQ), generator=g).to(device)) for _ in range(STEPS)]
        model = _model(device, dtype)
        ref, ref_losses = copy.deepcopy(model), []
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        for x, y in batches:
            loss = F.cross_entropy(ref(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        # through a Plan, as autopar runs it: the (dp, cp, tp) mesh, replicate over dp x cp, step_shard
        plan = plan_for_model(model, cp=world, seq_len=SEQ, micro_batch_size=2, precision="fp32")
        pm = ap_compile(model, plan=plan, example_inputs=lambda b: (torch.zeros(b, SEQ, dtype=torch.long),),
                        loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1).float(), t.flatten()),
                        optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR})
        losses = [pm.train_step((x,), y) for x, y in batches]
        got = pm.full_state_dict()
        want = dict(ref.named_parameters())
        row[name] = {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                     "param_diff": max((got[k].to(device) - want[k].detach()).abs().max().item() for k in want),
                     "losses": losses, "ref_losses": ref_losses}
    results.put((rank, row))
    dist.destroy_process_group()


def main(out: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "cp_gpu_check.json").write_text(json.dumps(rows, indent=1))
    r0 = rows[0]
    print(json.dumps({k: {m: v[m] for m in ("loss_diff", "param_diff")} if isinstance(v, dict) else v
                      for k, v in r0.items()}))
    ok = r0["fp32"]["loss_diff"] < 1e-4 and r0["bf16"]["loss_diff"] < 5e-2
    print("cp gpu check:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
