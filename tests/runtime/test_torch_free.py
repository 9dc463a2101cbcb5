"""The runtime works where torch cannot be imported: import it, load an export, generate, save a state."""

import json
import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name})")
            return None

    sys.meta_path.insert(0, NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_the_blocker_really_blocks_torch():
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


def test_import_and_generate_without_torch(tiny, tmp_path):
    _, export_dir = tiny
    proc = run_without_torch(
        f"""
        import json, sys
        import edgelin.runtime as rt
        import edgelin.cli_generate
        result = rt.generate_text({str(export_dir)!r}, "Hello", max_new_tokens=16, provider="cpu",
                                  state_out={str(tmp_path / "s.npz")!r})
        gen = rt.Generator(rt.load({str(export_dir)!r}, provider="cpu"), ["a", "bcd"], max_new_tokens=4, temperature=0.5, seed=0)
        gen.run()
        print(json.dumps({{"text": result["text"], "tokens": result["new_tokens"], "batch": gen.state.batch,
                          "torch": [m for m in sys.modules if m == "torch" or m.startswith("torch.")]}}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 16 and out["batch"] == 2 and out["torch"] == []
    assert (tmp_path / "s.npz").is_file()


def test_cli_generate_runs_without_torch(tiny):
    proc = run_without_torch(
        f"""
        from edgelin.cli_generate import generate
        generate.main([{str(tiny[1])!r}, "--prompt", "Hi", "-n", "5", "--provider", "cpu", "--json"], standalone_mode=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert '"new_tokens": 5' in proc.stdout
