"""`awex-fast bench --engine vllm`: one weight update into a real vLLM TP engine, every route timed
in the same run on the same server.

The parent writes a Hugging Face checkpoint of the model shape (`awex_fast.layouts.models`, random
weights), starts ``python -m vllm.entrypoints.openai.api_server`` (TP ``--tp``) with backend
``awex_fast`` and the `awex_fast.vllm.baselines.BenchWorkerExtension` (which swaps the workers'
weight-transfer engine between routes), and spawns the trainer ranks (FSDP2 over gloo, float32
weights, every local shard rewritten before every timed update) plus ``--tp`` stand-in receivers
for the raw bound, as fresh processes (``python -m awex_fast.bench.vllm_ranks ROLE SPEC.json``; JSON
specs and results, no pickle). Routes, interleaved per iteration (iteration 0 is a warm-up):

* ``awex_fast``: `awex_fast.vllm` (each trainer rank sends its own shards' boxes to the workers
  that keep them; the workers receive them in the background while vLLM keeps serving, then
  vLLM's layerwise reload applies them: ``receive_while_serving``);
* ``awex_fast_blocking``: the same with ``receive_while_serving=False`` (the workers receive
  inside vLLM's ``update_weights`` RPC: vLLM stands still for the whole round);
* ``broadcast``: vLLM's ``nccl``-backend algorithm on gloo (`awex_fast.vllm.baselines`): rank 0
  gathers every full tensor, casts, packs 1 GiB buckets, broadcasts them to every worker, which
  calls ``load_weights`` inside the layerwise reload (that reload runs from vLLM's start RPC to
  its finish, so with the stall meter on generation is paused around the round, ``/pause?mode=
  keep`` and ``/resume``, as vLLM's RL examples do, and the pause is timed);
* ``disk``: rank 0 gathers, casts and saves one safetensors file, then every worker reloads it
  through vLLM's own loader (``/collective_rpc`` ``reload_weights(weights_path=DIR)``, vLLM's
  `model_loader.reload.reload_weights`: layerwise reload of ``get_all_weights``);
* ``raw``: the transport's bound: each (trainer rank, worker) pair of awex_fast's plan moves the
  same bytes as one contiguous gloo message, between the trainer ranks and ``--tp`` stand-in
  receiver processes (vLLM's workers cannot run foreign code on request).

With ``--quant fp8`` the server serves a block-FP8 checkpoint (`awex_fast.vllm.fp8_checkpoint`;
on a CPU without AMX through `awex_fast.vllm.cpu_fp8`'s fallback kernel, switched on for the
server) and the routes are:

* ``awex_fast``: the trainer ranks quantize their shards (``fp8_quantize="trainer"``): e4m3 and
  float32 scales on the wire;
* ``awex_fast_receiver``: the training dtype on the wire, each worker quantizing what it received
  (``fp8_quantize="engine"``; float32, since quantizing bf16-rounded values would not equal vLLM's
  quantizer applied to the trainer's weights);
* ``raw``: the transport bound of the ``awex_fast`` route's bytes;
* ``bf16``: ``awex_fast`` into a bfloat16 server of the same shape (a second server, started once
  the FP8 one is gone), for the bytes and seconds FP8 saves.

With ``--two-hosts`` (root) the run spans two hosts (`awex_fast.bench.two_hosts`): the trainer
ranks stay on this host, the vLLM server and raw's receivers run on a second host, a network
namespace behind one veth link shaped to ``--link-gbps`` (a token bucket), and every address is
the one a two-node user has (the server's URL on the engine host's address; awex_fast finds the
rest from it; the broadcast group's rendezvous on the trainer host). The table adds the bytes
each route put on the link (the trainer host's kernel counter, HTTP included) and the **link
bound**: awex_fast's wire bytes, which all cross the one link, over its rate (``link_bound_s`` in
``--json``). The disk route reads its file from the shared file system, not across the link.

**Stall** (unless ``--no-stall``): trainer rank 0 keeps one streaming greedy completion running
against the server through every timed update (`awex_fast.bench.stall`); a route's stall is the
longest gap between two streamed tokens during its update minus the median gap outside updates
(about 0 for an update that never stops generation, about the update's length for one that
stops it throughout). Every route is timed under that load, raw included (it has no stall).

Phases: ``transfer`` is everything before vLLM's finalize (start + update RPCs, including the
trainer's gathers and the workers' ``load_weights``), ``finalize`` is vLLM's
``finalize_layerwise_reload`` (CPU repacking) as the ``finish_weight_update`` RPC times it, which
every route pays. The disk route finalizes inside one RPC: its transfer is shown as total minus
the median finalize of the other routes (marked ``~``). After timing, each route delivers the
same weights once more and the server's ``/weight_checker`` checksums must equal awex_fast's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from awex_fast.net import free_port

if TYPE_CHECKING:
    from awex_fast.bench.two_hosts import TwoHosts

ROUTES = ("awex_fast", "awex_fast_blocking", "broadcast", "disk", "raw")
FP8_ROUTES = ("awex_fast", "awex_fast_receiver", "raw", "bf16")
_HEADS = {"qwen2.5-0.5b": 14, "qwen2.5-1.5b": 12, "qwen2.5-7b": 28, "qwen2.5-72b": 64}


# --- parent ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `awex-fast bench --engine vllm`."""
    p = argparse.ArgumentParser(prog="awex-fast bench --engine vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="vllm", choices=["vllm"])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(_HEADS), help="model shape")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--untied", action="store_true",
                   help="give the model its own lm_head (Qwen2.5-0.5B ties it to the embedding)")
    p.add_argument("--tp", type=int, default=2, help="vLLM tensor parallel size")
    p.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks")
    p.add_argument("--dtype", default="bfloat16", help="vLLM dtype")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--methods", default=None,
                   help=f"comma list of {', '.join(ROUTES)} (with --quant fp8: {', '.join(FP8_ROUTES)}); "
                        "default: all")
    p.add_argument("--quant", default="none", choices=["none", "fp8"],
                   help="fp8: serve a block-FP8 checkpoint and time the FP8 routes (module docstring)")
    p.add_argument("--transport", default="gloo", choices=["gloo", "ipc"],
                   help="awex_fast's and raw's transport (broadcast is vLLM's algorithm on gloo)")
    p.add_argument("--buffer-mb", type=int, default=1024, help="broadcast bucket (vLLM's default 1 GiB)")
    p.add_argument("--workdir", default=None, help="checkpoint and logs here (default: a temp dir)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--two-hosts", action="store_true",
                   help="the trainer ranks on this host, vLLM and raw's receivers on a second host (a "
                        "network namespace) behind one veth link shaped to --link-gbps (root)")
    p.add_argument("--link-gbps", type=float, default=10.0, help="with --two-hosts: the link's rate, Gbit/s")
    p.add_argument("--no-stall", dest="stall", action="store_false",
                   help="no streaming request during the updates (no stall column; module docstring)")
    return p


