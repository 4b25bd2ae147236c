"""List, packer and projected draft input inside vLLM's own compile stack (CPU), side by side.

    V=~/.cache/compile_pass/venv-vllm0.34.0/bin
    $V/python benchmarks/vllm_projection.py --backends eager --ks 3 --combines fc \\
        --out docs/results/vllm_projection_0.34_eager_k3_fc.json        # one (K, combine) a process
    $V/python benchmarks/vllm_projection.py --backends inductor --no-engine \\
        --out docs/results/vllm_projection_0.34_inductor_toy.json
    $V/python benchmarks/vllm_projection.py --backends eager,inductor --modes VLLM_COMPILE,DYNAMO_TRACE_ONCE \
        --ks 3 --combines fc,norm_before_fc,fc_norms --no-engine --draft real --h-draft 192 \
        --out docs/results/vllm_projection_0.34_real_draft_k3.json     # vLLM's own draft class
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
The draft: ``H_draft`` = the target's hidden size (Eagle3) unless ``--h-draft``, combine
``fc``, ``norm_before_fc`` or ``fc_norms``; ``--draft real`` builds vLLM's own
``Eagle3LlamaForCausalLM`` through its loader from config folders after each target
(``models/vllm_drafts.py``; its patched ``__init__`` registers it), ``standin`` the
``models/vllm_style.Eagle3Draft`` laid out as it. The ``vllm_style`` decoder captures
``hidden + residual`` (vLLM's ``_maybe_add_hidden_state``); ``--modes DYNAMO_TRACE_ONCE``
compiles it as one graph (vLLM's CPU platform's mode).

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
import tempfile
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


def _speculator_cat(aux, speculator="eagle3"):
    """The concat each speculator forms its draft's input with (its module's ``torch``)."""
    if speculator == "eagle3":
        import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as spec
    else:  # DFlash, DFlash2 and DSpark stage and combine through DFlashSpeculator's
        import vllm.v1.worker.gpu.spec_decode.dflash.speculator as spec

    return spec.torch.cat(aux, dim=-1)


def _engine(kind, hidden, h_draft, dtype, combine, capture_layers, speculator="eagle3"):
    """``real``: an engine's configs with vLLM's own draft of ``speculator`` (Eagle3's
    ``Eagle3LlamaForCausalLM`` by default; ``models/vllm_drafts.SPECULATORS``); the target is
    built under the engine's speculative config, as vLLM builds both, so its compile projects
    into that engine's draft. ``standin``: None."""
    if kind != "real":
        return None
    from models.vllm_drafts import eagle3_engine

    if not capture_layers:
        raise SystemExit("--draft real needs the target's capture layers (the vllm_style rows: --no-engine)")
    return eagle3_engine(tempfile.mkdtemp(prefix="cp-vllm-draft-"), hidden=hidden, h_draft=h_draft,
                         layers=max(capture_layers) + 2, capture_layers=capture_layers, combine=combine, dtype=dtype,
                         speculator=speculator)


def _draft(engine, k, hidden, h_draft, dtype, combine):
    """The draft whose combine reads the captures: the engine's, built by vLLM's loader
    (registered by its patched ``__init__`` when projecting), or ``models/vllm_style``'s
    ``Eagle3Draft`` laid out as vLLM's (registered here)."""
    if engine is not None:
        draft = engine.build_draft()
        if plugin._projecting():
            assert vllm_projection.draft_name(engine.config) is not None, "the real draft did not register"
        return draft
    draft = H.Eagle3Draft(k, hidden, h_draft, combine, dtype=dtype).requires_grad_(False)
    if plugin._projecting():
        assert vllm_projection.register_draft(draft)
    return draft


