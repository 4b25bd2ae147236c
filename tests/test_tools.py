"""The repository's tools (``tools/``): the requirements reader behind ``make vllm``'s
``--no-deps`` install, the seam table of ``make engines-latest``, the fuzz batches' totals, the
docs' tables from results files."""

import importlib.metadata
import zipfile

import pytest

from compile_pass.integrations.seams import Patch, Probe, Seam, SeamAbsent, SeamMoved, probe, report
from tools import engine_seams, fuzz_runs, requirements_of, results_table


def test_canonical_names():
    assert requirements_of.canonical_name("Flashinfer_Python==0.7.3") == "flashinfer-python"
    assert requirements_of.canonical_name("torch>=2.11; python_version > '3.9'") == "torch"
    with pytest.raises(ValueError, match="not a requirement"):
        requirements_of.canonical_name("==1.0")


def _wheel(tmp_path, requires):
    path = tmp_path / "eng-1.0-py3-none-any.whl"
    metadata = "Metadata-Version: 2.1\nName: eng\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("eng-1.0.dist-info/METADATA", metadata)
    return str(path)


def test_requirements_with_overrides_and_no_extras(tmp_path):
    wheel = _wheel(tmp_path, ["torch==2.14.0", "flashinfer-python==0.7.3", "protobuf>=5; platform_machine != 's390x'",
                              "protobuf==7; platform_machine == 's390x'", "pandas; extra == \"bench\""])
    got = requirements_of.requirements("eng", ["flashinfer_python==0.7.4", "protobuf>=6"], wheel=wheel)
    assert got == ["torch==2.14.0", "flashinfer_python==0.7.4", "protobuf>=6"]  # one line per overridden name
    with pytest.raises(SystemExit, match="--override names no requirement of eng: numpy"):
        requirements_of.requirements("eng", ["numpy==1"], wheel=wheel)


def test_requirements_of_an_installed_distribution():
    assert any(requirements_of.canonical_name(r) == "pluggy" for r in requirements_of.requirements("pytest"))
    assert importlib.metadata.version("pytest")


def test_engine_seams_summary_names_what_moved():
    def ok():
        return [Patch(object, "x", 1)]

    def moved():
        raise SeamMoved("f(a, b) differs")

    def gone():
        raise SeamAbsent("no module m")

    probes = probe([Seam("a.ok", "c", "r", ok), Seam("b.moved", "c", "r", moved),
                    Seam("c.gone", "c", "r", gone, optional=True), Seam("d.route", "", "r", lambda: [])])
    line = engine_seams.summary({"engine": "vllm", "version": "9.9", "tested": False, "probes": probes})
    assert line == ("vllm 9.9: NOT a tested minor; 4 seams, moved: b.moved: moved (f(a, b) differs); "
                    "optional, absent here: c.gone")
    table = report(probes)
    assert "absent (optional)" in table and "route" in table and table.count("\n") == 4
    assert [p.fits for p in probes] == [True, False, True, True]
    with pytest.raises(SystemExit, match="unknown engine 'tgi'"):
        engine_seams.probe_engine("tgi")


def test_a_probe_that_raises_counts_as_moved():
    def broken():
        raise KeyError("inspect failed")

    (found,) = probe([Seam("x.y", "c", "r", broken)])
    assert isinstance(found, Probe) and found.state == "moved" and "KeyError" in found.detail


def test_fuzz_batch_totals():
    out = ("  inductor   runs=50 mismatches=0 compile_failures=0 rewritten=42 rejected=11 pass_errors=0 "
           "anomalies=0 (output groups: rewritten=3 rejected=6) token counts run=72 recompiles=0\n"
           "  cases per knob: return_list: 12, split: 17\n")
    per_inner, knobs = fuzz_runs.totals([out, out])
    assert per_inner["inductor"]["rewritten"] == 84 and per_inner["inductor"]["out_rewritten"] == 6
    assert per_inner["inductor"]["token_counts"] == 144 and per_inner["inductor"]["runs"] == 100
    assert knobs == {"return_list": 24, "split": 34}
    oracle = ("             captures as the model computes them (twins merged) where the list build rounds "
              "differently: 0 cases, largest difference 0; captures as computed outside the concat where the "
              "list build computes them into it: 1 cases, largest difference 5.96e-08; list build (pass off) "
              "changes the model's own output: 2 cases, of which the pass keeps the list build's: 1; list build "
              "wrong vs eager, the pass right: 3\n")
    counts, largest = fuzz_runs.oracle_totals([oracle, oracle.replace("5.96e-08", "2.4e-07")])
    assert counts == {"twin_rounding": 0, "own_kernel_rounding": 2, "list_changes_model": 4, "model_as_list": 2,
                      "reference_wrong": 6}
    assert largest["own_kernel_rounding"] == 2.4e-07


