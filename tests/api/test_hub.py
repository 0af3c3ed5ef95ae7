"""Hub ids resolve through huggingface_hub's cache; only text shards are fetched; offline errors
are clear. No network: the cache is laid out by hand and HF_HUB_OFFLINE=1."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from lily_py.checkpoint import text_weight_files
from lily_py.hub import is_repo_id


def test_text_weight_files_skips_vision_only_shards():
    index = {"weight_map": {
        "model.language_model.embed_tokens.weight": "a.safetensors",
        "model.visual.blocks.0.w": "v.safetensors",
        "mtp.fc.weight": "m.safetensors",
        "model.visual.merger.w": "a.safetensors",
        "lm_head.weight": "b.safetensors",
    }}
    assert text_weight_files(index) == ["a.safetensors", "b.safetensors"]


@pytest.mark.parametrize("s, ok", [("Qwen/Qwen3.6-35B-A3B", True), ("mlx-community/x_y.z", True),
                                   ("./local/dir", False), ("/abs/path", False), ("a/b/c", False),
                                   ("noslash", False)])
def test_is_repo_id(s, ok):
    assert is_repo_id(s) == ok


def _run(code, env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_load_from_offline_cache(tmp_path, tiny_mlx):
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-model" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_mlx, snap)
    (cache / "models--someorg--tiny-model" / "refs").mkdir()
    (cache / "models--someorg--tiny-model" / "refs" / "main").write_text("0" * 40)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    out = _run("""
        import lily_py
        m = lily_py.load("someorg/tiny-model", backend="reference")
        print(m.path)
        print(m.prefill([1, 2, 3]).shape)
    """, env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(snap), "(320,)"]
    out = _run("""
        import lily_py
        try:
            lily_py.load("someorg/not-cached")
        except lily_py.CheckpointError as e:
            print("ERR", e)
    """, env)
    assert "ERR someorg/not-cached: not in the local Hugging Face cache" in out.stdout, out.stderr[-2000:]
