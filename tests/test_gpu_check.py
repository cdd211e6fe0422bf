"""experiments.gpu_check on CPU: `--smoke` runs the real rows at tiny sizes (the train CLI, the
planner, the random HF checkpoint, the compare driver, pytest) and writes the table and the JSON;
a row that fails is named and makes the exit status 1; rows finished before a crash stay on disk.
"""

import json
import sys

import pytest

from experiments.gpu_check import driver as gpu_check
from experiments.gpu_check import rows as gr
from experiments.gpu_check.table import markdown


@pytest.fixture(autouse=True)
def _no_prealloc(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _doc(out):
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow  # two tiny train runs and a CPU plan: ~70 s on 2 busy cores
def test_smoke_train_row_with_plan_and_skipped_diag(tmp_path, capsys):
    out = tmp_path / "g"
    assert gpu_check.main(["--smoke", "--out", str(out), "--rows", "1b-adamw", "fp8-diag",
                           "--profile"]) == 0
    doc = _doc(out)
    assert doc["mode"] == "smoke" and doc["total_s"] > 0
    assert doc["cpu_isa"]["var"] == "ONEDNN_MAX_CPU_ISA" and doc["cpu_isa"]["reason"]
    train, diag = doc["rows"]
    assert (train["name"], train["status"]) == ("1b-adamw", "ok")
    assert train["tokens_per_s"] > 0 and train["eval_loss"] > 0
    assert train["peak_bytes"] is None and train["mfu"] is None  # --smoke: CPU only
    plan = train["plan"]
    assert plan["where"] == "cpu" and plan["backend"] == "cpu"
    assert plan["compiled_bytes"] > plan["analytic_bytes"] * 0.5 > 0
    assert diag["status"] == "skipped" and diag["why"]
    md = (out / "gpu_check.md").read_text()
    assert "| 1b-adamw | ok |" in md and "| fp8-diag | skipped |" in md
    assert f"{train['tokens_per_s']:,.0f}" in md
    # the checkpoint is deleted after the row, the record kept
    assert not (out / "runs" / "1b-adamw" / "checkpoints").exists()
    assert (out / "runs" / "1b-adamw" / "metrics.jsonl").is_file()
    assert "gpu_check: 2 rows in" in capsys.readouterr().err
    # --profile: the trace of the run's last step read by HLO instruction, each class's
    # measured seconds beside the time model's on the program the run compiled (XLA's dump)
    prof = json.loads((out / "1b-adamw.profile.json").read_text())
    measured = {r["class"]: r["measured_s"] for r in prof["by_class"]}
    assert measured["gemm"] > 0 and measured["fusion"] > 0  # named by the predicted kernels
    assert measured.get("unmatched", 0) < 0.2 * sum(measured.values())
    assert sum(t["predicted_s"] is not None for t in prof["costliest"]) > len(
        prof["costliest"]) / 2 and prof["predicted_s"] > 0
    assert "| gemm |" in (out / "1b-adamw.profile.md").read_text()


@pytest.mark.gpu_target  # a tiny train row and its plan from the H100's compiler: ~60 s
def test_smoke_plan_from_the_targets_compiler(tmp_path):
    out = tmp_path / "g"
    assert gpu_check.main(["--smoke", "--out", str(out), "--rows", "1b-adamw", "--plan",
                           "target", "--plan-card", "h100"]) == 0
    plan = _doc(out)["rows"][0]["plan"]
    assert plan["where"] == "h100, deviceless" and "H100" in plan["compiler"], plan
    # every phase compiled (--compile): the plan is the run's largest, never below the step
    assert {p["name"] for p in plan["phases"]["phases"]} >= {"state", "step"}
    assert plan["compiled_bytes"] >= plan["step_bytes"] > 0
    assert "(h100, deviceless; " in (out / "gpu_check.md").read_text()


def test_plan_card_is_checked_and_auto_follows_the_plugin(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--out", str(tmp_path), "--plan-card", "h1000"])
    assert e.value.code == 2
    assert gr.target_card("NVIDIA H100 80GB HBM3, 81559 MiB") == "h100"
    assert gr.target_card("NVIDIA GeForce RTX 4090, 24564 MiB") == "rtx4090"
    assert gr.target_card("NVIDIA L40S, 46068 MiB") == "l40s"
    assert gr.target_card(None) == "h100"
    for installed, want in ((True, "target"), (False, "cpu")):
        monkeypatch.setattr(gpu_check, "target_installed", lambda i=installed: i)
        assert gpu_check.parse_args(["--out", str(tmp_path)]).plan == want


@pytest.mark.slow  # one row of each kind the driver runs: ~100 s on 2 cores
def test_smoke_one_row_of_each_kind(tmp_path):
    """pytest, a train row on a random HF checkpoint, the costliest train flags (in-backward with
    the state and the weights on the host), the compare driver (torch's when installed). The
    other train rows are other flags of the same path: test_smoke_every_row (nightly)."""
    out = tmp_path / "g"
    rows = ["gpu-tests", "8b-both-host-4x", "qlora-nf4", "compare-full"]
    rc = gpu_check.main(["--smoke", "--out", str(out), "--plan", "off", "--rows", *rows])
    doc = _doc(out)
    status = {r["name"]: r["status"] for r in doc["rows"]}
    assert rc == 0, [(r["name"], r.get("error")) for r in doc["rows"] if r["status"] == "FAILED"]
    assert list(status) == rows
    assert status["8b-both-host-4x"] == status["qlora-nf4"] == "ok", status
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["qlora-nf4"]["tokens_per_s"] > 0 and rows["8b-both-host-4x"]["tokens_per_s"] > 0
    assert status["gpu-tests"] == "ok" and rows["gpu-tests"]["tests"]["counts"].get("skipped")
    if status["compare-full"] != "skipped":  # torch installed
        assert rows["compare-full"]["tokens_per_s"] > 0
        assert "torch eager" in rows["compare-full"]["note"]


@pytest.mark.nightly  # every row at tiny size: several minutes on 2 cores
def test_smoke_every_row(tmp_path):
    out = tmp_path / "g"
    rc = gpu_check.main(["--smoke", "--out", str(out), "--plan", "off"])
    doc = _doc(out)
    status = {r["name"]: r["status"] for r in doc["rows"]}
    assert rc == 0, [(r["name"], r.get("error")) for r in doc["rows"] if r["status"] == "FAILED"]
    assert "suite" not in status and len(status) == 17
    assert status["fp8-diag"] == "skipped"
    for name in ("1b-adamw", "1b-adamw8bit", "1b-fp8", "8b-1x2048", "8b-4x2048",
                 "8b-1x2048-pallas", "8b-fp8-sr-4x2048", "8b-8x2048-untiled", "8b-opt-host",
                 "8b-both-host", "8b-both-host-4x", "qlora-nf4", "lora-bf16"):
        assert status[name] == "ok", name
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["qlora-nf4"]["tokens_per_s"] > 0
    assert status["gpu-tests"] == "ok" and rows["gpu-tests"]["tests"]["counts"].get("skipped")
    if status["compare-none"] != "skipped":  # torch installed
        assert rows["compare-full"]["tokens_per_s"] > 0
        assert "torch eager" in rows["compare-full"]["note"]


def test_a_failing_row_is_named_and_exits_1(tmp_path, monkeypatch, capsys):
    """A train row with a flag jaxmem.train refuses: FAILED with the error's line, exit 1."""
    bad = gr.Row("bad", "train", "a precision that does not exist",
                 ("--preset", "tiny", "--precision", "fp7"), timeout=120)
    monkeypatch.setattr(gpu_check, "rows", lambda smoke: [bad])
    out = tmp_path / "g"
    assert gpu_check.main(["--smoke", "--out", str(out), "--plan", "off"]) == 1
    (row,) = _doc(out)["rows"]
    assert row["status"] == "FAILED" and row["error"].startswith("exit 2: ")
    assert "fp7" in row["error"]
    err = capsys.readouterr().err
    assert "gpu_check: FAILED bad: exit 2" in err and "FAILED rows: bad" in err
    assert "| bad | FAILED |" in (out / "gpu_check.md").read_text()


def test_rows_written_as_they_finish(tmp_path, monkeypatch):
    """The driver dies in the second row: the first row's numbers are already on disk."""
    def fake_row(row, args, hf):
        if row.name == "1b-adamw8bit":
            raise KeyboardInterrupt  # the machine taken away mid-run
        return {"status": "ok", "seconds": 1.0, "tokens_per_s": 123.0, "peak_bytes": 2**30}

    monkeypatch.setattr(gpu_check, "run_row", fake_row)
    out = tmp_path / "g"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--smoke", "--out", str(out), "--plan", "off",
                        "--rows", "1b-adamw", "1b-adamw8bit", "1b-fp8"])
    rows = _doc(out)["rows"]
    assert [r["status"] for r in rows] == ["ok", "running", "pending"]
    assert rows[0]["tokens_per_s"] == 123.0
    assert "| 1b-adamw | ok | 123 |" in (out / "gpu_check.md").read_text()


