"""A GRPO-style RL loop, end to end on one small machine: rollouts from vLLM (TP2), a train step
on 2 FSDP2 ranks, a weight sync into vLLM through awex_fast, repeat.

    python examples/grpo_vllm.py [--steps 16] [--out grpo_out]

The task is verifiable and made up: the reward of a completion is the fraction of its tokens that
fall in a target range of the vocabulary (ids below ``--target-below``). A tiny Qwen2 with random
weights starts near the range's share of the vocabulary and learns to stay in it. Per step it
prints the mean reward of the rollouts, the seconds the weight sync took, and the weight version
the rollouts were generated with (step k's rollouts come from the weights of step k - 1's
update, i.e. version k - 1); it writes ``reward_and_sync.png`` and ``steps.json`` to ``--out``.

What runs where: this script (the launcher) writes the model, starts ``vllm serve`` with
``--weight-transfer-config '{"backend": "awex_fast"}'`` and two trainer processes (itself with
``--rank``). Each trainer rank holds a `FSDPTrainEngine` and a `RemotevLLMEngine` client: it
samples ``--group`` completions for each of its prompts, computes group-normalised advantages,
trains one step, then the ranks upload the new weights (``connect_engine`` + ``upload_weights``:
every rank sends its own shards; rank 0 drives vLLM) while the inference client waits for every
server to report the new version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from awex_fast.net import free_port

VOCAB = 512


def make_model(path: Path, seed: int) -> None:
    """A tiny random Qwen2 (2 layers, hidden 128, GQA) saved as a Hugging Face checkpoint."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def start_vllm(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` (CPU, TP2, bfloat16) with the awex_fast backend; returns (process, url)."""
    import urllib.request

    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--skip-tokenizer-init",
        "--weight-transfer-config",
        json.dumps({"backend": "awex_fast"}),
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out, a version per token
    ]
    # cwd away from the checkout: `python -m` puts the cwd first on sys.path, and the source tree
    # (no compiled extension) would shadow the installed awex_fast in vLLM's processes
    proc = subprocess.Popen(
        cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"vLLM did not come up in 300 s; see {log}")


# --- trainer rank -----------------------------------------------------------------------------------


def reward(tokens: list[int], target_below: int) -> float:
    """The verifiable reward: the fraction of generated tokens in the target range."""
    return sum(t < target_below for t in tokens) / max(1, len(tokens))


