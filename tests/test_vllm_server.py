"""A real server: vLLM's OpenAI-compatible server on 127.0.0.1 serving an exported SPD directory (tiny Llama,
plan ``all``, TP=2, through the plugin) answers one completion request with syncdrop's greedy tokens, and
stops cleanly on SIGINT."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from syncdrop.serve.engine import VllmServer
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import reference_logprobs

pytestmark = pytest.mark.needs_vllm


def test_completion_from_an_exported_spd_model(tiny_vllm_dir, tmp_path) -> None:
    model = tiny_vllm_dir("llama")
    exported = export_model(str(model), 2, tmp_path / "export", "all", progress=False)
    prompt = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    want = reference_logprobs(str(model), 2, [prompt], 6, "all")["tokens"][0]
    server = VllmServer(exported.out, 2, tmp_path / "server.log", extra_args=["--dtype", "float32"])
    with server as url:
        body = {"model": str(exported.out), "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    got = [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert got == want
    assert server.exit_code == 0, (server.exit_code, (tmp_path / "server.log").read_text()[-2000:])
