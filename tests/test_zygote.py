"""testkit.zygote: the oracles' subprocesses forked from a warm process behave as cold ``python SCRIPT ARGS`` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from testkit import hf_oracle
from testkit.zygote import HF_ORACLE, UPSTREAM_RUN, Router, Zygote, kind_of

SCRIPT = textwrap.dedent("""
    import json, os, sys
    what = sys.argv[1]
    if what == "report":
        import json as j
        print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                          "patched": hasattr(j, "PATCHED"), "fla": "fla" in sys.modules and sys.modules["fla"] is None,
                          "stdin": sys.stdin.read()}))
        j.PATCHED = True  # a patch in this child: the next child must not see it
        print("to stderr", file=sys.stderr)
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "raise":
        raise ValueError("broken on purpose")
    elif what == "sleep":
        import time
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote("hf_oracle", dict(os.environ), tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def test_a_child_runs_the_script_as_python_would(zygote, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    for _ in range(2):  # the first child's patch of json is not in the second
        done = zygote.run([sys.executable, str(script), "report"], timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got == {"name": "__main__", "argv": [str(script), "report"], "cwd": str(tmp_path), "path0": str(tmp_path.resolve()),
                       "patched": False, "fla": True, "stdin": ""}
        assert done.stderr == "to stderr\n"
    assert zygote.run([sys.executable, str(script), "exit", "3"], timeout=60).returncode == 3
    done = zygote.run([sys.executable, str(script), "raise"], timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr and done.stderr.strip().endswith("ValueError: broken on purpose")
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, str(script), "sleep"], timeout=1)
    assert zygote.run([sys.executable, str(script), "exit", "0"], timeout=60).returncode == 0  # still serving


def test_only_the_oracle_scripts_in_their_plain_form_are_routed(tmp_path):
    spec = tmp_path / "spec.json"
    for framework, kind in (("fla", "fla"), ("transformers", "transformers"), ("other", None)):
        spec.write_text(json.dumps({"framework": framework}))
        assert kind_of([sys.executable, str(UPSTREAM_RUN), str(spec)]) == kind
    assert kind_of([sys.executable, str(HF_ORACLE), str(spec)]) == "hf_oracle"
    assert kind_of([sys.executable, "-c", "pass"]) is None and kind_of("python x.py") is None
    assert kind_of(["/usr/bin/python3", str(HF_ORACLE), str(spec)]) is None
    calls = []
    router = Router(lambda *a, **kw: calls.append((a, kw)) or "real", tmp_path / "z")
    assert router([sys.executable, "-c", "pass"], capture_output=True, text=True) == "real"
    assert router([sys.executable, str(HF_ORACLE), str(spec)], capture_output=True) == "real"  # bytes, not text
    assert router([sys.executable, str(HF_ORACLE), str(spec)], capture_output=True, text=True, stdin=None) == "real"
    assert len(calls) == 3 and router.warm == 0 and not router.zygotes


def test_a_warm_oracle_run_equals_a_cold_one(tmp_path):
    """transformers' model built, saved and run by hf_oracle.py cold and through a zygote: the same bytes."""
    config = {"vocab_size": 97, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2, "num_heads": 8,
              "head_dim": 8, "n_groups": 2, "conv_kernel": 4}
    prompt, steps = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 3))
    (tmp_path / "cold").mkdir()
    (tmp_path / "warm").mkdir()
    router = subprocess.run  # the suite's (conftest)
    assert isinstance(router, Router)
    subprocess.run = router.real
    try:
        cold_folder, cold = hf_oracle.run("mamba2", config, tmp_path / "cold", prompt, steps)
    finally:
        subprocess.run = router
    served = router.warm
    warm_folder, warm = hf_oracle.run("mamba2", config, tmp_path / "warm", prompt, steps)
    assert router.warm == served + 1
    assert sorted(cold) == sorted(warm) and all(torch.equal(cold[k], warm[k]) for k in cold)
    assert (cold_folder / "model.safetensors").read_bytes() == (warm_folder / "model.safetensors").read_bytes()
