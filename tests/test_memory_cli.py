"""The `python -m jaxmem.memory` command line."""

import json
import subprocess
import sys

import pytest

from jaxmem.memory.report import main


def test_json_output_fields(capsys):
    assert main(["--preset", "tiny", "--num-layers", "2", "--batch-size", "2", "--seq-len", "32",
                 "--remat", "full", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    c = r["compiled"]
    assert r["params"] > 0 and r["flops"] > 0 and r["remat"] == "full"
    assert c["peak_bytes"] == (c["temp_bytes"] + c["argument_bytes"] + c["output_bytes"]
                               - c["alias_bytes"])
    # arguments are at least the fp32 params
    assert c["argument_bytes"] >= 4 * r["params"]


def test_table_output(capsys):
    main(["--num-layers", "1", "--batch-size", "1", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert "peak" in out and "MiB" in out


@pytest.mark.parametrize("argv, needle", [
    (["--remat", "bogus"], "unknown remat policy 'bogus'"),
    (["--preset", "huge"], "--preset"),
    (["--batch-size", "0"], "--batch-size"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds"),
    (["--num-heads", "3"], "num_heads"),
])
def test_bad_input_exits_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "jaxmem.memory", *argv], capture_output=True,
                       text=True)
    assert p.returncode == 2
    assert needle in p.stderr
