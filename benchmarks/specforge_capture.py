"""SpecForge 0.2.0's offline capture on its pinned sglang 0.5.14, on the CPU: plugin off vs on.

SpecForge's own ``OfflineSGLangCaptureBackend`` (``capture_eagle3``: ``ScheduleBatch`` ->
``ForwardBatch`` -> ``ModelRunner.forward``, FULL capture of every token, its wrapped logits
processor) over SGLang 0.5.14's real ``LlamaForCausalLM`` (tiny random config, dummy weights,
fp32) built by SGLang's ``ModelRunner`` on the CPU. ``OfflineSGLangCaptureBackend.build``
itself asks for ``torch.cuda.current_device()``, so the runner is built here with the same
arguments on ``device="cpu"`` and handed to the backend's constructor.

Four runs in one process: no captures (the base), captures with the plugin off (0.5.14's
plain list and ``torch.cat``), then ``compile_pass.integrations.sglang.enable()`` and the same
capture compiled with the pass off (``COMPILE_PASS_SGLANG_REWRITE=0``: what compiling alone
changes) and on (the inner model compiled on the first call; the second call is measured); last, the compiled base (the same compile, no capture layers). Overhead =
(peak - base peak) / packed bytes, against the eager base and, for compiled runs, the compiled
base too.

Shims, CPU only, both import-level: an import-only stand-in for ``sgl_kernel`` (its CPU build
is not on PyPI; nothing here calls it), and SGLang's own ``unified_attention_with_output``
registered for the CPU too (SGLang registers it for CUDA/NPU/XPU/MUSA; the function is
SGLang's, unchanged).

    K=7 INNER=inductor python benchmarks/specforge_capture.py [out.json]
    # env: K (3: Eagle3's default layers; else DFlash-style layers 0..K-1), LAYERS, NREQ, LEN,
    # INNER (the plugin's COMPILE_PASS_SGLANG_INNER), NO_CPU_ATTENTION=1 (no CPU kernel for
    # SGLang's attention op: the compiled forward fails and the plugin falls back to eager)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ.setdefault("COMPILE_PASS_SGLANG_INNER", os.environ.get("INNER", "inductor"))

import _sgl_kernel_stub  # noqa: E402  (benchmarks/, on sys.path as the script's folder)

_sgl_kernel_stub.install()

import torch  # noqa: E402
import sglang.srt.utils.common as _sglang_common  # noqa: E402

_register = _sglang_common.direct_register_custom_op


def _register_cpu_too(op_name, op_func, mutates_args, fake_impl=None, target_lib=None):
    """SGLang's registration, plus the same function as the op's CPU kernel."""
    _register(op_name, op_func, mutates_args, fake_impl=fake_impl, target_lib=target_lib)
    try:
        (target_lib or _sglang_common.sglang_lib).impl(op_name, op_func, "CPU")
    except RuntimeError:  # already has one
        pass


if os.environ.get("NO_CPU_ATTENTION") != "1":  # NO_CPU_ATTENTION=1: the plugin's fallback
    _sglang_common.direct_register_custom_op = _register_cpu_too

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend  # noqa: E402
from specforge.offline_capture.sglang_backend.utils import wrap_offline_eagle3_logits_processors  # noqa: E402

from compile_pass.memory import measure_peak  # noqa: E402

HIDDEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_backend(layers: int) -> OfflineSGLangCaptureBackend:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "torch_dtype": "float32", "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    path = tempfile.mkdtemp(prefix="specforge_tiny_model_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    # SpecForge's build() arguments, on the CPU
    server_args = ServerArgs(model_path=path, skip_tokenizer_init=True, load_format="dummy",
                             device="cpu", dtype="float32", enable_return_hidden_states=True,
                             disable_cuda_graph=True, chunked_prefill_size=-1, tp_size=1, pp_size=1,
                             max_total_tokens=8192, mem_fraction_static=0.5,
                             attention_backend="torch_native")
    runner = ModelRunner(model_config=ModelConfig.from_server_args(server_args),
                         mem_fraction_static=server_args.mem_fraction_static, gpu_id=0, tp_rank=0,
                         tp_size=1, moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1,
                         nccl_port=_free_port(), server_args=server_args, is_draft_worker=False)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    wrap_offline_eagle3_logits_processors(runner.model)
    return OfflineSGLangCaptureBackend(runner)


def main() -> None:
    k = int(os.environ.get("K", 7))
    layers = int(os.environ.get("LAYERS", 16))
    nreq, length = int(os.environ.get("NREQ", 4)), int(os.environ.get("LEN", 512))
    backend = build_backend(layers)
    model = backend.model_runner.model
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (nreq, length))

    def capture():
        return backend.capture_eagle3(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      loss_mask=torch.ones_like(ids))

    base = measure_peak(capture).bytes  # no capture layers: FULL stores the final hidden state
    if k == 3:
        backend.set_eagle3_capture_layers()
    else:
        backend.set_capture_layers(list(range(k)), capture_method="dflash")
    off = measure_peak(capture)
    aux_off = [r.clone() for r in off.result[1]]
    last_off = [r.clone() for r in off.result[2]]

    from compile_pass.integrations import sglang as plugin
    from compile_pass.integrations import sglang_compile

    active = plugin.enable()

    def compiled_peak(rewrite: bool):
        sglang_compile.reset(model)
        torch._dynamo.reset()
        os.environ[sglang_compile.ENV_REWRITE] = "1" if rewrite else "0"
        capture()  # the first call compiles
        return measure_peak(capture)

    compiled_off = compiled_peak(False)  # compiled, the pass off (the logits hook still on)
    aux_compiled_off = [r.clone() for r in compiled_off.result[1]]
    on = compiled_peak(True)
    # the compiled base: the same compile without capture layers (installed directly: the
    # plugin compiles only capturing batches)
    layers_to_capture = list(model.model.layers_to_capture)
    model.model.layers_to_capture, model.capture_aux_hidden_states = [], False
    sglang_compile.reset(model)
    torch._dynamo.reset()
    sglang_compile._install(backend.model_runner)
    capture()
    compiled_base = measure_peak(capture).bytes
    model.model.layers_to_capture, model.capture_aux_hidden_states = layers_to_capture, True
    packed = nreq * length * HIDDEN * k * 4
    result = {
        "sglang": __import__("sglang").__version__, "specforge": "0.2.0", "torch": torch.__version__,
        "model": type(model).__name__, "layers": layers, "K": k,
        "capture_layers": list(model.model.layers_to_capture), "tokens": nreq * length,
        "inner": sglang_compile.STATE["inner"], "plugin_active": active,
        "plugin_layout": plugin.STATE["layout"],
        "overhead_off": round((off.bytes - base) / packed, 3),
        "overhead_compiled_pass_off": round((compiled_off.bytes - base) / packed, 3),
        "overhead_on": round((on.bytes - base) / packed, 3),
        "compiled_pass_off_bitwise": all(torch.equal(a, b) for a, b in zip(aux_off, aux_compiled_off)),
        "overhead_on_vs_compiled_base": round((on.bytes - compiled_base) / packed, 3),
        "overhead_compiled_pass_off_vs_compiled_base": round((compiled_off.bytes - compiled_base) / packed, 3),
        "peak_compiled_base": compiled_base, "peak_off": off.bytes, "peak_on": on.bytes, "peak_base": base,
        "aux_bitwise": len(aux_off) == len(on.result[1])
        and all(torch.equal(a, b) for a, b in zip(aux_off, on.result[1])),
        "aux_max_abs_vs_plugin_off": max(float((a - b).abs().max()) for a, b in zip(aux_off, on.result[1])),
        "last_hidden_bitwise": all(torch.equal(a, b) for a, b in zip(last_off, on.result[2])),
        "compiled": sglang_compile.STATE["compiled"], "failed": sglang_compile.STATE["failed"],
        "packed_views": sglang_compile.STATE["packed"],
    }
    print(json.dumps(result))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