def test_fuzz_combine_batch_totals():
    out = ("fuzz_combine seeds 0..1\n"
           "  eager     runs=2 fused=1 refused=1 wrong=0 crashed=0 above_list=0 hazards_fused=0 "
           "max_rel_error_fp32=0 max_rel_error_bf16=0.00939\n"
           "    split=chunk(K, dim=-1): fused 1, refused 0\n"
           "    refused (1): the chunk c is not normed\n")
    lines = fuzz_runs.combine_totals([out, out.replace("0.00939", "0.002").replace(" fused=1 ", " fused=2 ")])
    assert lines[0] == ("TOTAL eager: runs=4 fused=3 refused=2 wrong=0 crashed=0 above_list=0 hazards_fused=0 "
                        "max_rel_error_fp32=0 max_rel_error_bf16=0.00939")
    assert "TOTAL eager   split=chunk(K, dim=-1): fused 2, refused 0" in lines
    assert "TOTAL eager   refused (2): the chunk c is not normed" in lines
    assert not any("FAIL" in line for line in lines)
    assert fuzz_runs.combine_totals([out + "    FAIL seed=3 ...: hazard fused\n"])[-1] \
        == "TOTAL FAIL eager: FAIL seed=3 ...: hazard fused"


def _projection_row(combine, k, execution, dtype="bfloat16", **overheads):
    names = ("list", "packer", "projected") if execution == "module" else ("list", "pass", "fused", "projected")
    row = {"combine": combine, "K": k, "dtype": dtype, "execution": execution}
    for i, name in enumerate(names):
        row[f"overhead_{name}"] = overheads.get(name, 1.0 + i)
        row[f"rel_err_{name}"] = 0.004 if name in ("projected", "fused") else 0.0
        row[f"abs_err_{name}"] = 0.03 * k if name in ("projected", "fused") else 0.0
        row[f"model_equal_{name}"] = True
    return row


def test_projection_table_one_row_per_combine_and_k_one_column_per_execution():
    rows = [_projection_row("plain", 3, "module", projected=0.25), _projection_row("plain", 3, "eager"),
            _projection_row("dflash", 8, "eager", fused=0.125), _projection_row("plain", 3, "eager", dtype="float32")]
    table = results_table.projection_table(rows, "bfloat16").splitlines()
    assert table[0] == ("| combine | K | uncompiled: list / packer / projected | "
                        "eager: list / pass / fused / projected |")
    assert "| plain | 3 | 1.00 / 2.00 / 0.25 | 1.00 / 2.00 / 3.00 / 4.00 |" in table
    assert "| dflash | 8 | - | 1.00 / 2.00 / 0.12 / 4.00 |" in table  # 0.125 rounds half to even
    overheads = table[:table.index("")]
    assert len([line for line in overheads if line.startswith("| ")]) == 3  # the fp32 row is not in a bf16 table
    assert "| plain | 0.09 | 0.004 | 0.09 | 0.004 |" in table  # abs err 0.03*K, both K=3 rows
    assert "| dflash | 0.24 | 0.004 | 0.24 | 0.004 |" in table
    assert table[-1].endswith(": True")
    rows[1]["model_equal_pass"] = False
    assert results_table.projection_table(rows, "bfloat16").endswith(": False")


def test_acceptance_table_shows_the_fp32_accumulator_where_it_was_measured():
    row = {"combine": "plain", "dtype": "bfloat16", "draft_input_max_rel_diff": 0.0043, "first_token_agreement": 0.99,
           "all_tokens_agreement": 0.94, "accepted_length_cat": 0.28, "accepted_length_per_capture": 0.28}
    measured = dict(row, draft_input_max_abs_diff=0.031, fp32_accumulate_max_rel_diff=0.004,
                    fp32_accumulate_first_token_agreement=0.995)
    lines = results_table.acceptance_table([row, measured]).splitlines()
    assert lines[2].endswith("| 0.2800 | 0.2800 | - |") and "| 0.0043 |" in lines[2]
    assert lines[3].endswith("| 0.004 / 99.50% |") and "| 0.031 / 0.0043 |" in lines[3]


def test_engine_projection_table_one_row_per_run_sorted():
    run = {"model": "LlamaForCausalLM", "K": 8, "combine": "plain", "hidden": 1024, "draft_hidden": 768,
           "overhead_off": 1.46, "overhead_on": 1.0, "overhead_projected": 0.094, "max_abs_vs_cat_then_project": 3e-7,
           "max_rel_vs_cat_then_project": 4e-7, "logits_equal_no_capture_projected": True, "logits_equal_no_capture": True}
    lines = results_table.engine_projection_table([run, dict(run, K=3, overhead_projected=0.25)]).splitlines()
    assert lines[2] == ("| LlamaForCausalLM | 3 | plain | 1024 -> 768 | 1.46 | 1.00 | **0.25** | 3e-07 / 4e-07 "
                        "| True |")
    assert lines[3].startswith("| LlamaForCausalLM | 8 |") and len(lines) == 4


def test_engine_projection_table_with_the_drafts_proposals():
    run = {"model": "Qwen3ForCausalLM", "K": 3, "combine": "norm_before_fc", "hidden": 1024, "draft_hidden": 768,
           "overhead_off": 1.0, "overhead_on": 1.0, "overhead_projected": 0.25, "max_abs_vs_cat_then_project": 0.03,
           "max_rel_vs_cat_then_project": 0.01, "logits_equal_no_capture_projected": True,
           "logits_equal_no_capture": True, "dtype": "bfloat16", "proposal_agreement": 0.99121, "proposals": 2048}
    lines = results_table.engine_projection_table([run]).splitlines()
    assert "| dtype |" in lines[0] and "| draft proposals equal |" in lines[0]
    assert lines[2] == ("| Qwen3ForCausalLM | 3 | norm_before_fc | 1024 -> 768 | bfloat16 | 1.00 | 1.00 | **0.25** "
                        "| 0.03 / 0.01 | 99.12% of 2048 | True |")
