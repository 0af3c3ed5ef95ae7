"""Command line: ``lily-py generate``, ``chat``, ``info``, ``serve``, ``doctor``, ``bench``, ``align``.

Without ``--model`` every command uses the small demo checkpoint shipped with lily_py, so
``lily-py generate --prompt "..."`` works on a fresh machine with no download. ``parser()`` builds
the whole command line (README.md's CLI reference is generated from it: tools/api_reference.py).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from ._version import __version__
from .defaults import DEFAULT_MAX_TOKENS  # imports nothing heavy

CHAT_HELP = ("Commands: /reset (clear the conversation), /quit or /exit (leave), /help. "
             "Ctrl-C stops a reply; Ctrl-D leaves.")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default (and leaves out "(default: None)" for optional values)."""

    def _get_help_string(self, action):
        if action.default is None or action.default == [] or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint folder or Hugging Face repo id (default: the bundled demo)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "emu", "metal", "cuda"],
                   help="device that runs the model")
    p.add_argument("--context", type=int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings; the "
                        "same on every backend; engine backends take KV cache blocks as it fills)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--kv-dtype", choices=["bfloat16", "int8", "float32"], default=None,
                   help="KV cache element type (default bfloat16, the model's precision; int8: about "
                        "half the bytes, a little error, head_dim 64/128/256 only; float32: twice the "
                        "bytes, K and V unrounded; docs/memory.md)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens to generate per reply")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: random); in chat, turn N uses seed + N")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="turn the model's thinking on/off (chat template; default: the "
                        "template's, on for Qwen3.6); reasoning is shown on stderr")


def _sampling_kwargs(a, turn: int = 0) -> dict:
    seed = None if a.seed is None else (a.seed + turn) % (1 << 63)
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                min_p=a.min_p, seed=seed, stop=a.stop, enable_thinking=a.enable_thinking)


def _check_sampling(a) -> None:
    """The sampling flags checked before the model loads (a bad --temperature fails at once, not
    after minutes of loading), by generate()'s own checks."""
    from . import generate_args
    generate_args.sampling_params(a.temperature, a.top_p, a.top_k, a.min_p, a.seed)
    generate_args.max_tokens_arg(a.max_tokens)
    generate_args.stop_strings(a.stop)


