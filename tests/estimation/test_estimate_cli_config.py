"""``python -m llmmem estimate PATH``: a Hugging Face config.json (or a directory holding one), read
offline, estimated as ``llmmem.estimate(config)`` estimates the config object; bad paths and unknown
architectures are one line naming the argument (issue 15)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import llmmem
from llmmem.__main__ import main


def _transformers():
    return pytest.importorskip("transformers", reason="reading a saved Hugging Face config needs transformers")


def _llama_config(transformers):
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def _gpt2_config(transformers):
    return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=128)


def _without_name(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    d["model"].pop("name")
    return d


@pytest.mark.parametrize("make", [_llama_config, _gpt2_config], ids=["llama", "gpt2"])
@pytest.mark.parametrize("extra", [[], ["--attention", "explicit", "--checkpointing", "selective"]], ids=["", "opts"])
def test_a_saved_config_is_estimated_as_the_config_object(make, extra, tmp_path, capsys):
    config = make(_transformers())
    config.save_pretrained(tmp_path)
    kwargs = {"attention": "explicit", "checkpointing": "selective"} if extra else {}
    expected = _without_name(llmmem.estimate(config, batch=2, seq=64, **kwargs).to_dict())
    for path in (tmp_path, tmp_path / "config.json"):
        assert main(["estimate", str(path), "--batch", "2", "--seq", "64", "--json", *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        assert _without_name(got) == expected, path
    # the architecture was read, not guessed: a Llama is RMSNorm, SwiGLU, rotary, grouped heads
    if make is _llama_config:
        assert (got["model"]["norm"], got["model"]["mlp"], got["model"]["positions"]) == (
            "rmsnorm",
            "swiglu",
            "rotary",
        )
        assert got["model"]["kv_heads"] == 2
    # the table form works too and names the file
    assert main(["estimate", str(tmp_path), "--batch", "2", "--seq", "64"]) == 0
    assert str(tmp_path) in capsys.readouterr().out


def test_reading_needs_no_network_nor_transformers(tmp_path):
    config = _llama_config(_transformers())
    config.save_pretrained(tmp_path)
    # a fresh interpreter where importing transformers fails and sockets cannot connect
    code = (
        "import sys, socket\n"
        "sys.modules['transformers'] = None\n"
        "def refuse(*a, **k):\n    raise OSError('network used')\n"
        "socket.socket.connect = refuse\n"
        "from llmmem.__main__ import main\n"
        f"sys.exit(main(['estimate', {str(tmp_path)!r}, '--json']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["layers"] == 4


@pytest.mark.parametrize(
    "content, words",
    [
        (None, ["model", "no such file"]),
        ("dir-without-config", ["model", "holds no config.json"]),
        ("{not json", ["model", "cannot read"]),
        ("[1, 2]", ["model", "JSON list"]),
        (
            json.dumps({"model_type": "resnet", "num_channels": 3, "hidden_sizes": [64]}),
            ["model", "resnet", "not a causal language model"],
        ),
        (json.dumps({"model_type": "mystery", "num_hidden_layers": 2, "hidden_size": 8}), ["model", "vocab_size"]),
    ],
)
def test_bad_config_paths_are_one_line_naming_the_argument(content, words, tmp_path, capsys):
    if content is None:
        path = tmp_path / "missing" / "config.json"
    elif content == "dir-without-config":
        path = tmp_path
    else:
        path = tmp_path / "config.json"
        path.write_text(content)
    assert main(["estimate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("error: model: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_an_unknown_name_mentions_config_files(capsys):
    assert main(["estimate", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "llama-9000" in err and "config.json" in err and "llama-7b" in err
