"""List, packer and projected draft input inside vLLM's own compile stack (CPU), side by side.

    V=~/.cache/compile_pass/venv-vllm0.34.0/bin
    $V/python benchmarks/vllm_projection.py --backends eager --ks 3 --combines fc \\
        --out docs/results/vllm_projection_0.34_eager_k3_fc.json        # one (K, combine) a process
    $V/python benchmarks/vllm_projection.py --backends inductor --no-engine \\
        --out docs/results/vllm_projection_0.34_inductor_toy.json
    $V/python benchmarks/vllm_projection.py --render docs/results/vllm_projection_0.34_*.json

vLLM's compile state keeps every engine build alive (about 4 GB each for the 10-layer rank),
so a run holds one (K, combine) of the engine rank on a 24 GB machine; the Inductor engine
rank's compile does not fit it at all (docs/vllm.md).

For each model and K, one process builds the target three times through vLLM's
``VllmBackend`` (``@support_torch_compile``, VLLM_COMPILE split at attention, eager or
Inductor pieces) and runs the draft's input side as vLLM's Eagle3 speculator does:
``combine_hidden_states(torch.cat(aux, dim=-1))`` through the speculator's own ``torch``
global, with the draft's combine vLLM's ``Eagle3LlamaForCausalLM.combine_hidden_states``:

- ``list``: the plugin off (vLLM as shipped);
- ``packer``: ``COMPILE_PASS_VLLM=1`` (the captures one buffer, the concat a view);
- ``projected``: and ``COMPILE_PASS_VLLM_PROJECT=1`` (each capture projected into the
  draft's ``[T, H_draft]`` as it is made; the concat and the combine pass it on).

Models: ``models/vllm_style.py``'s decoder (fp32, H=256, 10 layers, 2048 tokens; K=3 at
Eagle3's layers (2, 5, 7), K=8 at layers 1-8) and one Llama 3.1 70B TP=8 rank
(``models/engine.py``: fused in-place add-RMSNorm, opaque attention, in-place all-reduce;
bf16, ``--engine-layers`` layers, 1024 tokens; K=3 Eagle3's layers, K=8 DFlash's spread).
The draft: ``H_draft`` = the target's hidden size (Eagle3), combine ``fc`` or
``norm_before_fc``.

overhead = (peak - peak of the same build without captures and without the draft's input)
/ packed bytes ``T*K*H``. ``model bitwise``: the target's output equals the uncompiled
no-capture model's. ``max abs / rel``: the projected draft input vs the list path's
(vLLM's cat then combine). ``agreement``: greedy tokens of a random ``[4096, H_draft]``
head over the draft's normed input, projected vs list, per token (a sensitivity check of
the draft's first step; the trained-draft acceptance is benchmarks/draft_acceptance.py).
"""

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from compile_pass import measure_peak  # noqa: E402
from compile_pass.integrations import vllm as plugin  # noqa: E402
from compile_pass.integrations import vllm_projection  # noqa: E402
import models.vllm_style as H  # noqa: E402

SETTINGS = ("list", "packer", "projected")


def _set(setting: str) -> None:
    plugin.uninstall()
    os.environ.pop(vllm_projection.ENV_PROJECT, None)
    if setting == "projected":
        os.environ[vllm_projection.ENV_PROJECT] = "1"
    if setting != "list":
        assert plugin.install()


def _speculator_cat(aux):
    import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as spec

    return spec.torch.cat(aux, dim=-1)