def write_checkpoint(path: Path, model: str, layers: int | None, dtype: str,
                     untied: bool = False) -> dict[str, Any]:
    """A Qwen2 checkpoint of the named shape with random weights (one safetensors file);
    ``untied`` adds an ``lm_head.weight`` of its own where the shape ties it."""
    import torch
    from safetensors.torch import save_file

    from awex_fast.layouts import model_spec

    spec = model_spec(model, layers)
    by = {t.name: t.shape for t in spec.tensors}
    vocab, hidden = by["model.embed_tokens.weight"]
    names = [(t.name, t.shape) for t in spec.tensors]
    if untied and "lm_head.weight" not in by:
        names.append(("lm_head.weight", (vocab, hidden)))
        by["lm_head.weight"] = (vocab, hidden)
    heads = _HEADS[model]
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": by["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": spec.num_layers, "num_attention_heads": heads,
        "num_key_value_heads": by["model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
        "vocab_size": vocab, "tie_word_embeddings": "lm_head.weight" not in by,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": dtype,
        "bos_token_id": 0, "eos_token_id": 1, "use_sliding_window": False,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype)) for n, shape in names}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return config


def write_fp8_checkpoint(bf16_dir: Path, path: Path, tp: int) -> None:
    """The block-FP8 checkpoint of the bfloat16 one in ``bf16_dir`` (`awex_fast.vllm.fp8_checkpoint`);
    refuses a shape whose TP-``tp`` shards vLLM cannot serve block-quantized, naming the tensors."""
    from safetensors.torch import load_file

    from awex_fast.vllm.fp8_checkpoint import fp8_checkpoint, misaligned_for_tp

    state = load_file(str(bf16_dir / "model.safetensors"))
    bad = misaligned_for_tp({n: tuple(t.shape) for n, t in state.items()}, tp)
    if bad:
        raise SystemExit(f"--quant fp8: this shape is not block-FP8 at TP{tp} ({'; '.join(bad[:3])}"
                         f"{'; ...' if len(bad) > 3 else ''}); try --model qwen2.5-1.5b")
    fp8_checkpoint(state, bf16_dir, path)