def _loss(logits: Any, mb: Any) -> Any:
    """Policy gradient with group-normalised advantages: -A * log p(token), averaged over the
    generated tokens of the micro-batch."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    chosen = logp.gather(-1, mb["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = mb["loss_mask"][:, 1:].float()
    return -(chosen * mb["advantage"][:, None] * mask).sum() / mask.sum().clamp(min=1.0)


def _weight(mb: Any) -> float:
    return float(mb["loss_mask"][:, 1:].sum())


def grpo_batch(outs: list, rewards: Any, prompts: int, group: int) -> Any:
    """The training batch of one step: every rollout's tokens, its completion as the loss mask,
    and its group-normalized advantage (GRPO: reward minus the group mean, over the group std)."""
    import torch
    from tensordict import TensorDict

    grouped = rewards.view(prompts, group)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    width = max(o.input_len + o.output_len for o in outs)
    ids = torch.zeros(len(outs), width, dtype=torch.long)
    mask, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, o in enumerate(outs):
        seq = o.input_tokens + o.output_tokens
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        loss_mask[i, o.input_len : len(seq)] = 1
    return TensorDict(
        {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "advantage": adv},
        batch_size=[len(outs)],
    )


def trainer_main(args: argparse.Namespace) -> None:
    """One trainer rank: rollouts through vLLM, a GRPO step, the weight sync, repeated."""
    import torch

    from python_engines.api import (
        FinetuneSpec,
        GenerationHyperparameters,
        InferenceEngineConfig,
        LLMRequest,
        WeightUpdateMeta,
    )
    from python_engines.inference import RemotevLLMEngine
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig

    rank = int(os.environ["RANK"])
    train = FSDPTrainEngine(
        FSDPEngineConfig(
            path=args.model,
            dtype="float32",
            device="cpu",
            seed=1,
            optimizer=OptimizerConfig(lr=args.lr, warmup_steps_proportion=0.0),
        )
    )
    train.initialize(None, FinetuneSpec(1, args.steps * 64, 64))
    rollout = RemotevLLMEngine(InferenceEngineConfig(request_timeout=300.0))
    rollout.initialize(args.url)
    train.connect_engine(args.url)
    gen = torch.Generator().manual_seed(100 + rank)
    prompts = [
        torch.randint(args.target_below, VOCAB, (6,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    gconfig = GenerationHyperparameters(max_new_tokens=args.new_tokens, temperature=1.0)
    log = []
    for step in range(1, args.steps + 1):

        async def rollouts() -> list:
            reqs = [LLMRequest(input_ids=p, gconfig=gconfig) for p in prompts for _ in range(args.group)]
            return await asyncio.gather(*(rollout.agenerate(r) for r in reqs))

        t0 = time.perf_counter()
        outs = asyncio.run(rollouts())
        gen_s = time.perf_counter() - t0
        rewards = torch.tensor([reward(o.output_tokens, args.target_below) for o in outs])
        batch = grpo_batch(outs, rewards, args.prompts, args.group)
        stats = train.train_batch(batch, _loss, _weight)
        train.set_version(step)
        meta = WeightUpdateMeta(type="awex", version=step)
        t1 = time.perf_counter()
        landed = rollout.update_weights(meta)
        train.upload_weights(meta)
        landed.result(timeout=300)
        sync_s = time.perf_counter() - t1
        versions = sorted({v for o in outs for v in o.output_versions})
        both = torch.tensor([float(rewards.mean())])
        torch.distributed.all_reduce(both)  # the mean over both ranks' rollouts
        mean_reward = float(both) / torch.distributed.get_world_size()
        row = {
            "step": step,
            "reward": mean_reward,
            "sync_s": sync_s,
            "rollout_versions": versions,
            "generate_s": gen_s,
            "loss": float(stats.get("loss", float("nan"))),
        }
        log.append(row)
        if rank == 0:
            print(
                f"step {step:3d}  reward {mean_reward:.3f}  sync {sync_s:.2f} s  rollouts from version "
                f"{versions}  (generate {gen_s:.1f} s)",
                flush=True,
            )
    if rank == 0:
        Path(args.out, "steps.json").write_text(json.dumps(log, indent=1))
    train.destroy()
    rollout.destroy()


# --- launcher ---------------------------------------------------------------------------------------


def plot(steps: list[dict], path: Path) -> None:
    """Reward and sync seconds per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [s["step"] for s in steps]
    ax.plot(xs, [s["reward"] for s in steps], "o-", color="tab:blue", label="mean reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward", color="tab:blue")
    ax2 = ax.twinx()
    ax2.bar(xs, [s["sync_s"] for s in steps], alpha=0.3, color="tab:orange", label="weight sync (s)")
    ax2.set_ylabel("weight sync seconds", color="tab:orange")
    ax.set_title("GRPO on vLLM TP2 <- 2 FSDP2 ranks, weights synced by awex_fast")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Launcher (no ``--rank``) or one trainer rank (``--rank``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=4, help="prompts per trainer rank")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--target-below", type=int, default=64, help="rewarded token ids are below this")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="grpo_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        trainer_main(args)
        return 0
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = out / "model"
    make_model(model, args.seed)
    server, url = start_vllm(model, out / "vllm.log")
    print(f"vLLM TP2 serving {model} at {url}", flush=True)
    procs = []
    try:
        port = free_port()
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            cmd = [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--url",
                url,
                "--model",
                str(model),
                *[
                    f"--{k.replace('_', '-')}={v}"
                    for k, v in vars(args).items()
                    if k not in ("rank", "url", "model") and v is not None
                ],
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [pr.wait() for pr in procs]
        if any(codes):
            print(f"trainer ranks exited with {codes}", file=sys.stderr)
            return 1
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
        os.killpg(server.pid, signal.SIGKILL)
    steps = json.loads((out / "steps.json").read_text())
    try:
        plot(steps, out / "reward_and_sync.png")
        print(f"wrote {out / 'reward_and_sync.png'}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'awex_fast[examples]')")
    first, last = steps[0]["reward"], steps[-1]["reward"]
    print(f"reward {first:.3f} -> {last:.3f} over {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
