"""Issue 12's rough edges, one test each (what a new user hit, and what happens now)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import lily_py
from lily_py.cli import main


@pytest.fixture(scope="module")
def demo():
    return lily_py.load(backend="reference")


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number"),
    (dict(temperature="0.7"), TypeError, "temperature must be a number, got '0.7'"),
    (dict(temperature=True), TypeError, "temperature must be a number"),
    (dict(top_p="1"), TypeError, "top_p must be a number"),
    (dict(stop=123), TypeError, "stop must be a string or a list of strings, got 123"),
    (dict(stop=["a", 1]), TypeError, "stop must be a string or a list of strings"),
    # a wrong type is a TypeError naming the parameter, a bad value a ValueError, for every one
    (dict(max_tokens=True), TypeError, "max_tokens must be an integer, got True"),
    (dict(max_tokens=0), ValueError, "max_tokens must be a positive integer"),
    (dict(seed="abc"), TypeError, "seed must be an integer, got 'abc'"),
    (dict(seed=-1), ValueError, "seed must be a non-negative integer"),
    (dict(top_k="3"), TypeError, "top_k must be an integer"),
    (dict(top_k=-1), ValueError, "top_k must be an integer >= 0"),
    (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
    (dict(min_p=2), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(logprobs=True, top_logprobs="2"), TypeError, "top_logprobs must be an integer"),
    (dict(logprobs=True, top_logprobs=99), ValueError, "top_logprobs must be an integer in"),
])
def test_bad_sampling_arguments_are_refused_clearly(demo, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        demo.generate("In the beginning", **kw)
    assert demo.generate_text("In", max_tokens=1).tokens      # still usable


@pytest.mark.parametrize("kw, exc", [(dict(seed="abc"), TypeError), (dict(temperature="0.7"), TypeError),
                                     (dict(top_k=1.5), TypeError), (dict(seed=-1), ValueError),
                                     (dict(top_p=0), ValueError)])
def test_sampling_params_follow_the_same_rule(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        lily_py.SamplingParams(**kw)


@pytest.mark.parametrize("msgs, exc, msg", [
    ([{"role": "user"}], ValueError, r"messages\[0\] \(role 'user'\) has no 'content'"),
    ([{"role": "user", "content": None}], ValueError, "has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], ValueError,
     r"messages\[1\] \(role 'assistant'\) has no 'content' and no 'tool_calls'"),
    ([{"role": "bot", "content": "hi"}], ValueError,
     "messages\\[0\\] has role 'bot'; the chat template takes 'system', 'user', 'assistant', 'tool'"),
    ([{"role": "user", "content": 5}], TypeError, "must be a string or a list of content parts"),
])
def test_bad_messages_are_refused_clearly(demo, msgs, exc, msg):
    with pytest.raises(exc, match=msg):
        demo.generate(msgs)


def test_an_assistant_turn_with_only_tool_calls_is_fine(demo):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "sunny"}]
    text = demo.tokenizer.decode(demo.prompt_ids(msgs))
    assert "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # OpenAI clients send the arguments as JSON text: same rendering, caller's list untouched
    openai_msgs = [dict(m) for m in msgs]
    openai_msgs[1] = dict(msgs[1], tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}])
    assert demo.tokenizer.decode(demo.prompt_ids(openai_msgs)) == text
    assert openai_msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    bad = [msgs[0], dict(openai_msgs[1], tool_calls=[
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]), msgs[2]]
    with pytest.raises(ValueError, match="arguments are not valid JSON"):
        demo.generate(bad)


def test_config_bits_contradicting_the_tensors_is_an_error(tmp_path):
    from lily_py.errors import CheckpointError
    from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
    p = make_checkpoint(tmp_path / "c", dict(TINY_TEXT_CONFIG), fmt="mlx", seed=1)
    cfg_file = os.path.join(p, "config.json")
    cfg = json.load(open(cfg_file))
    lily_py.load(p, backend="reference")                          # consistent: loads
    cfg["quantization"]["bits"] = 8                               # the tensors are 4-bit
    if "quantization_config" in cfg:
        cfg["quantization_config"]["bits"] = 8
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(CheckpointError, match=r"the config.s quantization default says 8-bit group 64, but "
                       r".*shapes imply 4-bit group 64\); fix 'quantization' in config.json"):
        lily_py.load(p, backend="reference")


@pytest.mark.parametrize("path", ["models/qwen3.6", "./qwen", "~/no/such/model", "a/b/c", "x/"])
def test_a_mistyped_local_path_is_not_a_hub_problem(tmp_path, monkeypatch, path):
    from lily_py.errors import CheckpointError
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="no such folder \\(read as a local path") as e:
        lily_py.load(path)
    assert "hub" not in str(e.value).replace("Hugging Face repo id", "")


def test_a_repo_id_still_goes_to_the_hub(tmp_path, monkeypatch):
    from lily_py.errors import CheckpointError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        lily_py.load("someorg/somemodel")


def test_one_default_context_length_for_every_backend():
    ref = lily_py.load(backend="reference")
    emu = lily_py.load(backend="emu")
    # The model's whole context: the engine takes KV blocks as positions advance.
    assert ref.context_length == emu.context_length == ref.config.max_position_embeddings
    assert "max_position_embeddings" in lily_py.load.__doc__ and "every backend" in lily_py.load.__doc__


def test_max_tokens_default_is_the_same_and_help_shows_defaults(capsys):
    import inspect
    import lily_py.cli as cli
    assert inspect.signature(lily_py.Model.generate).parameters["max_tokens"].default == \
        lily_py.DEFAULT_MAX_TOKENS == cli.DEFAULT_MAX_TOKENS == 256
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for s in ["(default: 256)", "0 = greedy (default: 0.0)", "(default: auto)",
              "(default: the model's max_position_embeddings", "1 = off (default: 1.0)"]:
        assert s in out, s


def test_stdin_prompt_loses_its_trailing_newline(capsys, monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("In the beginning\n"))
    assert main(["generate", "--raw", "--max-tokens", "6", "-q"]) == 0
    piped = capsys.readouterr().out
    assert main(["generate", "--raw", "--max-tokens", "6", "-q", "-p", "In the beginning"]) == 0
    assert piped == capsys.readouterr().out


def _chat(stdin, *args):
    return subprocess.run([sys.executable, "-m", "lily_py.cli", "chat", "--max-tokens", "4", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_chat_commands_are_handled_by_the_cli():
    p = _chat("/help\n/nope\n/quit\nnever sent\n")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("/quit or /exit") == 3          # banner, /help, unknown command
    assert "unknown command /nope" in p.stderr
    assert "[length]" not in p.stderr and "[stop]" not in p.stderr      # nothing was generated


def test_chat_with_a_seed_gives_each_turn_its_own_seed():
    args = ("--seed", "5", "--temperature", "1.5", "--max-tokens", "12", "--no-thinking")
    p = _chat("In the beginning\n/reset\nIn the beginning\n/exit\n", *args)
    assert p.returncode == 0, p.stderr
    # turn N has the seed 5 + N (after /reset too): the API's replies with those seeds, one per line
    m = lily_py.load(backend="reference")
    msgs = [{"role": "user", "content": "In the beginning"}]
    r = [m.generate_text(msgs, seed=5 + n, temperature=1.5, max_tokens=12, enable_thinking=False)
         for n in (0, 1)]
    assert r[0].text != r[1].text
    assert p.stdout == r[0].text + "\n" + r[1].text + "\n"


def _start(args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "lily_py.cli", "generate", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _wait_for_output(p):
    """Wait until the reply has started streaming (the model is loaded and generating)."""
    seen = b""
    t0 = time.time()
    while time.time() - t0 < 120 and len(seen) < 5:
        seen += os.read(p.stdout.fileno(), 100)
    assert seen, "no output"


def test_ctrl_c_in_generate_stops_with_stats_and_no_traceback():
    p = _start(["--raw", "-p", "In the beginning", "--max-tokens", "100000", "--temperature", "1",
                "--context", "100000"])
    _wait_for_output(p)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1].decode()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "[cancelled] prompt" in err and "generated" in err


def test_ctrl_c_twice_exits_130_without_traceback():
    p = _start(["--raw", "-p", "In the beginning", "--max-tokens", "100000", "--temperature", "1",
                "--context", "100000"])
    _wait_for_output(p)
    # the handler stays installed until the generator returns: two signals close together
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1].decode()
    assert p.returncode in (0, 130), err       # the first may already have ended the reply
    assert "Traceback" not in err
    if p.returncode == 130:
        assert "interrupted" in err


def test_cancel_from_another_thread(demo):
    import threading
    g = demo.generate("In the beginning", max_tokens=5000)
    first = next(g)
    threading.Thread(target=demo.cancel).start()
    rest = list(g)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].stats.generated_tokens >= 1
    assert len(rest) < 100
    demo.cancel()                    # nothing running: no effect on the next generation
    assert demo.generate_text("In", max_tokens=3).finish_reason == "length"
    assert first.token is not None


@pytest.mark.parametrize("stop_at", ["first", "last"])
def test_after_a_stop_every_backend_has_fed_the_same_tokens(stop_at):
    """The engine pipelines the next step, so the token generation stopped at is usually fed
    already; the reference (and the engine where nothing was in flight) feed it too."""
    ref = lily_py.load(backend="reference", context_length=128)
    emu = lily_py.load(backend="emu", context_length=128)
    prompt = ref.tokenizer.encode("In the beginning")
    full = ref.generate_text(prompt, max_tokens=6)
    ref.reset()
    n = 0 if stop_at == "first" else 5          # 5: the last step, where nothing is in flight
    end = len(ref.tokenizer.decode(full.tokens[:n + 1]))
    text = ref.tokenizer.decode(full.tokens)
    stop = text[max(0, end - 7):end]
    assert text.find(stop) + len(stop) > len(ref.tokenizer.decode(full.tokens[:n]))
    a = ref.generate_text(prompt, max_tokens=6, stop=stop)
    b = emu.generate_text(prompt, max_tokens=6, stop=stop)
    assert a.tokens == b.tokens == full.tokens[:n + 1] and a.finish_reason == b.finish_reason == "stop"
    assert list(ref.tokens) == list(emu.tokens) == prompt + a.tokens


def test_finish_reason_tells_a_full_context_from_max_tokens():
    m = lily_py.load(backend="reference", context_length=12)
    ids = m.tokenizer.encode("In the beginning")
    assert m.generate_text(ids, max_tokens=2).finish_reason == "length"
    m.reset()
    r = m.generate_text(ids, max_tokens=100)
    assert r.finish_reason == "context_length" and m.position == 12