def measure(name, backend, make, inputs, warm, k, hidden, dtype, combine):
    """make(captures: bool) -> (cls, kwargs); one row per setting."""
    ref_cls, ref_kwargs = make(False)
    torch.manual_seed(0)
    ref = ref_cls(**ref_kwargs).eval()
    with torch.no_grad():
        rh = ref(*inputs)[0]
    state = ref.state_dict()
    del ref
    rows, listed = [], None
    head = torch.randn(4096, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    for setting in SETTINGS:
        _set(setting)
        draft = H.Eagle3Draft(k, hidden, hidden, combine, dtype=dtype).requires_grad_(False)
        if setting == "projected":
            assert vllm_projection.register_draft(draft)
        t = time.time()
        peaks, outs = {}, {}
        for caps in (False, True):
            cls, kwargs = make(caps)
            model, run, _ = H.build(backend, cls=cls, **kwargs)
            model.load_state_dict(state, strict=False)
            run(*warm)

            @torch.no_grad()
            def full(*x, run=run, draft=draft):
                h, aux = run(*x)
                return h, (draft.combine_hidden_states(_speculator_cat(aux)) if aux else None)

            p = measure_peak(full, *inputs)
            peaks[caps], outs[caps] = p.bytes, p.result
            del model, run, full, p
            torch._dynamo.reset()
            gc.collect()
        h, drafted = outs[True]
        nbytes = inputs[0].shape[0] * k * hidden * torch.tensor([], dtype=dtype).element_size()
        if setting == "list":
            listed = drafted
        diff = (drafted.float() - listed.float()).abs()
        norm = draft.model.fc_norm[0] if draft.model.fc_norm is not None else H.DraftRMSNorm(hidden, dtype=dtype)
        with torch.no_grad():
            tokens = [(norm(d) @ head.t()).argmax(-1) for d in (drafted, listed)]
        rows.append({
            "model": name, "pieces": backend, "k": k, "combine": combine, "setting": setting,
            "dtype": str(dtype).replace("torch.", ""),
            "peak_mib": round(peaks[True] / 2**20, 2), "peak_no_capture_mib": round(peaks[False] / 2**20, 2),
            "packed_mib": round(nbytes / 2**20, 2), "overhead": round((peaks[True] - peaks[False]) / nbytes, 3),
            "model_bitwise": bool(torch.equal(h, rh)),
            "max_abs": float(diff.max()), "max_rel": float(diff.max() / listed.float().abs().max()),
            "agreement": float((tokens[0] == tokens[1]).float().mean()),
            "projected_groups": plugin.stats["groups_projected"] if setting == "projected" else 0,
            "seconds": round(time.time() - t, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
        del draft, outs, h, drafted, diff, tokens
        gc.collect()
    _set("list")
    return rows


def render(paths) -> str:
    lines = ["| vllm | model | pieces | K | combine | list | packer | projected | model bitwise | "
             "projected vs list: max abs / rel | greedy agreement |", "|" + "---|" * 11]
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        groups = {}
        for r in result["rows"]:
            groups.setdefault((r["model"], r["pieces"], r["k"], r["combine"]), {})[r["setting"]] = r
        for (model, pieces, k, combine), by in groups.items():
            p = by["projected"]
            bitwise = "yes" if all(r["model_bitwise"] for r in by.values()) else "no"
            lines.append(f"| {result['vllm']} | {model} ({p['dtype']}) | {pieces} | {k} | {combine} | "
                         f"{by['list']['overhead']:.2f} | {by['packer']['overhead']:.2f} | {p['overhead']:.2f} | "
                         f"{bitwise} | {p['max_abs']:.2g} / {p['max_rel']:.2g} | {p['agreement']:.2%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", nargs="+", help="print result files as one markdown table, run nothing")
    ap.add_argument("--backends", default="eager,inductor")
    ap.add_argument("--ks", default="3,8")
    ap.add_argument("--combines", default="fc,norm_before_fc")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--engine-layers", type=int, default=10)
    ap.add_argument("--engine-tokens", type=int, default=1024)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    rows = []
    x = torch.randn(args.tokens, 256)
    layers = {3: (2, 5, 7), 8: tuple(range(1, 9))}
    for backend in args.backends.split(","):
        for k in [int(k) for k in args.ks.split(",")]:
            for combine in args.combines.split(","):
                def make(caps, k=k):
                    return H.VllmStyleDecoder, {"num_layers": 10, "capture_at": layers[k] if caps else ()}
                rows += measure("vllm_style", backend, make, (x,), (torch.randn(64, 256),), k, 256,
                                torch.float32, combine)
                if args.no_engine:
                    continue
                from models import engine

                cfg = engine.with_captures(engine.llama_3_1_70b(tp=8, num_layers=args.engine_layers), k)
                ids, pos = engine.example_inputs(cfg, args.engine_tokens)

                def make_engine(caps, cfg=cfg):
                    return H.EngineRank, {"cfg": cfg, "capture_mode": "list_out" if caps else "none"}
                rows += measure(f"llama_3_1_70b_tp8_{args.engine_layers}l", backend, make_engine, (ids, pos),
                                engine.example_inputs(cfg, 64), k, cfg.hidden_size, torch.bfloat16, combine)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "vllm": __import__("vllm").__version__, "argv": sys.argv[1:],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
