"""The SGLang plugin on the installed sglang 0.5.23: plugin off vs on, in one process.

Loads the plugin through SGLang's own loader (``sglang.srt.plugins.load_plugins`` with
``COMPILE_PASS_SGLANG=1 SGLANG_PLUGINS=aux_capture``), checks what it replaced in SGLang's
real modules (the Llama model file, the logits processor), then measures a capture loop
that collects into the class SGLang's ``llama.py`` module now names (``AuxHiddenStateList``,
``capture(h)`` as the Llama layers call it) and packs with the function SGLang's logits
processor now names (``pack_aux_hidden_states``), against the same loop with SGLang's
original class and function. The decoder layers are a stand-in (a matmul + residual per
layer, not SGLang code): what is real SGLang is the collector, the pack and the hooks.

overhead = (peak - peak without captures) / packed bytes; bitwise: packed equal.

    python benchmarks/sglang_capture.py [--tokens 2048 --hidden 512 --layers 12 --out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("COMPILE_PASS_SGLANG", "1")
os.environ.setdefault("SGLANG_PLUGINS", "aux_capture")

import torch  # noqa: E402


def _loop(layers, x, capture_layers, collector_cls, pack):
    hidden, residual = x, torch.zeros_like(x)
    aux = collector_cls() if collector_cls is not None else None
    for i, w in enumerate(layers):
        if aux is not None and i in capture_layers:
            aux.capture(hidden + residual)  # borrowed value: SGLang's list clones it
        residual = hidden + residual
        hidden = torch.tanh(residual @ w)
    if aux is None:
        return hidden, None
    packed = pack(aux)
    del aux
    return hidden, packed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import sglang
    from sglang.srt.plugins import load_plugins

    import sglang.srt.layers.aux_hidden_states as aux_mod
    import sglang.srt.layers.logits_processor as lp
    import sglang.srt.models.llama as llama

    from sglang.srt.model_executor.model_runner import ModelRunner

    orig_list, orig_pack = aux_mod.AuxHiddenStateList, aux_mod.pack_aux_hidden_states
    orig_forward = ModelRunner.forward
    load_plugins()
    from compile_pass.integrations import sglang as plugin
    from compile_pass.memory import measure_peak
    checks = {
        "sglang": sglang.__version__,
        "plugin_active": plugin.STATE["active"],
        "llama_list_replaced": llama.AuxHiddenStateList is not orig_list
        and issubclass(llama.AuxHiddenStateList, orig_list),
        "logits_pack_replaced": lp.pack_aux_hidden_states is not orig_pack
        and getattr(lp.pack_aux_hidden_states, "__wrapped__", None) is orig_pack,
        "runner_forward_wrapped": ModelRunner.forward is not orig_forward
        and getattr(ModelRunner.forward, "__wrapped__", None) is orig_forward,
        "original_kept": plugin.STATE["orig_list"] is orig_list,
    }
    torch.manual_seed(0)
    rows = []
    for name, k in (("eagle3", 3), ("dflash", 8)):
        layers = [torch.randn(a.hidden, a.hidden) / a.hidden ** 0.5 for _ in range(a.layers)]
        cap = set(range(1, a.layers, max(1, a.layers // k))[:k]) if k < a.layers else set(range(k))
        cap = set(sorted(cap)[:k])
        assert len(cap) == k, cap
        x = torch.randn(a.tokens, a.hidden)
        packed_bytes = a.tokens * a.hidden * k * 4
        base = measure_peak(_loop, layers, x, cap, None, None).bytes
        off = measure_peak(_loop, layers, x, cap, orig_list, orig_pack)
        tok = plugin._num_captures.set(k)  # what the ModelRunner.forward hook sets
        try:
            on = measure_peak(_loop, layers, x, cap, llama.AuxHiddenStateList,
                              lp.pack_aux_hidden_states)
        finally:
            plugin._num_captures.reset(tok)
        p_off, p_on = off.result[1], on.result[1]
        rows.append({
            "config": f"{name} K={k}", "tokens": a.tokens, "hidden": a.hidden,
            "packed_MiB": packed_bytes / 2**20,
            "overhead_off": round((off.bytes - base) / packed_bytes, 3),
            "overhead_on": round((on.bytes - base) / packed_bytes, 3),
            "bitwise": bool(torch.equal(p_off, p_on)),
            "model_output_equal": bool(torch.equal(off.result[0], on.result[0])),
            "on_is_one_buffer": p_on.untyped_storage().nbytes() == packed_bytes,
        })
    res = {"checks": checks, "rows": rows, "fallbacks": plugin.STATE["fallbacks"]}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
