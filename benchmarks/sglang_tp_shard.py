"""SGLang 0.5.23 at TP=2 on the CPU (two processes over gloo, SGLang's own parallel runtime):
which Eagle3 draft ``fc`` layouts the projection takes on each rank, and which it refuses.

Each rank builds, as SGLang's drafts build them under tensor parallelism, the Kimi-K2.5
Eagle3 ``fc`` (``ColumnParallelLinear(K*H, H_draft, gather_output=False)``: this rank's
``[H_draft/2, K*H]`` rows) and the Llama Eagle3 one (``ReplicatedLinear``: the whole weight),
and asks the plugin's reader (``sglang_projection.draft_input_of``) for each draft. Prints
one JSON line per rank: the fc's weight shape, taken or refused, and the reason.

    ~/.cache/compile_pass/venv-sglang0.5.23/bin/python benchmarks/sglang_tp_shard.py

(``tests/test_sglang_tp.py`` runs it and asserts the result.)
"""

import json
import os
import socket
import sys
import tempfile

K, H, H_DRAFT, TP = 3, 64, 96, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node here)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _sgl_kernel_stub

    _sgl_kernel_stub.install()
    import torch
    from torch import nn
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.distributed.device_communicators import pynccl

    class _NoNccl:  # the CUDA wheel's PyNccl wants a CUDA device; on the CPU the groups use gloo alone
        def __init__(self, *args, **kwargs):
            self.available, self.disabled, self.world_size = False, True, 1

    pynccl.PyNcclCommunicator = _NoNccl
    from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from compile_pass.integrations import sglang_projection as sp

    sa = ServerArgs(model_path=model_dir, skip_tokenizer_init=True, load_format="dummy", device="cpu",
                    dtype="float32", tp_size=TP, disable_cuda_graph=True, chunked_prefill_size=-1,
                    max_total_tokens=1024)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    init_parallel_runtime(server_args=sa, device="cpu", dist_port=port)

    class Eagle3Inner(nn.Module):  # the attributes the plugin reads of an SGLang Eagle3 draft model
        def __init__(self, fc: nn.Module):
            super().__init__()
            self.num_aux_hidden_states = K
            self.fc = fc

    rows = []
    for name, fc in (("kimi_k25 ColumnParallelLinear(gather_output=False)",
                      ColumnParallelLinear(K * H, H_DRAFT, bias=False, gather_output=False)),
                     ("llama ReplicatedLinear", ReplicatedLinear(K * H, H_DRAFT, bias=False))):
        found, why = sp.draft_input_of(Eagle3Inner(fc))
        rows.append({"rank": rank, "fc": name, "weight": list(fc.weight.shape), "taken": found is not None,
                     "why": why, "out_features": found.projection.out_features if found is not None else None})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    torch.distributed.barrier()


def main() -> int:
    import torch.multiprocessing as mp

    model_dir = tempfile.mkdtemp(prefix="sglang_tp_shard_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
                   "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 1024,
                   "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False}, f)
    out = os.path.join(model_dir, "result")
    mp.start_processes(rank_main, args=(_free_port(), model_dir, out), nprocs=TP, join=True, start_method="spawn")
    for rank in range(TP):
        with open(f"{out}.{rank}") as f:
            for row in json.load(f):
                print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