def _utf8(text: str, where: str) -> str:
    """``text`` from the command line or stdin, or a ValueError naming the first byte that is not
    UTF-8. Python keeps such bytes as lone surrogates (surrogateescape); the tokenizer would
    refuse them with "TextInputSequence must be str"."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")      # the bytes as they arrived
    except UnicodeEncodeError:                              # a surrogate no byte made
        from .tokenizer import check_text
        check_text(text, where)
        raise
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not valid UTF-8 at byte {e.start} (0x{raw[e.start]:02x}); "
                         "lily-py reads text as UTF-8") from None
    return text


def _stdin_keeps_bad_bytes() -> None:
    """Read stdin as UTF-8 that keeps undecodable bytes (surrogateescape), so that _utf8 can say
    where they are instead of the decoder failing mid-read."""
    try:
        if sys.stdin.encoding.lower().replace("-", "") == "utf8":
            sys.stdin.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError):     # not a text stream we can reconfigure (a test's StringIO)
        pass


def _load(a):
    from .model import load
    return load(a.model, backend=a.backend, context_length=a.context, revision=a.revision,
                kv_dtype=getattr(a, "kv_dtype", None))


class _CtrlC:
    """While a reply streams, the first Ctrl-C asks the model to stop (``Model.cancel()``): the
    reply ends at the next token with finish reason "cancelled" and its statistics. A second
    Ctrl-C interrupts at once (KeyboardInterrupt)."""

    def __init__(self, model):
        self.model, self.hits, self.old = model, 0, None

    def __enter__(self):
        try:
            self.old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:          # not the main thread: leave Ctrl-C alone
            self.old = None
        return self

    def _handler(self, signum, frame):
        self.hits += 1
        if self.hits > 1:
            raise KeyboardInterrupt
        self.model.cancel()

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


def _stream(model, prompt, a, out, turn: int = 0) -> tuple[str, str | None]:
    """Stream one reply to ``out``; its reasoning, when there is any, goes to stderr between
    <think> and </think> (not with -q), statistics too. Returns (answer text, finish reason)."""
    text, last, n, t0 = [], None, 0, time.perf_counter()
    show_reasoning = not getattr(a, "quiet", False)
    in_reasoning = False
    try:
        with _CtrlC(model):
            for chunk in model.generate(prompt, **_sampling_kwargs(a, turn)):
                if chunk.reasoning and show_reasoning:
                    if not in_reasoning:
                        print("<think>", file=sys.stderr)
                        in_reasoning = True
                    print(chunk.reasoning, end="", file=sys.stderr, flush=True)
                if in_reasoning and (chunk.text or chunk.finish_reason):
                    print("\n</think>", file=sys.stderr, flush=True)
                    in_reasoning = False
                out.write(chunk.text)
                for call in chunk.tool_calls:
                    out.write(f"\n[tool call] {call.name}({call.arguments})")
                for err in chunk.tool_call_errors:
                    out.write(f"\n[malformed tool call: {err.message}] {err.raw}")
                out.flush()
                text.append(chunk.text)
                n += chunk.token is not None
                last = chunk
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        print(f"[interrupted] generated {n} tokens in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        raise
    out.write("\n")
    if last is not None and last.stats is not None and not getattr(a, "quiet", False):
        print(f"[{last.finish_reason}] {last.stats}", file=sys.stderr)
    return "".join(text), None if last is None else last.finish_reason


def cmd_generate(a) -> int:
    _check_sampling(a)
    if a.prompt is None:
        # A prompt piped on stdin: the newline that ends the last line is not part of it.
        _stdin_keeps_bad_bytes()
        a.prompt = _utf8(sys.stdin.read(), "the prompt on stdin")
        if a.prompt.endswith("\n"):
            a.prompt = a.prompt[:-2] if a.prompt.endswith("\r\n") else a.prompt[:-1]
    else:
        _utf8(a.prompt, "--prompt")
    if a.system is not None:
        _utf8(a.system, "--system")
    model = _load(a)
    prompt = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
    if a.system and not a.raw:
        prompt.insert(0, {"role": "system", "content": a.system})
    if not a.raw and (model.tokenizer is None or model.tokenizer.chat_template is None):
        prompt = a.prompt
    try:
        _stream(model, prompt, a, sys.stdout)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_chat(a) -> int:
    from .errors import LilyError
    _check_sampling(a)
    if a.system is not None:
        _utf8(a.system, "--system")
    _stdin_keeps_bad_bytes()
    model = _load(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print(f"lily_py chat — {model.config.summary()} [{model.backend}]. {CHAT_HELP}",
          file=sys.stderr)
    # The ">>> " prompt only for a person at a terminal, and never into a redirected stdout:
    # piped input gives stdout the replies alone.
    interactive = sys.stdin.isatty()
    prompt = ">>> " if interactive and sys.stdout.isatty() else ""
    turn = n_line = 0
    while True:
        try:
            if interactive and not prompt:
                print(">>> ", end="", file=sys.stderr, flush=True)
            line = input(prompt)
            n_line += 1
            _utf8(line, f"input line {n_line}")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        except ValueError as e:         # not UTF-8: say where, keep the session
            print(f"lily-py: error: {e}", file=sys.stderr)
            continue
        if not line.strip():
            continue
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/help":
            print(CHAT_HELP, file=sys.stderr)
            continue
        if cmd == "/reset":
            messages = messages[:1] if a.system else []
            model.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if cmd.startswith("/") and " " not in cmd:
            print(f"unknown command {cmd}. {CHAT_HELP} (start a message with a space to send "
                  "it as text)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply, why = _stream(model, messages, a, sys.stdout, turn)
            turn += 1
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            messages.pop()
            continue
        except (LilyError, ValueError, TypeError) as e:
            # e.g. the conversation outgrew --context: keep the session, drop the message
            print(f"\nlily-py: error: {e} (type /reset to start over)", file=sys.stderr)
            messages.pop()
            continue
        if why == "cancelled":
            print("(reply stopped; it stays in the conversation)", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


def cmd_info(a) -> int:
    from .checkpoint import load_weights
    from .hub import resolve
    from .resources import demo_path
    model = a.path if a.path is not None else a.model
    folder = demo_path() if model is None else resolve(model)
    cfg, w = load_weights(folder)
    print(f"folder: {folder}")
    print(cfg.summary())
    print(f"format: {w.format} (norms stored {w.norm_convention}); "
          f"{len(w.files)} weight file(s); {w.nbytes() / 1e6:.1f} MB of weights")
    if w.skipped:
        print("skipped: " + ", ".join(f"{n} tensor(s) of the {r}" for r, n in w.skipped.items()))
    q = cfg.quantization
    if q is not None and q.overrides:
        from collections import Counter
        widths = Counter((s.bits, s.group_size) for s in q.overrides.values()
                         if (s.bits, s.group_size) != (q.bits, q.group_size))
        if widths:
            print(f"quantization: {q.bits}-bit g{q.group_size} by default; per module: "
                  + ", ".join(f"{b}-bit g{g} x{n}" for (b, g), n in sorted(widths.items())))
    from .sizes import config_recipe, describe_fit
    recipe = config_recipe(cfg)
    if recipe is None:
        print("memory: unquantized; the engine runs MLX affine-quantized checkpoints (backend='reference' "
              "runs this one)")
    else:
        # load()'s default context: the model's whole context (the KV cache grows to it in blocks)
        ctx = min(a.context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        ws, dev = None, ""
        try:
            import lily_py
            if "metal" in {d["name"] for d in lily_py._core.registry.list() if d["available"]}:
                ws, dev = lily_py.device_info("metal").get("working_set_bytes"), "metal"
        except Exception:  # noqa: BLE001 - no core / no Metal: the Mac table instead
            ws = None
        for line in describe_fit(cfg, recipe, context_length=ctx, working_set=ws, device=dev,
                                 kv_dtype=a.kv_dtype):
            print(line)
    try:
        import lily_py
        print(f"lily_py {lily_py.__version__}; core: {lily_py.build_info()}")
    except ImportError as e:
        print(f"lily_py {__version__}; native core not importable: {e}")
    return 0


def cmd_align(a) -> int:
    from .tools.align import align_checkpoint
    for fn, r in align_checkpoint(a.src, a.dst).items():
        print(f"{fn}: {r['tensors']} tensors in {r['groups']} runs (an engine weight's parts, or one "
              f"other tensor), {r['aligned_groups']} of them at 16-byte offsets")
    return 0


def _add_tool_commands(sub) -> None:
    """``doctor`` and ``bench`` (lily_py/tools/)."""
    d = sub.add_parser("doctor", help="check this build on this machine: device, pipelines, "
                       "every kernel family and the demo model against the NumPy reference")
    d.add_argument("--device", choices=["metal", "emu", "cuda"], default=None,
                   help="device to check (default: metal where usable, else emu)")
    d.add_argument("--quick", action="store_true", help="smaller model-sized cases (emulator)")
    d.add_argument("--seed", type=int, default=None, help="replay a run's random inputs")
    d.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    d.set_defaults(func=lambda a: __import__("lily_py").doctor(
        a.device, quick=a.quick, json_path=a.json_path, seed=a.seed))

    al = sub.add_parser("align", help="rewrite a checkpoint so the engine serves every weight from its "
                        "pages (16-byte offsets, fused parts back to back; same tensors and bytes)")
    al.add_argument("src", help="checkpoint folder")
    al.add_argument("dst", help="new folder to write")
    al.set_defaults(func=cmd_align)

    b = sub.add_parser("bench", help="prefill / decode tokens/s, counters per token, time to first "
                       "token and peak memory at Lily's and MLX's context lengths")
    from .tools.bench import add_arguments
    add_arguments(b)


DESCRIPTION = ("Fast local inference for Qwen3.6-35B-A3B. Without --model, every command uses "
               "the small demo checkpoint bundled with lily_py.")


def parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand and its flags."""
    ap = argparse.ArgumentParser(prog="lily-py", description=DESCRIPTION, formatter_class=_Formatter)
    ap.add_argument("--version", action="version", version=f"lily_py {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion to stdout", formatter_class=_Formatter)
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", "-p", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--system", default=None, help="system prompt (chat mode)")
    g.add_argument("--raw", action="store_true",
                   help="feed the prompt as plain text instead of a chat user message")
    g.add_argument("--quiet", "-q", action="store_true", help="no statistics on stderr")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=_Formatter)
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("info", help="describe a checkpoint, the memory it needs and this build",
                       formatter_class=_Formatter)
    i.add_argument("path", nargs="?", default=None,
                   help="checkpoint folder or hub id (default: --model, else the bundled demo)")
    i.add_argument("--model", "-m", default=None)
    i.add_argument("--context", type=int, default=None,
                   help="context length the memory line is for (default: the model's "
                        "max_position_embeddings, load()'s default: the memory of a full context)")
    i.add_argument("--kv-dtype", choices=["bfloat16", "int8", "float32"], default=None,
                   help="KV cache element type the memory lines count (default bfloat16)")
    i.set_defaults(func=cmd_info)

    from .serve.cli import add_parser as add_serve_parser
    add_serve_parser(sub, _add_model_args)
    _add_tool_commands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from .errors import LilyError
    try:
        return a.func(a)
    except (LilyError, FileNotFoundError, ValueError, TypeError) as e:
        print(f"lily-py: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:           # e.g. Ctrl-C while loading: no traceback
        print("\nlily-py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
