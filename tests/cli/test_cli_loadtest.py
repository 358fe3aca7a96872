"""``prefixcache loadtest``: its help lists the lanes, each lane gets the options given on the command line (the
lanes' runners replaced by recorders here: tests/bench/test_loadtest_run.py runs one for real), its verdict is
the exit code, and a bad value is a usage error before any server starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from prefixcache.bench.loadtest import batching, fairness, llama_server, mixed, peer, served, soak
from prefixcache.bench.loadtest.options import FairnessOptions, LoadTestOptions, MixedOptions, PeerOptions, ServedModel
from prefixcache.cli.app import app

runner = CliRunner()


@pytest.fixture
def ran(monkeypatch) -> list:
    """What each lane's runner was called with; the models checked are recorded, not loaded."""
    calls = []
    monkeypatch.setattr(served, "check_model", lambda spec: calls.append(("model", spec)))
    for module, name in ((batching, "run_loadtest"), (mixed, "run_mixed"), (peer, "run_peer"), (fairness, "run_fairness")):
        monkeypatch.setattr(module, name, lambda options, name=name: calls.append((name, options)) or True)
    monkeypatch.setattr(soak, "run_soak", lambda options, seconds: calls.append(("run_soak", options, seconds)) or False)
    return calls


def words(text: str) -> str:
    return " ".join(text.split())


def test_the_help_lists_the_lanes():
    result = runner.invoke(app, ["loadtest", "--help"])
    assert result.exit_code == 0, result.output
    text = words(result.output)
    for lane in ("--openai", "--soak", "mixed", "peer", "fairness", "Lanes", "Other lanes"):
        assert lane in text, f"--help does not list {lane}:\n{result.output}"
    assert "loadtest" in words(runner.invoke(app, ["--help"]).output)


def test_the_plain_lane_gets_every_option(ran, tmp_path):
    result = runner.invoke(app, ["loadtest", "--model", "m", "--dtype", "float32", "--threads", "2", "--clients", "3",
                                 "--requests", "5", "--items-per-request", "2", "--distinct", "4", "--max-batch", "8",
                                 "--max-step-tokens", "64", "--rounds", "3", "--tolerance", "0.01", "--near-tie", "0.2",
                                 "--target", "2", "--json", str(tmp_path / "out.json")])
    assert result.exit_code == 0, result.output
    assert ran == [("model", "m"), ("run_loadtest", LoadTestOptions(
        ServedModel("m", "float32", 2), "support-tickets", 3, 5, 2, 4, 8, 64, 3, 0.01, 0.2, 2.0, False, 0.8,
        str(tmp_path / "out.json")))]


def test_openai_is_a_lane_of_the_plain_command(ran):
    result = runner.invoke(app, ["loadtest", "--openai", "--openai-target", "0.5"])
    assert result.exit_code == 0, result.output
    (_, (name, options)) = ran
    assert name == "run_loadtest" and options.openai and options.openai_target == 0.5


def test_the_soak_runs_for_its_seconds_and_a_failed_lane_exits_1(ran):
    result = runner.invoke(app, ["loadtest", "--soak", "90", "--clients", "4"])
    assert result.exit_code == 1, result.output  # the recorder's verdict: FAIL
    (_, (name, options, seconds)) = ran
    assert name == "run_soak" and seconds == 90.0 and options.clients == 4


def test_the_subcommand_lanes_get_their_options(ran, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert runner.invoke(app, ["loadtest", "mixed", "--baseline-src", str(src), "--seconds", "5", "--idle", "2"]).exit_code == 0
    assert runner.invoke(app, ["loadtest", "peer", "--llama-server", "/nowhere/llama-server", "--gguf", str(gguf),
                               "--requests", "4"]).exit_code == 0
    assert runner.invoke(app, ["loadtest", "fairness", "--max-batch", "32,8,4", "--max-step-tokens", "512,128",
                               "--flood-items", "16"]).exit_code == 0
    lanes = {call[0]: call[1] for call in ran if call[0] != "model"}
    assert lanes["run_mixed"] == MixedOptions(ServedModel(), str(src), 8, 8, 5.0, 2, None)
    assert lanes["run_peer"] == PeerOptions("/nowhere/llama-server", str(gguf), "support-tickets", "auto", None, 4, 8, None,
                                            ("auto",))
    assert lanes["run_fairness"] == FairnessOptions(ServedModel(), (32, 8, 4), (512, 128), 20, 4, 16, 2.0, 3.0)
    assert ("model", str(gguf)) in ran, "the peer's prefixcache server runs the --gguf"


@pytest.mark.parametrize(("args", "message"), [
    (["--openai", "--soak", "60"], "--openai and --soak are two lanes: choose one"),
    (["--duration", "600"], "No such option: --duration"),  # the old script's spelling of --soak
    (["--clients", "0"], "--clients"),
    (["--dtype", "float8"], "--dtype must be one of"),
    (["fairness", "--max-batch", "32,x"], "whole numbers of at least 1"),
    (["fairness", "--max-step-tokens", "0"], "whole numbers of at least 1"),
    (["mixed", "--baseline-src", "/nonexistent-folder/src"], "is not a folder"),
    (["peer", "--gguf", "/nonexistent-folder/m.gguf"], "no such .gguf file"),
])
def test_a_bad_value_is_a_usage_error_before_any_server_starts(ran, args, message):
    result = runner.invoke(app, ["loadtest", *args])
    assert result.exit_code == 2, result.output
    assert message in words(result.output), result.output
    assert "Traceback" not in result.output
    assert not [call for call in ran if call[0] != "model"], "a lane ran"


def test_the_peer_lane_without_a_llama_server_is_skipped(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llama_server.found_binary(None) is None
    assert llama_server.found_binary("/nonexistent-folder/llama-server") is None
    binary = tmp_path / "llama-server"
    binary.write_text("")
    binary.chmod(0o755)
    assert llama_server.found_binary(None) == str(binary)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert llama_server.found_binary(None) == str(binary)


def test_the_peer_and_mixed_lanes_json_names_the_machine(monkeypatch, tmp_path):
    """The ``--json`` of ``peer`` and ``mixed`` carries the machine beside the figures (docs/bench/ needs it)."""
    import json

    monkeypatch.setattr(peer, "chats", lambda task, requests: [])
    monkeypatch.setattr(peer, "embedded_gguf", lambda: "model.gguf")
    monkeypatch.setattr(peer, "run_server", lambda name, make, options, chosen, **_: [
        peer.Result(name, w, 2.0, [0.1, 0.2], 2) for w in ("classification", "extraction")])
    peer.run_peer(PeerOptions(llama_server=str(tmp_path / "absent"), json_path=str(tmp_path / "peer.json")))
    document = json.loads((tmp_path / "peer.json").read_text())
    assert document["machine"]["cpu"] and document["machine"]["dtype"] == "auto" and document["machine"]["command"]
    assert [r["workload"] for r in document["results"]] == ["classification", "extraction"]
    assert document["results"][0]["rate"] == 1.0

    def fills(lane, options, pool):
        lane.idle, lane.classify, lane.extract, lane.seconds = [10.0], [20.0], [30.0], 1.0
    monkeypatch.setattr(mixed, "run_lane", fills)
    monkeypatch.setattr(mixed, "texts", lambda: [])
    mixed.run_mixed(MixedOptions(json_path=str(tmp_path / "mixed.json")))
    document = json.loads((tmp_path / "mixed.json").read_text())
    assert document["machine"]["cores"] >= 1 and [lane["name"] for lane in document["lanes"]] == ["this checkout"]