def test_budget_skips_later_rows_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_row", lambda row, args, hf: {"status": "ok"})
    clock = iter([0.0, 0.0])  # start, first row; then 700 s
    monkeypatch.setattr(gpu_check, "_clock", lambda: next(clock, 700.0))
    out = tmp_path / "g"
    assert gpu_check.main(["--out", str(out), "--plan", "off", "--budget", "540",
                           "--rows", "1b-adamw", "1b-adamw8bit"]) == 0
    a, b = _doc(out)["rows"]
    assert a["status"] == "ok" and b["status"] == "skipped"
    assert "--budget of 540 s" in b["why"] and "--rows 1b-adamw8bit" in b["why"]


@pytest.mark.parametrize("argv, msg", [
    (["--rows", "nope"], "--rows: unknown row 'nope'"),
    (["--steps", "2"], "--steps 2: at least 3"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path / "g"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m experiments.gpu_check: error: {msg}")
    assert not (tmp_path / "g").exists()  # nothing written


def test_out_must_be_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("kept")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(f)])
    assert e.value.code == 2 and "is not a directory" in capsys.readouterr().err
    assert f.read_text() == "kept"


def test_help_names_every_row_and_flag(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    text = capsys.readouterr().out
    for r in gr.rows(False):
        assert r.name in text
    for flag in ("--out", "--rows", "--suite", "--smoke", "--steps", "--plan", "--budget",
                 "--keep-runs", "--profile"):
        assert flag in text


# ---------------------------------------------------------------- reading the results back


def test_pytest_counts_names_failures_and_errors():
    text = "\n".join([
        "[gw3] [ 41%] FAILED tests/test_a.py::test_x[fp32]",
        "[gw1] [ 42%] PASSED tests/test_a.py::test_y",
        "[gw0] [ 50%] ERROR tests/test_b.py::test_z",
        "=========================== short test summary info ============================",
        "FAILED tests/test_a.py::test_x[fp32] - AssertionError: 1 != 2",
        "FAILED tests/test_c.py::test_w - ValueError",
        "ERROR tests/test_b.py::test_z - fixture 'gpu' not found",
        "==== 2 failed, 40 passed, 3 skipped, 1 error in 12.34s ====",
    ])
    got = gr.pytest_counts(text)
    assert got["counts"] == {"failed": 2, "passed": 40, "skipped": 3, "errors": 1}
    assert got["failed"] == ["tests/test_a.py::test_x[fp32]", "tests/test_c.py::test_w"]
    assert got["errors"] == ["tests/test_b.py::test_z"]
    md = markdown({"mode": "full", "date": "d", "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB",
                   "host": "h", "commit": "abc", "versions": {"jax": "0.11.2"}, "total_s": 5.0,
                   "rows": [{"name": "suite", "kind": "suite", "what": "w", "status": "FAILED",
                             "tests": got, "error": "2 failed, 1 errors"}]})
    assert "- FAILED tests/test_c.py::test_w" in md and "- ERROR tests/test_b.py::test_z" in md
    assert "NVIDIA H100 80GB HBM3" in md and "project commit abc" in md


def test_compare_and_diag_cells():
    doc = {"complete": True, "results": [
        {"spec": {"framework": "jax"}, "tokens_per_s": 37072.0, "mfu": 0.31, "peak_bytes": 2**34,
         "saved_bytes": 578 * 2**20},
        {"spec": {"framework": "torch"}, "tokens_per_s": 29955.0, "saved_bytes": 5194 * 2**20,
         "peak_bytes": None},
        {"spec": {"framework": "torch-compile"}, "error": "exit 1: boom\nTimeout"}]}
    metrics, note, failed = gr.compare_numbers(doc)
    assert metrics == {"tokens_per_s": 37072.0, "mfu": 0.31, "peak_bytes": 2**34}
    assert note == ("saved for backward jax 578 MiB; torch eager 29,955 tok/s, saved 5,194 MiB, "
                    "peak n/a")
    assert failed == ["torch-compile: Timeout"]
    note = gr.diag_note({"fp8_einsums_traced": 112, "f8_gemm_custom_calls": 0,
                         "top_kernels": [["loop_convert_fusion", 12.5]], "steps": 3})
    assert note == ("fp8 einsums traced 112, __cublas$lt$matmul$f8 calls 0; top kernels: "
                    "loop_convert_fusion 12.5 ms; steps 3")


def test_the_peak_cell_names_the_states_peak():
    from experiments.gpu_check.table import row_cells
    rec = {"tokens_per_sec": 896.0, "peak_bytes_in_use": 10.5 * 2**30,
           "state_peak_bytes_in_use": 10.5 * 2**30}
    r = {"name": "8b-both-host", "kind": "train", "status": "ok", "what": "x",
         **gr.train_metrics(rec)}
    assert row_cells(r)[4] == "10.50 GiB (state 10.50 GiB)"
    r["state_peak_bytes"] = None  # a record written before the field existed
    assert row_cells(r)[4] == "10.50 GiB"


def test_error_line_prefers_the_error():
    res = {"timed_out": False, "rc": 1, "text": "$ cmd\nstep 1\njaxlib.XlaRuntimeError: "
           "RESOURCE_EXHAUSTED: Out of memory allocating 7.00GiB\n\nTry python -m jaxmem.memory"}
    assert gpu_check.error_line(res, 10) == ("exit 1: jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: "
                                             "Out of memory allocating 7.00GiB")
    assert gpu_check.error_line({**res, "timed_out": True}, 10) == "timed out after 10 s"


def test_children_import_this_checkout():
    env = gpu_check.child_env(X="1")
    assert env["PYTHONPATH"].split(":")[0] == str(gr.ROOT) and env["X"] == "1"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # --smoke sees no GPU, on a GPU machine too: the same check everywhere
    cpu = gpu_check.child_env(cpu_only=True)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["CUDA_VISIBLE_DEVICES"] == ""
    cmd = gpu_check.pytest_cmd([], suite=True)
    assert cmd[:3] == [sys.executable, "-m", "pytest"]
