"""Experiment scripts write a new dated result file, never over an existing (tracked) one."""

import datetime

from experiments.common import resultfiles


def test_new_result_file_never_returns_an_existing_path(tmp_path, monkeypatch):
    monkeypatch.setattr(resultfiles, "RESULTS", tmp_path)
    today = datetime.date.today().isoformat()
    first = resultfiles.new_result_file("compare-quick-cpu", companions=(".png",))
    assert first == tmp_path / f"compare-quick-cpu_{today}.json" and not first.exists()
    first.write_text("{}")
    second = resultfiles.new_result_file("compare-quick-cpu", companions=(".png",))
    assert second.name == f"compare-quick-cpu_{today}-2.json"
    (tmp_path / f"compare-quick-cpu_{today}-2.png").write_bytes(b"")  # its chart exists: skip it
    assert resultfiles.new_result_file("compare-quick-cpu", companions=(".png",)).name == \
        f"compare-quick-cpu_{today}-3.json"
    (tmp_path / "compare-quick-cpu.json").write_text("{}")  # an undated tracked file is untouched
    assert resultfiles.new_result_file("compare-quick-cpu").name != "compare-quick-cpu.json"