def measure(name, backend, make, inputs, warm, k, hidden, dtype, combine, draft_kind="standin", h_draft=None,
            capture_layers=(), mode="VLLM_COMPILE", speculator="eagle3"):
    """make(captures: bool) -> (cls, kwargs); one row per setting. The target is built, then
    its draft (as vLLM's ``load_model``), then compiled by its first call."""
    ref_cls, ref_kwargs = make(False)
    torch.manual_seed(0)
    ref = ref_cls(**ref_kwargs).eval()
    with torch.no_grad():
        rh = ref(*inputs)[0]
    state = ref.state_dict()
    del ref
    rows, listed = [], None
    h_draft = h_draft or hidden
    head = torch.randn(4096, h_draft, generator=torch.Generator().manual_seed(7)).to(dtype)
    for setting in SETTINGS:
        _set(setting)
        t = time.time()
        peaks, outs = {}, {}
        engine = _engine(draft_kind, hidden, h_draft, dtype, combine, capture_layers, speculator)
        spec = engine.speculative_config if engine is not None else None
        draft = None
        for caps in (False, True):
            cls, kwargs = make(caps)
            model, run, _ = H.build(backend, cls=cls, mode=mode, speculative_config=spec, **kwargs)
            model.load_state_dict(state, strict=False)
            draft = draft or _draft(engine, k, hidden, h_draft, dtype, combine)  # after the target, as load_model
            run(*warm)

            @torch.no_grad()
            def full(*x, run=run, draft=draft):
                h, aux = run(*x)
                return h, (draft.combine_hidden_states(_speculator_cat(aux, speculator)) if aux else None)

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
        norm = H.DraftRMSNorm(h_draft, dtype=dtype)
        with torch.no_grad():
            tokens = [(norm(d) @ head.t()).argmax(-1) for d in (drafted, listed)]
        rows.append({
            "model": name, "pieces": backend if mode == "VLLM_COMPILE" else f"{backend}, one graph", "k": k,
            "combine": combine, "speculator": speculator, "setting": setting, "draft": type(draft).__name__ if draft_kind == "real"
            else "stand-in", "hidden": hidden, "h_draft": h_draft, "capture": "hidden + residual" if name == "vllm_style" else "clone",
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
    lines = ["| vllm | model | draft | pieces | K | combine | list | packer | projected | floor | model bitwise | "
             "projected vs list: max abs / rel | greedy agreement |", "|" + "---|" * 13]
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        groups = {}
        for r in result["rows"]:
            groups.setdefault((r["model"], r.get("draft", "stand-in"), r["pieces"], r["k"], r["combine"]),
                              {})[r["setting"]] = r
        for (model, draft, pieces, k, combine), by in groups.items():
            p = by["projected"]
            bitwise = "yes" if all(r["model_bitwise"] for r in by.values()) else "no"
            floor = f"{p['h_draft'] / (k * p['hidden']):.3f}" if "hidden" in p else "-"
            lines.append(f"| {result['vllm']} | {model} ({p['dtype']}) | {draft} | {pieces} | {k} | {combine} | "
                         f"{by['list']['overhead']:.2f} | {by['packer']['overhead']:.2f} | {p['overhead']:.3f} | "
                         f"{floor} | "
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
    ap.add_argument("--draft", choices=("standin", "real"), default="standin",
                    help="real: vLLM's Eagle3LlamaForCausalLM built by its loader (models/vllm_drafts.py)")
    ap.add_argument("--speculators", default="eagle3",
                    help="with --draft real: eagle3, dflash, dflash2, dspark (models/vllm_drafts.SPECULATORS); "
                         "the DFlash family's combine is fc alone")
    ap.add_argument("--h-draft", type=int, help="the draft's width (default: the target's hidden size)")
    ap.add_argument("--modes", default="VLLM_COMPILE", help="VLLM_COMPILE (pieces), DYNAMO_TRACE_ONCE (one graph)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    rows = []
    x = torch.randn(args.tokens, 256)
    layers = {3: (2, 5, 7), 8: tuple(range(1, 9))}
    for backend, mode in [(b, m) for b in args.backends.split(",") for m in args.modes.split(",")]:
        for k in [int(k) for k in args.ks.split(",")]:
            for speculator, combine in [(s, c) for s in args.speculators.split(",") for c in args.combines.split(",")
                                        if s == "eagle3" or c == "fc"]:
                def make(caps, k=k):
                    return H.VllmStyleDecoder, {"num_layers": 10, "capture_at": layers[k] if caps else ()}
                rows += measure("vllm_style", backend, make, (x,), (torch.randn(64, 256),), k, 256,
                                torch.float32, combine, draft_kind=args.draft, h_draft=args.h_draft,
                                capture_layers=layers[k], mode=mode, speculator=speculator)
                if args.no_engine:
                    continue
                from models import engine

                cfg = engine.with_captures(engine.llama_3_1_70b(tp=8, num_layers=args.engine_layers), k)
                ids, pos = engine.example_inputs(cfg, args.engine_tokens)

                def make_engine(caps, cfg=cfg):
                    return H.EngineRank, {"cfg": cfg, "capture_mode": "list_out" if caps else "none"}
                rows += measure(f"llama_3_1_70b_tp8_{args.engine_layers}l", backend, make_engine, (ids, pos),
                                engine.example_inputs(cfg, 64), k, cfg.hidden_size, torch.bfloat16, combine,
                                draft_kind=args.draft, h_draft=args.h_draft, capture_layers=cfg.capture_layers,
                                mode=mode)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "vllm": __import__("vllm").__version__, "argv": sys.argv[1:],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