def start_server(model_dir: Path, tp: int, dtype: str, log: Path, timeout: float,
                 env_extra: dict[str, str] | None = None, prefix: Sequence[str] = (),
                 host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (dev mode), backend awex_fast, with the engine-switching extension;
    ``prefix`` runs it elsewhere (``ip netns exec NS`` for the engine host), listening on ``host``."""
    import requests

    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", **(env_extra or {}))
    cpus = os.cpu_count() or tp
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        f"{i * cpus // tp}-{(i + 1) * cpus // tp - 1}" if cpus // tp > 1 else str(i * cpus // tp)
        for i in range(tp)))
    cmd = [*prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", host, "--port", str(port), "--tensor-parallel-size", str(tp), "--enforce-eager",
           "--max-model-len", "128",
           "--dtype", dtype, "--skip-tokenizer-init",
           "--weight-transfer-config", json.dumps({"backend": "awex_fast"}),
           "--worker-extension-cls", "awex_fast.vllm.baselines.BenchWorkerExtension"]
    # cwd away from any checkout: `python -m` puts the cwd first on sys.path
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=log.parent,
                            start_new_session=True)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"vLLM did not come up in {timeout:.0f}s; see {log}")


def _spawn(role: str, spec: dict, tmp: Path, name: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen([*prefix, sys.executable, "-m", "awex_fast.bench.vllm_ranks", role, str(path)],
                            stdout=(tmp / f"{name}.log").open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=tmp)


def _wait(procs: dict[str, subprocess.Popen], tmp: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = {n: p.poll() for n, p in procs.items()}
        bad = [n for n, c in codes.items() if c not in (None, 0)]
        if bad or time.monotonic() > deadline:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            who = bad[0] if bad else next(n for n, c in codes.items() if c is None)
            log = (tmp / f"{who}.log").read_text(errors="replace")[-5000:]
            raise RuntimeError(f"{who} {'exited with ' + str(codes[who]) if bad else 'timed out'}:\n{log}")
        if all(c == 0 for c in codes.values()):
            return
        time.sleep(0.1)


def summarize(result: dict, raw: dict | None, spec: dict) -> dict:
    """Median seconds per phase and route, GB/s of the bytes the model holds in the inference
    dtype, and the ratios the issue asks for."""
    routes: dict[str, dict[str, Any]] = {}
    for name, its in result["times"].items():
        med = {k: statistics.median(v) if (v := [it[k] for it in its if it.get(k) is not None]) else None
               for k in its[0]}
        routes[name] = {"iters": its, **{k if k.endswith(("_s", "_bytes")) else f"{k}_s": v
                                         for k, v in med.items()}}
    fin = [r["finalize_s"] for n, r in routes.items() if n != "disk" and r.get("finalize_s") is not None]
    if "disk" in routes and fin:
        routes["disk"]["finalize_s"] = None
        routes["disk"]["transfer_s"] = routes["disk"]["total_s"] - statistics.median(fin)
        routes["disk"]["transfer_estimated"] = True
    if raw is not None:
        per = [max(r["times"][i] for r in raw["ranks"]) for i in range(spec["iters"])]
        routes["raw"] = {"iters": per, "transfer_s": statistics.median(per), "finalize_s": None,
                         "total_s": statistics.median(per), "bytes": raw["bytes"], "wire_bytes": raw["bytes"]}
    nbytes = result["model_bytes"]
    for r in routes.values():
        r["GBps"] = nbytes / r["transfer_s"] / 1e9 if r["transfer_s"] > 0 else 0.0
        r["update_s"] = r["total_s"]  # the whole update, as the trainer waits for it
        r.setdefault("stall_s", None)
    ours = routes.get("awex_fast")
    ratios: dict[str, float] = {}
    if ours:
        for other in ("broadcast", "disk", "raw", "awex_fast_receiver", "bf16"):
            if other in routes:
                ratios[f"transfer_vs_{other}"] = routes[other]["transfer_s"] / ours["transfer_s"]
                if other != "raw":
                    ratios[f"total_vs_{other}"] = routes[other]["total_s"] / ours["total_s"]
    if ours:
        # awex_fast's own split, from its workers: bytes moving vs vLLM applying them
        for phase in ("receive_s", "load_s", "finalize_s"):
            per = [max(v for k, v in it.items() if k.startswith("worker") and k.endswith(phase))
                   for it in ours["iters"] if any(k.endswith(phase) for k in it)]
            ours[f"workers_{phase}"] = statistics.median(per) if per else None
        if "raw" in routes and ours.get("workers_receive_s"):
            ratios["receive_vs_raw"] = routes["raw"]["transfer_s"] / ours["workers_receive_s"]
    blocking = routes.get("awex_fast_blocking")
    if ours and blocking and ours.get("stall_s") is not None:
        # the serving mode's stall against the whole update vLLM stands still for without it
        ratios["stall_vs_blocking_update"] = ours["stall_s"] / blocking["update_s"]
    if blocking and "raw" in routes:
        ratios["raw_vs_blocking_update"] = routes["raw"]["total_s"] / blocking["update_s"]
    if ours and ours.get("wire_bytes") and routes.get("bf16", {}).get("wire_bytes"):
        ratios["wire_vs_bf16"] = ours["wire_bytes"] / routes["bf16"]["wire_bytes"]
    link_bound = None
    if spec.get("link_gbps") and ours and ours.get("wire_bytes"):
        # one link between the hosts: every byte of awex_fast's plan crosses it
        link_bound = ours["wire_bytes"] * 8 / (spec["link_gbps"] * 1e9)
        for name, r in routes.items():
            if name != "raw":
                ratios[f"{name}_vs_link_bound"] = r["total_s"] / link_bound
    keys = ("model", "layers", "untied", "tp", "trainers", "dtype", "iters", "buffer_mb", "transport",
            "quant", "link_gbps")
    return {"layout": {k: spec.get(k) for k in keys}, "link_bound_s": link_bound,
            "model_bytes": nbytes, "raw_bytes": raw["bytes"] if raw else None, "routes": routes,
            "ratios": ratios, "checksums_equal": result.get("checksums_equal"),
            "mismatches": result.get("mismatches", {}), "phases": result.get("phases", {})}


def print_table(summary: dict) -> None:
    """The table `awex-fast bench --engine vllm` prints."""
    lay = summary["layout"]
    tie = " (untied lm_head)" if lay["untied"] else ""
    if lay["layers"] is None:
        from awex_fast.layouts import model_spec

        lay = {**lay, "layers": model_spec(lay["model"]).num_layers}
    served = "block-FP8 (e4m3 + scales)" if lay.get("quant") == "fp8" else lay["dtype"]
    link = lay.get("link_gbps")
    where = (f"; vLLM and raw's receivers on a second host behind a {link:g} Gbit/s link" if link else "")
    print(f"model={lay['model']}{tie} layers={lay['layers']} trainer=fsdp{lay['trainers']} (float32) -> vLLM "
          f"TP{lay['tp']} ({served}), {summary['model_bytes'] / 1e9:.3f} GB in {lay['dtype']}, "
          f"iters={lay['iters']}, awex_fast and raw over {lay.get('transport', 'gloo')}{where}, "
          "median seconds")
    print(f"{'route':18} {'transfer s':>11} {'finalize s':>11} {'total s':>8} {'stall s':>8} {'GB/s':>6} "
          f"{'wire MB':>8}" + (f" {'link MB':>8}" if link else "") + "  route / awex_fast (transfer, total)")
    ours = summary["routes"].get("awex_fast")
    for name, r in summary["routes"].items():
        tr = ("~" if r.get("transfer_estimated") else "") + f"{r['transfer_s']:.3f}"
        fin = "incl." if name == "disk" else ("-" if r["finalize_s"] is None else f"{r['finalize_s']:.3f}")
        ratio = ""
        if ours and name != "awex_fast":
            ratio = f"{r['transfer_s'] / ours['transfer_s']:.2f}x"
            if name != "raw":
                ratio += f", {r['total_s'] / ours['total_s']:.2f}x"
        wire = f"{r['wire_bytes'] / 1e6:.1f}" if r.get("wire_bytes") else "-"
        crossed = ""
        if link:  # measured on the trainer host's end of the link (raw's: not counted)
            got = r.get("link_bytes")
            crossed = " " + (f"{got / 1e6:.1f}" if got is not None else "-").rjust(8)
        stall = "-" if r.get("stall_s") is None else f"{r['stall_s']:.3f}"
        print(f"{name:18} {tr:>11} {fin:>11} {r['total_s']:8.3f} {stall:>8} {r['GBps']:6.2f} {wire:>8}"
              f"{crossed}  {ratio}")
    bound = summary.get("link_bound_s")
    if bound:
        times = ", ".join(f"{n} {summary['ratios'][f'{n}_vs_link_bound']:.2f}x" for n in summary["routes"]
                          if f"{n}_vs_link_bound" in summary["ratios"])
        print(f"{'link bound':18} {bound:11.3f} {'-':>11} {bound:8.3f}  (awex_fast's wire bytes / "
              f"{link:g} Gbit/s); total / bound: {times}")
        if "disk" in summary["routes"]:
            print("disk: the engine host reads the file from the shared file system, not across the link")
    if ours and ours.get("workers_receive_s") is not None:
        split = ", ".join(f"{k.removeprefix('workers_').removesuffix('_s')} {ours[k]:.3f} s"
                          for k in ("workers_receive_s", "workers_load_s", "workers_finalize_s")
                          if ours.get(k) is not None)
        raw_ratio = summary["ratios"].get("receive_vs_raw")
        print(f"awex_fast on its slowest worker: {split} (load: vLLM's load_weights and layer processing)"
              + (f"; receive vs raw: {raw_ratio:.2f}x" if raw_ratio else ""))
    if "stall_vs_blocking_update" in summary["ratios"]:
        print(f"stall: the longest gap between two streamed tokens during the update minus the median gap "
              f"outside updates; awex_fast's stall / awex_fast_blocking's whole update: "
              f"{summary['ratios']['stall_vs_blocking_update']:.2f}")
    if summary["raw_bytes"]:
        print(f"raw moves {summary['raw_bytes']:,} bytes (awex_fast's plan, per pair)")
    if "wire_vs_bf16" in summary["ratios"]:
        print(f"awex_fast's FP8 wire bytes / the bf16 server's: {summary['ratios']['wire_vs_bf16']:.3f}")
    print(f"checksums equal to awex_fast's after every route: {summary['checksums_equal']}"
          + (f" mismatches: {summary['mismatches']}" if summary["mismatches"] else ""))


def _methods(args: argparse.Namespace) -> list[str]:
    routes = FP8_ROUTES if args.quant == "fp8" else ROUTES
    methods = [m for m in (args.methods or ",".join(routes)).split(",") if m]
    unknown = set(methods) - set(routes)
    if unknown or "awex_fast" not in methods:
        raise SystemExit(f"--methods: choose from {', '.join(routes)}, awex_fast included")
    return methods


def _run_pass(args: argparse.Namespace, work: Path, ckpt: Path, methods: list[str], tag: str,
              env_extra: dict[str, str] | None = None,
              hosts: TwoHosts | None = None) -> tuple[dict, dict | None, dict]:
    """Start the server on ``ckpt``, run the trainer ranks (and raw receivers) through
    ``methods``, stop the server; returns (trainer 0's result, the raw receivers', the spec).
    With ``hosts`` the server and the raw receivers run on the engine host."""
    import torch.distributed as dist

    trainer_host = hosts.address("trainer") if hosts else "127.0.0.1"
    engine_host = hosts.address("engine") if hosts else "127.0.0.1"
    on_engine = hosts.command("engine", []) if hosts else []
    server = None
    try:
        t0 = time.perf_counter()
        server, url = start_server(ckpt, args.tp, args.dtype, work / f"server{tag}.log", 900, env_extra,
                                   prefix=on_engine, host=engine_host)
        print(f"vLLM TP{args.tp} ({ckpt.name}) up in {time.perf_counter() - t0:.1f}s at {url}",
              file=sys.stderr)
        # bound to the trainer host's address on the link: raw's receivers reach it from the engine host
        store = dist.TCPStore(trainer_host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=args.timeout))
        spec = {"model": args.model, "layers": args.layers, "tp": args.tp, "trainers": args.trainers,
                "dtype": args.dtype, "untied": args.untied, "iters": args.iters, "methods": methods,
                "buffer_mb": args.buffer_mb, "transport": args.transport, "quant": args.quant,
                "stall": args.stall,
                # the trainers build their model from the bfloat16 config (never the FP8 one)
                "url": url, "ckpt": str(work / "ckpt"), "disk_dir": str(work / "disk"),
                "store_host": trainer_host, "store_port": store.port, "dist_port": free_port(),
                "timeout": args.timeout, "trainer_host": trainer_host, "engine_host": engine_host,
                # the trainer host's end of the link: its tx counter is what crossed (None: one host)
                "link_device": hosts.devices["trainer"] if hosts else None,
                "link_gbps": args.link_gbps if hosts else None}
        roles = [("trainer", r) for r in range(args.trainers)]
        roles += [("raw", r) for r in range(args.tp)] if "raw" in methods else []
        procs = {f"{role}{r}{tag}": _spawn(role, {**spec, "rank": r,
                                                  "result": str(work / f"{role}{r}{tag}.out.json")},
                                           work, f"{role}{r}{tag}", on_engine if role == "raw" else ())
                 for role, r in roles}
        _wait(procs, work, args.timeout)
        result = json.loads((work / f"trainer0{tag}.out.json").read_text())
        raw = None
        if "raw" in methods:
            ranks = [json.loads((work / f"raw{r}{tag}.out.json").read_text()) for r in range(args.tp)]
            raw = {"ranks": ranks, "bytes": sum(r["bytes"] for r in ranks)}
        return result, raw, spec
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def bench_vllm_main(argv: list[str] | None = None) -> int:
    """Entry point of `awex-fast bench --engine vllm`."""

    args = build_parser().parse_args(argv)
    methods = _methods(args)
    if args.two_hosts:
        from awex_fast.bench.two_hosts import TwoHosts, available

        ok, why = available()
        if not ok:
            raise SystemExit(f"--two-hosts: {why}")
        if args.transport != "gloo" or args.link_gbps <= 0:
            raise SystemExit("--two-hosts needs --transport gloo (ipc stays on one host) and --link-gbps > 0")
        with TwoHosts(gbps=args.link_gbps, trainer_in_root=True) as hosts:
            return _bench(args, methods, hosts)
    return _bench(args, methods, None)


def _bench(args: argparse.Namespace, methods: list[str], hosts: TwoHosts | None) -> int:
    """Checkpoint, the server pass(es), the table; ``hosts``: the two-host harness or None."""
    from awex_fast.vllm.cpu_fp8 import ENV as FP8_FALLBACK

    own_dir = args.workdir is None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="awex_bench_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        write_checkpoint(work / "ckpt", args.model, args.layers, args.dtype, args.untied)
        ckpt = work / "ckpt"
        if args.quant == "fp8":
            write_fp8_checkpoint(work / "ckpt", work / "ckpt-fp8", args.tp)
            ckpt = work / "ckpt-fp8"
        print(f"checkpoint written in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        first = [m for m in methods if m != "bf16"]
        fallback = {FP8_FALLBACK: os.environ.get(FP8_FALLBACK, "1")} if args.quant == "fp8" else None
        result, raw, spec = _run_pass(args, work, ckpt, first, "", fallback, hosts)
        if "bf16" in methods:
            plain, _, _ = _run_pass(args, work, work / "ckpt", ["awex_fast"], "-bf16", None, hosts)
            result["times"]["bf16"] = plain["times"]["awex_fast"]
            result["checksums_equal"] = result["checksums_equal"] and plain["checksums_equal"]
        summary = summarize(result, raw, spec)
        print_table(summary)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        return 0 if summary["checksums_equal"] else 1
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
