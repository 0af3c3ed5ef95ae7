"""Print README.md's reference blocks from the code, so they cannot go stale (tools/gendocs.py).

    python tools/api_reference.py defaults   # load()'s and generate()'s defaults (a Markdown table)
    python tools/api_reference.py cli        # every lily-py subcommand's usage, from argparse
    python tools/api_reference.py snapshot   # a prompt-cache snapshot's bytes for the real config

The defaults come from the signatures; what a None (or "auto") default means is said once here,
in NONE_MEANS, and this script fails when a parameter defaulting to None has no entry (a new
parameter must say what its None does). Figures in those sentences come from the code.
"""
from __future__ import annotations

import argparse
import inspect
import sys

import lily_py
from lily_py import cli, sizes
from lily_py.backends import default_kv_dtype
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG

REAL = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
MiB, KiB = 1 << 20, 1 << 10

# What a default of None (or "auto") means, per function and parameter.
NONE_MEANS = {
    "load": {
        "path_or_repo_id": "the demo checkpoint bundled with lily_py (no download)",
        "backend": "`\"auto\"`: `\"metal\"` where this build's Metal device, library and every "
                   "kernel pipeline are usable (`lily_py.auto_backend()` says which and why), "
                   "else `\"reference\"`; never the slow emulator",
        "context_length": "the model's `max_position_embeddings` "
                          f"({REAL.max_position_embeddings:,} for Qwen3.6-35B-A3B), on every "
                          "backend; engine backends grow the KV cache in blocks as positions "
                          "advance, not for all of it at load",
        "revision": "the hub's default branch",
        "verbose": "progress on stderr only when stderr is a terminal",
        "activations": "the checkpoint's dtype (engine backends; bfloat16 for bf16 checkpoints)",
        "weights": "`\"auto\"`: engine backends map weights from the checkpoint's pages where they "
                   "can (zero copy) and copy the rest",
        "kv_block_tokens": f"{sizes.KV_BLOCK_TOKENS} tokens per KV cache block (engine backends)",
        "kv_dtype": f"`\"{default_kv_dtype(REAL)}\"`, the model's precision",
    },
    "generate": {
        "seed": "a random seed drawn once per generation",
        "stop": "no stop strings (EOS still stops)",
        "enable_thinking": "the chat template's default (Qwen3.6 thinks)",
        "tools": "no tools",
        "chat_template_kwargs": "no extra template variables",
        "parse_output": "parse a chat prompt's output (reasoning, tool calls), leave text and "
                        "token-id prompts' output in `chunk.text`",
        "prefill_progress": "no progress callback",
        "response_format": "unconstrained",
        "tool_choice": "`\"auto\"`: the model decides",
    },
}


def _default(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20:
        return f"`{v}` ({v / (1 << 30):g} GiB)" if v % (1 << 30) == 0 else f"`{v}`"
    return f"`{v!r}`"


def defaults() -> str:
    rows = ["| call | parameter | default | meaning of the default |", "|---|---|---|---|"]
    for name, fn in (("load", lily_py.load), ("generate", lily_py.Model.generate)):
        for p in inspect.signature(fn).parameters.values():
            if p.name == "self" or p.default is p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            note = NONE_MEANS[name].get(p.name, "")
            if (p.default is None or p.default == "auto") and not note:
                raise SystemExit(f"api_reference.py: {name}({p.name}=...) defaults to {p.default!r}; "
                                 f"say what that means in NONE_MEANS[{name!r}]")
            rows.append(f"| `{name}()` | `{p.name}` | {_default(p.default)} | {note} |")
    return "\n".join(rows)


def cli_reference() -> str:
    """Each subcommand's one-line help and its usage (argparse's, 100 columns wide)."""
    ap = cli.parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        first, *rest = p.format_usage().removeprefix("usage: ").rstrip().splitlines()
        # argparse indents the continuation lines under "usage: lily-py NAME "
        usage = "\n".join([first] + [line[len("usage: "):] for line in rest])
        out.append(f"# {helps.get(name, '')}\n{usage}")
    return "\n\n".join(out)


def snapshot() -> str:
    """A prompt-cache snapshot of the real config (lily_py.sizes.snapshot_bytes: the engine's own
    plan and block size; checked against measured snapshots in tests/api/test_prompt_cache.py)."""
    c, B = REAL, sizes.KV_BLOCK_TOKENS
    n_lin = c.num_hidden_layers - len(c.full_attention_layers)
    dims = (n_lin, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    deltanet = 4 * dims[0] * dims[1] * dims[2] * dims[3]
    examples = (300, 3000)
    lines = []
    for engine, kv in ((True, "bfloat16"), (True, "int8"), (True, "float32"), (False, None)):
        one = sizes.snapshot_bytes(c, 1, engine=engine, kv_dtype=kv)
        fixed = one["recurrent"]
        if engine:
            per = sizes.snapshot_bytes(c, B, kv_dtype=kv)["kv"]
            head = (f"engine, {kv} KV cache{' (the default)' if kv == 'bfloat16' else ''}: "
                    f"{fixed / MiB:.1f} MiB + {per / MiB:.2f} MiB per started block of {B} tokens "
                    f"({per / B / KiB:.2f} KiB a token)")
        else:
            per = sizes.snapshot_bytes(c, 1, engine=False)["kv"]
            head = (f"reference (float32 arrays): {fixed / MiB:.1f} MiB + {per / KiB:.0f} KiB a token, "
                    "exactly")
        ex = ", ".join(f"{n} tokens {sizes.snapshot_bytes(c, n, engine=engine, kv_dtype=kv)['total'] / MiB:.1f} MiB"
                       for n in examples)
        lines.append(f"{head}: {ex}")
    eng_conv = sizes.snapshot_bytes(c, 1)["recurrent"] - deltanet
    ref_conv = sizes.snapshot_bytes(c, 1, engine=False)["recurrent"] - deltanet
    conv = f"{eng_conv / MiB:.1f} MiB" + ("" if eng_conv == ref_conv else f" ({ref_conv / MiB:.1f} on the reference)")
    lines.append(f"the fixed part: the DeltaNet state, {' x '.join(map(str, dims))} float32 = "
                 f"{deltanet / MiB:.1f} MiB, and {conv} of conv windows")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["defaults", "cli", "snapshot"])
    a = ap.parse_args(argv)
    print({"defaults": defaults, "cli": cli_reference, "snapshot": snapshot}[a.what]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
